"""The ``odc`` torch.distributed backend object (:class:`ProcessGroupODC`): which operations run on ODC's
engines and which on the internal gloo backend, and the checks on their tensors. Built from
:mod:`._parts` (work objects, host staging, the scratch-bucket engines) and :mod:`._engines` (when
engines are made, how large, and who shares them). How torch reaches it is :func:`odc.backend.register`'s
business (:mod:`._route` where torch has no Python backends).
"""

from __future__ import annotations

import collections
import datetime
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from .._c10d import backend_base, gloo_method, init_backend, premul_factor
from ..deadline import deadline_for
from ..engine import Engine
from ..errors import ConfigError, LayoutError, OdcError, ProtocolError
from ._elastic import ElasticAllReduce, route
from ._elastic import enabled as elastic_enabled
from ._engines import (
    DEFAULT_SCRATCH_MB,
    SCRATCH_ENV,
    Engines,
    EngineSet,
    SetKey,
    engine_set,
    scratch_bytes,
    transports,
)
from ._parts import _DTYPES, WIRE_BYTES, _StagedWork, _tensors, _to_host, completed_work

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    _Base = object
else:
    _Base = backend_base()

# Not re-exported by torch.distributed (nor typed in its stubs); the default-options fallback needs it.
AllgatherOptions: Any = getattr(dist.distributed_c10d, "AllgatherOptions", None)

BACKEND_NAME = "odc"
"""The name torch.distributed knows the backend by: ``init_process_group("odc")``."""
__all__ = [
    "BACKEND_NAME",
    "DEFAULT_SCRATCH_MB",
    "SCRATCH_ENV",
    "NotAnOdcGroup",
    "NotInitialized",
    "ProcessGroupODC",
    "UnsupportedCollective",
    "scratch_bytes",
]

_ReduceOp = dist.ReduceOp
_SUM_LIKE = (_ReduceOp.SUM, _ReduceOp.AVG, _ReduceOp.PREMUL_SUM)


#: Where the elastic all-reduce's refusals send the reader.
ELASTIC_NOTE = "ODC_BACKEND_ELASTIC=1 runs every all-reduce of the group over the member nodes or refuses it"


class UnsupportedCollective(OdcError, NotImplementedError):
    """The ``odc`` backend has no implementation of this collective / reduce op / dtype.

    Raised by the group's reduce-scatter for a reduce op other than sum, average
    and premul-sum (a premul-sum whose factor it cannot read included); the
    message names the op and the dtype. Also a :class:`NotImplementedError`.

    What to do: reduce with a supported op, or run that collective on a gloo or
    NCCL group of its own.
    """


class NotInitialized(ProtocolError, RuntimeError):
    """An ``odc`` backend helper was called before ``init_process_group``.

    Also a :class:`RuntimeError`. What to do: call
    ``torch.distributed.init_process_group("odc")`` first.
    """


class NotAnOdcGroup(ConfigError, RuntimeError):
    """A process group passed to an ``odc`` backend helper uses another backend.

    Also a :class:`RuntimeError`. What to do: pass a group made with
    ``init_process_group("odc")`` or ``new_group(backend="odc")``.
    """


# -- helpers ---------------------------------------------------------------------
def _scale(op: Any, world: int, what: str, dtype: torch.dtype) -> float:
    """The push scale of a sum-like reduce op, or a typed error naming the op and dtype."""
    red = getattr(op, "op", op)
    if red == _ReduceOp.SUM:
        return 1.0
    if red == _ReduceOp.AVG:
        return 1.0 / world
    if red == _ReduceOp.PREMUL_SUM:
        factor = premul_factor(op)
        if factor is None:
            raise UnsupportedCollective(f"{what}: PREMUL_SUM without a readable factor ({op!r})")
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise UnsupportedCollective(f"{what}: PREMUL_SUM with a factor of {factor.numel()} elements")
            factor = factor.item()
        return float(factor)
    raise UnsupportedCollective(
        f"{what}: reduce op {red} on {dtype} is not supported by the odc backend (SUM, AVG and PREMUL_SUM are)"
    )


def _op_device(what: str, tensors: Sequence[torch.Tensor]) -> torch.device:
    """The one device of an operation's tensors (``cpu`` when it has none), or a LayoutError naming them."""
    devices = sorted({t.device for t in tensors}, key=str)
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        raise LayoutError(
            f"{what}: tensors on {' and '.join(map(str, devices))}; "
            "the odc backend needs every tensor of one operation on one device"
        )
    device = devices[0]
    if device.type not in ("cpu", "cuda"):
        raise LayoutError(f"{what}: tensor on {device}; the odc backend moves CPU and CUDA tensors")
    return device


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _dense(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is dense (strided): ODC moves those; sparse ones go to gloo."""
    return all(t.layout == torch.strided for t in tensors)


def _readable_factor(op: Any) -> bool:
    """Whether a PREMUL_SUM's factor can be read (a number, or a tensor of one element)."""
    factor = premul_factor(op)
    return factor is not None and (not isinstance(factor, torch.Tensor) or factor.numel() == 1)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _collective(method: _Method) -> _Method:
    """Counts a call of a collective in the group's sequence number (``_get_sequence_number_for_group``): one per
    call, whatever ran it, alike on every rank."""

    @functools.wraps(method)
    def counted(self: ProcessGroupODC, *args: Any, **kwargs: Any) -> Any:
        self._seq += 1
        return method(self, *args, **kwargs)

    return cast("_Method", counted)


# -- the backend -------------------------------------------------------------------
class ProcessGroupODC(_Base):
    """The ``odc`` backend of a torch.distributed process group: all-gather and reduce-scatter on ODC, on
    CPU and CUDA tensors; every other operation on an internal gloo backend.

    torch creates it for ``init_process_group("odc")`` / ``new_group(backend="odc")`` and reaches it
    through its dispatcher, as it reaches gloo's and nccl's (see :func:`odc.backend.register`); its
    methods are ``c10d``'s backend methods. It reserves no ODC memory: its ranks' engines come from
    :mod:`._engines` at its first ODC operation and are shared with every other group of the same
    ranks. See the module doc of :mod:`odc.backend` for which operations run where.

    Args:
        store: the group's store (torch passes a ``PrefixStore`` unique to the group).
        rank: this rank in the group.
        world_size: the group's size D.
        timeout: how long any wait on a peer may take.
        ranks: the group's global ranks, in group order (default ``range(world_size)``): groups of the
            same ranks share engines.
    """

    def __init__(
        self, store: Store, rank: int, world_size: int, timeout: datetime.timedelta,
        ranks: Sequence[int] | None = None,
    ) -> None:
        init_backend(self, rank, world_size)
        self._rank, self._size = rank, world_size
        self._group_name = ""
        self._owner: Callable[[], Any] | None = None  # the group holding this, where torch has no Python backends
        #: How many operations ran on ODC (``odc:<op>``) and on gloo (``gloo:<op>``).
        self.op_counts: collections.Counter[str] = collections.Counter()
        self._store = store
        # The group's timeout unless ODC_TIMEOUT_S is set; errors name which.
        self._seconds, self.deadline_source = deadline_for(timeout)
        self._odc_timeout_s = self._seconds
        self._timeout = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=self._seconds)
        )
        self._nbytes = scratch_bytes()
        cpu_transport, self._cuda_requested = transports(os.environ.get("ODC_TRANSPORT") or None)
        global_ranks = tuple(int(r) for r in ranks) if ranks else tuple(range(world_size))
        if len(global_ranks) != world_size:
            raise ConfigError(f"odc backend: {len(global_ranks)} global ranks for a group of {world_size}")
        key = SetKey(global_ranks, cpu_transport, self._cuda_requested, self._nbytes, self._seconds,
                     self.deadline_source)
        self._set: EngineSet | None
        self._set, self._index = engine_set(key, rank, store)
        self._set.check_transport()
        self._ops = 0  # this group's ODC operations so far: with _index, the ticket of its next one
        if self._index > 0:  # groups of these ranks share engines from now on: their turns are posted
            self._set.post_turns(store, self._seconds, self._index)
        self._engines_made = 0  # names each engine made through this group's store afresh
        self._seq = 0  # the collectives called so far (_get_sequence_number_for_group)
        self._gloo: Any = dist.ProcessGroupGloo(prefix_store("odc-gloo/", store), rank, world_size, self._timeout)
        self._elastic = (
            ElasticAllReduce(prefix_store("odc-elastic/", store), rank, world_size, global_ranks, self._seconds,
                             self.deadline_source)
            if elastic_enabled() else None
        )

    # -- identity (the names torch's backend trampoline looks for) -----------------------
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """The group's number of ranks."""
        return self._size

    def getBackendName(self) -> str:
        """The backend's name, ``"odc"``."""
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name, ``"odc"``."""
        return BACKEND_NAME

    @property
    def options(self) -> Any:
        """The backend's options (its name and timeout), as torch reads them from a group's backend."""
        return _c10d.Backend.Options(BACKEND_NAME, self._timeout)

    def _set_group_uid(self, name: str) -> None:
        # torch names the group through its backend; the base keeps the name the group reports.
        self._group_name = name
        _Base._set_group_uid(self, name)  # type: ignore[attr-defined]  # only called where _Base is Backend

    @property
    def group_name(self) -> str:
        """The name torch gave the group."""
        if not self._group_name and self._owner is not None:
            owner = self._owner()
            if owner is not None:
                return str(owner.group_name)
        return self._group_name

    def __repr__(self) -> str:
        return f"ProcessGroupODC(rank={self._rank}, world_size={self._size}, name={self.group_name!r})"

    @property
    def transports(self) -> dict[str, str]:
        """The transport of the engines of each device that ran an ODC operation: ``{"cpu": "shm",
        "cuda:0": "cuda-ipc"}`` (empty before the first, and after shutdown)."""
        return self._set.transports if self._set is not None else {}

    # -- ODC core ------------------------------------------------------------------
    def _make(self, role: str, **kw: Any) -> Engine:
        """Makes an engine of this group's rank set through this group's store (collective: every rank of
        the group is in the same operation)."""
        if self._set is None:
            raise OdcError("this odc process group was shut down")
        made, self._engines_made = self._engines_made, self._engines_made + 1
        return self._set.make(self._store, f"odc-e{made}-{role}", **kw)

    def _run(self, what: str, device: torch.device, body: Callable[[Engines], None]) -> None:
        """Runs one ODC collective on the engines of ``device`` (arguments already checked).

        A failure inside leaves the engines' version and minibatch counters out of step with the
        peers, so the rank set's groups refuse ODC work afterwards.
        """
        engine_set = self._set
        if engine_set is None:
            raise OdcError(f"{what}: this odc process group was shut down")
        ticket = (self._index, self._ops)
        self._ops += 1
        engine_set.acquire(ticket, what)
        try:
            if engine_set.failure is not None:
                raise OdcError(
                    f"{what}: this odc process group is unusable after an earlier failure "
                    f"({type(engine_set.failure).__name__}: {engine_set.failure}); destroy and re-create it"
                )
            # Errors before an engine exists leave the group usable (every rank raises them alike).
            engines = engine_set.engines(device, self._store)
            self.op_counts[f"odc:{what}"] += 1
            try:
                engines.begin()
                body(engines)
            except BaseException as e:
                engine_set.failure = e
                raise
        finally:
            engine_set.release()

    def _delegate(self, op: str, *args: Any, count_as: str | None = None) -> dist.Work:
        """Runs ``op`` on the internal gloo backend (an operation ODC does not run); CUDA tensors on host copies.

        ``count_as``: the operation the caller asked for, in ``op_counts`` (default ``op``).
        """
        if self._gloo is None:
            raise OdcError(f"{op}: this odc process group was shut down")
        device = _op_device(op, _tensors(args))
        self.op_counts[f"gloo:{count_as or op}"] += 1
        if device.type == "cpu":
            work: dist.Work = gloo_method(self._gloo, op)(*args)
            return work
        return self._staged(op, *args)

    def _staged(self, op: str, *args: Any) -> dist.Work:
        """Runs ``op`` on gloo on host copies of its tensors.

        Every operation's output is its first argument (``send`` has none):
        the returned Work copies that argument's tensors back when waited on.
        """
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        host = [_to_host(a, copies if i == 0 and op != "send" else None) for i, a in enumerate(args)]
        return _StagedWork(gloo_method(self._gloo, op)(*host), copies)

    def _all_gather_into(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> torch.device:
        if out.numel() != inp.numel() * self._size:
            raise LayoutError(f"{what}: output has {out.numel()} elements, expected {self._size} x {inp.numel()}")
        if out.dtype != inp.dtype:
            raise LayoutError(f"{what}: output dtype {out.dtype} differs from input dtype {inp.dtype}")
        device = _op_device(what, (out, inp))
        if inp.numel() == 0:
            return device
        src = _flat(inp)
        dst = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=device)
        words = src.numel() * src.element_size() // WIRE_BYTES
        self._run(what, device, lambda e: e.gatherer(self._make, words).all_gather(dst, src))
        if not out.is_contiguous():
            out.copy_(dst.view(out.shape))
        return device

    def _reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, op: Any, what: str) -> torch.device:
        """An ODC reduce-scatter (the caller checked :meth:`_odc_reduce_scatter_ok`)."""
        device = _op_device(what, (out, inp))
        scale = _scale(op, self._size, what, inp.dtype)
        if inp.numel() != out.numel() * self._size:
            raise LayoutError(f"{what}: input has {inp.numel()} elements, expected {self._size} x {out.numel()}")
        if out.numel() == 0:
            return device
        src = _flat(inp)
        dst = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=device)
        self._run(what, device, lambda e: e.reducer(self._make, dst.numel()).reduce_scatter(dst, src, scale))
        if not out.is_contiguous():
            out.copy_(dst.view(out.shape))
        return device

    def _odc_reduce_scatter_ok(self, tensors: Sequence[torch.Tensor], op: Any) -> bool:
        """Whether ODC runs a reduce-scatter of ``tensors`` with ``op``: a sum-like op (a PREMUL_SUM whose factor
        it can read) on dense f32 / bf16 / f16 tensors; everything else runs on gloo."""
        red = getattr(op, "op", op)
        if red not in _SUM_LIKE or not _dense(tensors) or any(t.dtype not in _DTYPES for t in tensors):
            return False
        return red != _ReduceOp.PREMUL_SUM or _readable_factor(op)

    def _odc_allreduce(self, t: torch.Tensor, scale: float) -> None:
        """All-reduce as an ODC reduce-scatter, then a gather of the reduced shards.

        A contiguous tensor whose length the group's size divides is reduced in place: its rows are pushed as
        they are, this rank's row receives its reduced shard, and the gather writes every row into the tensor
        itself (a row is read for its push, and for its publish, before anything is written over it). Any other
        tensor goes through a padded copy.
        """
        world, n = self._size, t.numel()
        if n == 0:
            return
        if n % world == 0 and t.is_contiguous():
            per = n // world
            full = t.view(-1)
            shard = full[self._rank * per:(self._rank + 1) * per]
            padded = full
        else:
            per = -(-n // world)
            padded = torch.zeros(world * per, dtype=t.dtype, device=t.device)
            padded[:n].copy_(t.reshape(-1))
            shard = torch.empty(per, dtype=t.dtype, device=t.device)
            full = torch.empty(world * per, dtype=t.dtype, device=t.device)
        words = per * t.element_size() // WIRE_BYTES

        def body(engines: Engines) -> None:
            engines.reducer(self._make, per).reduce_scatter(shard, padded, scale)
            engines.gatherer(self._make, words).all_gather(full, shard)

        self._run("allreduce", t.device, body)
        if full.data_ptr() != t.data_ptr():
            t.copy_(full[:n].view(t.shape))

    def _odc_reduce_ok(self, tensors: Sequence[torch.Tensor], op: Any) -> bool:
        """Whether ODC runs an all-reduce of ``tensors`` with ``op`` (as :meth:`_odc_reduce_scatter_ok`)."""
        return len(tensors) > 0 and self._odc_reduce_scatter_ok(tensors, op)

    # -- all-gather ----------------------------------------------------------------
    @_collective
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """All-gather into one tensor (``all_gather_into_tensor``) as an ODC gather.

        Dense f32 / bf16 / f16 tensors run on ODC; other dtypes and layouts go to the group's gloo backend.
        Completes before it returns on CPU tensors; on CUDA tensors it is enqueued on the current stream.
        """
        return self._all_gather_single(output, input, opts)

    def _all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        if input.dtype not in _DTYPES or not _dense((output, input)):
            return self._delegate("all_gather_single", output, input, opts or AllgatherOptions())
        device = self._all_gather_into(output, input, "all_gather_single")
        return completed_work([output], device)

    _allgather_base = all_gather_single

    @_collective
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Several :meth:`all_gather_single` calls, one after the other, as one Work."""
        device = _op_device("all_gather_single_coalesced", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs, strict=True):
            self._all_gather_single(out, inp, None).wait()
        return completed_work(list(outputs), device)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_collective
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """The list form of all-gather: an ODC gather into a flat buffer, copied out to the list.

        A list whose tensors differ from the input in dtype or size, or are not dense, goes to gloo.
        """
        device = _op_device("allgather", _tensors((outputs, inputs)))
        for outs, inp in zip(outputs, inputs, strict=True):
            same = all(o.dtype == inp.dtype and o.numel() == inp.numel() for o in outs)
            if inp.dtype in _DTYPES and same and _dense((*outs, inp)):
                full = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=device)
                self._all_gather_into(full, inp, "allgather")
                for o, row in zip(outs, full.view(len(outs), -1), strict=True):
                    o.copy_(row.view(o.shape))
            else:
                self._delegate("allgather", [outs], [inp], opts or AllgatherOptions()).wait()
        return completed_work([o for outs in outputs for o in outs], device)

    @_collective
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """All-gather of several tensors as lists, on the group's internal gloo backend."""
        return self._delegate("allgather_coalesced", output_lists, inputs, opts or AllgatherOptions())

    # -- reduce-scatter ------------------------------------------------------------
    @_collective
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """Reduce-scatter from one tensor (``reduce_scatter_tensor``) as an ODC scatter-accumulate.

        Sum, average and premul-sum on dense f32 / bf16 / f16, accumulated in f32; other ops, dtypes and layouts
        run on the group's gloo backend (which refuses what it does not run, PREMUL_SUM among them).
        """
        opts = opts or dist.ReduceScatterOptions()
        return self._reduce_scatter_single(output, input, opts)

    def _reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any,
                               what: str = "reduce_scatter_single") -> dist.Work:
        if not self._odc_reduce_scatter_ok((output, input), opts.reduceOp):
            return self._delegate("_reduce_scatter_base", output, input, opts, count_as=what)
        device = self._reduce_scatter_into(output, input, opts.reduceOp, what)
        return completed_work([output], device)

    _reduce_scatter_base = reduce_scatter_single

    @_collective
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Several :meth:`reduce_scatter_single` calls as one Work."""
        opts = opts or dist.ReduceScatterOptions()
        device = _op_device("reduce_scatter_single_coalesced", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs, strict=True):
            self._reduce_scatter_single(out, inp, opts, "reduce_scatter_single_coalesced").wait()
        return completed_work(list(outputs), device)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_collective
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """The list form of reduce-scatter: the inputs concatenated, then one ODC scatter-accumulate, where every
        input has the output's size and ODC runs the op and dtypes; otherwise (a size per rank, say) gloo's list
        form."""
        opts = opts or dist.ReduceScatterOptions()
        device = _op_device("reduce_scatter", _tensors((outputs, inputs)))
        for out, ins in zip(outputs, inputs, strict=True):
            even = len(ins) == self._size and all(i.numel() == out.numel() for i in ins)
            if not even or not self._odc_reduce_scatter_ok((out, *ins), opts.reduceOp):
                self._delegate("reduce_scatter", [out], [ins], opts).wait()
                continue
            stacked = torch.cat([i.reshape(-1).to(out.dtype) for i in ins])
            self._reduce_scatter_into(out, stacked, opts.reduceOp, "reduce_scatter")
        return completed_work(list(outputs), device)

    # -- all-reduce ----------------------------------------------------------------
    @_collective
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """All-reduce as an ODC reduce-scatter and gather, for sum-like ops on f32 / bf16 / f16.

        Max, min, integer dtypes and the rest go to gloo; with ``ODC_BACKEND_ELASTIC=1`` every all-reduce runs
        elastically or raises :class:`UnsupportedCollective` (see :mod:`odc.backend._elastic`).
        """
        opts = opts or dist.AllreduceOptions()
        if self._elastic is not None:
            return self._elastic_allreduce("allreduce", tensors, opts.reduceOp)
        if not self._odc_reduce_ok(tensors, opts.reduceOp):
            return self._delegate("allreduce", tensors, opts)
        device = _op_device("allreduce", tensors)
        for t in tensors:
            self._odc_allreduce(t, _scale(opts.reduceOp, self._size, "allreduce", t.dtype))
        return completed_work(list(tensors), device)

    @_collective
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """All-reduce of several tensors, each as :meth:`allreduce`."""
        opts = opts or dist.AllreduceCoalescedOptions()
        if self._elastic is not None:
            return self._elastic_allreduce("allreduce_coalesced", tensors, opts.reduceOp)
        if not self._odc_reduce_ok(tensors, opts.reduceOp):
            return self._delegate("allreduce_coalesced", tensors, opts)
        device = _op_device("allreduce_coalesced", tensors)
        for t in tensors:
            self._odc_allreduce(t, _scale(opts.reduceOp, self._size, "allreduce_coalesced", t.dtype))
        return completed_work(list(tensors), device)

    def _elastic_allreduce(self, what: str, tensors: list[torch.Tensor], op: Any) -> dist.Work:
        """An all-reduce over the member nodes (see :mod:`._elastic`), or :class:`UnsupportedCollective` naming
        what it does not carry (checked for every tensor before any runs: every rank refuses alike)."""
        assert self._elastic is not None
        device = _op_device(what, tensors)
        red = getattr(op, "op", op)
        scales = []
        for t in tensors:
            if t.is_sparse:
                raise UnsupportedCollective(f"{what}: a sparse tensor on an elastic odc group ({ELASTIC_NOTE})")
            _, why = route(t.dtype, red, t.numel(), self._size)
            if why is not None:
                raise UnsupportedCollective(f"{what}: {why} ({ELASTIC_NOTE})")
            scales.append(_scale(op, self._size, what, t.dtype) if red == _ReduceOp.PREMUL_SUM else 1.0)
        self.op_counts[f"odc-elastic:{what}"] += 1
        for t, scale in zip(tensors, scales, strict=True):
            self._elastic.all_reduce(t, red, scale)
        return completed_work(list(tensors), device)

    @property
    def elastic_members(self) -> list[int] | None:
        """``ODC_BACKEND_ELASTIC=1``: the nodes the group's all-reduces sum over (None before the first, or
        without it)."""
        return None if self._elastic is None else self._elastic.members

    def elastic_events(self) -> list[dict[str, Any]]:
        """``ODC_BACKEND_ELASTIC=1``: the node drops the group's all-reduces saw (as
        :meth:`odc.Engine.elastic_events`)."""
        return [] if self._elastic is None else self._elastic.events()

    # -- delegated to gloo ---------------------------------------------------------
    @_collective
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Broadcast, on the group's internal gloo backend (``ODC_BACKEND_ELASTIC=1``: over the member nodes, bit
        for bit, any dtype)."""
        opts = opts or dist.BroadcastOptions()
        if self._elastic is not None:
            device = _op_device("broadcast", tensors)
            if any(t.is_sparse for t in tensors):
                raise UnsupportedCollective(f"broadcast: a sparse tensor on an elastic odc group ({ELASTIC_NOTE})")
            self.op_counts["odc-elastic:broadcast"] += 1
            for t in tensors:
                self._elastic.broadcast(t, opts.rootRank)
            return completed_work(list(tensors), device)
        return self._delegate("broadcast", tensors, opts)

    @_collective
    def barrier(self, opts: Any = None) -> dist.Work:
        """Barrier, on the group's internal gloo backend (``ODC_BACKEND_ELASTIC=1``: over the member nodes)."""
        if self._elastic is not None:
            self.op_counts["odc-elastic:barrier"] += 1
            self._elastic.barrier()
            return completed_work([], torch.device("cpu"))
        return self._delegate("barrier", opts or dist.BarrierOptions())

    @_collective
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Reduce to one rank, on the group's internal gloo backend."""
        return self._delegate("reduce", tensors, opts or dist.ReduceOptions())

    @_collective
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Gather to one rank, on the group's internal gloo backend."""
        return self._delegate("gather", outputs, inputs, opts or dist.GatherOptions())

    @_collective
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        """Scatter from one rank, on the group's internal gloo backend."""
        return self._delegate("scatter", outputs, inputs, opts or dist.ScatterOptions())

    @_collective
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """The list form, as one gloo ``all_to_all_single`` over flat buffers: gloo has no list form on torch
        2.11 (nor on some later builds), and one code path serves every torch."""
        what = "alltoall"
        if len(inputs) != self._size or len(outputs) != self._size:
            raise LayoutError(
                f"{what}: {len(inputs)} inputs and {len(outputs)} outputs for a group of {self._size} ranks"
            )
        dtypes = {t.dtype for t in (*inputs, *outputs)}
        if len(dtypes) != 1:
            raise LayoutError(f"{what}: every input and output must have one dtype, got {sorted(map(str, dtypes))}")
        device = _op_device(what, (*inputs, *outputs))
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = torch.empty(sum(t.numel() for t in outputs), dtype=dtypes.pop(), device=device)
        sizes_out, sizes_in = [t.numel() for t in outputs], [t.numel() for t in inputs]
        work = self._delegate("all_to_all_single", recv, send, sizes_out, sizes_in, opts or dist.AllToAllOptions(),
                              count_as=what)
        offsets = [sum(sizes_out[:i]) for i in range(len(outputs))]
        copies = [(out, recv.narrow(0, off, out.numel()).view(out.shape))
                  for out, off in zip(outputs, offsets, strict=True)]
        return _StagedWork(work, copies)

    @_collective
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """All-to-all of one tensor with split sizes, on the group's internal gloo backend."""
        opts = opts or dist.AllToAllOptions()
        return self._delegate("all_to_all_single", output, input, output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single

    @_collective
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Point-to-point send, on the group's internal gloo backend."""
        return self._delegate("send", tensors, dst, tag)

    @_collective
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Point-to-point receive from ``src``, on the group's internal gloo backend."""
        return self._delegate("recv", tensors, src, tag)

    @_collective
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Point-to-point receive from any rank, on the group's internal gloo backend."""
        return self._delegate("recv_anysource", tensors, tag)

    recvAnysource = recv_anysource

    # -- debugging tools -------------------------------------------------------------
    # torch 2.15's PyBackend trampoline calls these two by name (torch/csrc/distributed/c10d/py/PyBackend.hpp,
    # getSequenceNumberForGroup and monitoredBarrier); on torch 2.11 the OdcGroup forwards the first, and the
    # monitored_barrier_ op reaches the OdcGroup's registered gloo backend itself.
    def _get_sequence_number_for_group(self) -> int:
        """The number of collectives this group has run (equal on every rank while they issue the same ones),
        as gloo's sequence number counts them: the debugging tools' check that ranks are in step."""
        return self._seq

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """``dist.monitored_barrier`` on the group's internal gloo backend: a barrier that names the ranks that did
        not reach it within the timeout (``opts``: torch's ``BarrierOptions`` or a ``timedelta``; default: the
        group's)."""
        if self._gloo is None:
            raise OdcError("monitored_barrier: this odc process group was shut down")
        timeout = getattr(opts, "timeout", opts)
        if not isinstance(timeout, datetime.timedelta) or timeout <= datetime.timedelta(0):
            timeout = self._timeout
        self.op_counts["gloo:monitored_barrier"] += 1
        self._gloo.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    # -- teardown ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Lets go of this group's engines (freed with the last group of the same ranks) and its gloo backend."""
        self._set = None
        self._gloo = None
        self._elastic = None

    def abort(self) -> None:
        """What torch calls on a failed job: the same as :meth:`shutdown`."""
        self.shutdown()


def prefix_store(prefix: str, store: Store) -> Store:
    """``store`` under ``prefix`` (torch's stubs do not export ``PrefixStore``)."""
    make: Any = dist.PrefixStore  # type: ignore[attr-defined]
    made: Store = make(prefix, store)
    return made
