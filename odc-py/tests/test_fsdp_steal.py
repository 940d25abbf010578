"""Work stealing with odc.fsdp.microbatches: 4 CPU ranks, one slowed down, uneven lists.

Every microbatch of every list must run exactly once (the claims are exact
whoever races), the training must match one process on all microbatches,
and the slow rank's list must be stolen from.
"""

from __future__ import annotations

import _fsdp_helpers as H
import pytest
from _dist import run_ranks

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD = 4
# Microbatches per rank's list at each step; rank 0 is slow (it sleeps per microbatch it runs).
COUNTS = ((6, 1, 0, 1), (0, 0, 3, 2), (2, 2, 2, 2))


@pytest.mark.parametrize("transport", ["shm", "fabric"])
def test_every_microbatch_runs_once_and_training_matches_one_process(transport):
    out = H.all_ok(run_ranks(H.steal_worker, WORLD, timeout=300, counts=COUNTS, slow_rank=0, slow_s=0.15,
                             transport=transport))
    runs = [tuple(mb) for r in range(WORLD) for mb in out[r]["ran"]]
    everything = [(s, m, r) for s, plan in enumerate(COUNTS) for r in range(WORLD) for m in range(plan[r])]
    assert sorted(runs) == sorted(everything), "a microbatch ran twice or not at all"
    stolen = {r: [tuple(mb) for mb in out[r]["ran"] if mb[2] != r] for r in range(WORLD)}
    # The slow rank's long list of step 0 is stolen from; the slow rank steals nothing there.
    assert any(mb[0] == 0 and mb[2] == 0 for r in range(1, WORLD) for mb in stolen[r]), stolen
    assert sum(1 for mb in out[0]["ran"] if mb[0] == 0) < COUNTS[0][0], out[0]["ran"]
    assert out[0]["max_diff"] < 1e-5, out[0]["max_diff"]


def test_without_stealing_every_rank_runs_its_own_list():
    out = H.all_ok(run_ranks(H.steal_worker, WORLD, timeout=300, counts=COUNTS, slow_rank=0, slow_s=0.0,
                             transport="shm", steal=False))
    for r in range(WORLD):
        assert all(mb[2] == r for mb in out[r]["ran"]), out[r]["ran"]
        assert len(out[r]["ran"]) == sum(plan[r] for plan in COUNTS)
    assert out[0]["max_diff"] < 1e-5, out[0]["max_diff"]


@pytest.mark.parametrize(("who", "runs"), [(0, 2), (1, 2)])
def test_a_rank_dying_with_claimed_work_is_named(who, runs):
    # Rank 0 is the slow victim of step 0, rank 1 a thief of it: either dies after running `runs`
    # microbatches, holding work it claimed. Every survivor fails naming it (never a hang, never a
    # silently skipped microbatch).
    res = run_ranks(H.steal_worker, WORLD, timeout=180, counts=COUNTS, slow_rank=0, slow_s=0.15, transport="shm",
                    die=(who, runs))
    for r in range(WORLD):
        if r == who:
            continue
        status, value = res[r]
        assert status == "error", (r, status, value)
        kind, msg, peer, _ = value
        assert kind in ("PeerDied", "PeerTimeout"), (r, kind, msg)
        assert peer == who and f"rank {who}" in msg, (r, msg)
