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

Supported: ``ShardingStrategy.FULL_SHARD`` and ``SHARD_GRAD_OP``,
``use_orig_params=False`` (verl's default), mixed precision, every FSDP
instance over the same process group, ``sharding="full"``. Refused with a
:class:`odc.ConfigError`: hybrid strategies (FSDP1 runs no comm hook under
them), ``NO_SHARD``, ``use_orig_params=True`` (FSDP1 then reads each
original parameter's gradient storage before every unshard, which a pending
gradient cannot answer without finishing the minibatch), CPU offload,
``keep_low_precision_grads``. Every private FSDP1 name used here is listed in
:data:`PRIVATE_FSDP1` with the releases it was checked on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from ..errors import ConfigError, LayoutError
from ._grads import _local, _Param, _pending_cell
from ._private import _ALL, PrivateName, _Group, _Layout, _where
from ._seams import gather_rows, push_rows
from ._state import _Binding, _Undo

#: Private FSDP1 names this module reads or writes (owner, name, first, last checked release, use).
PRIVATE_FSDP1: tuple[PrivateName, ...] = (
    PrivateName("FullyShardedDataParallel", "_handle", *_ALL, "the instance's FlatParamHandle (None: no params)"),
    PrivateName("FullyShardedDataParallel", "_comm_hook", *_ALL,
                "written: cleared by disable (FSDP1 has no public way to unregister a comm hook)"),
    PrivateName("FullyShardedDataParallel", "_comm_hook_state", *_ALL,
                "written: each instance's own state object, so the hook knows whose gradient it pushes"),
    PrivateName("FlatParamHandle", "_all_gather_flat_param", *_ALL,
                "replaced on each handle instance by ODC's gather (restored by disable)"),
    PrivateName("FlatParamHandle", "_training_state", *_ALL,
                "SUMMON_FULL_PARAMS (state dicts, summon_full_params): FSDP1's own all-gather serves the unshard"),
    PrivateName("_common_utils", "HandleTrainingState", *_ALL, "its SUMMON_FULL_PARAMS member"),
    PrivateName("FlatParamHandle", "_fwd_bwd_param_dtype", *_ALL, "the all-gather dtype (mixed precision)"),
    PrivateName("FlatParamHandle", "_use_orig_params", *_ALL, "use_orig_params=True is refused"),
    PrivateName("FlatParamHandle", "_offload_params", *_ALL, "CPU offload is refused"),
    PrivateName("FlatParamHandle", "_keep_low_precision_grads", *_ALL, "keep_low_precision_grads is refused"),
    PrivateName("FlatParamHandle", "device", *_ALL, "the compute device (the transport's choice)"),
    PrivateName("FlatParameter", "_local_shard", *_ALL, "this rank's shard (full precision): published"),
    PrivateName("FlatParameter", "_saved_grad_shard", *_ALL,
                "written: the sharded gradient FSDP1 accumulates onto, the pending gradient's real base"),
    PrivateName("Variable._execution_engine", "queue_callback", *_ALL,
                "the end-of-backward callback that makes .grad pending again (as FSDP1 queues its own)"),
)

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


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


class _FlatParamGroup:
    """One FSDP1 handle, with the attributes odc.fsdp reads of an FSDP2 ``FSDPParamGroup``."""

    def __init__(self, handle: Any, fqn: str) -> None:
        self.fsdp_params = [_FlatParam(handle, fqn)]
        self.device = handle.device
        self._module_fqn = fqn


@dataclass
class _FlatGroup(_Group):
    """One FlatParameter = one ODC bucket."""

    handle: Any = None

    def gather_inputs(self) -> list[torch.Tensor]:
        # The full-precision shard, cast as FSDP1 casts it before its all-gather (mixed precision).
        return [self.handle.flat_param._local_shard.to(self.dtype)]


def _check_private(instances: list[Any], owners: tuple[str, ...]) -> None:
    for inst in instances:
        handle = getattr(inst, "_handle", None)
        objs = {"FullyShardedDataParallel": inst, "FlatParamHandle": handle,
                "FlatParameter": None if handle is None else handle.flat_param}
        for n in PRIVATE_FSDP1:
            obj = objs.get(n.owner) if n.owner in owners else None
            if obj is None:
                continue
            if n.name == "_saved_grad_shard":  # set and deleted by FSDP1 around each backward
                continue
            if not hasattr(obj, n.name):
                raise ConfigError(
                    f"odc.fsdp cannot run FSDP1 on {_where()}: its {n.owner} has no {n.name!r} (private state "
                    "odc.fsdp reads); install one of the checked versions or keep FSDP1's own collectives"
                )


def describe(model: Any, sharding: str) -> tuple[list[_Group], _Layout, Any]:
    """The FSDP1 model's buckets (one per FlatParameter, in FSDP1's traversal order), this rank's layout
    and the process group; refuses what ODC cannot keep (see the module doc)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    instances = FullyShardedDataParallel.fsdp_modules(model)
    _check_private(instances, ("FullyShardedDataParallel", "FlatParamHandle"))
    if not model.check_is_root():  # public; runs FSDP1's lazy init (the first forward's), idempotent
        raise ConfigError("odc.fsdp.enable: pass the root FullyShardedDataParallel module (the one that runs forward)")
    _check_private(instances, ("FlatParameter",))  # attributes FSDP1's lazy init sets
    pg = model.process_group
    world = dist.get_world_size(pg)
    members = tuple(dist.get_process_group_ranks(pg))
    layout = _Layout("full", world=world, rank=dist.get_rank(pg), shards=world, index=dist.get_rank(pg),
                     members=members)
    if world == 1 and dist.get_world_size() > 1:
        raise ConfigError(
            f"odc.fsdp.enable: the FSDP1 model shards over a process group of one rank out of "
            f"{dist.get_world_size()} (a hybrid strategy with one rank per node, which FSDP1 turns into "
            "NO_SHARD): there is nothing to gather; shard over every rank (ShardingStrategy.FULL_SHARD)"
        )
    if world == 1:  # FSDP1 runs NO_SHARD on one rank; the caller makes it a solo model
        return [], layout, pg
    if sharding != "full":
        raise ConfigError(
            f"odc.fsdp.enable: sharding={sharding!r} on an FSDP1 (FullyShardedDataParallel) model; ODC runs "
            "FSDP1 under sharding='full' (ShardingStrategy.FULL_SHARD or SHARD_GRAD_OP over every rank); for "
            "hybrid sharding use FSDP2 (fully_shard over a 2-D mesh)"
        )
    names = {id(m): n for n, m in model.named_modules()}
    groups: list[_Group] = []
    for inst in instances:
        h = inst._handle
        fqn = names.get(id(inst)) or "<root>"
        where = f"FullyShardedDataParallel({fqn})"
        if h is None:
            continue
        strategy = inst.sharding_strategy
        if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            why = ("FSDP1 runs no comm hook under hybrid strategies" if "HYBRID" in strategy.name
                   else "it shards nothing, so there is nothing to gather")
            raise ConfigError(
                f"odc.fsdp.enable: {where} uses ShardingStrategy.{strategy.name}, which ODC cannot serve ({why}); "
                f"use {' or '.join(_STRATEGIES)}, or FSDP2 (fully_shard) for hybrid sharding"
            )
        if tuple(dist.get_process_group_ranks(inst.process_group)) != members:
            raise ConfigError(f"odc.fsdp.enable: {where} shards over other ranks than the root ({members})")
        if h._use_orig_params:
            raise ConfigError(
                f"odc.fsdp.enable: {where} was built with use_orig_params=True, which ODC does not serve on "
                "FSDP1 yet (FSDP1 reads every original parameter's gradient storage before each unshard); build "
                "it with use_orig_params=False (verl's default), or use FSDP2 (fully_shard)"
            )
        if h._offload_params:
            raise ConfigError(f"odc.fsdp.enable: {where} offloads parameters to CPU (CPUOffload), which ODC does "
                              "not serve on FSDP1; drop the offload or use FSDP2")
        if h._keep_low_precision_grads:
            raise ConfigError(f"odc.fsdp.enable: {where} keeps low-precision gradients "
                              "(MixedPrecision(keep_low_precision_grads=True)), which ODC does not serve on FSDP1")
        fp = h.flat_param
        n = fp._local_shard.numel()
        name = f"fsdp1-{len(groups)}:{fqn}"
        dtype = cast(torch.dtype, h._fwd_bwd_param_dtype)
        groups.append(_FlatGroup(name=name, pg=cast(Any, _FlatParamGroup(h, fqn)), module=cast(Any, inst), n=n,
                                 dtype=dtype, offsets=[0], index=len(groups), handle=h))
    return groups, layout, pg


@dataclass(eq=False)
class _Backward:
    """What the pushes of one backward leave for the callback that runs after FSDP1's end-of-backward."""

    binding: _Binding
    queued: bool = False
    pushed: list[_Param] = field(default_factory=list)  # records pushed in this backward


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
        b.begin(f"all-gather of {g.name}")
        b.check_unchanged(g)
        own = g.handle.flat_param.data  # this rank's shard in the all-gather dtype (FSDP1's pre-unshard cast it)
        if out.numel() != b.shards * g.n or own.numel() != g.n or out.dtype != g.dtype:
            raise LayoutError(
                f"odc.fsdp: all-gather of {g.name} got {out.numel()} {out.dtype} elements from a shard of "
                f"{own.numel()}; registered {b.shards}·{g.n} {g.dtype} (did the parameters change after enable?)"
            )
        if g.shard_len == g.n:
            out.view(b.shards, g.n)[b.index].copy_(own)
            b.engine.gather(g.name, b.version, out, skip_own=True)
        else:
            out.view(b.shards, g.n).copy_(gather_rows(b, g, own))
        return out

    def push(self, padded_unsharded_grad: torch.Tensor, new_sharded_grad: torch.Tensor) -> None:
        """The comm hook: pushes each owner's rows (scale 1/D), leaves zeros for FSDP1 to accumulate."""
        b, g = self.b, self.g
        what = f"reduce-scatter of {g.name}"
        b.begin(what)
        ws, n = b.shards, g.n
        if padded_unsharded_grad.numel() != ws * n:
            raise LayoutError(f"odc.fsdp: {what}: the gradient holds {padded_unsharded_grad.numel()} elements, "
                              f"not {ws}·{n}")
        self._hand_back_base(what)
        # FSDP1's mean over the ranks (it divides only on its default path, not around a comm hook).
        push_rows(b, g, padded_unsharded_grad, 1.0 / b.layout.world)
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
            b.grads._check_not_cleared(rec, saved, g.pushed_in == b.version, what)
            base = _local(saved)
            if _pending_cell(saved) is not None:
                if base is None:
                    del fp._saved_grad_shard
                else:
                    fp._saved_grad_shard = base
            rec.restored = base
            self.backward.pushed.append(rec)


def _summoning() -> Any:
    from torch.distributed.fsdp._common_utils import HandleTrainingState

    return HandleTrainingState.SUMMON_FULL_PARAMS


def _after_backward(bw: _Backward) -> None:
    """FSDP1 assigned ``.grad`` (the base plus its zeros): every sharded ``.grad`` pending again."""
    b = bw.binding
    pushed = {id(rec) for rec in bw.pushed}
    for rec in b.grads.params:
        g = rec.param.grad
        cell = _pending_cell(g)
        if cell is not None and cell.version == b.version and cell.real is None:
            continue
        if id(rec) in pushed:
            base = rec.restored if rec.restored is not None and _local(g) is rec.restored else None
        else:
            base = _local(g)
        rec.restored = None
        b.grads._pend(rec, b.version, base)
    bw.pushed.clear()
    bw.queued = False


def install(b: _Binding, model: Any, groups: list[_Group]) -> _Undo:
    """Installs ODC's gather on each handle and its push as FSDP1's comm hook; returns the undo."""
    backward = _Backward(b)
    comms = [_FlatComms(b, g, backward) for g in groups if isinstance(g, _FlatGroup)]
    # Public: on the root, refuses hybrid strategies and a hook already registered.
    model.register_comm_hook(comms[0], _push)
    for c in comms:
        cast(Any, c.g.module)._comm_hook_state = c  # each instance its own state: the hook learns whose gradient it is
        c.g.handle._all_gather_flat_param = c.gather

    def undo() -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        for c in comms:
            c.g.handle.__dict__.pop("_all_gather_flat_param", None)
        for inst in FullyShardedDataParallel.fsdp_modules(model):
            inst._comm_hook = None
            inst._comm_hook_state = None

    return _Undo(undo)


def _push(state: _FlatComms, padded_unsharded_grad: torch.Tensor, new_sharded_grad: torch.Tensor) -> None:
    state.push(padded_unsharded_grad, new_sharded_grad)
