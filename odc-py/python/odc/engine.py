"""The worker API on torch tensors: :class:`Engine`.

One :class:`Engine` per rank. It owns this rank's shard server daemon (a
native thread) and talks to peers through shared memory on the same node
and libfabric RMA across nodes. The rendezvous
store is torch's own (``dist.TCPStore`` / ``dist.FileStore``, or the default
group's store after ``init_process_group``).

Typical minibatch, on every rank::

    eng = Engine(store, rank, world_size)
    eng.register([Bucket("block0", numel, torch.bfloat16), ...])  # collective, eager
    eng.publish("block0", my_shard, version=0)
    full = torch.empty(numel, dtype=torch.bfloat16)
    eng.gather("block0", version=0, out=full)           # read every owner's shard
    eng.scatter_accumulate("block0", grads, scale=1/D)  # push, do not wait
    eng.finish_minibatch(0)                              # own gradient shards final
    g = eng.grad_shard("block0")                         # f32 view of the accumulator

Every call that may block releases the GIL; every wait has a deadline and
raises :class:`odc.PeerTimeout` / :class:`odc.PeerDied` naming the peer.

Threads. Because calls run without the GIL, a tensor handed to a call must
not be written (nor, for an output such as ``gather``'s, read) by another
thread until the call returns, as with torch's own kernels. The engine keeps
every tensor it was handed alive for the call.

Device transports. With ``transport="cuda-ipc"`` (one node of GPUs) the
published shards, landing slots and accumulators live in CUDA memory shared
between the node's processes, and the same calls take CUDA tensors on the
engine's device: each one enqueues its copies (and the signals that announce
them) on ``torch.cuda.current_stream(tensor.device)`` and returns before they
run, as a torch kernel launch does, so the data is ready for later work on
that stream. :meth:`Engine.finish_minibatch` first makes the current stream
wait for every stream the engine enqueued on since the previous finish, then
waits for it on the host. ``transport="nvshmem"`` does the same for GPUs on
several nodes, with the data on NVSHMEM's symmetric heap.
``transport="emu-ipc"`` / ``"emu-shmem"`` run the same device code paths on
CPU tensors (host memory for device memory, host threads for streams; see
:class:`Engine`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from . import _odc
from .deadline import deadline_for
from .errors import ConfigError, LayoutError, MalformedError, OdcError, PeerTimeout, ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["CUDA_TRANSPORTS", "DEVICE_TRANSPORTS", "TRANSPORTS", "Bucket", "Engine", "dtype_name", "heap_bytes"]

_elastic_log = logging.getLogger("odc.elastic")
_DTYPE_NAMES = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


def dtype_name(dtype: Any) -> str:
    """ODC's name (``f32``, ``bf16``, ``f16``) of a torch dtype or dtype string."""
    key = str(dtype)
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    if key in ("f32", "bf16", "f16"):
        return key
    raise LayoutError(f"unsupported dtype {dtype}: ODC moves float32, bfloat16 and float16")


@dataclass(frozen=True)
class Bucket:
    """One flat tensor group: ``numel`` elements of ``dtype`` (parameter dtype)."""

    name: str
    numel: int
    dtype: Any

    def spec(self) -> tuple[str, int, str]:
        """``(name, numel, dtype name)``, as the native engine takes a bucket.

        Raises:
            LayoutError: ``numel`` is not a positive integer, or the dtype is not one ODC moves.
        """
        if not isinstance(self.numel, int) or self.numel < 1:
            raise LayoutError(f"bucket {self.name!r}: numel must be a positive integer, got {self.numel!r}")
        return (str(self.name), int(self.numel), dtype_name(self.dtype))


BucketRef = int | str


def _buffer(t: torch.Tensor, what: str) -> tuple[int, int, str]:
    if t.device.type != "cpu":
        raise LayoutError(f"{what} is on {t.device}; the shared-memory transport moves CPU tensors")
    if not t.is_contiguous():
        raise LayoutError(f"{what} is not contiguous")
    return t.data_ptr(), t.numel() * t.element_size(), dtype_name(t.dtype)


TRANSPORTS = ("auto", "shm", "fabric", "mixed", "cuda-ipc", "emu-ipc", "nvshmem", "emu-shmem")
"""The transport names :class:`Engine` accepts."""
DEVICE_TRANSPORTS = ("cuda-ipc", "emu-ipc", "nvshmem", "emu-shmem")
"""Transports whose data lives in device memory (their calls take a stream)."""
CUDA_TRANSPORTS = ("cuda-ipc", "nvshmem")
"""Transports whose calls take CUDA tensors (the others' take CPU tensors)."""


def transport_name(name: str | None) -> str | None:
    """A transport name as the engine reads it (``CUDA_IPC`` → ``cuda-ipc``, ``shm+fabric`` → ``mixed``)."""
    if name is None:
        return None
    key = str(name).strip().lower().replace("_", "-")
    return "mixed" if key == "shm+fabric" else key


def heap_bytes(
    buckets: Iterable[Bucket],
    world_size: int,
    *,
    local_world_size: int | None = None,
    chunk_bytes: int | None = None,
    sharding: str | None = None,
) -> int:
    """Symmetric-heap bytes an ``nvshmem`` engine with these arguments takes for ``buckets``: what an earlier
    engine of the same process reserves for it (``Engine(..., heap_reserve=...)``)."""
    return _odc.heap_bytes(
        [b.spec() for b in buckets],
        int(world_size),
        local_world_size=local_world_size,
        chunk_bytes=chunk_bytes,
        sharding=sharding,
    )


def _emu_jitter_us() -> int:
    raw = os.environ.get("ODC_EMU_JITTER_US", "").strip()
    if not raw:
        return 0
    try:
        jitter = int(raw)
    except ValueError:
        raise ConfigError(f"ODC_EMU_JITTER_US={raw!r}: expected a whole number of microseconds") from None
    if jitter < 0:
        raise ConfigError(f"ODC_EMU_JITTER_US={raw!r}: expected a whole number of microseconds")
    return jitter


class _NotingDeadline:
    """The native engine; a :class:`odc.PeerTimeout` from any of its calls gets a note naming the
    deadline and where it came from (``timeout=``, ``ODC_TIMEOUT_S``, a process group's timeout)."""

    __slots__ = ("_native", "_note")

    def __init__(self, native: Any, note: str) -> None:
        self._native = native
        self._note = note

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._native, name)
        if not callable(attr):
            return attr
        note = self._note

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except PeerTimeout as e:
                e.add_note(note)
                raise

        return call


class _CudaArray:
    """A CUDA buffer for ``torch.as_tensor`` (``__cuda_array_interface__`` v3), keeping its owner alive."""

    def __init__(self, ptr: int, numel: int, owner: Any) -> None:
        self._owner = owner
        # stream None: no synchronization on import (the engine's finish
        # already waited for every add into the accumulator).
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": "<f4",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


COMPRESS_KEYS = ("push", "gather", "block", "feedback", "scope")


def compress_args(compress: Mapping[str, Any] | None) -> tuple[str | None, str | None, int, bool, str] | None:
    """Checks a ``compress=`` setting and returns what the native engine takes.

    Args:
        compress: ``None`` (nothing compressed) or a mapping with the keys
            ``push`` / ``gather`` (a format name: ``"bf16"``, ``"fp8"`` or
            ``"int8"``, or ``None``), ``block`` (elements per scale, a
            multiple of 16; default 32), ``feedback`` (error feedback on
            pushes; default ``True``) and ``scope`` (``"cross-node"``, the
            default, or ``"all"``).

    Returns:
        ``(push, gather, block, feedback, scope)``, or ``None``.

    Raises:
        ConfigError: an unknown key or format, a block size the formats
            cannot take, or a value of the wrong type.
    """
    if compress is None:
        return None
    if not isinstance(compress, Mapping):
        raise ConfigError(f"compress={compress!r}: expected a dict with keys {', '.join(COMPRESS_KEYS)}")
    unknown = sorted(set(compress) - set(COMPRESS_KEYS))
    if unknown:
        raise ConfigError(f"compress: unknown key(s) {unknown}: expected some of {', '.join(COMPRESS_KEYS)}")
    formats = []
    for key in ("push", "gather"):
        v = compress.get(key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"compress {key}={v!r}: expected a format name (bf16, fp8, int8) or None")
        formats.append(v)
    block = compress.get("block", 32)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ConfigError(f"compress block={block!r}: expected a positive multiple of 16")
    for key, fmt in zip(("push", "gather"), formats, strict=True):
        if fmt is not None:
            try:  # the native check: the format's name, the block size
                _odc.quant_sizes(fmt, int(block), 0)
            except ConfigError as e:
                raise ConfigError(f"compress {key}={fmt!r}, block={block}: {e}") from None
    scope = compress.get("scope", "cross-node")
    if not isinstance(scope, str):
        raise ConfigError(f"compress scope={scope!r}: expected \"cross-node\" or \"all\"")
    return formats[0], formats[1], int(block), bool(compress.get("feedback", True)), scope


def check_engine_options(*, compress: Mapping[str, Any] | None, cross_node: str | None, deterministic: bool) -> None:
    """Refuses the combinations of :class:`Engine` settings that deterministic mode cannot keep, before an engine
    is made (the engine refuses them too, with its own words, when it is made).

    Args:
        compress: the ``compress=`` setting (``None``: nothing compressed).
        cross_node: the ``cross_node=`` setting (``None``: the default).
        deterministic: the ``deterministic=`` setting.

    Raises:
        ConfigError: ``compress`` with ``deterministic=True``, or ``cross_node="node"`` with
            ``deterministic=True``.
    """
    if not deterministic:
        return
    if compress is not None:
        raise ConfigError("compress with deterministic=True: compressed sums are not bitwise reproducible across "
                          "schedules; drop one")
    if cross_node == "node":
        raise ConfigError("cross_node='node' with deterministic=True: the node sums add in arrival order; use "
                          "'direct' or 'auto'")


def _local_world_size(store: Any, rank: int, world: int, prefix: str) -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE`` when this engine spans the whole job
    (``WORLD_SIZE`` unset or equal to ``world``), else from every rank's host name."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env and os.environ.get("WORLD_SIZE") in (None, str(world)):
        try:
            g = int(env)
        except ValueError:
            raise ConfigError(f"LOCAL_WORLD_SIZE={env!r} is not an integer") from None
        if g < 1 or world % g != 0:
            raise ConfigError(f"LOCAL_WORLD_SIZE={g} does not divide the world size {world}")
        return g
    if world == 1:
        return 1
    store.set(f"{prefix}/hosts/{rank}", socket.gethostname())
    keys = [f"{prefix}/hosts/{r}" for r in range(world)]
    # One request for every rank's host where the store batches reads (torch's stores do):
    # a job of D ranks then sends its store O(D) reads here, not O(D²).
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    hosts = [bytes(v).decode() for v in values]
    g = hosts.count(hosts[0])
    blocks = [hosts[i : i + g] for i in range(0, world, g)]
    if world % g != 0 or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ConfigError(
            "ranks are not placed node-major with the same count per host "
            f"(hosts by rank: {hosts}); pass local_world_size= or set LOCAL_WORLD_SIZE"
        )
    return g


def _route_to_master() -> str | None:
    """This host's address on the route to ``MASTER_ADDR`` (no packet is sent)."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            addr: str = s.getsockname()[0]
            return addr
    except OSError:
        return None


def _enter_generation(store: Any, prefix: str, make: Callable[[], Engine]) -> tuple[Engine | None, str]:
    """This rank's part of beginning the elastic generation under ``prefix``: ``make()`` builds and registers its
    engine, then every rank of the generation proposes whether it goes ahead, and the first proposal stands.
    Returns the engine, or ``None`` and why when the generation was abandoned; re-raises this rank's own
    registration error when the others went ahead without it."""
    try:
        eng: Engine | None = make()
        failed: OdcError | None = None
    except OdcError as e:
        eng, failed = None, e
    if not _odc.decide_generation(store, prefix, eng is not None):
        return None, (f"{type(failed).__name__}: {failed}" if failed else "another rank did not register in time")
    if failed is not None:
        raise failed
    return eng, ""


def _await_extra(store: Any, key: str, source: int, rank: int, wait_s: float) -> bytes:
    """A joining rank waits (up to ``wait_s``) for the bytes its source serves beside its state
    (``Engine.admit(extra=...)``, at the source's first operation of the new generation where ``extra`` is a
    function); raises the source's error where it served one."""
    deadline = time.perf_counter() + wait_s
    nap = 0.001
    while not store.check([key]):
        if time.perf_counter() >= deadline:
            raise PeerTimeout(
                f"rejoin: rank {rank} waited {wait_s:g} s for what rank {source} serves beside its replica state "
                "(a learning rate, a loss scale: served as its next minibatch starts, at its first publish, push "
                "or finish): it served the tensors, then did not start the next minibatch",
                peer=source,
            )
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
    raw = bytes(store.get(key))
    if raw[:1] == b"!":
        raise ProtocolError(f"rejoin: rank {source}, whose replica rank {rank} copies, could not serve what it "
                            f"serves beside its state: {raw[1:].decode(errors='replace')}")
    if raw[:1] != b"+":
        raise MalformedError(f"rejoin: rank {source}'s extra state starts with {raw[:1]!r}, not b'+' or b'!'")
    return raw[1:]


class Engine:
    """One rank's ODC engine (shard server daemon + worker API).

    Args:
        store: torch ``dist.Store`` shared by every rank (TCPStore, FileStore,
            or ``dist.distributed_c10d._get_default_store()``).
        rank: this rank.
        world_size: number of ranks D.
        local_world_size: ranks per node G; ranks are numbered node-major
            (node n holds ranks n·G … n·G+G−1). Default: ``LOCAL_WORLD_SIZE``
            (set by torchrun) when the engine spans the whole job, else
            inferred from the ranks' host names through ``store``.
        chunk_bytes: landing-slot size (bytes); landing memory is
            ``2 · D · chunk_bytes`` per rank (``2 · G · chunk_bytes`` under
            hybrid sharding). Default: the engine's.
        timeout: seconds any wait on a peer may take (default
            ``ODC_TIMEOUT_S``, else 300); a :class:`odc.PeerTimeout` carries a
            note naming the deadline and where it came from.
        job_key: names this job's shared-memory segments so a restart of the
            same job removes a crashed run's leftovers (default
            ``ODC_JOB_KEY`` or ``"default"``).
        prefix: store key prefix, so several engines can share one store.
        transport: ``"auto"`` (the default: shared memory between ranks of
            a node, libfabric RMA between nodes), ``"shm"`` (every rank on
            this host), ``"fabric"`` (libfabric between every pair) or
            ``"mixed"`` (as auto, also on one node), all on CPU tensors;
            ``"cuda-ipc"`` (one node of GPUs: data in CUDA memory shared
            between the node's processes; calls take CUDA tensors on
            ``device`` and run on the current CUDA stream), ``"nvshmem"``
            (GPUs on any number of nodes: the same, with data on NVSHMEM's
            symmetric heap; full sharding only across nodes), or
            ``"emu-ipc"`` / ``"emu-shmem"`` (their code paths on CPU
            tensors: see below).
            ``ODC_FABRIC_ADDR`` / ``ODC_FABRIC_PROVIDER`` choose libfabric's
            address and provider; without ``ODC_FABRIC_ADDR`` a multi-node
            job binds the address that routes to ``MASTER_ADDR``. Default:
            ``ODC_TRANSPORT``, else ``"auto"``.
        sharding: ``"full"`` (shard every bucket over all D ranks; the
            default), ``"hybrid"`` (shard over the G ranks of a node;
            gathers and pushes stay inside the node and
            :meth:`finish_minibatch` sums the gradient shards across nodes
            once, so :meth:`grad_shard` holds the sum over every rank), or
            ``"hybrid-zero"`` (ZeRO++-style: gathers and pushes stay inside
            the node as under ``"hybrid"``, but each rank owns only a 1/D
            *piece* of the bucket, block ``rank`` of D equal blocks
            (``bucket(b)["piece_len"]`` elements): :meth:`publish` takes the
            piece, :meth:`finish_minibatch` reduces only this piece across
            nodes and :meth:`grad_shard` is its sum over every rank, so the
            optimizer state is 1/D. Every rank publishes the same versions
            of the buckets in the same order; host transports only).
        device: the CUDA device of a ``cuda-ipc`` / ``nvshmem`` engine (an ordinal or a
            ``torch.device``). Default: ``torch.cuda.current_device()``
            where CUDA is available, else the local rank (and creating the
            engine raises :class:`odc.GpuUnavailable`). Ignored by the other
            transports.
        heap_reserve: ``nvshmem`` only: symmetric-heap bytes to plan beyond
            this engine's regions for the engines this process creates later
            in the job, which share its NVSHMEM session (a process holds one,
            its heap fixed when it starts): the sum of :func:`heap_bytes` of
            those engines. Default 0.
        deterministic: accumulate gradients exactly, so that
            :meth:`grad_shard` after :meth:`finish_minibatch` is the same
            bits whatever the order pushes arrive in and whichever rank
            pushed which contribution. The daemon turns every contribution
            ``scale · x`` into a fixed-point integer of 2^-72 units (an
            extra 16 bytes per accumulator element) and
            :meth:`finish_minibatch` reads the integer sums out as the nearest
            f32s. Every ``|scale · x|`` must be below 2^39 (else
            :meth:`finish_minibatch` raises a ``ProtocolError`` naming the
            bucket); infinities and NaNs propagate as in an f32 sum. The
            integer sums go on until :meth:`zero_grad`: a minibatch finished
            again without it reads out the exact sum of both, rounded once.
            Under hybrid sharding across nodes the cross-node sum adds every
            node's integer sums too (the replicas read them: 16 more bytes
            per element of the accumulator region and of each cross-node
            read), so the bits do not depend on which node ran which
            contribution either.
            Host transports only; equal on every rank.
        cross_node: how gradients for owners on other nodes cross the
            network under full sharding: ``"direct"`` (every rank pushes its
            chunks to every remote owner itself, overlapped with the
            backward), ``"node"`` (node-mates' chunks for a remote owner are
            summed on the node, by the daemon of the node-mate with the
            owner's local rank, and each remote owner gets its node's sum
            once, when the node's last rank finished the minibatch: G times
            fewer bytes across the link, for waiting on the node's slowest
            rank; ``(N − 1)`` times this rank's gradient-shard memory in f32
            node buffers; not with ``deterministic=True``) or ``"auto"``
            (the default, ``ODC_CROSS_NODE``: ``"node"`` where the nodes are
            joined by a network, ``"direct"`` on one host, on ``nvshmem``
            (not measured there yet) or where it cannot apply). Equal on every rank. :attr:`cross_node` says what runs.
        node_cache_mb: the per-node bound in MiB of the node cache of remote
            shards (full sharding across nodes): the first rank of a node
            that gathers a version of a shard owned on another node fetches
            it into node shared memory, and its node-mates read it from there
            (least recently used pieces evicted beyond the bound; ``0`` turns
            it off; fractions of a MiB are allowed). Default
            ``ODC_NODE_CACHE_MB``, else 1024 where nodes are joined by a
            network and off on ``shm``. On ``nvshmem`` the slots are device
            memory and nothing is evicted: the cache holds every remote
            shard, or none beyond the default bound; a smaller explicit
            bound raises ``ConfigError`` naming the MiB needed. Equal on
            every rank.
        elastic: elastic hybrid sharding (``sharding="hybrid"`` over several
            nodes only; a ``ConfigError`` under the other shardings, where one
            copy of a shard or of its optimizer state dies with its rank).
            When a rank dies, its node is dropped at the end of that
            minibatch: every surviving node's :meth:`finish_minibatch`
            returns the sum over the surviving nodes (the dead node's
            microbatches of that minibatch are dropped), the dead node's
            other ranks raise :class:`~odc.errors.NodeDropped`, and the job
            goes on; :attr:`members` and :meth:`elastic_events` say what
            happened, and each drop is logged on the ``odc.elastic`` logger.
            Equal on every rank. See the elastic page of the docs.
        members: elastic only: the nodes this engine starts with (default
            every node); a generation begun by :meth:`admit` or
            :meth:`rejoin` passes them. Equal on every member rank.
        register_timeout: seconds joining the job and registering may wait
            for the other ranks (default ``timeout``).
        compress: compressed chunks (default ``None``: every byte moves as
            it is). A dict: ``push`` (``"bf16"``, ``"fp8"`` or ``"int8"``):
            pushed gradient chunks carry that format with one f32 scale per
            ``block`` elements (default 32; blocks never straddle a shard),
            and the owner's daemon adds them into its f32 accumulator in
            one pass; ``feedback`` (default ``True``): the pusher keeps each
            shard's quantisation residual and adds it into its next push of
            the same elements, so over a run nothing is lost; ``scope``:
            ``"cross-node"`` (the default: only chunks whose landing slot is
            on another node, e.g. the node sums under ``cross_node="node"``)
            or ``"all"`` (every push; for tests on one host). ``gather``
            (``"fp8"``, ``"bf16"`` or ``"int8"``): each owner makes a
            quantised copy of its shard once per version (at its publish,
            before the version is visible; about a quarter of the shard's
            f32 bytes for fp8 and int8, plus a scale per ``block``), and
            gathers read that copy instead of the shard where ``scope``
            says (``"cross-node"``: only shards owned on another node, e.g.
            the node cache's fetches; ``"all"``: every other rank's shard),
            dequantised into the output (the node cache keeps the quantised
            bytes). A rank's own shard is never read compressed. Under
            either hybrid sharding across nodes, ``push`` also compresses
            the end-of-minibatch sum across nodes (whatever ``scope``): each
            rank quantises its node's partial sums once (with ``feedback``,
            plus the residual it kept), and every node adds every node's
            dequantised copy in node order, so the replicas keep the same
            bits; under ``hybrid-zero``, ``gather`` compresses the copies of
            the updated parameter pieces that cross at each publish.
            ``deterministic=True`` and the device transports raise
            ``ConfigError``, as do ``gather`` with ``scope="all"`` under
            ``sharding="hybrid-zero"`` and ``gather`` under ``hybrid`` (no
            gather crosses nodes there). Unknown keys raise ``ConfigError``.

    ``emu-ipc`` (and ``emu-shmem``, whose puts to another node arrive only
    at the stream's next deliver, as NVSHMEM's do at a quiet) runs every
    call through the device data path (a separate
    landing region, adds on the daemon's own stream, signals sent by work on
    the stream after the data) with host memory for device memory and host
    threads for streams; ``ODC_EMU_JITTER_US`` makes each emulated stream
    sleep up to that long before every operation. The engine owns one
    emulated stream and, because torch's CPU tensors have no stream to order
    later work on, each call enqueues its work there and waits for it before
    returning: the calls then mean what they mean on a host transport.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        local_world_size: int | None = None,
        chunk_bytes: int | None = None,
        timeout: float | None = None,
        job_key: str | None = None,
        prefix: str | None = None,
        transport: str | None = None,
        sharding: str | None = None,
        device: Any = None,
        heap_reserve: int | None = None,
        deadline_source: str | None = None,
        deterministic: bool = False,
        cross_node: str | None = None,
        node_cache_mb: float | None = None,
        elastic: bool = False,
        members: Sequence[int] | None = None,
        register_timeout: float | None = None,
        compress: Mapping[str, Any] | None = None,
    ) -> None:
        # deadline_source: where ``timeout`` came from, for errors (a process group's timeout, say);
        # None: from ``timeout=`` itself, else ODC_TIMEOUT_S, else the default.
        if deadline_source is None or timeout is None:  # timeout=, else ODC_TIMEOUT_S, else the default
            timeout, deadline_source = deadline_for(None, explicit=timeout)
        if transport is None:
            transport = os.environ.get("ODC_TRANSPORT") or None
        ordinal = self._cuda_ordinal(transport, device)
        if local_world_size is None:
            local_world_size = _local_world_size(store, int(rank), int(world_size), prefix or "odc")
        # Across nodes libfabric must bind an address the other nodes reach:
        # unless told, the one on the route to the rendezvous host (set for
        # this construction only; the transport reads it once).
        addr = None
        if int(world_size) > int(local_world_size) and "ODC_FABRIC_ADDR" not in os.environ:
            addr = _route_to_master()
        if addr is not None:
            os.environ["ODC_FABRIC_ADDR"] = addr
        try:
            native = _odc.Engine(
                store,
                int(rank),
                int(world_size),
                local_world_size=local_world_size,
                chunk_bytes=chunk_bytes,
                timeout=timeout,
                job_key=job_key,
                prefix=prefix,
                transport=transport,
                sharding=sharding,
                device=ordinal,
                heap_reserve=heap_reserve,
                deterministic=bool(deterministic),
                cross_node=cross_node,
                node_cache_mb=node_cache_mb,
                elastic=bool(elastic),
                members=None if members is None else [int(n) for n in members],
                register_timeout=register_timeout,
                compress=compress_args(compress),
            )
        finally:
            if addr is not None:
                os.environ.pop("ODC_FABRIC_ADDR", None)
        self.deadline_source = deadline_source
        # Elastic generations: the store, the job's first prefix, this engine's and what a next generation repeats.
        self._store = store
        self._base = self._prefix = prefix or "odc"
        self._settings: dict[str, Any] = {
            "local_world_size": local_world_size, "chunk_bytes": chunk_bytes, "timeout": timeout,
            "job_key": job_key, "transport": transport, "sharding": sharding, "deadline_source": deadline_source,
            "deterministic": deterministic, "cross_node": cross_node, "node_cache_mb": node_cache_mb,
            "elastic": elastic, "compress": compress,
        }
        self._specs: list[Bucket] = []
        # Joins (and the drops of earlier generations) this rank saw, for elastic_events.
        self._history: list[dict[str, Any]] = []
        #: Elastic: the first minibatch this generation runs (None for the job's first).
        self.first_minibatch: int | None = None
        #: Elastic, a rejoined rank's engine: the ``extra`` bytes its source served (``rejoin(extra=True)``).
        self.extra_state: bytes | None = None
        #: Elastic, a rejoined rank's engine: the member rank whose replica state it copied.
        self.rejoin_source: int | None = None
        # Elastic, a member's new generation: the function whose bytes admit(extra=...) serves at this engine's
        # first operation.
        self._extra: Callable[[], bytes] | None = None
        # A later generation's native engine counts versions and minibatches from its first minibatch.
        self._offset = 0
        # Typed as the native engine it forwards to (``_odc.pyi``).
        note = f"ODC's deadline: {timeout:g} s, from {deadline_source}"
        self._native = cast(_odc.Engine, _NotingDeadline(native, note))
        self._ids: dict[str, int] = {}
        self._infos: list[dict[str, Any]] = []
        # Elastic: drops logged so far (None unless elastic).
        self._drops: int | None = 0 if elastic else None
        # Device engines: the CUDA device (cuda-ipc), the emulated stream
        # (emu-ipc), and the streams enqueued on since the last finish.
        self._cuda: Any = None
        self._emu: Any = None
        self._streams: dict[int, Any] = {}
        if self._native.is_device:
            if self._native.transport in CUDA_TRANSPORTS:
                import torch

                index = self._native.device
                if index is None:  # the engine opened the local rank's device
                    index = self.rank % self.local_world_size
                self._cuda = torch.device("cuda", index)
            else:
                self._emu = _odc.EmuStream(_emu_jitter_us())

    @staticmethod
    def _cuda_ordinal(transport: str | None, device: Any) -> int | None:
        """The CUDA ordinal a cuda-ipc / nvshmem engine opens (None: the engine's default, the local rank)."""
        cuda_ipc = transport_name(transport) in CUDA_TRANSPORTS
        if device is None and not cuda_ipc:
            return None
        import torch

        if device is None:
            return torch.cuda.current_device() if torch.cuda.is_available() else None
        if isinstance(device, int):
            return device
        dev = torch.device(device)
        if dev.type != "cuda":
            if cuda_ipc:
                raise ConfigError(f"device={device!r}: a {transport_name(transport)} engine needs a CUDA device")
            return None  # ignored by the other transports
        index = cast("int | None", dev.index)  # None for "cuda"; torch's stub says int
        if index is None:
            return torch.cuda.current_device() if torch.cuda.is_available() else None
        return index

    # -- setup ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank, 0 ≤ rank < :attr:`world_size`."""
        return self._native.rank

    @property
    def world_size(self) -> int:
        """The number of ranks D."""
        return self._native.world_size

    @property
    def transport(self) -> str:
        """The transport in use: ``"shm"``, ``"fabric"`` or ``"shm+fabric"`` (``"auto"`` resolved),
        ``"cuda-ipc"``, ``"nvshmem"``, ``"emu-ipc"`` or ``"emu-shmem"``."""
        return self._native.transport

    @property
    def is_device(self) -> bool:
        """Whether the engine's data lives in device memory (one of :data:`DEVICE_TRANSPORTS`)."""
        return self._native.is_device

    @property
    def device(self) -> torch.device:
        """Where the tensors passed to this engine live: ``cuda:<i>`` for ``cuda-ipc`` / ``nvshmem``, else ``cpu``."""
        import torch

        return self._cuda if self._cuda is not None else torch.device("cpu")

    @property
    def sharding(self) -> str:
        """``"full"``, ``"hybrid"`` or ``"hybrid-zero"``."""
        return self._native.sharding

    @property
    def cross_node(self) -> str:
        """How gradients for owners on other nodes cross: ``"direct"`` or ``"node"`` (see ``cross_node=``).

        Resolved at :meth:`register`; before it, what was asked (``"auto"`` by default).
        """
        return self._native.cross_node

    def node_cache_stats(self) -> dict[str, int] | None:
        """What this rank's gathers did with the node cache of remote shards, or ``None`` without one.

        Returns:
            Counts since registration: ``bytes`` and ``slots`` of the node's
            cache, ``entries`` (pieces of remote shards), and this rank's
            pieces ``fetched`` across the network, ``hits`` read from the
            node (of which ``waited`` while a node-mate fetched them),
            ``direct`` (read straight, no slot free) and ``taken_over`` (from
            a node-mate that died fetching). ``None`` where the engine keeps
            no cache (one node, not full sharding, ``node_cache_mb=0``).
        """
        return self._native.node_cache_stats()

    def bytes_across_nodes(self) -> dict[str, int] | None:
        """Bytes this rank moved across nodes since the engine started, or ``None`` on a device engine.

        Returns:
            ``gathered``: read by this rank's gathers from shards owned on another node (the node cache's
            fetches and hybrid-zero's piece copies included); ``pushed``: sent by its pushes to landing slots on
            another node, chunk headers included; ``summed``: read by hybrid sharding's end-of-minibatch sum from
            this rank's replicas on the other nodes. Compressed chunks and copies count as the bytes that
            crossed. Not counted: control words. Nodes are as the engine sees them (``LOCAL_WORLD_SIZE``), so
            emulated nodes on one host count too.
        """
        return self._native.bytes_across_nodes()

    @property
    def members(self) -> list[int] | None:
        """Elastic hybrid sharding: the nodes the next cross-node sum counts (``None`` unless ``elastic=True``)."""
        return self._native.members

    def elastic_events(self) -> list[dict[str, Any]]:
        """Elastic hybrid sharding: every node drop and join this rank saw, oldest first.

        Each is a dict with ``kind``. A ``"drop"``: ``minibatch`` (whose sum
        left the node out), ``epoch`` (of that minibatch's membership round),
        ``node``, ``members`` (after), ``detected_s`` (from the start of this
        rank's cross-node sum to its learning of the death) and
        ``recovered_s`` (from then to the round over the survivors
        committing). An ``"abandoned"`` (from :meth:`admit`): ``minibatch``
        (where the joiners would have come in), ``nodes``, ``members`` (as
        before), ``waited_s`` and ``reason``. A ``"join"`` (from :meth:`admit` or :meth:`rejoin`):
        ``minibatch`` (the first it takes part in), ``node``, ``members``
        (after), and on a member ``register_s`` (the new generation's
        registration) and ``copy_s`` (serving its state to the ranks in
        ``served``), on the joiner ``waited_s`` (for its admission),
        ``register_s``, ``copy_s`` (reading rank ``source``'s state) and, where it waited for the source's
        ``extra`` bytes, ``extra_s``. Events of earlier
        generations carry over to the next.
        """
        native = self._native.elastic_events()
        drops = [dict(ev, kind="drop", minibatch=ev["minibatch"] + self._offset) for ev in native]
        # In the order they happened: a join (or an abandoned one) at the boundary before its minibatch, a drop in it.
        return sorted(self._history + drops, key=lambda ev: (ev["minibatch"], ev["kind"] == "drop"))

    @property
    def admitted(self) -> tuple[int, list[int]] | None:
        """Elastic: ``(minibatch, nodes)`` a membership round admitted from that minibatch on, else ``None``.

        Once set, this engine cannot finish that minibatch: :meth:`admit`
        builds the generation that can.
        """
        adm = self._native.admitted()
        return None if adm is None else (adm[0] + self._offset, adm[1])

    def _rel(self, n: int, what: str = "version") -> int:
        """``n`` (a version or minibatch, numbered as the loop does) as this generation's engine counts it."""
        if int(n) < self._offset:
            raise ConfigError(
                f"{what} {n} comes before minibatch {self._offset}, where this elastic generation began: a "
                "generation runs its first minibatch and the later ones"
            )
        return int(n) - self._offset

    def _decline(self, why: str) -> None:
        """Elastic: lets no admitted node in at this boundary (the members' loop is in the middle of a step):
        the generation that would admit it is abandoned before anyone begins it, alike for every member (the
        first proposal stands), and the joiners ask a later round. Raises where another member began it."""
        adm = self.admitted
        if adm is None:
            return
        start, joining = adm
        if _odc.decline_generation(self._store, self._base, int(start)):
            raise ProtocolError(
                f"elastic: rank {self.rank} cannot let node(s) {list(joining)} in at minibatch {start} ({why}), but "
                "another member rank began the generation that admits them: the member ranks' loops disagree on "
                "where a step ends (every rank steps, or none, between the same minibatches)"
            )
        self._native.clear_admitted()
        ev = {"kind": "abandoned", "minibatch": int(start), "nodes": list(joining),
              "members": list(self.members or []), "waited_s": 0.0, "reason": why}
        self._history.append(ev)
        _elastic_log.warning("rank %d: node(s) %s not let in at minibatch %d (%s); they ask a later minibatch",
                             self.rank, list(joining), start, why)

    def admit(self, state: Sequence[torch.Tensor] = (), *, register_timeout: float | None = None,
              extra: bytes | Callable[[], bytes] | None = None) -> Engine:
        """Elastic: at a minibatch boundary, after the step, lets admitted nodes in; returns the engine to go on with.

        Call it on every member rank after each step (it returns ``self`` at
        once unless the last round admitted a node). When
        one did, it builds the next generation: a new engine of the same
        settings over the members and the joiners, the same buckets
        registered (a collective with the joiners' :meth:`rejoin`), then
        serves ``state`` (this rank's replica state: its parameter shards,
        the optimizer state of them, counters; contiguous host tensors, the
        same list on every rank) to the joining ranks that copy this rank's
        (the same local rank; joining nodes spread over the members), which
        read it one-sidedly. Returns the new engine once they have it; drop
        the old one. A joiner that dies during the copy is dropped by the
        new generation's first round, as any member would be.

        A rank that dies or stalls before the new generation's registration
        completes (a joiner, or a member) would hold the others: each rank
        waits ``register_timeout`` seconds for it (default: the engine's
        timeout, at most 60), then the generation is abandoned by all alike
        (the first rank to decide, through the store, decides for all): the
        members go on with this engine (``self`` is returned, the
        admission forgotten, an ``"abandoned"`` event and a warning say so)
        and the joiners' :meth:`rejoin` raises.

        ``extra``: bytes the joining ranks that copy this rank's state take
        beside it (the joiners' :meth:`rejoin` with ``extra=True`` keeps
        them): served with the state, or, given a function that makes them,
        by the returned engine at its first operation (its first publish,
        gather, push, claim or finish), so that what the loop changes between
        its step and the next minibatch (a learning rate a scheduler sets
        after the step, a loss scaler's update) is in them; the joiners wait
        for them. A function that raises serves its error instead, which the
        joiners raise, and raises there.
        """
        from . import _rejoin

        adm = self.admitted
        if adm is None:
            return self
        start, joining = adm
        t0 = time.perf_counter()
        old = list(self.members or [])
        members = sorted(set(old) | set(joining))
        _rejoin.check_state(state, "admit")
        gen = _odc.begin_generation(self._store, self._base, int(start), members, list(joining))

        def make() -> Engine:
            eng = Engine(self._store, self.rank, self.world_size, **self._settings, prefix=gen["prefix"],
                         members=members, register_timeout=_rejoin.register_window(self.timeout, register_timeout))
            eng._base, eng.first_minibatch, eng._offset = self._base, int(start), int(start)
            eng.register(self._specs)
            return eng

        new, why = _enter_generation(self._store, gen["prefix"], make)
        if new is None:
            _odc.restore_generation(self._store, self._base, self._prefix)
            self._native.clear_admitted()
            ev = {"kind": "abandoned", "minibatch": int(start), "nodes": list(joining), "members": old,
                  "waited_s": time.perf_counter() - t0, "reason": why}
            self._history.append(ev)
            _elastic_log.warning(
                "rank %d: the generation admitting node(s) %s at minibatch %d was abandoned after %.3f s (%s); "
                "members stay %s", self.rank, list(joining), start, ev["waited_s"], why, old,
            )
            return self
        t_reg = time.perf_counter()
        readers = _rejoin.readers(self.rank, self.local_world_size, joining, old)
        flat = _rejoin.pack(state)
        self._store.set(f"{gen['prefix']}/state/{self.rank}/layout", json.dumps(_rejoin.layout(state)))
        new._native.serve_state(flat.data_ptr() if flat.numel() else 0, flat.numel(), readers)
        if readers and extra is not None:
            if callable(extra):
                new._extra = extra
            else:
                self._store.set(f"{gen['prefix']}/state/{self.rank}/extra", b"+" + bytes(extra))
        done = time.perf_counter()
        new._history = self.elastic_events()
        for node in joining:
            ev = {
                "kind": "join", "minibatch": int(start), "node": int(node), "members": members,
                "register_s": t_reg - t0, "copy_s": done - t_reg, "served": readers,
            }
            new._history.append(ev)
            _elastic_log.warning(
                "rank %d: node %d joins at minibatch %d; members now %s; the new generation registered in %.3f s, "
                "this rank served its state to ranks %s in %.3f s",
                self.rank, node, start, members, ev["register_s"], readers, ev["copy_s"],
            )
        return new

    @classmethod
    def rejoin(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        buckets: Iterable[Bucket],
        state: Sequence[torch.Tensor] = (),
        *,
        local_world_size: int | None = None,
        prefix: str | None = None,
        timeout: float | None = None,
        register_timeout: float | None = None,
        extra: bool = False,
        names: Sequence[str] | None = None,
        **settings: Any,
    ) -> Engine:
        """Elastic: a restarted node's rank joins the running job; returns its engine, ``state`` filled.

        Every rank of the node calls it with what the job's engines were
        built with (``prefix``, ``local_world_size``, the settings) and the
        buckets they registered. It asks the job's membership round to
        admit its node, waits until the member ranks build the generation
        that admits it (at a minibatch boundary, after their step: see
        :meth:`admit`), registers the buckets with them, and copies a member
        replica's state (its local rank's, one-sided reads) into ``state``
        (contiguous host tensors laid out as the source's: the parameter
        shards, the optimizer state, counters). The engine's
        :attr:`first_minibatch` is the minibatch it takes part in first: the
        loop's data position (the plan of that minibatch, as every member
        reads it). Raises on no admission within ``timeout`` seconds, and
        :class:`odc.ProtocolError` when the generation that admitted it was
        abandoned (a rank did not register within ``register_timeout``; see
        :meth:`admit`).

        With ``extra`` it then waits (up to ``timeout`` seconds) for the
        bytes its source serves beside the tensors (the members' ``admit(...,
        extra=...)``: at once, or as their next minibatch starts) and keeps
        them as :attr:`extra_state`; :attr:`rejoin_source` names the source.
        ``names`` (one per state tensor) name the tensor whose layout differs
        from the source's in the error.
        """
        from . import _rejoin

        _rejoin.check_state(state, "rejoin")
        if local_world_size is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ConfigError(
                    "rejoin needs local_world_size (or LOCAL_WORLD_SIZE): a joining node cannot infer it from "
                    "ranks that are not running"
                )
            local_world_size = int(env)
        base = prefix or "odc"
        wait_s, _ = deadline_for(None, explicit=timeout)
        node = int(rank) // int(local_world_size)
        nodes = int(world_size) // int(local_world_size)
        t0 = time.perf_counter()
        gen = _odc.await_admission(store, base, nodes, int(rank), node, float(wait_s))
        t_admitted = time.perf_counter()
        window = _rejoin.register_window(wait_s, register_timeout)

        def make() -> Engine:
            made = cls(
                store, rank, world_size, local_world_size=local_world_size, prefix=gen["prefix"], timeout=timeout,
                members=gen["members"], elastic=True, register_timeout=window, **settings,
            )
            made._base, made.first_minibatch, made._offset = base, gen["start"], int(gen["start"])
            made.register(buckets)
            return made

        eng, why = _enter_generation(store, gen["prefix"], make)
        if eng is None:
            raise ProtocolError(
                f"rejoin: rank {rank}: the generation admitting node {node} at minibatch {gen['start']} was "
                f"abandoned ({why}); the members went on without this node (restart it to ask again)"
            )
        old = [n for n in gen["members"] if n not in gen["joining"]]
        source = _rejoin.source_node(gen["joining"], old, node) * int(local_world_size) + int(rank) % int(
            local_world_size
        )
        import torch

        mine = _rejoin.layout(state)
        t_reg = time.perf_counter()
        flat = torch.empty(sum(t.numel() * t.element_size() for t in state), dtype=torch.uint8)
        eng._native.read_state(source, flat.data_ptr() if flat.numel() else 0, flat.numel())
        raw = store.get(f"{gen['prefix']}/state/{source}/layout")
        try:
            _rejoin.compare_layouts(mine, raw, source)
        except ConfigError as e:
            if names is not None and (what := _rejoin.name_first_difference(mine, raw, names)):
                e.add_note(what)
            raise
        eng.rejoin_source = source
        _rejoin.unpack(flat, state)
        done = time.perf_counter()
        eng._history = [{
            "kind": "join", "minibatch": gen["start"], "node": node, "members": gen["members"],
            "waited_s": t_admitted - t0, "register_s": t_reg - t_admitted, "copy_s": done - t_reg, "source": source,
        }]
        if extra:
            eng.extra_state = _await_extra(store, f"{gen['prefix']}/state/{source}/extra", source, int(rank),
                                           float(wait_s))
            eng._history[0]["extra_s"] = time.perf_counter() - done
        _elastic_log.warning(
            "rank %d: node %d rejoined at minibatch %s; members %s; admitted after %.3f s, registered in %.3f s, "
            "copied rank %d's state in %.3f s", rank, node, gen["start"], gen["members"], t_admitted - t0,
            t_reg - t_admitted, source, done - t_reg,
        )
        return eng

    @property
    def deterministic(self) -> bool:
        """Whether gradients accumulate exactly (the same bits in any order); see ``deterministic=``."""
        return self._native.deterministic

    @property
    def local_world_size(self) -> int:
        """Ranks per node G."""
        return self._native.local_world_size

    @property
    def timeout(self) -> float:
        """The deadline of every wait on a peer, in seconds (see :attr:`deadline_source`)."""
        return self._native.timeout

    def register(self, buckets: Iterable[Bucket]) -> None:
        """Registers every bucket, collectively and in the same order on every rank.

        Raises:
            RegistrationError: another rank registered a different list (the
                message names the first differing bucket).
        """
        buckets = list(buckets)
        specs = [b.spec() for b in buckets]
        self._native.register(specs)
        self._specs = buckets
        self._infos = [self._native.bucket_info(i) for i in range(self._native.num_buckets())]
        self._ids = {info["name"]: i for i, info in enumerate(self._infos)}

    def bucket(self, ref: BucketRef) -> dict[str, Any]:
        """Layout of a bucket: name, numel, dtype, shard_len, padded_len, blocks, piece_len.

        ``piece_len`` is what :meth:`publish` takes and :meth:`grad_shard`
        holds: ``shard_len``, except under ``sharding="hybrid-zero"`` (this
        rank's 1/D piece, block ``rank`` of the padded bucket).
        """
        return dict(self._infos[self._id(ref)])

    def _id(self, ref: BucketRef) -> int:
        if isinstance(ref, str):
            if ref not in self._ids:
                # The native call raises the right error (unregistered / unknown).
                return self._native.bucket_id(ref)
            return self._ids[ref]
        if not 0 <= ref < len(self._infos):
            raise LayoutError(f"unknown bucket index {ref}: {len(self._infos)} buckets are registered")
        return ref

    def _serve_extra(self) -> None:
        """A member's new generation, at its first operation: serves the bytes ``admit(extra=...)``'s function
        makes now to the joining ranks that copied this rank's state; where it raises, serves the error (the
        joiners raise it) and raises."""
        make, self._extra = self._extra, None
        key = f"{self._prefix}/state/{self.rank}/extra"
        try:
            blob = make() if make is not None else b""
            if not isinstance(blob, (bytes, bytearray)):
                raise ConfigError(f"admit: extra gave a {type(blob).__name__}, not bytes")
        except BaseException as e:
            self._store.set(key, b"!" + f"{type(e).__name__}: {e}".encode())
            raise
        self._store.set(key, b"+" + bytes(blob))

    # -- data path -----------------------------------------------------------
    def publish(self, bucket: BucketRef, shard: torch.Tensor, version: int) -> None:
        """Publishes this rank's shard (``piece_len`` elements, parameter dtype) as ``version``.

        Waits until every reader released ``version - 1``. On ``cuda-ipc`` the
        copy out of ``shard`` is enqueued on the current stream of its device.
        """
        if self._extra is not None:
            self._serve_extra()
        if self._native.is_device:
            ptr, n, dt, stream = self._device_buffer(shard, "shard")
            self._device_call(self._native.publish_device, self._id(bucket), ptr, n, dt, self._rel(version), stream)
            return
        ptr, n, dt = _buffer(shard, "shard")
        self._native.publish(self._id(bucket), ptr, n, dt, self._rel(version))

    def gather(self, bucket: BucketRef, version: int, out: torch.Tensor, *, skip_own: bool = False) -> torch.Tensor:
        """Reads ``version`` of every owner's shard into ``out`` (``numel`` or padded length).

        With ``skip_own`` this rank's own range of ``out`` is left untouched
        (for callers that already copied their shard in). On ``cuda-ipc`` it
        waits on the host until every owner published ``version`` and
        enqueues the copies on the current stream of ``out``'s device.
        """
        if self._extra is not None:
            self._serve_extra()
        if self._native.is_device:
            ptr, n, dt, stream = self._device_buffer(out, "output")
            self._device_call(self._native.gather_device, self._id(bucket), self._rel(version), ptr, n, dt, skip_own,
                              stream)
            return out
        ptr, n, dt = _buffer(out, "output")
        self._native.gather(self._id(bucket), self._rel(version), ptr, n, dt, skip_own)
        return out

    def release(self, bucket: BucketRef, version: int) -> None:
        """Tells every owner this rank is done reading ``version`` of ``bucket``.

        On ``cuda-ipc`` the signal follows the work already on the current stream (the gather's copies).
        """
        if self._native.is_device:
            self._device_call(self._native.release_device, self._id(bucket), self._rel(version), self._stream())
            return
        self._native.release(self._id(bucket), self._rel(version))

    def scatter_accumulate(
        self, bucket: BucketRef, grads: torch.Tensor, scale: float = 1.0, offset: int | None = None
    ) -> None:
        """Pushes ``grads`` to the owners: the whole bucket (``numel`` or padded
        length) when ``offset`` is None, else the part starting at element ``offset``.

        Each owner adds ``scale · grads[its shard]`` into its f32 accumulator.
        Returns once the data is in the owners' landing slots (``grads`` may
        be reused); does not wait for the additions. On ``cuda-ipc`` the
        copies are enqueued on the current stream of ``grads``' device and
        later work on that stream may overwrite ``grads``.
        """
        if self._extra is not None:
            self._serve_extra()
        at = None if offset is None else int(offset)
        if self._native.is_device:
            ptr, n, dt, stream = self._device_buffer(grads, "gradient")
            self._device_call(
                self._native.scatter_accumulate_device, self._id(bucket), ptr, n, dt, float(scale), at, stream
            )
            return
        ptr, n, dt = _buffer(grads, "gradient")
        self._native.scatter_accumulate(self._id(bucket), ptr, n, dt, float(scale), at)

    def finish_minibatch(self, k: int) -> None:
        """Ends minibatch ``k``; returns when this rank's own gradient shards are final.

        On ``cuda-ipc`` the current stream first waits for every stream this
        engine enqueued work on since the previous finish (FSDP runs its
        comms on streams of its own), and the host then waits for it.
        """
        if self._extra is not None:
            self._serve_extra()
        if self._native.is_device:
            stream = self._stream()
            if self._cuda is not None:
                import torch

                current = torch.cuda.current_stream(self._cuda)
                for other in self._streams.values():
                    if other.cuda_stream != current.cuda_stream:
                        current.wait_stream(other)
                self._streams.clear()
            self._device_call(self._native.finish_minibatch_device, self._rel(k, "minibatch"), stream)
            return
        seen = self._drops
        self._native.finish_minibatch(self._rel(k, "minibatch"))
        if seen is not None:
            events = self._native.elastic_events()
            for ev in events[seen:]:
                _elastic_log.warning(
                    "rank %d: node %d dropped at minibatch %d (epoch %d): its microbatches of that minibatch "
                    "are not in the sum; members now %s; learnt %.3f s into the cross-node sum, survivors' "
                    "round committed %.3f s later",
                    self.rank, ev["node"], ev["minibatch"] + self._offset, ev["epoch"], ev["members"], ev["detected_s"],
                    ev["recovered_s"],
                )
            self._drops = len(events)

    def grad_shard(self, bucket: BucketRef) -> torch.Tensor:
        """This rank's f32 gradient accumulator of ``bucket``, as a tensor view (no copy).

        Its values are this minibatch's between :meth:`finish_minibatch` and
        the next :meth:`zero_grad`; it aliases engine memory (copy it to keep
        them). The view keeps the engine's memory alive: dropping the engine
        while holding it is safe. On ``cuda-ipc`` it is a CUDA tensor on the
        engine's device.
        """
        import torch

        if self._cuda is not None:
            ptr, numel = self._native.grad_shard_device(self._id(bucket))
            view = torch.as_tensor(_CudaArray(ptr, numel, self._native), device=self._cuda)
            if view.data_ptr() != ptr or view.dtype != torch.float32:
                raise ProtocolError(
                    f"grad_shard({bucket!r}): torch copied the accumulator at {ptr:#x} instead of viewing it"
                )
            return view
        if self._emu is not None:
            # emu-ipc's device memory is host memory: the address is a host pointer.
            ptr, numel = self._native.grad_shard_device(self._id(bucket))
        else:
            ptr, numel = self._native.grad_shard_ptr(self._id(bucket))
        buf = (ctypes.c_float * numel).from_address(ptr)
        # The tensor holds `buf` (torch.frombuffer keeps its exporter alive) and `buf` holds the
        # native engine, so the accumulator outlives every view of it, whoever drops the engine.
        setattr(buf, "_odc_owner", self._native)  # noqa: B010 - ctypes arrays take attributes
        return torch.frombuffer(buf, dtype=torch.float32, count=numel)

    # -- work stealing ---------------------------------------------------------
    def claim_own(self, k: int, count: int) -> int | None:
        """Claims this rank's next microbatch of minibatch ``k`` (``count`` in its list).

        Returns its index in the list, or None once every one is claimed
        (by this rank from the front, or by thieves through :meth:`steal`
        from the back). The first claim of ``k`` starts minibatch ``k`` for
        thieves; every microbatch is claimed exactly once. Host transports.
        """
        if self._extra is not None:
            self._serve_extra()
        return self._native.claim_own(self._rel(k, "minibatch"), int(count))

    def steal(self, victim: int, k: int) -> tuple[str, int | None]:
        """Claims one of rank ``victim``'s unclaimed microbatches of minibatch ``k``, from the back of its list.

        The victim's server daemon makes the claim, so the victim's own
        loop is not interrupted. Returns ``("got", index)``, ``("empty",
        None)`` (all claimed) or ``("not-yet", None)`` (the victim has not
        started ``k``). Waits for the answer within the engine's deadline;
        a dead or stalled victim is named. ``victim`` must be in this
        rank's shard group (every rank under full sharding, the node under
        hybrid sharding).
        """
        if self._extra is not None:
            self._serve_extra()
        return self._native.steal(int(victim), self._rel(k, "minibatch"))

    def claims_of(self, rank: int) -> tuple[int | None, int, int]:
        """Rank ``rank``'s claim word as it reads now: ``(minibatch, front, back)``.

        ``[front, back)`` of its list of that minibatch is unclaimed
        (``minibatch`` None: it has not started one). A one-sided read, a
        hint for picking a victim, not a claim.
        """
        k, front, back = self._native.claims_of(int(rank))
        return (None if k is None else k + self._offset), front, back

    def claimed(self, k: int, counts: Sequence[int], *, ranks: Iterable[int] | None = None,
                cost: Callable[[int, int], float] | None = None, steal: bool = True) -> Iterator[tuple[int, int]]:
        """Yields ``(owner, index)`` for every microbatch this rank should run in minibatch ``k``.

        ``counts[r]`` is the length of rank ``r``'s list (equal on every rank). First this rank's own list,
        front to back (:meth:`claim_own`); then, with ``steal``, unstarted microbatches of the rank among
        ``ranks`` (default: every rank) with the most predicted cost left (``cost(owner, index)``, default 1
        each), taken from the back of its list (:meth:`steal`), until every list is drained. Run it to the
        end on every rank, once per minibatch.
        """
        me = self.rank
        while (i := self.claim_own(k, counts[me])) is not None:
            yield me, i
        if not steal:
            return
        weigh = cost or (lambda _r, _i: 1.0)
        victims = [v for v in (range(self.world_size) if ranks is None else ranks) if v != me and counts[v] > 0]
        while True:
            victim, most = -1, 0.0
            for v in victims:
                started, front, back = self.claims_of(v)
                if started is None or started < k:
                    front, back = 0, counts[v]  # not started: all of it ("not yet" until it starts)
                elif started > k:
                    continue  # moved on: every microbatch of k is claimed
                left = sum(weigh(v, j) for j in range(front, back))
                if back > front and left > most:
                    victim, most = v, left
            if victim < 0:
                return
            status, i = self.steal(victim, k)
            if status == "got" and i is not None:
                yield victim, i
            elif status == "not-yet":
                time.sleep(0.0005)

    def zero_grad(self, bucket: BucketRef | None = None) -> None:
        """Zeroes one accumulator, or all of them (under ``deterministic=True`` its exact sums too: until
        then each :meth:`finish_minibatch` reads out the exact sum since the last zeroing).

        On ``cuda-ipc`` the zeroing runs after the work already on the
        current stream (the optimizer step that read the accumulator).
        """
        if self._native.is_device:
            stream = self._stream()
            if bucket is None:
                self._device_call(self._native.zero_grads_device, stream)
            else:
                self._device_call(self._native.zero_grad_device, self._id(bucket), stream)
            return
        if bucket is None:
            self._native.zero_grads()
        else:
            self._native.zero_grad(self._id(bucket))

    def _wait_partials_read(self) -> None:
        """Hybrid sharding across nodes (host transports): waits until the other nodes have read this rank's
        partial sums of the last finished minibatch, leaving them as they are (what :meth:`zero_grad` waits for
        before it zeroes). At once otherwise."""
        if not self._native.is_device:
            self._native.wait_partials_read()

    # -- device engines --------------------------------------------------------
    def _stream(self) -> int:
        """The stream handle of a device call: the emulated stream, or the
        current CUDA stream (remembered until the next finish)."""
        if self._emu is not None:
            return int(self._emu.handle)
        import torch

        stream = torch.cuda.current_stream(self._cuda)
        self._streams.setdefault(stream.cuda_stream, stream)
        return stream.cuda_stream

    def _device_buffer(self, t: torch.Tensor, what: str) -> tuple[int, int, str, int]:
        """``(pointer, bytes, dtype, stream)`` of a tensor for a device call."""
        if self._cuda is not None:
            if t.device != self._cuda:
                raise LayoutError(
                    f"{what} is on {t.device}; this engine's transport {self.transport} moves CUDA tensors on "
                    f"{self._cuda}"
                )
        elif t.device.type != "cpu":
            raise LayoutError(
                f"{what} is on {t.device}; the {self.transport} transport emulates device memory with CPU tensors"
            )
        if not t.is_contiguous():
            raise LayoutError(f"{what} is not contiguous")
        dt = dtype_name(t.dtype)
        stream = self._stream()
        if self._cuda is not None:
            # The copies run later on this stream: the caching allocator must
            # not hand the memory to another stream before they have.
            t.record_stream(self._streams[stream])
        return t.data_ptr(), t.numel() * t.element_size(), dt, stream

    def _device_call(self, fn: Any, *args: Any) -> None:
        """Runs a ``*_device`` call; on emu-ipc, waits for the emulated stream (see the class doc)."""
        try:
            fn(*args)
        except BaseException:
            if self._emu is not None:
                with contextlib.suppress(OdcError):
                    self._emu.synchronize()  # nothing of this call stays in flight
            raise
        if self._emu is not None:
            self._emu.synchronize()

    def __repr__(self) -> str:
        return f"odc.Engine(rank={self.rank}, world_size={self.world_size}, buckets={len(self._infos)})"
