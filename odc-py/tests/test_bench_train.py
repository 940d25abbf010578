"""odc-bench train: real FSDP2 training at tiny sizes on 2 ranks, every configuration, its checks and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from odc.bench import main, memory, train
from odc.bench.train_report import PARAM_TOLERANCE

pytest.importorskip("transformers")

TINY = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
        "--vocab", "64", "--synthetic", "lognormal:n=256,median=24,sigma=1.0,max=64,seed=0", "--max-tokens", "64",
        "--fit-repeats", "1", "--progress", "off", "--timeout", "120"]


def test_train_runs_every_configuration_and_matches_the_collectives(tmp_path, capsys):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    code = main(["train", *TINY, "--sweep", "minibatch-size=2,4", "--minibatches", "2", "--repeats", "2",
                 "--json", str(out), "--plot", str(png)])
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
    names = [c[0] for c in train.CONFIGS]
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


def test_train_curves_compare_odc_with_the_collectives(tmp_path, capsys):
    out = tmp_path / "curves.json"
    code = main(["train", "--curves", *TINY, "--minibatch-size", "4", "--minibatches", "5", "--lr", "3e-3",
                 "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    curves = json.loads(out.read_text())["curves"]
    assert list(curves["losses"]) == ["collective+lb-micro", "odc+lb-mini", "collective+local-sort"]
    assert all(len(v) == 5 for v in curves["losses"].values())
    assert curves["ok"] and curves["max_abs_loss_diff"]["odc+lb-mini"] <= curves["bound"]
    assert "within" in text


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
    # The landing chunk follows odc-core's budget rule (its unit test: 128 KiB at D = 1024, an error at 4096).
    assert memory.landing_chunk(2 * mib, 8, 256 * mib) == 2 * mib
    assert memory.landing_chunk(2 * mib, 1024, 256 * mib) == 128 * 1024
    with pytest.raises(ValueError, match="ODC_LANDING_MB to at least 512"):
        memory.landing_chunk(2 * mib, 4096, 256 * mib)
    assert memory.parse_count("7B") == 7 * 10**9 and memory.parse_count("1.5M") == 1_500_000
    assert memory.parse_count("32e9") == 32 * 10**9 and gib == 2**30


def test_memory_formula_prints_every_mode(capsys):
    assert main(["memory", "--formula", "7B", "--world", "16", "--per-node", "8", "--gather-dtype", "bf16",
                 "--markdown"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n| ") == 5 and "| ODC hybrid-zero |" in text and "ODC landing slots" in text
