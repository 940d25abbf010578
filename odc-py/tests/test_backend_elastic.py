"""``ODC_BACKEND_ELASTIC=1``: an ``odc`` process group's all-reduces (the token count, a norm) go on over the
surviving nodes when a rank dies: 3 emulated nodes x 2 ranks, one rank SIGKILLed; every survivor's every
all-reduce is the sum over the member nodes of that all-reduce (integers exactly, beyond f32's 2^24; f64 and bool
too), the dead node's other rank raises, and the world size stays what it was. An all-reduce is all or nothing: a
death between two of its engine minibatches gives the sum over the survivors in every element. Every dtype torch
has either runs elastically (as gloo reduces it) or is refused by name, never left to gloo."""

from __future__ import annotations

import datetime
import functools
import os
import signal
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc
import odc.backend._elastic as elastic

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

WORLD, LOCAL, STEPS, N = 6, 2, 5, 70_000  # N: more than one minibatch of the elastic engine (2^16 elements)


def _tokens(rank: int, k: int) -> int:
    return 2**40 + 1000 * (rank + 1) + k  # far beyond f32's exact integers


def _wide(rank: int, k: int) -> float:
    return 2.0**40 + 0.25 * rank + 1e-3 * k  # needs f64: f32 would round it to 2^40


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
        wide = torch.tensor([_wide(rank, k), -0.1 * rank], dtype=torch.float64)
        flags = torch.tensor([rank % 2 == 0, True, rank == 5])
        try:
            dist.all_reduce(tokens)
            dist.all_reduce(x)
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            dist.all_reduce(wide)
            every, some = flags.clone(), flags.clone()
            dist.all_reduce(every, op=dist.ReduceOp.MIN)
            dist.all_reduce(some)  # gloo's SUM of bools: any
        except (odc.NodeDropped, odc.PeerDied) as e:
            return {"raised": type(e).__name__, "message": str(e), "k": k}
        out["steps"][k] = (tokens.tolist(), x[:3].tolist() + x[-3:].tolist(), mean.float().tolist(),
                           pg.elastic_members, wide.tolist(), every.tolist() + some.tolist())
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
        assert out["counts"].get("odc-elastic:allreduce") == 6 * STEPS, out["counts"]
        assert not any(c.startswith("gloo:") for c in out["counts"]), out["counts"]
        for k, (tokens, x, mean, members, wide, flags) in out["steps"].items():
            ranks = [q for q in range(WORLD) if k < at or q // LOCAL != dead]
            assert members == sorted({q // LOCAL for q in ranks}), (r, k, members)
            assert tokens == [sum(_tokens(q, k) for q in ranks), -sum(ranks)], (r, k, tokens)
            weight = sum(q + 1 for q in ranks)
            assert x == [i * weight for i in (0, 1, 2, N - 3, N - 2, N - 1)], (r, k)
            want = torch.tensor(sum(float(q + k) for q in ranks) / len(ranks), dtype=torch.bfloat16)
            assert mean == [want.item()] * 3, (r, k, mean)
            # f64 summed in f64, in rank order: the same rounding as a fold over the member ranks' values here.
            want_wide = [functools.reduce(lambda a, b: a + b, [_wide(q, k) for q in ranks]),
                         functools.reduce(lambda a, b: a + b, [-0.1 * q for q in ranks])]
            assert wide == want_wide, (r, k, wide, want_wide)
            assert flags == [all(q % 2 == 0 for q in ranks), True, False,
                             any(q % 2 == 0 for q in ranks), True, 5 in ranks], (r, k, flags)


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


# -- all or nothing ----------------------------------------------------------------------------------
NODES3 = 3  # three nodes of one rank: the victim's death leaves two
BIG = 3 * elastic.CAPACITY + 5  # four minibatches of the elastic engine (8 limbs an element for int64: 32)


def _big(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent integer-valued data, exact in f32 sums over any of the ranks."""
    return ((torch.arange(BIG) % 251 + 1) * (rank + 1) - 100 * rank).to(dtype)


def _dies_inside(rank, world, store, victim, op, dtype):
    """The victim SIGKILLs itself once the first minibatch of the second all-reduce has completed on it: that
    minibatch's round has committed with its node, the next ones' rounds drop it."""
    os.environ.update(LOCAL_WORLD_SIZE="1", ODC_BACKEND_ELASTIC="1", ODC_TRANSPORT="shm")
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = odc.backend.get_process_group()
    warm = torch.ones(4)
    dist.all_reduce(warm)  # the engine exists, every node a member
    if rank == victim:
        elastic._after_minibatch = lambda i: os.kill(os.getpid(), signal.SIGKILL)
    x = _big(rank, dtype)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    after = _big(rank, dtype)
    dist.all_reduce(after, op=getattr(dist.ReduceOp, op))
    return {"x": x.tolist(), "after": after.tolist(), "members": pg.elastic_members,
            "redone": getattr(pg._elastic, "redone", None),
            "events": [(e["kind"], e["node"]) for e in pg.elastic_events()]}


@pytest.mark.parametrize(("op", "dtype"), [("SUM", torch.float32), ("AVG", torch.float32), ("SUM", torch.int64)])
def test_a_death_between_the_minibatches_of_one_all_reduce_gives_the_survivors_sum_in_every_element(op, dtype):
    """Before, each minibatch of an all-reduce had its own membership round: the first 65,536 elements summed
    three nodes, the rest two, and AVG divided all by two."""
    victim = 2
    res = run_ranks(_dies_inside, NODES3, timeout=180, victim=victim, op=op, dtype=dtype)
    assert res[victim][0] == "hung", res[victim]
    survivors = [r for r in range(NODES3) if r != victim]
    want = functools.reduce(torch.add, [_big(q, torch.int64) for q in survivors])
    want = want.to(dtype) if op == "SUM" else want.to(torch.float64).div(len(survivors)).to(dtype)
    for r in survivors:
        assert res[r][0] == "ok", (r, res[r])
        out = res[r][1]
        assert out["members"] == survivors and out["events"] == [("drop", victim)], (r, out["members"], out["events"])
        for name in ("x", "after"):
            bad = (torch.tensor(out[name], dtype=dtype) != want).nonzero().flatten()
            first = bad[:5].tolist()
            assert not first, (r, name, bad.numel(), first, [out[name][i] for i in first], want[first].tolist())
        assert out["redone"] == 1, (r, out["redone"])  # the kill did land between two minibatches of one call


# -- every dtype ---------------------------------------------------------------------------------------------
_OPS = ("SUM", "AVG", "PREMUL_SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _dtypes() -> list[torch.dtype]:
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Small integer-valued rank-dependent data in ``dtype`` (negative ones included), None where torch cannot make
    a tensor of it."""
    base = [[-1, 2, 3, 0, 5], [0, 1, -2, 7, 3], [0, 3, 1, -1, 6]][rank % 3]
    try:
        if dtype == torch.bool:
            return torch.tensor([v > 0 for v in base])
        return torch.tensor(base).to(dtype)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _op(name: str):
    return dist._make_nccl_premul_sum(0.5) if name == "PREMUL_SUM" else getattr(dist.ReduceOp, name)


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:
        return type(e).__name__, str(e)


def _every_dtype(rank, world, store):
    """Every dtype x reduce op: gloo's outcome and the elastic group's, side by side, on the same data."""
    os.environ.update(LOCAL_WORLD_SIZE="1", ODC_BACKEND_ELASTIC="1", ODC_TRANSPORT="shm")
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    gloo = dist.new_group(backend="gloo")
    pg = odc.backend.get_process_group()
    out = {}
    for dtype in _dtypes():
        if _value(rank, dtype) is None:
            continue
        for name in _OPS:
            def run(group, dtype=dtype, name=name):
                t = _value(rank, dtype)
                dist.all_reduce(t, op=_op(name), group=group)
                # Bytes, so that a float's sign of zero and NaN payloads count; bools by value: gloo's SUM leaves
                # the count in a bool's byte (an out-of-range bool, True as a value), ODC a proper True.
                plain = dtype.is_complex or dtype == torch.bool
                return t.tolist() if plain else t.view(torch.uint8).tolist()
            out[(str(dtype), name)] = (_outcome(lambda: run(gloo)), _outcome(lambda: run(None)))
        sent = _outcome(lambda dtype=dtype: _broadcast(rank, dtype))
        out[(str(dtype), "broadcast")] = sent
    out["counts"] = dict(pg.op_counts)
    return out


def _broadcast(rank, dtype):
    t = _value(1, dtype) if rank == 1 else torch.zeros_like(_value(0, dtype))
    dist.broadcast(t, src=1)
    return bool(torch.equal(t.view(torch.uint8), _value(1, dtype).view(torch.uint8))) if dtype.itemsize else None


def _local(dtype, name, world):
    """The reduction of every rank's data computed here, for what gloo refuses and ODC carries: int16 (gloo has no
    kernel for it) and PREMUL_SUM (gloo refuses the op), on data whose results are exact in every dtype."""
    rows = [_value(q, torch.int64) for q in range(world)]
    if name == "PREMUL_SUM":
        total = functools.reduce(torch.add, rows).to(torch.float64) * 0.5
        with warnings.catch_warnings():  # torch's "ComplexHalf support is experimental"
            warnings.simplefilter("ignore", UserWarning)
            return total.to(dtype).tolist() if dtype.is_complex else total.to(dtype).view(torch.uint8).tolist()
    fold = {"SUM": torch.add, "PRODUCT": torch.mul, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
            "BXOR": torch.bitwise_xor, "MIN": torch.minimum, "MAX": torch.maximum}[name]
    return functools.reduce(fold, rows).to(dtype).view(torch.uint8).tolist()


def test_every_dtype_on_an_elastic_group_runs_as_gloo_runs_it_or_is_refused_by_name():
    """Before, float64, bool and every dtype but f32 / bf16 / f16 / int8-int64 went to gloo over the full group
    (where they wait for a dead rank), and the AVG of int32 (-1, 0, 0) on 3 ranks gave 1431655765."""
    world = 3
    res = run_ranks(_every_dtype, world, timeout=300)
    for r in range(world):
        assert res[r][0] == "ok", (r, res[r])
    out = res[0][1]
    counts = out.pop("counts")
    assert not any(k.startswith(("gloo:allreduce", "gloo:broadcast")) for k in counts), counts
    ran = refused = 0
    for (dtype, name), got in out.items():
        if name == "broadcast":
            assert got == ("ok", True) or (got[0] == "ok" and got[1] is None), (dtype, got)
            continue
        (g_status, g_value), (o_status, o_value) = got
        if o_status == "ok":
            ran += 1
            if g_status == "ok":
                assert o_value == g_value, (dtype, name, "gloo", g_value, "odc", o_value)
            else:  # a dtype gloo has no kernel for (int16), an op gloo refuses (PREMUL_SUM): ODC carries them exactly
                assert (dtype == "torch.int16" and "Invalid scalar type" in g_value) or name == "PREMUL_SUM", got
                assert o_value == _local(getattr(torch, dtype[6:]), name, world), (dtype, name, o_value)
        else:
            refused += 1
            assert g_status != "ok", (dtype, name, "odc refused what gloo runs", got)
            if o_status == g_status == "ValueError":  # refused by torch itself, before any backend (complex MAX)
                continue
            assert o_status == "UnsupportedCollective" and dtype in o_value and name in o_value, (dtype, name, got)
    int_avg = out[("torch.int32", "AVG")][1]
    assert int_avg[0] == "UnsupportedCollective" and "AVG on torch.int32" in int_avg[1], int_avg
    assert ran >= 60 and refused >= 60, (ran, refused)
