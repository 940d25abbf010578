"""A minibatch's edges, each against a reference computed in one process from the same samples (workers in
_boundaries.py): a push that is a minibatch's first operation reaches a slow owner only once it has read the
previous minibatch's sums; an evaluation block reshards what its forward left unsharded; an exception out of
``odc.fsdp.minibatch``, ``odc.fsdp.skip`` and an iterator of ``odc.fsdp.microbatches`` left early skip the
minibatch on every rank alike (or leave it refused); ``odc.fsdp.clip_grad_norm_`` over a list of
parameters behaves the same on every rank; world size 1 trains as one process does."""

from __future__ import annotations

import math

import _boundaries as W
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test


def test_a_minibatchs_first_push_waits_for_a_slow_owner_to_read_the_last_one():
    """No group gathers after the first minibatch (every parameter stays unsharded), so each later minibatch
    starts with a push, while the owner still holds the previous sums: the result matches FSDP2 over gloo."""
    runs = {comm: all_ok(run_ranks(W.push_first_worker, 2, timeout=240, steps=4, delay=0.5, comm=comm))
            for comm in ("gloo", "odc")}
    for rank in (0, 1):
        worst, ok = W.close(runs["gloo"][rank], runs["odc"][rank], 1e-5)
        assert ok, f"rank {rank}: parameters differ from FSDP2 over gloo by {worst}"


@pytest.mark.parametrize("variant", ["fsdp2-root", "fsdp2-no-reshard", "fsdp1-full-shard", "fsdp1-shard-grad-op"])
def test_an_evaluation_block_reshards_what_its_forward_left_unsharded(variant):
    """The evaluated (halved) weights stay out of the next minibatch: FSDP2's root (fully_shard's default),
    FSDP2 modules with reshard_after_forward=False, FSDP1's root and its SHARD_GRAD_OP handles are gathered again
    after the block."""
    out = all_ok(run_ranks(W.evaluation_worker, 2, timeout=240, variant=variant))
    ref = W.evaluation_reference(2)
    for rank, res in out.items():
        assert math.isclose(res["evals"][0], ref["evals"][0][rank], rel_tol=1e-5), (rank, res["evals"], ref)
        worst, ok = W.close(ref["params"], res["params"], 1e-5)
        assert ok, f"{variant}, rank {rank}: parameters differ from one process by {worst}"


@pytest.mark.parametrize("variant", ["fsdp2", "fsdp1", "hybrid"])
def test_an_exception_out_of_a_minibatch_block_skips_it_on_every_rank(variant):
    """The skip-a-bad-batch loop: rank 0's data raises in the middle of a minibatch, after its first push; the loop
    catches it and moves on without stepping, while the other ranks finish the minibatch and step as usual. Every
    rank skips it alike (warned, ``odc.fsdp.skipped``; under hybrid sharding the other node learns it in the
    cross-node sum): the parameters are one process's that skipped the minibatch whole, and the next minibatches
    stay apart (the same minibatch count on every rank)."""
    world, plan = (4, W.SKIP_PLAN_4) if variant == "hybrid" else (2, W.SKIP_PLAN)
    out = all_ok(run_ranks(W.skip_worker, world, timeout=240, variant=variant))
    ref = W.skip_reference(world, plan=plan)
    for rank in range(world):
        for s, msgs in enumerate(out[rank]["warnings"]):
            if s != W.SKIP:
                assert msgs == [], (rank, s, msgs)
                continue
            (msg,) = msgs
            assert f"minibatch {W.SKIP}" in msg and "skipped on every rank" in msg, (rank, msg)
            assert ("BadBatch" in msg) == (rank == 0), (rank, msg)
        assert out[rank]["skipped"] == [int(s == W.SKIP) for s in range(len(plan))], out[rank]["skipped"]
    assert {res["version"] for res in out.values()} == {len(plan) - 1}, out
    for rank, res in out.items():
        worst, ok = W.close(ref, res["params"], 1e-5)
        assert ok, f"rank {rank}: parameters differ from one process that skipped minibatch {W.SKIP} by {worst}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_odc_fsdp_skip_with_a_hooked_optimizer_makes_every_ranks_step_a_no_op(optimizer):
    """A loop with the optimizer hooked calls ``odc.fsdp.skip`` in its handler and steps as usual on every rank:
    the skipped minibatch's step trains nothing anywhere (AdamW would otherwise move every parameter on zero
    gradients): one process that skipped the minibatch whole."""
    out = all_ok(run_ranks(W.hooked_skip_worker, 2, timeout=240, optimizer=optimizer))
    ref = W.hooked_skip_reference(2, optimizer)
    assert out[1]["warnings"][W.SKIP] and "skipped on every rank" in out[1]["warnings"][W.SKIP][0], out[1]
    assert out[0]["warnings"][W.SKIP] == [], out[0]  # the rank that skipped knows
    for rank, res in out.items():
        assert res["skipped"] == [int(s == W.SKIP) for s in range(len(W.SKIP_PLAN))], (rank, res["skipped"])
        # AdamW divides by sqrt(v): the last-bit differences of a sum in another order grow to ~1e-5 where a
        # gradient is tiny (seen on torch 2.11). A step on the skipped minibatch's zeros moves parameters by 0.36.
        worst, ok = W.close(ref, res["params"], 1e-5 if optimizer == "sgd" else 1e-4)
        assert ok, f"rank {rank}: parameters differ from one process that skipped minibatch {W.SKIP} by {worst}"


def test_a_minibatch_that_cannot_be_finished_after_an_exception_is_refused_at_the_next_block():
    out = all_ok(run_ranks(W.interrupted_worker, 2, timeout=120))
    assert out[0].startswith("ProtocolError") and "minibatch 0" in out[0] and "KeyboardInterrupt" in out[0], out[0]
    assert out[1].startswith(("PeerTimeout", "PeerDied")) and "rank 0" in out[1], out[1]


@pytest.mark.parametrize("steal", [False, True])
def test_an_iterator_left_early_and_kept_is_named_and_skips_the_minibatch_everywhere(steal):
    """Rank 0 breaks out of a loop over an iterator it keeps (the generator is never finalized): the step
    finishes the minibatch, names every microbatch of its own list that ran nowhere (and the one it left with),
    and skips the minibatch on every rank; each microbatch ran at most once, no rank's parameters moved, and
    the iterator refuses to resume."""
    out = all_ok(run_ranks(W.held_iterator_worker, 2, timeout=240, steal=steal))
    ran = out[0]["ran"] + out[1]["ran"]
    assert len(ran) == len(set(ran)), ran
    unrun = sorted(set(range(5)) - set(ran))
    err = out[0]["error"]
    assert err.startswith("odc.fsdp.microbatches") and "skipped on every rank" in err, (err, ran)
    assert "1 microbatch(es) handed to it" in err, err  # the one it left with
    if unrun:
        assert f"indices {unrun}" in err, (err, ran)
    if not steal:
        assert unrun == [1, 2, 3], ran
    assert out[1]["error"] == ""
    assert out[0]["skipped"] == out[1]["skipped"] == 1, out
    assert "resumed after that minibatch finished" in out[0]["resumed"], out[0]["resumed"]
    assert out[1]["resumed"] == "StopIteration"  # drained
    ref = W.params_of(W.plain())  # skipped: no step trained on any of it
    for rank, res in out.items():
        worst, ok = W.close(ref, res["params"], 1e-6)
        assert ok, f"rank {rank}: parameters moved by {worst} on a skipped minibatch"


def test_odc_clip_over_a_list_of_fsdp1_original_parameters_agrees_on_every_rank():
    """FSDP1 with use_orig_params=True, where a parameter lies wholly in the other rank's shard: accepted on
    both ranks, FSDP1's own norms; a foreign tensor in the list is refused on both, before any exchange."""
    out = all_ok(run_ranks(W.clip_list_worker, 2, timeout=180))
    for rank, res in out.items():
        assert res["missing"] == [], (rank, res["missing"])
        for s, (x, y) in enumerate(zip(res["odc"], res["fsdp1"], strict=True)):
            assert math.isclose(x, y, rel_tol=1e-5), (rank, s, res["odc"], res["fsdp1"])
        assert res["foreign"].startswith("ConfigError") and "do not belong" in res["foreign"], res["foreign"]
    assert out[0]["odc"] == out[1]["odc"]


def test_every_odc_fsdp_call_works_at_world_size_one_and_trains_as_one_process():
    """ODC at world size 1 (FSDP2 bypasses its seams there) against one process without FSDP, in another
    process: the same norms (the clip active) and parameters."""
    out = all_ok(run_ranks(W.solo_worker, 1, timeout=120))[0]
    ref = W.solo_reference()
    assert out["enabled"] and out["disabled"]
    assert ref["norms"][0] > 0.05  # the clip is active
    for s, (x, y) in enumerate(zip(out["norms"], ref["norms"], strict=True)):
        assert math.isclose(x, y, rel_tol=1e-6), (s, out["norms"], ref["norms"])
    worst, ok = W.close(ref["params"], out["params"], 1e-6)
    assert ok, f"parameters differ from one process by {worst}"
