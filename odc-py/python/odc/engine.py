"""The worker API on torch tensors: :class:`Engine`.

One :class:`Engine` per rank. It owns this rank's shard server daemon (a
native thread) and talks to peers through shared memory. The rendezvous
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
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Union

from . import _odc
from .errors import LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["Bucket", "Engine", "dtype_name"]

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
        if not isinstance(self.numel, int) or self.numel < 1:
            raise LayoutError(f"bucket {self.name!r}: numel must be a positive integer, got {self.numel!r}")
        return (str(self.name), int(self.numel), dtype_name(self.dtype))


BucketRef = Union[int, str]


def _buffer(t: "torch.Tensor", what: str) -> tuple[int, int, str]:
    if t.device.type != "cpu":
        raise LayoutError(f"{what} is on {t.device}; the shared-memory transport moves CPU tensors")
    if not t.is_contiguous():
        raise LayoutError(f"{what} is not contiguous")
    return t.data_ptr(), t.numel() * t.element_size(), dtype_name(t.dtype)


class Engine:
    """One rank's ODC engine (shard server daemon + worker API).

    Args:
        store: torch ``dist.Store`` shared by every rank (TCPStore, FileStore,
            or ``dist.distributed_c10d._get_default_store()``).
        rank: this rank.
        world_size: number of ranks D.
        local_world_size: ranks per node (default: all on one node).
        chunk_bytes: landing-slot size (bytes); landing memory is
            ``2 · D · chunk_bytes`` per rank. Default: the engine's.
        timeout: seconds any wait on a peer may take (default 300, or
            ``ODC_TIMEOUT_S``).
        job_key: names this job's shared-memory segments so a restart of the
            same job removes a crashed run's leftovers (default
            ``ODC_JOB_KEY`` or ``"default"``).
        prefix: store key prefix, so several engines can share one store.
        transport: ``"auto"`` (the default: ``"shm"`` on one node, else
            ``"mixed"``), ``"shm"`` (shared memory, every rank on one
            host), ``"fabric"`` (libfabric RMA to every peer;
            ``ODC_FABRIC_ADDR`` / ``ODC_FABRIC_PROVIDER`` choose the address
            and provider) or ``"mixed"`` (shared memory within a node,
            libfabric between nodes, as ``local_world_size`` places ranks).
            Default: ``ODC_TRANSPORT``, else ``"auto"``.
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
    ) -> None:
        if transport is None:
            transport = os.environ.get("ODC_TRANSPORT") or None
        self._native = _odc.Engine(
            store,
            int(rank),
            int(world_size),
            local_world_size=local_world_size,
            chunk_bytes=chunk_bytes,
            timeout=timeout,
            job_key=job_key,
            prefix=prefix,
            transport=transport,
        )
        self._ids: dict[str, int] = {}
        self._infos: list[dict] = []

    # -- setup ---------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def transport(self) -> str:
        """The transport in use: ``"shm"``, ``"fabric"`` or ``"shm+fabric"``."""
        return self._native.transport

    @property
    def timeout(self) -> float:
        return self._native.timeout

    def register(self, buckets: Iterable[Bucket]) -> None:
        """Registers every bucket, collectively and in the same order on every rank.

        Raises:
            RegistrationError: another rank registered a different list (the
                message names the first differing bucket).
        """
        specs = [b.spec() for b in buckets]
        self._native.register(specs)
        self._infos = [self._native.bucket_info(i) for i in range(self._native.num_buckets())]
        self._ids = {info["name"]: i for i, info in enumerate(self._infos)}

    def bucket(self, ref: BucketRef) -> dict:
        """Layout of a bucket: name, numel, dtype, shard_len, padded_len."""
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

    # -- data path -----------------------------------------------------------
    def publish(self, bucket: BucketRef, shard: "torch.Tensor", version: int) -> None:
        """Publishes this rank's shard (``shard_len`` elements, parameter dtype) as ``version``.

        Waits until every reader released ``version - 1``.
        """
        ptr, n, dt = _buffer(shard, "shard")
        self._native.publish(self._id(bucket), ptr, n, dt, int(version))

    def gather(self, bucket: BucketRef, version: int, out: "torch.Tensor", *, skip_own: bool = False) -> "torch.Tensor":
        """Reads ``version`` of every owner's shard into ``out`` (``numel`` or padded length).

        With ``skip_own`` this rank's own range of ``out`` is left untouched
        (for callers that already copied their shard in).
        """
        ptr, n, dt = _buffer(out, "output")
        self._native.gather(self._id(bucket), int(version), ptr, n, dt, skip_own)
        return out

    def release(self, bucket: BucketRef, version: int) -> None:
        """Tells every owner this rank is done reading ``version`` of ``bucket``."""
        self._native.release(self._id(bucket), int(version))

    def scatter_accumulate(
        self, bucket: BucketRef, grads: "torch.Tensor", scale: float = 1.0, offset: int | None = None
    ) -> None:
        """Pushes ``grads`` to the owners: the whole bucket (``numel`` or padded
        length) when ``offset`` is None, else the part starting at element ``offset``.

        Each owner adds ``scale · grads[its shard]`` into its f32 accumulator.
        Returns once the data is in the owners' landing slots (``grads`` may
        be reused); does not wait for the additions.
        """
        ptr, n, dt = _buffer(grads, "gradient")
        self._native.scatter_accumulate(
            self._id(bucket), ptr, n, dt, float(scale), None if offset is None else int(offset)
        )

    def finish_minibatch(self, k: int) -> None:
        """Ends minibatch ``k``; returns when this rank's own gradient shards are final."""
        self._native.finish_minibatch(int(k))

    def grad_shard(self, bucket: BucketRef) -> "torch.Tensor":
        """This rank's f32 gradient accumulator of ``bucket``, as a tensor view (no copy).

        Valid between :meth:`finish_minibatch` and the next publish; it
        aliases engine memory, so copy it if you need it later.
        """
        import torch

        ptr, numel = self._native.grad_shard_ptr(self._id(bucket))
        buf = (ctypes.c_float * numel).from_address(ptr)
        return torch.frombuffer(buf, dtype=torch.float32, count=numel)

    def zero_grad(self, bucket: BucketRef | None = None) -> None:
        """Zeroes one accumulator, or all of them."""
        if bucket is None:
            self._native.zero_grads()
        else:
            self._native.zero_grad(self._id(bucket))

    def __repr__(self) -> str:
        return f"odc.Engine(rank={self.rank}, world_size={self.world_size}, buckets={len(self._infos)})"
