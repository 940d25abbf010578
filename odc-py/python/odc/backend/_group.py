"""The ``odc`` torch.distributed backend's process group (:class:`ProcessGroupODC`): which
operations run on ODC's engines and which on the internal gloo group, and the checks on their
tensors. Built from :mod:`._parts` (work objects, host staging, the scratch-bucket engine pair).
"""

from __future__ import annotations

import collections
import datetime
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._c10d import gloo_method, premul_factor
from ..deadline import deadline_for
from ..engine import CUDA_TRANSPORTS, Engine, _local_world_size, heap_bytes, transport_name
from ..errors import ConfigError, LayoutError, OdcError, ProtocolError
from ._parts import _DTYPES, _CompletedWork, _Pair, _Reducer, _StagedWork, _tensors, _to_host

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

# Not re-exported by torch.distributed (nor typed in its stubs); the default-options fallback needs it.
AllgatherOptions: Any = getattr(dist.distributed_c10d, "AllgatherOptions", None)

BACKEND_NAME = "odc"
"""The name torch.distributed knows the backend by: ``init_process_group("odc")``."""
SCRATCH_ENV = "ODC_BACKEND_SCRATCH_MB"
"""The environment variable that sets the scratch shard size, in MiB."""
DEFAULT_SCRATCH_MB = 16.0
"""The scratch shard per rank and engine when :data:`SCRATCH_ENV` is unset, in MiB."""

_ReduceOp = dist.ReduceOp
_SUM_LIKE = (_ReduceOp.SUM, _ReduceOp.AVG, _ReduceOp.PREMUL_SUM)


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


def scratch_bytes() -> int:
    """Per-rank shard capacity of the backend's scratch buckets, in bytes (``ODC_BACKEND_SCRATCH_MB``)."""
    raw = os.environ.get(SCRATCH_ENV)
    try:
        mb = DEFAULT_SCRATCH_MB if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{SCRATCH_ENV}={raw!r} is not a number of MiB") from None
    if not mb > 0:
        raise ConfigError(f"{SCRATCH_ENV}={raw!r} must be positive")
    return int(mb * 2**20)


def _transports(requested: str | None) -> tuple[str, str | None]:
    """The transports of the CPU pair and of the CUDA pair for ``ODC_TRANSPORT`` (None: picked by node count).

    A transport that moves CUDA tensors goes to the CUDA pair; any other name
    (``emu-ipc`` and ``emu-shmem`` included: device transports on CPU
    tensors) goes to the CPU pair, an unknown one too: its engine raises
    :class:`odc.ConfigError` listing the names it knows.
    """
    name = transport_name(requested)
    if name is None:
        return "auto", None
    if name in CUDA_TRANSPORTS:
        return "auto", name
    return str(requested), None


def _cuda_transport(requested: str | None, nodes: int) -> str:
    """The CUDA pair's transport: ``requested``, else ``cuda-ipc`` on one node and ``nvshmem`` across nodes."""
    if requested == "cuda-ipc" and nodes > 1:
        raise ConfigError(
            f"odc backend: ODC_TRANSPORT={requested!r} serves one node and the group spans {nodes} nodes; "
            "use 'nvshmem' (the default for CUDA tensors across nodes)"
        )
    if requested is not None:
        return requested
    return "cuda-ipc" if nodes == 1 else "nvshmem"


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


def _check_dtype(what: str, dtype: torch.dtype) -> None:
    if dtype not in _DTYPES:
        raise LayoutError(f"{what}: dtype {dtype} is not supported by the odc backend (float32, bfloat16, float16 are)")


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


def _timeout_s(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _job_key(store: Store, rank: int) -> str:
    """Equal on every rank, distinct per job: ``ODC_JOB_KEY``, torchelastic's run id, or a token rank 0 posts."""
    for env in ("ODC_JOB_KEY", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(env):
            return os.environ[env]
    key = "odc/job_key"
    if rank == 0:
        store.set(key, "pg" + secrets.token_hex(8))
    return store.get(key).decode()


# -- the process group -------------------------------------------------------------
class ProcessGroupODC(dist.ProcessGroup):
    """A torch.distributed process group whose all-gather and reduce-scatter run on ODC, on CPU and CUDA tensors.

    Created by torch for ``init_process_group("odc")`` / ``new_group(backend="odc")``;
    see the module doc for which operations run where and on which engines.

    Args:
        store: the group's store (torch passes a ``PrefixStore`` unique to the group).
        rank: this rank in the group.
        world_size: the group's size D.
        timeout: how long any wait on a peer may take.
    """

    def __init__(self, store: Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, world_size)
        self._group_name = ""
        self._group_desc = ""
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        #: How many operations ran on ODC (``odc:<op>``) and on gloo (``gloo:<op>``).
        self.op_counts: collections.Counter[str] = collections.Counter()
        self._store = store
        # The group's timeout unless ODC_TIMEOUT_S is set; errors name which.
        self._seconds, self.deadline_source = deadline_for(timeout)
        self._odc_timeout_s = self._seconds
        self._nbytes = scratch_bytes()
        self._job_key = _job_key(store, rank)
        cpu_transport, self._cuda_requested = _transports(os.environ.get("ODC_TRANSPORT") or None)
        self._cpu = _Pair(lambda prefix: self._engine(prefix, transport=cpu_transport), "", self._nbytes)
        self._cuda: _Pair | None = None  # created by the first ODC op on CUDA tensors
        gloo_timeout = (
            timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=_timeout_s(timeout))
        )
        self._gloo = dist.ProcessGroupGloo(prefix_store("odc-gloo/", store), rank, world_size, gloo_timeout)

    def _engine(self, prefix: str, **kw: Any) -> Engine:
        return Engine(
            self._store, self.rank(), self.size(), timeout=self._seconds, deadline_source=self.deadline_source,
            job_key=self._job_key, prefix=prefix, **kw
        )

    def _cuda_engines(self, device: torch.device) -> Callable[[str], Engine]:
        """How the CUDA pair's engines are made on ``device``: the node count and transport, decided alike on
        every rank (collective: every rank is in its first ODC op on CUDA tensors), before any engine exists."""
        rank, world = self.rank(), self.size()
        local = _local_world_size(self._store, rank, world, "odc-cuda")
        nodes = world // local
        transport = _cuda_transport(self._cuda_requested, nodes)
        # nvshmem: a process holds one NVSHMEM session, whose heap is fixed when the pair's first engine
        # (all-gather) starts it; that engine plans the second one's (reduce-scatter) regions, which shares it.
        unplanned: list[int] = []  # taken by the first engine made
        if transport == "nvshmem":
            unplanned.append(heap_bytes(_Reducer.buckets(world, self._nbytes), world, local_world_size=local))

        def make(prefix: str) -> Engine:
            reserve = unplanned.pop() if unplanned else 0
            return self._engine(
                prefix, transport=transport, device=device.index, local_world_size=local, heap_reserve=reserve
            )

        return make

    # -- identity (a Python group keeps its own name; torch sets it after creation)
    def getBackendName(self) -> str:
        """The backend's name, ``"odc"``."""
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        """Keeps the group name torch gives the group after creating it."""
        self._group_name = name

    def getGroupName(self) -> str:
        """The group name torch gave the group."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        """Keeps the group description torch gives the group after creating it."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        """The group description torch gave the group."""
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupODC(rank={self.rank()}, world_size={self.size()}, name={self._group_name!r})"

    @property
    def transports(self) -> dict[str, str]:
        """The transport of each engine pair created so far, by device: ``{"cpu": "shm", "cuda:0": "cuda-ipc"}``."""
        return {str(p.device): p.transport for p in (self._cpu, self._cuda) if p is not None}

    # -- ODC core ------------------------------------------------------------------
    def _run(self, what: str, device: torch.device, body: Callable[[_Pair], None]) -> None:
        """Runs one ODC collective on the engine pair of ``device`` (arguments already checked).

        A failure inside leaves the engines' version and minibatch counters
        out of step with the peers, so the group refuses ODC work afterwards.
        """
        with self._lock:
            if self._failure is not None:
                raise OdcError(
                    f"{what}: this odc process group is unusable after an earlier failure "
                    f"({type(self._failure).__name__}: {self._failure}); destroy and re-create it"
                )
            if device.type == "cuda" and self._cuda is not None and self._cuda.device != device:
                raise LayoutError(
                    f"{what}: tensors on {device}, but this odc process group's CUDA engines are on "
                    f"{self._cuda.device} (created by its first operation on CUDA tensors); "
                    "use one CUDA device per group"
                )
            # Errors before an engine exists leave the group usable (every rank raises them alike).
            make_cuda = self._cuda_engines(device) if device.type == "cuda" and self._cuda is None else None
            self.op_counts[f"odc:{what}"] += 1
            try:
                if make_cuda is not None:
                    self._cuda = _Pair(make_cuda, "-cuda", self._nbytes)
                pair = self._cpu if device.type != "cuda" else self._cuda
                if pair is None:  # pragma: no cover - made just above on the first CUDA op
                    raise ProtocolError(f"{what}: the group's CUDA engines were not made")
                pair.begin()
                body(pair)
            except BaseException as e:
                self._failure = e
                raise

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
        if out.numel() != inp.numel() * self.size():
            raise LayoutError(f"{what}: output has {out.numel()} elements, expected {self.size()} x {inp.numel()}")
        if out.dtype != inp.dtype:
            raise LayoutError(f"{what}: output dtype {out.dtype} differs from input dtype {inp.dtype}")
        device = _op_device(what, (out, inp))
        if inp.numel() == 0:
            return device
        src = _flat(inp)
        dst = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=device)
        self._run(what, device, lambda pair: pair.gatherer.all_gather(dst, src))
        if not out.is_contiguous():
            out.copy_(dst.view(out.shape))
        return device

    def _reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor, op: Any, what: str) -> torch.device:
        _check_dtype(what, inp.dtype)
        _check_dtype(what, out.dtype)
        device = _op_device(what, (out, inp))
        scale = _scale(op, self.size(), what, inp.dtype)
        if inp.numel() != out.numel() * self.size():
            raise LayoutError(f"{what}: input has {inp.numel()} elements, expected {self.size()} x {out.numel()}")
        if out.numel() == 0:
            return device
        src = _flat(inp)
        dst = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=device)
        self._run(what, device, lambda pair: pair.reducer.reduce_scatter(dst, src, scale))
        if not out.is_contiguous():
            out.copy_(dst.view(out.shape))
        return device

    def _odc_allreduce(self, t: torch.Tensor, scale: float) -> None:
        """All-reduce as an ODC reduce-scatter of a padded copy, then a gather of the reduced shards."""
        world, n = self.size(), t.numel()
        if n == 0:
            return
        per = -(-n // world)
        padded = torch.zeros(world * per, dtype=t.dtype, device=t.device)
        padded[:n].copy_(t.reshape(-1))
        shard = torch.empty(per, dtype=t.dtype, device=t.device)
        full = torch.empty(world * per, dtype=t.dtype, device=t.device)

        def body(pair: _Pair) -> None:
            pair.reducer.reduce_scatter(shard, padded, scale)
            pair.gatherer.all_gather(full, shard)

        self._run("allreduce", t.device, body)
        t.copy_(full[:n].view(t.shape))

    def _odc_reduce_ok(self, tensors: Sequence[torch.Tensor], op: Any) -> bool:
        red = getattr(op, "op", op)
        return red in _SUM_LIKE and len(tensors) > 0 and all(t.dtype in _DTYPES for t in tensors)

    # -- all-gather ----------------------------------------------------------------
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """All-gather into one tensor (``all_gather_into_tensor``) as an ODC gather.

        f32 / bf16 / f16 run on ODC; other dtypes go to the group's gloo backend. Completes before it returns on
        CPU tensors; on CUDA tensors it is enqueued on the current stream.
        """
        if input.dtype not in _DTYPES:
            return self._delegate("all_gather_single", output, input, opts or AllgatherOptions())
        device = self._all_gather_into(output, input, "all_gather_single")
        return _CompletedWork([output], device)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Several :meth:`all_gather_single` calls, one after the other, as one Work."""
        device = _op_device("all_gather_single_coalesced", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs, strict=True):
            self.all_gather_single(out, inp).wait()
        return _CompletedWork(list(outputs), device)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """The list form of all-gather: an ODC gather into a flat buffer, copied out to the list.

        A list whose tensors differ from the input in dtype or size goes to gloo.
        """
        device = _op_device("allgather", _tensors((outputs, inputs)))
        for outs, inp in zip(outputs, inputs, strict=True):
            if inp.dtype in _DTYPES and all(o.dtype == inp.dtype and o.numel() == inp.numel() for o in outs):
                full = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=device)
                self._all_gather_into(full, inp, "allgather")
                for o, row in zip(outs, full.view(len(outs), -1), strict=True):
                    o.copy_(row.view(o.shape))
            else:
                self._delegate("allgather", [outs], [inp], opts or AllgatherOptions()).wait()
        return _CompletedWork([o for outs in outputs for o in outs], device)

    # -- reduce-scatter ------------------------------------------------------------
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """Reduce-scatter from one tensor (``reduce_scatter_tensor``) as an ODC scatter-accumulate.

        Sum, average and premul-sum on f32 / bf16 / f16, accumulated in f32; another op raises
        :class:`UnsupportedCollective`, another dtype a :class:`~odc.LayoutError`.
        """
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        device = self._reduce_scatter_into(output, input, op, "reduce_scatter_single")
        return _CompletedWork([output], device)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Several :meth:`reduce_scatter_single` calls as one Work."""
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        device = _op_device("reduce_scatter_single_coalesced", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs, strict=True):
            self._reduce_scatter_into(out, inp, op, "reduce_scatter_single_coalesced")
        return _CompletedWork(list(outputs), device)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """The list form of reduce-scatter: the inputs concatenated, then one ODC scatter-accumulate.

        Raises:
            LayoutError: not one input per rank, or inputs whose size differs from the output's.
        """
        op = opts.reduceOp if opts is not None else _ReduceOp.SUM
        device = _op_device("reduce_scatter", _tensors((outputs, inputs)))
        for out, ins in zip(outputs, inputs, strict=True):
            if len(ins) != self.size() or any(i.numel() != out.numel() for i in ins):
                raise LayoutError(f"reduce_scatter: needs {self.size()} inputs of {out.numel()} elements each")
            for t in (out, *ins):
                _check_dtype("reduce_scatter", t.dtype)
            stacked = torch.cat([i.reshape(-1).to(out.dtype) for i in ins])
            self._reduce_scatter_into(out, stacked, op, "reduce_scatter")
        return _CompletedWork(list(outputs), device)

    # -- all-reduce ----------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """All-reduce as an ODC reduce-scatter and gather, for sum-like ops on f32 / bf16 / f16.

        Max, min, integer dtypes and the rest go to gloo.
        """
        opts = opts or dist.AllreduceOptions()
        if not self._odc_reduce_ok(tensors, opts.reduceOp):
            return self._delegate("allreduce", tensors, opts)
        device = _op_device("allreduce", tensors)
        for t in tensors:
            self._odc_allreduce(t, _scale(opts.reduceOp, self.size(), "allreduce", t.dtype))
        return _CompletedWork(list(tensors), device)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """All-reduce of several tensors, each as :meth:`allreduce`."""
        opts = opts or dist.AllreduceCoalescedOptions()
        if not self._odc_reduce_ok(tensors, opts.reduceOp):
            return self._delegate("allreduce_coalesced", tensors, opts)
        device = _op_device("allreduce_coalesced", tensors)
        for t in tensors:
            self._odc_allreduce(t, _scale(opts.reduceOp, self.size(), "allreduce_coalesced", t.dtype))
        return _CompletedWork(list(tensors), device)

    # -- delegated to gloo ---------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Broadcast, on the group's internal gloo backend."""
        return self._delegate("broadcast", tensors, opts or dist.BroadcastOptions())

    def barrier(self, opts: Any = None) -> dist.Work:
        """Barrier, on the group's internal gloo backend."""
        return self._delegate("barrier", opts or dist.BarrierOptions())

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Reduce to one rank, on the group's internal gloo backend."""
        return self._delegate("reduce", tensors, opts or dist.ReduceOptions())

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Gather to one rank, on the group's internal gloo backend."""
        return self._delegate("gather", outputs, inputs, opts or dist.GatherOptions())

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Scatter from one rank, on the group's internal gloo backend."""
        return self._delegate("scatter", outputs, inputs, opts or dist.ScatterOptions())

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """The list form, as one gloo ``all_to_all_single`` over flat buffers: gloo has no list form on torch
        2.11 (nor on some later builds), and one code path serves every torch."""
        what = "alltoall"
        if len(inputs) != self.size() or len(outputs) != self.size():
            raise LayoutError(
                f"{what}: {len(inputs)} inputs and {len(outputs)} outputs for a group of {self.size()} ranks"
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

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Point-to-point send, on the group's internal gloo backend."""
        return self._delegate("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Point-to-point receive from ``src``, on the group's internal gloo backend."""
        return self._delegate("recv", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Point-to-point receive from any rank, on the group's internal gloo backend."""
        return self._delegate("recv_anysource", tensors, tag)

    recvAnysource = recv_anysource

    # -- teardown ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops every engine's server daemon and drops the gloo backend."""
        with self._lock:
            self._cpu = self._cuda = None  # type: ignore[assignment]
            self._gloo = None  # type: ignore[assignment]
            if self._failure is None:
                self._failure = OdcError("the process group was shut down")

    def abort(self) -> None:
        """What torch calls on a failed job: the same as :meth:`shutdown`."""
        self.shutdown()


def prefix_store(prefix: str, store: Store) -> Store:
    """``store`` under ``prefix`` (torch's stubs do not export ``PrefixStore``)."""
    make: Any = dist.PrefixStore  # type: ignore[attr-defined]
    made: Store = make(prefix, store)
    return made
