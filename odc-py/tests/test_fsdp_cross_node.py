"""odc.fsdp under full sharding across nodes with cross_node="node": 4 ranks on one host as 2 nodes × 2.

LOCAL_WORLD_SIZE=2 and transport "auto": shared memory inside a node,
libfabric between the two. Node-mates' gradients for an owner on the other
node are summed on the node and pushed once per node when its last rank
finished the minibatch; remote shards are read through the node cache.
Checked against a single-process reference with uneven microbatch counts,
a whole node idle at a step.
"""

from __future__ import annotations

import _fsdp_helpers as H
import _loops as L
import pytest
from _dist import run_ranks

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD, PER_NODE = 4, 2
# Microbatches per rank at each step: ranks 0-1 are node 0, ranks 2-3 node 1.
# Step 1 leaves node 0 idle, step 2 node 1.
TABLE = ((2, 0, 1, 3), (0, 0, 2, 1), (1, 2, 0, 0), (3, 1, 1, 0))


def test_node_sums_match_single_process_with_a_whole_node_idle():
    out = H.all_ok(run_ranks(H.hybrid_zero_worker, WORLD, timeout=240, per_node=PER_NODE, table=TABLE,
                             transport="auto", modes=(("full", True),), cross_node="node"))
    for r in range(WORLD):
        info = out[r]["full"]
        assert info["transport"] == "shm+fabric", info["transport"]
        assert info["cross_node"] == "node", info["cross_node"]
        assert info["norms"] == pytest.approx(out[0]["ref_norms"], rel=1e-5), (r, info["norms"])
        # Every remote shard version crossed once per node and served the rest.
        cache = info["cache"]
        assert cache is not None and cache["fetched"] + cache["hits"] > 0, cache
        assert cache["direct"] == 0, cache
    node = [out[r]["full"]["cache"] for r in range(PER_NODE)]
    assert sum(c["hits"] for c in node) >= sum(c["fetched"] for c in node), node
    assert out[0]["max_diff"]["full"] < 1e-5, out[0]["max_diff"]


def test_hf_models_in_users_loops_across_nodes_match_one_process(monkeypatch):
    # What users run, across 2 emulated nodes x 2 on shm+fabric (node cache, node sums, versions and dones once
    # per node): a tiny Qwen2 in an HF Trainer-like loop (torch's own clip_grad_norm_, an LR scheduler) and a
    # tiny Llama in a torchtitan-like one, TABLE's first 3 steps (a whole node idle at step 1). Every rank's
    # grad norms are one process's on the whole batch and the norm of the ranks' own shards before the clip,
    # and the result is one process's on the whole batch.
    L.quiet()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(PER_NODE))
    monkeypatch.setenv("ODC_TRANSPORT", "auto")
    variants = [{"loop": "hf", "model": "qwen2"}, {"loop": "titan", "model": "llama"}]
    out = H.all_ok(run_ranks(L.loops_worker, WORLD, timeout=600, variants=variants, plan=list(TABLE[:3])))
    for i, variant in enumerate(variants):
        got = out[0][i]["odc"]
        assert (got["transport"], got["cross_node"]) == ("shm+fabric", "node"), (variant, got["transport"])
        L.assert_norms_from_shards({r: out[r][i]["odc"] for r in range(WORLD)}, out[0][i]["ref"], str(variant))
        L.assert_close(got, out[0][i]["ref"], 1e-5, 1e-4, str(variant))


def test_an_hf_model_across_nodes_on_the_emulated_device_plane_matches_one_process(monkeypatch):
    # nvshmem's path across nodes, emulated in host memory with jittered streams (emu-shmem): the node cache's slots
    # and the node buffers are "device" memory, each fill marked ready and each node sum pushed by work on a stream.
    # A tiny Qwen2 in an HF Trainer-like loop, a whole node idle at step 1: one process's result on the whole batch.
    L.quiet()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(PER_NODE))
    monkeypatch.setenv("ODC_TRANSPORT", "emu-shmem")
    monkeypatch.setenv("ODC_CROSS_NODE", "node")
    monkeypatch.setenv("ODC_EMU_JITTER_US", "50")
    variant = {"loop": "hf", "model": "qwen2"}
    out = H.all_ok(run_ranks(L.loops_worker, WORLD, timeout=600, variants=[variant], plan=list(TABLE[:3])))
    got = out[0][0]["odc"]
    assert (got["transport"], got["cross_node"]) == ("emu-shmem", "node"), got["transport"]
    for rank in range(WORLD):
        cache = out[rank][0]["odc"]["cache"]
        assert cache is not None and cache["direct"] == 0 and cache["taken_over"] == 0, (rank, cache)
    L.assert_norms_from_shards({r: out[r][0]["odc"] for r in range(WORLD)}, out[0][0]["ref"], str(variant))
    node = [out[r][0]["odc"]["cache"] for r in range(PER_NODE)]
    assert sum(c["fetched"] for c in node) > 0 and sum(c["hits"] for c in node) >= sum(c["fetched"] for c in node), node
    L.assert_close(got, out[0][0]["ref"], 1e-5, 1e-4, str(variant))


def _peer_error(fn):
    """Runs ``fn``; the peer error it raised (type, peer, message, seconds it took) or ``{"type": None}``."""
    import time

    import odc

    t0 = time.monotonic()
    try:
        fn()
    except odc.PeerError as e:
        return {"type": type(e).__name__, "peer": e.peer, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"type": None}


def _aggregator_dies_holding_a_node_buffer(rank, world, store, per_node, transport):
    # Rank 0 sums node 0's gradients for rank 2 (the other node's local rank 0). Rank 1's chunk for rank 2
    # lands in rank 0's node buffer, rank 0 adds its own, and dies before its finish would push the sum.
    import os
    import time

    import torch

    import odc

    eng = odc.Engine(store, rank, world, local_world_size=per_node, transport=transport, cross_node="node",
                     timeout=5, job_key=f"pytest-nodebuf-{os.getppid()}")
    eng.register([odc.Bucket("a", 4096, torch.float32)])
    eng.publish("a", torch.zeros(eng.bucket("a")["shard_len"]), 0)
    assert eng.cross_node == "node", eng.cross_node
    if rank == 1:
        eng.scatter_accumulate("a", torch.ones(4096))
        store.set("pushed", "1")
    if rank == 0:
        store.wait(["pushed"])
        eng.scatter_accumulate("a", torch.ones(4096))
        time.sleep(0.5)  # rank 1's chunk acknowledged into the buffer
        os._exit(3)
    if rank >= 2:
        eng.scatter_accumulate("a", torch.ones(4096))
    return _peer_error(lambda: eng.finish_minibatch(0))


# emu-shmem: the node buffer in (emulated) device memory, added on the aggregator's daemon stream.
@pytest.mark.parametrize("transport", ["shm", "emu-shmem"])
def test_an_aggregator_killed_holding_a_node_buffer_is_named_not_a_hang(transport):
    # Under cross_node="node" a rank holds its node's sums for the other node's ranks of its local rank. Killed
    # with one node-mate's chunk in that buffer, the sum never goes: its owner (rank 2) and its node-mate
    # (rank 1, whose done waits on it) name rank 0 within the deadline; rank 3, whose gradients wait on rank 1
    # as its aggregator on node 0, names rank 0 or rank 1 (which failed first). Nobody hangs or finishes.
    res = run_ranks(_aggregator_dies_holding_a_node_buffer, WORLD, timeout=60, per_node=PER_NODE, transport=transport)
    assert res[0][0] != "ok", res
    for r, allowed in ((1, {0}), (2, {0}), (3, {0, 1})):
        status, out = res[r]
        assert status == "ok", (r, res[r])
        assert out["type"] in ("PeerDied", "PeerTimeout"), (r, out)
        assert out["peer"] in allowed and f"rank {out['peer']}" in out["message"], (r, out)
        assert out["elapsed"] < 5 + 10, (r, out)


def _relay_dies_before_a_version(rank, world, store, per_node):
    # Over shm+fabric an owner announces its version to one rank of each other node (its local rank there), whose
    # node-mates read it from that rank's control region. Rank 0 hears rank 2's versions for node 0 and dies
    # after publishing its own shard; node 1 then publishes, and rank 1's gather waits on a word rank 0 will never
    # raise.
    import os
    import time

    import torch

    import odc

    eng = odc.Engine(store, rank, world, local_world_size=per_node, transport="auto", cross_node="node",
                     timeout=5, job_key=f"pytest-relay-{os.getppid()}")
    eng.register([odc.Bucket("a", 4096, torch.float32)])
    assert eng.transport == "shm+fabric" and eng.cross_node == "node", (eng.transport, eng.cross_node)
    shard = torch.full((eng.bucket("a")["shard_len"],), float(rank))
    if rank < 2:
        eng.publish("a", shard, 0)
    if rank == 0:
        store.set("relay-gone", "1")
        os._exit(3)
    store.wait(["relay-gone"])
    time.sleep(0.3)

    def minibatch():
        if rank >= 2:
            eng.publish("a", shard, 0)  # its announce to node 0 goes to rank 2's local rank there: rank 0
        eng.gather("a", 0, torch.empty(4096))
        eng.finish_minibatch(0)

    return _peer_error(minibatch)


def test_a_dead_node_mate_that_hears_an_owners_versions_is_named_not_the_owner():
    # Rank 1 waits for rank 2's version in rank 0's control region: it names rank 0 (dead) within the deadline,
    # not rank 2 (alive, published) at it. Ranks 2 and 3 fail on rank 0 too (their announce or its shard).
    res = run_ranks(_relay_dies_before_a_version, WORLD, timeout=60, per_node=PER_NODE)
    assert res[0][0] != "ok", res
    for r in (1, 2, 3):
        status, out = res[r]
        assert status == "ok", (r, res[r])
        assert out["type"] == "PeerDied", (r, out)
        assert out["peer"] == 0 and "rank 0" in out["message"], (r, out)
        assert out["elapsed"] < 5, (r, out)
    # Rank 1 names it at its first probe (shared memory), not after rank 2 fails on it over the network (3 s).
    assert "the versions rank 2 announces to this node through it" in res[1][1]["message"], res[1]
    assert res[1][1]["elapsed"] < 2, res[1]
