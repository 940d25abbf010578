"""One-line FSDP2 integration: ``odc.fsdp.enable(model, optimizer)``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) re-assembles each parameter
group with an all-gather and shards its gradients with a reduce-scatter.
:func:`enable` swaps both for ODC through FSDP2's own seams
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``); no
FSDP function is patched. Ranks then synchronize once per minibatch, not per
layer, and may run different numbers of microbatches (LB-Mini), zero included.

How the protocol maps onto FSDP2 (``k`` is the minibatch, equal to the
version of the parameters it reads):

- ``enable``: every FSDP parameter group becomes one ODC bucket, registered
  collectively in FSDP's group order (numel = D · the group's padded shard
  length, dtype = its all-gather dtype). Each rank publishes version 0 of its
  shards, which are exactly FSDP's all-gather inputs.
- all-gather (forward, and backward for groups resharded after forward):
  FSDP has already copied this rank's shard into the output; ODC reads the
  D − 1 other owners' shards of version ``k``.
- reduce-scatter (post-backward): pushes each owner's rows with
  scatter-accumulate (scale 1/D for AVG, ``op.factor`` for PREMUL_SUM, the
  lost post-divide for SUM), writes zeros into the output and does not wait.
- the gradient contract (``odc._fsdp_grads``): while minibatch ``k`` runs,
  every sharded ``.grad`` is a pending gradient; the first read of its values
  (torch's ``clip_grad_norm_``, ``GradScaler.unscale_``, a norm for the logs,
  the optimizer) finishes the minibatch: ``finish_minibatch(k)`` (this rank
  waits only for its own gradient shards), the final shards installed as
  ``.grad`` (also on ranks that ran no microbatch), the accumulators zeroed.
  The optimizer's step pre-hook does the same where nothing read them.
- optimizer step post-hook: publishes version ``k + 1`` from the updated
  parameters. There is no barrier: each wait is a causal edge. A loop that
  clears the gradients of a finished minibatch without stepping (a skipped
  step) starts minibatch ``k + 1`` on the unchanged parameters.

The loop contract: read gradients (clip, unscale, log) only after the
minibatch's last backward; step once per minibatch (or skip the step and
call ``optimizer.zero_grad()``); clear gradients only between minibatches.
A loop that breaks it gets an :class:`odc.ProtocolError` naming the group
and what to call instead; optimizer-in-backward hooks (post-accumulate-grad
hooks) are refused at :func:`enable`. :func:`enable` wraps
``optimizer.zero_grad`` and ``model.zero_grad`` (on the instances) so a rank
with no microbatch still holds pending gradients; :func:`disable` restores
them.

Without an optimizer (``enable(model, None)``) the same two steps run from
:func:`minibatch`: leaving it finishes the minibatch, entering the next one
publishes the stepped parameters (or a read finishes it, and
``model.zero_grad()`` after a step made by hand publishes it at the next
forward).

Hybrid sharding (``enable(..., sharding="hybrid")``) runs on FSDP2's HSDP
layout: the model is ``fully_shard``-ed over a 2-D mesh ``(replicate, shard)``
= (nodes, ranks per node). A bucket then has G shards, one per rank of a
node; gathers and pushes stay inside the node and ``finish_minibatch`` sums
each shard over the N nodes once (the engine's cross-node reduce), so every
node's replica of the optimizer steps bitwise-identical gradients. FSDP's own
replicate all-reduce (a direct ``dist.all_reduce`` in ``foreach_reduce``,
not a seam) is switched off with ``set_requires_all_reduce(False)``; FSDP
then parks its (zero) reduce-scatter output as a pending partial instead of
assigning ``.grad``; ODC drops it when the minibatch finishes. FSDP's divide
factor under HSDP covers all D = N·G ranks (AVG on both collectives, or
PREMUL_SUM(1/f) then SUM), so pushes are scaled by 1/D, ``op.factor``, or
the post-divide computed over both groups.

Transports. CPU parameters use the engine's default (``shm`` within a node,
libfabric between nodes) unless told otherwise; CUDA parameters use
``cuda-ipc`` on one node (published shards, landing slots and accumulators
in device memory shared between the node's processes; every copy runs on the
stream FSDP made current for the comm, and the optimizer reads the
accumulators in place) and ``nvshmem`` across nodes (the same regions on
NVSHMEM's symmetric heap; full sharding only: hybrid sharding across nodes
on CUDA is refused). The ``transport=`` argument of :func:`enable`, else
``ODC_TRANSPORT``, overrides the choice; a transport that cannot carry the
parameters' tensors (``shm`` for CUDA parameters, ``cuda-ipc`` for CPU ones)
is refused before anything is registered. ``emu-ipc`` and ``emu-shmem`` run
CPU parameters through cuda-ipc's and nvshmem's device code paths (host
memory and host-thread streams).

Settings whose semantics ODC cannot keep are refused with :class:`odc.ConfigError`:
2-D meshes under ``sharding="full"``, 1-D meshes under ``sharding="hybrid"``,
shard groups that are not the ranks of one node, ``reshard_after_forward=int``,
tensor-subclass all-gather extensions, groups whose gradients are packed in
another order than their parameters (mixed gradient dtypes). A group whose
reduce-scatter input shrinks because a parameter got no gradient raises
:class:`odc.LayoutError` (use ``set_reduce_scatter_unused_params(True)``).
``set_force_sum_reduction_for_comms(True)`` and fp16 reduce dtypes are
handled: ODC applies FSDP's post-divide itself.

The comms are installed with the public ``FSDPModule.set_custom_all_gather``
/ ``set_custom_reduce_scatter`` of the module that owns each group (one call
per module; torch refuses a module whose ``fully_shard`` made several groups,
from per-parameter meshes, and so does :func:`enable`).

Private FSDP2 state is imported and checked in one module,
``odc._torch_private`` (torch versions in :data:`TORCH_VERSIONS_CHECKED`):
importing ``odc.fsdp`` never fails on another torch; :func:`enable` raises
:class:`odc.ConfigError` naming the running torch where a name it reads is
missing, and warns where all are present but the version was not checked.
Read here: ``FSDPModule._get_fsdp_state``, ``FSDPState`` (``_lazy_init``,
``_state_ctx.all_states``, ``_fsdp_param_groups``), per group the names in
``_torch_private.GROUP_STATE``, per parameter ``PARAM_STATE``, and
``_get_param_all_gather_inputs`` / ``_get_gradient_divide_factors`` from
``_fsdp_collectives``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ._fsdp_grads import GradContract, wrap_zero_grad
from ._torch_private import (
    GROUP_STATE,
    PARAM_STATE,
    TORCH_VERSIONS_CHECKED,
    AllGather,
    DDPMeshInfo,
    DefaultAllGather,
    DefaultReduceScatter,
    FSDPMeshInfo,
    HSDPMeshInfo,
    ReduceScatter,
    _get_gradient_divide_factors,
    _get_param_all_gather_inputs,
    check_fsdp2,
    check_state,
)
from .deadline import deadline_for
from .engine import CUDA_TRANSPORTS, TRANSPORTS, Bucket, Engine, _local_world_size, transport_name
from .errors import ConfigError, LayoutError, ProtocolError

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["enable", "disable", "minibatch", "finish", "clip_grad_norm_", "is_enabled", "TORCH_VERSIONS_CHECKED"]

_NORM_BUCKET = "odc-fsdp/grad-norm"
SHARDINGS = ("full", "hybrid")
_enables = itertools.count()  # one per enable() in this process; equal on every rank
_live: "weakref.WeakSet[_Binding]" = weakref.WeakSet()


@dataclass
class _Group:
    """One FSDP parameter group = one ODC bucket."""

    name: str
    pg: "FSDPParamGroup"
    module: FSDPModule  # the fully_shard-ed module that owns the group (its comm setters)
    n: int  # FSDP's padded shard length (the all-gather input numel)
    dtype: torch.dtype  # all-gather dtype
    shard_len: int = 0  # ODC's shard length (n rounded up to the engine's alignment)
    offsets: list[int] = field(default_factory=list)  # each parameter's offset in the shard
    shard: torch.Tensor | None = None  # staging buffer for publish (shard_len elements)
    index: int = 0  # position in the binding's group list (= bucket order)
    pushed_in: int = -1  # last minibatch in which this rank pushed the group's gradients


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits: D ranks in all, a bucket cut into ``shards`` shards."""

    sharding: str
    world: int  # D: every rank of the mesh (the gradient is the mean over all of them)
    rank: int  # this rank among the D, node-major
    shards: int  # shards per bucket: D (full) or G, the ranks of a node (hybrid)
    index: int  # this rank's shard
    members: tuple[int, ...]  # global ranks of the mesh, node-major


class _Binding:
    """The ODC state of one enabled model (one engine, one bucket per group).

    The minibatch protocol, in the order a loop drives it: :meth:`begin`
    (every gather and push), :meth:`finish` (a gradient read, the
    optimizer's step pre-hook, :func:`finish`), :meth:`advance` (the step
    post-hook, or the first forward after a skipped step).
    """

    def __init__(self, model: FSDPModule, groups: list[_Group], engine: Engine, layout: _Layout) -> None:
        self.model = model
        self.groups = groups
        self.engine = engine
        self.layout = layout
        self.shards = layout.shards
        self.index = layout.index
        self.hybrid = layout.sharding == "hybrid"
        self.version = 0  # parameters published; gathers of this minibatch read them
        self.open = True  # minibatch `version` is running (not finished)
        self.pushed = False  # this rank pushed gradients in the running minibatch
        self.finished_by = ""  # what finished the last minibatch (for errors)
        self.cleared = False  # gradients cleared after a finish without a step hook (a skipped or hand-made step)
        self.clipped = -1  # last minibatch whose gradients were clipped
        self.hooks: list[Any] = []  # optimizer hook handles and zero_grad undos
        self.all_reduce_was: list[bool] = []  # FSDP's HSDP all-reduce flags, restored by disable
        self.param_ids = {id(fp.sharded_param) for g in groups for fp in g.pg.fsdp_params}
        self.device = engine.device  # where the engine's tensors live (the parameters' device)
        self.grads = GradContract(self, groups)

    # -- protocol ------------------------------------------------------------
    def begin(self, what: str) -> None:
        """A gather, a push or a gradient read of the running minibatch.

        After a finished minibatch whose gradients were then cleared without
        an optimizer step hook (a skipped step, or a step the loop made by
        hand), starts the next minibatch: the current parameters are its
        version.
        """
        if self.open:
            return
        if self.cleared:
            self.advance()
            return
        raise ProtocolError(
            f"odc.fsdp: {what}, but minibatch {self.version}'s gradients are final already ({self.finished_by} "
            "finished it); read gradients only after the minibatch's last backward, step the optimizer before "
            "the next minibatch (to skip a step, call optimizer.zero_grad() instead), or, without an optimizer "
            "hook, enter odc.fsdp.minibatch"
        )

    def publish_all(self) -> None:
        for g in self.groups:
            inputs = _get_param_all_gather_inputs(g.pg.fsdp_params)
            flat = [t.reshape(-1) for ts in inputs for t in ts]
            torch.cat(flat, out=g.shard[: g.n])
            self.engine.publish(g.name, g.shard, self.version)

    def finish(self, reason: str, install: bool = True) -> None:
        """Ends the running minibatch: own gradient shards final, installed as ``.grad``."""
        if not self.open:
            return
        self.engine.finish_minibatch(self.version)
        self.open = False
        self.finished_by = reason
        if self.hybrid:
            # FSDP parked its reduce-scatter outputs (zeros) as HSDP partials
            # awaiting an all-reduce that never comes; they would stay
            # allocated, a gradient's worth per group.
            for g in self.groups:
                g.pg._partial_reduce_output = None
                g.pg._partial_reduce_output_layout.clear()
        if install:
            self.grads.install([self.engine.grad_shard(g.name) for g in self.groups])
        self.engine.zero_grad()
        self.pushed = False

    def advance(self) -> None:
        """Publishes the stepped parameters as the next version (after :meth:`finish`)."""
        if self.open:
            return
        self.version += 1
        self.publish_all()
        self.open = True
        self.cleared = False

    # -- optimizer and zero_grad hooks -----------------------------------------
    def before_step(self) -> None:
        if self.open and not self.pushed and self.grads.stepped_twice():
            raise ProtocolError(
                f"odc.fsdp: optimizer.step() again in minibatch {self.version}: every gradient is still the one "
                "the previous step used (no backward and no zero_grad since). Step once per minibatch; a rank "
                "that runs no microbatch in a minibatch must still call optimizer.zero_grad() after each step, "
                "so that ODC installs the new minibatch's gradients"
            )
        self.finish("optimizer.step()")

    def after_step(self) -> None:
        self.advance()

    def check_zero_grad(self) -> None:
        if self.open and self.pushed:
            raise ProtocolError(
                f"odc.fsdp: zero_grad() in the middle of minibatch {self.version}, after this rank had pushed "
                "gradients to their owners, which ODC cannot take back; clear gradients only between minibatches "
                "(after optimizer.step(), or before the minibatch's first backward)"
            )

    def after_zero_grad(self) -> None:
        if not self.open:
            self.cleared = True
        # Pending again, so that a rank with no microbatch in the next minibatch reads final gradients.
        self.grads.pend(self.version if self.open else self.version + 1)


class _OdcAllGather(AllGather):
    """FSDP2 all-gather seam: reads the other owners' published shards."""

    def __init__(self, binding: _Binding, group: _Group) -> None:
        self._b = binding
        self._g = group

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, async_op: bool = False):
        b, g = self._b, self._g
        b.begin(f"all-gather of {g.name}")
        if b.hybrid:
            # Re-asserted before every backward: set_requires_gradient_sync(True)
            # turns HSDP's all-reduce back on.
            g.pg.all_reduce_grads = False
        ws, n, sl = b.shards, g.n, g.shard_len
        if output_tensor.numel() != ws * n or output_tensor.dtype != g.dtype:
            raise LayoutError(
                f"odc.fsdp: all-gather of {g.name} got {output_tensor.numel()} {output_tensor.dtype} elements; "
                f"registered {ws}·{n} {g.dtype} (did the parameters change after odc.fsdp.enable?)"
            )
        if sl == n:
            b.engine.gather(g.name, b.version, output_tensor, skip_own=True)
        else:
            # ODC aligns shards to 64 bytes; FSDP packs them densely.
            tmp = torch.empty(ws, sl, dtype=g.dtype, device=output_tensor.device)
            tmp[b.index, :n].copy_(input_tensor)
            b.engine.gather(g.name, b.version, tmp.view(-1), skip_own=True)
            output_tensor.view(ws, n).copy_(tmp[:, :n])
        return None


class _OdcReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter seam: pushes the rows to their owners, does not wait."""

    def __init__(self, binding: _Binding, group: _Group) -> None:
        self._b = binding
        self._g = group

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def _scale(self, op: Any, dtype: torch.dtype) -> float:
        # The pushes are summed over every rank (every node too, under hybrid
        # sharding), so a scale divides by FSDP's whole data-parallel size.
        pg = self._g.pg
        factor = getattr(op, "factor", None)
        if factor is not None:  # PREMUL_SUM(1 / gradient_divide_factor)
            return float(factor)
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            # AVG: no divide factor (mean over all D ranks; under HSDP FSDP
            # averages over the shard group, then over the replicas), or one
            # equal to the shard group's size.
            f = pg.gradient_divide_factor
            return 1.0 / (f if f is not None else self._b.layout.world)
        if kind == dist.ReduceOp.SUM:
            # FSDP divides the *output* after a SUM (forced sum, or fp16 with a
            # pre-divide already applied to the input); our output is zeros, so
            # the post-divide moves into the push.
            replicas = pg._all_reduce_process_group if self._b.hybrid else None
            _, post, _, _ = _get_gradient_divide_factors(
                pg.mesh_info.shard_process_group, replicas, dtype, pg.device.type,
                pg.gradient_divide_factor, pg.force_sum_reduction_for_comms,
            )
            return 1.0 / post if post else 1.0
        raise ConfigError(f"odc.fsdp: reduce-scatter op {op} is not supported (AVG, SUM, PREMUL_SUM are)")

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op: bool = False):
        b, g = self._b, self._g
        b.begin(f"reduce-scatter of {g.name}")
        if b.hybrid and g.pg.all_reduce_grads:
            # FSDP's replicate all-reduce follows this call, with this flag
            # already read: it would pair up with peers' minibatch ends.
            raise ConfigError(
                f"odc.fsdp: FSDP's HSDP all-reduce was turned back on for {g.name} after its forward "
                "(set_requires_all_reduce(True) or set_requires_gradient_sync(True)); under sharding='hybrid' "
                "ODC reduces across nodes once per minibatch and keeps it off: make those calls before "
                "the forward, or after odc.fsdp.disable"
            )
        ws, n, sl = b.shards, g.n, g.shard_len
        if input_tensor.numel() != ws * n:
            raise LayoutError(
                f"odc.fsdp: reduce-scatter input of {g.name} holds {input_tensor.numel()} elements, not "
                f"{ws}·{n}: a parameter got no gradient and FSDP dropped it; call "
                "model.set_reduce_scatter_unused_params(True) before odc.fsdp.enable"
            )
        scale = self._scale(op, input_tensor.dtype)
        # .grad back to what FSDP adds onto (full sharding; it then calls our post-accumulate-grad
        # hook), or pending now (hybrid: FSDP parks its output and leaves .grad alone).
        pushed_before = g.pushed_in == b.version
        if b.hybrid:
            b.grads.pend_group(g.index, pushed_before, f"reduce-scatter of {g.name}")
        else:
            b.grads.hand_to_fsdp(g.index, pushed_before, f"reduce-scatter of {g.name}")
        if sl == n:
            b.engine.scatter_accumulate(g.name, input_tensor, scale=scale)
        else:
            tmp = torch.zeros(ws, sl, dtype=input_tensor.dtype, device=input_tensor.device)
            tmp[:, :n].copy_(input_tensor.view(ws, n))
            b.engine.scatter_accumulate(g.name, tmp.view(-1), scale=scale)
        g.pushed_in = b.version
        b.pushed = True
        output_tensor.zero_()
        return None


def _states(model: FSDPModule) -> list[Any]:
    state = model._get_fsdp_state()
    state._lazy_init()  # what the first forward does; idempotent
    if not state._is_root:
        raise ConfigError("odc.fsdp.enable: pass the root fully_shard-ed module (the one that runs forward)")
    return list(state._state_ctx.all_states)


_HSDP_MESH = (
    "init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))"
)


def _describe(model: FSDPModule, sharding: str) -> list[_Group]:
    groups: list[_Group] = []
    owners = {id(m._get_fsdp_state()): m for m in model.modules() if isinstance(m, FSDPModule)}
    for state in _states(model):
        if len(state._fsdp_param_groups) > 1:
            fqn = state._fsdp_param_groups[0]._module_fqn or "<root>"
            raise ConfigError(
                f"odc.fsdp: fully_shard({fqn}) made {len(state._fsdp_param_groups)} parameter groups "
                "(per-parameter meshes from shard_placement_fn); ODC installs its comms with "
                "FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, which take one group "
                "per module: give every parameter of a fully_shard call the same mesh"
            )
        for pg in state._fsdp_param_groups:
            check_state(pg, GROUP_STATE, "parameter group (FSDPParamGroup)")
            for fp in pg.fsdp_params:
                check_state(fp, PARAM_STATE, "parameter (FSDPParam)")
            mesh = pg.mesh_info
            name = f"fsdp{len(groups)}:{pg._module_fqn or '<root>'}"
            if sharding == "full" and (isinstance(mesh, DDPMeshInfo) or not isinstance(mesh, FSDPMeshInfo)):
                raise ConfigError(
                    f"odc.fsdp: {name} uses a 2-D (HSDP / replicated) mesh, but sharding='full' shards "
                    "over one mesh dimension; pass sharding='hybrid' to odc.fsdp.enable for a "
                    "(replicate, shard) mesh, or fully_shard over a 1-D mesh"
                )
            if sharding == "hybrid" and not isinstance(mesh, HSDPMeshInfo):
                kind = "a replicate-only" if isinstance(mesh, DDPMeshInfo) else "a 1-D"
                raise ConfigError(
                    f"odc.fsdp: sharding='hybrid' needs a model fully_shard-ed over a 2-D mesh "
                    f"(replicate, shard) = (nodes, ranks per node), but {name} uses {kind} mesh; build it "
                    f"with {_HSDP_MESH}, or use sharding='full'"
                )
            if pg.post_forward_mesh_info is not None and pg.post_forward_mesh_info is not mesh:
                raise ConfigError(
                    f"odc.fsdp: {name} uses reshard_after_forward=<int> (gathers over a sub-mesh); "
                    "use True or False with ODC"
                )
            if pg._reduce_scatter_param_indices != list(range(len(pg.fsdp_params))):
                raise ConfigError(
                    f"odc.fsdp: {name} packs its gradients in another order than its parameters "
                    "(mixed gradient dtypes); give its parameters one grad dtype"
                )
            inputs = _get_param_all_gather_inputs(pg.fsdp_params)
            dtypes = {t.dtype for ts in inputs for t in ts}
            if any(len(ts) != 1 for ts in inputs) or len(dtypes) != 1:
                raise ConfigError(
                    f"odc.fsdp: {name} uses an all-gather extension (fsdp_pre_all_gather) or mixed "
                    "all-gather dtypes, which ODC does not support"
                )
            offsets, off = [], 0
            for fp, (t,) in zip(pg.fsdp_params, inputs):
                if t.numel() != fp.padded_sharded_param_size.numel():
                    raise ConfigError(f"odc.fsdp: {name} has an all-gather input that is not its padded shard")
                offsets.append(off)
                off += t.numel()
            groups.append(
                _Group(name=name, pg=pg, module=owners[id(state)], n=off, dtype=dtypes.pop(), offsets=offsets,
                       index=len(groups))
            )
    return groups


def _node_layout(groups: list[_Group], sharding: str) -> _Layout:
    """This rank's place among the mesh's ranks; under hybrid, checks that each shard group is one node."""
    info = groups[0].pg.mesh_info
    grid = info.mesh.mesh.tolist()
    for g in groups:
        if g.pg.mesh_info.mesh.mesh.tolist() != grid:
            raise ConfigError(f"odc.fsdp: {g.name} is sharded over other ranks than {groups[0].name}")
    if sharding == "full":
        d, r = info.shard_mesh_size, info.shard_mesh_rank
        return _Layout("full", world=d, rank=r, shards=d, index=r, members=tuple(grid))
    # HSDPMeshInfo: dim 0 replicates (nodes), dim 1 shards (the ranks of a node).
    nodes, per_mesh_row = len(grid), len(grid[0])
    members = tuple(r for row in grid for r in row)
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(env) if env.isdigit() and int(env) > 0 else None
    where = f"LOCAL_WORLD_SIZE={per_node}, node-major ranks" if per_node else "by host name"

    def fix(g: int) -> str:
        return (
            f"sharding='hybrid' shards within a node: build the mesh with init_device_mesh(device, "
            f"({len(members) // g}, {g}), mesh_dim_names=('replicate', 'shard')) over node-major ranks"
        )

    if per_node is not None:
        if len(members) % per_node:
            raise ConfigError(
                f"odc.fsdp: the mesh's {len(members)} ranks are not whole nodes of {per_node} "
                "(LOCAL_WORLD_SIZE); sharding='hybrid' needs the same number of ranks on every node"
            )
        if per_mesh_row != per_node:
            raise ConfigError(
                f"odc.fsdp: the mesh's shard dimension has {per_mesh_row} ranks, but a node runs "
                f"{per_node} (LOCAL_WORLD_SIZE); {fix(per_node)}"
            )
        node_of = {r: r // per_node for r in members}
    else:
        node_of = _hosts(members)
    for row in grid:
        if len({node_of[r] for r in row}) != 1:
            raise ConfigError(
                f"odc.fsdp: the mesh's shard dimension groups ranks {row}, which are on different nodes "
                f"({where}); {fix(per_mesh_row)}"
            )
    if per_mesh_row == 1 and nodes > 1:
        raise ConfigError(
            "odc.fsdp: sharding='hybrid' with one rank per node shards nothing (FSDP skips its all-gather "
            "and reduce-scatter on a shard group of 1); use sharding='full' over a 1-D mesh"
        )
    node, index = info.replicate_mesh_rank, info.shard_mesh_rank
    return _Layout("hybrid", world=len(members), rank=node * per_mesh_row + index, shards=per_mesh_row,
                   index=index, members=members)


def _hosts(members: tuple[int, ...]) -> dict[int, str]:
    """Host name of every rank of the mesh, through the default store (each rank posts its own)."""
    store = dist.PrefixStore(f"odc-fsdp/hosts/{'-'.join(map(str, members))}/",
                             dist.distributed_c10d._get_default_store())
    me = dist.get_rank()
    store.set(str(me), socket.gethostname())
    return {r: store.get(str(r)).decode() for r in members}


def _install_comms(groups: list[_Group], comms: list[tuple[AllGather, ReduceScatter]]) -> None:
    """Installs each group's all-gather and reduce-scatter through FSDP2's public seams.

    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` set one comm on
    every group of the module they are called on; :func:`_describe` made sure
    each module owns exactly one group, so each group gets its own objects.
    """
    for g, (all_gather, reduce_scatter) in zip(groups, comms, strict=True):
        g.module.set_custom_all_gather(all_gather)
        g.module.set_custom_reduce_scatter(reduce_scatter)


def _param_device(groups: list[_Group]) -> torch.device:
    """The one device every parameter group lives on (CPU or CUDA)."""
    devices = {g.pg.device: g.name for g in groups}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ConfigError(f"odc.fsdp.enable: the parameter groups live on several devices ({where}); ODC needs one")
    (device,) = devices
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"odc.fsdp.enable: {groups[0].name} is on {device}; ODC moves CPU tensors (shm, libfabric, emu-ipc, "
            "emu-shmem) and CUDA tensors (cuda-ipc, nvshmem)"
        )
    return device


def _pick_transport(
    groups: list[_Group], requested: str | None, source: str, nodes: int | None, sharding: str = "full"
) -> str | None:
    """The transport the engine gets for these parameter groups, checked before anything is registered.

    Args:
        groups: the parameter groups (all on one device).
        requested: the ``transport=`` argument, else ``ODC_TRANSPORT``, else None.
        source: where ``requested`` came from (for messages).
        nodes: how many nodes the ranks span (None: not known yet, not checked).
        sharding: ``"full"`` or ``"hybrid"``.

    Returns:
        For CUDA parameters ``"cuda-ipc"`` on one node, ``"nvshmem"``
        across nodes (or ``requested`` when it names one of them); for CPU
        ones ``requested`` (None: the engine's default).
    """
    device = _param_device(groups)
    name = transport_name(requested)
    if name is not None and name not in TRANSPORTS:
        raise ConfigError(
            f"odc.fsdp.enable: unknown transport {requested!r} (from {source}); "
            f"expected one of {', '.join(TRANSPORTS)}"
        )
    where = f"{groups[0].name} is on {device}"
    if device.type == "cuda":
        if name not in (None, "auto", *CUDA_TRANSPORTS):
            raise ConfigError(
                f"odc.fsdp.enable: transport {requested!r} (from {source}) cannot carry CUDA tensors and {where}; "
                "CUDA parameters take 'cuda-ipc' (the default on one node) or 'nvshmem' (the default across nodes)"
            )
        if nodes is None or nodes == 1:
            return name if name in CUDA_TRANSPORTS else "cuda-ipc"
        if sharding == "hybrid":
            raise ConfigError(
                f"odc.fsdp.enable: {where}, the job spans {nodes} nodes and sharding is 'hybrid': ODC sums "
                "the replicas' gradient shards across nodes in host memory, which its GPU transports do not "
                "keep; use sharding='full' (nvshmem) or keep FSDP2's own collectives for this model"
            )
        if name == "cuda-ipc":
            raise ConfigError(
                f"odc.fsdp.enable: transport {requested!r} (from {source}) serves one node and the job spans "
                f"{nodes} nodes; use 'nvshmem' (the default for CUDA parameters across nodes)"
            )
        return "nvshmem"
    if name in CUDA_TRANSPORTS:
        raise ConfigError(
            f"odc.fsdp.enable: transport {requested!r} (from {source}) moves CUDA tensors, but {where}; "
            "use 'shm' / 'auto' for CPU parameters ('emu-ipc' / 'emu-shmem' run the GPU transports' device "
            "code paths on them)"
        )
    return requested


class _Undo:
    """A removable handle (like torch's hook handles) around an undo function."""

    def __init__(self, undo: Any) -> None:
        self.remove = undo


def _binding(model: Any) -> _Binding:
    b = getattr(model, "_odc_fsdp", None)
    if b is None:
        raise ConfigError("odc.fsdp: this model is not enabled; call odc.fsdp.enable(model, optimizer) first")
    return b


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    return getattr(model, "_odc_fsdp", None) is not None


def enable(
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    *,
    sharding: str = "full",
    chunk_bytes: int | None = None,
    timeout: float | None = None,
    transport: str | None = None,
) -> None:
    """Makes a ``fully_shard``-ed model's all-gathers and reduce-scatters ODC operations.

    Call on every rank, after ``fully_shard`` and before the first forward.
    Collective once (registration); afterwards no call waits on the slowest
    rank. Ranks may run different numbers of microbatches per minibatch.

    Hybrid sharding keeps parameters and gradients sharded within a node and
    every gather and push inside it; at the end of a minibatch each gradient
    shard is summed across the nodes once. Each node keeps a replica of the
    optimizer state for its shards, stepped on bitwise-identical gradients
    (as HSDP does). Shard the model over FSDP2's 2-D mesh::

        mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        odc.fsdp.enable(model, optimizer, sharding="hybrid")

    Ranks are node-major (node n runs ranks n·G … n·G + G − 1, as torchrun
    numbers them); ``LOCAL_WORLD_SIZE``, where set, is the node size G.
    FSDP's own cross-node all-reduce is switched off
    (``set_requires_all_reduce(False)``) until :func:`disable`.

    Args:
        model: the root module returned by ``fully_shard``: over a 1-D mesh
            (``sharding="full"``) or a 2-D ``(replicate, shard)`` mesh
            (``sharding="hybrid"``).
        optimizer: its optimizer; a step pre-hook finishes the minibatch and
            installs the gradients, a post-hook publishes the new parameters.
            ``None``: wrap each minibatch in :func:`minibatch` instead.
        sharding: ``"full"`` (shard over every rank) or ``"hybrid"`` (shard
            within a node, reduce gradients across nodes once per minibatch).
        chunk_bytes: landing-slot size (default: the engine's). Each rank
            keeps ``2 · clients · chunk_bytes`` of landing slots, clients
            being every rank (full) or the ranks of its node (hybrid).
        timeout: seconds any wait on a peer may take (default
            ``ODC_TIMEOUT_S``, else the timeout of the process group FSDP
            shards over); past it :class:`odc.PeerTimeout` names the peer,
            with a note naming the deadline and where it came from.
        transport: the engine's transport (default ``ODC_TRANSPORT``, else
            picked by device): CPU parameters get the engine's default
            (``"auto"``: shm within a node, libfabric between nodes), CUDA
            parameters ``"cuda-ipc"`` (one node) or ``"nvshmem"`` (several
            nodes). See :class:`odc.Engine`.

    Warns:
        UserWarning: the running torch is not in :data:`TORCH_VERSIONS_CHECKED`.

    Raises:
        ConfigError: the model is not ``fully_shard``-ed, already enabled,
            ``sharding`` is unknown or does not fit the mesh (a 2-D mesh under
            ``"full"``, a 1-D mesh under ``"hybrid"``, shard groups that are
            not the ranks of one node), or it uses a setting ODC cannot keep
            (see the module doc); the parameters live on several devices, on
            CUDA across several nodes with hybrid sharding, or ``transport``
            cannot carry their tensors (``shm`` for CUDA, ``cuda-ipc`` /
            ``nvshmem`` for CPU, ``cuda-ipc`` across nodes).
        RegistrationError: ranks built different models.
    """
    check_fsdp2()
    if not isinstance(model, FSDPModule):
        raise ConfigError(
            f"odc.fsdp.enable needs a module passed through torch.distributed.fsdp.fully_shard; "
            f"got {type(model).__name__}"
        )
    if is_enabled(model):
        raise ConfigError("odc.fsdp.enable: this model is already enabled")
    if sharding not in SHARDINGS:
        raise ConfigError(
            f"odc.fsdp.enable: unknown sharding {sharding!r}; use 'full' (shard over every rank, 1-D mesh) "
            "or 'hybrid' (shard within a node, 2-D (replicate, shard) mesh)"
        )
    groups = _describe(model, sharding)
    if not groups:
        raise ConfigError("odc.fsdp.enable: the model has no FSDP parameter groups")
    if transport is not None:
        requested, source = transport, "the transport argument"
    else:
        requested, source = os.environ.get("ODC_TRANSPORT") or None, "ODC_TRANSPORT"
    device = _param_device(groups)
    _pick_transport(groups, requested, source, nodes=None)
    layout = _node_layout(groups, sharding)
    if layout.world == 1:
        return  # FSDP bypasses both seams at world size 1; nothing to replace
    store = dist.PrefixStore(
        f"odc-fsdp/{next(_enables)}/{'-'.join(map(str, layout.members))}/",
        dist.distributed_c10d._get_default_store(),
    )
    # Ranks per node: the shard group under hybrid sharding; under full
    # sharding only CUDA parameters need it now (cuda-ipc or nvshmem).
    local = layout.shards if layout.sharding == "hybrid" else None
    if local is None and device.type == "cuda":
        local = _local_world_size(store, layout.rank, layout.world, "odc")
    nodes = layout.world // local if local else None
    chosen = _pick_transport(groups, requested, source, nodes, layout.sharding)
    # ODC waits as long as FSDP's process group would (its timeout), unless ODC_TIMEOUT_S or timeout= says.
    seconds, deadline_source = deadline_for(groups[0].pg.mesh_info.shard_process_group, explicit=timeout)
    kw: dict[str, Any] = {"chunk_bytes": chunk_bytes, "timeout": seconds, "deadline_source": deadline_source,
                          "transport": chosen}
    if device.type == "cuda":
        kw["device"] = device.index if device.index is not None else torch.cuda.current_device()
    if layout.sharding == "hybrid":
        engine = Engine(store, layout.rank, layout.world, local_world_size=layout.shards, sharding="hybrid", **kw)
    else:
        engine = Engine(store, layout.rank, layout.world, local_world_size=local, **kw)
    ws = layout.shards
    engine.register([Bucket(g.name, ws * g.n, g.dtype) for g in groups] + [Bucket(_NORM_BUCKET, ws, torch.float32)])
    for g in groups:
        g.shard_len = engine.bucket(g.name)["shard_len"]
        g.shard = torch.zeros(g.shard_len, dtype=g.dtype, device=device)
    b = _Binding(model, groups, engine, layout)
    b.publish_all()  # version 0
    if b.hybrid:
        b.all_reduce_was = [g.pg.all_reduce_grads for g in groups]
        model.set_requires_all_reduce(False)  # the engine reduces across nodes
    _install_comms(groups, [(_OdcAllGather(b, g), _OdcReduceScatter(b, g)) for g in groups])
    b.grads.refuse_foreign_hooks()
    b.grads.ensure_hooked(b.grads.params)
    b.grads.pend(0)  # a rank with no microbatch in minibatch 0 reads final gradients too
    if optimizer is not None:
        b.hooks.append(optimizer.register_step_pre_hook(lambda *_: b.before_step()))
        b.hooks.append(optimizer.register_step_post_hook(lambda *_: b.after_step()))
        b.hooks.append(_Undo(wrap_zero_grad(optimizer, b.after_zero_grad, b.check_zero_grad)))
    b.hooks.append(_Undo(wrap_zero_grad(model, b.after_zero_grad, b.check_zero_grad)))
    model.__dict__["_odc_fsdp"] = b
    _live.add(b)


def disable(model: Any) -> None:
    """Restores FSDP2's default collectives. Call on every rank, after an optimizer step.

    Raises:
        ProtocolError: this rank pushed gradients that no optimizer step consumed.
    """
    b = _binding(model)
    if b.open and b.pushed:
        raise ProtocolError(
            f"odc.fsdp.disable: gradients of minibatch {b.version} are pending; step the optimizer first"
        )
    # A teardown fence: once every peer finished, nobody reads this rank's shards.
    b.finish("odc.fsdp.disable", install=False)
    b.grads.release()
    for h in b.hooks:
        h.remove()
    _install_comms(b.groups, [(DefaultAllGather(), DefaultReduceScatter()) for _ in b.groups])
    if b.hybrid:
        for g, was in zip(b.groups, b.all_reduce_was, strict=True):
            g.pg.all_reduce_grads = was
    del model.__dict__["_odc_fsdp"]
    _live.discard(b)
    b.engine = None  # type: ignore[assignment]  # drops the engine (unmaps, joins the daemon)


@contextlib.contextmanager
def minibatch(model: Any) -> Iterator[None]:
    """One minibatch with explicit boundaries instead of optimizer hooks.

    Entering publishes the parameters stepped since the previous minibatch;
    leaving finishes the minibatch and installs the gradients as ``.grad``.
    Step the optimizer after the block::

        with odc.fsdp.minibatch(model):
            for mb in microbatches:       # any number per rank, zero included
                model(mb).sum().backward()
        optimizer.step(); optimizer.zero_grad()
    """
    b = _binding(model)
    b.advance()
    yield
    b.finish("leaving odc.fsdp.minibatch")


def finish(model: Any) -> None:
    """Finishes the running minibatch now: ``.grad`` holds the reduced gradients.

    The optimizer pre-hook does this too; call it to read gradients before
    ``optimizer.step()``.
    """
    _binding(model).finish("odc.fsdp.finish")


def _binding_of(model_or_params: Any) -> tuple[_Binding, list[torch.Tensor]]:
    if isinstance(model_or_params, torch.nn.Module):
        b = _binding(model_or_params)
        params = [p for p in model_or_params.parameters() if id(p) in b.param_ids]
        return b, params
    params = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
    for b in list(_live):
        if params and all(id(p) in b.param_ids for p in params):
            return b, params
    raise ConfigError("odc.fsdp.clip_grad_norm_: these parameters do not belong to one odc.fsdp-enabled model")


def clip_grad_norm_(model_or_params: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clips gradients by their global norm, like ``torch.nn.utils.clip_grad_norm_``, without a collective.

    Finishes the running minibatch first (so call it where you would call
    torch's, before ``optimizer.step()``). Each rank reduces its own gradient
    shards to one number (sum of ``|g|^p``, or the max for ``inf``) and
    publishes it, split into two float32 words for double precision, in a
    small registered bucket; every rank gathers the D numbers (under hybrid
    sharding the G numbers of its node, whose shards make up the whole,
    identical on every node) and combines them in rank order, so all ranks
    compute the identical norm. The bucket's
    version is the minibatch number + 1, so it may be called once per
    minibatch, on every rank.

    Returns:
        The total norm (a float64 scalar tensor), as torch's does.
    """
    b, params = _binding_of(model_or_params)
    b.finish("odc.fsdp.clip_grad_norm_")
    if b.clipped == b.version:
        raise ProtocolError(f"odc.fsdp.clip_grad_norm_: already called in minibatch {b.version}")
    b.clipped = b.version
    norm_type = float(norm_type)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    local = 0.0
    for g in grads:
        g = g.detach().double()
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            local = max(local, g.abs().max().item())
        else:
            local += g.abs().pow(norm_type).sum().item()
    info = b.engine.bucket(_NORM_BUCKET)
    sl = info["shard_len"]
    hi = torch.tensor(local, dtype=torch.float32)
    words = torch.zeros(sl, dtype=torch.float32)
    words[0], words[1] = hi, torch.tensor(local - hi.double().item(), dtype=torch.float32)
    shard = words.to(b.device)  # the engine's device (cuda-ipc: the parameters' GPU)
    version = b.version + 1  # above every version the done words of minibatches <= k imply
    b.engine.publish(_NORM_BUCKET, shard, version)
    everyone = torch.empty(info["padded_len"], dtype=torch.float32, device=b.device)
    b.engine.gather(_NORM_BUCKET, version, everyone)
    b.engine.release(_NORM_BUCKET, version)
    parts = everyone.view(b.shards, sl)[:, :2].double().sum(dim=1).tolist()
    total = max(parts) if math.isinf(norm_type) else sum(parts) ** (1.0 / norm_type)
    coef = float(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return torch.tensor(total, dtype=torch.float64)
