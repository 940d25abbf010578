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


def _aggregator_dies_holding_a_node_buffer(rank, world, store, per_node):
    # Rank 0 sums node 0's gradients for rank 2 (the other node's local rank 0). Rank 1's chunk for rank 2
    # lands in rank 0's node buffer, rank 0 adds its own, and dies before its finish would push the sum.
    import os
    import time

    import torch

    import odc

    eng = odc.Engine(store, rank, world, local_world_size=per_node, transport="shm", cross_node="node",
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
    t0 = time.monotonic()
    try:
        eng.finish_minibatch(0)
    except odc.PeerError as e:
        return {"type": type(e).__name__, "peer": e.peer, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"type": None}


def test_an_aggregator_killed_holding_a_node_buffer_is_named_not_a_hang():
    # Under cross_node="node" a rank holds its node's sums for the other node's ranks of its local rank. Killed
    # with one node-mate's chunk in that buffer, the sum never goes: its owner (rank 2) and its node-mate
    # (rank 1, whose done waits on it) name rank 0 within the deadline; rank 3, whose gradients wait on rank 1
    # as its aggregator on node 0, names rank 0 or rank 1 (which failed first). Nobody hangs or finishes.
    res = run_ranks(_aggregator_dies_holding_a_node_buffer, WORLD, timeout=60, per_node=PER_NODE)
    assert res[0][0] != "ok", res
    for r, allowed in ((1, {0}), (2, {0}), (3, {0, 1})):
        status, out = res[r]
        assert status == "ok", (r, res[r])
        assert out["type"] in ("PeerDied", "PeerTimeout"), (r, out)
        assert out["peer"] in allowed and f"rank {out['peer']}" in out["message"], (r, out)
        assert out["elapsed"] < 5 + 10, (r, out)
