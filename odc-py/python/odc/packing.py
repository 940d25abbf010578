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

The cost model can be fitted to the user's own model: :func:`fit_cost`
times forward + backward of single samples of a few lengths (or takes
measured ``(length, seconds)`` pairs), fits ``a·s² + b·s`` and returns a
:class:`CostFit` that :func:`plan` takes as ``cost``. Given whole minibatches
of a few microbatch counts to time as well (``minibatch=``, or measured
``minibatch_timings=``), it also fits what every microbatch and every
minibatch costs beside its samples; :func:`plan` then minimises the
predicted time with those fixed costs (LB-Micro and LB-Mini: fewer, fuller
microbatches where that wins) and predicts with them.

The verl-compatible helpers :func:`karmarkar_karp` and
:func:`get_seqlen_balanced_partitions` are drop-in replacements for the
functions of the same names in ``verl.utils.seqlen_balancing``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from . import _odc
from .errors import PackingError

__all__ = [
    "COST_MODELS",
    "STRATEGIES",
    "CostFit",
    "Plan",
    "fit_cost",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
    "main",
    "plan",
    "sequence_cost",
    "synthetic",
    "time_minibatches",
    "time_samples",
]

STRATEGIES = ("local-sort", "lb-micro", "lb-mini", "verl-native")
"""The strategies :func:`plan` takes (see the module docstring)."""
COST_MODELS = ("linear", "quadratic", "qwen2-1.5b", "qwen2-7b", "verl", "flops:hidden=H,layers=L,query=Q")
"""The cost models :func:`plan` takes by name; ``quadratic:a=..,b=..`` and a :class:`CostFit` work too."""

DEFAULT_MAX_TOKENS = 65536


def _lengths(lengths: Sequence[int]) -> list[int]:
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
        time_collective: predicted time of the run under collectives, in the
            cost model's units (seconds for a :class:`CostFit`), fixed costs
            included: ``Σ_m max_d C[m,d] + K·f + g`` per minibatch.
        time_odc: the same under ODC: ``max_d (Σ_m C[m,d] + n_d·f) + g``.
        minibatch_times: ``(collective, odc)`` predicted times of each minibatch.
        microbatch_cost: the fixed cost ``f`` of a microbatch the plan was made
            and predicted with.
        minibatch_cost: the fixed cost ``g`` of a minibatch.
    """

    minibatches: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    costs: tuple[tuple[float, ...], ...]
    bubble_collective: float
    bubble_odc: float
    minibatch_bubbles: tuple[tuple[float, float], ...]
    world_size: int
    strategy: str
    time_collective: float = 0.0
    time_odc: float = 0.0
    minibatch_times: tuple[tuple[float, float], ...] = ()
    microbatch_cost: float = 0.0
    minibatch_cost: float = 0.0

    @property
    def num_minibatches(self) -> int:
        """The number of minibatches planned."""
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
        """``time_collective / time_odc``: ODC over collectives on this plan (without fixed costs,
        ``(1 - bubble_odc) / (1 - bubble_collective)``)."""
        return self.time_collective / self.time_odc if self.time_odc > 0 else 1.0

    def time(self, mode: Literal["collective", "odc"] = "odc", start: int = 0) -> float:
        """Predicted time of minibatches ``start..`` under ``mode``, fixed costs included."""
        if mode not in ("collective", "odc"):
            raise PackingError(f"unknown mode {mode!r}; expected 'collective' or 'odc'")
        column = 0 if mode == "collective" else 1
        return sum(t[column] for t in self.minibatch_times[start:])

    def to_dict(self) -> dict[str, Any]:
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
                    "time_collective": self.minibatch_times[m][0],
                    "time_odc": self.minibatch_times[m][1],
                }
                for m, ranks in enumerate(self.minibatches)
            ],
            "bubble_collective": self.bubble_collective,
            "bubble_odc": self.bubble_odc,
            "predicted_speedup": self.predicted_speedup,
            "time_collective": self.time_collective,
            "time_odc": self.time_odc,
            "fixed": {"microbatch": self.microbatch_cost, "minibatch": self.minibatch_cost},
        }


def plan(
    lengths: Sequence[int],
    world_size: int,
    minibatch_size: int,
    strategy: str = "lb-mini",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    cost: str | CostFit = "linear",
    seed: int | None = None,
    *,
    microbatch_cost: float | None = None,
    minibatch_cost: float | None = None,
) -> Plan:
    """Plans microbatches for every rank and minibatch.

    Args:
        lengths: token count of every sample, in dataset order.
        world_size: number of ranks D.
        minibatch_size: samples per rank per minibatch M (a global minibatch
            is M·D samples; the last one may be partial).
        strategy: one of :data:`STRATEGIES`.
        max_tokens: token budget of one microbatch; a longer sample is an error.
        cost: cost model name (:data:`COST_MODELS`), or a :class:`CostFit`.
        seed: shuffle seed of the sample order, like a DataLoader's. ``None``
            (the default) cuts minibatches from consecutive samples in dataset
            order; an integer in ``0..=2**64 - 1`` first shuffles the samples
            with a permutation fixed by the seed, so it decides which samples
            share a minibatch. Either way the plan's indices are positions in
            ``lengths``, and the same seed gives the same plan.
        microbatch_cost: what every microbatch costs beside its samples, in
            the cost model's units (seconds for a :class:`CostFit`). ``None``:
            the fit's :attr:`CostFit.microbatch_s`, else 0. With a positive
            cost LB-Micro and LB-Mini minimise the predicted time with it
            (never worse by that measure than the plan without); 0 plans the
            fewest microbatches that fit, as without fixed costs.
        minibatch_cost: what every minibatch costs beside its microbatches
            (the optimizer step); ``None``: the fit's, else 0. In the
            predictions only: it changes no plan.

    Raises:
        PackingError: bad lengths (naming the value and its index), an
            out-of-range size or seed, unknown strategy or cost, a sample over
            budget, a negative or non-finite fixed cost.
    """
    fit = cost if isinstance(cost, CostFit) else None
    per_micro = microbatch_cost if microbatch_cost is not None else fit.microbatch_s if fit else 0.0
    per_mini = minibatch_cost if minibatch_cost is not None else fit.minibatch_s if fit else 0.0
    raw = json.loads(
        _odc.plan_json(_lengths(lengths), world_size, minibatch_size, str(strategy), max_tokens, str(cost), seed,
                       float(per_micro), float(per_mini))
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
        time_collective=raw["time_collective"],
        time_odc=raw["time_odc"],
        minibatch_times=tuple((m["time_collective"], m["time_odc"]) for m in mbs),
        microbatch_cost=raw["fixed"]["microbatch"],
        minibatch_cost=raw["fixed"]["minibatch"],
    )


@dataclass(frozen=True)
class CostFit:
    """A quadratic cost model fitted to measured timings (see :func:`fit_cost`).

    ``str(fit)`` is the model as the planner names it, so ``plan(..., cost=fit)``
    plans with it; its costs are predicted seconds.

    Attributes:
        cost: ``"quadratic:a=..,b=.."`` (``a·x² + b·x`` seconds, ``x = s / 32000``).
        a: seconds per token² of ``a·s² + b·s``.
        b: seconds per token.
        rms_relative: root mean square of the relative errors of the fit.
        max_relative: largest relative error (absolute value).
        rms_seconds: root mean square error in seconds.
        overhead_s: diagnostic, not part of the model: the fixed seconds per
            timed call ``c`` of a fit ``a·s² + b·s + c`` (interpreter and
            launch overhead a per-sample model cannot express).
        points: ``(length, measured seconds, fitted seconds)`` per timing.
        microbatch_s: seconds every microbatch costs beside its samples
            (0 unless minibatches were timed); :func:`plan` plans with it.
        minibatch_s: seconds every minibatch costs beside its microbatches.
        fixed_points: ``(microbatches, length, measured seconds, fitted
            seconds)`` per timed minibatch.
        raw_fixed_s: diagnostic: ``(per microbatch, per minibatch)`` of the
            unconstrained line (a negative value: the timings' noise exceeds
            that cost, which is then 0).
    """

    cost: str
    a: float
    b: float
    rms_relative: float
    max_relative: float
    rms_seconds: float
    overhead_s: float
    points: tuple[tuple[int, float, float], ...]
    microbatch_s: float = 0.0
    minibatch_s: float = 0.0
    fixed_points: tuple[tuple[int, int, float, float], ...] = ()
    raw_fixed_s: tuple[float, float] = (0.0, 0.0)

    def __str__(self) -> str:
        return self.cost

    def seconds(self, length: int) -> float:
        """Predicted seconds of forward + backward of one sample of ``length`` tokens."""
        return self.a * length * length + self.b * length

    def to_dict(self) -> dict[str, Any]:
        """The fit as plain data (JSON-ready): the cost spec, ``a``, ``b``, residuals, the points and the fixed
        costs."""
        return {"cost": self.cost, "a": self.a, "b": self.b, "rms_relative": self.rms_relative,
                "max_relative": self.max_relative, "rms_seconds": self.rms_seconds, "overhead_s": self.overhead_s,
                "points": [list(p) for p in self.points], "microbatch_s": self.microbatch_s,
                "minibatch_s": self.minibatch_s, "fixed_points": [list(p) for p in self.fixed_points],
                "raw_fixed_s": list(self.raw_fixed_s)}


def time_samples(step: Callable[[int], Any], lengths: Sequence[int], *, repeats: int = 3, warmup: int = 1,
                 sync: Callable[[], Any] | None = None) -> list[tuple[int, float]]:
    """Times ``step(length)`` for every length: ``(length, median seconds)`` pairs.

    Rounds go over all lengths in turn (``warmup`` untimed rounds, then
    ``repeats`` timed ones), so a slow spell of a shared machine touches
    every length alike. ``sync`` (e.g. ``torch.cuda.synchronize``) runs
    before each clock read.
    """
    lengths = [int(s) for s in lengths]
    if repeats < 1 or warmup < 0:
        raise PackingError(f"repeats must be positive and warmup non-negative, got {repeats} and {warmup}")
    times: dict[int, list[float]] = {s: [] for s in lengths}
    for r in range(warmup + repeats):
        for s in lengths:
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            step(s)
            if sync is not None:
                sync()
            if r >= warmup:
                times[s].append(time.perf_counter() - t0)
    return [(s, statistics.median(times[s])) for s in dict.fromkeys(lengths)]


def _module_step(model: Any, vocab_size: int | None,
                 seed: int) -> tuple[Callable[[int], None], Callable[[], Any] | None]:
    """Forward + backward of one random sample through a causal LM (``model(input_ids=, position_ids=)``)."""
    import torch
    import torch.nn.functional as F

    if vocab_size is None:
        cfg = getattr(model, "config", None)
        vocab_size = getattr(cfg, "vocab_size", None)
        if vocab_size is None and hasattr(model, "get_input_embeddings"):
            vocab_size = model.get_input_embeddings().num_embeddings
        if vocab_size is None:
            raise PackingError("fit_cost: cannot tell the model's vocabulary size; pass vocab_size=")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)

    def step(length: int) -> None:
        ids = torch.randint(0, vocab_size, (1, length), generator=gen).to(device)
        pos = torch.arange(length, device=device)[None]
        out = model(input_ids=ids, position_ids=pos)
        logits = out.logits if hasattr(out, "logits") else out
        F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        model.zero_grad(set_to_none=True)

    return step, (torch.cuda.synchronize if device.type == "cuda" else None)


# The fixed costs are timed on minibatches of these many microbatches, each one sample this short (nearly all
# fixed cost).
FIXED_COUNTS = (1, 4)
FIXED_LENGTH = 16


def fit_cost(source: Any, lengths: Sequence[int] | None = None, *, repeats: int = 3, warmup: int = 1,
             vocab_size: int | None = None, seed: int = 0, minibatch: Callable[[int, int], Any] | None = None,
             minibatch_timings: Sequence[tuple[int, int, float]] | None = None) -> CostFit:
    """Fits the planner's quadratic cost model ``a·s² + b·s`` to a model's measured speed, and the fixed costs.

    Args:
        source: one of
            - measured ``(length, seconds)`` pairs (``lengths`` unused);
            - a torch module, a causal LM called as ``model(input_ids=,
              position_ids=)`` (Hugging Face style): forward + backward of one
              random sample of each length is timed;
            - a callable ``step(length)`` that runs forward + backward of one
              sample of ``length`` tokens, timed as is.
        lengths: sample lengths to time (a few, spread over the lengths the
            data holds, e.g. powers of two up to the longest sample).
        repeats: timed runs per length (the median counts).
        warmup: untimed rounds first.
        vocab_size: token ids are drawn below it (default: the model's).
        seed: seed of the random token ids.
        minibatch: a callable ``minibatch(n, length)`` that runs one whole
            minibatch of the training loop as it trains (on every rank at
            once): ``n`` microbatches of one ``length``-token sample each,
            forward + backward, then clipping and the optimizer step. It is
            timed for ``n`` in ``FIXED_COUNTS`` (``warmup`` untimed rounds,
            then ``repeats``, the median counts) with ``FIXED_LENGTH``
            tokens, and the fixed costs per microbatch and per minibatch are
            fitted to the times: ``seconds = g + n·(f + a·L² + b·L)``.
        minibatch_timings: instead, measured ``(n, length, seconds)`` of whole
            minibatches.

    The fit minimises squared relative errors with ``a, b >= 0``; the fixed
    costs are least squares with ``f, g >= 0``. Time on
    the device and in the setting of training (on a GPU: the GPU; on a
    shared host: with the other ranks running too). A sharded (FSDP) model
    issues collectives in forward: call it on every rank with the same
    lengths, or time an unsharded copy.

    Raises:
        PackingError: fewer than two distinct lengths, a length that is not
            a positive integer, a time that is not a positive number.
    """
    if lengths is None:
        if callable(source):
            raise PackingError("fit_cost: give the lengths to time the model at")
        try:
            pairs = [(p[0], float(p[1])) for p in source]
        except (TypeError, ValueError, IndexError):
            raise PackingError("fit_cost: expected (length, seconds) pairs, a model, or a step function") from None
    else:
        sync = None
        if callable(source) and not hasattr(source, "parameters"):
            step = source
        else:
            step, sync = _module_step(source, vocab_size, seed)
        pairs = time_samples(step, _lengths(lengths), repeats=repeats, warmup=warmup, sync=sync)
    if not pairs:
        raise PackingError("fit_cost: no timings given")
    if minibatch is not None and minibatch_timings is not None:
        raise PackingError("fit_cost: give minibatch= (to time) or minibatch_timings= (measured), not both")
    if minibatch is not None:
        minibatch_timings = time_minibatches(minibatch, repeats=repeats, warmup=warmup)
    timed = [(int(n), int(length), float(t)) for n, length, t in minibatch_timings or ()]
    raw = json.loads(_odc.fit_cost_json(_lengths([p[0] for p in pairs]), [p[1] for p in pairs], timed))
    fixed = raw["fixed"] or {"microbatch_seconds": 0.0, "minibatch_seconds": 0.0, "points": [],
                             "raw_microbatch_seconds": 0.0, "raw_minibatch_seconds": 0.0}
    return CostFit(
        cost=raw["model"],
        a=raw["a_per_token2"],
        b=raw["b_per_token"],
        rms_relative=raw["rms_relative"],
        max_relative=raw["max_relative"],
        rms_seconds=raw["rms_seconds"],
        overhead_s=raw["overhead_seconds"],
        points=tuple((p["length"], p["seconds"], p["predicted"]) for p in raw["points"]),
        microbatch_s=fixed["microbatch_seconds"],
        minibatch_s=fixed["minibatch_seconds"],
        fixed_points=tuple((p["microbatches"], p["length"], p["seconds"], p["predicted"]) for p in fixed["points"]),
        raw_fixed_s=(fixed["raw_microbatch_seconds"], fixed["raw_minibatch_seconds"]),
    )


def time_minibatches(minibatch: Callable[[int, int], Any], *, counts: Sequence[int] = FIXED_COUNTS,
                     length: int = FIXED_LENGTH, repeats: int = 3, warmup: int = 1,
                     sync: Callable[[], Any] | None = None) -> list[tuple[int, int, float]]:
    """Times ``minibatch(n, length)`` for every ``n`` in ``counts``: ``(n, length, median seconds)``.

    Rounds go over the counts in turn, as :func:`time_samples` does. What
    :func:`fit_cost` fits the fixed costs to.
    """
    if repeats < 1 or warmup < 0:
        raise PackingError(f"repeats must be positive and warmup non-negative, got {repeats} and {warmup}")
    times: dict[int, list[float]] = {int(n): [] for n in counts}
    for r in range(warmup + repeats):
        for n in times:
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            minibatch(n, length)
            if sync is not None:
                sync()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
    return [(n, int(length), statistics.median(t)) for n, t in times.items()]


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
    # Named odc-pack in its messages however it was started (the console script, `python -m odc.packing`).
    args = ["odc-pack", *(sys.argv[1:] if argv is None else argv)]
    sys.stdout.flush()
    code = _odc.pack_cli(args)
    if argv is None:
        raise SystemExit(code)
    return code


if __name__ == "__main__":
    main()
