"""The ``odc`` backend's parts: the Work objects it returns and the engine pair behind its collectives.

Split out of :mod:`odc.backend`, whose module doc describes the scheme (scratch buckets, versions, the
alternating reduce-scatter buckets, CUDA tensors and host staging).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..engine import Bucket, Engine, dtype_name
from ..errors import LayoutError

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every shard capacity is a multiple of this many elements, so a bucket of
# D·S elements has shard_len exactly S in every dtype (the engine aligns
# shards to 64 bytes in the dtype and in the f32 accumulator).
_ALIGN_ELEMS = 64
_SMALLEST_SHARD_BYTES = 4096
_CLASS_STEP = 4


def _capacity(nbytes: int, elem_size: int) -> int:
    return max(_ALIGN_ELEMS, nbytes // elem_size // _ALIGN_ELEMS * _ALIGN_ELEMS)


def _shard_classes(nbytes: int, elem_size: int) -> list[int]:
    """Shard lengths of the all-gather buckets of one dtype, ascending, ending at the capacity."""
    cap = _capacity(nbytes, elem_size)
    out, s = [], _capacity(_SMALLEST_SHARD_BYTES, elem_size)
    while s < cap:
        out.append(s)
        s *= _CLASS_STEP
    out.append(cap)
    return out


# -- Work ------------------------------------------------------------------------
class _CompletedWork(dist.Work):
    """The Work of an ODC collective: it completed before the call returned, or,
    on CUDA tensors, it is enqueued on the stream that was current then."""

    def __init__(self, result: list[torch.Tensor], device: torch.device | None = None) -> None:
        super().__init__()
        self._result = result
        self._stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None

    def wait(self, timeout: Any = None) -> bool:
        # As NCCL's Work: later work on the caller's stream runs after the op.
        if self._stream is not None:
            current = torch.cuda.current_stream(self._stream.device)
            if current.cuda_stream != self._stream.cuda_stream:
                current.wait_stream(self._stream)
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future[list[torch.Tensor]]:
        # A CUDA future records an event on the current streams at set_result
        # and makes its waiters' streams wait for it.
        devices: list[int | str | torch.device] | None = [self._stream.device] if self._stream is not None else None
        fut: Future[list[torch.Tensor]] = Future(devices=devices) if devices else Future()
        fut.set_result(self._result)
        return fut


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


# -- the engine pairs ----------------------------------------------------------------
class _Gatherer:
    """All-gather through versions of per-dtype scratch buckets (engine prefix ``odc-ag``)."""

    def __init__(self, engine: Engine, nbytes: int) -> None:
        self.engine = engine
        self.world = engine.world_size
        self.classes = {dt: _shard_classes(nbytes, dt.itemsize) for dt in _DTYPES}
        buckets = [
            Bucket(self._name(dt, s), self.world * s, dt) for dt in _DTYPES for s in self.classes[dt]
        ]
        engine.register(buckets)
        for b in buckets:
            if engine.bucket(b.name)["shard_len"] != b.numel // self.world:
                raise LayoutError(f"scratch bucket {b.name}: unexpected shard length {engine.bucket(b.name)}")
        self.version = {b.name: 0 for b in buckets}
        self._staging: dict[str, torch.Tensor] = {}
        self._full: dict[str, torch.Tensor] = {}

    @staticmethod
    def _name(dtype: torch.dtype, shard: int) -> str:
        return f"ag-{dtype_name(dtype)}-{shard}"

    def _buffer(self, cache: dict[str, torch.Tensor], name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = cache.get(name)
        if buf is None:
            buf = cache[name] = torch.zeros(numel, dtype=dtype, device=self.engine.device)
        return buf

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (D·n, contiguous) gets every rank's ``inp`` (n, contiguous), rank order."""
        n, world, dtype = inp.numel(), self.world, inp.dtype
        classes = self.classes[dtype]
        rows = out.view(world, n)
        for start in range(0, n, classes[-1]):
            length = min(classes[-1], n - start)
            shard = next(s for s in classes if s >= length)
            name = self._name(dtype, shard)
            version = self.version[name]
            self.version[name] = version + 1
            piece = inp[start : start + length]
            if length != shard:
                staged = self._buffer(self._staging, name, shard, dtype)
                staged[:length].copy_(piece)
                piece = staged
            self.engine.publish(name, piece, version)
            if length == n == shard:
                self.engine.gather(name, version, out)
                self.engine.release(name, version)
                continue
            full = self._buffer(self._full, name, world * shard, dtype)
            self.engine.gather(name, version, full)
            self.engine.release(name, version)
            rows[:, start : start + length].copy_(full.view(world, shard)[:, :length])


class _Reducer:
    """Reduce-scatter through two alternating f32 scratch buckets (engine prefix ``odc-rs``)."""

    def __init__(self, engine: Engine, nbytes: int) -> None:
        self.engine = engine
        self.world, self.rank = engine.world_size, engine.rank
        self.shard = _capacity(nbytes, 4)
        engine.register(self.buckets(self.world, nbytes))
        self.piece = self.shard
        self.accum = [engine.grad_shard(i) for i in range(2)]
        self.k = 0

    @staticmethod
    def buckets(world: int, nbytes: int) -> list[Bucket]:
        """The two f32 scratch buckets a reduce-scatter engine of ``world`` ranks registers."""
        return [Bucket(f"rs-{i}", world * _capacity(nbytes, 4), torch.float32) for i in range(2)]

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, scale: float) -> None:
        """``out`` (n) gets ``scale · Σ_ranks inp.view(D, n)[rank]``, accumulated in f32."""
        n, world = out.numel(), self.world
        rows = inp.view(world, n)
        for start in range(0, n, self.piece):
            length = min(self.piece, n - start)
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


class _Pair:
    """The all-gather and reduce-scatter engines of one device (store prefixes ``odc-ag<suffix>``, ``odc-rs<suffix>``).

    Args:
        make: creates the engine of a store prefix (collective).
        suffix: appended to both prefixes.
        nbytes: per-rank shard capacity of the scratch buckets.
    """

    def __init__(self, make: Callable[[str], Engine], suffix: str, nbytes: int) -> None:
        self.gatherer = _Gatherer(make(f"odc-ag{suffix}"), nbytes)
        self.reducer = _Reducer(make(f"odc-rs{suffix}"), nbytes)
        #: Where the tensors of this pair's ops live (``cpu`` for the host and emulated transports).
        self.device: torch.device = self.gatherer.engine.device
        self.transport: str = self.gatherer.engine.transport
        self._last_stream: Any = None

    def begin(self) -> None:
        """Orders a CUDA op after the previous one when the caller switched streams.

        The engines order an op's work on the current stream only, and the
        scratch buffers and accumulators are reused from op to op.
        """
        if self.device.type != "cuda":
            return
        current = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last.cuda_stream != current.cuda_stream:
            current.wait_stream(last)
        self._last_stream = current
