"""odc.fsdp with sharding="hybrid": 4 ranks on one host as 2 nodes × 2 (LOCAL_WORLD_SIZE=2).

Gathers and pushes stay inside a node; the engine sums gradient shards across
the nodes once per minibatch. Checked against a single-process reference with
uneven (and per-node zero) microbatch counts, against FSDP2's own HSDP over
gloo, for the errors a wrong mesh must give, and through the example.
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


# torch's clip runs with deterministic accumulation: the same checks hold.
@pytest.mark.parametrize("torch_clip", [False, True])
def test_uneven_microbatches_match_single_process(torch_clip):
    # transport "auto": shared memory inside a node, libfabric between the two
    # (test_parity_with_fsdp2_hsdp_over_gloo runs on shared memory alone).
    out = H.all_ok(run_ranks(H.hybrid_uneven_worker, WORLD, timeout=240, per_node=PER_NODE, table=TABLE,
                        transport="auto", torch_clip=torch_clip, deterministic=torch_clip))
    for r, info in out.items():
        assert info["sharding"] == "hybrid", info["sharding"]
        assert info["transport"] == "shm+fabric", info["transport"]
        # Forward, backward and the optimizer step issue no collective: FSDP's HSDP all-reduce
        # stays off, set_requires_gradient_sync(True) notwithstanding. torch's clip all-reduces
        # its norm once per minibatch on every rank, those with no microbatch too; ODC's does not.
        assert info["comms"] == ({"c10d_functional.all_reduce": 1} if torch_clip else {}), (r, info["comms"])
        assert info["all_reduce_off"] and info["all_reduce_restored"], r
        assert info["norms"] == pytest.approx(out[0]["ref_norms"], rel=1e-5), (r, info["norms"])
    # Node replicas step bitwise-identical gradients: equal shards on both nodes.
    for r in range(PER_NODE):
        assert out[r]["shards"] == out[r + PER_NODE]["shards"], r
    assert out[0]["max_diff"] < 1e-5, out[0]["max_diff"]


def test_parity_with_fsdp2_hsdp_over_gloo():
    variants = ("fp32", "forcesum", "divide")
    out = H.all_ok(run_ranks(H.hybrid_parity_worker, WORLD, timeout=300, per_node=PER_NODE, variants=variants,
                        transport="shm"))
    for rank, res in out.items():
        for name in variants:
            gloo, odc_ = res[name]["gloo"], res[name]["odc"]
            assert gloo[0] == pytest.approx(odc_[0], rel=1e-5, abs=1e-6), (name, rank)
            assert gloo[1] == pytest.approx(odc_[1], rel=1e-5), (name, rank)  # clipped norms
            H.assert_params_close(gloo[2], odc_[2], 1e-5)


def test_wrong_meshes_are_refused_clearly():
    found = H.all_ok(run_ranks(H.hybrid_errors_worker, WORLD, timeout=180, per_node=PER_NODE))[0]
    assert "unknown sharding 'hsdp'" in found["unknown"] and "'hybrid'" in found["unknown"], found
    assert "2-D mesh" in found["one_d"] and "init_device_mesh" in found["one_d"], found
    assert "sharding='hybrid'" in found["full_on_2d"], found
    assert "shard dimension has 4 ranks" in found["wide"] and "(2, 2)" in found["wide"], found
    assert "different nodes" in found["across"] and "[0, 2]" in found["across"], found
    assert "set_requires_all_reduce(True)" in found["all_reduce_on"], found
    assert "sharding='hybrid-zero'" in found["zero_on_2d"] and "1-D mesh" in found["zero_on_2d"], found
    assert "not whole nodes of 3" in found["zero_uneven"] and "LOCAL_WORLD_SIZE=3" in found["zero_uneven"], found


def test_example_runs_hybrid():
    H.run_hybrid_example("hybrid")
