"""odc.fsdp with sharding="hybrid-zero": 4 ranks on one host as 2 nodes × 2 (LOCAL_WORLD_SIZE=2).

FSDP2 shards over every rank (its 1-D mesh), so the optimizer state is 1/D per
rank; ODC keeps node shards (gathers and pushes stay inside a node), reduces
each rank's piece across the nodes and exchanges the updated pieces at
publish. Checked against a single-process reference and against
sharding="full" on the same plan, with uneven and per-node idle microbatch
counts, and for a rank dying on the other node (the meshes it refuses:
test_fsdp_hybrid.py).
"""

from __future__ import annotations

import _fsdp_helpers as H
import pytest
from _dist import run_ranks

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD, PER_NODE = 4, 2
# Microbatches per rank at each step: ranks 0-1 are node 0, ranks 2-3 node 1.
# Step 1 leaves node 0 idle, step 2 node 1.
TABLE = ((2, 0, 1, 3), (0, 0, 2, 1), (1, 2, 0, 0), (3, 1, 1, 0))


# The second case also accumulates deterministically (both modes): the same checks hold.
@pytest.mark.parametrize(("transport", "torch_clip", "deterministic"), [("auto", False, False), ("shm", True, True)])
def test_uneven_microbatches_match_single_process_and_full(transport, torch_clip, deterministic):
    out = H.all_ok(run_ranks(H.hybrid_zero_worker, WORLD, timeout=300, per_node=PER_NODE, table=TABLE,
                             transport=transport, torch_clip=torch_clip, deterministic=deterministic))
    ref = out[0]
    for r, res in out.items():
        hz, full = res["hybrid-zero"], res["full"]
        assert hz["sharding"] == "hybrid-zero" and full["sharding"] == "full", r
        assert hz["transport"] == ("shm+fabric" if transport == "auto" else "shm"), hz["transport"]
        # Node shards in the engine: 2 blocks (one per node) per local owner, and the
        # piece a rank publishes and reads gradients for is 1/D of the bucket.
        for bz, bf in zip(hz["buckets"], full["buckets"], strict=True):
            assert bz["blocks"] == WORLD // PER_NODE and bz["shard_len"] == 2 * bz["piece_len"], bz
            assert bz["piece_len"] == bf["piece_len"] == bf["shard_len"], (bz, bf)
        # AdamW's state is 1/D of every parameter, as under full sharding (not 1/G, as under hybrid).
        # (FSDP2 shards dim 0: rank r holds at most ceil(rows / D) rows.)
        for name, (state, local, rows, total) in hz["state"].items():
            assert state == local == full["state"][name][0], (r, name)
            assert local <= -(-rows // WORLD) * (total // rows), (r, name, local, total)
        assert hz["norms"] == pytest.approx(ref["ref_norms"], rel=1e-5), (r, hz["norms"])
        assert hz["norms"] == pytest.approx(full["norms"], rel=1e-6), r
    # Three layouts of one computation: hybrid-zero ends where full ends and where one process ends.
    H.assert_params_close(out[0]["hybrid-zero"]["params"], out[0]["full"]["params"], 1e-6)
    assert ref["max_diff"]["hybrid-zero"] < 1e-5, ref["max_diff"]
    assert ref["max_diff"]["full"] < 1e-5, ref["max_diff"]


def test_reshard_after_forward_int_regathers_within_the_node_as_with_true():
    """reshard_after_forward=2 (a node's ranks: FSDP2 keeps half of each gathered parameter after the forward and
    re-gathers over the node in the backward, ZeRO++'s hpZ) against True on the same plan: the same norms and
    parameters, bit for bit (deterministic sums: otherwise the order the pushes land in moves the last bits),
    and one process's. The re-gathers are served from hybrid-zero's node copy, which every gather reads within
    the node."""
    modes = (("hybrid-zero", PER_NODE), ("hybrid-zero", True))
    out = H.all_ok(run_ranks(H.hybrid_zero_worker, WORLD, timeout=300, per_node=PER_NODE, table=TABLE,
                             transport="auto", deterministic=True, modes=modes))
    ref = out[0]
    int_, true = "hybrid-zero,reshard=2", "hybrid-zero"
    for r, res in out.items():
        assert res[int_]["sharding"] == res[true]["sharding"] == "hybrid-zero", r
        assert res[int_]["norms"] == res[true]["norms"], (r, res[int_]["norms"], res[true]["norms"])
        assert res[int_]["norms"] == pytest.approx(ref["ref_norms"], rel=1e-5), (r, res[int_]["norms"])
        # One re-gather per block per microbatch this rank ran (the root, resharded too, is gathered again
        # for its backward as well); none with True, whose backward gathers as its forward does.
        runs = sum(plan[r] for plan in TABLE)
        assert res[int_]["regathers"] >= 2 * runs > 0 and res[true]["regathers"] == 0, (r, res[int_]["regathers"])
        assert res[int_]["params"] == res[true]["params"], r
    assert ref["max_diff"][int_] < 1e-5, ref["max_diff"]


@pytest.mark.parametrize("victim", [2, 3])
def test_a_rank_dying_on_the_other_node_is_named(victim):
    res = run_ranks(H.hybrid_zero_death_worker, WORLD, timeout=120, per_node=PER_NODE, victim=victim,
                    transport="shm")
    survivors = [r for r in range(WORLD) if r != victim]
    for r in survivors:
        status, value = res[r]
        assert status == "error", (r, status, value)
        kind, msg, peer, _ = value
        assert kind in ("PeerDied", "PeerTimeout"), (r, kind, msg)
        assert peer is not None and f"rank {peer}" in msg, (r, msg)
    # The victim's column on node 0 waits on it directly and names it.
    column = victim - PER_NODE
    assert res[column][1][2] == victim, res[column][1][:2]


def test_example_runs_hybrid_zero_with_uneven_counts():
    H.run_hybrid_example("hybrid-zero")
