"""The torch.distributed backend "odc" across real processes, checked against gloo."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc
import odc.backend

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 7, 1001]
TIMEOUT = datetime.timedelta(seconds=30)


def _init(rank, world, store, scratch_mb=None):
    if scratch_mb is not None:
        os.environ["ODC_BACKEND_SCRATCH_MB"] = scratch_mb
    odc.register()
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    return dist.new_group(backend="gloo")


def _data(rank, n, dtype, salt=0):
    """Integer-valued, rank-dependent data (exact in every dtype for small values)."""
    return ((torch.arange(n, dtype=torch.float32) * 3 + rank * 5 + salt) % 17).to(dtype)


def _close(got, want, dtype, what):
    if dtype == torch.float32:
        assert torch.equal(got, want), f"{what}: {got} != {want}"
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2, msg=what)


# PREMUL_SUM factors: 0.375 is exact in every dtype (ODC must then equal the reference bit for bit), 1/3 is not.
_PREMUL_FACTORS = (0.375, 1 / 3)


def _ops_vs_gloo():
    """(name, odc op, premul factor or None) for every sum-like reduction the backend runs."""
    return [("SUM", dist.ReduceOp.SUM, None), ("AVG", dist.ReduceOp.AVG, None)] + [
        (f"PREMUL_SUM({f:.3g})", dist._make_nccl_premul_sum(f), f) for f in _PREMUL_FACTORS
    ]


def _gloo_reduce_scatter(gloo, inp, n, dtype, op, factor):
    """Gloo's reduce-scatter of ``inp`` (world rows of ``n``) into ``dtype``, the reference for ODC's.

    Gloo (torch 2.15, CPU) runs SUM and AVG on f32 / bf16 / f16 itself but
    refuses PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): for that
    one the reference is gloo's f32 SUM of the input premultiplied by the
    factor in f32 (what PREMUL_SUM means, and how ODC accumulates), cast to
    ``dtype``.
    """
    if factor is None:
        ref = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(ref, inp.reshape(-1), op=op, group=gloo)
        return ref
    ref = torch.empty(n, dtype=torch.float32)
    dist.reduce_scatter_tensor(ref, (inp.float() * factor).reshape(-1), op=dist.ReduceOp.SUM, group=gloo)
    return ref.to(dtype)


def _same_as_gloo(got, ref, factor, what):
    """Bit-equal where the arithmetic is exact (integer data, dyadic scales); else within one ulp of the dtype."""
    if factor is None or (factor * 1024).is_integer():
        assert torch.equal(got, ref), f"{what}: odc {got} != gloo {ref}"
    else:
        eps = torch.finfo(got.dtype).eps
        torch.testing.assert_close(got.float(), ref.float(), rtol=eps, atol=eps, msg=what)


def _against_gloo(pg, gloo, rank, world):
    """ODC's all-gather and reduce-scatter (single and coalesced) against gloo in the same workers.

    Every dtype (f32 / bf16 / f16), every reduction (SUM, AVG, PREMUL_SUM),
    odd sizes. The all-gather data is random (gathers must be bit-exact for any
    value); the reduce-scatter data is integer-valued, so sums are exact in
    every dtype and ODC's f32 accumulation must equal gloo's. Returns how many
    comparisons ran; checks that every ODC op ran on ODC, not on gloo.
    """
    before = dict(pg.op_counts)
    checked = 0
    gen = torch.Generator().manual_seed(7 + rank)
    for dtype in DTYPES:
        for n in SIZES:
            tag = f"{dtype} n={n} world={world}"
            x = torch.randn(n, generator=gen).to(dtype)
            got, ref = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(got, x)
            dist.all_gather_into_tensor(ref, x, group=gloo)
            assert torch.equal(got, ref), f"all_gather_into_tensor {tag}"
            checked += 1
            inp = torch.stack([_data(rank, n, dtype, salt=r) for r in range(world)])
            for name, op, factor in _ops_vs_gloo():
                got = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, inp.reshape(-1), op=op)
                ref = _gloo_reduce_scatter(gloo, inp, n, dtype, op, factor)
                _same_as_gloo(got, ref, factor, f"reduce_scatter_tensor {name} {tag}")
                checked += 1

    # Coalesced forms (one op per dtype and odd size, one reduction per batch), against gloo one by one.
    shapes = [(n, d) for d in DTYPES for n in SIZES]
    ins = [torch.randn(n, generator=gen).to(d) for n, d in shapes]
    outs = [torch.empty(world * n, dtype=d) for n, d in shapes]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i)
    for o, i in zip(outs, ins, strict=True):
        ref = torch.empty_like(o)
        dist.all_gather_into_tensor(ref, i, group=gloo)
        assert torch.equal(o, ref), f"coalesced all_gather_into_tensor {i.dtype} n={i.numel()}"
        checked += 1
    rs_in = [torch.stack([_data(rank, n, d, salt=r) for r in range(world)]) for n, d in shapes]
    for name, op, factor in _ops_vs_gloo():
        rs_out = [torch.empty(n, dtype=d) for n, d in shapes]
        with dist._coalescing_manager():
            for o, i in zip(rs_out, rs_in, strict=True):
                dist.reduce_scatter_tensor(o, i.reshape(-1), op=op)
        for o, i, (n, d) in zip(rs_out, rs_in, shapes, strict=True):
            ref = _gloo_reduce_scatter(gloo, i, n, d, op, factor)
            _same_as_gloo(o, ref, factor, f"coalesced reduce_scatter_tensor {name} {d} n={n}")
            checked += 1

    ran = {k: pg.op_counts[k] - before.get(k, 0) for k in pg.op_counts}
    ops = len(_ops_vs_gloo())
    assert ran.get("odc:all_gather_single", 0) == len(shapes) * 2, ran
    assert ran.get("odc:reduce_scatter_single", 0) == len(shapes) * ops, ran
    assert ran.get("odc:reduce_scatter_single_coalesced", 0) == len(shapes) * ops, ran
    assert not any(k.startswith("gloo:") and v for k, v in ran.items()), ran
    return checked


def _ops(rank, world, store, scratch_mb, transport=None):
    if transport is not None:
        os.environ["ODC_TRANSPORT"] = transport
        os.environ["ODC_EMU_JITTER_US"] = "100"  # emu-ipc: streams that lag behind the host
    gloo = _init(rank, world, store, scratch_mb)
    pg = odc.backend.get_process_group()
    assert type(pg).__name__ == "ProcessGroupODC" and dist.get_backend() == "odc"
    assert pg.group_name and pg.group_name == dist.group.WORLD.group_name
    for dtype in DTYPES:
        for n in SIZES:
            tag = f"{dtype} n={n}"
            x = _data(rank, n, dtype)
            rows = torch.stack([_data(r, n, dtype) for r in range(world)])

            # all-gather: flat and stacked outputs, async work, list form.
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, x)
            assert torch.equal(out, rows.reshape(-1)), tag
            stacked = torch.empty(world, n, dtype=dtype)
            work = dist.all_gather_into_tensor(stacked, x, async_op=True)
            assert work.wait() and torch.equal(stacked, rows), tag
            outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, x)
            assert all(torch.equal(o, rows[r]) for r, o in enumerate(outs)), tag
            if dtype == torch.float32:
                ref = torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(ref, x, group=gloo)
                assert torch.equal(out, ref), tag

            # reduce-scatter: input row r goes to rank r.
            inp = torch.stack([_data(rank, n, dtype, salt=r) for r in range(world)])
            total = sum(torch.stack([_data(s, n, torch.float32, salt=r) for r in range(world)]) for s in range(world))
            for op, want in (
                (dist.ReduceOp.SUM, total[rank]),
                (dist.ReduceOp.AVG, total[rank] / world),
                (dist._make_nccl_premul_sum(0.5), total[rank] * 0.5),
            ):
                got = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, inp.reshape(-1), op=op)
                _close(got, want.to(dtype), dtype, f"reduce_scatter {op} {tag}")
            if dtype == torch.float32:
                ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(ref, inp.reshape(-1), group=gloo)
                got = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, inp, op=dist.ReduceOp.SUM)
                assert torch.equal(got, ref), tag
            got = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(got, list(inp.unbind(0)))
            _close(got, total[rank].to(dtype), dtype, f"reduce_scatter list {tag}")

            # all-reduce on ODC (sum-like) and delegated (max), against gloo.
            want = sum(_data(r, n, torch.float32) for r in range(world))
            for op, expect in (
                (dist.ReduceOp.SUM, want),
                (dist.ReduceOp.AVG, want / world),
                (dist._make_nccl_premul_sum(0.25), want * 0.25),
            ):
                t = x.clone()
                dist.all_reduce(t, op=op)
                _close(t, expect.to(dtype), dtype, f"all_reduce {op} {tag}")
            t, ref = x.clone(), x.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(ref, op=dist.ReduceOp.MAX, group=gloo)
            assert torch.equal(t, ref), tag
            if dtype == torch.float32:
                t, ref = x.clone(), x.clone()
                dist.all_reduce(t)
                dist.all_reduce(ref, group=gloo)
                assert torch.equal(t, ref), tag

    # Coalesced all-gather and reduce-scatter (odd sizes, mixed dtypes).
    ins = [_data(rank, n, d) for n, d in zip(SIZES, DTYPES, strict=True)]
    outs = [torch.empty(world * i.numel(), dtype=i.dtype) for i in ins]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i)
    for o, (n, d) in zip(outs, zip(SIZES, DTYPES, strict=True), strict=True):
        assert torch.equal(o, torch.cat([_data(r, n, d) for r in range(world)]))
    rs_in = [torch.cat([_data(rank, n, torch.float32, salt=r) for r in range(world)]) for n in SIZES]
    rs_out = [torch.empty(n) for n in SIZES]
    with dist._coalescing_manager():
        for o, i in zip(rs_out, rs_in, strict=True):
            dist.reduce_scatter_tensor(o, i)
    for o, n in zip(rs_out, SIZES, strict=True):
        assert torch.equal(o, sum(_data(s, n, torch.float32, salt=rank) for s in range(world)))

    # Delegated ops: broadcast, barrier, p2p, all-to-all, reduce, gather, scatter, objects, int all-gather.
    b = _data(rank, 7, torch.float32)
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, _data(world - 1, 7, torch.float32))
    dist.barrier()
    if rank == 0:
        dist.send(torch.arange(5.0), dst=1)
    elif rank == 1:
        t = torch.empty(5)
        dist.recv(t, src=0)
        assert torch.equal(t, torch.arange(5.0))
    a2a_out = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(a2a_out, [torch.full((3,), float(rank * 10 + r)) for r in range(world)])
    assert all(torch.equal(o, torch.full((3,), float(r * 10 + rank))) for r, o in enumerate(a2a_out))
    single = torch.empty(world * 2)
    dist.all_to_all_single(single, torch.arange(world * 2, dtype=torch.float32) + 100 * rank)
    assert single.tolist() == [float(100 * r + 2 * rank + j) for r in range(world) for j in range(2)]
    red = torch.full((4,), float(rank + 1))
    dist.reduce(red, dst=0)
    if rank == 0:
        assert red.tolist() == [float(world * (world + 1) // 2)] * 4
    gl = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gl, dst=0)
    if rank == 0:
        assert [g.tolist() for g in gl] == [[float(r)] * 2 for r in range(world)]
    sc = torch.empty(2)
    dist.scatter(sc, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
    assert sc.tolist() == [float(rank)] * 2
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank})
    assert objs == [{"rank": r, "pad": "x" * r} for r in range(world)]
    ints = torch.empty(world * 3, dtype=torch.int64)
    dist.all_gather_into_tensor(ints, torch.full((3,), rank, dtype=torch.int64))
    assert ints.tolist() == [r for r in range(world) for _ in range(3)]

    # What ODC does not run (another reduce op, an integer dtype) runs on gloo, as on a gloo group.
    rs_max, rs_int = torch.empty(3), torch.empty(3, dtype=torch.int64)
    rs_in = torch.arange(3 * world, dtype=torch.float32) * (rank + 1)
    dist.reduce_scatter_tensor(rs_max, rs_in, op=dist.ReduceOp.MAX)
    dist.reduce_scatter_tensor(rs_int, rs_in.long())
    refs = torch.empty(3), torch.empty(3, dtype=torch.int64)
    dist.reduce_scatter_tensor(refs[0], rs_in, op=dist.ReduceOp.MAX, group=gloo)
    dist.reduce_scatter_tensor(refs[1], rs_in.long(), group=gloo)
    assert torch.equal(rs_max, refs[0]) and torch.equal(rs_int, refs[1]), (rs_max, rs_int, refs)
    # A typed error, raised before any engine call, and the group keeps working.
    errors = []
    try:
        dist.all_gather_into_tensor(torch.empty(world * 3 + 1), torch.ones(3))
    except odc.LayoutError as e:
        errors.append((type(e).__name__, str(e)))
    out = torch.empty(world * 5)
    dist.all_gather_into_tensor(out, torch.full((5,), float(rank)))
    assert out.tolist() == [float(r) for r in range(world) for _ in range(5)]
    counts = dict(pg.op_counts)
    checked = _against_gloo(pg, gloo, rank, world)
    with pytest.raises(odc.backend.NotAnOdcGroup) as not_odc:
        odc.backend.get_process_group(gloo)
    e = not_odc.value
    assert isinstance(e, odc.ConfigError) and isinstance(e, RuntimeError) and "'gloo'" in str(e), e

    # A second odc group (ranks 0 and 1) beside the default one: its own backend object (on 2 ranks sharing
    # the default group's engines, on 4 with engines of its own).
    sub = dist.new_group([0, 1], backend="odc")
    if rank < 2:
        assert odc.backend.get_process_group(sub) is not pg
        out = torch.empty(2 * 7, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, _data(rank, 7, torch.bfloat16), group=sub)
        assert torch.equal(out, torch.cat([_data(r, 7, torch.bfloat16) for r in range(2)]))
        got = torch.empty(7)
        dist.reduce_scatter_tensor(got, torch.ones(14) * (rank + 1), group=sub)
        assert got.tolist() == [3.0] * 7
    dist.all_reduce(torch.ones(3))
    transports = pg.transports
    dist.destroy_process_group()
    return errors, counts, checked, transports


@pytest.mark.parametrize(
    ("world", "scratch_mb", "transport"), [(2, None, None), (4, "0.0005", None), (2, "0.0005", "emu-ipc")]
)
def test_every_op_every_dtype_matches_gloo(world, scratch_mb, transport):
    """Default scratch (each op fits one bucket) and a tiny one (64-element pieces: 1001 elements chunk).

    With ``emu-ipc`` the group's engines are device engines on CPU tensors:
    every op takes the code path of CUDA tensors (see test_backend_device.py).
    """
    res = run_ranks(_ops, world, timeout=150, scratch_mb=scratch_mb, transport=transport)
    for rank, (status, value) in res.items():
        assert status == "ok", (rank, value)
        [(c3, _)], counts, checked, transports = value
        assert list(transports) == ["cpu"], transports  # no CUDA tensor: no CUDA engines
        if transport is not None:
            assert transports["cpu"] == transport, transports
        # all-gather and 4 reductions per dtype and size, single and coalesced.
        assert checked == 2 * len(DTYPES) * len(SIZES) * (1 + len(_ops_vs_gloo())), checked
        # Float gathers, reductions and all-reduces ran on ODC; the rest on gloo.
        assert counts["odc:all_gather_single"] >= 2 * len(DTYPES) * len(SIZES) + 4, counts
        assert counts["odc:reduce_scatter_single"] >= 3 * len(DTYPES) * len(SIZES), counts
        assert counts["odc:allreduce"] == 3 * len(DTYPES) * len(SIZES) + len(SIZES), counts
        assert counts["gloo:allreduce"] == len(DTYPES) * len(SIZES), counts  # MAX
        assert counts["gloo:broadcast"] == 1, counts
        assert counts["gloo:reduce_scatter_single"] == 2, counts  # MAX, int64
        for op in ("all_gather_single", "barrier", "alltoall", "all_to_all_single", "reduce", "gather", "scatter"):
            assert counts[f"gloo:{op}"] >= 1, (op, counts)
        assert c3 == "LayoutError"


_INIT_ODC = """
import sys, datetime
import torch, torch.distributed as dist
{imports}
dist.init_process_group("odc", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
out = torch.empty(3)
dist.all_gather_into_tensor(out, torch.arange(3.0))
assert out.tolist() == [0.0, 1.0, 2.0], out
import odc.backend
print(type(odc.backend.get_process_group()).__module__, dist.get_backend())
"""
#: torch reads the torch.distributed.backends entry point from 2.14 (Backend._ensure_backend_registered).
_READS_ENTRY_POINTS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _init_odc(imports):
    code = _INIT_ODC.format(imports=imports)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/",
                          check=False)


def test_entry_point_no_import():
    """A fresh interpreter that never imports odc gets the backend from torch's entry point where torch reads
    it (2.14 and later); torch 2.11 to 2.13 do not, and say the backend is unknown (docs/backend.md says so)."""
    proc = _init_odc('assert "odc" not in sys.modules')
    if _READS_ENTRY_POINTS:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["odc.backend", "odc"]
    else:
        assert proc.returncode != 0 and "Unknown backend type odc" in proc.stderr, proc.stderr


@pytest.mark.parametrize("imports", ["import odc", "import odc.backend"])
def test_importing_odc_registers_the_backend_on_every_supported_torch(imports):
    """``import odc`` (or any of its modules) is enough, with no further call, on every supported torch."""
    proc = _init_odc(imports)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["odc.backend", "odc"]


def test_register_is_idempotent_and_helpers_need_a_group():
    odc.register()
    odc.register()
    assert dist.Backend("odc") == "odc" and "odc" in dist.Backend.backend_list
    assert dist.is_backend_available("odc")
    with pytest.raises(odc.backend.NotInitialized, match="init_process_group") as info:
        odc.backend.get_process_group()
    # Typed (ODC's hierarchy) and still a RuntimeError, as it was before.
    assert isinstance(info.value, odc.ProtocolError) and isinstance(info.value, RuntimeError)
    assert issubclass(odc.backend.UnsupportedCollective, (odc.OdcError, RuntimeError))


def _dies(rank, world, store):
    _init(rank, world, store)
    x = torch.full((1001,), float(rank))
    out = torch.empty(world * 1001)
    # Warm: everyone is up, and the group's engines exist (an operation that makes one waits for every rank
    # in the store, and would time out there naming the key of the rank that is missing).
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(torch.empty(1001), out)
    if rank == 1:
        os._exit(3)  # dies between collectives; the survivors are inside the next one
    try:
        dist.reduce_scatter_tensor(torch.empty(1001), out)
    except odc.PeerError as e:
        return ("rs", type(e).__name__, e.peer, str(e))
    raise AssertionError("reduce_scatter returned although rank 1 died")


def _dies_in_gather(rank, world, store):
    _init(rank, world, store)
    out = torch.empty(world * 7)
    dist.all_gather_into_tensor(out, torch.ones(7))
    if rank == world - 1:
        os._exit(3)
    try:
        dist.all_gather_into_tensor(out, torch.ones(7))
    except odc.PeerError as e:
        return ("ag", type(e).__name__, e.peer, str(e))
    raise AssertionError("all_gather returned although a rank died")


@pytest.mark.parametrize(("fn", "world", "dead"), [(_dies, 2, 1), (_dies_in_gather, 2, 1)])
def test_dead_peer_raises_typed_error_naming_it(fn, world, dead):
    res = run_ranks(fn, world, timeout=90)
    for rank, (status, value) in res.items():
        if rank == dead:
            continue
        assert status == "ok", (rank, value)
        _, cls, peer, msg = value
        assert cls in ("PeerDied", "PeerTimeout"), msg
        assert peer == dead and f"rank {dead}" in msg, msg


# -- FSDP over "odc" vs gloo ---------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 31), torch.nn.ReLU(), torch.nn.Linear(31, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3)
    )


def _train(model, opt, rank, steps=4):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(5, 13, generator=g), torch.randn(5, 3, generator=g)
        # .float(): torch 2.11's mse_loss has no backward for a bf16 input against an f32 target.
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp(rank, world, store):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard

    gloo = _init(rank, world, store)
    results = {}
    for name, group in (("odc", dist.group.WORLD), ("gloo", gloo)):
        mesh = DeviceMesh.from_group(group, "cpu")
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        results[f"fsdp2-{name}"] = _train(model, opt, rank)
        results[f"fsdp2-{name}-counts"] = counts(group)

        model1 = FullyShardedDataParallel(_model(), process_group=group, device_id=torch.device("cpu"),
                                          use_orig_params=True)
        opt1 = torch.optim.SGD(model1.parameters(), lr=0.1)
        results[f"fsdp1-{name}"] = _train(model1, opt1, rank)
        results[f"fsdp1-{name}-counts"] = counts(group)

        # bf16 parameters on the wire (ODC gathers bf16), f32 gradient reduction.
        model = _model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        results[f"fsdp2bf16-{name}"] = _train(model, opt, rank)
        results[f"fsdp2bf16-{name}-counts"] = counts(group)
    dist.destroy_process_group()
    return results


def counts(group):
    """ODC ops run on ``group`` since the last call (empty for gloo)."""
    if dist.get_backend(group) != "odc":
        return {}
    backend = odc.backend.get_process_group(group)
    got = {k: v for k, v in backend.op_counts.items() if k.startswith("odc:")}
    backend.op_counts.clear()
    return got


@pytest.mark.parametrize("world", [2])
def test_fsdp2_and_fsdp1_train_like_gloo(world):
    res = run_ranks(_fsdp, world, timeout=150)
    for rank, (status, value) in res.items():
        assert status == "ok", (rank, value)
        for kind, rel in (("fsdp2", 1e-5), ("fsdp1", 1e-5), ("fsdp2bf16", 1e-2)):
            odc_l, gloo_l = value[f"{kind}-odc"], value[f"{kind}-gloo"]
            assert len(odc_l) == 4
            assert odc_l == pytest.approx(gloo_l, rel=rel, abs=1e-6), (kind, odc_l, gloo_l)
            # FSDP2: 3 parameter groups; FSDP1: one flat parameter. At least a gather
            # and a reduce-scatter per group and step ran on ODC.
            ran, groups = value[f"{kind}-odc-counts"], 1 if kind == "fsdp1" else 3
            assert ran.get("odc:all_gather_single", 0) + ran.get("odc:allgather", 0) >= 4 * groups, (kind, ran)
            assert ran.get("odc:reduce_scatter_single", 0) >= 4 * groups, (kind, ran)
