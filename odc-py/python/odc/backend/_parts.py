"""The ``odc`` backend's parts: the Work objects it returns and the scratch-bucket engines behind its collectives.

Split out of :mod:`odc.backend`, whose module doc describes the scheme (scratch buckets, versions, the
alternating reduce-scatter buckets, CUDA tensors and host staging); :mod:`._engines` decides when these
are made, how large, and who shares them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from ..engine import Bucket, Engine
from ..errors import LayoutError

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: What the scratch buckets hold: 2-byte words. A gather moves bytes, so every dtype of ``_DTYPES`` travels
#: through the same buckets as its bytes viewed as words (bit-exact); a reduce-scatter bucket is never
#: published (only its f32 accumulator and landing slots are used), so its shards take the narrowest dtype.
WIRE = torch.float16
WIRE_BYTES = 2
# Every shard class is a multiple of this many elements, so a bucket of
# D·S elements has shard_len exactly S in every dtype (the engine aligns
# shards to 64 bytes in the dtype and in the f32 accumulator).
_ALIGN_ELEMS = 64
_SMALLEST_SHARD_BYTES = 4096
_CLASS_STEP = 4


def _capacity(nbytes: int, elem_size: int) -> int:
    return max(_ALIGN_ELEMS, nbytes // elem_size // _ALIGN_ELEMS * _ALIGN_ELEMS)


def shard_classes(nbytes: int, elem_size: int) -> list[int]:
    """Shard lengths (elements of ``elem_size`` bytes) of scratch buckets up to ``nbytes`` per rank:
    4 KiB, ×4 each, ascending, ending at ``nbytes`` (rounded down to 64 elements)."""
    cap = _capacity(nbytes, elem_size)
    out, s = [], _capacity(_SMALLEST_SHARD_BYTES, elem_size)
    while s < cap:
        out.append(s)
        s *= _CLASS_STEP
    out.append(cap)
    return out


def class_for(need: int, classes: Sequence[int]) -> int:
    """The smallest of ``classes`` that holds ``need`` elements, the largest if none does (the op is then cut)."""
    return next((s for s in classes if s >= need), classes[-1])


# -- Work ------------------------------------------------------------------------
def completed_work(result: list[torch.Tensor], device: torch.device) -> dist.Work:
    """The Work of an ODC collective: it completed before the call returned, or, on CUDA tensors, it is
    enqueued on the current stream.

    A C++ Work around a completed future, so that it outlives any Python reference to it (torch's
    dispatcher hands it on as a C++ object). On CUDA tensors the future records an event on the current
    stream; ``wait()`` makes the waiter's current stream wait for it, as NCCL's Work does.
    """
    fut: Future[list[torch.Tensor]] = Future(devices=[device]) if device.type == "cuda" else Future()
    fut.set_result(result)
    work: dist.Work = _create_work_from_future(fut)
    return work


class _StagedWork(dist.Work):
    """The Work of a gloo operation run on host copies of CUDA tensors: waiting copies the results back."""

    def __init__(self, work: dist.Work, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self._work = work
        self._copies = copies
        self._result = [t for t, _ in copies]
        self._lock = threading.Lock()

    def _copy_back(self) -> None:
        with self._lock:
            copies, self._copies = self._copies, []
            for device_tensor, host in copies:
                device_tensor.copy_(host)

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        self._copy_back()
        return True

    def is_completed(self) -> bool:
        if not self._work.is_completed():
            return False
        if self._work.exception() is None:
            self._copy_back()
        return True

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        return self._work._source_rank()  # recv_anysource: the rank that sent

    def get_future(self) -> Future[list[torch.Tensor]]:
        def done(fut: Future[Any]) -> list[torch.Tensor]:
            fut.value()  # raises gloo's error
            self._copy_back()
            return self._result

        return self._work.get_future().then(done)


def _to_host(arg: Any, copies: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
    """``arg`` (a tensor, or lists of them) with every tensor replaced by a host copy;
    each (tensor, copy) pair is appended to ``copies`` unless it is None."""
    if isinstance(arg, torch.Tensor):
        host = arg.to("cpu", copy=True)
        if copies is not None:
            copies.append((arg, host))
        return host
    if isinstance(arg, (list, tuple)):
        return type(arg)(_to_host(a, copies) for a in arg)
    return arg


def _tensors(args: Sequence[Any]) -> list[torch.Tensor]:
    """Every tensor in ``args`` (tensors, lists of them, lists of lists)."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_tensors(a))
    return out


# -- the engines ------------------------------------------------------------------
class Gatherer:
    """All-gather through versions of scratch buckets of 2-byte words, one bucket per shard class (engine
    prefix ``...-ag``).

    Args:
        engine: a new engine (registers the buckets, collectively).
        classes: shard lengths in words, ascending; the last is the largest piece an op is cut into.
    """

    def __init__(self, engine: Engine, classes: list[int]) -> None:
        self.engine = engine
        self.world = engine.world_size
        self.classes = classes
        buckets = [Bucket(self._name(s), self.world * s, WIRE) for s in classes]
        engine.register(buckets)
        for b in buckets:
            if engine.bucket(b.name)["shard_len"] != b.numel // self.world:
                raise LayoutError(f"scratch bucket {b.name}: unexpected shard length {engine.bucket(b.name)}")
        self.version = {b.name: 0 for b in buckets}
        self._staging: dict[str, torch.Tensor] = {}
        self._full: dict[str, torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        """The largest shard class, in words."""
        return self.classes[-1]

    @staticmethod
    def _name(shard: int) -> str:
        return f"ag-{shard}"

    def _buffer(self, cache: dict[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
        buf = cache.get(name)
        if buf is None:
            buf = cache[name] = torch.zeros(numel, dtype=WIRE, device=self.engine.device)
        return buf

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (D·n, contiguous) gets every rank's ``inp`` (n, contiguous), rank order, bit for bit."""
        out, inp = out.view(WIRE), inp.view(WIRE)
        n, world, classes = inp.numel(), self.world, self.classes
        rows = out.view(world, n)
        for start in range(0, n, classes[-1]):
            length = min(classes[-1], n - start)
            shard = class_for(length, classes)
            name = self._name(shard)
            version = self.version[name]
            self.version[name] = version + 1
            piece = inp[start : start + length]
            if length != shard:
                staged = self._buffer(self._staging, name, shard)
                staged[:length].copy_(piece)
                piece = staged
            self.engine.publish(name, piece, version)
            if length == n == shard:
                self.engine.gather(name, version, out)
                self.engine.release(name, version)
                continue
            full = self._buffer(self._full, name, world * shard)
            self.engine.gather(name, version, full)
            self.engine.release(name, version)
            rows[:, start : start + length].copy_(full.view(world, shard)[:, :length])


class Reducer:
    """Reduce-scatter through two alternating scratch buckets (engine prefix ``...-rs``): each owner's row
    of a piece is pushed into the owner's shard and summed in its f32 accumulator.

    Args:
        engine: a new engine (registers the buckets, collectively).
        shard: elements per rank of each bucket: the largest piece an op is cut into.
    """

    def __init__(self, engine: Engine, shard: int) -> None:
        self.engine = engine
        self.world, self.rank = engine.world_size, engine.rank
        self.shard = shard
        engine.register(self.buckets(self.world, shard))
        self.accum = [engine.grad_shard(i) for i in range(2)]
        self.k = 0

    @property
    def capacity(self) -> int:
        return self.shard

    @staticmethod
    def buckets(world: int, shard: int) -> list[Bucket]:
        """The two scratch buckets a reduce-scatter engine of ``world`` ranks registers for ``shard`` elements."""
        return [Bucket(f"rs-{i}", world * shard, WIRE) for i in range(2)]

    @staticmethod
    def chunk_bytes(shard: int) -> int:
        """The landing chunk of a reduce-scatter engine: the largest row a piece pushes (f32), at most 2 MiB
        (the engine's default, what larger pieces are cut into)."""
        return min(2 << 20, shard * 4)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scale: float) -> None:
        """``out`` (n) gets ``scale · Σ_ranks inp.view(D, n)[rank]``, accumulated in f32."""
        n, world = out.numel(), self.world
        rows = inp.view(world, n)
        for start in range(0, n, self.shard):
            length = min(self.shard, n - start)
            k = self.k
            self.k += 1
            bucket = k % 2
            for i in range(world):
                # Start with the next rank so owners are not all hit in the same order.
                owner = (self.rank + 1 + i) % world
                self.engine.scatter_accumulate(
                    bucket, rows[owner, start : start + length], scale=scale, offset=owner * self.shard
                )
            self.engine.finish_minibatch(k)
            acc = self.accum[bucket][:length]
            out[start : start + length].copy_(acc)
            if self.engine.is_device:
                # On the daemon's stream after the read: the additions of piece k + 2 queue behind it.
                self.engine.zero_grad(bucket)
            else:
                acc.zero_()
