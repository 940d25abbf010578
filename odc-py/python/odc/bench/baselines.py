"""What a user runs instead of ODC when ranks have uneven microbatch counts: the three baselines' plans.

Collectives need every rank to run the same number of microbatches. Without
ODC a user has three ways around uneven counts, and ``odc-bench train`` and
``odc-bench imbalance`` run each beside ODC on the same minibatches:

- ``verl-maxcount``: verl's own fix (``same_micro_num_in_dp=True``, verl's
  default): every minibatch is balanced over the ranks (Karmarkar–Karp on
  verl's workload estimate, equal sample counts: verl's per-minibatch
  ``balance_batch``), each rank counts the microbatches its samples need, the
  ranks all-reduce the largest count, and each re-splits its samples into
  that many microbatches (``verl.utils.seqlen_balancing.rearrange_micro_batches``),
  raising the count together until every rank's microbatches fit the token
  budget. Every rank then pays the per-microbatch cost of the busiest. Over
  FSDP2's collectives. :func:`verl_maxcount_plan` uses verl's own functions
  when verl is importable and this module's reimplementation otherwise (a
  test holds the two equal on verl's own pins).
- ``dummy-pad``: LB-Mini's plan, and a rank with fewer microbatches than the
  most any rank has runs zero-loss padding microbatches (one
  ``DUMMY_LENGTH``-token sample, loss times 0) up to that count, so the
  collectives match. Over FSDP2's collectives.
- ``fsdp2-accum``: LB-Mini's plan under FSDP2's own gradient accumulation:
  ``reshard_after_forward=False``, and ``set_requires_gradient_sync(False)``
  with ``set_reshard_after_backward(False)`` on all but each rank's last
  microbatch, so each group all-gathers once at the rank's first forward and
  reduce-scatters once at its last backward: the collective sequences match
  whatever the counts, as long as every rank runs at least one microbatch (a
  rank LB-Mini gives none — only when a minibatch holds fewer samples than
  ranks — runs one zero-loss dummy microbatch). The price is memory: the
  unsharded parameters and gradients stay for the whole minibatch (ZeRO-2-like),
  where ODC keeps ZeRO-3's ``1/D``.

Only the plans live here (pure functions, no torch but for verl's own path);
the runs are in :mod:`odc.bench.train` and :mod:`odc.bench.imbalance`.
"""

from __future__ import annotations

import heapq
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CONFIGS", "DUMMY_LENGTH", "DUMMY_PAD", "FSDP2_ACCUM", "VERL_MAXCOUNT", "Assignment", "padded_counts",
           "verl_available", "verl_balance", "verl_karmarkar_karp", "verl_maxcount_plan", "verl_split",
           "verl_workload"]

VERL_MAXCOUNT = "verl-maxcount"
"""verl's split of every rank's samples into the largest microbatch count of any rank, over collectives."""
DUMMY_PAD = "dummy-pad"
"""LB-Mini's plan padded with zero-loss microbatches up to the largest count, over collectives."""
FSDP2_ACCUM = "fsdp2-accum"
"""LB-Mini's plan under FSDP2's own gradient accumulation (no sync but at each rank's last microbatch)."""
CONFIGS: tuple[tuple[str, str, str], ...] = (
    (VERL_MAXCOUNT, "collective", VERL_MAXCOUNT),
    (DUMMY_PAD, "pad", "lb-mini"),
    (FSDP2_ACCUM, "accum", "lb-mini"),
)
"""The baselines as ``(name, mode, plan)``: ``mode`` how the ranks run (``collective``: in step; ``pad``: in step,
padded; ``accum``: FSDP2's accumulation), ``plan`` the strategy of odc.packing or ``verl-maxcount``."""
DUMMY_LENGTH = 16
"""Tokens of a padding (dummy) microbatch: one sample this short, its loss multiplied by 0."""


@dataclass(frozen=True)
class Assignment:
    """Who runs which samples: ``minibatches[m][r]`` rank ``r``'s microbatches in minibatch ``m`` (a
    :class:`odc.packing.Plan`'s shape, for plans that are not the packer's: verl-maxcount's): ``source`` names whose
    functions made it."""

    minibatches: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    world_size: int
    source: str = ""

    @property
    def num_minibatches(self) -> int:
        """The number of minibatches."""
        return len(self.minibatches)

    def rank(self, r: int) -> list[list[list[int]]]:
        """Rank ``r``'s microbatches, one list per minibatch."""
        return [[list(mb) for mb in minibatch[r]] for minibatch in self.minibatches]


def padded_counts(counts: Sequence[int], mode: str) -> list[int]:
    """The microbatches each rank runs under ``mode`` given its own ``counts``: the largest for every rank under
    ``pad`` (padding up to it), at least one under ``accum`` (a rank without samples runs one dummy)."""
    if mode == "pad":
        return [max(counts, default=0)] * len(counts)
    if mode == "accum":
        return [max(1, c) for c in counts]
    return list(counts)


# -- verl's algorithm ----------------------------------------------------------------------------------------
# A transcription of verl 0.9.1's verl/utils/seqlen_balancing.py (Apache-2.0): calculate_workload, karmarkar_karp,
# get_seqlen_balanced_partitions and the splitting of rearrange_micro_batches (force_group_size 1, dynamic batch-size
# balance on), with verl's tie-breaking, so that the plans are verl's to the sample.


def verl_workload(lengths: Sequence[int]) -> list[int]:
    """verl's workload estimate of each sample, ``24576·s + s²`` (``calculate_workload``)."""
    return [24576 * int(s) + int(s) * int(s) for s in lengths]


class _Set:
    __slots__ = ("items", "sum")

    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []

    def add(self, idx: int, val: int) -> None:
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other: _Set) -> None:
        for idx, val in other.items:
            self.items.append((idx, val))
            self.sum += val

    def __lt__(self, other: _Set) -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    __slots__ = ("k", "sets")

    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, seqlen) in enumerate(items):
            self.sets[i].add(idx=idx, val=seqlen)
        self.sets = sorted(self.sets, reverse=True)

    def merge(self, other: _State) -> None:
        for i in range(self.k):
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def verl_karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's largest differencing method (``karmarkar_karp``), tie-breaking included: ``k_partitions`` lists of
    indices into ``seqlen_list``, in verl's order."""
    ordered = sorted((int(s), i) for i, s in enumerate(seqlen_list))
    heap: list[_State] = []
    if equal_size:
        if len(ordered) % k_partitions:
            raise ValueError(f"{len(ordered)} items do not split into {k_partitions} equal parts")
        for offset in range(0, len(ordered), k_partitions):
            items = [(ordered[offset + i][1], ordered[offset + i][0]) for i in range(k_partitions)]
            heapq.heappush(heap, _State(items=items, k=k_partitions))
    else:
        for seqlen, idx in ordered:
            heapq.heappush(heap, _State(items=[(idx, seqlen)], k=k_partitions))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [[idx for idx, _ in s.items] for s in heap[0].sets]


def _balanced_partitions(seqlen_list: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: non-empty partitions, each sorted."""
    if len(seqlen_list) < k:
        raise ValueError(f"number of items {len(seqlen_list)} < k_partitions {k}")
    parts = verl_karmarkar_karp(seqlen_list, k, equal_size)
    if any(not p for p in parts):
        raise ValueError(f"an empty partition: {k} partitions of {len(seqlen_list)} items")
    return [sorted(p) for p in parts]


def _split_own(lengths: Sequence[int], max_token_len: int, min_num_micro_batch: int | None) -> list[list[int]]:
    """One rank's ``rearrange_micro_batches`` without the data-parallel sync: its microbatches (positions in
    ``lengths``, in verl's execution order), at least ``min_num_micro_batch`` of them."""
    if max(lengths) > max_token_len:
        raise ValueError(f"max_token_len must be greater than the sequence length. Got {max_token_len=} and "
                         f"max_seq_len={max(lengths)}")
    n = len(lengths)
    num = min(n, -(sum(lengths) // -max_token_len))
    if min_num_micro_batch is not None:
        num = max(min_num_micro_batch, num)
    workloads = verl_workload(lengths)
    while True:
        if num > n:
            raise ValueError(f"cannot split {n} samples into {num} non-empty microbatches")
        parts = _balanced_partitions(workloads, num, equal_size=False)
        if all(sum(lengths[i] for i in p) <= max_token_len for p in parts):
            break
        num += 1
    parts.sort(key=lambda p: (sum(workloads[i] for i in p), p[0] if p else 0), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def _verl_split_own(lengths: Sequence[int], max_token_len: int, min_num_micro_batch: int | None) -> list[list[int]]:
    """verl's own ``rearrange_micro_batches`` on one rank's samples, without the sync (``dp_group=None``)."""
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, s in enumerate(lengths):
        mask[i, :s] = 1
    batch = TensorDict({"input_ids": torch.zeros_like(mask), "attention_mask": mask}, batch_size=[len(lengths)])
    _, idx = rearrange_micro_batches(batch, max_token_len, dp_group=None, same_micro_num_in_dp=True,
                                     min_num_micro_batch=min_num_micro_batch)
    return [list(map(int, p)) for p in idx]


def verl_available() -> bool:
    """Whether verl (and the tensordict it needs) can be imported here."""
    return all(importlib.util.find_spec(m) is not None for m in ("verl", "tensordict"))


def verl_split(per_rank: Sequence[Sequence[int]], max_token_len: int, *,
               own: Callable[[Sequence[int], int, int | None], list[list[int]]] | None = None) -> list[list[list[int]]]:
    """Every rank's samples (lengths) split as ``rearrange_micro_batches(..., same_micro_num_in_dp=True)`` splits
    them across a data-parallel group: the largest count of any rank, raised together until every rank's
    microbatches fit ``max_token_len``. Returns per rank its microbatches as positions in its own list.

    The group's all-reduces are done here: each rank's split without the sync (``own``, verl's own function by
    default when importable) from the largest count up, until every rank keeps that count. That is the sync's
    smallest count at which every rank fits (a count some rank skips is one where that rank does not fit), and at
    it each rank's partition is the synced one.
    """
    if own is None:
        own = _verl_split_own if verl_available() else _split_own
    count = max(min(len(r), -(sum(r) // -max_token_len)) for r in per_rank)
    while True:
        splits = [own(r, max_token_len, count) for r in per_rank]
        top = max(len(s) for s in splits)
        if top == count:
            return splits
        count = top


def verl_balance(lengths: Sequence[int], world: int, *, verl: bool | None = None) -> list[list[int]]:
    """One minibatch over ``world`` ranks as verl's per-minibatch ``balance_batch`` does it: equal-size
    Karmarkar–Karp on the workload estimate, each rank's positions ordered small-large-small by workload."""
    if len(lengths) % world:
        raise ValueError(f"verl balances equal parts: {len(lengths)} samples over {world} ranks")
    workloads = verl_workload(lengths)
    if verl if verl is not None else verl_available():
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

        parts = [list(p) for p in get_seqlen_balanced_partitions(workloads, k_partitions=world, equal_size=True)]
    else:
        parts = _balanced_partitions(workloads, world, equal_size=True)
    out = []
    for p in parts:
        p.sort(key=lambda x: (workloads[x], x))
        out.append(p[::2] + p[1::2][::-1])
    return out


def verl_maxcount_plan(lengths: Sequence[int], world: int, minibatch_size: int, max_tokens: int, *,
                       verl: bool | None = None) -> Assignment:
    """verl-maxcount's plan of ``lengths`` (dataset order, minibatches of ``minibatch_size · world`` consecutive
    samples): ``minibatches[m][r]`` rank ``r``'s microbatches (global sample indices, verl's execution order) in
    minibatch ``m``, every rank the same count; ``source`` says whose functions made it (``verl X``: verl's own,
    when importable unless ``verl=False``; else ``odc.bench.baselines``, this module's transcription)."""
    use = verl if verl is not None else verl_available()
    own = _verl_split_own if use else _split_own
    size = minibatch_size * world
    minibatches = []
    for start in range(0, len(lengths), size):
        chunk = list(range(start, min(start + size, len(lengths))))
        ranks = verl_balance([lengths[i] for i in chunk], world, verl=use)
        per_rank = [[lengths[chunk[j]] for j in r] for r in ranks]
        splits = verl_split(per_rank, max_tokens, own=own)
        minibatches.append([[[chunk[r[j]] for j in mb] for mb in split]
                            for r, split in zip(ranks, splits, strict=True)])
    source = "odc.bench.baselines"
    if use:
        from importlib.metadata import version

        source = f"verl {version('verl')}"
    return Assignment(tuple(tuple(tuple(tuple(mb) for mb in r) for r in m) for m in minibatches), world, source)
