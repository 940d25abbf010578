"""The gradient contract: users' unchanged loops train the same under odc.fsdp as under FSDP2's collectives.

Models, loops and references live in _loops.py (Hugging Face models, torchtitan-, verl- and HF
Trainer-shaped steps) and _contract.py (the small model: the loop a new user writes, broken
loops, skipped steps, other gradient consumers).
"""

from __future__ import annotations

import math

import _contract as C
import _loops as L
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok, assert_params_close

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

pytest.importorskip("transformers")


def test_the_loop_a_new_user_writes_matches_gloo():
    """FSDP2, 2 ranks, 2 microbatches each, torch.nn.utils.clip_grad_norm_(params, 0.05) before step."""
    out = all_ok(run_ranks(C.why_loop_worker, 2, timeout=200))
    for rank, res in out.items():
        gloo, odc_ = res["gloo"], res["odc"]
        assert all(n > 0.1 for n in gloo["norms"]), gloo["norms"]  # the clip is active: max_norm 0.05
        for s, (x, y) in enumerate(zip(odc_["norms"], gloo["norms"], strict=True)):
            assert math.isclose(x, y, rel_tol=1e-5), (rank, s, odc_["norms"], gloo["norms"])
        assert_params_close(gloo["params"], odc_["params"], 1e-5)
        # What a loop logs from p.grad before the step: this rank's shards, as FSDP2 holds them.
        assert_params_close(gloo["logged"], odc_["logged"], 1e-6)


# Uneven plans: plan[s][r] microbatches for rank r at step s, zero included (under GradScaler, a rank
# idle in the first minibatch calls scaler.scale once itself: the scale is made on the first call).
UNEVEN = {
    2: [(2, 0), (1, 3), (0, 1)],
    3: [(2, 1, 1), (1, 3, 0), (0, 1, 2)],
}
EVEN = [(2, 2, 2), (1, 1, 1), (2, 2, 2)]
# Mixed precision against the reference: a cast copy of the parameters computes, f32 sums. That
# emulation is exact where FSDP2's own sums are: an average that divides by a world size that is not
# a power of two, or verl's no-sync accumulation (FSDP2 keeps those unsharded gradients in the reduce
# dtype), reorders roundings across a bf16 boundary. So the uneven runs put mixed precision on the
# summing loop (torchtitan's) and on the 2-rank Trainer loop; FSDP2 itself checks verl's under bf16.
VARIANTS = {
    2: [
        {"loop": "titan", "model": "qwen2", "ckpt": True},
        {"loop": "verl", "model": "llama"},
        {"loop": "hf", "model": "llama", "precision": "bf16"},
        {"loop": "titan", "model": "llama", "precision": "fp16"},
        # Deterministic accumulation under GradScaler (fp16) and under bf16 compute. The fp16 one with an
        # inactive clip: the norm over shards and the reference's over whole tensors differ in the last bit,
        # and through an active clip's coefficient, AdamW and fp16 casts that grew to 8e-5 by the third step
        # on some CPUs (1 ulp at every step without it; the other variants clip).
        {"loop": "titan", "model": "qwen2", "precision": "fp16", "deterministic": True, "clip": 10.0},
        {"loop": "hf", "model": "llama", "precision": "bf16", "deterministic": True},
    ],
    3: [
        {"loop": "titan", "model": "llama", "ckpt": True},
        {"loop": "verl", "model": "qwen2", "ckpt": True},
        {"loop": "hf", "model": "qwen2"},
        {"loop": "titan", "model": "qwen2", "precision": "bf16"},
        {"loop": "titan", "model": "llama", "precision": "fp16"},
    ],
}
EVEN_VARIANTS = {
    2: VARIANTS[2] + [{"loop": "verl", "model": "qwen2", "precision": "bf16"}],
    3: VARIANTS[3][:3],
}


def _check(res, variant, want, norm_rel=1e-5, param_abs=1e-4):
    L.assert_close(res, want, norm_rel, param_abs, str(variant))


@pytest.mark.parametrize("world", [2, 3])
def test_hf_models_in_users_loops_with_uneven_counts_match_one_process(world):
    L.quiet()
    plan = UNEVEN[world]
    variants = VARIANTS[world]
    out = all_ok(run_ranks(L.loops_worker, world, timeout=600, variants=variants, plan=plan))
    for i, variant in enumerate(variants):
        # Every rank, those with no microbatch included, computed the grad norm of the whole gradient: checked
        # against one process and against each rank's own shards as it held them before the clip's exchange.
        L.assert_norms_from_shards({r: out[r][i]["odc"] for r in range(world)}, out[0][i]["ref"], str(variant))
        _check(out[0][i]["odc"], variant, out[0][i]["ref"])


@pytest.mark.parametrize("world", [2, 3])
def test_hf_models_in_users_loops_with_even_counts_match_fsdp2_over_gloo(world):
    L.quiet()
    plan = [c[:world] for c in EVEN]
    variants = EVEN_VARIANTS[world]
    out = all_ok(run_ranks(L.loops_worker, world, timeout=600, variants=variants, plan=plan, comms=("gloo", "odc")))
    for i, variant in enumerate(variants):
        res = out[0][i]
        _check(res["odc"], variant, res["gloo"])
        if variant.get("precision") is None or variant["loop"] != "verl":
            _check(res["gloo"], variant, res["ref"])  # the reference reproduces FSDP2 here too


def test_loops_that_break_the_contract_get_errors_naming_what_to_call():
    out = all_ok(run_ranks(C.broken_loops_worker, 2, timeout=200))
    for found in out.values():
        early = found["early_read"]
        assert early.startswith("ProtocolError") and "final already" in early and "_foreach_norm" in early, early
        assert "read gradients only after the minibatch's last backward" in early, early
        # The backward's first gather (parameters resharded after forward) is refused, naming the read.
        before = found["read_before_backward"]
        assert "-gather of fsdp" in before and "final already" in before and "aten.sum" in before, before
        assert "again in minibatch 1" in found["step_twice"] and "zero_grad" in found["step_twice"], found
        for key in ("zero_grad_mid", "zero_mid", "none_mid"):
            assert found[key].startswith("ProtocolError") and "cannot take back" in found[key], (key, found[key])
        assert "fsdp" in found["none_mid"] and "weight" in found["none_mid"], found["none_mid"]  # group, parameter
        # The refused microbatch added nothing and the first one was not lost.
        assert found["none_mid_norm"] == pytest.approx(found["early_norm"], rel=1e-6), found
        assert found["hook"].startswith("ConfigError") and "post-accumulate-grad hook" in found["hook"], found
        assert "PendingGrad(" in found["repr"] and "final once read" in found["repr"], found["repr"]
        assert found["repr_open"] is True


@pytest.mark.parametrize(("world", "plan", "skip"), [
    (2, [(2, 1), (0, 2), (1, 1), (1, 0)], (1,)),
    (3, [(1, 2, 0), (2, 0, 1), (0, 1, 1), (1, 1, 2)], (0, 2)),
])
def test_skipped_steps_and_hand_made_steps_match_one_process(world, plan, skip):
    """verl's skip on a non-finite norm (clip, zero_grad, no step), and a loop stepping by hand."""
    out = all_ok(run_ranks(C.skipped_steps_worker, world, timeout=200, plan=plan, skip=skip))
    ref = out[0]["ref"]
    for loop in ("skip", "by_hand"):
        for rank in range(world):
            norms = out[rank][loop]["norms"]
            assert norms == pytest.approx(ref["norms"], rel=1e-5), (loop, rank, norms, ref["norms"])
        assert_params_close(out[0][loop]["params"], ref["params"], 1e-5)


def test_optimizers_and_logging_read_the_gradients_fsdp2_holds():
    out = all_ok(run_ranks(C.consumers_worker, 2, timeout=300))
    for rank, res in out.items():
        for name, r in res.items():
            assert_params_close(r["gloo"]["params"], r["odc"]["params"], 1e-5)
            for s, (g, o) in enumerate(zip(r["gloo"]["logs"], r["odc"]["logs"], strict=True)):
                assert o == pytest.approx(g, rel=1e-5, abs=1e-7), (rank, name, s)


def test_hf_example_prints_equal_losses_and_norms_in_both_comm_modes():
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "hf_sft.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, str(example), "--nproc", "2", "--comm", "both", "--steps", "3", "--layers", "2",
           "--samples", "96", "--minibatch", "8", "--max-len", "96", "--max-tokens", "256", "--ckpt"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split("|")[1:] for line in p.stdout.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 3, p.stdout
    for collective, odc_ in rows:
        (lc, nc, _), (lo, no, _) = (map(float, c.split(",")) for c in (collective, odc_))
        assert lc == pytest.approx(lo, rel=1e-5) and nc == pytest.approx(no, rel=1e-5), p.stdout
        assert nc > 0.0, p.stdout


def test_the_deadline_follows_the_process_group_and_a_timeout_names_it():
    out = run_ranks(C.deadline_worker, 2, timeout=120)
    assert all(s == "ok" for s, _ in out.values()), out
    for _, res in out.values():
        assert res["timeout"] == 3.0 and res["source"] == "the process group's timeout", res
    r0 = out[0][1]
    assert r0["peer"] == 1 and "rank 1" in r0["error"], r0
    assert r0["notes"] == ["ODC's deadline: 3 s, from the process group's timeout"], r0
    assert 3.0 <= r0["waited"] < 15.0, r0  # the step waited out the group's 3 s, not a default of its own
