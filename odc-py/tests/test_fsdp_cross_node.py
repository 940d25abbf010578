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
