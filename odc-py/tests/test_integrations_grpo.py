"""odc.integrations.transformers with TRL's ``GRPOTrainer`` against one process, on CPU.

Two ranks build a ``GRPOTrainer`` as a user's script does (tiny random Qwen2, FSDP2 through the training arguments,
gloo), add ``odc.integrations.transformers.enable(trainer)`` and train two steps: each step generates its
completions with transformers' ``generate`` (lengths 1 to 12 tokens, different on each rank), then each rank runs
its own completions in as few microbatches as the token budget allows, so the ranks run different counts. The
logged loss and grad norm of every step and the final parameters are held to plain torch in one process over the
completions and advantages the run generated (``_grpo_worker.reference``), for every loss type the integration runs:
the token-normalized ``dapo`` (TRL's default), ``cispo`` and ``vespo``, and the per-sequence ``grpo``, ``sapo``,
``luspo`` and ``dr_grpo``. Each refused setting names itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from _dist import need_hf, run_ranks

from odc import ConfigError

pytestmark = [pytest.mark.torch_versions, pytest.mark.hf]

need_hf()

RANK_PRELOAD = ["transformers.trainer", "accelerate", "datasets", "trl", "trl.trainer.grpo_trainer", "_hf_worker",
                "_grpo_worker"]

STEPS = 2
TOL = 1e-5
LOSS_TYPES = ["dapo", "grpo", "cispo", "vespo", "sapo", "luspo", "dr_grpo"]  # every one the integration runs


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import _grpo_worker as W

    out = run_ranks(W.suite_worker, 2, timeout=900, root=str(tmp_path_factory.mktemp("grpo")), steps=STEPS,
                    loss_types=LOSS_TYPES)
    for rank, (status, value) in out.items():
        assert status == "ok", (rank, status, value[3] if isinstance(value, tuple) and len(value) > 3 else value)
    return {rank: value for rank, (_, value) in out.items()}


def _logged(run):
    return [line for line in run["logs"] if "loss" in line and "train_loss" not in line]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_steps_match_one_process(two, loss_type):
    import _grpo_worker as W

    runs = [two[r][loss_type] for r in range(2)]
    assert all(r["enabled"] and r["class"] == "OdcGRPOTrainer" for r in runs), [(r["class"], r["enabled"])
                                                                                  for r in runs]
    assert all(len(r["rollouts"]) == STEPS for r in runs)
    ref = W.reference([r["rollouts"] for r in runs], STEPS, loss_type)
    # The RL case: completion lengths differ within and across ranks, and so do the ranks' microbatch counts.
    lengths = [[sum(m) for m in r["rollouts"][s]["completion_mask"]] for s in range(STEPS) for r in runs]
    assert len({n for per in lengths for n in per}) > 3, lengths
    assert any(runs[0]["counts"][s] != runs[1]["counts"][s] for s in range(STEPS)), [r["counts"] for r in runs]
    got = _logged(runs[0])
    assert len(got) == STEPS, got
    for step, (line, want) in enumerate(zip(got, ref["logs"], strict=True)):
        for key in ("loss", "grad_norm"):
            assert line[key] == pytest.approx(want[key], abs=TOL), (step, key, line, want)
    local = {"step_time"}  # each rank's own clock
    assert [{k: v for k, v in line.items() if k not in local} for line in _logged(runs[1])] == [
        {k: v for k, v in line.items() if k not in local} for line in got]  # every rank logged the same
    assert max(w["grad_norm"] for w in ref["logs"]) > 1e-3
    init = W.build_model().state_dict()
    moved = 0.0
    for key, want in ref["params"].items():
        np.testing.assert_allclose(runs[0]["params"][key], want, rtol=0, atol=TOL, err_msg=key)
        moved = max(moved, float(np.abs(want - init[key].numpy()).max()))
    assert moved > 100 * TOL, moved


REFUSED = {
    "beta": "beta=0.1",
    "bnpo": "loss_type='bnpo'",
    "iterations": "num_iterations=2",
    "generation": "steps_per_generation=4",
    "entropy": "top_entropy_quantile=0.5",
}


def test_unsupported_grpo_settings_are_refused_by_name(two):
    got = two[0]["refusals"]
    assert sorted(got) == sorted(REFUSED)
    for case, words in REFUSED.items():
        assert words in got[case], (case, got[case])


def test_a_ranks_completions_fill_microbatches_longest_first_under_the_budget():
    from odc.integrations import _hf_grpo

    # rows × the longest row ≤ 24: 16 alone; 12 and 11 together; 6, 5, 5 and 4 together (4 × 6 = 24).
    assert _hf_grpo.plan_rows([5, 16, 12, 6, 11, 4, 5], 24) == [[1], [2, 4], [3, 0, 6, 5]]
    assert _hf_grpo.plan_rows([30, 2], 24) == [[0], [1]]  # a row over the budget runs alone
    with pytest.raises(ConfigError, match="budget of 0 tokens"):
        _hf_grpo.plan_rows([3], 0)


def test_the_per_microbatch_normalizer_makes_the_ranks_losses_the_steps():
    from odc.integrations import _hf_grpo

    # Token means divide by num_items_in_batch / world × this / steps_per_generation: this must be the latter.
    assert _hf_grpo.accumulation("dapo", 4, 16, 2, 3) == 4.0
    # Row means divide the microbatch's mean over its 3 rows by this: 16 rows over 2 ranks make each row's share
    # world / rows_global = 1/8, so 3 rows' mean (1/3 each) needs 16 / (2 · 3).
    assert _hf_grpo.accumulation("grpo", 4, 16, 2, 3) == pytest.approx(16 / 6)
    with pytest.raises(ConfigError, match="loss_type='bnpo'"):
        _hf_grpo.accumulation("bnpo", 4, 16, 2, 3)
