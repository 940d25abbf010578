"""The torch.distributed backend ``"odc"``: all-gather and reduce-scatter on ODC.

``import odc`` registers the backend (:func:`register`), so
``dist.init_process_group("odc")`` works after it on every supported torch.
torch 2.14 and later also find it without any import, through the
``torch.distributed.backends`` entry point, which calls :func:`register`;
torch 2.11 to 2.13 do not read that entry point. :func:`odc.register` does
the same explicitly (it is idempotent). The backend is registered for CPU and CUDA tensors
(``devices=["cpu", "cuda"]``), so ``"odc"`` and ``"cpu:odc,cuda:odc"`` both
name it.

The group is a Python ``ProcessGroup`` (:class:`ProcessGroupODC`). It owns a
pair of :class:`odc.Engine` instances for CPU tensors, created and registered
eagerly and collectively when the group is created, a second pair for CUDA
tensors created on first use (see *CUDA tensors* below), and an internal
gloo backend on the same store (under its own ``PrefixStore``) for the
operations ODC has no verb for:

+------------------------------------------+---------------------------------------------+
| operation                                | runs on                                     |
+==========================================+=============================================+
| ``all_gather_single`` (alias             | ODC gather for f32 / bf16 / f16;            |
| ``all_gather_into_tensor``,              | other dtypes (int, bool, f64): gloo         |
| ``_allgather_base``), ``*_coalesced``    |                                             |
+------------------------------------------+---------------------------------------------+
| ``allgather`` (list form)                | ODC when every output has the input's size  |
|                                          | and dtype (f32 / bf16 / f16); else gloo     |
+------------------------------------------+---------------------------------------------+
| ``reduce_scatter_single`` (alias         | ODC scatter-accumulate: SUM / AVG /         |
| ``reduce_scatter_tensor``,               | PREMUL_SUM on f32 / bf16 / f16; anything    |
| ``_reduce_scatter_base``),               | else raises :class:`UnsupportedCollective`  |
| ``*_coalesced``, ``reduce_scatter``      | (op) or :class:`odc.LayoutError` (dtype)    |
+------------------------------------------+---------------------------------------------+
| ``allreduce``, ``allreduce_coalesced``   | ODC reduce-scatter, then gather, for SUM /  |
|                                          | AVG / PREMUL_SUM on f32 / bf16 / f16;       |
|                                          | other ops and dtypes: gloo                  |
+------------------------------------------+---------------------------------------------+
| ``broadcast``, ``barrier``, ``reduce``,  | gloo (CUDA tensors: on host copies)         |
| ``gather``, ``scatter``,                 |                                             |
| ``all_to_all_single``, ``send``,         |                                             |
| ``recv``, ``recv_anysource``             |                                             |
+------------------------------------------+---------------------------------------------+
| ``alltoall`` (list form)                 | gloo's ``all_to_all_single`` over flat      |
|                                          | buffers (one dtype; gloo has no list form   |
|                                          | on torch 2.11)                              |
+------------------------------------------+---------------------------------------------+

ODC collectives on CPU tensors complete before they return (the returned
Work is already done); on CUDA tensors they are enqueued on the current
stream (see below). Delegated ones return gloo's own Work (on CUDA tensors, a
Work that copies the results back). Every tensor of one operation must be on
one device, else :class:`odc.LayoutError`. ``ProcessGroupODC.op_counts``
counts which ran where.

Scratch buckets. Registration is eager and collective, but a process group
does not know its op sizes in advance, so each engine registers fixed scratch
buckets and every op is cut into pieces that fit them. The per-rank shard
capacity is ``ODC_BACKEND_SCRATCH_MB`` MiB (default 16), in each pair:

* all-gather engine (store prefix ``odc-ag``, ``odc-ag-cuda``): per dtype,
  buckets whose shard is 4 KiB, 16 KiB, ... (×4) up to the capacity, so a
  small op does not copy a 16 MiB bucket. Op piece ``i`` on a bucket publishes version ``i``, gathers
  it and releases it; ``publish`` itself waits until every reader released
  ``i - 1``. ``publish`` needs exactly ``shard_len`` elements, so a piece
  shorter than its bucket's shard is first copied into a staging shard, and
  the gathered bucket (``D · shard_len``) is copied out into the output's
  rows (skipped when the op fills its bucket exactly).
* reduce-scatter engine (store prefix ``odc-rs``, ``odc-rs-cuda``): two f32
  buckets whose shard holds the capacity in f32. Each owner's row of a piece
  is pushed in place (``scatter_accumulate`` with an explicit offset into the
  owner's shard), with no copy. Op piece ``k`` pushes each owner's row into
  bucket ``k % 2``, calls ``finish_minibatch(k)``, reads its own shard into
  the output (cast to the output dtype: bf16/f16 accumulate in f32) and
  zeroes it (a host engine zeroes what it read; a device engine zeroes the
  shard with ``zero_grad``, on its daemon's stream after the read, so later
  additions queue behind it). Alternating buckets makes this safe without a
  barrier: a peer pushes into the same bucket again only for piece ``k + 2``,
  after its ``finish_minibatch(k + 1)`` returned, which needs this rank's
  ``finish_minibatch(k + 1)``, which this rank calls only after it read and
  zeroed piece ``k``.

Two engines, because ``finish_minibatch(k)`` releases every bucket at version
``k``: on one engine that release would run ahead of the all-gather versions.

CUDA tensors. The first ODC operation on a CUDA tensor creates the CUDA
pair on that tensor's device, collectively: every rank issues the group's
collectives in the same order, so every rank creates it in the same call.
It holds the same scratch buckets in device memory. Its transport is
``cuda-ipc`` when the group's ranks are on one node and ``nvshmem`` when they
span several; ``ODC_TRANSPORT`` naming either one overrides that choice (the
CPU pair then stays on ``auto``), and any other name sets the CPU pair's
transport. Under ``nvshmem`` both engines share the process's one NVSHMEM
session, whose heap is fixed when it starts: the all-gather engine starts it
with the reduce-scatter engine's regions planned in (``heap_reserve``,
computed by :func:`odc.engine.heap_bytes`). Another ``nvshmem`` engine of
the process created before the pair (``odc.fsdp.enable``'s) leaves no room
for it, and the pair's creation raises :class:`odc.ConfigError` naming the
numbers. The pair stays on its device: an operation on another CUDA device
raises :class:`odc.LayoutError` naming both.

An ODC operation on CUDA tensors is enqueued on the current stream of their
device, as a kernel launch is, and its Work's ``wait()`` makes the caller's
current stream wait for that stream. An operation issued on another stream
than the previous one first makes its stream wait for the previous one (the
scratch buffers are reused). The cost: every reduce-scatter piece (so every
reduce-scatter and all-reduce) ends in ``finish_minibatch``, which on a
device engine blocks the host until the stream has drained, so each piece
synchronizes the host with the GPU once. The operations delegated to gloo run
on host copies of CUDA tensors: the inputs are copied to host memory (which
waits for the stream), gloo runs there, and the Work's ``wait()`` copies the
outputs back. Every delegated operation thus works on CUDA tensors without
NCCL, at the price of a copy each way.

With ``ODC_TRANSPORT=emu-ipc`` (or ``emu-shmem``) the CPU pair is made of
engines that emulate cuda-ipc (nvshmem) on CPU tensors, and CPU tensors take
the CUDA pair's code path (operations on the engine's stream, the finish on
the device, accumulator reads and zeroing through the engine): that is how a
machine without a GPU runs it.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

from ._group import (
    BACKEND_NAME,
    DEFAULT_SCRATCH_MB,
    SCRATCH_ENV,
    NotAnOdcGroup,
    NotInitialized,
    ProcessGroupODC,
    UnsupportedCollective,
    scratch_bytes,
)

__all__ = [
    "BACKEND_NAME",
    "DEFAULT_SCRATCH_MB",
    "SCRATCH_ENV",
    "NotAnOdcGroup",
    "NotInitialized",
    "ProcessGroupODC",
    "UnsupportedCollective",
    "get_process_group",
    "register",
    "scratch_bytes",
]


# Public classes answer to their public module (reprs, pickles, docs).
for _cls in (ProcessGroupODC, NotAnOdcGroup, NotInitialized, UnsupportedCollective):
    _cls.__module__ = __name__
del _cls


# -- registration ------------------------------------------------------------------
def _create(store: Store, rank: int, world_size: int, timeout: datetime.timedelta) -> ProcessGroupODC:
    return ProcessGroupODC(store, rank, world_size, timeout)


_registered = False


def register() -> None:
    """Registers the backend ``"odc"`` with torch.distributed (idempotent).

    torch calls this through the ``torch.distributed.backends`` entry point
    on ``init_process_group("odc")``; call it yourself where entry points are
    not installed (a source checkout on ``sys.path``).
    """
    global _registered  # noqa: PLW0603 - one registration per process
    if _registered:
        return
    plugins = getattr(dist.Backend, "_plugins", {})
    if BACKEND_NAME.upper() not in plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
    _registered = True


def get_process_group(group: dist.ProcessGroup | None = None) -> ProcessGroupODC:
    """The :class:`ProcessGroupODC` behind ``group`` (default: the default group).

    Raises:
        NotInitialized: torch.distributed is not initialized; the message
            says what to call.
        NotAnOdcGroup: ``group`` (or the default group) is not an ``odc``
            group.
    """
    if not dist.is_initialized():
        raise NotInitialized(
            "odc.backend: torch.distributed is not initialized; "
            'call torch.distributed.init_process_group("odc") first'
        )
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupODC):
        raise NotAnOdcGroup(
            f"odc.backend: group {pg!r} uses backend {dist.get_backend(pg)!r}, not 'odc'; "
            'create it with init_process_group("odc") or new_group(backend="odc")'
        )
    return pg
