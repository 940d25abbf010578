"""odc.fsdp on real FSDP2 ranks (CPU, gloo): parity with collectives, LB-Mini, errors, the example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _fsdp_helpers as H
import pytest
import torch
from _dist import run_ranks

import odc
import odc.fsdp

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_sft.py"
FP16_REL = 2e-4  # fp16 reduce: gloo rounds the sum of two fp16 gradients to fp16 (3e-5 seen); a wrong factor: 2x
# Final f32 parameters after 10 AdamW steps (lr 1e-2) against gloo. At 2 ranks they differ by about 2e-7 run after
# run (rounding where each side scales by 1/D). From three ranks on, an owner adds the ranks' chunks in the order
# they arrive and gloo in its own order, so the sums differ in their last bits from run to run, and AdamW (a step
# of about lr whatever the gradient's size) makes that visible where a parameter's summed gradient nearly cancels:
# 2e-7 to 3.8e-6 over 6 quiet runs at 4 ranks, 1.15e-5 once under make test's load. A wrong sum or a misplaced
# chunk changes the clipped norms (checked at 1e-5 relative) and moves parameters by AdamW steps of about lr.
PARAMS_TOL = {2: 1e-5, 4: 1e-4}


@pytest.mark.parametrize(
    ("world", "variants", "transport"),
    [
        (2, ("fp32", "bf16", "forcesum", "divide", "fp16reduce"), None),
        (4, ("fp32",), None),
        # ODC_TRANSPORT=emu-ipc: the whole integration through the device calls (jittered emulated streams).
        (2, ("fp32", "bf16", "forcesum"), "emu-ipc"),
    ],
)
def test_parity_with_gloo_collectives(world, variants, transport):
    out = H.all_ok(run_ranks(H.parity_worker, world, timeout=300, variants=variants, transport=transport))
    for rank, res in out.items():
        if transport is not None:
            assert "'cuda-ipc'" in res["cuda_ipc_on_cpu"] and "on cpu" in res["cuda_ipc_on_cpu"], res
        for name in variants:
            gloo, odc_ = res[name]["gloo"], res[name]["odc"]
            assert odc_[4] == (transport or "shm"), (name, odc_[4])
            # Gathers read buckets in FSDP's all-gather dtype: bf16 under MixedPrecisionPolicy(param_dtype=bf16).
            # 3 groups: two blocks and the root (embedding, head).
            assert odc_[3] == ["bf16" if name == "bf16" else "f32"] * 3, (name, odc_[3])
            assert len(gloo[1]) == len(odc_[1]) == 10 and all(n > 0.3 for n in gloo[1]), (name, gloo[1])  # clipped
            if name == "bf16":
                # bf16 gathers round the same way in both; only summation order differs.
                assert max(abs(x - y) for x, y in zip(gloo[0], odc_[0], strict=True)) < 2e-2, (name, gloo[0], odc_[0])
                assert gloo[1] == pytest.approx(odc_[1], rel=2e-2), (name, rank)
                H.assert_params_close(gloo[2], odc_[2], 2e-2)
            elif name == "fp16reduce":
                # gloo sums the fp16 gradients in fp16, ODC's owners in f32.
                assert gloo[1] == pytest.approx(odc_[1], rel=FP16_REL), (name, rank, gloo[1], odc_[1])
                H.assert_params_close(gloo[2], odc_[2], 2e-5)
            else:
                assert gloo[0] == pytest.approx(odc_[0], rel=1e-5, abs=1e-6), (name, rank)
                assert gloo[1] == pytest.approx(odc_[1], rel=1e-5), (name, rank)  # clipped norms
                H.assert_params_close(gloo[2], odc_[2], 1e-5)
            assert len(gloo[0]) == 10
    if world == 4:
        for res in out.values():
            assert "reshard_after_forward" in res["reshard_int_error"], res["reshard_int_error"]
            assert "sharding='hybrid-zero'" in res["reshard_int_error"], res["reshard_int_error"]  # the way that works


def test_lb_mini_uneven_microbatches_match_single_process():
    counts = (2, 0, 1)
    out = H.all_ok(run_ranks(H.lbmini_worker, 3, timeout=180, counts=counts, steps=4))
    for s in range(4):
        assert sorted(out[r]["counts"][s] for r in range(3)) == [0, 1, 2]  # one rank idles every step
    # False: optimizer hooks; True: odc.fsdp.minibatch without hooks.
    assert out[0]["max_diff"][False] < 1e-5 and out[0]["max_diff"][True] < 1e-5, out[0]


def test_errors_are_typed_and_clear_and_a_dead_peer_is_named():
    res = run_ranks(H.errors_worker, 2, timeout=150)
    status, found = res[0]
    assert status == "ok", res
    assert res[1][0] == "exited", res  # rank 1 dies at the end, on purpose
    assert "fully_shard" in found["not_sharded"], found
    assert "hybrid" in found["hsdp"], found
    assert "not enabled" in found["not_enabled"], found
    assert "already enabled" in found["twice"], found
    assert "pending" in found["pending"], found
    assert "ProtocolError" in found["stale_forward"] and "step the optimizer" in found["stale_forward"], found
    # The advice fits the running torch: the setter from 2.13, what to do instead before it.
    assert "LayoutError" in found["unused"] and "set_reduce_scatter_unused_params" in found["unused"], found
    assert ("torch 2.13 added" in found["unused"]) == (H.TORCH_MINOR < (2, 13)), found
    # Comms go in through FSDP2's public setters, one call per FSDP module (= group), each its own object.
    inst = found["installs"]
    assert inst["groups"] == 3 and inst["own"], inst  # two blocks and the root
    assert sorted(c[0] for c in inst["enable"]) == ["ag"] * inst["groups"] + ["rs"] * inst["groups"], inst
    assert {c[2] for c in inst["enable"]} == {"_OdcAllGather", "_OdcReduceScatter"}, inst
    assert {c[2] for c in inst["disable"]} == {"DefaultAllGather", "DefaultReduceScatter"}, inst
    assert len(inst["disable"]) == len(inst["enable"]), inst
    if H.TORCH_MINOR >= (2, 12):
        assert "ConfigError" in found["per_param_mesh"] and "set_custom_all_gather" in found["per_param_mesh"], found
    # The survivor gets the typed error naming the peer, never a hang.
    assert found["dead_peer"].startswith(("PeerDied", "PeerTimeout")) and "rank 1" in found["dead_peer"], found
    assert found["dead_peer_peer"] == 1, found


def test_enable_refuses_a_torch_outside_the_supported_range(monkeypatch):
    # The running torch is in the range: no warning (warnings are errors here), the model's own error.
    with pytest.raises(odc.ConfigError, match="fully_shard"):
        odc.fsdp.enable(torch.nn.Linear(2, 2), None)
    monkeypatch.setattr(torch, "__version__", "2.10.2+cu126")
    with pytest.raises(odc.ConfigError, match=r"cannot run on torch 2\.10\.2 \(odc.fsdp supports torch 2\.11 to 2\.15"):
        odc.fsdp.enable(torch.nn.Linear(2, 2), None)
    monkeypatch.setattr(torch, "__version__", "2.16.0.dev20261101+cu132")
    with pytest.raises(odc.ConfigError, match="ODC_ALLOW_UNCHECKED_TORCH=1") as e:
        odc.fsdp.enable(torch.nn.Linear(2, 2), None)
    assert "torch 2.16.0.dev20261101 " in str(e.value) and "cu132" not in str(e.value), e.value
    assert all(v in str(e.value) for v in odc.fsdp.TORCH_VERSIONS_CHECKED), e.value
    monkeypatch.setenv("ODC_ALLOW_UNCHECKED_TORCH", "1")
    with pytest.warns(UserWarning, match="ODC_ALLOW_UNCHECKED_TORCH=1") as record, \
            pytest.raises(odc.ConfigError, match="fully_shard"):
        odc.fsdp.enable(torch.nn.Linear(2, 2), None)
    assert len(record) == 1, [str(w.message) for w in record]
    assert record[0].filename == __file__  # points at the caller of enable


def test_every_private_name_missing_in_turn_is_a_config_error_and_enables_nothing():
    """On the running torch, each private FSDP2 attribute odc.fsdp uses, taken away from a real model in turn:
    enable raises ConfigError naming it, the running torch and the range, and leaves nothing enabled."""
    from odc.fsdp._private import names_of

    out = H.all_ok(run_ranks(H.missing_names_worker, 1, timeout=120))[0]
    expected = {f"{o}.{n}" for o in ("FSDPModule", "FSDPState", "FSDPParamGroup", "FSDPParam") for n in names_of(o)}
    assert set(out) == expected and len(expected) >= 20, sorted(set(out) ^ expected)
    group = "_fsdp_param_groups" if H.TORCH_MINOR >= (2, 12) else "_fsdp_param_group"
    assert f"FSDPState.{group}" in out, sorted(out)
    version = torch.__version__.split("+")[0]
    for key, msg in out.items():
        name = key.split(".")[1]
        assert f"has no {name!r}" in msg and f"torch {version} " in msg and "2.11 to 2.15" in msg, (key, msg)
        assert "left behind" not in msg, (key, msg)

def test_example_runs_in_both_comm_modes():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, str(EXAMPLE), "--nproc", "2", "--comm", "both", "--steps", "2", "--dim", "32",
           "--layers", "2", "--samples", "16", "--minibatch", "4", "--max-len", "48", "--strategy", "lb-mini"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "collective" in p.stdout and "odc" in p.stdout and "overhead" in p.stdout, p.stdout


def test_a_torch_without_the_private_fsdp2_state_imports_and_enable_says_why():
    """On a torch whose private FSDP2 module lacks a name odc.fsdp reads, importing odc.fsdp and odc.backend
    still works, and enable raises a ConfigError naming the running torch and the versions checked."""
    code = """
import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives as c
del c._get_gradient_divide_factors          # as a later torch might rename it
import odc.backend, odc.fsdp                # must not raise ImportError
try:
    odc.fsdp.enable(torch.nn.Linear(2, 2), None)
except odc.ConfigError as e:
    print("CONFIG", e)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    msg = p.stdout
    version = torch.__version__.split("+")[0]
    assert msg.startswith("CONFIG") and f"torch {version} " in msg and "_get_gradient_divide_factors" in msg, msg
    assert "2.11 to 2.15" in msg and all(v in msg for v in odc.fsdp.TORCH_VERSIONS_CHECKED), msg


@pytest.mark.parametrize("fsdp1", [False, True], ids=["fsdp2", "fsdp1"])
def test_enable_is_a_pipeline_of_four_steps_each_in_one_module(fsdp1):
    """enable describes the model, makes the engine, binds, installs the seams: one call into one module each."""
    out = H.all_ok(run_ranks(H.enable_steps_worker, 2, timeout=120, fsdp1=fsdp1))
    seams = "odc.fsdp._fsdp1.install" if fsdp1 else "odc.fsdp._seams.install"
    for rank, steps in out.items():
        assert steps == ["odc.fsdp._model.describe", "odc.fsdp._engine.make", "odc.fsdp._binding.bind", seams], (
            rank, steps)


def test_torchs_clip_on_pending_gradients_counts_a_group_of_two_modules():
    """fully_shard([block, head]) (accelerate's tail of a causal LM), torch's clip finishing the minibatch: the norms
    and parameters equal FSDP2's over gloo. On torch 2.11 the group was listed once per module, so it became two
    buckets and the clip read the empty one (the norm left the tail out)."""
    runs = {comm: H.all_ok(run_ranks(H.tail_group_worker, 2, timeout=180, comm=comm)) for comm in ("gloo", "odc")}
    for rank in (0, 1):
        g, o = runs["gloo"][rank], runs["odc"][rank]
        assert g["norms"][0] > 0.05  # the clip is active
        assert o["norms"] == pytest.approx(g["norms"], rel=1e-5), (rank, o["norms"], g["norms"])
        H.assert_params_close(o["params"], g["params"], 1e-5)
