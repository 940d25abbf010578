"""Elastic all-reduce for ``odc`` process groups (``ODC_BACKEND_ELASTIC=1``): the all-reduces a loop asks of the
world (a token count, a norm, a loss for logging) go on over the surviving nodes when a rank dies.

One elastic hybrid engine per group (:class:`odc.Engine` with ``sharding="hybrid"``, ``elastic=True``) over
the group's nodes, with one bucket of :data:`CAPACITY` f32 elements: a tensor is summed as one minibatch of it
per :data:`CAPACITY` elements (a push of the whole tensor into the node's shards, the cross-node sum that the
membership round decides, a gather of the node's reduced shards). When a rank dies its node is dropped, alike
on every survivor; its node-mates raise :class:`odc.NodeDropped` (or :class:`odc.PeerDied`). The ranks keep
their numbers and ``get_world_size`` its value: ``SUM`` adds the member nodes' tensors, ``AVG`` divides by
their ranks.

An all-reduce is all or nothing: one membership decision per call, whatever its size. Every minibatch's round
says which nodes its sum holds (:attr:`odc.Engine.members` after it); a call whose minibatches saw different
members (a death between two of them) is summed again, from its input, over the members then, so every
element of the result sums the same nodes and ``AVG`` divides by their count.

How each dtype and reduction is carried (:func:`route`, the one table; anything it refuses raises
:class:`~odc.backend.UnsupportedCollective` naming the dtype and op, never a fall back to gloo, which would wait
for the dead ranks):

* f32 / bf16 / f16 ``SUM`` / ``AVG`` / ``PREMUL_SUM``: added in f32 (``"float"``).
* int8 / uint8 / int16 / int32 / int64 ``SUM``: added exactly as 8-bit limbs, each limb's sum exact in f32 up
  to 65,793 ranks, wrapping as integer sums do (``"limbs"``). ``AVG`` and ``PREMUL_SUM`` of integers are refused,
  as gloo refuses them (``result type Float can't be cast to the desired output type``).
* bool, every reduction but ``AVG`` / ``PREMUL_SUM`` (refused, as gloo does): the member ranks' ``True`` counted
  exactly, then gloo's meaning: ``SUM`` / ``MAX`` / ``BOR`` any, ``MIN`` / ``PRODUCT`` / ``BAND`` all, ``BXOR`` an
  odd count (``"count"``).
* ``MAX``, ``MIN``, ``PRODUCT`` (floats and integers), the bitwise ops (integers), and every sum-like op on f64
  (summed in f64, in rank order): every rank's tensor reaches every rank bit for bit (its bytes at its rank's
  place, the other places zero, summed as limbs) and each rank reduces the member ranks' itself
  (``"gathered"``), up to :data:`GATHER_BYTES` bytes of every rank's tensors together; larger ones are refused.
* complex tensors (which torch's ``all_reduce`` hands over as real views already): as their real view.
* every other dtype (the uint16 to uint64 and float8 families, sub-byte and quantized dtypes), which gloo does
  not reduce either: refused.

A broadcast sends its root's bytes the same way (any dtype, bit for bit) and raises :class:`odc.PeerDied` if
the root's node was dropped; a barrier is an all-reduce of one element. Every other operation of the group
(all-gather, reduce-scatter, ...), and any other group, still waits for the dead rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..engine import Bucket, Engine
from ..errors import ConfigError, PeerDied

ELASTIC_ENV = "ODC_BACKEND_ELASTIC"
"""The environment variable that makes an ``odc`` group's all-reduces, barrier and broadcast elastic (``1``)."""
#: f32 elements per minibatch of the elastic all-reduce engine (a larger tensor runs in several).
CAPACITY = 1 << 16
#: Integer dtypes added exactly as limbs (floats are added in f32).
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Most bytes of every rank's tensors together that a gathered reduction (MAX, MIN, ...) moves elastically.
GATHER_BYTES = 1 << 20
#: Complex dtypes, carried as their real view (the dtype of its elements).
COMPLEX_DTYPES = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}

_R = dist.ReduceOp
_SUM_LIKE = (_R.SUM, _R.AVG, _R.PREMUL_SUM)
_BITWISE = (_R.BAND, _R.BOR, _R.BXOR)
_ORDERED = (_R.MAX, _R.MIN, _R.PRODUCT)

#: A test's fault point: called with the index of each minibatch of an all-reduce once it has completed on this
#: rank (before the next one's push), so a test can end a rank exactly between two of them.
_after_minibatch: Callable[[int], None] | None = None


def enabled() -> bool:
    """Whether ``ODC_BACKEND_ELASTIC`` asks for elastic all-reduces (``1``; ``0`` or unset: no)."""
    raw = os.environ.get(ELASTIC_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{ELASTIC_ENV}={raw!r}: expected 0 or 1")
    return raw == "1"


def route(dtype: torch.dtype, red: Any, numel: int, world: int) -> tuple[str, str | None]:
    """How an elastic all-reduce of ``numel`` elements of ``dtype`` with reduce op ``red`` (a ``RedOpType``) over
    ``world`` ranks runs: ``(way, None)`` with ``way`` one of ``"float"``, ``"limbs"``, ``"count"``,
    ``"gathered"`` (see the module doc), or ``("", why)`` when it is refused (``why`` names the dtype and op).

    >>> route(torch.float32, dist.ReduceOp.SUM, 10, 4), route(torch.float64, dist.ReduceOp.AVG, 10, 4)
    (('float', None), ('gathered', None))
    >>> route(torch.int32, dist.ReduceOp.AVG, 10, 4)[1]
    'AVG on torch.int32 (an integer average is not an integer: gloo refuses it too)'
    """
    name = str(red).split(".")[-1]
    if dtype in COMPLEX_DTYPES:
        if red not in _SUM_LIKE:
            return "", f"{name} on {dtype} (complex tensors are reduced with SUM, AVG or PREMUL_SUM only)"
        return route(COMPLEX_DTYPES[dtype], red, numel * 2, world)
    if dtype == torch.bool:
        if red in (_R.AVG, _R.PREMUL_SUM):
            return "", f"{name} on {dtype} (gloo refuses it too)"
        return "count", None
    if dtype in INT_DTYPES:
        if red == _R.SUM:
            return "limbs", None
        if red == _R.AVG:
            return "", f"{name} on {dtype} (an integer average is not an integer: gloo refuses it too)"
        if red == _R.PREMUL_SUM:
            return "", f"{name} on {dtype} (a scaled integer sum is not an integer)"
        way = "gathered"
    elif dtype in FLOAT_DTYPES or dtype == torch.float64:
        if red in _BITWISE:
            return "", f"{name} on {dtype} (bitwise reductions need an integer or bool dtype)"
        if red in _SUM_LIKE and dtype != torch.float64:
            return "float", None
        way = "gathered"
    else:
        return "", (
            f"{name} on {dtype}: the elastic all-reduce carries bool, int8 to int64, f16, bf16, f32, f64 and complex "
            "tensors (gloo does not reduce this dtype either)"
        )
    if red not in (*_SUM_LIKE, *_ORDERED, *_BITWISE):
        return "", f"{name} on {dtype} (unknown reduce op)"
    nbytes = numel * dtype.itemsize * world
    if nbytes > GATHER_BYTES:
        return "", (
            f"{name} on {dtype} of {numel} elements: it moves every rank's tensor to every rank ({nbytes} bytes over "
            f"{world} ranks, more than the {GATHER_BYTES} the elastic all-reduce carries); reduce smaller pieces, or "
            "use a group without ODC_BACKEND_ELASTIC"
        )
    return way, None


def node_size(global_ranks: tuple[int, ...]) -> int:
    """The group's ranks per node: whole nodes of ``LOCAL_WORLD_SIZE`` global ranks, node-major, the same count
    on each node the group spans; a ConfigError naming what does not fit."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        raise ConfigError(f"{ELASTIC_ENV}=1 needs LOCAL_WORLD_SIZE (the ranks per node, as torchrun sets it)")
    per_node = int(raw)
    nodes: dict[int, int] = {}
    for r in global_ranks:
        nodes[r // per_node] = nodes.get(r // per_node, 0) + 1
    counts = set(nodes.values())
    order = [r // per_node for r in global_ranks]
    if len(counts) != 1 or order != sorted(order):
        raise ConfigError(
            f"{ELASTIC_ENV}=1: the group's ranks {list(global_ranks)} are not node-major with the same count on "
            f"each node (LOCAL_WORLD_SIZE={per_node}); an elastic all-reduce drops whole nodes"
        )
    return counts.pop()


def _fold(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Folds ``f`` over the rows (one per member rank, in rank order)."""
    return lambda rows: functools.reduce(f, rows.unbind(0))


#: The gathered reductions: the member ranks' rows (in rank order) -> the result.
GATHERED: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    _R.MAX: lambda rows: rows.amax(0),
    _R.MIN: lambda rows: rows.amin(0),
    _R.PRODUCT: _fold(torch.mul),
    _R.BAND: _fold(torch.bitwise_and),
    _R.BOR: _fold(torch.bitwise_or),
    _R.BXOR: _fold(torch.bitwise_xor),
    _R.SUM: _fold(torch.add),
}


class ElasticAllReduce:
    """The elastic all-reduce of one group: its engine (made at the first all-reduce, collectively) and the
    minibatch counter every rank advances alike."""

    def __init__(self, store: Any, rank: int, world: int, global_ranks: tuple[int, ...], seconds: float,
                 deadline_source: str) -> None:
        self._args = (store, rank, world)
        self._local = node_size(global_ranks)
        self._timeout = (seconds, deadline_source)
        self._engine: Engine | None = None
        self._k = 0
        #: How many calls were summed again because their minibatches saw different members.
        self.redone = 0

    def _made(self) -> Engine:
        if self._engine is None:
            store, rank, world = self._args
            seconds, source = self._timeout
            eng = Engine(store, rank, world, local_world_size=self._local, sharding="hybrid", elastic=True,
                         timeout=seconds, deadline_source=source, prefix="odc-elastic-allreduce")
            eng.register([Bucket("allreduce", CAPACITY, torch.float32)])
            self._engine = eng
        return self._engine

    @property
    def members(self) -> list[int] | None:
        """The member nodes (None before the first elastic all-reduce)."""
        return None if self._engine is None else self._engine.members

    def events(self) -> list[dict[str, Any]]:
        """The node drops this group's all-reduces saw."""
        return [] if self._engine is None else self._engine.elastic_events()

    def _sum(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the member nodes of every rank's ``flat`` (f32, on the host), every element over the same
        members: a call whose minibatches saw different members is summed again over the members then (every
        survivor sees the same rounds, so every survivor decides alike)."""
        while True:
            out, seen = self._sum_once(flat)
            if len(seen) <= 1:
                return out
            self.redone += 1

    def _sum_once(self, flat: torch.Tensor) -> tuple[torch.Tensor, set[tuple[int, ...]]]:
        """One pass of :meth:`_sum`: the sums and the members each minibatch's round summed."""
        eng = self._made()
        out = torch.empty_like(flat)
        padded_len = eng.bucket("allreduce")["padded_len"]
        full = torch.empty(padded_len, dtype=torch.float32)
        seen: set[tuple[int, ...]] = set()
        for i, lo in enumerate(range(0, flat.numel(), CAPACITY)):
            part = flat[lo:lo + CAPACITY]
            k, self._k = self._k, self._k + 1
            padded = torch.zeros(CAPACITY, dtype=torch.float32)
            padded[: part.numel()] = part
            eng.scatter_accumulate("allreduce", padded, scale=1.0)
            eng.finish_minibatch(k)
            seen.add(tuple(eng.members or ()))  # the nodes this minibatch's sum holds
            shard = eng.grad_shard("allreduce").clone()
            eng.zero_grad()
            eng.publish("allreduce", shard, version=k)
            eng.gather("allreduce", k, full)
            eng.release("allreduce", k)
            out[lo:lo + part.numel()] = full[: part.numel()]
            if _after_minibatch is not None:
                _after_minibatch(i)
        return out, seen

    def all_reduce(self, t: torch.Tensor, red: Any, scale: float = 1.0) -> None:
        """``t`` becomes its reduction with ``red`` over the member nodes' ranks, carried as :func:`route` says
        (which the caller checked); ``scale``: a ``PREMUL_SUM``'s factor."""
        if t.numel() == 0:
            return
        if t.dtype in COMPLEX_DTYPES:
            self.all_reduce(torch.view_as_real(t), red, scale)  # a view: written in place
            return
        way, why = route(t.dtype, red, t.numel(), self._args[2])
        if why is not None:  # pragma: no cover - the caller checked
            raise ValueError(why)
        host = t.detach().reshape(-1).to("cpu")
        if way == "limbs":
            result = self._limbs(host)
        elif way == "count":
            result = self._count(host, red)
        elif way == "gathered":
            result = self._gathered(host.contiguous(), red, scale)
        else:
            result = self._sum(host.to(torch.float32) * scale)
            if red == _R.AVG:
                result /= self._ranks()
        t.copy_(result.view(t.shape).to(t.dtype))

    def _limbs(self, host: torch.Tensor) -> torch.Tensor:
        """The exact integer sum of every member rank's ``host``, wrapping as an integer sum does."""
        width = host.element_size()
        limbs = host.contiguous().view(torch.uint8).to(torch.float32)  # little-endian bytes
        sums = self._sum(limbs).to(torch.int64).view(-1, width)
        total = torch.zeros(host.numel(), dtype=torch.int64)
        for i in range(width):
            total += sums[:, i] << (8 * i)  # wraps as an integer sum does
        return total.to(host.dtype)

    def _count(self, host: torch.Tensor, red: Any) -> torch.Tensor:
        """A bool reduction from the member ranks' count of ``True`` (exact in f32), as gloo reduces bools."""
        count = self._sum(host.to(torch.float32))
        if red in (_R.MIN, _R.PRODUCT, _R.BAND):
            return count == self._ranks()
        if red == _R.BXOR:
            return count.to(torch.int64) % 2 == 1
        return count > 0

    def _gathered(self, host: torch.Tensor, red: Any, scale: float) -> torch.Tensor:
        """``reduce(rows)`` over the member ranks' tensors (``rows``: one per member rank, in rank order, bit for
        bit each rank's), the members being those every element was summed over; sums in the tensor's dtype."""
        rank, world = self._args[1], self._args[2]
        rows = self._exact_bytes(host.view(torch.uint8), rank).view(world, -1).view(host.dtype)[self._member_ranks()]
        if red in _SUM_LIKE:
            if red == _R.PREMUL_SUM:
                rows = rows * scale
            total = GATHERED[_R.SUM](rows)
            return total / len(rows) if red == _R.AVG else total
        return GATHERED[red](rows)

    def _ranks(self) -> int:
        members = self.members or []
        return len(members) * self._local

    def _member_ranks(self) -> list[int]:
        members = set(self.members or [])
        return [r for r in range(self._args[2]) if r // self._local in members]

    def _exact_bytes(self, flat: torch.Tensor, rank_slot: int | None) -> torch.Tensor:
        """Bytes summed as limbs over the member nodes, each place written by one rank only (so every limb's sum
        is that rank's byte, exactly): ``flat`` (uint8) at place ``rank_slot`` of ``world`` places, or, with
        ``None``, ``flat`` as it is (a broadcast's root; the others pass zeros)."""
        if rank_slot is None:
            limbs = flat.to(torch.float32)
        else:
            limbs = torch.zeros(self._args[2] * flat.numel(), dtype=torch.float32)
            limbs[rank_slot * flat.numel():(rank_slot + 1) * flat.numel()] = flat.to(torch.float32)
        return self._sum(limbs).to(torch.uint8)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """``t`` becomes the root's, bit for bit (any dtype); :class:`odc.PeerDied` if the root's node was
        dropped."""
        rank = self._args[1]
        host = t.detach().reshape(-1).to("cpu").contiguous()
        nbytes = host.numel() * host.element_size()
        flat = host.view(torch.uint8) if rank == root else torch.zeros(nbytes, dtype=torch.uint8)
        got = self._exact_bytes(flat, None) if t.numel() else flat
        if root not in self._member_ranks():
            raise PeerDied(
                f"odc elastic broadcast: its root, rank {root}, is on node {root // self._local}, which was dropped "
                f"(members now {self.members}); broadcast from a rank of a member node"
            )
        t.copy_(got.view(t.dtype).view(t.shape).to(t.device))

    def barrier(self) -> None:
        """Every member rank reached it (an all-reduce of one element)."""
        self._sum(torch.zeros(1))
