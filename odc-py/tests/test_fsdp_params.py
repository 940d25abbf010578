"""The parameter side of the loop contract (a change between minibatches reaches every peer) and its edges.

A peer's gather reads the owner's published copy; ODC publishes at the owner's first operation of each
minibatch, so a load, a second optimizer or an in-place edit made after the step is what the peers gather,
as under FSDP2's collectives. Workers in _params.py.
"""

from __future__ import annotations

import math

import _params as P
import pytest
from _dist import run_ranks
from _fsdp_helpers import all_ok, assert_runs_match

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test


def test_parameters_changed_between_minibatches_reach_every_peer_as_over_gloo():
    """Loads (after enable, full and sharded state dicts), in-place edits, clamps, a second optimizer, and an
    EMA-style swap evaluated inside odc.fsdp.evaluation (its losses as over gloo, training unchanged by it)."""
    out = all_ok(run_ranks(P.param_edits_worker, 2, timeout=300))
    for rank, res in out.items():
        for edit, runs in res.items():
            gloo, odc_ = runs["gloo"], runs["odc"]
            assert_runs_match((edit, rank), gloo, odc_, clip=0.05)
            assert len(odc_["evals"]) == len(gloo["evals"]) == (2 if edit == "ema_eval" else 0), (edit, odc_)
            for x, y in zip(odc_["evals"], gloo["evals"], strict=True):
                assert math.isclose(x, y, rel_tol=1e-5), (edit, rank, odc_["evals"], gloo["evals"])


def test_a_parameter_changed_inside_a_minibatch_is_refused_naming_it():
    out = all_ok(run_ranks(P.inside_edit_worker, 2, timeout=120))
    for rank, msg in out.items():
        assert msg.startswith("ProtocolError"), (rank, msg)
        assert "blocks.1.up.weight" in msg and "minibatch 0" in msg, msg
        assert "between minibatches" in msg, msg


def test_leaving_microbatches_early_is_named_at_the_minibatch_finish():
    out = all_ok(run_ranks(P.left_early_worker, 2, timeout=120))
    assert out[1] == "no error", out[1]
    assert out[0].startswith("ProtocolError") and "indices [1, 2]" in out[0] and "minibatch 0" in out[0], out[0]


def test_a_parameter_frozen_after_enable_is_refused_naming_it_and_trains_frozen_after_a_re_enable():
    out = all_ok(run_ranks(P.frozen_after_enable_worker, 2, timeout=120))
    for rank, res in out.items():
        msg = res["error"]
        assert msg.startswith("ConfigError") and "blocks.0.up.weight (frozen)" in msg, (rank, msg)
        assert "odc.fsdp.disable" in msg, msg
        assert res["frozen_moved"] == 0.0 and res["grad"], (rank, res)


def test_evaluation_mid_minibatch_or_with_a_backward_is_refused_naming_it():
    out = all_ok(run_ranks(P.evaluation_misuse_worker, 2, timeout=120))
    for rank, (mid, backward) in out.items():
        assert mid.startswith("ProtocolError") and "entered during minibatch 0" in mid, (rank, mid)
        assert "between minibatches" in mid, mid
        assert backward.startswith("ProtocolError") and "torch.no_grad()" in backward, (rank, backward)
