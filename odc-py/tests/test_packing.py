"""odc.packing from Python: plans, verl-compatible helpers, errors, the odc-pack command."""

from __future__ import annotations

import heapq
import itertools
import json
import random
import subprocess
import sys

import pytest

import odc
from odc import packing

LONGALIGN = "lognormal:n=512,median=10000,sigma=1.0,max=65536,seed=0"


def all_indices(p: packing.Plan) -> list[int]:
    return sorted(i for r in range(p.world_size) for mbs in p.rank(r) for mb in mbs for i in mb)


@pytest.mark.parametrize("strategy", packing.STRATEGIES)
def test_plan_covers_every_sample_once(strategy):
    lengths = packing.synthetic(LONGALIGN)
    p = packing.plan(lengths, world_size=4, minibatch_size=8, strategy=strategy, max_tokens=65536, cost="quadratic")
    assert all_indices(p) == list(range(len(lengths)))
    for r in range(4):
        for mbs in p.rank(r):
            for mb in mbs:
                assert sum(lengths[i] for i in mb) <= 65536
    assert 0.0 <= p.bubble_rate("odc") <= p.bubble_rate("collective") + 1e-12
    assert p.predicted_speedup >= 1.0 - 1e-12


def test_lb_micro_equal_counts_and_lb_mini_beats_it():
    lengths = packing.synthetic(LONGALIGN)
    micro = packing.plan(lengths, 8, 8, strategy="lb-micro", cost="quadratic")
    mini = packing.plan(lengths, 8, 8, strategy="lb-mini", cost="quadratic")
    for m in range(micro.num_minibatches):
        counts = {len(micro.rank(r)[m]) for r in range(8)}
        assert len(counts) == 1, counts
    # LB-Mini balances whole minibatches: under ODC it idles less than LB-Micro under collectives.
    assert mini.bubble_rate("odc") < micro.bubble_rate("collective")


def minibatch_sets(p: packing.Plan) -> list[list[int]]:
    return [sorted(i for ranks in mb for micro in ranks for i in micro) for mb in p.minibatches]


def test_same_seed_same_plan():
    lengths = packing.synthetic(LONGALIGN)
    for seed in (None, 0, 7, 2**64 - 1):
        a = packing.plan(lengths, 4, 4, seed=seed)
        b = packing.plan(lengths, 4, 4, seed=seed)
        assert a == b


@pytest.mark.parametrize("strategy", packing.STRATEGIES)
def test_seed_shuffles_which_samples_share_a_minibatch(strategy):
    lengths = packing.synthetic(LONGALIGN)
    plans = {seed: packing.plan(lengths, 4, 4, strategy=strategy, seed=seed) for seed in (None, 1, 2)}
    for p in plans.values():
        assert all_indices(p) == list(range(len(lengths)))  # original positions, each exactly once
    if strategy == "verl-native":
        # verl-native balances the whole batch first: the seed shows in who runs what, where.
        def composition(p):
            return [[sorted(i for micro in ranks for i in micro) for ranks in mb] for mb in p.minibatches]
    else:
        composition = minibatch_sets
        assert composition(plans[None]) == [list(range(i, i + 16)) for i in range(0, len(lengths), 16)]
    assert composition(plans[1]) != composition(plans[None])
    assert composition(plans[1]) != composition(plans[2])


# Plans of this input as odc.packing produced them before seeds shuffled anything.
TODAY_LENGTHS = [5, 9, 1, 7, 3, 3, 8, 2, 6, 4]
TODAY_PLANS = {
    "local-sort": [[[[0], [2]], [[1], [3]]], [[[6], [4]], [[5], [7]]], [[[8]], [[9]]]],
    "lb-micro": [[[[0, 3]], [[1, 2]]], [[[4, 5, 7]], [[6]]], [[[8]], [[9]]]],
    "lb-mini": [[[[0, 3]], [[1, 2]]], [[[4, 5, 7]], [[6]]], [[[8]], [[9]]]],
    "verl-native": [[[[0, 2]], [[1, 4]]], [[[3, 5]], [[7, 8]]], [[[6]], [[9]]]],
}


@pytest.mark.parametrize("strategy", packing.STRATEGIES)
def test_no_seed_is_todays_plan(strategy):
    p = packing.plan(TODAY_LENGTHS, 2, 2, strategy=strategy, max_tokens=12)
    assert p == packing.plan(TODAY_LENGTHS, 2, 2, strategy=strategy, max_tokens=12, seed=None)
    assert [[list(map(list, ranks)) for ranks in mb] for mb in p.minibatches] == TODAY_PLANS[strategy]


def test_json_shape_matches_cli():
    lengths = [5, 9, 1, 7, 3, 3, 8, 2]
    p = packing.plan(lengths, 2, 2, strategy="lb-mini", max_tokens=100)
    d = p.to_dict()
    assert set(d) == {"minibatches", "bubble_collective", "bubble_odc", "predicted_speedup", "time_collective",
                      "time_odc", "fixed"}
    assert set(d["minibatches"][0]) == {"ranks", "bubble_collective", "bubble_odc", "time_collective", "time_odc"}
    assert set(d["minibatches"][0]["ranks"][0]) == {"microbatches", "cost"}
    assert d["fixed"] == {"microbatch": 0.0, "minibatch": 0.0}


def test_karmarkar_karp_verl_compatible():
    seqlens = [10, 20, 30, 40, 50, 60, 70, 80]
    parts = packing.karmarkar_karp(seqlens, 2, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    sums = sorted(sum(seqlens[i] for i in p) for p in parts)
    assert sums == [180, 180]
    parts = packing.get_seqlen_balanced_partitions(seqlens, 3, equal_size=False)
    assert all(p == sorted(p) and p for p in parts)


def test_cost_models():
    assert packing.sequence_cost(1000, "linear") == 1000
    assert packing.sequence_cost(32000, "qwen2-7b") == pytest.approx(4.348357 + 8.768377)
    assert packing.sequence_cost(10, "verl") == 10 * 10 + 24576 * 10


@pytest.mark.parametrize(
    ("lengths", "needle"),
    [
        ([], "empty"),
        ([5, 0, 3], "index 1"),
        ([5, -4, 3], "index 1"),
        ([5, 2.5], "index 1"),
        ([5, "7"], "index 1"),
    ],
)
def test_bad_lengths(lengths, needle):
    with pytest.raises(odc.PackingError, match=needle) as e:
        packing.plan(lengths, 2, 2)
    assert isinstance(e.value, ValueError)


BIG = 2**70


@pytest.mark.parametrize(
    ("call", "needles"),
    [
        (lambda: packing.plan([1, BIG], 2, 2), ["index 1", str(BIG)]),
        (lambda: packing.plan([1, 2**64], 2, 2), ["index 1", str(2**64)]),
        (lambda: packing.plan([1, 2], 2, 2, seed=-1), ["seed", "-1"]),
        (lambda: packing.plan([1, 2], 2, 2, seed=2**64), ["seed", str(2**64)]),
        (lambda: packing.plan([1, 2], 2, 2, seed=1.5), ["seed", "1.5"]),
        (lambda: packing.plan([1, 2], 2, 2, seed="3"), ["seed", "'3'"]),
        (lambda: packing.plan([1, 2], BIG, 2), ["world_size", str(BIG)]),
        (lambda: packing.plan([1, 2], 2, -3), ["minibatch_size", "-3"]),
        (lambda: packing.plan([1, 2], 2, 2, max_tokens=BIG), ["max_tokens", str(BIG)]),
        (lambda: packing.karmarkar_karp([1, BIG, 3], 2, False), ["index 1", str(BIG)]),
        (lambda: packing.karmarkar_karp([1, 2**1100], 2, False), ["index 1"]),
        (lambda: packing.karmarkar_karp([1, 2, 3], -1, False), ["k_partitions", "-1"]),
        (lambda: packing.karmarkar_karp([1, 2, 3], BIG, False), ["k_partitions", str(BIG)]),
        (lambda: packing.get_seqlen_balanced_partitions([4, 1, BIG], 2, False), ["index 2", str(BIG)]),
        (lambda: packing.get_seqlen_balanced_partitions([1, 2], -2, True), ["k_partitions", "-2"]),
        (lambda: packing.sequence_cost(-1), ["length", "-1"]),
        (lambda: packing.sequence_cost(BIG), ["length", str(BIG)]),
    ],
)
def test_out_of_range_integers_are_packing_errors(call, needles):
    with pytest.raises(odc.PackingError) as e:
        call()
    assert isinstance(e.value, ValueError)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


@pytest.mark.parametrize("fn", [packing.karmarkar_karp, packing.get_seqlen_balanced_partitions])
@pytest.mark.parametrize(
    ("lengths", "needles"),
    [
        ([1, 0, 3, 4], ["index 1", "zero"]),
        ([1, 2, 3, -4], ["index 3", "negative", "-4"]),
        ([1, 2.5, 3, 4], ["index 1", "2.5"]),
        ([1, True, 3, 4], ["index 1", "True"]),
        ([], ["empty"]),
    ],
)
def test_verl_helpers_refuse_bad_lengths(fn, lengths, needles):
    with pytest.raises(odc.PackingError) as e:
        fn(lengths, 2, equal_size=False)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_native_module_never_overflows():
    # The private module guards itself too: no OverflowError even without the Python checks.
    from odc import _odc

    for call, needle in [
        (lambda: _odc.plan_json([1, BIG], 2, 2, "lb-mini", 100, "linear", None), "index 1"),
        (lambda: _odc.plan_json([1, 0], 2, 2, "lb-mini", 100, "linear", None), "index 1"),
        (lambda: _odc.plan_json([1, 2], 2, 2, "lb-mini", 100, "linear", -1), "seed"),
        (lambda: _odc.plan_json([1, 2], -2, 2, "lb-mini", 100, "linear", None), "world_size"),
        (lambda: _odc.karmarkar_karp([1, 0, 3, 4], 2, False), "index 1"),
        (lambda: _odc.karmarkar_karp([1, BIG], 2, False), "index 1"),
        (lambda: _odc.karmarkar_karp([1, 2], -1, False), "k_partitions"),
        (lambda: _odc.sequence_cost("linear", -1), "length"),
    ]:
        with pytest.raises(odc.PackingError, match=needle):
            call()


def test_numpy_integers_are_lengths():
    np = pytest.importorskip("numpy")
    lengths = np.array([5, 9, 1, 7], dtype=np.int64)
    assert packing.karmarkar_karp(lengths, 2, True) == packing.karmarkar_karp([5, 9, 1, 7], 2, True)
    assert packing.plan(lengths, 2, 2, seed=np.uint64(3)) == packing.plan([5, 9, 1, 7], 2, 2, seed=3)


def verl_reference_karmarkar_karp(seqlens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """verl's heapq Karmarkar–Karp, rewritten here as the quality reference.

    A partial partition is k (sum, items) sets sorted by sum, largest first;
    the heap pops the partial partition of largest spread (max - min sum).
    The two of largest spread merge by joining the i-th largest set of one
    with the i-th smallest of the other. Items enter in ascending length
    order: one item per partial partition, or with ``equal_size`` k
    consecutive items at a time, one per set.
    """
    tie = itertools.count()
    heap: list = []

    def push(sets):
        sets = sorted(sets, key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tie), sets))

    order = sorted(range(len(seqlens)), key=lambda i: (seqlens[i], i))
    if equal_size:
        for start in range(0, len(order), k):
            push([(seqlens[i], [i]) for i in order[start : start + k]])
    else:
        for i in order:
            push([(seqlens[i], [i])] + [(0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    return [items for _, items in heap[0][2]]


def test_verl_reference_sanity():
    # Karmarkar–Karp's own textbook example: {8,7,6,5,4} into 2 gives 16/14 by plain differencing.
    parts = verl_reference_karmarkar_karp([8, 7, 6, 5, 4], 2, False)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    parts = verl_reference_karmarkar_karp([1, 2, 3, 4, 5, 6], 3, True)
    assert sorted(len(p) for p in parts) == [2, 2, 2]
    assert sorted(i for p in parts for i in p) == list(range(6))


def test_karmarkar_karp_at_least_as_good_as_verl():
    rng = random.Random(20240607)
    cases = 0
    for _ in range(400):
        k = rng.randint(1, 12)
        equal_size = rng.random() < 0.5
        per_part = rng.randint(1, 8) if rng.random() < 0.6 else rng.randint(9, 20)
        n = k * per_part if equal_size else rng.randint(k, k * per_part)
        top = rng.choice([5, 100, 70000])  # 5: many ties; 70000: LongAlign-like spread
        seqlens = [rng.randint(1, top) for _ in range(n)]
        ours = packing.karmarkar_karp(seqlens, k, equal_size)
        ref = verl_reference_karmarkar_karp(seqlens, k, equal_size)
        assert len(ours) == k
        assert sorted(i for p in ours for i in p) == list(range(n))
        if equal_size:
            assert {len(p) for p in ours} == {n // k}
        ours_max = max(sum(seqlens[i] for i in p) for p in ours)
        ref_max = max(sum(seqlens[i] for i in p) for p in ref)
        assert ours_max <= ref_max, (seqlens, k, equal_size, ours_max, ref_max)
        cases += 1
    assert cases == 400


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="bogus"):
        packing.plan([1, 2, 3, 4], 2, 2, strategy="bogus")
    with pytest.raises(ValueError, match="nope"):
        packing.plan([1, 2, 3, 4], 2, 2, cost="nope")
    with pytest.raises(ValueError, match="70000"):
        packing.plan([1, 70000, 3, 4], 2, 2, max_tokens=65536)
    with pytest.raises(ValueError, match="k = 3"):
        packing.get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)
    with pytest.raises(ValueError, match="world_size"):
        packing.plan([1, 2], 0, 2)


def test_odc_pack_console_script(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(str(x) for x in [100, 2000, 300, 4000, 50, 600, 7000, 80]) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "odc.packing", "--lengths", str(f), "--world", "2", "--minibatch-size", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["minibatches"]) == 2
    bad = subprocess.run(
        [sys.executable, "-m", "odc.packing", "--lengths", str(f), "--strategy", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "nope" in bad.stderr
    # The Rust command's own help, examples last.
    helped = subprocess.run([sys.executable, "-m", "odc.packing", "--help"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert helped.returncode == 0, helped.stderr
    assert "Usage: odc-pack" in helped.stdout and "\nExamples:\n  odc-pack --synthetic" in helped.stdout, helped.stdout


def test_fit_cost_recovers_known_coefficients_from_pairs():
    a, b = 3e-8, 1.5e-4
    exact = packing.fit_cost([(s, a * s * s + b * s) for s in (64, 128, 256, 512, 1024, 2048)])
    assert exact.a == pytest.approx(a, rel=1e-9) and exact.b == pytest.approx(b, rel=1e-9)
    assert exact.rms_relative < 1e-9 and exact.max_relative < 1e-9
    # The planner takes the fit as its cost model; its costs are the predicted seconds.
    assert packing.sequence_cost(1000, str(exact)) == pytest.approx(exact.seconds(1000), rel=1e-9)
    lengths = packing.synthetic("lognormal:n=64,median=300,max=2048,seed=1")
    assert packing.plan(lengths, 2, 8, "lb-mini", 2048, cost=exact) == packing.plan(lengths, 2, 8, "lb-mini", 2048,
                                                                                     cost=exact.cost)
    # Multiplicative noise of +-3 %: coefficients within 10 %, the residual reports it.
    rng = random.Random(0)
    noisy = packing.fit_cost([(s, (a * s * s + b * s) * (1 + rng.uniform(-0.03, 0.03)))
                              for s in (64, 128, 256, 512, 1024, 2048) for _ in range(3)])
    assert noisy.a == pytest.approx(a, rel=0.1) and noisy.b == pytest.approx(b, rel=0.1)
    assert 0.005 < noisy.rms_relative < 0.03
    # A fixed cost per call is not part of a*s^2 + b*s; the diagnostic names it.
    fixed = packing.fit_cost([(s, a * s * s + b * s + 0.005) for s in (32, 64, 128, 256, 512, 1024, 2048)])
    assert fixed.overhead_s == pytest.approx(0.005, rel=1e-6)
    assert fixed.max_relative > 0.2


def test_fit_cost_times_a_step_function(monkeypatch):
    """time_samples + fit on a fake clock: each step of s tokens takes exactly 2e-8*s^2 + 1e-4*s seconds."""
    clock = [0.0]
    calls = []

    def step(s):
        calls.append(s)
        clock[0] += 2e-8 * s * s + 1e-4 * s

    monkeypatch.setattr(packing.time, "perf_counter", lambda: clock[0])
    fit = packing.fit_cost(step, [100, 400, 1600], repeats=2, warmup=1)
    assert fit.a == pytest.approx(2e-8, rel=1e-6) and fit.b == pytest.approx(1e-4, rel=1e-6)
    # Rounds go over every length in turn: one warm-up round, then two timed ones.
    assert calls == [100, 400, 1600] * 3
    assert [p[0] for p in fit.points] == [100, 400, 1600]


def test_fit_cost_fits_the_fixed_costs_and_plan_uses_them(monkeypatch):
    """Whole minibatches on a fake clock: n microbatches of an L-token sample take g + n * (f + cost(L))."""
    clock = [0.0]
    calls = []

    def step(s):
        clock[0] += 1e-4 * s

    def minibatch(n, length):
        calls.append((n, length))
        clock[0] += 0.25 + n * (0.03 + 1e-4 * length)

    monkeypatch.setattr(packing.time, "perf_counter", lambda: clock[0])
    fit = packing.fit_cost(step, [100, 400, 1600], repeats=2, warmup=1, minibatch=minibatch)
    assert fit.microbatch_s == pytest.approx(0.03, rel=1e-6) and fit.minibatch_s == pytest.approx(0.25, rel=1e-6)
    assert calls == [(n, packing.FIXED_LENGTH) for n in packing.FIXED_COUNTS] * 3
    assert [p[0] for p in fit.fixed_points] == list(packing.FIXED_COUNTS)
    assert fit.to_dict()["microbatch_s"] == fit.microbatch_s
    # plan() takes the fit's fixed costs; the predicted times count them, explicit arguments override them.
    lengths = packing.synthetic("lognormal:n=64,median=300,sigma=1.0,max=2048,seed=0")
    p = packing.plan(lengths, 2, 8, "lb-mini", 2048, cost=fit)
    assert (p.microbatch_cost, p.minibatch_cost) == (fit.microbatch_s, fit.minibatch_s)
    per_rank = [sum(sum(fit.seconds(lengths[i]) for i in mb) + fit.microbatch_s for mb in r) for r in p.minibatches[0]]
    assert p.minibatch_times[0][1] == pytest.approx(max(per_rank) + fit.minibatch_s)
    assert p.time("odc") == pytest.approx(p.time_odc) and p.time("odc", 1) == pytest.approx(
        p.time_odc - p.minibatch_times[0][1])
    assert p.predicted_speedup == pytest.approx(p.time_collective / p.time_odc)
    plain = packing.plan(lengths, 2, 8, "lb-mini", 2048, cost=fit, microbatch_cost=0.0, minibatch_cost=0.0)
    assert plain.microbatch_cost == 0.0 and plain.time_odc < p.time_odc
    with pytest.raises(odc.PackingError, match="microbatch_cost"):
        packing.plan(lengths, 2, 8, "lb-mini", 2048, microbatch_cost=-1.0)
    with pytest.raises(odc.PackingError, match="not both"):
        packing.fit_cost(step, [100, 400], minibatch=minibatch, minibatch_timings=[(1, 16, 0.3), (4, 16, 0.4)])
    with pytest.raises(odc.PackingError, match="2 distinct microbatch counts"):
        packing.fit_cost([(100, 0.01), (200, 0.02)], minibatch_timings=[(4, 16, 0.3), (4, 16, 0.4)])


def test_a_dear_microbatch_buys_lb_mini_fewer_microbatches():
    """The fixed cost makes LB-Mini trade cost balance for a microbatch less on the slowest rank (the packer's
    property tests hold it to never doing worse than without the cost)."""
    lengths = packing.synthetic("lognormal:n=512,median=312,sigma=1.0,max=2048,seed=0")
    cost = "quadratic:a=20,b=31.4"
    per_micro = packing.sequence_cost(312, cost)  # a microbatch costs what a median sample does
    base = packing.plan(lengths, 8, 4, "lb-mini", 2048, cost=cost)
    dear = packing.plan(lengths, 8, 4, "lb-mini", 2048, cost=cost, microbatch_cost=per_micro)
    again = packing.plan(lengths, 8, 4, "lb-mini", 2048, cost=cost, microbatch_cost=per_micro, minibatch_cost=1.0)
    assert again.minibatches == dear.minibatches  # the minibatch's cost changes no plan
    timed = packing.plan(lengths, 8, 4, "lb-micro", 2048, cost=cost, microbatch_cost=per_micro)
    # Both plans' ODC time with the fixed cost, the way the packer predicts it.
    def odc_time(p):
        return sum(max(p_cost + per_micro * len(r) for p_cost, r in zip(costs, m, strict=True))
                   for costs, m in zip(p.costs, p.minibatches, strict=True))
    assert odc_time(dear) == pytest.approx(dear.time_odc)
    assert odc_time(dear) < odc_time(base)
    assert sum(len(r) for m in dear.minibatches for r in m) < sum(len(r) for m in base.minibatches for r in m)
    assert timed.time_collective >= dear.time_odc


def test_fit_cost_times_a_torch_module():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    fit = packing.fit_cost(model, [16, 64, 256], repeats=1)
    assert fit.a >= 0 and fit.b >= 0 and fit.a + fit.b > 0
    assert [p[0] for p in fit.points] == [16, 64, 256] and all(p[1] > 0 for p in fit.points)
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind


@pytest.mark.parametrize(
    ("source", "lengths", "needle"),
    [
        ([(100, 0.1), (100, 0.2)], None, "2 distinct lengths"),
        ([(100, 0.1), (200, -1.0)], None, "index 1"),
        ([(0, 0.1), (200, 1.0)], None, "index 0"),
        ([(100, "x")], None, "pairs"),
        (lambda s: None, None, "lengths"),
        ([], None, "no timings"),
    ],
)
def test_fit_cost_refuses_bad_input(source, lengths, needle):
    with pytest.raises(odc.PackingError, match=needle):
        packing.fit_cost(source, lengths)
