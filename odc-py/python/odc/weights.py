"""Rollout weights: processes outside the training group read the trainer's parameter versions.

A trainer serves its parameters with :func:`serve_weights` (also exported as ``odc.fsdp.serve_weights``); any
process, on the trainer's hosts or on others, that knows the job's store and the served name reads them with
:class:`WeightReader`::

    # every trainer rank, after fully_shard and before the loop
    server = odc.fsdp.serve_weights(model, optimizer, name="policy")

    # a rollout worker, an evaluator: not a rank of the training job
    reader = odc.WeightReader("127.0.0.1:29500", name="policy")
    got = reader.read(into=inference_model)  # got.version, got.age

How it works (docs/weights.md has the rest). Each trainer rank keeps K snapshot slots (``slots=K``, at least 2) in
shared memory registered with its own ``shm`` transport and, to serve readers on other nodes, with its own libfabric
endpoint too (``transport=``). After each optimizer step (its step post-hook) the rank
copies its parameter shards, as the optimizer left them, into slot ``v mod K`` between two sequence words
(``begin = v + 1`` before the data, ``end = v + 1`` after). The trainer never reads anything a reader writes, so a
reader that is slow, late or killed cannot make it wait. A reader takes the newest version every trainer rank
published, copies every rank's slot one-sidedly (mapped shared memory for ranks on its node, libfabric ``fi_read``
for the others, all ranks' slots in flight together), then reads the ``begin`` words again: a slot overwritten meanwhile
is read again (a newer version), or the read is refused with :class:`VersionRefused` naming the rank and the
versions. A read is a whole version or nothing, and ``into`` changes only after a whole version arrived. Readers on
a node that is not the trainer's can share each version through the node's memory (``node_cache=True``): one of them
fetches every version across once into copies of the slots, and all of them read the copies by the same rules.

What goes into the store under ``odc/weights/<name>/``: ``meta`` (the job's segment names, K, every parameter's
fully qualified name, full shape and dtype) and ``rank<r>`` (rank r's node, its ``shm`` endpoint, its libfabric endpoint
or why it has none, its slot region, and where each of its shards lies: element offset in the flattened full
parameter, element count, byte offset in the slot). FSDP2 shards
dim 0 (``Shard(0)``), so a rank's local shard is a contiguous run of the full parameter's flattened elements.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import datetime
import json
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._odc import WeightNodeCache as _NodeCache
from ._odc import WeightReader as _Reader
from ._odc import WeightServer as _Server
from ._odc import weights_node as _node
from .errors import ConfigError, LayoutError, OdcError, StoreError, TransportError

__all__ = ["ReadResult", "VersionRefused", "WeightReader", "WeightServer", "serve_weights"]

#: Store keys live under ``f"{STORE_PREFIX}/{name}/"``.
STORE_PREFIX = "odc/weights"
_FORMAT = 1
_ALIGN = 64
_TRANSPORTS = ("auto", "shm", "fabric")
_STAGINGS = ("whole", "pieces")
#: One part of a native publish: slot offset, source pointer, source bytes, and the cast on the way (from, to).
_Part = tuple[int, int, int, tuple[str, str] | None]
#: The dtypes the native publish casts between.
_NATIVE_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
#: ``staging="pieces"``: the bytes of one piece, shared between the remote ranks' slots (each rank's part a multiple
#: of 64 bytes).
PIECE_BYTES = 64 << 20


class VersionRefused(OdcError):
    """A weight read gave up: the version it read was overwritten on a trainer rank while it was copied.

    Raised by :meth:`WeightReader.read` when a version asked for by number was overwritten, or when reading the
    latest version found it overwritten ``retries + 1`` times in a row (the reader is slower than K versions of
    the trainer). ``into`` is unchanged.

    Attributes:
        owner: the trainer rank whose slot was overwritten.
        version: the version being read.
        by: the version that overwrote it.
        attempts: reads started.

    What to do: read again (the newest version), serve more slots (``serve_weights(slots=K)``), or read faster.
    """

    def __init__(self, message: str, owner: int = -1, version: int = -1, by: int = -1, attempts: int = 0):
        super().__init__(message)
        self.owner, self.version, self.by, self.attempts = owner, version, by, attempts


@dataclass(frozen=True)
class ReadResult:
    """What :meth:`WeightReader.read` got.

    Attributes:
        version: the version read (the trainer's optimizer steps since :func:`serve_weights`).
        newest: the newest version any trainer rank had published when the read ended.
        attempts: reads started (1 when no slot was overwritten under it).
        seconds: the read's wall time, copy and cast included.
        tensors: the full parameters by name, when the read was given no ``into``.
    """

    version: int
    newest: int
    attempts: int
    seconds: float
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def age(self) -> int:
        """How many versions newer than the one read the trainer had published (0: the newest)."""
        return self.newest - self.version


def _key(name: str, what: str) -> str:
    return f"{STORE_PREFIX}/{name}/{what}"


def _base_store(store: Any) -> Any:
    """``store`` without its ``PrefixStore`` wrappers: readers reach the job's store by address, unprefixed."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or any(c.isspace() or c == "/" for c in name):
        raise ConfigError(f"weights name {name!r}: expected a non-empty string without spaces or '/'")


def _wait_keys(store: Any, keys: list[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    nap = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [k for k in keys if not store.check([k])]
            raise StoreError(f"{what}: store key(s) {', '.join(missing)} not set after {timeout:g} s")
        time.sleep(nap)
        nap = min(nap * 2, 0.05)


def _check_transport(transport: str, who: str) -> None:
    if transport not in _TRANSPORTS:
        raise ConfigError(f"{who}: transport={transport!r}; expected one of {', '.join(map(repr, _TRANSPORTS))}")


def _route_to(host: str | None) -> str | None:
    """This host's address on the route to ``host`` (no packet is sent), unless that is a loopback address."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            addr: str = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@contextlib.contextmanager
def _fabric_addr(addr: str | None) -> Iterator[None]:
    """``ODC_FABRIC_ADDR`` set to ``addr`` while libfabric opens (it reads it once), unless already set."""
    if addr is None or "ODC_FABRIC_ADDR" in os.environ:
        yield
        return
    os.environ["ODC_FABRIC_ADDR"] = addr
    try:
        yield
    finally:
        os.environ.pop("ODC_FABRIC_ADDR", None)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _native_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether the native publish copies ``src`` into a slot of ``dst`` itself (the same dtype, or a cast between
    f32, bf16 and f16: rounded to nearest, ties to even, as torch casts)."""
    return src == dst or (src in _NATIVE_FLOATS and dst in _NATIVE_FLOATS)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"weights manifest: unknown dtype {name!r}")
    return dt


def _fsdp1_clean_name(name: str) -> str:
    """An FSDP1 module name without FSDP1's wrapper parts (``_fsdp_wrapped_module``), as the model names it."""
    return name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module").rstrip(".")


def _fsdp1_pieces(model: nn.Module, world: int) -> tuple[list[tuple[str, torch.Tensor, list[int], int]],
                                                          list[list[Any]]] | None:
    """FSDP1's (``FullyShardedDataParallel``) pieces and parameter list, or None for a model without FSDP1 units.

    Each unit's ``FlatParameter`` flattens its parameters end to end and gives rank r one contiguous run of the
    result (``_shard_param_infos``: which parameters reach into this rank's shard, where in the shard, and which of
    their elements), so a rank holds, per parameter, at most one contiguous run of its flattened elements: the
    pieces the reader assembles, whichever ``use_orig_params``. Names are the model's own (FSDP1's wrapper prefixes
    removed), as ``summon_full_params`` would name them."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    units = FullyShardedDataParallel.fsdp_modules(model)
    if not units:
        return None
    prefixes = {id(m): _fsdp1_clean_name(n) for n, m in model.named_modules()}
    pieces, params = [], []
    for unit in units:
        handle = unit._handle
        if handle is None:
            continue
        strategy = unit.sharding_strategy
        if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            raise ConfigError(f"serve_weights: FSDP1 unit {prefixes.get(id(unit)) or '(root)'!r} is {strategy.name}; "
                              "only FULL_SHARD and SHARD_GRAD_OP shard each parameter once over the job are served")
        if dist.get_world_size(unit.process_group) != world:
            raise ConfigError(f"serve_weights: FSDP1 unit {prefixes.get(id(unit)) or '(root)'!r} shards over "
                              f"{dist.get_world_size(unit.process_group)} ranks, the job has {world}")
        fp = handle.flat_param
        prefix = prefixes.get(id(unit), "")
        label = prefix or "(root)"
        prefix = f"{prefix}." if prefix else ""
        # Before FSDP1's lazy init (the first forward) the FlatParameter's data is the shard that becomes its
        # _local_shard; the optimizer steps that storage either way.
        local = getattr(fp, "_local_shard", fp.data).detach()
        if local.numel() != fp._sharded_size.numel():
            raise ConfigError(f"serve_weights: FSDP1 unit {label!r} holds {local.numel()} elements, its shard "
                              f"{fp._sharded_size.numel()}: call serve_weights outside forward, backward and "
                              "summon_full_params")
        for info, fqn, shape in zip(fp._shard_param_infos, fp._fqns, fp._shapes, strict=True):
            name = prefix + fqn
            params.append([name, list(shape), _dtype_name(fp.dtype)])
            start, count, elem = info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx
            if info.in_shard and count and start is not None and elem is not None:
                pieces.append((name, local[start:start + count], list(shape), elem))
    return pieces, params


def _local_pieces(model: nn.Module, rank: int, world: int) -> Iterator[tuple[str, torch.Tensor, list[int], int]]:
    """(name, local shard, full shape, element offset of the shard in the flattened full parameter) per parameter
    this rank holds: FSDP2's ``Shard(0)`` DTensors (rank r holds rows ``[r·ceil(dim0/D), ...)``), and plain tensors
    (replicated: rank 0 serves them whole)."""
    from torch.distributed.tensor import DTensor, Shard

    for fqn, p in model.named_parameters():
        shape = list(p.shape)
        if isinstance(p, DTensor):
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ConfigError(f"serve_weights: parameter {fqn!r} is placed {tuple(p.placements)} on a "
                                  f"{p.device_mesh.ndim}-D mesh; only FSDP2's Shard(0) on a 1-D mesh is served")
            if p.device_mesh.size() != world:
                raise ConfigError(f"serve_weights: parameter {fqn!r} is sharded over {p.device_mesh.size()} "
                                  f"ranks, the job has {world}")
            local = p.to_local().detach()
            mesh_rank = p.device_mesh.get_local_rank()
            rows = math.ceil(shape[0] / world) if shape else 0
            start = min(mesh_rank * rows, shape[0]) if shape else 0
            row_numel = math.prod(shape[1:]) if shape else 1
            if local.numel() != max(0, min(rows, shape[0] - start)) * row_numel:
                raise LayoutError(f"serve_weights: parameter {fqn!r}: the local shard has {local.numel()} "
                                  f"elements, FSDP2's Shard(0) of {shape} over {world} ranks gives rank "
                                  f"{mesh_rank} rows from {start}")
            yield fqn, local, shape, start * row_numel
        elif rank == 0:
            yield fqn, p.detach(), shape, 0


class WeightServer:
    """One trainer rank's published parameter versions (made by :func:`serve_weights`).

    Attributes:
        name: the served name.
        slots: K, the versions kept.
        slot_bytes: bytes of one version of this rank's shards; the slots hold ``slots · slot_bytes``.
        version: the newest version published (0 at :func:`serve_weights`, then one per optimizer step).
        publish_seconds: wall time of every publish (the copy into the slot), in order.
    """

    def __init__(self, model: nn.Module, *, store: Any, name: str, slots: int, rank: int, world: int,
                 timeout: float, transport: str = "auto", overlap: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        _check_name(name)
        _check_transport(transport, "serve_weights")
        if not isinstance(overlap, bool):
            raise ConfigError(f"serve_weights: overlap={overlap!r}; True or False")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ConfigError(f"serve_weights: dtype={dtype!r}; a floating-point torch.dtype (torch.bfloat16, say) "
                              "or None (each parameter's own)")
        #: The dtype floating-point parameters are served in (None: each parameter's own).
        self.dtype = dtype
        #: Whether :meth:`publish` copies on a thread of its own (see :func:`serve_weights`).
        self.overlap = overlap
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[None] | None = None
        self._copy_delay = 0.0  # tests: a sleep before each overlapped copy
        if not isinstance(slots, int) or slots < 2:
            raise ConfigError(f"serve_weights: slots={slots!r}; K must be an integer >= 2, so that a reader "
                              "of version v never blocks the publish of v + 1")
        self.name, self.slots, self.rank, self.world = name, slots, rank, world
        self._pieces: list[tuple[str, torch.Tensor, int, int]] = []  # name, local shard, elem offset, byte offset
        #: Per piece, the dtype its slot bytes hold (the served dtype of a floating-point shard, else its own).
        self._served_dtypes: list[torch.dtype] = []
        offset = 0
        flat = _fsdp1_pieces(model, world)
        params: list[list[Any]]
        if flat is None:
            served = list(_local_pieces(model, rank, world))
            params = [[fqn, list(p.shape), _dtype_name(p.dtype)] for fqn, p in model.named_parameters()]
        else:
            served, params = flat
        if dtype is not None:
            params = [[fqn, shape, _dtype_name(dtype) if _dtype(dt).is_floating_point else dt]
                      for fqn, shape, dt in params]
        devices = {local.device for _, local, _, _ in served}
        if len(devices) > 1 or any(d.type not in ("cpu", "cuda") for d in devices):
            raise ConfigError(f"serve_weights: this rank's shards are on {sorted(map(str, devices))}; they must "
                              "all be on the CPU or all on one CUDA device")
        for fqn, local, _, elem in served:
            kind = dtype if dtype is not None and local.dtype.is_floating_point else local.dtype
            self._pieces.append((fqn, local, elem, offset))
            self._served_dtypes.append(kind)
            offset += -(-local.numel() * kind.itemsize // _ALIGN) * _ALIGN
        self.slot_bytes = max(offset, _ALIGN)
        #: A cast the native publish does not make (f32, bf16 and f16 it casts on its way into the slot, in one
        #: pass): this rank's shards in the served dtype, copied into the slot from here.
        self._cast_stage: torch.Tensor | None = None
        if any(not _native_cast(local.dtype, k)
               for k, (_, local, _, _) in zip(self._served_dtypes, self._pieces, strict=True)):
            self._cast_stage = torch.empty(self.slot_bytes, dtype=torch.uint8)
        #: CUDA shards: the device copy of a version and its host staging (see :class:`_DeviceSnapshot`).
        self._device: _DeviceSnapshot | None = None
        if devices and next(iter(devices)).type == "cuda":
            self._device = _DeviceSnapshot(next(iter(devices)), self.slot_bytes)
            self.overlap = True  # the copy to the host slot always runs on the thread
            self._cast_stage = None  # the device snapshot casts
        base = _base_store(store)
        job_key = "w" + "".join(c if c.isalnum() else "_" for c in name)[:15]
        # Serving a name again in the same store (a restart, a test) is a new generation: every rank counts its
        # own serves of the name, so rank r > 0 never takes an earlier generation's job id.
        gen = base.add(_key(name, f"gen{rank}"), 1)
        job = _key(name, f"job{gen}")
        if rank == 0:
            base.set(job, uuid.uuid4().hex[:12])
        else:
            _wait_keys(base, [job], timeout, f"serve_weights({name!r}) on rank {rank}")
        job_id = base.get(job).decode()
        # libfabric binds ODC_FABRIC_ADDR, else (as odc.Engine does) this host's address on the route to
        # MASTER_ADDR. "auto" serves over libfabric only where that address is one other nodes can reach.
        addr = os.environ.get("ODC_FABRIC_ADDR") or _route_to(os.environ.get("MASTER_ADDR"))
        serve, why_not = transport, None
        if transport == "auto" and addr is None:
            serve, why_not = "shm", ("served with shared memory only: set ODC_FABRIC_ADDR on the trainer (or a "
                                     "non-loopback MASTER_ADDR) to serve readers on other nodes")
        with _fabric_addr(addr):
            self._server = _Server(rank, world, job_key, job_id, slots, self.slot_bytes, serve, timeout)
        fabric = self._server.fabric_endpoint()
        #: Whether readers on other nodes can read this rank's slots (over libfabric).
        self.fabric = fabric is not None
        #: Why not, when they cannot.
        self.fabric_error: str | None = why_not or self._server.fabric_error
        self.version = -1
        self.publish_seconds: list[float] = []
        self.publish(0)
        self.wait()
        shards = [[fqn, elem, t.numel(), off] for fqn, t, elem, off in self._pieces]
        base.set(_key(name, f"rank{rank}"), json.dumps({
            "job_id": job_id, "node": _node(), "endpoint": json.loads(self._server.endpoint()),
            "fabric": None if fabric is None else json.loads(fabric), "fabric_error": self.fabric_error,
            "region": json.loads(self._server.region()), "slots": slots, "slot_bytes": self.slot_bytes,
            "shards": shards}))
        if rank == 0:
            base.set(_key(name, "meta"), json.dumps({
                "format": _FORMAT, "world": world, "slots": slots, "job_key": job_key, "job_id": job_id,
                "params": params}))
        self._hooks: list[Any] = []

    def publish(self, version: int | None = None) -> int:
        """Copies this rank's shards as they are now into the slot of ``version`` (default: the next one) and
        announces it; returns the version. Never waits for a reader. With ``overlap`` the copy runs on a thread
        and this returns at once (after the copy before it finished): the shards must not be written until
        :meth:`wait` returned, which the optimizer's next step does first when ``serve_weights`` was given it.

        Raises:
            OdcError: the overlapped copy before this one failed (what it raised).
        """
        self.wait()
        v = self.version + 1 if version is None else int(version)
        t0 = time.perf_counter()
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slot bytes viewed in the served dtype, shard)
        if self._device is not None:  # CUDA: a device copy on a side stream now, the host copy on the thread
            parts, keep = self._device.snapshot(self._pieces, self._served_dtypes), [self._device.host]
        else:  # CPU: the slot copies (or casts) straight from the shards (contiguous), or from the cast stage
            parts, keep = [], []
            for (_, local, _, off), kind in zip(self._pieces, self._served_dtypes, strict=True):
                src = local if local.is_contiguous() else local.contiguous()
                keep.append(src)
                nbytes = src.numel() * src.element_size()
                if kind == src.dtype:
                    parts.append((off, src.data_ptr(), nbytes, None))
                elif _native_cast(src.dtype, kind):
                    parts.append((off, src.data_ptr(), nbytes, (str(src.dtype), str(kind))))
                else:
                    stage = self._cast_stage
                    assert stage is not None  # made for every cast the native publish does not make
                    n = src.numel() * kind.itemsize
                    casts.append((stage[off:off + n].view(kind), src.reshape(-1)))
                    parts.append((off, stage.data_ptr() + off, n, None))
            if casts:
                keep.append(self._cast_stage)  # type: ignore[arg-type]  # not None where casts were made
        if self.overlap:
            if self._copier is None:
                self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"odc-publish-{self.name}")
            self._pending = self._copier.submit(self._copy, v, parts, keep, casts)
        else:
            self._cast(casts)
            self._server.publish(v, parts)
        self.publish_seconds.append(time.perf_counter() - t0)
        self.version = v
        return v

    @staticmethod
    def _cast(casts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for dst, src in casts:
                dst.copy_(src)

    def _copy(self, version: int, parts: list[_Part], keep: list[torch.Tensor],
              casts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._copy_delay:
            time.sleep(self._copy_delay)
        if self._device is not None:
            self._device.staged.synchronize()  # the side stream's copy to the host staging is done
        self._cast(casts)
        self._server.publish(version, parts)  # the GIL released for the copy
        del keep

    def wait(self) -> None:
        """Returns once the last :meth:`publish`'s copy is done and its version announced (at once without
        ``overlap``).

        Raises:
            OdcError: that copy failed (what it raised).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def memory_bytes(self) -> int:
        """Bytes of shared memory the slots hold on this rank (K · slot bytes, plus headers). CUDA shards add one
        slot's bytes on the device and one in pinned host memory (:attr:`device_bytes`). CPU shards served in
        another dtype (``dtype=``) are cast on their way into the slot (f32, bf16, f16), or, for other dtypes, into
        one slot's bytes of private host memory first."""
        return self.slots * (self.slot_bytes + 128) + 64

    @property
    def device_bytes(self) -> int:
        """Bytes a CUDA rank holds besides the slots: the device copy of a version and its pinned host staging,
        one slot's bytes each (0 for CPU shards)."""
        return 0 if self._device is None else 2 * self.slot_bytes

    def close(self) -> None:
        """Stops publishing (removes the optimizer hooks) once the last publish is announced; the slots stay
        readable until this object is gone."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            self.wait()
        finally:
            if self._copier is not None:
                self._copier.shutdown()
                self._copier = None

    def __repr__(self) -> str:
        return (f"WeightServer(name={self.name!r}, rank={self.rank}, slots={self.slots}, "
                f"slot_bytes={self.slot_bytes}, version={self.version}, fabric={self.fabric})")


class _DeviceSnapshot:
    """A CUDA rank's publish: on a side stream of its own, after the work queued so far on the current stream (the
    optimizer step), the rank's shards are copied into one device buffer (device to device: the snapshot), then
    that buffer into pinned host memory; the current stream waits for the snapshot only (an event, no host wait)
    before what comes next may write the parameters. The server's thread waits for the host copy, then copies it
    into the version's slot. One publish at a time (the server waits for the one before)."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self.snap = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.staged = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def snapshot(self, pieces: list[tuple[str, torch.Tensor, int, int]],
                 dtypes: list[torch.dtype]) -> list[_Part]:
        """Queues the copies of ``pieces`` (name, local shard, element offset, byte offset), each cast to its dtype
        of ``dtypes`` on the device; returns the parts (slot offset, host pointer, bytes, no cast) the thread copies
        into the slot once :attr:`staged` is reached."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        parts: list[_Part] = []
        with torch.cuda.stream(self.stream):
            for (_, local, _, off), kind in zip(pieces, dtypes, strict=True):
                src = (local if local.is_contiguous() else local.contiguous()).reshape(-1)
                n = src.numel() * kind.itemsize
                self.snap[off:off + n].view(kind).copy_(src, non_blocking=True)
                parts.append((off, self.host.data_ptr() + off, n, None))
            self.copied.record(self.stream)
            self.host.copy_(self.snap, non_blocking=True)
            self.staged.record(self.stream)
        current.wait_event(self.copied)  # later writes to the parameters come after the snapshot
        return parts


def serve_weights(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, name: str = "policy",
                  slots: int = 2, store: Any = None, timeout: float = 60.0, transport: str = "auto",
                  group: dist.ProcessGroup | None = None, overlap: bool = False,
                  dtype: torch.dtype | None = None) -> WeightServer:
    """Publishes this trainer rank's parameter shards for readers outside the training group.

    Call it on every rank, after ``fully_shard`` (and after ``odc.fsdp.enable``, if used), before the loop. It
    publishes version 0 (the parameters now), then, with an ``optimizer``, version k after its k-th step (a step
    post-hook: the optimizer has just written this rank's shards). Without one, call
    :meth:`WeightServer.publish` yourself where a new version is final.

    Parameters on a CUDA device are served too: each publish copies the rank's shards into a device buffer on a
    side stream (the current stream waits for that copy only, on the device), then to pinned host memory, and the
    server's thread copies that into the slot (one slot's bytes on the device and one pinned, besides the slots;
    :attr:`WeightServer.device_bytes`). A version is readable once that thread is done.

    Args:
        model: the FSDP2 model (parameters ``Shard(0)`` DTensors on a 1-D mesh, on CPU or one CUDA device), an
            FSDP1 model (``FullyShardedDataParallel`` with ``FULL_SHARD`` or ``SHARD_GRAD_OP``, either
            ``use_orig_params``: each rank serves the runs of its FlatParameters' shards under the model's own
            parameter names), or a plain module (rank 0 serves it whole).
        optimizer: whose steps make new versions; None to publish by hand.
        name: what readers ask for (``WeightReader(..., name=...)``).
        slots: K >= 2, the versions each rank keeps; memory is K times this rank's shard bytes.
        store: where readers find the slots (default: the default process group's store, without its prefix,
            so ``WeightReader("MASTER_ADDR:MASTER_PORT")`` finds it).
        timeout: seconds rank r > 0 waits for rank 0's job id in the store; bounds libfabric's operations too.
        transport: how readers reach the slots. ``"shm"``: readers on this rank's node only. ``"fabric"``: also
            readers on other nodes, over libfabric (bound to ``ODC_FABRIC_ADDR``, else to this host's address on
            the route to ``MASTER_ADDR``); an error if libfabric cannot serve them. ``"auto"`` (default): as
            ``"fabric"`` where such an address exists and libfabric opens, else as ``"shm"`` (the reason is in
            :attr:`WeightServer.fabric_error` and in a remote reader's error).
        group: the training group whose ranks serve the shards (default: the default process group), for a job
            whose default group holds other processes too (rollout workers, say).
        overlap: copy each version into its slot on a thread of this rank's own while training goes on (the next
            microbatch's forward and backward), instead of in the optimizer step's hook. The optimizer's next step
            waits for that copy first (a step pre-hook: it reads the shards the step writes), and so does the next
            publish. Parameters written outside ``optimizer.step()`` (a checkpoint load, an elastic rejoin's copy)
            need :meth:`WeightServer.wait` before. A version is readable once its copy is done.
        dtype: the dtype floating-point parameters are served in, e.g. ``torch.bfloat16`` for rollout workers that
            run in bf16: each publish casts the shards (round to nearest even, as ``Tensor.to``) into the slot,
            so the slots hold half the bytes of f32 and readers move half as many; a reader's bf16 read is
            bit-identical to casting the trainer's f32 parameters itself, and a wider read gets those bf16
            values widened. The native publish casts f32, bf16 and f16 on their way into the slot, one pass (other
            floating dtypes: one staging copy of the slot on the host first; CUDA: the device snapshot casts).
            None (default): each parameter's own dtype.

    Returns:
        this rank's :class:`WeightServer`. Keep it: when it is garbage collected its slots are withdrawn (the
        optimizer hook holds it as long as the optimizer lives).

    Raises:
        ConfigError: ``slots`` < 2, shards on several devices or not on CPU or CUDA, or not sharded as FSDP2 or
            FSDP1's full sharding do (FSDP1's hybrid and ``NO_SHARD`` strategies, named), an unknown
            ``transport``.
        TransportError: ``transport="fabric"`` and libfabric cannot serve the slots.
    """
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    server = WeightServer(model, store=store, name=name, slots=slots, rank=rank, world=world, timeout=timeout,
                          transport=transport, overlap=overlap, dtype=dtype)
    if optimizer is not None:
        def publish(*_: Any) -> None:
            server.publish()

        def wait(*_: Any) -> None:
            server.wait()

        # With overlap, a step waits for the copy of the version before it: the copy reads the shards it writes.
        server._hooks = [optimizer.register_step_pre_hook(wait), optimizer.register_step_post_hook(publish)]
    return server


@dataclass(frozen=True)
class _Shard:
    name: str
    elem: int
    numel: int
    offset: int


class WeightReader:
    """Reads a served model's parameter versions from outside the training group.

    Args:
        store: the job's store (a ``torch.distributed.Store``), or its address ``"host:port"`` (a TCPStore).
        name: the name the trainer served (``serve_weights(name=...)``).
        timeout: seconds to wait for the trainer's ranks to appear in the store, the default deadline of each
            :meth:`read`, and the longest a network read may go unanswered before its trainer rank counts as dead.
        transport: ``"auto"`` (default): shared memory for trainer ranks on this node (same host and network
            namespace), libfabric for the others (bound to ``ODC_FABRIC_ADDR``, else to this host's address on the
            route to the store). ``"shm"`` or ``"fabric"``: that way to every rank.
        node_cache: where some trainer rank is on another node, share each version across once per node: the first
            reader of this node (elected through the store) fetches every new version whole into copies of the
            trainer's slots in this node's shared memory, and every reader of the node, that one too, reads the
            copies by the same rules (a version lags by one fetch). If the fetching reader dies, the node's other
            readers fail naming it (``PeerDied``).
        staging: how the slots of trainer ranks over the network (libfabric) are copied before the cast: ``"whole"``
            (default) all at once, in flight together, into one buffer per rank; ``"pieces"``: in pieces of 64 MiB,
            the next piece's copy in flight while the one before is cast (memory: two pieces instead of the
            model). Slots this process maps (``shm``: the trainer's node, or ``node_cache``) are cast straight out of
            the mapping, without a copy. Either way a read is one whole version: sequence-word checks bracket every
            cast, and ``into`` changes only after every rank's part arrived whole.

    Attributes:
        routes: how each trainer rank is reached, by rank (``"shm"``, ``"fabric"``, or ``"node-cache"``).
        cache_fetches: with ``node_cache``, on the node's fetching reader: versions fetched across so far (else
            None).

    Raises:
        StoreError: nothing is served under ``name`` within ``timeout`` (the message names the missing key).
        ConfigError: a trainer rank on another node that serves no libfabric endpoint (the message says why it
            has none).
    """

    def __init__(self, store: Any, name: str = "policy", *, timeout: float = 60.0, transport: str = "auto",
                 node_cache: bool = False, staging: str = "whole") -> None:
        _check_name(name)
        _check_transport(transport, "WeightReader")
        if staging not in _STAGINGS:
            raise ConfigError(f"WeightReader: staging={staging!r}; expected one of {', '.join(_STAGINGS)}")
        store_host = None
        if isinstance(store, str):
            host, _, port = store.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"WeightReader: store address {store!r}: expected 'host:port'")
            store_host = host
            store = dist.TCPStore(host, int(port), is_master=False,  # type: ignore[attr-defined]
                                  timeout=datetime.timedelta(seconds=timeout))
        self.name, self.timeout = name, timeout
        base = _base_store(store)
        _wait_keys(base, [_key(name, "meta")], timeout, f"WeightReader({name!r}): nothing served under this name")
        deadline = time.monotonic() + timeout
        while True:  # the manifest and every rank's post of one generation (a name served again moves on)
            meta = json.loads(base.get(_key(name, "meta")))
            if meta.get("format") != _FORMAT:
                raise ConfigError(f"WeightReader({name!r}): manifest format {meta.get('format')!r}, this reader "
                                  f"reads {_FORMAT}")
            world = int(meta["world"])
            keys = [_key(name, f"rank{r}") for r in range(world)]
            _wait_keys(base, keys, max(deadline - time.monotonic(), 0.001), f"WeightReader({name!r})")
            ranks = [json.loads(v) for v in base.multi_get(keys)]
            stale = [r for r, info in enumerate(ranks) if info["job_id"] != meta["job_id"]]
            if not stale:
                break
            if time.monotonic() >= deadline:
                raise StoreError(f"WeightReader({name!r}): rank {stale[0]} serves job {ranks[stale[0]]['job_id']}, "
                                 f"the manifest names {meta['job_id']} (a rank of the trainer did not serve again?)")
            time.sleep(0.01)
        #: name -> (full shape, dtype) in the trainer's parameter order.
        self.params: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            fqn: (tuple(shape), _dtype(dt)) for fqn, shape, dt in meta["params"]}
        self.slots = int(meta["slots"])
        self.world = world
        self._shards = [[_Shard(*s) for s in info["shards"]] for info in ranks]
        self._check_cover()
        # A manifest without nodes (one host) is read over shared memory.
        here = _node()
        owners = [(json.dumps(i["endpoint"]), json.dumps(i["region"]), int(i["slots"]), int(i["slot_bytes"]),
                   i.get("node", here), None if i.get("fabric") is None else json.dumps(i["fabric"]),
                   i.get("fabric_error")) for i in ranks]
        if store_host is None:
            store_host = getattr(base, "host", None) or os.environ.get("MASTER_ADDR")
        addr = os.environ.get("ODC_FABRIC_ADDR") or _route_to(store_host)
        try:
            with _fabric_addr(addr):
                self._reader = _Reader(meta["job_key"], meta["job_id"], owners, transport, float(timeout))
        except TransportError as e:
            raise TransportError(f"WeightReader({name!r}): cannot reach the served slots (is the trainer still "
                                 f"running and holding what serve_weights returned?): {e}") from e
        self.routes: list[str] = list(self._reader.routes())
        self._cache: Any = None
        if node_cache and "fabric" in self.routes:
            self._share_on_node(base, meta, here)
        self.staging = staging
        self._slot_bytes = [int(i["slot_bytes"]) for i in ranks]
        #: Copies of the slots of ranks over the network, by rank (``staging="pieces"``: two, under -1 and -2).
        self._staging: dict[int, torch.Tensor] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: A read with ``into``: the version cast, by name, until it is whole (made at the first read).
        self._cast: dict[str, torch.Tensor] = {}
        self._between = [0.0, 0]

    def _share_on_node(self, base: Any, meta: dict[str, Any], here: str) -> None:
        """Reads this node's copies of the trainer's slots instead (see ``node_cache``), serving them first when this
        reader is the node's first."""
        key = _key(self.name, f"cache/{meta['job_id']}/{here}")
        if base.add(key + "/readers", 1) == 1:
            copies = meta["job_id"] + uuid.uuid4().hex[:6]
            self._cache = _NodeCache(self._reader, meta["job_key"], copies, float(self.timeout))
            base.set(key, json.dumps({"job_id": copies, "owners": self._cache.owners()}))
        else:
            _wait_keys(base, [key], self.timeout, f"WeightReader({self.name!r}): this node's cache")
        info = json.loads(base.get(key))
        owners = [(ep, region, int(k), int(nbytes), here, None, None) for ep, region, k, nbytes in info["owners"]]
        try:
            self._reader = _Reader(meta["job_key"], info["job_id"], owners, "shm", float(self.timeout))
        except TransportError as e:
            raise TransportError(f"WeightReader({self.name!r}): cannot map this node's cache (is the reader that "
                                 f"fetches for the node still running?): {e}") from e
        self.routes = ["node-cache"] * self.world

    @property
    def cache_fetches(self) -> int | None:
        """Versions this reader fetched across for its node (``node_cache``, the fetching reader), else None."""
        return None if self._cache is None else int(self._cache.fetched)

    def _check_cover(self) -> None:
        """Every parameter's shards cover it exactly once (a manifest that does not is refused)."""
        seen: dict[str, list[tuple[int, int]]] = {n: [] for n in self.params}
        for r, shards in enumerate(self._shards):
            for s in shards:
                if s.name not in seen:
                    raise LayoutError(f"WeightReader({self.name!r}): rank {r} serves {s.name!r}, which the "
                                      "manifest does not list")
                seen[s.name].append((s.elem, s.numel))
        for n, runs in seen.items():
            numel = math.prod(self.params[n][0])
            at = 0
            for elem, count in sorted(runs):
                if elem != at:
                    break
                at += count
            if at != numel:
                raise LayoutError(f"WeightReader({self.name!r}): the served shards of {n!r} cover {at} of its "
                                  f"{numel} elements")

    def latest(self) -> int | None:
        """The newest version every trainer rank has published, or None before the first."""
        words = self._reader.latest()
        return None if min(words) == 0 else min(words) - 1

    def _targets(self, into: nn.Module | Mapping[str, torch.Tensor], strict: bool) -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = (dict(into.named_parameters()) if isinstance(into, nn.Module)
                                            else dict(into))
        for n, (shape, _) in self.params.items():
            if n not in targets:
                raise LayoutError(f"WeightReader.read: {n!r} is served but not in `into` (first missing name; "
                                  f"`into` has {len(targets)} entries)")
            t = targets[n]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise LayoutError(f"WeightReader.read: {n!r} has shape {got} in `into`, the trainer's is {shape}")
        if strict:
            extra = [n for n in targets if n not in self.params]
            if extra:
                raise LayoutError(f"WeightReader.read: `into` has {extra[0]!r}, which is not served "
                                  f"({len(extra)} such name(s); strict=False ignores them)")
        return targets

    def read(self, version: int | str = "latest", into: nn.Module | Mapping[str, torch.Tensor] | None = None,
             dtype: torch.dtype = torch.bfloat16, *, timeout: float | None = None, retries: int = 16,
             strict: bool = True) -> ReadResult:
        """Reads one whole version of every parameter.

        Args:
            version: ``"latest"`` (the newest every trainer rank has; if it is overwritten while read, a newer one
                is read) or a version number (waited for if not yet published; refused if overwritten).
            into: a model (its ``named_parameters``) or a state dict whose tensors receive the parameters, cast to
                each tensor's own dtype; None to get new tensors of ``dtype`` in :attr:`ReadResult.tensors`.
            dtype: the dtype of new tensors (``into=None``).
            timeout: seconds the read may wait (default: the reader's).
            retries: how many times a ``"latest"`` read starts again after a version was overwritten under it.
            strict: with ``into``, refuse names in it that are not served (its buffers, say: pass
                ``strict=False``).

        Returns:
            the :class:`ReadResult` (version, age, ...).

        Raises:
            LayoutError: ``into`` misses a served name or holds one with another shape (the first named);
                ``into`` is unchanged.
            VersionRefused: no whole version could be read (see the class); ``into`` is unchanged.
            PeerTimeout: a trainer rank published nothing (or not ``version``) within the timeout.
            PeerDied: a trainer rank is gone, or on another node answered no read within the reader's timeout
                (``peer`` names it); ``into`` is unchanged.
        """
        t0 = time.perf_counter()
        if version == "latest":
            want = None
        elif isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            want = version
        else:
            raise ConfigError(f"WeightReader.read: version={version!r}; expected 'latest' or a number >= 0")
        targets = self._targets(into, strict) if into is not None else None
        out: dict[str, torch.Tensor] | None = None
        if targets is None:
            out = targets = {n: torch.empty(shape, dtype=dtype) for n, (shape, _) in self.params.items()}
        # New tensors are nobody's until returned: cast into them. `into` gets the version only once whole.
        dst = targets if out is not None else self._cast_buffers(targets)
        got = self._read_version(want, dst, float(self.timeout if timeout is None else timeout), int(retries))
        if out is None:
            with torch.no_grad():
                for n, t in dst.items():
                    targets[n].copy_(t)
        return ReadResult(version=got["version"], newest=got["newest"], attempts=got["attempts"],
                          seconds=time.perf_counter() - t0, tensors=out)

    def _cast_buffers(self, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The buffers a read into ``into`` fills first: each served tensor in its target's dtype and shape."""
        for n in self.params:
            t = targets[n]
            have = self._cast.get(n)
            if have is None or have.dtype != t.dtype:
                self._cast[n] = torch.empty(t.shape, dtype=t.dtype)
        return {n: self._cast[n] for n in self.params}

    def _stage(self, key: int, nbytes: int) -> torch.Tensor:
        """A staging buffer of at least ``nbytes`` (by rank with ``staging="whole"``; the two pieces' with
        ``"pieces"``), made at the first need."""
        if key not in self._staging or self._staging[key].numel() < nbytes:
            self._staging[key] = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[key]

    def _read_version(self, want: int | None, dst: dict[str, torch.Tensor], wait: float,
                      retries: int) -> dict[str, Any]:
        """Casts one whole version into ``dst``; returns the native reader's answer (version, newest, attempts).

        Sequence-word reads bracket every attempt: the first (a read of no bytes) picks the version and checks
        every rank's slot holds it; the slots this process maps are cast straight out of the mapping, the others
        copied (libfabric) into staging and cast; the last (no bytes again) reads every ``begin`` word after an
        acquire fence: unchanged, nothing the casts read was overwritten. A ``"latest"`` read whose version was
        overwritten starts again on the newest (``retries`` times); a version asked by number is refused.
        """
        deadline = time.monotonic() + wait
        zeros = [(0, 0)] * self.world
        attempts = 0
        while True:
            attempts += 1
            got = self._reader.read(want, zeros, max(deadline - time.monotonic(), 1e-3), 0)
            if "refused" not in got:
                version = int(got["version"])
                got = self._fill(version, dst, zeros, deadline) or self._reader.read(
                    version, zeros, max(deadline - time.monotonic(), 1e-3), 0)
                if "refused" not in got:
                    return {**got, "attempts": attempts}
            if want is not None or attempts > retries or time.monotonic() >= deadline:
                raise VersionRefused(got["refused"], got["owner"], got["version"], got["by"], attempts)

    def _fill(self, version: int, dst: dict[str, torch.Tensor], zeros: list[tuple[int, int]],
              deadline: float) -> dict[str, Any] | None:
        """Casts every rank's part of ``version`` into ``dst``: ranks over the network copied first (see
        ``staging``; each copy checked whole on its own), mapped ranks straight from the mapping. Returns the native
        reader's refusal if a copy was refused, else None (the caller's last check decides)."""
        maps = self._reader.mapped(version)
        remote = [r for r in range(self.world) if maps[r] is None]
        done = 0
        if remote and self.staging == "whole":
            bufs = list(zeros)
            for r in remote:
                bufs[r] = (self._stage(r, self._slot_bytes[r]).data_ptr(), self._slot_bytes[r])
            got = self._reader.read(version, bufs, max(deadline - time.monotonic(), 1e-3), 0)
            if "refused" in got:
                return dict(got)
            for r in remote:
                self._assemble(dst, r, self._stage(r, self._slot_bytes[r]))
                done = self._fault_point(done)
        elif remote:
            refused = self._fill_pieces(version, dst, zeros, deadline, remote)
            if refused is not None:
                return refused
            done += len(remote)
        for r in range(self.world):
            place = maps[r]
            if place is not None:
                addr, nbytes = place
                self._assemble(dst, r, torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr),
                                                        dtype=torch.uint8))
                done = self._fault_point(done)
        return None

    def _fill_pieces(self, version: int, dst: dict[str, torch.Tensor], zeros: list[tuple[int, int]],
                     deadline: float, remote: list[int]) -> dict[str, Any] | None:
        """``staging="pieces"``: the remote ranks' slots in pieces of ``PIECE_BYTES``, one in flight while the one
        before is cast (two buffers); each piece's copy checked whole on its own. A piece holds the same byte range
        of every remote rank's slot (``PIECE_BYTES`` shared between them), so each read goes to every trainer rank
        at once: trainer ranks on several nodes send over their links together."""
        sub = max(_ALIGN, PIECE_BYTES // len(remote) // _ALIGN * _ALIGN)  # bytes of one rank's slot per piece
        starts = range(0, max(self._slot_bytes[r] for r in remote), sub)
        stages = [self._stage(-1, sub * len(remote)), self._stage(-2, sub * len(remote))]

        def spans(a: int) -> list[tuple[int, int, int]]:
            """(rank, byte offset in the stage, bytes) of the piece starting at byte ``a`` of the slots."""
            return [(r, j * sub, min(sub, self._slot_bytes[r] - a)) for j, r in enumerate(remote)
                    if self._slot_bytes[r] > a]

        def fetch(i: int) -> dict[str, Any]:
            a, stage = starts[i], stages[i % 2]
            bufs = list(zeros)
            for r, off, n in spans(a):
                bufs[r] = (stage.data_ptr() + off, n)
            return dict(self._reader.read(version, bufs, max(deadline - time.monotonic(), 1e-3), 0, a))

        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="odc-weight-reader")
        pending = self._pool.submit(fetch, 0)
        try:
            for i, a in enumerate(starts):
                got = pending.result()
                if "refused" in got:
                    return got
                if i + 1 < len(starts):
                    pending = self._pool.submit(fetch, i + 1)
                for r, off, n in spans(a):
                    self._assemble(dst, r, stages[i % 2][off:off + n], a)
                self._fault_point(i)
        finally:
            pending.result()  # never leave a copy landing in a buffer the next read reuses
        return None

    def _fault_point(self, done: int) -> int:
        """After the first rank's part (or piece) is cast: the test fault's sleep (:meth:`_set_fault`), if one is
        pending."""
        if done == 0 and self._between[1] > 0:
            self._between[1] -= 1
            time.sleep(self._between[0])
        return done + 1

    def _assemble(self, targets: dict[str, torch.Tensor], r: int, buf: torch.Tensor, at: int = 0) -> None:
        """Casts what ``buf`` holds of rank ``r``'s slot (its bytes from ``at`` on) into the full tensors
        (contiguous): every shard's elements in that range."""
        end = at + buf.numel()
        with torch.no_grad():
            for s in self._shards[r]:
                dt = self.params[s.name][1]
                lo, hi = max(s.offset, at), min(s.offset + s.numel * dt.itemsize, end)
                if lo >= hi:
                    continue
                src = buf[lo - at:hi - at].view(dt)
                first = s.elem + (lo - s.offset) // dt.itemsize
                targets[s.name].view(-1)[first:first + src.numel()].copy_(src)

    def _set_fault(self, delay: float, reads: int = 1) -> None:
        """Test fault point: in each of the next ``reads`` reads, sleep ``delay`` seconds after the first rank's part
        was cast and before the others' (a slot overwritten meanwhile must be seen by the read's last check)."""
        self._between = [float(delay), int(reads)]

    def __repr__(self) -> str:
        return (f"WeightReader(name={self.name!r}, ranks={self.world}, slots={self.slots}, params={len(self.params)}, "
                f"routes={self.routes})")
