"""The baselines' plans (odc.bench.baselines): verl's split to the largest count against verl's own functions on
verl's pins (with its data-parallel sync: tests/test_integrations_verl.py), padding, and what each keeps of the
samples."""

from __future__ import annotations

import importlib.util
import os
import random

import _baselines_worker
import pytest

from odc.bench import baselines


def _need_verl() -> None:
    if importlib.util.find_spec("verl") is None:
        if os.environ.get("ODC_REQUIRE_VERL") == "1":
            pytest.fail("ODC_REQUIRE_VERL=1, but verl is not installed here (make setup-torch211 installs it)")
        pytest.skip("verl is not installed here: make test runs this in .venv-torch211, on verl's own pins; "
                    "ODC_REQUIRE_VERL=1 makes this a failure")


def test_padding_runs_every_rank_to_the_largest_count_and_accumulation_at_least_one():
    assert baselines.padded_counts([3, 1, 0, 2], "pad") == [3, 3, 3, 3]
    assert baselines.padded_counts([3, 1, 0, 2], "accum") == [3, 1, 1, 2]
    assert baselines.padded_counts([3, 1, 0, 2], "odc") == [3, 1, 0, 2]


def test_verl_split_raises_every_rank_to_one_count_that_fits_every_rank():
    # Rank 0 alone fits 2 microbatches (40 + 30 twice); rank 1 needs 2 by tokens (180), but any 2-way split of
    # 60, 60, 60 holds 120 in one: no fit until 3. Both run 3.
    per_rank = [[40, 40, 30, 30], [60, 60, 60]]
    assert len(baselines._split_own(per_rank[0], 100, None)) == 2
    splits = baselines.verl_split(per_rank, 100, own=baselines._split_own)
    assert [len(s) for s in splits] == [3, 3]
    for lengths, split in zip(per_rank, splits, strict=True):
        assert sorted(i for mb in split for i in mb) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= 100 for mb in split)


def test_verl_maxcount_plan_equal_counts_every_sample_once_within_budget():
    rng = random.Random(1)
    lengths = [rng.randint(1, 2048) for _ in range(4 * 8 * 3)]
    plan = baselines.verl_maxcount_plan(lengths, 4, 8, 2048, verl=False)
    assert plan.source == "odc.bench.baselines" and plan.num_minibatches == 3 and plan.world_size == 4
    for m, ranks in enumerate(plan.minibatches):
        assert len({len(r) for r in ranks}) == 1  # verl raises every rank to the same count
        assert all(len(r) == 8 for r in [[i for mb in rank for i in mb] for rank in ranks])  # equal sample counts
        assert sorted(i for r in ranks for mb in r for i in mb) == list(range(m * 32, (m + 1) * 32))
        assert all(sum(lengths[i] for i in mb) <= 2048 for r in ranks for mb in r)
    assert plan.rank(1)[0] == [list(mb) for mb in plan.minibatches[0][1]]
    with pytest.raises(ValueError, match="equal parts"):
        baselines.verl_maxcount_plan(lengths[:30], 4, 8, 2048, verl=False)


@pytest.mark.verl
def test_the_transcription_is_verls_own_functions():
    _need_verl()
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions, karmarkar_karp

    rng = random.Random(0)  # the partition counts; the lengths come from split_cases
    for per_rank, budget in _baselines_worker.split_cases(0, 40, world=1):
        lengths = per_rank[0]
        workloads = baselines.verl_workload(lengths)
        for k in sorted({1, rng.randint(1, len(lengths)), len(lengths)}):
            for equal in (False, True):
                if not (equal and len(lengths) % k):
                    assert baselines.verl_karmarkar_karp(workloads, k, equal) == karmarkar_karp(workloads, k, equal)
            assert baselines._balanced_partitions(workloads, k, False) == get_seqlen_balanced_partitions(
                workloads, k, False)
        for floor in (None, rng.randint(1, len(lengths))):
            want = baselines._verl_split_own(lengths, budget, floor)
            assert baselines._split_own(lengths, budget, floor) == want, (lengths, budget, floor)
    lengths = [rng.randint(1, 2048) for _ in range(2 * 8 * 4)]
    ours, verls = (baselines.verl_maxcount_plan(lengths, 2, 8, 2048, verl=v) for v in (False, True))
    assert ours.minibatches == verls.minibatches and verls.source.startswith("verl ")
