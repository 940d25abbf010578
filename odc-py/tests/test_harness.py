"""The test harness itself: ranks forked from the fork server see the test's environment and write to its
capture, and a rank that hangs is named with its stack; the fork servers preload modules that exist."""

import ast
import importlib.util
import os
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest
from _dist import PRELOAD, run_ranks

from odc.bench import launch, memory, train


def _stall_here_forever():
    time.sleep(600)


def _ready(rank, world, store):
    return rank


def _probe(rank, world, store):
    print(f"rank {rank} of {world} writes to the test's capture", flush=True)
    if rank == 1:
        _stall_here_forever()
    return os.environ.get("ODC_HARNESS_PROBE")


def test_ranks_see_the_tests_environment_write_to_its_capture_and_a_hung_rank_shows_its_stack(monkeypatch, capfd):
    monkeypatch.setenv("ODC_HARNESS_PROBE", "set by the test")
    run_ranks(_ready, 1, timeout=300)  # the fork server's start (its preload) is not what the time below bounds
    start = time.monotonic()
    res = run_ranks(_probe, 2, timeout=4)
    assert res[0] == ("ok", "set by the test"), res
    assert res[1][0] == "hung", res
    assert time.monotonic() - start < 30
    out, err = capfd.readouterr()
    assert "rank 0 of 2 writes" in out and "rank 1 of 2 writes" in out, out
    assert "_stall_here_forever" in err, err  # faulthandler's dump of rank 1's threads


@pytest.mark.parametrize("rank_fn", [train.train_rank, memory.memory_rank])
def test_the_fork_servers_preload_modules_that_exist(rank_fn, monkeypatch):
    """A fork server skips a module it cannot import without a word, so a renamed module would quietly put its
    import back into every rank (seconds each): every module the test and benchmark fork servers preload is
    found here, and a benchmark's server preloads what its rank function's module lists."""
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", None)  # restored after the test
    launch._context(rank_fn)
    preload = forkserver._forkserver._preload_modules
    module = importlib.import_module(rank_fn.__module__)
    assert {rank_fn.__module__, *module.RANK_PRELOAD} <= set(preload), preload
    for name in [*PRELOAD, *preload]:
        assert importlib.util.find_spec(name) is not None, f"{name} is preloaded but cannot be imported here"


def test_the_test_modules_rank_preloads_exist_where_their_package_is_installed():
    """What a test module lists in RANK_PRELOAD (the fork server imports it when the module's tests run, see
    _dist.preload_for) is found wherever its package is installed: a renamed module would quietly cost every
    rank its import again."""
    listed = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "RANK_PRELOAD" for t in node.targets):
                listed[path.name] = ast.literal_eval(node.value)
    assert "test_integrations_torchtitan.py" in listed, listed
    for file, names in listed.items():
        for name in names:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                assert importlib.util.find_spec(name) is not None, f"{file} preloads {name}, which is not found"
