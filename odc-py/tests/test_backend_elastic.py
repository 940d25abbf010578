"""``ODC_BACKEND_ELASTIC=1``: an ``odc`` process group's sum-like all-reduces (the token count, a norm) go on over
the surviving nodes when a rank dies: 3 emulated nodes x 2 ranks, one rank SIGKILLed; every survivor's every
all-reduce is the sum over the member nodes of that all-reduce (integers exactly, beyond f32's 2^24), the dead
node's other rank raises, and the world size stays what it was."""

from __future__ import annotations

import datetime
import os
import signal

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD, LOCAL, STEPS, N = 6, 2, 5, 70_000  # N: more than one minibatch of the elastic engine (2^16 elements)


def _tokens(rank: int, k: int) -> int:
    return 2**40 + 1000 * (rank + 1) + k  # far beyond f32's exact integers


def _allreduces(rank, world, store, victim, at, transport):
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL), ODC_BACKEND_ELASTIC="1", ODC_TRANSPORT=transport)
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = odc.backend.get_process_group()
    out = {"steps": {}}
    for k in range(STEPS):
        if rank == victim and k == at:
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = torch.tensor([_tokens(rank, k), -rank], dtype=torch.int64)
        x = torch.arange(N, dtype=torch.float32) * (rank + 1)
        mean = torch.full((3,), float(rank + k), dtype=torch.bfloat16)
        try:
            dist.all_reduce(tokens)
            dist.all_reduce(x)
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        except (odc.NodeDropped, odc.PeerDied) as e:
            return {"raised": type(e).__name__, "message": str(e), "k": k}
        out["steps"][k] = (tokens.tolist(), x[:3].tolist() + x[-3:].tolist(), mean.float().tolist(),
                           pg.elastic_members)
    out["world"] = dist.get_world_size()
    out["events"] = [(e["kind"], e["node"]) for e in pg.elastic_events()]
    out["counts"] = dict(pg.op_counts)
    return out


@pytest.mark.parametrize("transport", ["shm", "mixed"])
def test_an_odc_groups_all_reduces_go_on_over_the_surviving_nodes(transport):
    victim, at = 3, 2
    dead = victim // LOCAL
    res = run_ranks(_allreduces, WORLD, timeout=180, victim=victim, at=at, transport=transport)
    assert res[victim] == ("hung", -signal.SIGKILL), res[victim]
    status, mate = res[victim ^ 1]
    assert (mate["raised"] if status == "ok" else mate[0]) in ("NodeDropped", "PeerDied"), res[victim ^ 1]
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    for r in survivors:
        assert res[r][0] == "ok" and "steps" in res[r][1], (r, res[r])
        out = res[r][1]
        assert out["world"] == WORLD and out["events"] == [("drop", dead)], (r, out["world"], out["events"])
        assert out["counts"].get("odc-elastic:allreduce") == 3 * STEPS, out["counts"]
        for k, (tokens, x, mean, members) in out["steps"].items():
            ranks = [q for q in range(WORLD) if k < at or q // LOCAL != dead]
            assert members == sorted({q // LOCAL for q in ranks}), (r, k, members)
            assert tokens == [sum(_tokens(q, k) for q in ranks), -sum(ranks)], (r, k, tokens)
            weight = sum(q + 1 for q in ranks)
            assert x == [i * weight for i in (0, 1, 2, N - 3, N - 2, N - 1)], (r, k)
            want = torch.tensor(sum(float(q + k) for q in ranks) / len(ranks), dtype=torch.bfloat16)
            assert mean == [want.item()] * 3, (r, k, mean)
