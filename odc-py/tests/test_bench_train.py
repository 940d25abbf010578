"""odc-bench train: real FSDP2 training at tiny sizes on 2 ranks, every configuration, its checks and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from odc.bench import baselines, main, memory, train
from odc.bench.train_report import PARAM_TOLERANCE

pytest.importorskip("transformers")

TINY = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
        "--vocab", "64", "--synthetic", "lognormal:n=256,median=24,sigma=1.0,max=64,seed=0", "--max-tokens", "64",
        "--fit-repeats", "1", "--progress", "off", "--timeout", "120"]


# The configurations with ODC and their collective twins (the baselines without ODC: the test below).
WITH_ODC = [n for n in train.DEFAULT_CONFIGS if n not in {c[0] for c in baselines.CONFIGS}]


def test_train_runs_every_configuration_and_matches_the_collectives(tmp_path, capsys):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    code = main(["train", *TINY, "--sweep", "minibatch-size=2,4", "--minibatches", "2", "--repeats", "2",
                 "--configs", ",".join(WITH_ODC), "--json", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "REAL COMPUTE" in text and "gloo collectives (TCP loopback)" in text
    doc = json.loads(out.read_text())
    assert doc["emulated_compute"] is False
    # The cost model was fitted in the run, from every rank's single-sample timings.
    fit = doc["fit"]
    assert fit["cost"].startswith("quadratic:a=") and fit["a"] >= 0 and fit["b"] >= 0 and fit["a"] + fit["b"] > 0
    assert len(doc["fit_timings"]) == 2 * len(doc["fit_lengths"])
    # The fixed costs per microbatch and per minibatch were measured apart, for both modes.
    assert set(doc["overheads"]) == {"collective", "odc"}
    assert all(len(o["calibration_minibatch_s"]) == 9 for o in doc["overheads"].values())
    rows = doc["rows"]
    names = WITH_ODC  # every configuration with ODC but stealing (tested below)
    assert [(r["label"], r["config"]) for r in rows] == [(m, n) for m in (2, 4) for n in names]
    for r in rows:
        assert len(r["runs"]) == 2, r["config"]
        assert r["speedup_measured"] > 0 and r["speedup_predicted"] > 0
        assert r["speedup_min"] <= r["speedup_measured"] <= r["speedup_max"]
        assert math.isclose(r["error"], r["speedup_measured"] / r["speedup_predicted"] - 1)
        assert r["speedup_predicted_with_overheads"] > 0 and r["predicted_time_with_overheads_s"] > 0
        # Same samples per minibatch in every configuration: the same losses up to the order of float sums ...
        assert r["dloss"] < 1e-4, r
        # ... and final parameters equal to the collective run's with the same plan (odc+lb-mini: the baseline's).
        assert r["params_ok"] and r["dparam"] <= PARAM_TOLERANCE, r
        assert r["same_plan"] == {"odc+lb-mini": "collective+lb-micro"}.get(r["config"],
                                                                           "collective+" + r["strategy"])
        counts = r["microbatches"]
        if r["strategy"] == "lb-micro" or r["mode"] == "collective":
            assert all(len(set(m)) == 1 for m in counts), counts  # collectives need equal counts per rank
    base = [r for r in rows if r["config"] == "collective+lb-micro"]
    assert all(r["speedup_predicted"] == 1.0 and r["speedup_measured"] == 1.0 for r in base)
    assert all(r["speedup_predicted_with_overheads"] == 1.0 for r in base)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_runs_what_users_pick_instead_on_the_same_samples(tmp_path, capsys):
    out = tmp_path / "baselines.json"
    code = main(["train", *TINY, "--minibatch-size", "4", "--minibatches", "3", "--repeats", "1", "--configs",
                 "odc+lb-mini,verl-maxcount,dummy-pad,fsdp2-accum", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "verl-maxcount = verl's split to the largest count" in text and "params+grads held" in text
    doc = json.loads(out.read_text())
    # Each way of running measured its own fixed costs: the collectives' (also dummy-pad's), ODC's, FSDP2's
    # accumulation's.
    assert set(doc["overheads"]) == {"collective", "odc", "accum"}
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == ["collective+lb-micro", "odc+lb-mini", "verl-maxcount", "dummy-pad", "fsdp2-accum"]
    for name, r in rows.items():
        # The same samples per minibatch: losses and final parameters of the baseline up to float reordering.
        assert r["dloss"] < 1e-4 and r["params_ok"] and (name == train.BASELINE or r["dparam_baseline"] < 1e-4), r
        # The same sums: the first minibatch's gradients agree to float reordering (a lost or doubled microbatch
        # moves them by a percent or more).
        assert r["dgrad_baseline"] is not None and r["dgrad_baseline"] < 1e-5, r["dgrad_baseline"]
        assert "within_target" in r and r["memory"]["held"] > 0, r
        assert r["memory"]["rss_peak"] is None or r["memory"]["rss_peak"] > 100 << 20, r["memory"]
        assert r["speedup_predicted"] > 0 and r["speedup_predicted_with_overheads"] > 0
    verl, pad, accum = rows["verl-maxcount"], rows["dummy-pad"], rows["fsdp2-accum"]
    assert verl["mode"] == "collective" and verl["plan_source"] in ("odc.bench.baselines", f"verl {_verl_version()}")
    # In step: every rank runs the largest count (verl re-splits to it, dummy-pad pads to it).
    assert all(len(set(m)) == 1 for m in verl["microbatches"] + pad["microbatches"]), (verl, pad)
    # dummy-pad ran its padding: as many microbatches per rank as the largest count, the extra ones without samples.
    run = pad["runs"][0]
    for rank in range(2):
        assert len(run["micro"][rank]) == sum(m[rank] for m in pad["microbatches"])
    for k in range(3):  # the microbatches with samples hold each of the minibatch's samples once
        ran = sorted(i for rank in run["micro"] for kk, mb, _ in rank if kk == k for i in mb)
        assert ran == list(range(k * 8, (k + 1) * 8)), (k, ran)
    # FSDP2's accumulation holds the unsharded parameters and gradients between microbatches: with 2 ranks about
    # 3x the sharded parameters and gradients the others hold; ODC's engine adds shared memory of its own.
    assert accum["memory"]["held"] > 2 * rows[train.BASELINE]["memory"]["held"], (accum, rows[train.BASELINE])
    assert rows["odc+lb-mini"]["memory"]["odc_shm"] > 0 and verl["memory"]["odc_shm"] is None
    pairs = {p["other"]: p for p in doc["pairs"]}
    assert set(pairs) == {"verl-maxcount", "dummy-pad", "fsdp2-accum", "collective+lb-micro"}, pairs
    for p in pairs.values():
        assert p["measured"] > 0 and p["min"] <= p["measured"] <= p["max"] and p["with_fixed"] > 0, p


def _verl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return "-"


def test_train_steals_from_a_straggler_and_matches_odc_lb_mini(tmp_path, capsys):
    out = tmp_path / "steal.json"
    size, world, minibatches = 8, 2, 3
    code = main(["train", *TINY, "--configs", "odc+lb-mini,odc+lb-mini+steal", "--minibatch-size", str(size),
                 "--minibatches", str(minibatches), "--repeats", "1", "--straggler", "1:4", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "straggler: rank 1 computes 4x slower" in text and "stolen/mb" in text
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["collective+lb-micro", "odc+lb-mini", "odc+lb-mini+steal"]
    steal, plain = rows["odc+lb-mini+steal"], rows["odc+lb-mini"]
    assert steal["strategy"] == plain["strategy"] == "lb-mini" and steal["steal"] and not plain["steal"]
    assert steal["microbatches"] == plain["microbatches"]  # the same plan
    run, plain_run = steal["runs"][0], plain["runs"][0]
    # Every sample of every minibatch ran exactly once, whichever rank ran it.
    for k in range(minibatches):
        ran = sorted(i for rank in run["micro"] for kk, mb, _ in rank if kk == k for i in mb)
        assert ran == list(range(k * size * world, (k + 1) * size * world)), (k, ran)
    # Only the straggler slept; it ran fewer microbatches than its own lists hold: the fast rank took the rest.
    assert run["slept_s"][1] > 0 and run["slept_s"][0] == 0, run["slept_s"]
    assert len(run["micro"][1]) < len(plain_run["micro"][1]) == sum(m[1] for m in plain["microbatches"])
    assert len(run["micro"][0]) > len(plain_run["micro"][0])
    assert sum(run["stolen"]) >= len(run["micro"][0]) - len(plain_run["micro"][0]) > 0, run["stolen"]
    assert steal["stolen_per_minibatch"] > 0 and plain["stolen_per_minibatch"] is None
    assert 0 < steal["steal_bound"] < 1 and plain["steal_bound"] is None
    # Stolen microbatches contribute the gradient their owner's would: the parameters of odc+lb-mini (and the
    # baseline's) to float tolerance, the same losses.
    assert steal["same_plan"] == "odc+lb-mini" and steal["params_ok"], steal["dparam"]
    assert steal["dparam"] <= PARAM_TOLERANCE and steal["dparam_baseline"] <= PARAM_TOLERANCE, steal
    assert steal["dloss"] < 1e-4, steal["dloss"]


def test_deterministic_stealing_trains_what_odc_lb_mini_trains(tmp_path, capsys):
    out = tmp_path / "det.json"
    code = main(["train", *TINY, "--configs", "odc+lb-mini,odc+lb-mini+steal+det", "--minibatch-size", "8",
                 "--minibatches", "3", "--repeats", "1", "--straggler", "1:4", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    det = rows["odc+lb-mini+steal+det"]
    assert det["steal"] and det["strategy"] == "lb-mini" and det["stolen_per_minibatch"] > 0, det
    # Checked against the same plan without stealing (odc+lb-mini+steal does not run here).
    assert det["same_plan"] == "odc+lb-mini" and det["params_ok"], det["dparam"]
    assert det["dparam"] <= PARAM_TOLERANCE and det["dloss"] < 1e-4, det


def test_stealing_is_checked_against_the_same_plan_without_stealing():
    every = [c[0] for c in train.CONFIGS]
    assert train.same_plan("odc+lb-mini+det", every) == "odc+lb-mini"
    assert train.same_plan("odc+lb-mini+steal+det", every) == "odc+lb-mini+steal"
    assert train.same_plan("odc+lb-mini+steal+det", [train.BASELINE, "odc+lb-mini", "odc+lb-mini+steal+det"]) \
        == "odc+lb-mini"
    assert train.steals("odc+lb-mini+steal+det") and not train.steals("odc+lb-mini+det")
    assert "odc+lb-mini+det" not in train.DEFAULT_CONFIGS and "collective+lb-micro+det" not in every
    assert train.same_plan("odc+lb-mini+steal", every) == "odc+lb-mini"
    # Without odc+lb-mini, stealing falls back to what odc+lb-mini is checked against; so does any configuration
    # whose reference does not run.
    assert train.same_plan("odc+lb-mini+steal", [train.BASELINE, "odc+lb-mini+steal"]) == train.BASELINE
    assert train.same_plan("odc+local-sort", every) == "collective+local-sort"
    assert train.same_plan("odc+local-sort", [train.BASELINE, "odc+local-sort"]) == train.BASELINE
    assert train.same_plan(train.BASELINE, [train.BASELINE]) == train.BASELINE


def test_compressed_configurations_are_lb_mini_on_odc_checked_against_it(capsys):
    every = [c[0] for c in train.CONFIGS]
    for name, setting in train.COMPRESSED.items():
        assert (name, "odc", "lb-mini") in train.CONFIGS and name not in train.DEFAULT_CONFIGS
        assert setting["scope"] == "all" and setting["push"] == "int8"
        assert train.same_plan(name, every) == "odc+lb-mini"
        assert train.same_plan(name, [train.BASELINE, name]) == train.BASELINE
    assert train.COMPRESSED["odc+lb-mini+int8-nofb"]["feedback"] is False
    assert train.COMPRESSED["odc+lb-mini+fp8g-int8"]["gather"] == "fp8"
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in train.COMPRESSED)


@pytest.mark.parametrize(("value", "why"), [("1", "RANK:FACTOR"), ("x:2", "RANK:FACTOR"), ("1:0", "RANK:FACTOR"),
                                            ("1:0.5", "cannot be sped up"), ("2:1.5", "no rank 2 among 2")])
def test_train_refuses_a_bad_straggler(value, why, capsys):
    assert main(["train", *TINY, "--configs", "odc+lb-mini+steal", "--straggler", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("odc-bench: error:") and "--straggler" in err and why in err, err


def test_train_help_documents_the_straggler(capsys):
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--straggler RANK:FACTOR" in text and "FACTOR-1 times the microbatch's compute time" in text
    assert "odc+lb-mini+steal" in text


def test_train_curves_compare_odc_with_the_collectives(tmp_path, capsys):
    out = tmp_path / "curves.json"
    code = main(["train", "--curves", *TINY, "--minibatch-size", "4", "--minibatches", "5", "--lr", "3e-3",
                 "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    curves = json.loads(out.read_text())["curves"]
    assert list(curves["losses"]) == ["collective+lb-micro", "odc+lb-mini", "collective+local-sort", "odc+lb-mini+int8",
                                      "odc+lb-mini+int8-nofb", "odc+lb-mini+fp8g-int8"]
    assert all(len(v) == 5 for v in curves["losses"].values())
    assert curves["ok"] and curves["max_abs_loss_diff"]["odc+lb-mini"] <= curves["bound"]
    assert "within" in text
    # The compressed runs (int8 pushes, every push: scope "all") measured against the uncompressed ODC run: the
    # first minibatch's loss is before any step, so equal; later ones differ by what int8 rounds, a little.
    for name, feedback in (("odc+lb-mini+int8", True), ("odc+lb-mini+int8-nofb", False)):
        c = curves["compressed"][name]
        assert c["compress"]["push"] == "int8" and c["compress"]["scope"] == "all"
        assert c["compress"].get("feedback", True) is feedback
        losses, plain = curves["losses"][name], curves["losses"]["odc+lb-mini"]
        assert losses[0] == plain[0]
        assert 0 < c["max_vs_odc"] < 1e-2 and c["mean_vs_odc"] <= c["max_vs_odc"]
        assert c["max_vs_odc"] == max(abs(a - b) for a, b in zip(losses, plain, strict=True))
        assert c["within"] == (c["max_vs_odc"] <= 2 * curves["max_abs_loss_diff"]["collective+local-sort"])
        assert f"# {name} (compress=" in text
    # fp8 gathers round the weights the forward sees: the curve differs from the first minibatch on.
    c = curves["compressed"]["odc+lb-mini+fp8g-int8"]
    assert c["compress"] == {"gather": "fp8", "push": "int8", "scope": "all"}
    assert curves["losses"]["odc+lb-mini+fp8g-int8"][0] != curves["losses"]["odc+lb-mini"][0]
    assert 0 < c["max_vs_odc"] < 1e-1


def _train_steps(rows_per_step, lr=1e-3):
    """A tiny model trained in one process: each step's gradient summed over its packed rows."""
    model = train.build_model(train.ModelSpec(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for rows, tokens in rows_per_step:
        for row in rows:
            (train._loss(model, train.packed_row(row)) / tokens).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_the_parameter_tolerance_separates_reordered_sums_from_a_lost_gradient():
    samples = [train.markov_tokens(i, n, 64) for i, n in enumerate([40, 7, 23, 64, 12, 31, 50, 9])]
    steps = [samples[:4], samples[4:]]
    tokens = [sum(len(s) - 1 for s in step) for step in steps]
    one_row = _train_steps([([step], t) for step, t in zip(steps, tokens, strict=True)])
    packed_otherwise = _train_steps([([step[2:], step[:2]], t) for step, t in zip(steps, tokens, strict=True)])
    lost = _train_steps([([step[:3]], t) for step, t in zip(steps, tokens, strict=True)])
    reordered, _ = train._param_diff(packed_otherwise, one_row)
    dropped, _ = train._param_diff(lost, one_row)
    assert reordered < PARAM_TOLERANCE / 10, reordered
    assert dropped > PARAM_TOLERANCE * 5, dropped


def test_varlen_attention_keeps_samples_apart():
    """A packed row gives every sample the logits it gets alone (per-sample attention, positions restart)."""
    model = train.build_model(train.ModelSpec(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=64))
    a, b = train.markov_tokens(0, 9, 64), train.markov_tokens(1, 5, 64)

    def logits(samples):
        row = train.packed_row(samples)
        with torch.no_grad():
            return model(**{k: v for k, v in row.items() if k != "labels"}).logits[0]

    both = logits([a, b])
    torch.testing.assert_close(both[:9], logits([a])[0:9], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[9:], logits([b]), rtol=1e-5, atol=1e-5)


def test_memory_table_measures_every_kind(tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = main(["memory", "--world", "2", "--sharding", "full", "--steps", "1", "--micros", "1", "--length", "16",
                 "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
                 "--vocab", "64", "--markdown", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "| FSDP2 full (gloo) |" in text and "| ODC full |" in text
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    gloo, odc = rows["FSDP2 full (gloo)"]["max"], rows["ODC full"]["max"]
    model = train.build_model(train.ModelSpec(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=64))
    numel = sum(p.numel() for p in model.parameters())
    for m in (gloo, odc):
        # Half of every parameter per rank (padded to whole rows), AdamW's two f32 moments (+ a step count each).
        assert 4 * numel / 2 <= m["params"] <= 4 * numel / 2 * 1.05, (m, numel)
        assert m["grads"] == m["params"] and 2 * m["params"] <= m["optim"] <= 2 * m["params"] + 4096
    assert gloo["odc_shm"] is None
    # Landing slots alone are 2 * D * chunk = 8 MiB at the default 2 MiB chunk; shards and accumulators come on top.
    assert 8 << 20 < odc["odc_shm"] < (8 << 20) + 2 * odc["params"] + (1 << 20), odc
    # The formula of --formula against what the file system says: the segments hold the published shard and the
    # landing slots (the accumulators are private), plus signal words (a few KiB) and FSDP2's padding.
    doc = json.loads(out.read_text())
    assert doc["params"] == numel
    f = rows["ODC full"]["formula"]
    assert f["landing"] == 8 << 20 and f["published"] == 4 * numel / 2 and f["cross"] == 0, f
    assert 0 <= odc["odc_shm"] - f["odc_shm"] <= 64 * 1024 + 0.05 * f["published"], (odc, f)
    assert "by formula" in text


def test_memory_of_hybrid_zero_is_measured_against_its_formula(tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = main(["memory", "--world", "4", "--per-node", "2", "--sharding", "hybrid-zero", "--steps", "1",
                 "--micros", "1", "--length", "16", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads",
                 "1", "--intermediate", "64", "--vocab", "64", "--markdown", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    m, f, numel = row["max"], row["formula"], doc["params"]
    # FSDP2 shards over all 4 ranks: a quarter of every parameter (padded to whole rows), AdamW's moments on it.
    assert 4 * numel / 4 <= m["params"] <= 4 * numel / 4 * 1.1, (m, numel)
    assert 2 * m["params"] <= m["optim"] <= 2 * m["params"] + 4096, m
    # The engine keeps node shards (half the model) in /dev/shm: published copy and the accumulators the other
    # node reads, plus 2 * G * chunk of landing slots.
    assert f["published"] == 4 * numel / 2 and f["accum"] == 4 * numel / 2 and f["landing"] == 8 << 20, f
    assert 0 <= m["odc_shm"] - f["odc_shm"] <= 64 * 1024 + 0.05 * f["published"], (m, f)


def test_memory_formula_sizes_any_model():
    mib, gib = 1 << 20, 1 << 30
    rows = {r["label"]: r for r in memory.formula(32 * 10**9, 32, 8, gather_bytes=2)}
    full, hybrid = rows["ODC full"], rows["ODC hybrid"]
    zero = rows["ODC hybrid-zero"]
    # 32B parameters: a 1/32 shard is 1e9 parameters, a 1/8 shard 4e9.
    assert full["params"] == 4e9 and full["published"] == 2e9 and full["accum"] == 4e9 and full["optim"] == 8e9
    assert full["landing"] == 2 * 32 * 2 * mib and hybrid["landing"] == 2 * 8 * 2 * mib
    assert hybrid["params"] == 16e9 and hybrid["optim"] == 32e9 and hybrid["cross"] == 16e9
    # ZeRO++-style: FSDP2's parameters, gradients and optimizer state at full sharding's 1/D, ODC's node shard
    # (working copy, accumulator) at hybrid's 1/G, a 1/D piece for the cross-node sum, slots for the node's 8.
    assert (zero["params"], zero["grads"], zero["optim"]) == (full["params"], full["grads"], full["optim"])
    assert zero["published"] == hybrid["published"] and zero["accum"] == hybrid["accum"] and zero["cross"] == 4e9
    assert zero["landing"] == 2 * 8 * 2 * mib
    assert zero["odc_shm"] == zero["published"] + zero["accum"] + zero["landing"]
    assert rows["FSDP2 HSDP"]["total"] > zero["total"] > full["total"]
    assert rows["FSDP2 full"]["published"] is None and rows["FSDP2 full"]["total"] == 16e9
    # Deterministic accumulation: 16 bytes per accumulator element, in private memory (not in odc_shm).
    assert full["exact"] is None
    det = {r["label"]: r for r in memory.formula(32 * 10**9, 32, 8, gather_bytes=2, deterministic=True)}
    assert det["ODC full"]["exact"] == 16e9 and det["ODC hybrid"]["exact"] == 64e9
    assert det["ODC full"]["total"] == full["total"] + 16e9 and det["ODC full"]["odc_shm"] == full["odc_shm"]
    assert det["FSDP2 full"]["exact"] is None
    # The landing chunk follows odc-core's budget rule (its unit test: 128 KiB at D = 1024, an error at 4096).
    assert memory.landing_chunk(2 * mib, 8, 256 * mib) == 2 * mib
    assert memory.landing_chunk(2 * mib, 1024, 256 * mib) == 128 * 1024
    with pytest.raises(ValueError, match="ODC_LANDING_MB to at least 512"):
        memory.landing_chunk(2 * mib, 4096, 256 * mib)
    # The baselines: verl-maxcount and dummy-pad hold what FSDP2 holds; FSDP2's accumulation holds the unsharded
    # parameters (gather dtype) and gradients (parameter dtype) beside, for the whole minibatch.
    bf16 = {r["label"]: r for r in memory.formula(70 * 10**9, 64, 8, param_bytes=2, gather_bytes=2, layers=80)}
    fsdp, accum, odc_full = bf16["FSDP2 full"], bf16["fsdp2-accum"], bf16["ODC full"]
    assert bf16["verl-maxcount"]["total"] == bf16["dummy-pad"]["total"] == fsdp["total"]
    assert accum["unsharded"] == 4 * 70e9 and fsdp["unsharded"] == odc_full["unsharded"] == 6 * 70e9 / 80
    assert fsdp["total"] == (2 + 2 + 8) * 70e9 / 64 + 6 * 70e9 / 80
    assert accum["total"] > 80e9 > odc_full["total"] > fsdp["total"]  # where accumulation stops fitting a GPU
    assert rows["FSDP2 full"]["unsharded"] is None and rows["fsdp2-accum"]["unsharded"] == (2 + 4) * 32e9
    assert memory.parse_count("7B") == 7 * 10**9 and memory.parse_count("1.5M") == 1_500_000
    assert memory.parse_count("32e9") == 32 * 10**9 and gib == 2**30


def test_memory_formula_prints_every_mode(capsys):
    assert main(["memory", "--formula", "7B", "--world", "16", "--per-node", "8", "--gather-dtype", "bf16",
                 "--markdown"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert text.count("\n| ") == 8 and "| ODC hybrid-zero |" in text and "ODC landing slots" in text
    assert "| fsdp2-accum |" in text and "unsharded params + grads" in text
    assert captured.err.splitlines()[-1] == ("odc-bench: wrote no files (the results are printed above; --json FILE "
                                             "keeps them)"), captured.err
    assert main(["memory", "--formula", "7B", "--world", "16", "--per-node", "8", "--deterministic"]) == 0
    assert "ODC exact (deterministic)" in capsys.readouterr().out
