"""Where torch has no Python backends (:func:`odc._c10d.python_backends` False: torch 2.11.0), the ``odc``
group and the route from torch's dispatcher to its :class:`ProcessGroupODC`.

torch 2.11's ``c10d`` ops (``c10d::allreduce_``, ``c10d::_allgather_base_``, ...; their schemas are in
``torch/csrc/distributed/c10d/Ops.cpp``) have CPU and CUDA kernels that call the group's C++ backend
(``ProcessGroup::getBackend(device)->allreduce(...)``), and 2.11 binds ``Backend`` with neither a
trampoline nor a constructor, so no Python object can be that backend. The nearest supported means:

* :class:`OdcGroup`, a Python ``ProcessGroup`` (torch's ``PyProcessGroup`` trampoline) that overrides no
  collective, so that ``dist.all_reduce(..., group)`` and C++ callers alike enter the dispatcher through
  ``ProcessGroup``'s own methods. It holds the group's :class:`ProcessGroupODC` and registers that
  object's gloo backend as its C++ backend for what bypasses the ops (``pg._get_backend(device)``).
* a kernel for every ``c10d`` op at the ``BackendSelect`` dispatch key (below the ``Python`` key where
  ``CommDebugMode`` and other modes see an op, above the ``CPU`` / ``CUDA`` kernels), registered
  (:func:`install`) while an :class:`OdcGroup` lives: for an :class:`OdcGroup` it calls the
  :class:`ProcessGroupODC` method the op's backend call would have, else it passes the op on unchanged
  (a Python call per collective of other backends' groups, only while an ``odc`` group lives on such a
  torch). The kernels go (:func:`uninstall`) when the last :class:`OdcGroup` is shut down
  (``destroy_process_group``) or collected, so gloo's and NCCL's collectives cost what they cost without
  ``odc`` again; the next :class:`OdcGroup` registers them anew.

A ``c10d::ReduceOp`` reaches a kernel without its ``PREMUL_SUM`` factor (the TorchScript class binds
only ``op()``), so :class:`OdcGroup` overrides the five methods that take a reduce op to hand the
caller's ``ReduceOp`` to the kernel (:data:`_PENDING`) before calling ``ProcessGroup``'s own method.

Checked on torch 2.11.0. torch 2.15.0 does not use this module.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from ._group import AllgatherOptions, ProcessGroupODC, UnsupportedCollective

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["OdcGroup", "install", "installed", "uninstall"]

_ReduceOp = dist.ReduceOp
_CUSTOM = dist.ProcessGroup.BackendType.CUSTOM


class _Pending(threading.local):
    """The reduce op of the operation this thread is in (see the module doc), or None."""

    op: Any = None


_PENDING = _Pending()


@contextlib.contextmanager
def _passing(op: Any) -> Iterator[None]:
    before, _PENDING.op = _PENDING.op, op
    try:
        yield
    finally:
        _PENDING.op = before


def _reduce_op(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The reduce op among a ``ProcessGroup`` method's arguments (an options object's or a bare one)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (_ReduceOp, _ReduceOp.RedOpType)):
            return a
        op = getattr(a, "reduceOp", None)
        if op is not None:
            return op
    return None


class OdcGroup(dist.ProcessGroup):
    """An ``odc`` process group where torch has no Python backends: a ``ProcessGroup`` whose operations
    reach :attr:`odc` (its :class:`ProcessGroupODC`) through torch's dispatcher (see the module doc)."""

    def __init__(
        self, store: Store, rank: int, world_size: int, timeout: datetime.timedelta, ranks: Sequence[int] | None
    ) -> None:
        super().__init__(rank, world_size)
        self._live = _attach(self)
        self.odc = ProcessGroupODC(store, rank, world_size, timeout, ranks)
        self.odc._owner = weakref.ref(self)
        self._odc_timeout_s = self.odc._odc_timeout_s  # what odc.deadline reads from a group
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), _CUSTOM, self.odc._gloo)
        self._set_default_backend(_CUSTOM)

    def getBackendName(self) -> str:
        return "odc"

    def _get_sequence_number_for_group(self) -> int:
        return self.odc._get_sequence_number_for_group()

    def shutdown(self) -> None:
        self.odc.shutdown()
        _detach(self._live)

    def abort(self) -> None:
        self.shutdown()

    # The methods that take a reduce op: the op for the kernel, then ProcessGroup's own method (torch's
    # trampoline sees the call come from the override of the same name and calls the C++ method).
    def allreduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        with _passing(_reduce_op(args, kwargs)):
            return dist.ProcessGroup.allreduce(self, *args, **kwargs)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        with _passing(_reduce_op(args, kwargs)):
            return dist.ProcessGroup.allreduce_coalesced(self, *args, **kwargs)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
        with _passing(_reduce_op(args, kwargs)):
            return dist.ProcessGroup.reduce_scatter(self, *args, **kwargs)

    def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> dist.Work:
        with _passing(_reduce_op(args, kwargs)):
            return dist.ProcessGroup._reduce_scatter_base(self, *args, **kwargs)

    def reduce_scatter_tensor_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        with _passing(_reduce_op(args, kwargs)):
            return dist.ProcessGroup.reduce_scatter_tensor_coalesced(self, *args, **kwargs)


# -- the kernels ---------------------------------------------------------------------------------
def _op(reduce_op: Any, what: str) -> Any:
    """The ``dist.ReduceOp`` of a ``c10d::ReduceOp`` script object: the caller's own where it passed one of
    the same type (a ``PREMUL_SUM`` carries its factor only there)."""
    red = _ReduceOp.RedOpType(int(reduce_op.op()))
    pending = _PENDING.op
    if pending is not None and getattr(pending, "op", pending) == red:
        return pending
    if red == _ReduceOp.PREMUL_SUM:
        raise UnsupportedCollective(f"{what}: PREMUL_SUM whose factor did not reach the odc backend")
    return _ReduceOp(red)


def _opts(cls: Any, timeout: int, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    if timeout >= 0:  # the ops' -1: the group's default
        opts.timeout = datetime.timedelta(milliseconds=timeout)
    return opts


def _boxed(work: dist.Work) -> Any:
    """A Work as the ops return it; a Work defined in Python (host staging) becomes a C++ one around its
    future first, so that it outlives the Python object."""
    if type(work) is not dist.Work:
        work = _create_work_from_future(work.get_future())
    return work.boxed()


# The handlers: (backend, the op's arguments without its process group) -> what the op returns.
def _allreduce(b: ProcessGroupODC, tensors: Any, op: Any, _sparse: Any = None, _a: bool = True,
               timeout: int = -1) -> Any:
    opts = _opts(dist.AllreduceOptions, timeout, reduceOp=_op(op, "allreduce"))
    return tensors, _boxed(b.allreduce(tensors, opts))


def _allreduce_coalesced(b: ProcessGroupODC, tensors: Any, op: Any, _a: bool = True, timeout: int = -1) -> Any:
    opts = _opts(dist.AllreduceCoalescedOptions, timeout, reduceOp=_op(op, "allreduce_coalesced"))
    return _boxed(b.allreduce_coalesced(tensors, opts))


def _broadcast(b: ProcessGroupODC, tensors: Any, root: int, root_tensor: int, _a: bool = True,
               timeout: int = -1) -> Any:
    opts = _opts(dist.BroadcastOptions, timeout, rootRank=root, rootTensor=root_tensor)
    return tensors, _boxed(b.broadcast(tensors, opts))


def _allgather(b: ProcessGroupODC, outs: Any, ins: Any, _a: bool = True, timeout: int = -1) -> Any:
    return outs, _boxed(b.allgather(outs, ins, _opts(AllgatherOptions, timeout)))


def _allgather_base(b: ProcessGroupODC, out: Any, inp: Any, _a: bool = True, timeout: int = -1) -> Any:
    return out, _boxed(b.all_gather_single(out, inp, _opts(AllgatherOptions, timeout)))


def _allgather_coalesced(b: ProcessGroupODC, outs: Any, ins: Any, _a: bool = True) -> Any:
    return _boxed(b.allgather_coalesced(outs, ins, AllgatherOptions()))


def _allgather_into_tensor_coalesced(b: ProcessGroupODC, outs: Any, ins: Any, _a: bool = True) -> Any:
    return _boxed(b.all_gather_single_coalesced(outs, ins, AllgatherOptions()))


def _reduce_scatter(b: ProcessGroupODC, outs: Any, ins: Any, op: Any, _a: bool = True, timeout: int = -1) -> Any:
    opts = _opts(dist.ReduceScatterOptions, timeout, reduceOp=_op(op, "reduce_scatter"))
    return outs, _boxed(b.reduce_scatter(outs, ins, opts))


def _reduce_scatter_base(b: ProcessGroupODC, out: Any, inp: Any, op: Any, _a: bool = True,
                         timeout: int = -1) -> Any:
    opts = _opts(dist.ReduceScatterOptions, timeout, reduceOp=_op(op, "reduce_scatter_single"))
    return out, _boxed(b.reduce_scatter_single(out, inp, opts))


def _reduce_scatter_tensor_coalesced(b: ProcessGroupODC, outs: Any, ins: Any, op: Any, _a: bool = True,
                                     timeout: int = -1) -> Any:
    opts = _opts(dist.ReduceScatterOptions, timeout, reduceOp=_op(op, "reduce_scatter_single_coalesced"))
    return _boxed(b.reduce_scatter_single_coalesced(outs, ins, opts))


def _reduce(b: ProcessGroupODC, tensors: Any, op: Any, root: int, root_tensor: int, _a: bool = True,
            timeout: int = -1) -> Any:
    opts = _opts(dist.ReduceOptions, timeout, reduceOp=_op(op, "reduce"), rootRank=root, rootTensor=root_tensor)
    return _boxed(b.reduce(tensors, opts))


def _gather(b: ProcessGroupODC, outs: Any, ins: Any, root: int, _a: bool = True, timeout: int = -1) -> Any:
    return _boxed(b.gather(outs, ins, _opts(dist.GatherOptions, timeout, rootRank=root)))


def _scatter(b: ProcessGroupODC, outs: Any, ins: Any, root: int, _a: bool = True, timeout: int = -1) -> Any:
    return outs, _boxed(b.scatter(outs, ins, _opts(dist.ScatterOptions, timeout, rootRank=root)))


def _alltoall(b: ProcessGroupODC, outs: Any, ins: Any, _a: bool = True, timeout: int = -1) -> Any:
    return outs, _boxed(b.alltoall(outs, ins, _opts(dist.AllToAllOptions, timeout)))


def _alltoall_base(b: ProcessGroupODC, out: Any, inp: Any, out_splits: Any, in_splits: Any, _a: bool = True,
                   timeout: int = -1) -> Any:
    opts = _opts(dist.AllToAllOptions, timeout)
    return _boxed(b.all_to_all_single(out, inp, list(out_splits), list(in_splits), opts))


def _barrier(b: ProcessGroupODC, _tensor: Any, device_ids: Any, _a: bool = True, timeout: int = -1) -> Any:
    return _boxed(b.barrier(_opts(dist.BarrierOptions, timeout, device_ids=list(device_ids))))


def _send(b: ProcessGroupODC, tensors: Any, dst: int, tag: int) -> Any:
    return _boxed(b.send(tensors, dst, tag))


def _recv(b: ProcessGroupODC, tensors: Any, src: int, tag: int) -> Any:
    return _boxed(b.recv(tensors, src, tag))


def _recv_any_source(b: ProcessGroupODC, tensors: Any, tag: int) -> Any:
    return _boxed(b.recv_anysource(tensors, tag))


#: ``c10d`` op -> its handler (every op of torch 2.11.0 but ``monitored_barrier_``, which reaches gloo).
HANDLERS: dict[str, Callable[..., Any]] = {
    "allreduce_": _allreduce,
    "allreduce_coalesced_": _allreduce_coalesced,
    "broadcast_": _broadcast,
    "allgather_": _allgather,
    "_allgather_base_": _allgather_base,
    "allgather_coalesced_": _allgather_coalesced,
    "allgather_into_tensor_coalesced_": _allgather_into_tensor_coalesced,
    "reduce_scatter_": _reduce_scatter,
    "_reduce_scatter_base_": _reduce_scatter_base,
    "reduce_scatter_tensor_coalesced_": _reduce_scatter_tensor_coalesced,
    "reduce_": _reduce,
    "gather_": _gather,
    "scatter_": _scatter,
    "alltoall_": _alltoall,
    "alltoall_base_": _alltoall_base,
    "barrier": _barrier,
    "send": _send,
    "recv_": _recv,
    "recv_any_source_": _recv_any_source,
}

_LIB: Any = None
_INSTALL_LOCK = threading.Lock()
#: The live OdcGroups, by token (each goes at its group's shutdown, or when the group is collected).
_LIVE: set[int] = set()
_TOKENS = itertools.count()


def _kernel(name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
    op = getattr(torch.ops.c10d, name).default
    at = next(i for i, a in enumerate(op._schema.arguments) if "ProcessGroup" in str(a.type))
    select = torch._C.DispatchKey.BackendSelect
    unbox = dist.ProcessGroup.unbox

    def kernel(keyset: Any, *args: Any) -> Any:
        group = unbox(args[at])
        if isinstance(group, OdcGroup):
            return handler(group.odc, *args[:at], *args[at + 1 :])
        return op.redispatch(keyset.remove(select), *args)

    return kernel


def install() -> None:
    """Registers the kernels (once while an :class:`OdcGroup` lives; see the module doc)."""
    with _INSTALL_LOCK:
        _install()


def _install() -> None:
    global _LIB  # noqa: PLW0603 - one registration per process
    if _LIB is not None:
        return
    lib = torch.library.Library("c10d", "IMPL")  # type: ignore[no-untyped-call]
    for name, handler in HANDLERS.items():
        lib.impl(name, _kernel(name, handler), "BackendSelect", with_keyset=True)  # type: ignore[no-untyped-call]
    _LIB = lib


def uninstall() -> None:
    """Removes the kernels: torch's dispatcher goes straight to the ``c10d`` ops' own kernels again."""
    with _INSTALL_LOCK:
        _uninstall()


def _uninstall() -> None:
    global _LIB
    lib, _LIB = _LIB, None
    if lib is not None:
        lib._destroy()


def installed() -> bool:
    """Whether the kernels are registered now."""
    return _LIB is not None


def _attach(group: OdcGroup) -> int:
    """Counts ``group`` live (the kernels registered) until its shutdown or collection; returns its token."""
    with _INSTALL_LOCK:
        key = next(_TOKENS)
        _LIVE.add(key)
        _install()
    weakref.finalize(group, _detach, key)
    return key


def _detach(key: int) -> None:
    """``key``'s group was shut down or collected: the kernels go with the last live group."""
    with _INSTALL_LOCK:
        if key in _LIVE:
            _LIVE.discard(key)
            if not _LIVE:
                _uninstall()
