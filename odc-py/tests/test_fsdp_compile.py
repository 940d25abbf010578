"""torch.compile'd FSDP2 models under ODC train as over gloo with the same compile (workers in _compile.py)."""

from __future__ import annotations

import _compile as C
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok, assert_runs_match

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test
# The workers, and inductor's check of the CPU's vector instructions (_inductor_isa), once in the fork server.
RANK_PRELOAD = ["_compile", "_inductor_isa"]

CASES = [(order, {}) for order in C.ORDERS] + [("blocks_before", {"deterministic": True}),
                                               ("blocks_before", {"steal": True})]


def test_compiled_blocks_and_whole_model_train_as_over_gloo():
    """Each case over gloo and over ODC; then torchtitan's order (blocks compiled, then fully_shard) with a rank
    idle at two of the three steps against one process (gloo cannot run uneven counts)."""
    out = all_ok(run_ranks(C.compile_worker, 2, timeout=600, cases=CASES,
                           uneven=("blocks_before", [(3, 0), (0, 2), (1, 2)])))
    uneven = {rank: res.pop("uneven") for rank, res in out.items()}
    for rank, res in out.items():
        uneven[rank]["dynamo"] = dynamo = res.pop("dynamo")
        assert dynamo["graphs"] > 0 and not dynamo["breaks"], (rank, dynamo)  # compiled, without a graph break
        assert len(res) == len(CASES), res.keys()
        for name, runs in res.items():
            gloo, odc_ = runs["gloo"], runs["odc"]
            assert_runs_match((name, rank), gloo, odc_, clip=0.3)
            if "steal" in name:  # every microbatch ran exactly once, wherever (stealing itself is timing's)
                for s in range(3):
                    ran = sorted(tuple(x) for r in out for x in out[r][name]["odc"]["ran"][s])
                    assert ran == [(m, r) for m in range(2) for r in range(2)], (s, ran)
            want = 1 if name.startswith("whole") else 2  # the model, or its two blocks
            assert odc_["compiled"] == gloo["compiled"] == want, (name, odc_["compiled"], gloo["compiled"])
    _assert_uneven(uneven, "full")


def _assert_uneven(out, sharding):
    ref = out[0]["ref"]
    for rank, res in out.items():
        assert res["odc"]["sharding"] == sharding, (rank, res["odc"]["sharding"])
        assert res["odc"]["compiled"] == 2, (rank, res["odc"]["compiled"])  # both blocks, compiled before fully_shard
        assert res["dynamo"]["graphs"] > 0 and not res["dynamo"]["breaks"], (rank, res["dynamo"])
        assert_runs_match(("uneven", sharding, rank), ref, res["odc"], clip=0.3)


def test_compiled_blocks_under_hybrid_zero_with_uneven_counts_match_one_process():
    """sharding="hybrid-zero" on 2 emulated nodes x 2 ranks (gathers and pushes within the node), a node's
    rank idle at each step and a whole node idle at the second."""
    table = [(2, 0, 1, 1), (1, 2, 0, 0), (0, 1, 2, 1)]
    _assert_uneven(all_ok(run_ranks(C.uneven_worker, 4, timeout=600, order="blocks_before", table=table,
                                    odc_kw={"sharding": "hybrid-zero"}, per_node=2)), "hybrid-zero")
