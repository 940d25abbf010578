"""torch.compile'd FSDP2 models under ODC train as over gloo with the same compile (workers in _compile.py)."""

from __future__ import annotations

import _compile as C
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok, assert_runs_match

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

CASES = [(order, {}) for order in C.ORDERS] + [("blocks_before", {"deterministic": True}),
                                               ("blocks_before", {"steal": True})]


def test_compiled_blocks_and_whole_model_train_as_over_gloo():
    out = all_ok(run_ranks(C.compile_worker, 2, timeout=600, cases=CASES))
    for rank, res in out.items():
        dynamo = res.pop("dynamo")
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
