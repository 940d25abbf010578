"""Elastic all-reduce for ``odc`` process groups (``ODC_BACKEND_ELASTIC=1``): the sum-like all-reduces a loop
asks of the world (a token count, a norm, a loss for logging) go on over the surviving nodes when a rank dies.

One elastic hybrid engine per group (:class:`odc.Engine` with ``sharding="hybrid"``, ``elastic=True``) over
the group's nodes, with one bucket of :data:`CAPACITY` f32 elements: an all-reduce is one minibatch of it per
:data:`CAPACITY` elements (a push of the whole tensor into the node's shards, the cross-node sum that the
membership round decides, a gather of the node's reduced shards). When a rank dies its node is dropped from
that all-reduce on, alike on every survivor; its node-mates raise :class:`odc.NodeDropped` (or
:class:`odc.PeerDied`). The ranks keep their numbers and ``get_world_size`` its value: ``SUM`` adds the
member nodes' tensors, ``AVG`` divides by their ranks. Integer tensors are added exactly (as 8-bit limbs,
each limb's sum exact in f32 up to 65,793 ranks, wrapping as integer sums do).

The group's other reductions (``MAX``, ``MIN``, ``PRODUCT``, the bitwise ones) go on too, up to
:data:`GATHER_BYTES` bytes of every rank's tensors together: every rank's tensor reaches every rank bit for bit
(its bytes at its rank's place, the other places zero, summed as limbs) and each rank reduces the member ranks'
(of the nodes still members at the end) itself. A broadcast sends its root's bytes the same way and raises
:class:`odc.PeerDied` if the root's node was dropped; a barrier is an all-reduce of one element. Every other
operation of the group (all-gather, reduce-scatter, ...), and any other group, still waits for the dead rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..engine import Bucket, Engine
from ..errors import ConfigError, PeerDied

ELASTIC_ENV = "ODC_BACKEND_ELASTIC"
"""The environment variable that makes an ``odc`` group's sum-like all-reduces elastic (``1``)."""
#: f32 elements per minibatch of the elastic all-reduce engine (a larger tensor runs in several).
CAPACITY = 1 << 16
#: Integer dtypes added exactly as limbs (floats are added in f32).
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Most bytes of every rank's tensors together that a gathered reduction (MAX, MIN, ...) moves elastically.
GATHER_BYTES = 1 << 20


def enabled() -> bool:
    """Whether ``ODC_BACKEND_ELASTIC`` asks for elastic all-reduces (``1``; ``0`` or unset: no)."""
    raw = os.environ.get(ELASTIC_ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"{ELASTIC_ENV}={raw!r}: expected 0 or 1")
    return raw == "1"


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
        """The sum over the member nodes of every rank's ``flat`` (f32, on the host)."""
        eng = self._made()
        out = torch.empty_like(flat)
        padded_len = eng.bucket("allreduce")["padded_len"]
        full = torch.empty(padded_len, dtype=torch.float32)
        for lo in range(0, flat.numel(), CAPACITY):
            part = flat[lo:lo + CAPACITY]
            k, self._k = self._k, self._k + 1
            padded = torch.zeros(CAPACITY, dtype=torch.float32)
            padded[: part.numel()] = part
            eng.scatter_accumulate("allreduce", padded, scale=1.0)
            eng.finish_minibatch(k)
            shard = eng.grad_shard("allreduce").clone()
            eng.zero_grad()
            eng.publish("allreduce", shard, version=k)
            eng.gather("allreduce", k, full)
            eng.release("allreduce", k)
            out[lo:lo + part.numel()] = full[: part.numel()]
        return out

    def all_reduce(self, t: torch.Tensor, scale: float, average: bool) -> None:
        """``t`` becomes the sum (``scale`` times each rank's, as PREMUL_SUM) over the member nodes' ranks, or
        with ``average`` their mean; integers exactly (``scale`` 1)."""
        if t.numel() == 0:
            return
        host = t.detach().reshape(-1).to("cpu")
        if t.dtype in INT_DTYPES:
            width = t.element_size()
            limbs = host.contiguous().view(torch.uint8).to(torch.float32)  # little-endian bytes
            sums = self._sum(limbs).to(torch.int64).view(-1, width)
            total = torch.zeros(host.numel(), dtype=torch.int64)
            for i in range(width):
                total += sums[:, i] << (8 * i)  # wraps as an integer sum does
            if average:
                total = torch.div(total, self._ranks(), rounding_mode="floor")
            result = total.to(t.dtype)
        else:
            result = self._sum(host.to(torch.float32) * scale)
            if average:
                result /= self._ranks()
        t.copy_(result.view(t.shape).to(t.dtype))

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

    @staticmethod
    def gathers(numel: int, dtype: torch.dtype, world: int) -> bool:
        """Whether a gathered reduction of ``numel`` elements of ``dtype`` over ``world`` ranks runs elastically
        (at most :data:`GATHER_BYTES` in all)."""
        return numel * dtype.itemsize * world <= GATHER_BYTES

    def reduce_gathered(self, t: torch.Tensor, reduce: Any) -> None:
        """``t`` becomes ``reduce(rows)`` over the member ranks' tensors (``rows``: one per member rank, in rank
        order, bit for bit each rank's), the members being those at the end of the all-reduce."""
        if t.numel() == 0:
            return
        host = t.detach().reshape(-1).to("cpu").contiguous()
        rank, world = self._args[1], self._args[2]
        rows = self._exact_bytes(host.view(torch.uint8), rank).view(world, -1).view(t.dtype)
        result = reduce(rows[self._member_ranks()])
        t.copy_(result.view(t.shape).to(t.device))

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """``t`` becomes the root's, bit for bit; :class:`odc.PeerDied` if the root's node was dropped."""
        rank = self._args[1]
        host = t.detach().reshape(-1).to("cpu").contiguous()
        flat = host.view(torch.uint8) if rank == root else torch.zeros(host.numel() * host.element_size(),
                                                                          dtype=torch.uint8)
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
