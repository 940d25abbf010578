"""The test harness itself: ranks forked from the fork server see the test's environment and write to its
capture, and a rank that hangs is named with its stack."""

import os
import time

from _dist import run_ranks


def _stall_here_forever():
    time.sleep(600)


def _probe(rank, world, store):
    print(f"rank {rank} of {world} writes to the test's capture", flush=True)
    if rank == 1:
        _stall_here_forever()
    return os.environ.get("ODC_HARNESS_PROBE")


def test_ranks_see_the_tests_environment_write_to_its_capture_and_a_hung_rank_shows_its_stack(monkeypatch, capfd):
    monkeypatch.setenv("ODC_HARNESS_PROBE", "set by the test")
    start = time.monotonic()
    res = run_ranks(_probe, 2, timeout=4)
    assert res[0] == ("ok", "set by the test"), res
    assert res[1][0] == "hung", res
    assert time.monotonic() - start < 30
    out, err = capfd.readouterr()
    assert "rank 0 of 2 writes" in out and "rank 1 of 2 writes" in out, out
    assert "_stall_here_forever" in err, err  # faulthandler's dump of rank 1's threads
