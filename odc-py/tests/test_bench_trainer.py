"""odc-bench trainer: TRL's SFTTrainer four ways at a tiny size on 2 ranks (seconds), the JSON's shape, the arms'
agreement at step 0, and its errors."""

from __future__ import annotations

import importlib.util
import json
import shlex

import pytest
from _dist import need_hf

from odc.bench import EXAMPLES, _build_parser, main, trainer

pytestmark = pytest.mark.hf

need_hf()

# A literal, as test_harness.py reads it; the bench's ranks import the same.
RANK_PRELOAD = ["torch.distributed.fsdp", "transformers.trainer", "accelerate", "datasets", "trl",
                "trl.trainer.sft_trainer", "transformers.models.qwen2.modeling_qwen2"]
assert RANK_PRELOAD == trainer.RANK_PRELOAD, trainer.RANK_PRELOAD


@pytest.fixture(autouse=True, scope="module")
def _tests_fork_server():
    """The bench's ranks start from the process's one fork server: started here with the tests' preload (this
    module's RANK_PRELOAD among it), so that a test module after this one finds what its ranks import."""
    import _dist

    _dist._context()

TINY = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
        "--vocab", "64", "--max-length", "128", "--synthetic", "lognormal:n=400,median=20,sigma=1.0,max=128,seed=0",
        "--progress", "off", "--timeout", "120"]


def test_trainer_runs_four_arms_on_the_same_samples(tmp_path, capsys):
    out, png = tmp_path / "trainer.json", tmp_path / "trainer.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") is not None else []  # not on every leg
    code = main(["trainer", *TINY, "--sweep", "minibatch-size=3", "--steps", "3", "--repeats", "2",
                 "--json", str(out), *plot])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    assert doc["bench"] == "trainer" and doc["arms"] == ["trl-default", "odc+lb-mini", "odc-accum", "fsdp2-accum"]
    assert doc["baseline"] == "trl-default" and doc["world"] == 2
    prov = doc["provenance"]
    assert prov["command"].startswith("odc-bench trainer") and "load" in prov and "commit" in prov
    assert [p["minibatch_size"] for p in doc["points"]] == [3]
    # Interleaved: each repeat runs every arm, in an order rotated by the repeat.
    for m in (3,):
        order = [[r["arm"] for r in doc["runs"] if r["minibatch_size"] == m and r["repeat"] == k] for k in (0, 1)]
        assert order == [trainer.rotated(0), trainer.rotated(1)], order
        assert order[0] != order[1]
    for p in doc["points"]:
        m = p["minibatch_size"]
        for arm in doc["arms"]:
            a = p["arms"][arm]
            assert a["step_s"] > 0 and len(a["step_s_runs"]) == 2
            assert a["rss_peak"] > 0 and len(a["losses"]) == 3
            assert len(a["microbatches"]) == 2 and all(len(c) == 3 for c in a["microbatches"])
        # TRL's default runs M packed rows on every rank; fsdp2-accum at least one per rank.
        trl = p["arms"]["trl-default"]["microbatches"]
        assert all(c == [m] * 3 for c in trl), trl
        assert all(min(c) >= 1 for c in p["arms"]["fsdp2-accum"]["microbatches"])
        assert p["arms"]["odc+lb-mini"]["odc_shm"] > 0 and p["arms"]["trl-default"]["odc_shm"] is None
        assert p["arms"]["odc-accum"]["odc_shm"] > 0 and p["arms"]["fsdp2-accum"]["odc_shm"] is None
        # odc-accum runs ODC's plan: the same counts as odc+lb-mini, a rank with none included.
        assert p["arms"]["odc-accum"]["microbatches"] == p["arms"]["odc+lb-mini"]["microbatches"]
        # Same rows, same weights: the arms' losses at step 0 agree (up to the order of float sums).
        zero = [p["arms"][arm]["losses"][0] for arm in doc["arms"]]
        assert max(zero) - min(zero) <= 1e-5 * abs(zero[0]), zero
        assert p["same_samples"] and p["step0_loss_spread"] <= trainer.SAME_SAMPLES_TOLERANCE
        # And after it: the arms' updates are the same (ODC's and FSDP2's accumulation reduce what TRL's does).
        for arm in ("odc+lb-mini", "fsdp2-accum"):
            assert p["arms"][arm]["losses"] == pytest.approx(p["arms"]["trl-default"]["losses"], rel=1e-4), arm
        for arm in ("odc+lb-mini", "fsdp2-accum"):
            ratio = p["ratios"][arm]
            assert ratio["speedup"] == pytest.approx(p["arms"]["trl-default"]["step_s"] / p["arms"][arm]["step_s"])
            assert ratio["memory"] == pytest.approx(p["arms"][arm]["rss_peak"] / p["arms"]["trl-default"]["rss_peak"])
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup vs trl-default" in text and "fsdp2-accum" in text


def test_help_ends_with_examples_that_parse(capsys):
    assert main(["trainer", "--help"]) == 0
    text = capsys.readouterr().out
    flags, sep, examples = text.partition("\nexamples:\n")
    assert sep and "--sweep" in flags, text
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("odc-bench ")]
    assert len(lines) >= 2 and all(line.startswith("odc-bench trainer") for line in lines), examples
    for line in lines:
        _build_parser().parse_args(shlex.split(line)[1:])
    assert examples.strip() == EXAMPLES["trainer"].partition("examples:\n")[2].strip()


@pytest.mark.parametrize(("argv", "why"), [
    (["--world", "1"], "--world 1"),
    (["--steps", "1"], "--steps 1"),
    (["--sweep", "max-length=1,2"], "minibatch-size only"),
    (["--sweep", "minibatch-size=2,x"], "minibatch-size=2,x"),
    (["--max-length", "32"], "longer than --max-length 32"),
    (["--synthetic", "lognormal:n=8,median=20,max=128", "--steps", "4"], "more samples, or fewer steps"),
    (["--json", "/nonexistent/dir/out.json"], "/nonexistent/dir"),
])
def test_trainer_refuses_bad_arguments(argv, why, capsys):
    assert main(["trainer", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert "odc-bench: error:" in err and why in err, err
