"""``odc-bench imbalance``: an FSDP-shaped training loop under sequence-length imbalance.

A model of ``L`` layers, each one bucket of ``layer_bytes`` f32 parameters
sharded over the world. Per microbatch of cost ``C`` (the packer's cost
model), on every layer: forward = gather the layer's parameters, then
**emulated compute** of ``scale · C`` seconds; backward = gather again,
emulated compute of ``2 · scale · C``, push the layer's gradients. Compute
is a sleep (the host has few cores; what is measured is how ranks wait for
each other), with each sleep's overshoot carried into the next so a rank's
total emulated compute matches what it asked for. Communication is real.

Overlap (``--overlap``): as FSDP does, the next layer's gather can be
issued before this layer's compute and gradient pushes waited for only at
the end of the microbatch (collectives: async gloo work; ODC: one
communication thread — the engine's calls release the GIL). The default,
``auto``, overlaps the collectives and runs ODC's calls inline: an ODC
gather of a layer takes tens of microseconds, less than the thread
hand-off that would hide it on an oversubscribed host.

- **collective**: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` per
  layer per microbatch step; every rank runs the minibatch's largest
  microbatch count, a rank without a microbatch at a step runs an empty
  step (the collectives, zero compute) — the collective bubble.
- **odc**: each rank runs its own microbatches with ``Engine.gather`` /
  ``Engine.scatter_accumulate``, then ``finish_minibatch(k)``, an optimizer
  step on its own shards, ``zero_grad`` and ``publish`` of version ``k+1``
  (which waits for every reader's release of ``k``: the causal edge).
- **pad** (``dummy-pad``): as collective, with LB-Mini's plan; a rank with
  fewer microbatches runs dummy ones (zero weight, the cost of a
  ``DUMMY_LENGTH``-token sample) up to the largest count.
- **accum** (``fsdp2-accum``): LB-Mini's plan under FSDP2-style
  accumulation: every layer gathered once, at the rank's first microbatch,
  and kept; gradients accumulated locally and reduce-scattered once, at its
  last (a rank without microbatches runs one dummy).
- ``verl-maxcount`` runs verl's split to the largest count
  (:mod:`odc.bench.baselines`) as collective.
- **odc ... +steal**: the same, but the plan's per-rank lists are claimable
  work: a rank runs its own list (``Engine.claim_own``), then takes
  unstarted microbatches from the back of the list with the most predicted
  cost left (``Engine.steal``) until every list is drained. A stolen
  microbatch costs what its samples cost on the rank that runs it (a
  straggler's slowness stays with the straggler).

Checks (exact, integer-valued data): a gradient of sample ``i`` is
``w(i) · pattern`` with ``w(i) = i mod 7 + 1``, so the owner's accumulated
shard after minibatch ``k`` must equal ``W_k · pattern`` (``W_k`` summed over
the minibatch's samples) whatever the plan; the step adds ``grad / W_k`` =
``pattern`` to the parameters, so version ``j`` of a layer is
``init + j · pattern`` — checked on every gather (checksum) and on the
final shards.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from .report import fmt, png_metadata, table

__all__ = ["CONFIGS", "STEAL", "build_point", "imbalance_rank", "plot", "render", "steal_bound", "summarize"]

Mode = Literal["collective", "odc", "pad", "accum"]
Config = tuple[str, Mode, str]

CONFIGS: tuple[Config, ...] = (
    ("collective+lb-micro", "collective", "lb-micro"),
    ("collective+local-sort", "collective", "local-sort"),
    ("odc+lb-micro", "odc", "lb-micro"),
    ("odc+lb-mini", "odc", "lb-mini"),
    ("odc+local-sort", "odc", "local-sort"),
    ("odc+lb-mini+steal", "odc", "lb-mini"),
    ("verl-maxcount", "collective", "verl-maxcount"),
    ("dummy-pad", "pad", "lb-mini"),
    ("fsdp2-accum", "accum", "lb-mini"),
)
"""The configurations, ``(name, mode, strategy)``; the first is the baseline of every speedup. The last three are
what a user runs without ODC (:mod:`odc.bench.baselines`): ``mode`` ``pad`` runs in step with zero-loss padding
microbatches up to the largest count, ``accum`` under FSDP2-style gradient accumulation."""
BASELINE = CONFIGS[0][0]
"""The baseline's name: ``collective+lb-micro``."""
STEAL = "+steal"
"""The suffix of a configuration whose ranks steal each other's unstarted microbatches (``Engine.claim_own`` /
``steal``)."""


def sample_weight(i: int) -> int:
    """Integer gradient weight of sample ``i`` (exact in f32 sums)."""
    return i % 7 + 1


@dataclass(frozen=True)
class Settings:
    """What does not change over a sweep (the model and the run shape)."""

    layers: int
    layer_bytes: int
    cost: str
    minibatches: int
    repeats: int
    seed: int | None
    configs: tuple[Config, ...]
    # How far the emulated compute strays from the cost model the plans use: each sample's time is its model cost
    # times a seeded lognormal factor of mean 1 and this sigma (the same factor whichever rank runs it) ...
    noise: float = 0.0
    noise_seed: int = 0
    # ... and one rank's compute slowed by a factor: (rank, factor).
    straggler: tuple[int, float] | None = None


def true_costs(costs: Sequence[float], noise: float, seed: int) -> list[float]:
    """The emulated cost of every sample: ``costs`` times a seeded lognormal factor of mean 1 (``noise`` = its
    sigma; 0 = the model exactly)."""
    if noise <= 0:
        return list(costs)
    import random

    rng = random.Random(seed)
    return [c * math.exp(noise * rng.gauss(0.0, 1.0) - noise * noise / 2) for c in costs]


def build_point(lengths: Sequence[int], *, world: int, minibatch_size: int, max_tokens: int, settings: Settings,
                compute_scale: float | None, run_seconds: float | None, label: Any = None) -> dict[str, Any]:
    """Plans one benchmark point: every configuration's per-rank microbatches, predictions and the compute scale.

    The lengths are cut to ``minibatches · minibatch_size · world`` samples
    first, so each prediction covers exactly the minibatches that run.
    """
    from odc import packing

    from . import baselines

    n = settings.minibatches * minibatch_size * world
    lengths = list(lengths[:n])
    costs = [packing.sequence_cost(s, settings.cost) for s in lengths]
    # The plans and predictions use the model's costs; the emulated compute runs the true ones.
    true = true_costs(costs, settings.noise, settings.noise_seed)
    dummy = packing.sequence_cost(baselines.DUMMY_LENGTH, settings.cost)
    slow = dict([settings.straggler]) if settings.straggler else {}
    plans: dict[str, Any] = {}
    configs: dict[str, dict[str, Any]] = {}
    for name, mode, strategy in settings.configs:
        if strategy not in plans:
            if strategy == baselines.VERL_MAXCOUNT:
                plans[strategy] = baselines.verl_maxcount_plan(lengths, world, minibatch_size, max_tokens)
            else:
                plans[strategy] = packing.plan(lengths, world, minibatch_size, strategy, max_tokens, settings.cost,
                                               settings.seed)
        p = plans[strategy]
        steal = name.endswith(STEAL)
        # A stealing rank may run another's microbatch: its costs are the samples' own, and the rank that runs
        # it applies its own slowness (``slow``); otherwise the owner runs it, slowed by its own factor.
        per_rank = [[[((1.0 if steal else slow.get(r, 1.0)) * sum(true[i] for i in mb),
                       sum(sample_weight(i) for i in mb))
                      for mb in minibatch] for minibatch in p.rank(r)] for r in range(world)]
        # The baselines' dummy microbatches (weight 0): up to the largest count (pad), one for a rank without any
        # (accum). The same in the predictions, with the model's costs.
        model_costs = [[[sum(costs[i] for i in mb) for mb in minibatch] for minibatch in p.rank(r)]
                       for r in range(world)]
        for k in range(p.num_minibatches):
            runs = baselines.padded_counts([len(per_rank[r][k]) for r in range(world)], mode)
            for r in range(world):
                extra = runs[r] - len(per_rank[r][k])
                per_rank[r][k] += [(slow.get(r, 1.0) * dummy, 0)] * extra
                model_costs[r][k] += [dummy] * extra
        steps = [max(len(per_rank[r][k]) for r in range(world)) for k in range(p.num_minibatches)]
        weights = [sum(w for r in range(world) for _, w in per_rank[r][k]) for k in range(p.num_minibatches)]
        # Emulated-compute time of the plan in cost units (one unit = one layer's forward at scale 1).
        if mode in ("collective", "pad"):
            units = sum(sum(max((per_rank[r][k][s][0] if s < len(per_rank[r][k]) else 0.0) for r in range(world))
                            for s in range(steps[k])) for k in range(p.num_minibatches))
        else:
            units = sum(max(sum(c for c, _ in per_rank[r][k]) * (slow.get(r, 1.0) if steal else 1.0)
                            for r in range(world)) for k in range(p.num_minibatches))
        if isinstance(p, packing.Plan) and mode in ("collective", "odc"):
            bubble = p.bubble_rate(mode)
        else:
            bubble = _predicted_bubble(model_costs, mode, sum(costs))
        configs[name] = {
            "mode": mode,
            "strategy": strategy,
            "steal": steal,
            "slow": {str(r): f for r, f in slow.items()},
            "per_rank": per_rank,
            "steps": steps,
            "weights": weights,
            "bubble_pred": bubble,
            "units": units,
            "max_microbatches": max(max(len(m) for m in r) for r in per_rank),
            "plan_source": getattr(p, "source", "") or "odc.packing",
        }
        if steal:
            configs[name]["steal_bound"] = steal_bound(per_rank, slow)
    base = configs[BASELINE]
    for c in configs.values():
        c["speedup_pred"] = _ratio(1.0 - c["bubble_pred"], 1.0 - base["bubble_pred"])
    if run_seconds is not None:
        base_s = _compute_seconds(base["units"], settings.layers, 1.0)  # at scale 1
        compute_scale = run_seconds / base_s if base_s > 0 else 0.0
    return {
        "label": label,
        "world": world,
        "minibatch_size": minibatch_size,
        "max_tokens": max_tokens,
        "num_minibatches": plans["lb-micro"].num_minibatches,
        "samples": len(lengths),
        "work_units": sum(costs),
        "compute_scale": compute_scale,
        "configs": configs,
    }


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _compute_seconds(units: float, layers: int, scale: float) -> float:
    """Seconds of emulated compute for ``units`` of cost: each unit is a layer's forward (``scale`` seconds at
    scale 1) and a backward of twice that, on each of ``layers`` layers."""
    return 3 * layers * scale * units


def _predicted_bubble(costs: Sequence[Sequence[Sequence[float]]], mode: str, work: float) -> float:
    """The bubble ``1 - work / (D * time)`` of per-rank microbatch costs ``costs[r][k][j]`` (dummies included)
    under ``mode``: every step its slowest rank (collective, pad) or every minibatch its slowest rank (odc,
    accum)."""
    world = len(costs)
    span = 0.0
    for k in range(len(costs[0])):
        mine = [costs[r][k] for r in range(world)]
        if mode in ("collective", "pad"):
            span += sum(max(c[j] if j < len(c) else 0.0 for c in mine) for j in range(max(len(c) for c in mine)))
        else:
            span += max(sum(c) for c in mine)
    return 1.0 - work / (world * span) if span > 0 else 0.0


def steal_bound(per_rank: Sequence[Sequence[Sequence[tuple[float, int]]]], slow: dict[int, float]) -> float:
    """The emulated-compute bubble the stealing policy leaves with no communication and no delay: every rank runs
    its list largest first, then takes the smallest unstarted microbatch of the rank with the most cost left, at its
    own speed. Microbatches are not split, so the minibatch still ends ragged by up to one microbatch: the part of
    the bubble stealing cannot take back (a simulation of the policy on the true costs, not a measurement)."""
    import heapq

    world = len(per_rank)
    total_busy = total_span = 0.0
    for k in range(len(per_rank[0])):
        lists = [sorted((c for c, _ in per_rank[r][k]), reverse=True) for r in range(world)]
        front, back = [0] * world, [len(x) for x in lists]
        events = [(0.0, r) for r in range(world)]
        end, busy = 0.0, 0.0
        while events:
            now, r = heapq.heappop(events)
            victim = r if front[r] < back[r] else -1
            if victim < 0:
                left = [(sum(lists[v][front[v]:back[v]]), v) for v in range(world) if v != r and front[v] < back[v]]
                if not left:
                    end = max(end, now)
                    continue
                victim = max(left)[1]
                back[victim] -= 1
                cost = lists[victim][back[victim]]
            else:
                cost = lists[r][front[r]]
                front[r] += 1
            cost *= slow.get(r, 1.0)
            busy += cost
            heapq.heappush(events, (now + cost, r))
        total_busy += busy
        total_span += end
    return 1.0 - total_busy / (world * total_span) if total_span > 0 else 0.0


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


# -- rank side ---------------------------------------------------------------------------------------


class EmulatedCompute:
    """Emulated compute: sleeps, carrying each sleep's overshoot into the next request.

    ``time.sleep`` wakes late (scheduler granularity; more on a loaded host).
    A rank's total emulated compute stays what it asked for: the late part
    of one sleep is taken off the next. Waiting for peers is never counted.
    """

    def __init__(self) -> None:
        self.owed = 0.0
        self.requested = 0.0

    def reset(self) -> None:
        """Forgets what was owed and requested (a new measurement)."""
        self.owed = 0.0
        self.requested = 0.0

    def run(self, seconds: float) -> None:
        """Sleeps ``seconds`` of emulated compute, less what earlier sleeps overslept."""
        if seconds <= 0:
            return
        self.requested += seconds
        self.owed += seconds
        if self.owed > 0:
            t0 = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - t0


class _Model:
    """This rank's parameter shards, gradient accumulators (collective mode) and the check patterns."""

    def __init__(self, ctx: Any, layers: int, numel: int, shard_len: int) -> None:
        import torch

        self.layers, self.numel, self.shard_len, self.world = layers, numel, shard_len, ctx.world
        padded = shard_len * ctx.world
        idx = torch.arange(padded)
        live = (idx < numel).to(torch.float32)
        self.init = [((idx + layer) % 11).to(torch.float32) * live for layer in range(layers)]
        self.pattern = [((idx * 3 + layer) % 5 + 1).to(torch.float32) * live for layer in range(layers)]
        lo, hi = ctx.rank * shard_len, (ctx.rank + 1) * shard_len
        self.init_shard = [t[lo:hi].clone() for t in self.init]
        self.pattern_shard = [t[lo:hi].clone() for t in self.pattern]
        self.init_sum = [float(t.sum(dtype=torch.float64)) for t in self.init]
        self.pattern_sum = [float(t.sum(dtype=torch.float64)) for t in self.pattern]
        self.params = [t.clone() for t in self.init_shard]
        self.grads = [torch.zeros(shard_len) for _ in range(layers)]
        self.buffers = [torch.empty(padded) for _ in range(2)]
        self.kept: list[Any] = []  # every layer's gathered parameters, under accumulation

    def reset(self) -> None:
        for p, i in zip(self.params, self.init_shard, strict=True):
            p.copy_(i)
        for g in self.grads:
            g.zero_()

    def gathered_ok(self, layer: int, buf: Any, j: int) -> bool:
        import torch

        return float(buf.sum(dtype=torch.float64)) == self.init_sum[layer] + j * self.pattern_sum[layer]

    def step(self, grad_shards: Sequence[Any], weight: int) -> int:
        """Checks the final gradient shards, then param += grad / W; returns wrong elements."""
        wrong = 0
        for layer, g in enumerate(grad_shards):
            wrong += int((g != self.pattern_shard[layer] * weight).sum())
            if weight > 0:
                self.params[layer] += g / weight
        return wrong

    def final_wrong(self, j: int) -> int:
        return sum(int((p != i + j * pat).sum())
                   for p, i, pat in zip(self.params, self.init_shard, self.pattern_shard, strict=True))

    def checksum(self) -> float:
        import torch

        return sum(float(p.sum(dtype=torch.float64)) for p in self.params)


class _CollectiveComm:
    def __init__(self, ctx: Any, model: _Model, overlap: bool) -> None:
        self.ctx, self.model, self.overlap = ctx, model, overlap

    def gather(self, layer: int, buf: Any, version_index: int) -> Any:
        import torch.distributed as dist

        work = dist.all_gather_into_tensor(buf, self.model.params[layer], group=self.ctx.group, async_op=self.overlap)
        return work if self.overlap else _DONE

    def push(self, layer: int, grads: Any) -> Any:
        import torch
        import torch.distributed as dist

        out = torch.empty(self.model.shard_len)
        work = dist.reduce_scatter_tensor(out, grads, group=self.ctx.group, async_op=self.overlap)
        return _Pushed(work if self.overlap else _DONE, lambda: self.model.grads[layer].add_(out))


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class _Pushed:
    def __init__(self, work: Any, then: Any) -> None:
        self.work, self.then = work, then

    def wait(self) -> None:
        self.work.wait()
        self.then()


class _OdcComm:
    def __init__(self, engine: Any, pool: ThreadPoolExecutor | None) -> None:
        self.engine, self.pool, self.version = engine, pool, 0

    def _call(self, fn: Any, *args: Any) -> Any:
        if self.pool is None:
            fn(*args)
            return _DONE
        return _Future(self.pool.submit(fn, *args))

    def gather(self, layer: int, buf: Any, version_index: int) -> Any:
        return self._call(self.engine.gather, layer, self.version, buf)

    def push(self, layer: int, grads: Any) -> Any:
        return self._call(self.engine.scatter_accumulate, layer, grads, 1.0, 0)


class _Future:
    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def wait(self) -> None:
        self.fut.result()


def _microbatch(comm: Any, model: _Model, compute: EmulatedCompute, cost: float, weight: int, scale: float,
                j: int, stats: dict[str, int]) -> None:
    """Forward and backward of one microbatch (cost 0 = an empty collective step)."""
    layers = model.layers
    order = [(i, 1.0) for i in range(layers)] + [(i, 2.0) for i in reversed(range(layers))]
    pending = comm.gather(order[0][0], model.buffers[0], j)
    pushes = []
    for p, (layer, factor) in enumerate(order):
        pending.wait()
        buf = model.buffers[p % 2]
        if not model.gathered_ok(layer, buf, j):
            stats["gather_wrong"] += 1
        if p + 1 < len(order):  # prefetch the next layer's parameters during this layer's compute
            pending = comm.gather(order[p + 1][0], model.buffers[(p + 1) % 2], j)
        compute.run(factor * scale * cost)
        if factor == 2.0:
            pushes.append(comm.push(layer, model.pattern[layer] * float(weight)))
    for w in pushes:
        w.wait()


def _accum_minibatch(comm: Any, model: _Model, compute: EmulatedCompute, items: Sequence[tuple[float, int]],
                     scale: float, j: int, stats: dict[str, int]) -> None:
    """One minibatch under FSDP2-style gradient accumulation: every layer gathered once, in the first
    microbatch's forward, and kept (``reshard_after_forward=False``); gradients accumulated unsharded; every layer
    pushed once, in the last microbatch's backward (no gradient sync before)."""
    import torch

    layers = model.layers
    if len(model.kept) != layers:
        model.kept = [torch.empty(model.shard_len * model.world) for _ in range(layers)]
    acc = [torch.zeros_like(p) for p in model.pattern]
    pushes = []
    for m, (cost, weight) in enumerate(items):
        first, last = m == 0, m == len(items) - 1
        pending = comm.gather(0, model.kept[0], j) if first else _DONE
        for layer in range(layers):
            pending.wait()
            if first:
                if not model.gathered_ok(layer, model.kept[layer], j):
                    stats["gather_wrong"] += 1
                if layer + 1 < layers:
                    pending = comm.gather(layer + 1, model.kept[layer + 1], j)
            compute.run(scale * cost)
        for layer in reversed(range(layers)):
            compute.run(2.0 * scale * cost)
            acc[layer] += model.pattern[layer] * float(weight)
            if last:
                pushes.append(comm.push(layer, acc[layer]))
    for w in pushes:
        w.wait()


def _claimed(ctx: Any, cfg: dict[str, Any], engine: Any, claim_k: int, k: int, stats: dict[str, int]) -> Any:
    """This rank's microbatches of minibatch ``k`` as ``(cost, weight)``: its own list, and under stealing the
    microbatches it claims (its own from the front, then other ranks' from the back of the list with the most
    cost left), each cost scaled by this rank's slowness."""
    lists = [cfg["per_rank"][r][k] for r in range(ctx.world)]
    if not cfg.get("steal"):
        yield from lists[ctx.rank]
        return
    # Largest first (the same order on every rank): owners start with their long microbatches, thieves take the
    # short ones from the back, so the last work of a minibatch comes in small pieces.
    lists = [sorted(mbs, key=lambda mb: -mb[0]) for mbs in lists]
    factor = float(cfg["slow"].get(str(ctx.rank), 1.0))
    for owner, i in engine.claimed(claim_k, [len(x) for x in lists], cost=lambda r, j: lists[r][j][0]):
        stats["stolen"] += owner != ctx.rank
        cost, weight = lists[owner][i]
        yield cost * factor, weight


def _run_config(ctx: Any, cfg: dict[str, Any], scale: float, model: _Model, engine: Any,
                pool: ThreadPoolExecutor | None, state: dict[str, int], progress: Any) -> dict[str, Any]:
    mine = cfg["per_rank"][ctx.rank]
    n = len(cfg["weights"])
    compute = EmulatedCompute()
    stats = {"gather_wrong": 0, "grad_wrong": 0, "stolen": 0}
    model.reset()
    if cfg["mode"] == "odc":
        comm: Any = _OdcComm(engine, pool)
        base = state["next_version"]
        for layer in range(model.layers):
            engine.publish(layer, model.params[layer], base)
    else:
        comm = _CollectiveComm(ctx, model, overlap=pool is not None)
    ctx.barrier()
    t0 = time.perf_counter()
    ends = []
    for k in range(n):
        if cfg["mode"] == "odc":
            comm.version = base + k
            for cost, weight in _claimed(ctx, cfg, engine, base + k, k, stats):
                _microbatch(comm, model, compute, cost, weight, scale, k, stats)
            engine.finish_minibatch(base + k)
            grads = [engine.grad_shard(layer) for layer in range(model.layers)]
            stats["grad_wrong"] += model.step(grads, cfg["weights"][k])
            engine.zero_grad()
            if k + 1 < n:
                for layer in range(model.layers):
                    engine.publish(layer, model.params[layer], base + k + 1)
        elif cfg["mode"] == "accum":
            _accum_minibatch(comm, model, compute, mine[k], scale, k, stats)
            stats["grad_wrong"] += model.step(model.grads, cfg["weights"][k])
            for g in model.grads:
                g.zero_()
        else:
            for s in range(cfg["steps"][k]):
                cost, weight = mine[k][s] if s < len(mine[k]) else (0.0, 0)
                _microbatch(comm, model, compute, cost, weight, scale, k, stats)
            stats["grad_wrong"] += model.step(model.grads, cfg["weights"][k])
            for g in model.grads:
                g.zero_()
        ends.append(time.perf_counter())
        progress()
    if cfg["mode"] == "odc":
        state["next_version"] = base + n
    # Padding (the baselines' dummy microbatches, weight 0) is compute no sample needed: not counted as busy.
    dummy_s = sum(_compute_seconds(c, model.layers, scale) for mbs in mine for c, w in mbs if w == 0 and c > 0)
    return {
        "t0": t0,
        "ends": ends,
        "compute_s": compute.requested - dummy_s,
        "stolen": stats["stolen"],
        "gather_wrong": stats["gather_wrong"],
        "grad_wrong": stats["grad_wrong"],
        "param_wrong": model.final_wrong(n),
        "checksum": model.checksum(),
        "expected_checksum": sum(model.init_sum[i] + n * model.pattern_sum[i] for i in range(model.layers)),
    }


def imbalance_rank(ctx: Any, *, points: list[dict[str, Any]], layers: int, layer_bytes: int, repeats: int,
                   timeout: float, chunk_bytes: int | None, overlap: str = "auto",
                   calibrate: bool = True) -> list[dict[str, Any]]:
    """One rank of ``odc-bench imbalance``: runs every configuration of every point; rank 0 returns the results.

    ``calibrate``: before its timed repeats, each configuration runs its plan once with no compute (every
    gather, push, collective and step, no sleep); that run's seconds (``comm_s``) are what the *+comm*
    prediction adds to the compute-only one.
    """
    import torch

    import odc

    numel = max(1, layer_bytes // 4)
    engine = ctx.engine(timeout=timeout, chunk_bytes=chunk_bytes)
    engine.register([odc.Bucket(f"layer{i}", numel, torch.float32) for i in range(layers)])
    shard_len = engine.bucket(0)["shard_len"]
    model = _Model(ctx, layers, numel, shard_len)
    state = {"next_version": 0}
    results = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="odc-comm") as executor:
        for pi, point in enumerate(points):
            for name, cfg in point["configs"].items():
                label = f"{point['label'] if point['label'] is not None else ''} {name}".strip()
                on = overlap == "on" or (overlap == "auto" and cfg["mode"] != "odc")
                comm_s = None
                if calibrate:  # the same plan with no compute: what its communication and steps alone take
                    per_rank = _run_config(ctx, cfg, 0.0, model, engine, executor if on else None, state,
                                           functools.partial(ctx.emit, "progress", f"{label} no compute"))
                    comm_s = _aggregate(ctx.all_gather_object(per_rank))["total_s"]
                runs = []
                for rep in range(repeats):
                    per_rank = _run_config(ctx, cfg, point["compute_scale"], model, engine, executor if on else None,
                                           state,
                                           functools.partial(ctx.emit, "progress", f"{label} #{rep + 1}"))
                    runs.append(_aggregate(ctx.all_gather_object(per_rank)))
                results.append({"point": pi, "config": name, "runs": runs, "comm_s": comm_s})
    return results


def _aggregate(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    start = min(r["t0"] for r in per_rank)
    n = len(per_rank[0]["ends"])
    ends = [max(r["ends"][k] for r in per_rank) for k in range(n)]
    prev, per_minibatch = start, []
    for e in ends:
        per_minibatch.append(e - prev)
        prev = e
    return {
        "total_s": (ends[-1] - start) if ends else 0.0,
        "minibatch_s": per_minibatch,
        "compute_s": [r["compute_s"] for r in per_rank],
        "stolen": sum(r["stolen"] for r in per_rank),
        "gather_wrong": sum(r["gather_wrong"] for r in per_rank),
        "grad_wrong": sum(r["grad_wrong"] for r in per_rank),
        "param_wrong": sum(r["param_wrong"] for r in per_rank),
        "param_checksum": sum(r["checksum"] for r in per_rank),
        "param_checksum_expected": per_rank[0]["expected_checksum"],
    }


# -- report side -------------------------------------------------------------------------------------


def summarize(points: list[dict[str, Any]], results: list[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    """One row per (point, configuration): measured and predicted bubble and speedup, checks."""
    rows = []
    for pi, point in enumerate(points):
        sel = {r["config"]: r for r in results if r["point"] == pi}
        med = {name: statistics.median(run["total_s"] for run in r["runs"]) for name, r in sel.items()}
        comm: dict[str, float | None] = {name: r.get("comm_s") for name, r in sel.items()}
        # Seconds of emulated compute the plan takes plus its no-compute run's; nan without a calibration run.
        with_comm = {name: _compute_seconds(cfg["units"], settings.layers, point["compute_scale"])
                     + _or_nan(comm[name]) for name, cfg in point["configs"].items()}
        comm_speedup = {name: _ratio(with_comm[BASELINE], t) for name, t in with_comm.items()}
        for name, cfg in point["configs"].items():
            runs = sel[name]["runs"]
            total = med[name]
            world = point["world"]
            compute = statistics.median(sum(run["compute_s"]) for run in runs)
            bubble = 1.0 - compute / (world * total) if total > 0 else float("nan")
            speedup = _ratio(med[BASELINE], total)
            wrong = sum(run["gather_wrong"] + run["grad_wrong"] + run["param_wrong"] for run in runs)
            rows.append({
                "label": point["label"],
                "world": world,
                "minibatch_size": point["minibatch_size"],
                "max_tokens": point["max_tokens"],
                "minibatches": point["num_minibatches"],
                "config": name,
                "mode": cfg["mode"],
                "strategy": cfg["strategy"],
                "plan_source": cfg.get("plan_source"),
                "max_microbatches": cfg["max_microbatches"],
                "compute_scale": point["compute_scale"],
                "time_per_minibatch_s": total / max(1, point["num_minibatches"]),
                "samples_per_s": point["samples"] / total if total > 0 else float("nan"),
                "bubble_measured": bubble,
                "bubble_predicted": cfg["bubble_pred"],
                "speedup_measured": speedup,
                "speedup_predicted": cfg["speedup_pred"],
                "error": speedup / cfg["speedup_pred"] - 1.0 if cfg["speedup_pred"] > 0 else float("nan"),
                # +comm: the compute-only prediction's seconds plus the configuration's no-compute run.
                "comm_s": comm[name],
                "predicted_time_with_comm_s": with_comm[name],
                "speedup_predicted_with_comm": comm_speedup[name],
                "error_with_comm": _ratio(speedup, comm_speedup[name]) - 1.0,
                "wrong": wrong,
                "stolen_per_minibatch": statistics.median(run["stolen"] for run in runs)
                / max(1, point["num_minibatches"]),
                "steal_bound": cfg.get("steal_bound"),
                "param_checksum": runs[-1]["param_checksum"],
                "param_checksum_expected": runs[-1]["param_checksum_expected"],
                "runs": runs,
            })
    return rows


def render(rows: list[dict[str, Any]], title: list[str], sweep_name: str | None) -> str:
    """The results as an nccl-tests style table, ``title`` lines first (one row per configuration and point)."""
    header = ["config", "mb/rank", "t/minibatch(s)", "samples/s", "bubble", "pred", "speedup", "pred", "error",
              "+comm", "error", "#wrong"]
    widths = [22, 7, 14, 9, 7, 7, 8, 7, 7, 7, 7, 6]
    if sweep_name:
        header.insert(0, sweep_name)
        widths.insert(0, max(8, len(sweep_name)))
    body = []
    for r in rows:
        comm = r["speedup_predicted_with_comm"]
        cells = [r["config"], r["max_microbatches"], fmt(r["time_per_minibatch_s"], 3), fmt(r["samples_per_s"], 2),
                 f"{100 * r['bubble_measured']:.1f}%", f"{100 * r['bubble_predicted']:.1f}%",
                 fmt(r["speedup_measured"], 3) + "x", fmt(r["speedup_predicted"], 3) + "x",
                 f"{100 * r['error']:+.1f}%" if not math.isnan(r["error"]) else "-",
                 "-" if math.isnan(comm) else fmt(comm, 3) + "x",
                 "-" if math.isnan(r["error_with_comm"]) else f"{100 * r['error_with_comm']:+.1f}%", r["wrong"]]
        if sweep_name:
            cells.insert(0, r["label"])
        body.append(cells)
    return table(header, body, widths, title)


def plot(rows: list[dict[str, Any]], path: str, title: str, sweep_name: str | None) -> None:
    """Measured against predicted speedup per configuration (over the sweep, if any); with a stealing
    configuration in a sweep, a second panel of measured bubbles beside the steal bound."""
    from .report import require_matplotlib

    plt = require_matplotlib()
    names = list(dict.fromkeys(r["config"] for r in rows))
    bubbles = bool(sweep_name) and any(n.endswith(STEAL) for n in names)
    fig, axes = plt.subplots(1, 2 if bubbles else 1, figsize=(13 if bubbles else 8, 5), squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = [c[0] for c in CONFIGS]

    def color(name: str) -> Any:
        # One colour per configuration, the same in every plot whatever --configs leaves out.
        return colors[order.index(name) % len(colors)] if name in order else "black"

    if sweep_name:
        labels = list(dict.fromkeys(r["label"] for r in rows))
        xs = range(len(labels))
        for name in names:
            sel = {r["label"]: r for r in rows if r["config"] == name}
            c = color(name)
            ax.plot(xs, [sel[x]["speedup_measured"] for x in labels], "-o", color=c, label=f"{name} measured")
            ax.plot(xs, [sel[x]["speedup_predicted"] for x in labels], "--x", color=c, alpha=0.7,
                    label=f"{name} predicted")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(x) for x in labels])
        ax.set_xlabel(sweep_name)
        if bubbles:
            bx = axes[0][1]
            for name in names:
                sel = {r["label"]: r for r in rows if r["config"] == name}
                bx.plot(xs, [100 * sel[x]["bubble_measured"] for x in labels], "-o", color=color(name),
                        label=f"{name} measured")
                if name.endswith(STEAL):
                    bx.plot(xs, [100 * sel[x]["steal_bound"] for x in labels], ":s", color=color(name), alpha=0.7,
                            label=f"{name}: the policy's bound (simulated)")
            bx.set_xticks(list(xs))
            bx.set_xticklabels([str(x) for x in labels])
            bx.set_xlabel(sweep_name)
            bx.set_ylabel("bubble (%)")
            bx.set_ylim(bottom=0)
            bx.grid(True, alpha=0.3)
            bx.legend(fontsize=7)
    else:
        width = 0.38
        xs = range(len(names))
        sel = {r["config"]: r for r in rows}
        ax.bar([x - width / 2 for x in xs], [sel[n]["speedup_measured"] for n in names], width, label="measured")
        ax.bar([x + width / 2 for x in xs], [sel[n]["speedup_predicted"] for n in names], width, label="predicted")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=15, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel(f"speedup vs {BASELINE}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=png_metadata())  # which run drew it (the docs check it)
    plt.close(fig)
