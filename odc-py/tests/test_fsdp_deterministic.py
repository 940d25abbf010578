"""Deterministic accumulation (``odc.fsdp.enable(..., deterministic=True)``): with work stealing and random
per-rank delays, which rank runs which microbatch and when its gradient reaches each owner change from run to
run; the final parameters must not change by a single bit, and must still match one process.
"""

from __future__ import annotations

import _fsdp_helpers as H
import pytest
from _dist import run_ranks

import odc

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD = 4
# Microbatches per rank's list at each step (uneven, with an empty list).
COUNTS = ((5, 1, 0, 2), (0, 2, 3, 2), (2, 2, 2, 2))
RUNS = 5


def _run(seed, *, deterministic, transport="shm"):
    # A different slow rank and different delays in every run, so the steals differ.
    out = H.all_ok(run_ranks(H.steal_worker, WORLD, timeout=300, counts=COUNTS, slow_rank=seed % WORLD,
                             slow_s=0.05, transport=transport, jitter=seed, deterministic=deterministic))
    digests = {out[r]["digest"] for r in range(WORLD)}
    assert len(digests) == 1, "ranks disagree on the final parameters"
    who_ran = tuple(sorted((tuple(mb), r) for r in range(WORLD) for mb in out[r]["ran"]))
    return digests.pop(), who_ran, out[0]["max_diff"]


def test_final_parameters_are_bit_identical_over_five_runs_with_stealing_and_jitter():
    runs = [_run(seed, deterministic=True) for seed in range(RUNS)]
    digests = {d for d, _, _ in runs}
    assignments = {w for _, w, _ in runs}
    # Not vacuous: the runs split the microbatches among the ranks differently.
    assert len(assignments) > 1, "every run stole the same microbatches; the jitter did not vary the runs"
    assert len(digests) == 1, f"{len(digests)} different final parameters over {RUNS} runs"
    for _, _, diff in runs:
        assert diff < 1e-5, diff


def test_deterministic_over_fabric_matches_one_process():
    _, _, diff = _run(7, deterministic=True, transport="fabric")
    assert diff < 1e-5, diff


def test_deterministic_is_refused_on_a_device_transport():
    import torch.distributed as dist

    with pytest.raises(odc.ConfigError, match="deterministic accumulation runs on the host transports"):
        odc.Engine(dist.HashStore(), 0, 1, transport="emu-ipc", deterministic=True)
