"""odc-bench: both subcommands at tiny sizes on 2 local ranks, exact checks, and its usage errors."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time

import pytest
import torch

from odc.bench import EXAMPLES, _build_parser, main
from odc.bench.imbalance import CONFIGS, EmulatedCompute, _Model
from odc.bench.report import Progress, UsageError


def test_primitives_every_dtype_is_exact(tmp_path, capsys):
    out = tmp_path / "prim.json"
    code = main(["primitives", "-g", "2", "-b", "4K", "-e", "16K", "-n", "2", "-w", "1", "-d", "all",
                 "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out
    assert code == 0, text
    assert "#wrong" in text and "ratio" in text
    # The run's last word: where its results went.
    assert captured.err.splitlines()[-1] == f"odc-bench: wrote {out} (JSON)", captured.err
    doc = json.loads(out.read_text())
    # What made it, for the docs' benchmark pages: the command, the commit (or None outside a checkout), the date,
    # and the load average sampled from the run's start (odc-bench's main) to the JSON's writing, with the cores.
    assert set(doc["provenance"]) == {"command", "commit", "version", "date", "load"}
    load = doc["provenance"]["load"]
    assert load["cpus"] > 0 and load["period_s"] > 0 and len(load["samples"]) >= 2, load
    assert "primitives -g 2 -b 4K" in doc["provenance"]["command"] and doc["provenance"]["date"].endswith("+00:00")
    rows = doc["rows"]
    # 3 dtypes x 2 sizes (4K, 16K) x 2 ops
    assert len(rows) == 12
    assert {r["type"] for r in rows} == {"f32", "bf16", "f16"}
    for r in rows:
        for side in ("collective", "odc"):
            assert r[side]["wrong"] == 0, r
            assert r[side]["time_us"] > 0 and r[side]["busbw"] > 0
        assert math.isclose(r["odc"]["busbw"] / r["collective"]["busbw"], r["busbw_ratio"])
        # nccl-tests: busbw = algbw * (n-1)/n
        assert math.isclose(r["odc"]["busbw"], r["odc"]["algbw"] / 2)
        assert r["collective"]["name"].startswith("gloo")


def test_imbalance_runs_every_configuration_with_exact_sums(tmp_path, capsys):
    out = tmp_path / "imb.json"
    code = main(["imbalance", "--world", "2", "--minibatches", "2", "--minibatch-size", "2", "--layers", "2",
                 "--layer-bytes", "4K", "--compute-scale", "0.0001", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "EMULATED COMPUTE" in text
    doc = json.loads(out.read_text())
    assert doc["emulated_compute"] is True
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == [c[0] for c in CONFIGS]
    assert rows["collective+lb-micro"]["speedup_measured"] == 1.0
    assert rows["collective+lb-micro"]["speedup_predicted"] == 1.0
    for name, r in rows.items():
        assert r["speedup_measured"] > 0 and r["speedup_predicted"] > 0, r
        assert 0.0 <= r["bubble_predicted"] < 1.0
        assert r["minibatches"] == 2
        run = r["runs"][0]
        assert run["grad_wrong"] == 0 and run["gather_wrong"] == 0 and run["param_wrong"] == 0, (name, run)
        # Final parameters are init + minibatches * pattern on every shard.
        assert r["param_checksum"] == r["param_checksum_expected"], r
        assert r["wrong"] == 0
        # +comm: the configuration's plan run once without compute, its seconds added to the prediction's.
        assert r["comm_s"] > 0 and r["predicted_time_with_comm_s"] > r["comm_s"], r
        assert r["speedup_predicted_with_comm"] > 0 and not math.isnan(r["error_with_comm"]), r
    assert rows["collective+lb-micro"]["speedup_predicted_with_comm"] == 1.0
    assert "+comm" in text


def test_imbalance_compute_that_strays_from_the_model(tmp_path, capsys):
    # The plans and predictions keep the model's costs; the emulated compute runs noisy ones and a slow rank,
    # the same for every configuration, and every sum stays exact.
    out = tmp_path / "imb.json"
    code = main(["imbalance", "--world", "2", "--minibatches", "2", "--minibatch-size", "2", "--layers", "1",
                 "--layer-bytes", "4K", "--compute-scale", "0.0001", "--configs", "odc+lb-mini",
                 "--noise", "0.5", "--noise-seed", "3", "--straggler", "1:2", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "COMPUTE STRAYS FROM THE MODEL" in text and "rank 1 computes 2x slower" in text
    doc = json.loads(out.read_text())
    assert doc["args"]["noise"] == 0.5 and doc["args"]["straggler"] == [1, 2.0]
    assert all(r["wrong"] == 0 and r["param_checksum"] == r["param_checksum_expected"] for r in doc["rows"])


def test_stray_costs_are_seeded_and_the_predictions_keep_the_model():
    from odc.bench import imbalance

    costs = [1.0, 2.0, 4.0] * 400
    assert imbalance.true_costs(costs, 0.0, 1) == costs
    a, b = imbalance.true_costs(costs, 0.3, 1), imbalance.true_costs(costs, 0.3, 1)
    assert a == b and a != imbalance.true_costs(costs, 0.3, 2)
    ratios = [x / c for x, c in zip(a, costs, strict=True)]
    assert abs(sum(ratios) / len(ratios) - 1) < 0.05 and max(ratios) > 1.3 and min(ratios) < 0.75
    lengths = [1000 * (i % 7 + 1) for i in range(32)]

    def point(**kw):
        settings = imbalance.Settings(layers=1, layer_bytes=4096, cost="quadratic", minibatches=2, repeats=1,
                                      seed=None, configs=imbalance.CONFIGS, **kw)
        return imbalance.build_point(lengths, world=2, minibatch_size=4, max_tokens=16000, settings=settings,
                                     compute_scale=0.001, run_seconds=None)

    exact, stray = point(), point(noise=0.3, straggler=(1, 2.0))
    for name, cfg in exact["configs"].items():
        other = stray["configs"][name]
        assert other["bubble_pred"] == cfg["bubble_pred"] and other["speedup_pred"] == cfg["speedup_pred"]
        # Rank 1's microbatches cost twice their noisy model cost: more work than rank 0's share of the noise.
        assert other["per_rank"][1] != cfg["per_rank"][1] and other["units"] != cfg["units"]
    fast = point(straggler=(1, 2.0))["configs"]["odc+lb-mini"]["per_rank"]
    base = exact["configs"]["odc+lb-mini"]["per_rank"]
    assert fast[0] == base[0]
    assert all(f[0] == 2 * c[0] for fm, cm in zip(fast[1], base[1], strict=True)
               for f, c in zip(fm, cm, strict=True))


def test_imbalance_with_stealing_steals_from_a_straggler_and_stays_exact(tmp_path, capsys):
    # Rank 1 computes 4x slower than the plan thinks: with stealing the other ranks take its unstarted
    # microbatches (through Engine.claim_own / steal), every gradient sum and parameter stays exact.
    out = tmp_path / "imb.json"
    code = main(["imbalance", "--world", "3", "--minibatches", "2", "--minibatch-size", "8", "--layers", "1",
                 "--layer-bytes", "4K", "--compute-scale", "0.002", "--configs", "odc+lb-mini,odc+lb-mini+steal",
                 "--straggler", "1:4", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    steal, static = rows["odc+lb-mini+steal"], rows["odc+lb-mini"]
    assert all(r["wrong"] == 0 and r["param_checksum"] == r["param_checksum_expected"] for r in rows.values())
    assert steal["stolen_per_minibatch"] > 0 and static["stolen_per_minibatch"] == 0, (steal, static)
    assert steal["max_microbatches"] >= 2, steal
    assert 0 <= steal["steal_bound"] < 1 and static["steal_bound"] is None


def test_steal_bound_simulates_the_policy():
    from odc.bench.imbalance import steal_bound

    # One minibatch: rank 0 holds microbatches of cost 3 and 1, rank 1 one of cost 1. Rank 0 runs 3 (0..3);
    # rank 1 runs its 1 (0..1), steals rank 0's 1 (1..2), then idles until 3: bubble 1 - 5 / (2 * 3).
    assert steal_bound([[[(3.0, 1), (1.0, 1)]], [[(1.0, 1)]]], {}) == pytest.approx(1 - 5 / 6)
    # Rank 1 twice as slow: it runs its 1 in 0..2, steals rank 0's 1 at 2 (rank 0 is busy until 3) and runs it
    # at its speed, 2..4: busy 3 + 2 + 2 over 2 ranks x 4. (Greedy, not optimal: the price of not knowing speeds.)
    assert steal_bound([[[(3.0, 1), (1.0, 1)]], [[(1.0, 1)]]], {1: 2.0}) == pytest.approx(1 - 7 / 8)
    # Even work on both ranks: no bubble.
    assert steal_bound([[[(2.0, 1)]], [[(2.0, 1)]]], {}) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("sweep", "labels", "field", "values"),
    [
        # max-length redraws the lengths with that max and scales the token budget with it (ratio kept).
        ("max-length=32768,65536", [32768, 65536], "max_tokens", [32768, 65536]),
        ("packing-ratio=1,2", [1.0, 2.0], "max_tokens", [65536, 131072]),
        ("world=2,3", [2, 3], "world", [2, 3]),
    ],
)
def test_imbalance_sweep_gives_one_table_and_one_plot(sweep, labels, field, values, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "imb.json", tmp_path / "imb.png"
    code = main(["imbalance", "--world", "2", "--minibatches", "1", "--minibatch-size", "2", "--layers", "1",
                 "--layer-bytes", "4K", "--compute-scale", "0.00001", "--configs", "odc+lb-mini", "--sweep", sweep,
                 "--json", str(out), "--plot", str(png)])
    captured = capsys.readouterr()
    text = captured.out
    assert code == 0, text
    assert captured.err.splitlines()[-1] == f"odc-bench: wrote {out} (JSON) and {png} (plot)", captured.err
    name = sweep.partition("=")[0]
    headers = [line for line in text.splitlines() if line.startswith("#") and "config" in line]
    assert len(headers) == 1 and headers[0].split()[1] == name, text
    assert text.count("EMULATED COMPUTE") == 1, text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["label"], r["config"]) for r in rows] == [(v, c) for v in labels
                                                         for c in ("collective+lb-micro", "odc+lb-mini")]
    assert [r[field] for r in rows[::2]] == values
    assert all(r["wrong"] == 0 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stealing_sweep_plots_bubbles_beside_the_steal_bound(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from odc.bench import imbalance

    out, png = tmp_path / "steal.json", tmp_path / "steal.png"
    code = main(["imbalance", "--minibatches", "1", "--minibatch-size", "4", "--layers", "1", "--layer-bytes", "4K",
                 "--compute-scale", "0.00001", "--configs", "odc+lb-mini+steal", "--sweep", "world=2,3",
                 "--straggler", "1:2", "--json", str(out), "--plot", str(png)])
    assert code == 0, capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Drawn again from the JSON: two panels, the speedups and the bubbles beside the policy's bound.
    drawn = []
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append([(ax.get_ylabel(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes])
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    imbalance.plot(json.loads(out.read_text())["rows"], str(tmp_path / "again.png"), "t", "world")
    (speedups, speed_lines), (bubbles, bubble_lines) = drawn[0]
    assert speedups == "speedup vs collective+lb-micro" and bubbles == "bubble (%)", drawn
    assert "odc+lb-mini+steal: the policy's bound (simulated)" in bubble_lines, bubble_lines
    assert "odc+lb-mini+steal measured" in speed_lines and "odc+lb-mini+steal measured" in bubble_lines


@pytest.mark.parametrize("command", ["odc-bench", "primitives", "imbalance", "train", "memory"])
def test_help_ends_with_examples_that_parse(command, capsys):
    assert main(["--help"] if command == "odc-bench" else [command, "--help"]) == 0
    text = capsys.readouterr().out
    flags, sep, examples = text.partition("\nexamples:\n")
    assert sep and "-h, --help" in flags, text
    prog = command if command == "odc-bench" else f"odc-bench {command}"
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("odc-bench ")]
    assert len(lines) >= 2 and all(line.startswith(prog) for line in lines), examples
    # Each example is a command line this odc-bench takes (an example that no longer parses is a wrong one).
    for line in lines:
        _build_parser().parse_args(shlex.split(line)[1:])
    assert examples.strip() == EXAMPLES[command].partition("examples:\n")[2].strip()


def test_progress_bar_is_tqdms_and_counts_to_its_total(capsys):
    bar = Progress(2, "primitives 2 ranks", enabled=True)
    bar.step("all_gather 4096")
    bar.step("reduce_scatter 4096")
    bar.step("one too many")
    assert bar.done == 2 and bar._bar.n == 2
    bar.close()
    err = capsys.readouterr().err
    assert "primitives 2 ranks" in err and "0/2" in err, err


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    with pytest.raises(UsageError, match=r"--progress on needs tqdm.*fsdp-odc\[bench\]"):
        Progress(3, "imbalance 2 ranks", enabled=True)
    quiet = Progress(3, "imbalance 2 ranks", enabled=False)
    quiet.step("x")
    assert quiet.done == 1
    assert capsys.readouterr().err == ""


class _Ctx:
    rank, world = 1, 2


def test_gradient_check_catches_a_wrong_sum():
    model = _Model(_Ctx(), layers=2, numel=1000, shard_len=512)
    right = [p * 6 for p in model.pattern_shard]
    assert model.step(right, 6) == 0
    assert model.final_wrong(1) == 0
    # This rank's shard only; the benchmark sums shards over ranks against init_sum + j * pattern_sum.
    shards = zip(model.init_shard, model.pattern_shard, strict=True)
    assert model.checksum() == sum(float((i + p).sum()) for i, p in shards)
    wrong = [g.clone() for g in right]
    wrong[1][3] += 1.0  # one lost / duplicated contribution
    assert model.step(wrong, 6) == 1
    # Padding past numel (rank 1 holds elements 512..1023 of 1000) stays zero.
    assert torch.count_nonzero(model.params[0][1000 - 512 :]) == 0


def test_emulated_compute_carries_overshoot():
    c = EmulatedCompute()
    t0 = time.perf_counter()
    for _ in range(20):
        c.run(0.002)
    elapsed = time.perf_counter() - t0
    assert c.requested == pytest.approx(0.04)
    # Overshoot is carried into later sleeps; only the last one's is left.
    assert 0.04 <= elapsed < 0.04 + 0.05


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["nonsense"], "nonsense"),
        ([], "missing subcommand"),
        (["primitives", "-g", "1"], "-g 1"),
        (["primitives", "-g", "2,x"], "-g"),
        (["primitives", "-b", "64M", "-e", "64K"], "-b 67108864 -e 65536"),
        (["primitives", "-b", "12Q"], "12Q"),
        (["primitives", "-n", "0"], "-n '0'"),
        (["primitives", "-d", "int8"], "int8"),
        (["primitives", "--backend", "mpi"], "mpi"),
        (["primitives", "--backend", "gloo", "--transport", "nvshmem"], "--transport nvshmem moves CUDA tensors"),
        (["imbalance", "--cost", "cubic"], "cubic"),
        (["imbalance", "--configs", "odc+lb-maxi"], "odc+lb-maxi"),
        (["imbalance", "--lengths", "/nonexistent/lengths.txt"], "/nonexistent/lengths.txt"),
        (["imbalance", "--layers", "0"], "--layers '0'"),
        (["imbalance", "--compute-scale", "-1"], "--compute-scale '-1'"),
        (["imbalance", "--world", "1"], "--world 1"),
        (["imbalance", "--sweep", "layers=1,2"], "layers"),
        (["imbalance", "--sweep", "minibatch-size=2,0"], "minibatch-size=0"),
        (["imbalance", "--synthetic", "uniform:n=3"], "uniform"),
        (["imbalance", "--max-tokens", "100"], "planning failed"),
        (["imbalance", "--json", "/nonexistent/dir/out.json"], "/nonexistent/dir"),
        (["imbalance", "--noise", "-0.1"], "--noise '-0.1'"),
        (["imbalance", "--noise", "x"], "--noise 'x'"),
        (["imbalance", "--straggler", "1"], "--straggler '1'"),
        (["imbalance", "--straggler", "0:0"], "--straggler '0:0'"),
        (["imbalance", "--world", "2", "--straggler", "5:2"], "no rank 5 among 2"),
        (["train", "--world", "64"], "--world 64"),
        (["train", "--world", "1"], "--world 1"),
        (["train", "--configs", "odc+lb-maxi"], "odc+lb-maxi"),
        (["train", "--sweep", "max-length=1,2"], "minibatch-size only"),
        (["train", "--sweep", "minibatch-size=2,x"], "minibatch-size=2,x"),
        (["train", "--minibatches", "1"], "--minibatches 1"),
        (["train", "--max-tokens", "100"], "planning failed"),
        (["train", "--synthetic", "lognormal:n=8", "--minibatches", "4"], "the input has 8"),
        (["train", "--json", "/nonexistent/dir/out.json"], "/nonexistent/dir"),
        (["memory", "--world", "4", "--per-node", "4"], "two emulated nodes"),
        (["memory", "--world", "1", "--sharding", "full"], "--world 1"),
        (["memory", "--formula", "x7"], "a parameter count like 7B"),
        (["memory", "--formula", "0"], "at least 1"),
        (["memory", "--formula", "1M", "--world", "6", "--per-node", "4"], "the world must be whole nodes"),
        (["memory", "--formula", "1M", "--world", "8192", "--per-node", "8192"], "ODC_LANDING_MB to at least 1024"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("odc-bench: error:") and "\n" not in err, err
    assert named in err, err


def test_bad_lengths_file(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n-3\n")
    assert main(["imbalance", "--lengths", str(f)]) == 2
    assert "-3" in capsys.readouterr().err
