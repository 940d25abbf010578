"""FSDP1 (FullyShardedDataParallel, use_orig_params=False) on ODC: uneven counts against one process, even
counts against FSDP1 over gloo, and what enable refuses. Workers in _fsdp1.py."""

from __future__ import annotations

import math

import _fsdp1 as W
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok, assert_params_close

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

#: Microbatches per rank per step: rank 1 idle at step 0, rank 0 at step 1 (they still clip and step).
UNEVEN = [[3, 0], [0, 2], [1, 2]]


def test_uneven_counts_on_fsdp1_match_one_process_with_either_use_orig_params_no_sync_and_deterministic_sums():
    """A rank idle at a step still reads final gradients (FSDP1's clip all-reduces a norm on every rank), and
    FULL_SHARD, SHARD_GRAD_OP, no_sync() on all but the last microbatch, deterministic sums and
    use_orig_params=True all train as one process on the whole minibatch would."""
    out = all_ok(run_ranks(W.uneven_worker, 2, timeout=240, table=UNEVEN, variants=tuple(W.UNEVEN)))
    ref = out[0]["ref"]
    assert all(n > 0.5 for n in ref["norms"]), ref["norms"]  # the clip is active at every step
    for rank, res in out.items():
        for v in W.UNEVEN:
            got = res[v]
            for s, (x, y) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
                assert math.isclose(x, y, rel_tol=1e-5), (v, rank, s, got["norms"], ref["norms"])
            assert_params_close(ref["params"], got["params"], 2e-6)
        # Each rank's own shards, read without an all-gather, against the same slice of one process's parameters
        # (summon_full_params above gathers them: every rank would read the same, right or wrong).
        assert_local_shards_match(ref["params"], res["full"]["local"], world=2, tol=2e-6)


def assert_local_shards_match(params, shards, world, tol):
    """Each FlatParameter shard equals the slice of the flattened, padded ``params`` it holds."""
    import torch

    assert shards, "no FlatParameter shards"
    for s in shards:
        flat = torch.cat([torch.tensor(params[n]).flatten() for n in s["names"]])
        n = len(s["shard"])
        padded = torch.zeros(n * world)
        padded[: flat.numel()] = flat
        want = padded[s["index"] * n : (s["index"] + 1) * n]
        worst = (torch.tensor(s["shard"]) - want).abs().max().item()
        assert worst <= tol, (s["names"], s["index"], worst)


def test_even_counts_on_fsdp1_match_fsdp1_over_gloo_with_torchs_clip_fsdp1s_clip_and_bf16_compute():
    """torch's clip_grad_norm_ on FSDP1's shards (a per-rank norm, as a user's loop may call it) and FSDP1's own
    model.clip_grad_norm_, in f32 and with verl's MixedPrecision (bf16 compute, f32 reduce), with either
    use_orig_params, a loop that keeps the first step's gradients (no zero_grad) to add the second's onto,
    and LoRA's pattern (part of each FlatParameter frozen, use_orig_params=True)."""
    variants = {
        "torch/f32": {"clip": "torch"},
        "fsdp1/f32/keep": {"clip": "fsdp1", "keep": True},
        "fsdp1/bf16": {"clip": "fsdp1", "mp": True},
        "torch/f32/orig": {"clip": "torch", "orig": True},
        "fsdp1/bf16/orig": {"clip": "fsdp1", "mp": True, "orig": True},
        "fsdp1/f32/orig/keep": {"clip": "fsdp1", "orig": True, "keep": True},
        "torch/f32/orig/frozen": {"clip": "torch", "orig": True, "freeze": True},
    }
    out = all_ok(run_ranks(W.gloo_parity_worker, 2, timeout=240, table=[[1, 1], [2, 2], [1, 1]],
                           variants=variants))
    per_rank = {}
    for rank, res in out.items():
        assert set(res) == set(variants), sorted(res)
        for name, runs in res.items():
            gloo, odc_ = runs["gloo"], runs["odc"]
            assert all(n > 0.1 for n in gloo["norms"]), (name, gloo["norms"])
            for s, (x, y) in enumerate(zip(odc_["norms"], gloo["norms"], strict=True)):
                assert math.isclose(x, y, rel_tol=1e-5), (name, rank, s, odc_["norms"], gloo["norms"])
            assert_params_close(gloo["params"], odc_["params"], 1e-5)
        per_rank[rank] = res["torch/f32"]["odc"]["norms"]
    assert per_rank[0] != per_rank[1]  # torch's clip saw each rank's own shards, as over gloo


def test_fsdp1_hybrid_shard_with_compressed_cross_node_sums():
    """HYBRID_SHARD under sharding="hybrid" with compress={"push": "int8"} on 2 emulated nodes x 2: the cross-node
    sum crosses as int8 with error feedback; the nodes still hold the same replica bit for bit, and the run follows
    the uncompressed one (which matches one process) within int8's rounding."""
    table = [[2, 1, 0, 0], [0, 1, 2, 1], [1, 0, 1, 2]]
    out = all_ok(run_ranks(W.hybrid_compressed_worker, 4, timeout=240, table=table, per_node=2))
    ref = out[0]["ref"]
    for rank, res in out.items():
        plain, packed = res["plain"], res["int8"]
        assert_params_close(ref["params"], plain["params"], 2e-6)
        assert packed["local"] == out[rank ^ 2]["int8"]["local"], rank  # replicas: the same bits
        gaps = [abs(x - y) / y for x, y in zip(packed["norms"], plain["norms"], strict=True)]
        print(f"rank {rank}: clip norms int8 {packed['norms']}, f32 {plain['norms']}, relative gaps {gaps}")
        # On: the norms differ by more than f32 summation order would (1e-7); within int8's rounding: each
        # gradient element errs by at most amax/254 of its block (0.4 %), and the norm, a sum of squares over all
        # of them, by less.
        assert max(gaps) > 1e-7 and max(gaps) < 4e-3, gaps
    # The losses, summed over the ranks: step 0's are computed before any update (the same); later ones move by
    # the updates' difference, which AdamW's normalisation can make up to 2 lr for an element whose gradient
    # rounds to the other sign, but which is that small only on a few elements.
    losses = {name: [sum(out[r][name]["losses"][s] for r in out) for s in range(len(table))]
              for name in ("plain", "int8")}
    loss_gaps = [abs(a - b) / abs(b) for a, b in zip(losses["int8"], losses["plain"], strict=True)]
    print(f"losses {losses}, relative gaps {loss_gaps}")
    assert loss_gaps[0] == 0.0 and max(loss_gaps) < 1e-3, loss_gaps


def test_fsdp1_hybrid_strategies_run_under_hybrid_sharding_against_one_process_and_gloo():
    """HYBRID_SHARD (flat parameters) and _HYBRID_SHARD_ZERO2 (use_orig_params=True) on 2 emulated nodes × 2:
    uneven counts with a whole node idle at a step match one process, both nodes end with the same replica;
    even counts match FSDP1's own HYBRID_SHARD over gloo; sharding='full' on a hybrid strategy is refused."""
    table = [[2, 1, 0, 0], [0, 1, 2, 1], [1, 0, 1, 2]]
    out = all_ok(run_ranks(W.hybrid_worker, 4, timeout=240, table=table, per_node=2))
    ref = out[0]["ref"]
    for rank, res in out.items():
        for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
            got = res[strategy]
            for s, (x, y) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
                assert math.isclose(x, y, rel_tol=1e-5), (strategy, rank, s, got["norms"], ref["norms"])
            assert_params_close(ref["params"], got["params"], 2e-6)
            assert res[strategy]["local"] == out[rank ^ 2][strategy]["local"], (strategy, rank)  # replicas
        for s, (x, y) in enumerate(zip(res["odc_even"]["norms"], res["gloo"]["norms"], strict=True)):
            assert math.isclose(x, y, rel_tol=1e-5), (rank, s, res["odc_even"]["norms"], res["gloo"]["norms"])
        assert_params_close(res["gloo"]["params"], res["odc_even"]["params"], 1e-5)
        assert "HYBRID_SHARD" in res["full"] and "sharding='hybrid'" in res["full"], res["full"]


def test_a_checkpoint_loaded_between_minibatches_reaches_every_peer_and_an_edit_inside_one_is_refused():
    """FSDP1's state dicts unshard with its own all-gather (every rank calls them at the same point), so the
    loaded parameters are what the next minibatch publishes: the same norms and parameters as over gloo."""
    out = all_ok(run_ranks(W.params_worker, 2, timeout=240))
    for rank, res in out.items():
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "FULL_STATE_DICT/orig", "SHARDED_STATE_DICT/orig"):
            gloo, odc_ = res[kind]["gloo"], res[kind]["odc"]
            for s, (x, y) in enumerate(zip(odc_["norms"], gloo["norms"], strict=True)):
                assert math.isclose(x, y, rel_tol=1e-5), (kind, rank, s, odc_["norms"], gloo["norms"])
            assert_params_close(gloo["params"], odc_["params"], 1e-5)
        msg = res["inside"]
        assert "blocks.1._flat_param" in msg and "minibatch 0" in msg, msg
        msg = res["inside/orig"]  # use_orig_params=True: the original parameter is named
        assert "blocks.1.up.bias" in msg and "minibatch 0" in msg, msg


def test_fsdp1_settings_odc_cannot_serve_are_refused_by_name_and_enable_nothing():
    out = all_ok(run_ranks(W.refusals_worker, 2, timeout=120))
    for res in out.values():
        assert "CPUOffload" in res["offload"], res["offload"]
        assert "NO_SHARD" in res["no_shard"] and "FULL_SHARD" in res["no_shard"], res["no_shard"]
        # Without a mesh, on one host without GPUs, FSDP1 makes HYBRID_SHARD a one-rank NO_SHARD group per rank.
        assert "process group of one rank" in res["hybrid"], res["hybrid"]
        msg = res["sharding=hybrid-zero"]
        assert "sharding='hybrid-zero'" in msg and "FSDP2" in msg, msg
        msg = res["sharding=hybrid"]  # a FULL_SHARD model under sharding="hybrid"
        assert "ShardingStrategy.FULL_SHARD and sharding='hybrid'" in msg and "sharding='full'" in msg, msg
        assert not any(res[k + "_enabled"] for k in ("offload", "no_shard", "hybrid")), res


def test_every_private_fsdp1_name_missing_in_turn_is_a_config_error_that_enables_nothing():
    from odc.fsdp._fsdp1 import PRIVATE_FSDP1

    out = all_ok(run_ranks(W.missing_names_worker, 1, timeout=120))[0]
    owners = ("FullyShardedDataParallel", "FlatParamHandle", "FlatParameter")
    expected = {f"{n.owner}.{n.name}" for n in PRIVATE_FSDP1
                if n.owner in owners and n.name not in ("_saved_grad_shard", "_inter_node_pg")}
    assert set(out) == expected and len(expected) >= 9, sorted(set(out) ^ expected)
    for key, msg in out.items():
        assert f"has no {key.split('.')[1]!r}" in msg and "FSDP1" in msg and "left enabled" not in msg, (key, msg)


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
def test_a_rank_dying_mid_minibatch_is_named_by_its_peer_not_a_hang(orig):
    out = run_ranks(W.death_worker, 2, timeout=120, orig=orig)
    assert out[1] == ("exited", 3), out[1]
    status, res = out[0]
    assert status == "ok", out[0]
    assert res["peer_error"] and res["peer"] == 1 and res["step"] == 1, res
    assert "rank 1" in res["message"], res["message"]
    assert res["seconds"] < 20, res  # named well before the 20 s deadline (a death, not a timeout)
