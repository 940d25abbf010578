"""odc.integrations.transformers against one process: Hugging Face's ``Trainer`` and TRL's ``SFTTrainer`` on CPU.

Each rank builds the trainer as a user's script does (tiny random Llama / Qwen2, FSDP2 through the training
arguments, gloo), adds ``odc.integrations.transformers.enable(trainer)`` and calls ``trainer.train()``: the plain
``Trainer`` with a user's padding collator, ``SFTTrainer`` with ``packing=True`` (``bfd``) and
``padding_free=True``, and ``SFTTrainer`` without packing, on 2 and 3 ranks. LB-Mini gives the ranks different
microbatch counts, and a rank none in some step. Every logged loss and grad norm and the final parameters are held
to a plain torch loop in one process over the same samples (``_hf_worker.reference``): the sum of each step's
token losses over its count of loss tokens, AdamW, the clip, the linear schedule. A run resumed from a
mid-run checkpoint is held to the uninterrupted run. Each refused setting names itself.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _dist import need_hf, run_ranks

pytestmark = [pytest.mark.torch_versions, pytest.mark.hf]

need_hf()

# Imported once by the fork server (conftest.py) instead of in every rank: the Trainer, TRL and datasets take
# several seconds of CPU each to import.
RANK_PRELOAD = ["transformers.trainer", "accelerate", "datasets", "trl", "trl.trainer.sft_trainer", "_hf_worker"]

STEPS = 4  # three steps of the first epoch (its last one short: a rank without a sample) and one of the second
LOSS_TOL = 1e-5
# On one host only "all" compresses anything: every push, every read of another rank's shard.
COMPRESS = {"gather": "fp8", "push": "int8", "scope": "all"}
COMPRESSED_TOL = 5e-2  # relative to the loss: fp8 gathers' rounding (docs/benchmarks/compression.md: 0.6 % at most)
RESUME_TOL = 1e-6


def _ok(out):
    for rank, (status, value) in out.items():
        assert status == "ok", (rank, status, value[3] if isinstance(value, tuple) and len(value) > 3 else value)
    return {rank: value for rank, (_, value) in out.items()}


def _suite(world, root, cases, refusals=False):
    import _hf_worker as W

    cases = [{**case, "out_dir": os.path.join(root, case["name"])} for case in cases]
    return _ok(run_ranks(W.suite_worker, world, timeout=900, cases=cases,
                         refusals=os.path.join(root, "refused") if refusals else None))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """2 ranks: the three kinds, the plain Trainer saving a checkpoint at step 2 and a run resumed from it, the
    refusals."""
    root = str(tmp_path_factory.mktemp("hf2"))
    checkpoint = os.path.join(root, "trainer", "checkpoint-2")
    cases = [{"name": "trainer", "kind": "trainer", "steps": STEPS, "save_steps": 2},
             {"name": "resumed", "kind": "trainer", "steps": STEPS, "resume": checkpoint},
             {"name": "sft-packed", "kind": "sft-packed", "steps": STEPS},
             {"name": "sft", "kind": "sft", "steps": STEPS},
             {"name": "sft-packed-accum", "kind": "sft-packed", "steps": STEPS, "accumulation": "fsdp2-accum"},
             {"name": "sft-packed-odc-accum", "kind": "sft-packed", "steps": STEPS, "accumulation": "odc-accum"},
             {"name": "sft-packed-compressed", "kind": "sft-packed", "steps": STEPS, "compress": COMPRESS},
             {"name": "sft-packed-deterministic", "kind": "sft-packed", "steps": STEPS, "deterministic": True}]
    return _suite(2, root, cases, refusals=True)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf3"))
    return _suite(3, root, [{"name": kind, "kind": kind, "steps": STEPS} for kind in ("trainer", "sft-packed")])


def _logged(run):
    """Each optimizer step's log line (the Trainer's, on rank 0)."""
    return [line for line in run["logs"] if "loss" in line and "train_loss" not in line]


def _same_as_one_process(results, name, kind, world, odc=True):
    import _hf_worker as W

    runs = [results[r][name] for r in range(world)]
    assert all(r["enabled"] == odc and r["class"].startswith("Odc") for r in runs), [(r["class"], r["enabled"])
                                                                                     for r in runs]
    ref = W.reference(kind, runs[0]["rows"], world, STEPS)
    got = _logged(runs[0])
    assert len(got) == STEPS, got
    for step, (line, want) in enumerate(zip(got, ref["logs"], strict=True)):
        for key in ("loss", "grad_norm"):
            assert line[key] == pytest.approx(want[key], abs=LOSS_TOL), (step, key, line, want)
        if kind.startswith("sft"):  # TRL's metrics, gathered once per step over every rank's tokens
            assert line["mean_token_accuracy"] == pytest.approx(want["mean_token_accuracy"], abs=LOSS_TOL), (step, line)
            assert line["num_tokens"] == sum(w["tokens"] for w in ref["logs"][:step + 1]), (step, line)
    assert all(_logged(r) == got for r in runs[1:])  # every rank logged the same
    assert max(w["grad_norm"] for w in ref["logs"]) > W.CLIP  # the clip acted
    params = runs[0]["params"]
    assert set(params) == set(ref["params"]), set(params) ^ set(ref["params"])
    init = W.build_model(W.KINDS[kind]["model"]).state_dict()
    moved = 0.0
    for key, want in ref["params"].items():
        np.testing.assert_allclose(params[key], want, rtol=0, atol=LOSS_TOL, err_msg=key)
        moved = max(moved, float(np.abs(want - init[key].numpy()).max()))
    assert moved > 100 * LOSS_TOL, moved  # training moved the parameters far beyond the tolerance
    return [r["counts"] for r in runs]


def _runs(request, world):
    return request.getfixturevalue({2: "two", 3: "three"}[world])


def _uneven(counts):
    """Per step, each rank's microbatch count: some step with different non-zero counts, and a rank with none in
    another."""
    steps = list(zip(*counts, strict=True))
    assert any(min(s) > 0 and len(set(s)) > 1 for s in steps), steps
    assert any(0 in s and max(s) > 0 for s in steps), steps


@pytest.mark.parametrize("world", [2, 3])
def test_trainer_matches_one_process(world, request):
    counts = _same_as_one_process(_runs(request, world), "trainer", "trainer", world)
    _uneven(counts)


@pytest.mark.parametrize("world", [2, 3])
def test_sft_packed_padding_free_matches_one_process(world, request):
    counts = _same_as_one_process(_runs(request, world), "sft-packed", "sft-packed", world)
    _uneven(counts)


def test_sft_without_packing_matches_one_process(two):
    counts = _same_as_one_process(two, "sft", "sft", 2)
    assert any(0 in s for s in zip(*counts, strict=True)), counts


def test_the_same_plan_on_fsdp2_accumulation_matches_one_process(two):
    """enable(trainer, accumulation="fsdp2-accum"): LB-Mini's plan without ODC, under FSDP2's own accumulation (the
    baseline of odc-bench trainer); a rank the plan gives nothing runs one zero-loss microbatch."""
    counts = _same_as_one_process(two, "sft-packed-accum", "sft-packed", 2, odc=False)
    steps = list(zip(*counts, strict=True))
    assert all(min(s) >= 1 for s in steps), steps  # at least one microbatch per rank, every step
    assert any(len(set(s)) > 1 for s in steps), steps  # and uneven counts
    odc_counts = [two[r]["sft-packed"]["counts"] for r in range(2)]
    assert any(0 in s for s in zip(*odc_counts, strict=True))  # where ODC's plan gave a rank nothing: the dummy ran


def test_odc_with_fsdp2_accumulation_matches_one_process(two):
    """enable(trainer, accumulation="odc-accum"): each rank accumulates its microbatches as FSDP2 does and pushes
    once on ODC; a rank the plan gives nothing runs nothing (no zero-loss microbatch, unlike fsdp2-accum)."""
    counts = _same_as_one_process(two, "sft-packed-odc-accum", "sft-packed", 2)
    assert counts == [two[r]["sft-packed"]["counts"] for r in range(2)], counts  # "odc"'s plan, ranks with none too
    _uneven(counts)


def test_deterministic_sums_through_the_trainer_match_one_process(two):
    counts = _same_as_one_process(two, "sft-packed-deterministic", "sft-packed", 2)
    assert counts == [two[r]["sft-packed"]["counts"] for r in range(2)], counts


def test_compressed_pushes_and_gathers_through_the_trainer_follow_one_process(two):
    """enable(trainer, compress=...) reaches odc.fsdp.enable: the same plan, every logged loss within the formats'
    rounding of one process's, and none exact (from the first step's forward, which reads fp8 shards)."""
    import _hf_worker as W

    runs = [two[r]["sft-packed-compressed"] for r in range(2)]
    assert all(r["enabled"] and r["class"].startswith("Odc") for r in runs)
    assert [r["counts"] for r in runs] == [two[r]["sft-packed"]["counts"] for r in range(2)]
    ref = W.reference("sft-packed", runs[0]["rows"], 2, STEPS)["logs"]
    got = _logged(runs[0])
    assert len(got) == STEPS and all(_logged(r) == got for r in runs[1:])
    gaps = [abs(line["loss"] - want["loss"]) / want["loss"] for line, want in zip(got, ref, strict=True)]
    print(f"\ncompressed ({COMPRESS}) loss vs one process, relative, per step: {[f'{g:.1e}' for g in gaps]}")
    assert max(gaps) < COMPRESSED_TOL, gaps
    assert min(gaps) * ref[0]["loss"] > LOSS_TOL, gaps  # compression is on at every step


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(two):
    full, resumed = two[0]["trainer"], two[0]["resumed"]
    got, want = _logged(resumed), _logged(full)
    assert [line["step"] for line in got] == [1, 2, 3, 4], got  # steps 1 and 2 are the checkpoint's history
    for line, same in zip(got[2:], want[2:], strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert line[key] == pytest.approx(same[key], abs=RESUME_TOL), (key, line, same)
    for key, value in full["params"].items():
        np.testing.assert_allclose(resumed["params"][key], value, rtol=0, atol=RESUME_TOL, err_msg=key)
    assert resumed["counts"][2:] == full["counts"][2:]


REFUSED = {
    "no fsdp": "needs FSDP2 through accelerate",
    "fsdp1": "FSDP1 through accelerate",
    "offload": "parameter offload",
    "sampling": "train_sampling_strategy='group_by_length'",
    "tokens": "average_tokens_across_devices=False",
    "auto batch": "auto_find_batch_size",
    "iterable": "iterable dataset",
    "mean loss": "num_items_in_batch",
    "deepspeed": "DeepSpeed",
    "tp": "tensor parallelism (tp_size) = 2",
    "cp": "context parallelism (cp_size) = 2",
    "sp": "sequence parallelism (sp_size) = 2",
    "hsdp": "HSDP (dp_replicate_size = 2)",
    "model parallel": "split over several devices",
    "dpo": "DPOTrainer is not supported",
    "not a trainer": "takes a transformers.Trainer; got object",
    "strategy": "strategy='verl-native'",
    "budget": "max_tokens=0",
    "cost": "cost='cubic'",
    "accumulation": "accumulation='zero2'",
    "accum resharding": "reshard_after_forward': False",
    "compress format": "compress push='int4', block=32: Format::from_str: unknown compressed format \"int4\"",
    "compress deterministic": "compress with deterministic=True",
    "cross node": "cross_node='ring'; one of 'auto', 'node', 'direct'",
    "compress accum": "compress with accumulation='fsdp2-accum'",
}


def test_unsupported_settings_are_refused_by_name(two):
    got = two[0]["refusals"]
    assert sorted(got) == sorted(REFUSED)
    for case, words in REFUSED.items():
        assert words in got[case], (case, got[case])
