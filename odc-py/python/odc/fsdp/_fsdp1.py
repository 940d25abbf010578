"""FSDP1 (``FullyShardedDataParallel``) on ODC: what ``odc.fsdp.enable`` installs on an FSDP1 model.

FSDP1 keeps the parameters of each wrapped module in one ``FlatParameter``,
flattened, padded and cut into D equal shards (shard r on rank r), so one
FlatParameter is one ODC bucket (D · its padded shard, in its all-gather
dtype) and the minibatch protocol, the gradient contract and the optimizer
hooks are odc.fsdp's own (:mod:`._state`, :mod:`._grads`). Two FSDP1
operations become ODC ones:

- the all-gather: ``FlatParamHandle._all_gather_flat_param``, FSDP1's one
  call that all-gathers a FlatParameter (forward, backward, prefetches), is
  replaced on each handle instance: this rank's shard is copied in, the
  D − 1 others read from their owners' published copies of minibatch k.
  An unshard for ``summon_full_params`` or a state dict (save or load) is
  FSDP1's own all-gather: FSDP1 makes every rank call those at the same
  point, and a checkpoint loaded between minibatches is then what the next
  minibatch's first operation publishes to the peers.
- the reduce-scatter: through FSDP1's public ``register_comm_hook`` (on the
  root; one state object per FSDP instance, written to its
  ``_comm_hook_state``), each post-backward pushes the padded unsharded
  gradient's rows to their owners, scaled by 1/D (FSDP1 applies neither its
  pre- nor its post-divide around a comm hook), and writes zeros into the
  sharded output, which FSDP1 then accumulates as usual.

The gradient contract: a FlatParameter's ``.grad`` is a plain
:class:`~._grads.PendingGrad` while the minibatch runs (FSDP1's gradients
are plain tensors). FSDP1 moves a sharded ``.grad`` aside before each
backward (``_saved_grad_shard``, to accumulate onto); the push puts the
real tensor the pending gradient stands for back there, and a callback
queued behind FSDP1's own end-of-backward callback makes ``.grad`` pending
again once FSDP1 has assigned it.

Under ``use_orig_params=True`` the optimizer holds the original parameters,
whose sharded ``.data`` and ``.grad`` FSDP1 keeps as 1-D views into the
FlatParameter and its gradient. There each original parameter with a part
in this rank's shard carries the pending gradient of that part (its
offset in the bucket shard); the FlatParameter's ``.grad`` stays None, and
three handle methods are replaced on each instance: ``_use_sharded_grad_views``
(after every reshard and reduce-scatter FSDP1 would point the parameters'
``.grad`` at its own, zero, gradient) leaves ODC's gradients in place;
``_use_unsharded_grad_views`` (after a ``no_sync()`` backward) takes the
pending gradients off first, since FSDP1 repoints an existing ``.grad``
with ``.grad.data = view``; and ``_writeback_orig_params`` (every
pre-unshard, where FSDP1 compares each ``.grad`` with its gradient's
storage, a read a pending gradient cannot answer without finishing the
minibatch) runs with the pending gradients out of its sight.

Hybrid strategies (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``: shard within a
node, replicate across nodes) run under ``sharding="hybrid"``, on the
engine's hybrid sharding: gathers and pushes stay in the node and each
gradient shard is summed across the nodes once per minibatch. FSDP1's
``register_comm_hook`` refuses hybrid strategies (its own hooks would skip
the inter-node all-reduce), so there the hook is set on each instance as
``register_comm_hook`` sets it; the shard group must be one node's ranks,
node-major (``LOCAL_WORLD_SIZE``, else host names).

Supported: ``ShardingStrategy.FULL_SHARD`` and ``SHARD_GRAD_OP`` under
``sharding="full"``, ``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` under
``sharding="hybrid"``, ``use_orig_params`` False (verl's default) or True,
mixed precision, every FSDP instance over the same process group. Refused
with a :class:`odc.ConfigError`: ``NO_SHARD``, ``sharding="hybrid-zero"``,
CPU offload, ``keep_low_precision_grads``. Every private FSDP1 name used
here is listed in :data:`PRIVATE_FSDP1` with the releases it was checked on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import ConfigError, LayoutError
from ._binding import _Binding, _Undo
from ._grads import _local, _Param, _pending_cell
from ._private import _ALL, PrivateName, _Group, _hosts, _Layout, _where
from ._seams import gather_rows, push_rows

#: The torch releases whose FSDP1 sources :data:`PRIVATE_FSDP1` was checked against (the two legs of make test;
#: FSDP1 is in maintenance upstream, and none of these names changed between them).
FSDP1_VERSIONS_CHECKED = ("2.11.0", "2.15.0")
#: Private FSDP1 names this module reads or writes (owner, name, first, last supported release, use).
PRIVATE_FSDP1: tuple[PrivateName, ...] = (
    PrivateName("FullyShardedDataParallel", "_handle", *_ALL, "the instance's FlatParamHandle (None: no params)"),
    PrivateName("FullyShardedDataParallel", "_comm_hook", *_ALL,
                "written: set under hybrid strategies (register_comm_hook refuses them), cleared by disable"),
    PrivateName("FullyShardedDataParallel", "_inter_node_pg", *_ALL, "hybrid strategies: the replicate group"),
    PrivateName("FullyShardedDataParallel", "_comm_hook_state", *_ALL,
                "written: each instance's own state object, so the hook knows whose gradient it pushes"),
    PrivateName("FlatParamHandle", "_all_gather_flat_param", *_ALL,
                "replaced on each handle instance by ODC's gather (restored by disable)"),
    PrivateName("FlatParamHandle", "_training_state", *_ALL,
                "SUMMON_FULL_PARAMS (state dicts, summon_full_params): FSDP1's own all-gather serves the unshard"),
    PrivateName("_common_utils", "HandleTrainingState", *_ALL, "its SUMMON_FULL_PARAMS member"),
    PrivateName("FlatParamHandle", "_writeback_orig_params", *_ALL,
                "use_orig_params=True: wrapped on each handle instance, the gradients out of its sight"),
    PrivateName("FlatParamHandle", "_use_sharded_grad_views", *_ALL,
                "use_orig_params=True: replaced on each handle instance, ODC's gradients stay on the parameters"),
    PrivateName("FlatParamHandle", "_use_unsharded_grad_views", *_ALL,
                "use_orig_params=True: wrapped on each handle instance, the pending gradients taken off first"),
    PrivateName("FlatParamHandle", "is_sharded", *_ALL, "whether the FlatParameter is sharded now"),
    PrivateName("FlatParameter", "_params", *_ALL, "use_orig_params=True: the original parameters"),
    PrivateName("FlatParameter", "_shard_param_infos", *_ALL, "use_orig_params=True: each one's part of the shard"),
    PrivateName("FlatParameter", "_fqns", *_ALL, "use_orig_params=True: their names"),
    PrivateName("FlatParameter", "_shared_params", *_ALL, "use_orig_params=True: tied parameters' gradients"),
    PrivateName("FlatParameter", "_shared_param_infos", *_ALL, "use_orig_params=True: where they are tied"),
    PrivateName("FlatParamHandle", "_fwd_bwd_param_dtype", *_ALL, "the all-gather dtype (mixed precision)"),
    PrivateName("FlatParamHandle", "_use_orig_params", *_ALL, "which parameters carry the gradients"),
    PrivateName("FlatParamHandle", "_offload_params", *_ALL, "CPU offload is refused"),
    PrivateName("FlatParamHandle", "_keep_low_precision_grads", *_ALL, "keep_low_precision_grads is refused"),
    PrivateName("FlatParamHandle", "device", *_ALL, "the compute device (the transport's choice)"),
    PrivateName("FlatParameter", "_local_shard", *_ALL, "this rank's shard (full precision): published"),
    PrivateName("FlatParameter", "_saved_grad_shard", *_ALL,
                "written: the sharded gradient FSDP1 accumulates onto, the pending gradient's real base"),
    PrivateName("Variable._execution_engine", "queue_callback", *_ALL,
                "the end-of-backward callback that makes .grad pending again (as FSDP1 queues its own)"),
    PrivateName("FlatParamHandle", "needs_unshard", *_ALL,
                "leaving odc.fsdp.evaluation: whether a forward kept the unsharded FlatParameter allocated"),
    PrivateName("FlatParamHandle", "uses_sharded_strategy", *_ALL, "leaving odc.fsdp.evaluation: as above"),
    PrivateName("_runtime_utils", "_reshard", *_ALL,
                "leaving odc.fsdp.evaluation: FSDP1's own reshard of a handle its forward left unsharded"),
)

#: Names FSDP1 sets only on some objects (around a backward, under hybrid strategies): not checked up front.
_WHERE_USED = ("_saved_grad_shard", "_inter_node_pg")
#: The handle methods replaced on each instance (the last three under use_orig_params=True only).
_REPLACED = ("_all_gather_flat_param", "_writeback_orig_params", "_use_sharded_grad_views",
             "_use_unsharded_grad_views")
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` is an FSDP1 ``FullyShardedDataParallel`` module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


class _FlatParam:
    """A FlatParameter, with the attributes odc.fsdp reads of an FSDP2 ``FSDPParam``."""

    def __init__(self, handle: Any, fqn: str) -> None:
        self.handle = handle
        self._param_fqn = fqn
        self.sharded_size = handle.flat_param._local_shard.size()  # the padded shard
        self.sharded_grad_dtype = handle.flat_param._local_shard.dtype  # FSDP1 casts gradients to it

    @property
    def sharded_param(self) -> Any:
        return self.handle.flat_param

    @staticmethod
    def to_sharded_dtensor(t: torch.Tensor) -> torch.Tensor:
        return t  # FSDP1's gradients are plain tensors


class _OrigParam:
    """Under ``use_orig_params=True``: an original parameter with a part in this rank's shard (its sharded
    ``.data`` and ``.grad`` are 1-D, ``numel_in_shard`` long), as odc.fsdp reads an FSDP2 ``FSDPParam``."""

    def __init__(self, handle: Any, index: int, fqn: str) -> None:
        self.handle = handle
        self.index = index
        self._param_fqn = fqn
        info = handle.flat_param._shard_param_infos[index]
        self.offset = int(info.offset_in_shard)
        self.sharded_size = torch.Size([int(info.numel_in_shard)])
        self.sharded_grad_dtype = handle.flat_param._local_shard.dtype

    @property
    def sharded_param(self) -> Any:
        return self.handle.flat_param._params[self.index]

    @staticmethod
    def to_sharded_dtensor(t: torch.Tensor) -> torch.Tensor:
        return t


class _FlatParamGroup:
    """One FSDP1 handle, with the attributes odc.fsdp reads of an FSDP2 ``FSDPParamGroup``: its FlatParameter,
    or under ``use_orig_params=True`` the original parameters with a part in this rank's shard."""

    def __init__(self, handle: Any, fqn: str) -> None:
        self.device = handle.device
        self._module_fqn = fqn
        self.fsdp_params: list[Any] = [_FlatParam(handle, fqn)]
        if handle._use_orig_params:
            fp = handle.flat_param
            prefix = "" if fqn == "<root>" else fqn + "."
            self.fsdp_params = [_OrigParam(handle, i, prefix + name) for i, (info, name)
                                in enumerate(zip(fp._shard_param_infos, fp._fqns, strict=True)) if info.in_shard]

    @property
    def offsets(self) -> list[int]:
        return [getattr(fp, "offset", 0) for fp in self.fsdp_params]


@dataclass
class _FlatGroup(_Group):
    """One FlatParameter = one ODC bucket."""

    handle: Any = None

    def gather_inputs(self) -> list[torch.Tensor]:
        # The full-precision shard, cast as FSDP1 casts it before its all-gather (mixed precision).
        return [self.handle.flat_param._local_shard.to(self.dtype)]

    def drop_parked(self) -> None:
        pass  # FSDP1 parks nothing: under a comm hook it runs no all-reduce of its own


def _check_private(instances: list[Any], owners: tuple[str, ...]) -> None:
    for inst in instances:
        handle = getattr(inst, "_handle", None)
        objs = {"FullyShardedDataParallel": inst, "FlatParamHandle": handle,
                "FlatParameter": None if handle is None else handle.flat_param}
        for n in PRIVATE_FSDP1:
            obj = objs.get(n.owner) if n.owner in owners else None
            if obj is None:
                continue
            if n.name in _WHERE_USED:  # looked up where they are used
                continue
            if not hasattr(obj, n.name):
                raise ConfigError(
                    f"odc.fsdp cannot run FSDP1 on {_where()}: its {n.owner} has no {n.name!r} (private state "
                    "odc.fsdp reads); install one of the checked versions or keep FSDP1's own collectives"
                )


def describe(model: Any, sharding: str) -> tuple[list[_Group], _Layout, Any]:
    """The FSDP1 model's buckets (one per FlatParameter, in FSDP1's traversal order), this rank's layout
    and the process group; refuses what ODC cannot keep (see the module doc)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    instances = FullyShardedDataParallel.fsdp_modules(model)
    _check_private(instances, ("FullyShardedDataParallel", "FlatParamHandle"))
    for inst in instances:  # before the lazy init, which CPU offload cannot run without a GPU
        h = inst._handle
        where = f"a FullyShardedDataParallel module ({type(inst.module).__name__})"
        if h is not None and h._offload_params:
            raise ConfigError(f"odc.fsdp.enable: {where} offloads parameters to CPU (CPUOffload), which ODC does "
                              "not serve on FSDP1; drop the offload or use FSDP2")
        if h is not None and h._keep_low_precision_grads:
            raise ConfigError(f"odc.fsdp.enable: {where} keeps low-precision gradients "
                              "(MixedPrecision(keep_low_precision_grads=True)), which ODC does not serve on FSDP1")
    if not model.check_is_root():  # public; runs FSDP1's lazy init (the first forward's), idempotent
        raise ConfigError("odc.fsdp.enable: pass the root FullyShardedDataParallel module (the one that runs forward)")
    _check_private(instances, ("FlatParameter",))  # attributes FSDP1's lazy init sets
    process_group = model.process_group
    world = dist.get_world_size(process_group)
    shard_ranks = tuple(dist.get_process_group_ranks(process_group))
    rank = dist.get_rank(process_group)
    layout = _Layout("full", world=world, rank=rank, shards=world, index=rank, members=shard_ranks)
    if world == 1 and dist.get_world_size() > 1:
        raise ConfigError(
            f"odc.fsdp.enable: the FSDP1 model shards over a process group of one rank out of "
            f"{dist.get_world_size()} (a hybrid strategy with one rank per node, which FSDP1 turns into "
            "NO_SHARD): there is nothing to gather; shard over every rank (ShardingStrategy.FULL_SHARD)"
        )
    if world == 1:  # FSDP1 runs NO_SHARD on one rank; the caller makes it a solo model
        return [], layout, process_group
    if sharding == "hybrid-zero":
        raise ConfigError(
            "odc.fsdp.enable: sharding='hybrid-zero' on an FSDP1 (FullyShardedDataParallel) model; ODC runs FSDP1 "
            "under sharding='full' (ShardingStrategy.FULL_SHARD or SHARD_GRAD_OP) or 'hybrid' (HYBRID_SHARD or "
            "_HYBRID_SHARD_ZERO2); for hybrid-zero use FSDP2 (fully_shard over a 1-D mesh)"
        )
    strategies = _HYBRID if sharding == "hybrid" else _STRATEGIES
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")
             for n, m in model.named_modules()}
    groups: list[_Group] = []
    for inst in instances:
        h = inst._handle
        fqn = names.get(id(inst)) or "<root>"
        where = f"FullyShardedDataParallel({fqn})"
        if h is None:
            continue
        strategy = inst.sharding_strategy
        if strategy.name not in strategies:
            if strategy.name in _HYBRID:
                fix = "pass odc.fsdp.enable(..., sharding='hybrid') for FSDP1's hybrid strategies"
            elif strategy.name in _STRATEGIES:
                fix = "pass sharding='full' for FULL_SHARD and SHARD_GRAD_OP (sharding='hybrid' serves HYBRID_SHARD)"
            else:
                fix = (f"it shards nothing, so there is nothing to gather; use {' or '.join(_STRATEGIES)} or "
                       f"{' or '.join(_HYBRID)}")
            raise ConfigError(
                f"odc.fsdp.enable: {where} uses ShardingStrategy.{strategy.name} and sharding={sharding!r}: {fix}"
            )
        if tuple(dist.get_process_group_ranks(inst.process_group)) != shard_ranks:
            raise ConfigError(f"odc.fsdp.enable: {where} shards over other ranks than the root ({shard_ranks})")
        fp = h.flat_param
        n = fp._local_shard.numel()
        name = f"fsdp1-{len(groups)}:{fqn}"
        dtype = cast(torch.dtype, h._fwd_bwd_param_dtype)
        pg = _FlatParamGroup(h, fqn)
        groups.append(_FlatGroup(name=name, pg=cast(Any, pg), module=cast(Any, inst), n=n, dtype=dtype,
                                 offsets=pg.offsets, index=len(groups), handle=h))
    if sharding == "hybrid":  # every instance runs a hybrid strategy (checked above)
        layout = _hybrid_layout(instances[0], process_group)
    return groups, layout, process_group


def _hybrid_layout(root: Any, shard_group: Any) -> _Layout:
    """FSDP1's hybrid strategies: the shard group must be the ranks of one node, node-major, the replicate
    group (``_inter_node_pg``) one rank of each node."""
    shard_ranks = list(dist.get_process_group_ranks(shard_group))
    replicas = getattr(root, "_inter_node_pg", None)
    if replicas is None:
        raise ConfigError(f"odc.fsdp cannot run FSDP1 on {_where()}: its hybrid state has no '_inter_node_pg'")
    nodes, g = dist.get_world_size(replicas), len(shard_ranks)
    node, index = dist.get_rank(replicas), dist.get_rank(shard_group)
    world = nodes * g
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(env) if env.isdigit() and int(env) > 0 else None
    fix = (f"build FSDP1 with device_mesh=init_device_mesh(device, ({nodes}, {g}), mesh_dim_names=('replicate', "
           "'shard')) over node-major ranks")
    if shard_ranks != list(range(node * g, node * g + g)) or dist.get_world_size() != world:
        raise ConfigError(f"odc.fsdp.enable: FSDP1's shard group is ranks {shard_ranks}, not one node's "
                          f"node-major ranks of {world}; {fix}")
    if per_node is not None and per_node != g:
        raise ConfigError(f"odc.fsdp.enable: FSDP1's shard group has {g} ranks, but a node runs {per_node} "
                          f"(LOCAL_WORLD_SIZE); {fix}")
    if per_node is None:
        hosts = _hosts(tuple(range(world)))
        if len({hosts[r] for r in shard_ranks}) != 1:
            raise ConfigError(f"odc.fsdp.enable: FSDP1's shard group (ranks {shard_ranks}) spans several hosts; "
                              f"{fix}")
    return _Layout("hybrid", world=world, rank=node * g + index, shards=g, index=index, members=tuple(range(world)))


@dataclass(eq=False)
class _Backward:
    """What the pushes of one backward leave for the callback that runs after FSDP1's end-of-backward."""

    binding: _Binding
    queued: bool = False
    pushed: list[_Param] = field(default_factory=list)  # records pushed in this backward (FlatParameter grads)
    pushed_groups: set[int] = field(default_factory=set)  # groups pushed in this backward


class _FlatComms:
    """One FSDP1 instance's ODC comms: its handle's gather and its comm hook's state."""

    def __init__(self, binding: _Binding, group: _FlatGroup, backward: _Backward) -> None:
        self.b = binding
        self.g = group
        self.backward = backward

    def gather(self, padded_unsharded_flat_param: torch.Tensor) -> torch.Tensor:
        """``FlatParamHandle._all_gather_flat_param``: every owner's shard of this minibatch, rank order."""
        b, g = self.b, self.g
        out = padded_unsharded_flat_param
        if g.handle._training_state == _summoning():
            # summon_full_params, state_dict(), load_state_dict(): collectives FSDP1 makes every rank call at the
            # same point, outside any minibatch's compute; FSDP1's own all-gather serves them, so a load between
            # minibatches is what the next minibatch's first operation publishes.
            return cast(torch.Tensor, type(g.handle)._all_gather_flat_param(g.handle, out))
        b.state.begin(f"all-gather of {g.name}")
        b.state.check_unchanged(g)
        own = g.handle.flat_param.data  # this rank's shard in the all-gather dtype (FSDP1's pre-unshard cast it)
        if out.numel() != b.state.shards * g.n or own.numel() != g.n or out.dtype != g.dtype:
            raise LayoutError(
                f"odc.fsdp: all-gather of {g.name} got {out.numel()} {out.dtype} elements from a shard of "
                f"{own.numel()}; registered {b.state.shards}·{g.n} {g.dtype} (did the parameters change after enable?)"
            )
        if g.shard_len == g.n:
            out.view(b.state.shards, g.n)[b.state.index].copy_(own)
            b.engine.gather(g.name, b.state.version, out, skip_own=True)
        else:
            out.view(b.state.shards, g.n).copy_(gather_rows(b, g, own))
        return out

    def push(self, padded_unsharded_grad: torch.Tensor, new_sharded_grad: torch.Tensor) -> None:
        """The comm hook: pushes each owner's rows (scale 1/D), leaves zeros for FSDP1 to accumulate."""
        b, g = self.b, self.g
        what = f"reduce-scatter of {g.name}"
        b.state.begin(what)
        ws, n = b.state.shards, g.n
        if padded_unsharded_grad.numel() != ws * n:
            raise LayoutError(f"odc.fsdp: {what}: the gradient holds {padded_unsharded_grad.numel()} elements, "
                              f"not {ws}·{n}")
        if not g.handle._use_orig_params:
            self._hand_back_base(what)
        self.backward.pushed_groups.add(g.index)
        # FSDP1's mean over the ranks (it divides only on its default path, not around a comm hook).
        push_rows(b, g, padded_unsharded_grad, 1.0 / b.state.layout.world)
        new_sharded_grad.zero_()
        bw = self.backward
        if not bw.queued:
            # Runs after FSDP1's own end-of-backward callback (queued at the root's pre-backward).
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _after_backward(bw))
            bw.queued = True

    def _hand_back_base(self, what: str) -> None:
        """FSDP1 moved ``.grad`` to ``_saved_grad_shard`` to accumulate onto: the real tensor, not the pending one."""
        b, g = self.b, self.g
        fp = g.handle.flat_param
        for rec in b.grads.by_group[g.index]:
            saved = getattr(fp, "_saved_grad_shard", None)
            b.grads._check_not_cleared(rec, saved, g.pushed_in == b.state.version, what)
            base = _local(saved)
            if _pending_cell(saved) is not None:
                if base is None:
                    del fp._saved_grad_shard
                else:
                    fp._saved_grad_shard = base
            rec.restored = base
            self.backward.pushed.append(rec)


    # -- use_orig_params=True: FSDP1 derives the original parameters' .grad from the FlatParameter's ---------
    def writeback_orig_params(self) -> bool:
        """``FlatParamHandle._writeback_orig_params`` (every pre-unshard) with the pending gradients out of its sight.

        FSDP1 compares each original parameter's ``.grad`` with the FlatParameter's gradient storage there
        (a read a pending gradient cannot answer without finishing the minibatch); ODC keeps those gradients
        itself (the FlatParameter's ``.grad`` stays None), so only the parameters are checked.
        """
        h = self.g.handle
        fp = h.flat_param
        if not h.is_sharded(fp):
            return cast(bool, type(h)._writeback_orig_params(h))  # returns before reading any gradient
        # Only the pending ones: real gradients are FSDP1's to check (its unsharded views after a no_sync()
        # backward, with the accumulation in the FlatParameter's .grad).
        held = [(p, p.grad) for p in fp._params if _pending_cell(p.grad) is not None]
        for p, _ in held:
            p.grad = None
        try:
            return cast(bool, type(h)._writeback_orig_params(h))
        finally:
            for p, grad in held:
                if p.grad is None:
                    p.grad = grad

    def use_unsharded_grad_views(self) -> None:
        """``FlatParamHandle._use_unsharded_grad_views`` (after a ``no_sync()`` backward, and in
        ``summon_full_params(with_grads=True)``) with the pending gradients taken off the parameters first:
        FSDP1 repoints an existing ``.grad`` with ``.grad.data = view``, which would rewrite the pending
        tensor itself. They come back at FSDP1's next ``_use_sharded_grad_views`` (:meth:`use_sharded_grad_views`)."""
        h = self.g.handle
        for p in h.flat_param._params:
            if _pending_cell(p.grad) is not None:
                p.grad = None
        type(h)._use_unsharded_grad_views(h)

    def use_sharded_grad_views(self) -> None:
        """``FlatParamHandle._use_sharded_grad_views``: the gradients the contract holds, not views of FSDP1's.

        FSDP1 calls it after each reshard and each reduce-scatter to point the original parameters' ``.grad``
        at its sharded FlatParameter gradient (zeros under ODC); ODC's pending (or, once the minibatch
        finished, final) gradients stay instead.
        """
        b, g = self.b, self.g
        fp = g.handle.flat_param
        recs = {rec.fp.index: rec for rec in b.grads.by_group[g.index]}
        for i, param in enumerate(fp._params):
            rec = recs.get(i)
            if rec is None:  # no part in this rank's shard, or frozen: no gradient here, as FSDP1 has it
                param.grad = None
            elif rec.cell is not None and rec.cell.real is None and rec.pending is not None:
                param.grad = rec.pending
            elif rec.cell is not None:
                param.grad = rec.installed
        for param, info in zip(fp._shared_params, fp._shared_param_infos, strict=True):
            prim_name, prim_module = info[3], info[4]
            prim = getattr(prim_module, prim_name, None)
            param.grad = prim.grad if prim is not None and param.requires_grad else None


def reshard(model: Any) -> None:
    """Frees every unsharded FlatParameter a forward kept (the root's, and every one under ``SHARD_GRAD_OP``)
    with FSDP1's own reshard, as its post-forward does for the others: the next forward gathers."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._runtime_utils import _reshard

    for inst in FullyShardedDataParallel.fsdp_modules(model):
        h = inst._handle
        # After a forward FSDP1 points the root's FlatParameter (and every one under SHARD_GRAD_OP) back at its
        # shard but keeps the unsharded storage, and the next forward computes with that instead of gathering.
        if h is not None and h.uses_sharded_strategy and not h.needs_unshard():
            _reshard(inst, h, True)


def _summoning() -> Any:
    from torch.distributed.fsdp._common_utils import HandleTrainingState

    return HandleTrainingState.SUMMON_FULL_PARAMS


def _after_backward(bw: _Backward) -> None:
    """FSDP1 assigned ``.grad`` (the base plus its zeros): every sharded ``.grad`` pending again."""
    b = bw.binding
    for gi in bw.pushed_groups:
        g = b.groups[gi]
        if isinstance(g, _FlatGroup) and g.handle._use_orig_params:
            g.handle.flat_param.grad = None  # FSDP1's zeros; the original parameters' gradients are ODC's
    pushed = {id(rec) for rec in bw.pushed}
    for rec in b.grads.params:
        g = rec.param.grad
        cell = _pending_cell(g)
        if cell is not None and cell.version == b.state.version and cell.real is None:
            continue
        if id(rec) in pushed:
            base = rec.restored if rec.restored is not None and _local(g) is rec.restored else None
        else:
            base = _local(g)
        rec.restored = None
        b.grads._pend(rec, b.state.version, base)
    bw.pushed.clear()
    bw.pushed_groups.clear()
    bw.queued = False


def install(b: _Binding, model: Any, groups: list[_Group]) -> None:
    """The pipeline's last step for an FSDP1 model: ODC's gather on each handle and its push as FSDP1's comm
    hook; the undo joins the binding's hooks (``odc.fsdp.disable`` restores FSDP1's own)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    backward = _Backward(b)
    comms = [_FlatComms(b, g, backward) for g in groups if isinstance(g, _FlatGroup)]
    if b.state.hybrid:
        # FSDP1's register_comm_hook refuses its hybrid strategies (its default hooks do not do the
        # inter-node all-reduce); ODC's push does it, once per minibatch: set as register_comm_hook does.
        for inst in FullyShardedDataParallel.fsdp_modules(model):
            if inst._comm_hook is not None:
                raise ConfigError("odc.fsdp.enable: the FSDP1 model already has a communication hook")
            inst._comm_hook, inst._comm_hook_state = _push, comms[0]
    else:
        # Public: on the root, refuses a hook already registered.
        model.register_comm_hook(comms[0], _push)
    for c in comms:
        cast(Any, c.g.module)._comm_hook_state = c  # each instance its own state: the hook learns whose gradient it is
        h = c.g.handle
        h._all_gather_flat_param = c.gather
        if h._use_orig_params:
            h._writeback_orig_params = c.writeback_orig_params
            h._use_sharded_grad_views = c.use_sharded_grad_views
            h._use_unsharded_grad_views = c.use_unsharded_grad_views
            h.flat_param.grad = None  # the original parameters' .grad (pending since enable) are the gradients

    def undo() -> None:
        for c in comms:
            for name in _REPLACED:
                c.g.handle.__dict__.pop(name, None)
        for inst in FullyShardedDataParallel.fsdp_modules(model):
            inst._comm_hook = None
            inst._comm_hook_state = None

    b.hooks.append(_Undo(undo))


def _push(state: _FlatComms, padded_unsharded_grad: torch.Tensor, new_sharded_grad: torch.Tensor) -> None:
    state.push(padded_unsharded_grad, new_sharded_grad)
