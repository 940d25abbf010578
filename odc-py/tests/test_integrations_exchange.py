"""odc.integrations._exchange: who runs which sample under LB-Mini, and moving the samples there."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _dist import run_ranks

import odc
from odc import packing
from odc.integrations import _exchange as X

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test


def _loads(runs, lengths, cost="verl"):
    return [sum(packing.sequence_cost(lengths[src][i], cost) for src, i in run) for run in runs]


def test_assign_balances_cost_and_keeps_the_most_tokens_in_place():
    lengths = [[63, 40, 12], [63, 40, 40]]
    runs = X.assign(lengths, max_tokens=64)
    # {63, 63} on one rank, {40, 40, 40, 12} on the other; rank 1 keeps its two 40s (80 tokens in place).
    assert runs == [[(0, 0), (1, 0)], [(0, 1), (0, 2), (1, 1), (1, 2)]]
    assert X.assign(lengths, max_tokens=64) == runs  # the same on every rank
    assert X.moves_anything(runs)
    before, after = _loads([[(r, i) for i in range(3)] for r in range(2)], lengths), _loads(runs, lengths)
    assert max(after) - min(after) < max(before) - min(before)


@pytest.mark.parametrize("lengths", [
    [[5, 6], [], [7]],
    [[900, 3, 3, 3, 3, 3], [4, 4], [2] * 9, [1000]],
    [[10], [10], [10]],
])
def test_assign_runs_every_sample_once_and_gives_every_rank_one(lengths):
    runs = X.assign(lengths, max_tokens=1024, cost="quadratic")
    flat = sorted(x for run in runs for x in run)
    assert flat == [(r, i) for r, ls in enumerate(lengths) for i in range(len(ls))]
    assert all(run for run in runs), runs  # as many samples as ranks here
    if all(len(ls) == 1 for ls in lengths):
        assert not X.moves_anything(runs)  # already balanced: nothing moves


def test_an_empty_part_takes_the_cheapest_sample_of_the_largest():
    parts = [[0, 1, 2], [], [3]]
    X._fill_empty(parts, [5.0, 1.0, 3.0, 9.0])
    assert parts == [[0, 2], [1], [3]]


def test_assign_names_a_sample_over_the_budget():
    with pytest.raises(odc.PackingError, match="65"):
        X.assign([[10, 65], [3]], max_tokens=64)
    assert X.assign([[], []], max_tokens=64) == [[], []]


def _exchange_worker(rank, world, store):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    outgoing = [b"" if (rank + d) % 3 == 0 else bytes([rank, d]) * (1 + 1000 * rank + d) for d in range(world)]
    got = X.exchange(outgoing, None)
    dist.destroy_process_group()
    return got


def test_exchange_delivers_each_payload_to_its_rank():
    out = run_ranks(_exchange_worker, 3, timeout=120)
    for rank in range(3):
        status, got = out[rank]
        assert status == "ok", out[rank]
        for src in range(3):
            want = b"" if (src + rank) % 3 == 0 else bytes([src, rank]) * (1 + 1000 * src + rank)
            assert got[src] == want, (rank, src, len(got[src]), len(want))


def test_each_trainer_integration_imports_or_names_the_torch_it_needs():
    """On torch 2.11 ``odc.integrations.torchtitan`` says torchtitan 0.3.0 needs torch 2.12 (a ConfigError, not
    torchtitan's ImportError); where torchtitan runs (make setup's torch 2.15) it imports."""
    import importlib.util
    import subprocess
    import sys

    import torch

    version = torch.__version__.split("+")[0]
    minor = tuple(int(x) for x in version.split(".")[:2])
    code = "import odc.integrations.torchtitan"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    if minor < (2, 12):
        assert p.returncode != 0 and "ConfigError" in p.stderr, p.stderr
        assert "needs torch 2.12 or newer" in p.stderr and f"this is torch {version}" in p.stderr, p.stderr
    elif importlib.util.find_spec("torchtitan") is not None:
        assert p.returncode == 0, p.stderr
    else:
        assert "ConfigError" in p.stderr and "fsdp-odc[torchtitan]" in p.stderr, p.stderr
