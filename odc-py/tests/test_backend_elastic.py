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


def _other_ops(rank, world, store, victim, at, transport):
    """The group's other collectives a loop asks of the world: a barrier, MAX / MIN / PRODUCT / BOR all-reduces and
    a broadcast (its payload's bits: -0.0, a NaN's payload, the largest int64), each step; then a broadcast from a
    rank of the dropped node."""
    os.environ.update(LOCAL_WORLD_SIZE=str(LOCAL), ODC_BACKEND_ELASTIC="1", ODC_TRANSPORT=transport)
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = odc.backend.get_process_group()
    out = {"steps": {}}
    payload = torch.tensor([-0.0, float("nan"), 1.5], dtype=torch.float32)
    payload.view(torch.int32)[1] = 0x7FC0_1234  # a NaN with a payload
    for k in range(STEPS):
        if rank == victim and k == at:
            os.kill(os.getpid(), signal.SIGKILL)
        hi = torch.tensor([rank + k + 0.5, -float(rank)], dtype=torch.float32)
        lo = torch.tensor([10 * rank + k], dtype=torch.int64)
        prod = torch.tensor([2.0 if rank % 2 else 1.0], dtype=torch.bfloat16)
        bits = torch.tensor([1 << rank], dtype=torch.int32)
        sent = payload.clone() if rank == 0 else torch.zeros(3)
        big = torch.tensor([2**63 - 1 - k], dtype=torch.int64) if rank == 0 else torch.zeros(1, dtype=torch.int64)
        try:
            dist.barrier()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(prod, op=dist.ReduceOp.PRODUCT)
            dist.all_reduce(bits, op=dist.ReduceOp.BOR)
            dist.broadcast(sent, src=0)
            dist.broadcast(big, src=0)
        except (odc.NodeDropped, odc.PeerDied) as e:
            return {"raised": type(e).__name__, "message": str(e), "k": k}
        out["steps"][k] = (hi.tolist(), lo.item(), prod.float().item(), bits.item(), sent.view(torch.int32).tolist(),
                           big.item())
    try:
        dist.broadcast(torch.zeros(2), src=victim ^ 1)
        out["dead_root"] = None
    except odc.PeerDied as e:
        out["dead_root"] = str(e)
    out["counts"] = dict(pg.op_counts)
    return out


def test_an_odc_groups_barrier_broadcast_and_other_reductions_go_on_over_the_surviving_nodes():
    victim, at = 3, 2
    dead = victim // LOCAL
    res = run_ranks(_other_ops, WORLD, timeout=180, victim=victim, at=at, transport="shm")
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    payload = torch.tensor([-0.0, 0.0, 1.5])
    payload.view(torch.int32)[1] = 0x7FC0_1234
    for r in survivors:
        assert res[r][0] == "ok" and "steps" in res[r][1], (r, res[r])
        out = res[r][1]
        for k, (hi, lo, prod, bits, sent, big) in out["steps"].items():
            ranks = [q for q in range(WORLD) if k < at or q // LOCAL != dead]
            assert hi == [max(ranks) + k + 0.5, -float(min(ranks))], (r, k, hi)
            assert lo == 10 * min(ranks) + k, (r, k, lo)
            assert prod == 2.0 ** sum(q % 2 for q in ranks), (r, k, prod)
            assert bits == sum(1 << q for q in ranks), (r, k, bits)
            assert sent == payload.view(torch.int32).tolist() and big == 2**63 - 1 - k, (r, k, sent, big)
        assert "rank 2" in out["dead_root"] and f"node {dead}" in out["dead_root"], out["dead_root"]
        assert out["counts"].get("odc-elastic:barrier") == STEPS, out["counts"]
    status, mate = res[victim ^ 1]
    assert (mate["raised"] if status == "ok" else mate[0]) in ("NodeDropped", "PeerDied"), res[victim ^ 1]
