"""Sequence packing: turn sequence lengths into per-rank microbatch plans.

Strategies (see the ODC design notes):

- ``"local-sort"``: strided split of each minibatch, each rank sorts its
  samples, one sample per microbatch.
- ``"lb-micro"``: balance every microbatch step across ranks; every rank runs
  the same number of microbatches (what collectives need).
- ``"lb-mini"``: balance the total cost per rank per minibatch
  (Karmarkar–Karp); each rank packs its own microbatches under the token
  budget, so counts may differ (ODC only).
- ``"verl-native"``: balance the whole global batch first, then split it into
  minibatches and microbatches (what verl does).

Example:
    >>> from odc import packing
    >>> p = packing.plan([9000, 120, 3000, 700, 64000, 15], world_size=2,
    ...                  minibatch_size=3, strategy="lb-mini", max_tokens=65536)
    >>> p.num_minibatches
    1
    >>> sorted(i for r in range(2) for mb in p.rank(r)[0] for i in mb)
    [0, 1, 2, 3, 4, 5]
    >>> p.bubble_rate("odc") <= p.bubble_rate("collective")
    True

The verl-compatible helpers :func:`karmarkar_karp` and
:func:`get_seqlen_balanced_partitions` are drop-in replacements for the
functions of the same names in ``verl.utils.seqlen_balancing``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Literal, Sequence

from . import _odc
from .errors import PackingError

__all__ = [
    "Plan",
    "plan",
    "karmarkar_karp",
    "get_seqlen_balanced_partitions",
    "sequence_cost",
    "synthetic",
    "STRATEGIES",
    "COST_MODELS",
    "main",
]

STRATEGIES = ("local-sort", "lb-micro", "lb-mini", "verl-native")
COST_MODELS = ("linear", "quadratic", "qwen2-1.5b", "qwen2-7b", "verl", "flops:hidden=H,layers=L,query=Q")

DEFAULT_MAX_TOKENS = 65536


def _lengths(lengths: Sequence[int]) -> list:
    """The lengths as a list for the native module, which checks every value.

    The native bindings are the one place lengths and integer arguments are
    validated: a value that is not an integer in ``1..=2**64 - 1`` (zero,
    negative, oversized, boolean, float, string) is a :class:`PackingError`
    naming it and its index, never an ``OverflowError`` or ``TypeError``.
    """
    return list(lengths)


@dataclass(frozen=True)
class Plan:
    """Per-minibatch, per-rank microbatch plan produced by :func:`plan`.

    Attributes:
        minibatches: ``minibatches[m][r]`` is rank ``r``'s list of microbatches
            (lists of sample indices) in minibatch ``m``.
        costs: ``costs[m][r]`` is rank ``r``'s total cost in minibatch ``m``.
        bubble_collective: predicted idle fraction under per-layer collectives.
        bubble_odc: predicted idle fraction under ODC (sync once per minibatch).
        minibatch_bubbles: ``(collective, odc)`` bubble rates of each minibatch.
    """

    minibatches: tuple
    costs: tuple
    bubble_collective: float
    bubble_odc: float
    minibatch_bubbles: tuple
    world_size: int
    strategy: str

    @property
    def num_minibatches(self) -> int:
        return len(self.minibatches)

    def rank(self, r: int) -> list[list[list[int]]]:
        """Rank ``r``'s microbatches, one list per minibatch."""
        if not 0 <= r < self.world_size:
            raise PackingError(f"rank {r} is out of range for world size {self.world_size}")
        return [[list(mb) for mb in minibatch[r]] for minibatch in self.minibatches]

    def bubble_rate(self, mode: Literal["collective", "odc"] = "odc") -> float:
        """Predicted bubble rate of the whole run under ``mode``."""
        if mode == "collective":
            return self.bubble_collective
        if mode == "odc":
            return self.bubble_odc
        raise PackingError(f"unknown mode {mode!r}; expected 'collective' or 'odc'")

    @property
    def predicted_speedup(self) -> float:
        """``(1 - bubble_odc) / (1 - bubble_collective)``: ODC over collectives on this plan."""
        denom = 1.0 - self.bubble_collective
        return (1.0 - self.bubble_odc) / denom if denom > 0 else 1.0

    def to_dict(self) -> dict:
        """The plan in the same JSON shape ``odc-pack --json`` prints."""
        return {
            "minibatches": [
                {
                    "ranks": [
                        {"microbatches": [list(mb) for mb in ranks[r]], "cost": self.costs[m][r]}
                        for r in range(len(ranks))
                    ],
                    "bubble_collective": self.minibatch_bubbles[m][0],
                    "bubble_odc": self.minibatch_bubbles[m][1],
                }
                for m, ranks in enumerate(self.minibatches)
            ],
            "bubble_collective": self.bubble_collective,
            "bubble_odc": self.bubble_odc,
            "predicted_speedup": self.predicted_speedup,
        }


def plan(
    lengths: Sequence[int],
    world_size: int,
    minibatch_size: int,
    strategy: str = "lb-mini",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    cost: str = "linear",
    seed: int | None = None,
) -> Plan:
    """Plans microbatches for every rank and minibatch.

    Args:
        lengths: token count of every sample, in dataset order.
        world_size: number of ranks D.
        minibatch_size: samples per rank per minibatch M (a global minibatch
            is M·D samples; the last one may be partial).
        strategy: one of :data:`STRATEGIES`.
        max_tokens: token budget of one microbatch; a longer sample is an error.
        cost: cost model name (:data:`COST_MODELS`).
        seed: shuffle seed of the sample order, like a DataLoader's. ``None``
            (the default) cuts minibatches from consecutive samples in dataset
            order; an integer in ``0..=2**64 - 1`` first shuffles the samples
            with a permutation fixed by the seed, so it decides which samples
            share a minibatch. Either way the plan's indices are positions in
            ``lengths``, and the same seed gives the same plan.

    Raises:
        PackingError: bad lengths (naming the value and its index), an
            out-of-range size or seed, unknown strategy or cost, a sample over
            budget.
    """
    raw = json.loads(
        _odc.plan_json(_lengths(lengths), world_size, minibatch_size, str(strategy), max_tokens, str(cost), seed)
    )
    mbs = raw["minibatches"]
    return Plan(
        minibatches=tuple(tuple(tuple(tuple(mb) for mb in r["microbatches"]) for r in m["ranks"]) for m in mbs),
        costs=tuple(tuple(r["cost"] for r in m["ranks"]) for m in mbs),
        bubble_collective=raw["bubble_collective"],
        bubble_odc=raw["bubble_odc"],
        minibatch_bubbles=tuple((m["bubble_collective"], m["bubble_odc"]) for m in mbs),
        world_size=int(world_size),
        strategy=str(strategy),
    )


def karmarkar_karp(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl-compatible Karmarkar–Karp: partition indices of ``seqlen_list`` into ``k_partitions`` sets.

    Each set's sum of lengths is balanced (largest differencing plus a local
    refinement that never makes the result worse). With ``equal_size`` every
    set has the same number of items.

    Raises:
        PackingError: a length that is not an integer in ``1..=2**64 - 1``
            (zero included: every sequence holds at least one token), naming
            the value and its index; ``k_partitions`` not a positive integer,
            larger than the item count, or (with ``equal_size``) not dividing it.
    """
    return _odc.karmarkar_karp(_lengths(seqlen_list), k_partitions, bool(equal_size))


def get_seqlen_balanced_partitions(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl-compatible: balanced partitions, each non-empty and sorted by index.

    Raises:
        PackingError: as :func:`karmarkar_karp`.
    """
    parts = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    for i, p in enumerate(parts):
        if not p:
            raise PackingError(f"partition {i} is empty: {k_partitions} partitions of {len(seqlen_list)} items")
    return [sorted(p) for p in parts]


def sequence_cost(length: int, cost: str = "linear") -> float:
    """Cost of one sequence of ``length`` tokens (an integer in ``1..=2**64 - 1``) under the cost model ``cost``."""
    return _odc.sequence_cost(str(cost), length)


def synthetic(spec: str) -> list[int]:
    """Lengths from a spec such as ``"lognormal:n=1000,median=10000,sigma=1.0,max=65536,seed=0"``."""
    return _odc.synthetic(str(spec))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``odc-pack`` command line (same as the Rust binary)."""
    args = list(sys.argv if argv is None else ["odc-pack", *argv])
    sys.stdout.flush()
    code = _odc.pack_cli(args)
    if argv is None:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    main()
