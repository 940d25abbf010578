"""The torch.distributed backend ``"odc"``: all-gather and reduce-scatter on ODC.

``import odc`` registers the backend (:func:`register`), so
``dist.init_process_group("odc")`` works after it on every supported torch.
torch 2.14 and later also find it without any import, through the
``torch.distributed.backends`` entry point, which calls :func:`register`;
torch 2.11 to 2.13 do not read that entry point. :func:`odc.register` does
the same explicitly (it is idempotent). The backend is registered for CPU and CUDA tensors
(``devices=["cpu", "cuda"]``), so ``"odc"`` and ``"cpu:odc,cuda:odc"`` both
name it.

Dispatch. An ``odc`` group is reached as gloo's and nccl's are: torch's own
``ProcessGroup`` methods call the ``c10d`` ops (``torch.ops.c10d.allreduce_``,
``_allgather_base_``, ...) through the dispatcher, so ``CommDebugMode``,
``torch.profiler``, functional collectives and every other mode see the same
operations, under the same names, as on gloo. Where torch binds Python
backends (torch 2.15: the ``PyBackend`` trampoline), the group is a plain
``ProcessGroup`` and :class:`ProcessGroupODC` is its backend for CPU and CUDA
tensors (a ``torch._C._distributed_c10d.Backend``; ``group._get_backend(device)``
returns it). Where it does not (torch 2.11: ``Backend`` has no trampoline and
no constructor), the group is :class:`odc.backend._route.OdcGroup`, a
``ProcessGroup`` that overrides no collective and holds its
:class:`ProcessGroupODC`, and kernels registered for the ``c10d`` ops at the
``BackendSelect`` dispatch key hand its operations to it (see that module).
:func:`get_process_group` returns the :class:`ProcessGroupODC` of a group on
either.

:class:`ProcessGroupODC` runs the operations below on ODC's engines and the
others on an internal gloo backend on the group's store (under its own
``PrefixStore``), made with the group:

+------------------------------------------+---------------------------------------------+
| operation                                | runs on                                     |
+==========================================+=============================================+
| ``all_gather_single`` (alias             | ODC gather for dense f32 / bf16 / f16;      |
| ``all_gather_into_tensor``,              | other dtypes (int, bool, f64) and sparse    |
| ``_allgather_base``), ``*_coalesced``    | tensors: gloo                               |
+------------------------------------------+---------------------------------------------+
| ``allgather`` (list form)                | ODC when every output has the input's size  |
|                                          | and dtype (dense f32 / bf16 / f16); else    |
|                                          | gloo                                        |
+------------------------------------------+---------------------------------------------+
| ``reduce_scatter_single`` (alias         | ODC scatter-accumulate: SUM / AVG /         |
| ``reduce_scatter_tensor``,               | PREMUL_SUM on dense f32 / bf16 / f16; other |
| ``_reduce_scatter_base``),               | ops, dtypes and layouts, and the list form  |
| ``*_coalesced``, ``reduce_scatter``      | with a size per rank: gloo (which refuses   |
|                                          | what it does not run, PREMUL_SUM among it)  |
+------------------------------------------+---------------------------------------------+
| ``allreduce``, ``allreduce_coalesced``   | ODC reduce-scatter, then gather, for SUM /  |
|                                          | AVG / PREMUL_SUM on dense f32 / bf16 / f16  |
|                                          | (in place where the group's size divides    |
|                                          | the length of a contiguous tensor); other   |
|                                          | ops, dtypes and sparse tensors: gloo. With  |
|                                          | ``ODC_BACKEND_ELASTIC=1``: every all-reduce |
|                                          | on an elastic hybrid engine of the group's  |
|                                          | nodes, over the surviving nodes after a     |
|                                          | death, one membership decision per call, or |
|                                          | refused by name (:mod:`._elastic`)          |
+------------------------------------------+---------------------------------------------+
| ``broadcast``, ``barrier``, ``reduce``,  | gloo (CUDA tensors: on host copies)         |
| ``gather``, ``scatter``,                 |                                             |
| ``all_to_all_single``, ``send``,         |                                             |
| ``recv``, ``recv_anysource``,            |                                             |
| ``monitored_barrier``                    |                                             |
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

Debugging tools. The group's sequence number (``group._get_sequence_number_for_group()``, what torch's tools
compare across ranks) counts every collective it ran, on ODC or on gloo, one per call. ``monitored_barrier``
runs on the internal gloo backend and names the ranks that did not reach it. torch 2.15's Python-backend
trampoline forwards both by name (``PyBackend.hpp``: ``getSequenceNumberForGroup``, ``monitoredBarrier``); on
torch 2.11 the group forwards the first, and ``dist.monitored_barrier`` itself accepts gloo groups only
(``distributed_c10d.py``: ``if get_backend(group) != Backend.GLOO: raise ValueError``), so there the group's
own ``group.monitored_barrier(timeout)`` is the way.

Memory. A group reserves no ODC memory when it is created: its engines come
from :mod:`odc.backend._engines` at its first ODC operation on each device, and
every group of the same global ranks (and the same transport, bound and
deadline) shares them, so the default group, the groups of a device mesh and
the groups a test makes again and again cost one set of engines per rank set.
Groups that share engines still cannot cross, whatever order their threads
issue operations in: they take turns on the engines, every rank running the
same group's operation in each turn. From the second group of a rank set on,
the set's rank 0 decides the turns and posts each one in the store (a store
round trip per ODC operation, on every rank; a set with one group skips it;
see :mod:`odc.backend._engines`). The last group of a rank set to go
(``destroy_process_group``, or garbage collection) unmaps and unlinks them.

An engine's registration is collective (every rank registers the same buckets)
and a process group does not know its op sizes in advance, so each engine
registers scratch buckets and every op is cut
into pieces that fit them. The bound is ``ODC_BACKEND_SCRATCH_MB`` MiB per rank
(default 16): the largest piece of an op, and the largest bucket either engine
holds. On a host transport (``shm``, ``fabric``, ``shm+fabric``) the buckets are
sized by use: an engine is made with the shard classes the operation that needs
it takes, and made again, larger, by an operation that needs more (all ranks
decide alike: they run the same operations in the same order), once every
rank has left the previous one; so an engine set holds what its largest
operation needed, never more than the bound. On a device transport the engines
are made at the bound by the device's first operation (see *CUDA tensors*).

* all-gather engine (store prefix ``odc-e<n>-ag``): buckets of 2-byte words, one
  per shard class (4 KiB, 16 KiB, ... ×4, up to the class the largest op needed,
  at most the bound), so a small op does not copy a large bucket; an op of any
  of the supported dtypes travels as its bytes (bit for bit). Its landing slots
  are 4 KiB (it never pushes). Op piece ``i`` on a bucket publishes version
  ``i``, gathers it and releases it; ``publish`` itself waits until every reader
  released ``i - 1``. ``publish`` needs exactly ``shard_len`` elements, so a piece
  shorter than its bucket's shard is first copied into a staging shard, and
  the gathered bucket (``D · shard_len``) is copied out into the output's
  rows (skipped when the op fills its bucket exactly).
* reduce-scatter engine (store prefix ``odc-e<n>-rs``): two buckets whose shard
  holds the largest piece seen (f32 accumulators of that many elements, up to
  the bound in f32; the shards themselves are never published and take 2 bytes
  an element), landing slots as large as its largest row (at most 2 MiB). Each
  owner's row of a piece is pushed in place (``scatter_accumulate`` with an
  explicit offset into the owner's shard), with no copy. Op piece ``k`` pushes
  each owner's row into bucket ``k % 2``, calls ``finish_minibatch(k)``, reads
  its own shard into the output (cast to the output dtype: bf16/f16 accumulate
  in f32) and zeroes it (a host engine zeroes what it read; a device engine
  zeroes the shard with ``zero_grad``, on its daemon's stream after the read, so
  later additions queue behind it). Alternating buckets makes this safe without
  a barrier: a peer pushes into the same bucket again only for piece ``k + 2``,
  after its ``finish_minibatch(k + 1)`` returned, which needs this rank's
  ``finish_minibatch(k + 1)``, which this rank calls only after it read and
  zeroed piece ``k``.

What a group costs, 2 ranks on one host, per rank (measured): nothing at rest
(its gloo backend aside, 0.2 MiB); after a 4 KiB all-gather, 28 KiB of
/dev/shm and 4 MiB of RSS (the engine's daemon and mappings); after a 64 MiB
all-gather, 21 MiB of /dev/shm (the classes up to 16 MiB) and, besides, the
peer's shards mapped (21 MiB) and the gathered pieces' buffer (32 MiB); a
64 MiB reduce-scatter adds 24 MiB of /dev/shm (landing slots and shards) and
32 MiB of accumulators. A group spanning nodes adds libfabric's endpoint to
each engine (~85 MiB of RSS each on the tcp provider).

An operation that makes an engine waits for every rank of the group in the
store: a rank that died before it shows as a :class:`odc.StoreError` naming the
missing key, after the group's timeout; once the engines exist, a dead peer is
a :class:`odc.PeerError` naming it.

Two engines, because ``finish_minibatch(k)`` releases every bucket at version
``k``: on one engine that release would run ahead of the all-gather versions.

CUDA tensors. The first ODC operation on a CUDA tensor creates the CUDA
pair on that tensor's device, collectively: every rank issues the group's
collectives in the same order, so every rank creates it in the same call.
It holds the scratch buckets at the bound in device memory (a device engine
is never made again larger: a peer's stream may still read the old one after
its host moved on, and an ``nvshmem`` heap is fixed when it starts). Its transport is
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
engines that emulate cuda-ipc (nvshmem) on CPU tensors, at the bound as a device pair, and CPU tensors take
the CUDA pair's code path (operations on the engine's stream, the finish on
the device, accumulator reads and zeroing through the engine): that is how a
machine without a GPU runs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._c10d import python_backends
from ._engines import DEFAULT_SCRATCH_MB, SCRATCH_ENV, scratch_bytes
from ._group import BACKEND_NAME, NotAnOdcGroup, NotInitialized, ProcessGroupODC, UnsupportedCollective

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
def _create(opts: Any, _backend_options: Any) -> Any:
    """torch's backend creator (extended API): the group's :class:`ProcessGroupODC`, which torch registers
    as the backend of a new ``ProcessGroup`` for CPU and CUDA tensors; where torch has no Python backends,
    the group itself (:class:`odc.backend._route.OdcGroup`), holding it."""
    ranks = list(opts.global_ranks_in_group) or None  # empty for the default group: every rank
    if python_backends():
        return ProcessGroupODC(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks)
    from ._route import OdcGroup

    return OdcGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks)


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
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    _registered = True


def _backend_of(group: Any) -> ProcessGroupODC | None:
    if isinstance(group, ProcessGroupODC):
        return group
    held = getattr(group, "odc", None)  # odc.backend._route.OdcGroup
    if isinstance(held, ProcessGroupODC):
        return held
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None
    return backend if isinstance(backend, ProcessGroupODC) else None


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
    found = _backend_of(pg)
    if found is None:
        raise NotAnOdcGroup(
            f"odc.backend: group {pg!r} uses backend {dist.get_backend(pg)!r}, not 'odc'; "
            'create it with init_process_group("odc") or new_group(backend="odc")'
        )
    return found
