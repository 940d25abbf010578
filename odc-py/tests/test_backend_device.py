"""The torch.distributed backend "odc" on its device code path: emu-ipc on CPU tensors, CUDA tensors on a GPU.

Under ``ODC_TRANSPORT=emu-ipc`` the group's CPU engines are device engines
whose streams sleep up to ``ODC_EMU_JITTER_US`` before every operation, so
the backend's device path (work on the engine's stream, finish on the
device, accumulator reads and zeroing through the engine) runs on every
machine. The same worker then runs on CUDA tensors, where the group creates
its CUDA engines (cuda-ipc) on the first CUDA operation. The GPU tests skip
where torch sees no CUDA device, and fail instead under ``ODC_REQUIRE_GPU=1``.
"""

from __future__ import annotations

import datetime
import os
from types import SimpleNamespace

import _fsdp_helpers as H
import pytest
import torch
import torch.distributed as dist
from _dist import need_gpu, run_ranks
from torch.distributed.distributed_c10d import AllgatherOptions

import odc
import odc.backend

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TIMEOUT = datetime.timedelta(seconds=60)
JITTER_US = "100"


def _data(rank, n, dtype, salt=0):
    """Integer-valued, rank-dependent data: sums (and halves, for AVG over 2 ranks) are exact in every dtype."""
    return ((torch.arange(n, dtype=torch.float32) * 3 + rank * 5 + salt) % 17).to(dtype)


def _device_ops(rank, world, store, device, transport=None, per_node=None):
    """ODC and delegated operations on tensors of ``device``, checked exactly; returns what the test checks
    about the group (the engines' transports and devices, op counts, error messages).

    ``transport``: ``ODC_TRANSPORT`` (an emulated device transport for CPU tensors); ``per_node``: ranks per
    (emulated) node."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if transport is None:
        os.environ.pop("ODC_TRANSPORT", None)
    else:
        os.environ["ODC_TRANSPORT"] = transport
        os.environ["ODC_EMU_JITTER_US"] = JITTER_US
    if per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    os.environ["ODC_BACKEND_SCRATCH_MB"] = "0.0005"  # 64-element pieces: 1001 elements take 16
    odc.register()
    dist.init_process_group("cpu:odc,cuda:odc", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    pg = odc.backend.get_process_group()

    def on(t):
        return t.to(dev)

    for dtype in DTYPES:
        for n in (7, 1001):
            tag = f"{dtype} n={n} on {dev}"
            x = on(_data(rank, n, dtype))
            rows = torch.stack([_data(r, n, dtype) for r in range(world)])
            out = torch.empty(world * n, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, x)
            assert torch.equal(out.cpu(), rows.reshape(-1)), tag
            strided = torch.empty(n, world, dtype=dtype, device=dev).t()  # not contiguous
            dist.all_gather_into_tensor(strided, x)
            assert torch.equal(strided.cpu(), rows), tag
            outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, x)
            assert all(torch.equal(o.cpu(), rows[r]) for r, o in enumerate(outs)), tag

            inp = on(torch.stack([_data(rank, n, dtype, salt=r) for r in range(world)]))
            total = sum(torch.stack([_data(s, n, torch.float32, salt=r) for r in range(world)]) for s in range(world))
            for op, want in ((dist.ReduceOp.SUM, total[rank]), (dist.ReduceOp.AVG, total[rank] / world)):
                got = torch.empty(n, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(got, inp.reshape(-1), op=op)
                assert torch.equal(got.cpu(), want.to(dtype)), f"reduce_scatter {op} {tag}"
            got = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter(got, list(inp.unbind(0)))
            assert torch.equal(got.cpu(), total[rank].to(dtype)), f"reduce_scatter list {tag}"

            want = sum(_data(r, n, torch.float32) for r in range(world))
            for op, expect in ((dist.ReduceOp.SUM, want), (dist.ReduceOp.AVG, want / world)):
                t = x.clone()
                dist.all_reduce(t, op=op)
                assert torch.equal(t.cpu(), expect.to(dtype)), f"all_reduce {op} {tag}"
            t = x.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo
            assert torch.equal(t.cpu(), rows.max(dim=0).values), f"all_reduce MAX {tag}"

    # Coalesced forms (odd sizes, mixed dtypes).
    sizes = (1, 7, 1001)
    ins = [on(_data(rank, n, d)) for n, d in zip(sizes, DTYPES, strict=True)]
    outs = [torch.empty(world * i.numel(), dtype=i.dtype, device=dev) for i in ins]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(o, i)
    for o, n, d in zip(outs, sizes, DTYPES, strict=True):
        assert torch.equal(o.cpu(), torch.cat([_data(r, n, d) for r in range(world)])), f"coalesced gather {d}"
    rs_in = [on(torch.cat([_data(rank, n, torch.float32, salt=r) for r in range(world)])) for n in sizes]
    rs_out = [torch.empty(n, device=dev) for n in sizes]
    with dist._coalescing_manager():
        for o, i in zip(rs_out, rs_in, strict=True):
            dist.reduce_scatter_tensor(o, i)
    for o, n in zip(rs_out, sizes, strict=True):
        assert torch.equal(o.cpu(), sum(_data(s, n, torch.float32, salt=rank) for s in range(world)))

    # Delegated to gloo (on CUDA tensors: through host copies).
    b = on(_data(rank, 7, torch.float32))
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b.cpu(), _data(world - 1, 7, torch.float32))
    dist.barrier()
    if rank == 0:
        dist.send(on(torch.arange(5.0)), dst=1)
    elif rank == 1:
        t = on(torch.zeros(5))
        dist.recv(t, src=0)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    single = on(torch.empty(world * 2))
    dist.all_to_all_single(single, on(torch.arange(world * 2, dtype=torch.float32) + 100 * rank))
    assert single.tolist() == [float(100 * r + 2 * rank + j) for r in range(world) for j in range(2)]
    ints = on(torch.empty(world * 3, dtype=torch.int64))
    dist.all_gather_into_tensor(ints, on(torch.full((3,), rank, dtype=torch.int64)))
    assert ints.tolist() == [r for r in range(world) for _ in range(3)]
    red = on(torch.full((4,), float(rank + 1)))
    dist.reduce(red, dst=0)
    if rank == 0:
        assert red.tolist() == [float(world * (world + 1) // 2)] * 4
    gl = [on(torch.empty(2)) for _ in range(world)] if rank == 0 else None
    dist.gather(on(torch.full((2,), float(rank))), gl, dst=0)
    if rank == 0:
        assert [g.tolist() for g in gl] == [[float(r)] * 2 for r in range(world)]
    sc = on(torch.empty(2))
    dist.scatter(sc, [on(torch.full((2,), float(r))) for r in range(world)] if rank == 0 else None, src=0)
    assert sc.tolist() == [float(rank)] * 2
    mx = on(torch.full((3,), float(rank)))
    fut = dist.all_reduce(mx, op=dist.ReduceOp.MAX, async_op=True).get_future()
    fut.wait()
    assert mx.tolist() == [float(world - 1)] * 3

    found = {}
    if dev.type == "cpu":
        # The host staging CUDA tensors take to gloo, on CPU tensors (it copies them all the same).
        t = torch.full((4,), float(rank + 1))
        work = pg._staged("allreduce", [t], dist.AllreduceOptions())
        assert t.tolist() == [float(rank + 1)] * 4, "a staged operation wrote its output before wait()"
        work.wait()
        assert t.tolist() == [float(world * (world + 1) // 2)] * 4
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t = torch.full((2,), float(rank))
        pg._staged("broadcast", [t], opts).get_future().wait()
        assert t.tolist() == [0.0, 0.0]
        outs = [[torch.empty(3) for _ in range(world)]]
        pg._staged("allgather", outs, [torch.full((3,), float(rank))], AllgatherOptions()).wait()
        assert [o.tolist() for o in outs[0]] == [[float(r)] * 3 for r in range(world)]
        if rank == 0:
            sent = torch.arange(3.0)
            pg._staged("send", [sent], 1, 0).wait()
            assert sent.tolist() == [0.0, 1.0, 2.0]
        elif rank == 1:
            got = torch.zeros(3)
            pg._staged("recv", [got], 0, 0).wait()
            assert got.tolist() == [0.0, 1.0, 2.0]
    else:
        # On a side stream, as FSDP issues its collectives: wait() orders the caller's stream after them.
        n = 1001
        side = torch.cuda.Stream(dev)
        x = on(_data(rank, n, torch.float32))
        inp = on(torch.cat([_data(rank, n, torch.float32, salt=r) for r in range(world)]))
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            out = torch.empty(world * n, device=dev)
            got = torch.empty(n, device=dev)
            works = [
                dist.all_gather_into_tensor(out, x, async_op=True),
                dist.reduce_scatter_tensor(got, inp, async_op=True),
            ]
        for w in works:
            w.wait()
        doubled = torch.cat([out, got]) * 2  # on the default stream, after the waits
        want = torch.cat(
            [
                torch.cat([_data(r, n, torch.float32) for r in range(world)]),
                sum(_data(s, n, torch.float32, salt=rank) for s in range(world)),
            ]
        )
        assert torch.equal(doubled.cpu(), want * 2)
        # CPU tensors still run on the group's CPU engines beside the CUDA ones.
        cpu_out = torch.empty(world * 7)
        dist.all_gather_into_tensor(cpu_out, _data(rank, 7, torch.float32))
        assert torch.equal(cpu_out, torch.cat([_data(r, 7, torch.float32) for r in range(world)]))
        for key, call in (
            ("mixed", lambda: pg.all_gather_single(torch.empty(world * 7), on(torch.ones(7)))),
            ("other_gpu", lambda: pg.all_gather_single(
                torch.empty(world * 7, device="cuda:1"), torch.ones(7, device="cuda:1"))),
        ):
            if key == "other_gpu" and torch.cuda.device_count() < 2:
                continue
            try:
                call()
            except odc.LayoutError as e:
                found[key] = str(e)
        t = on(torch.ones(5))
        dist.all_reduce(t)  # the errors left the group usable
        assert t.tolist() == [float(world)] * 5

    info = {"transports": pg.transports, "counts": dict(pg.op_counts), "found": found}
    dist.destroy_process_group()
    return info


def _check_counts(counts):
    for op in ("all_gather_single", "allgather", "reduce_scatter_single", "reduce_scatter", "allreduce",
               "reduce_scatter_single_coalesced"):
        assert counts.get(f"odc:{op}", 0) >= 1, (op, counts)
    for op in ("broadcast", "barrier", "all_to_all_single", "all_gather_single", "reduce", "gather", "scatter"):
        assert counts.get(f"gloo:{op}", 0) >= 1, (op, counts)
    assert counts["gloo:allreduce"] == 2 * len(DTYPES) + 1, counts  # MAX


@pytest.mark.parametrize(("transport", "per_node"), [("emu-ipc", None), ("emu-shmem", 1)])
def test_emulated_device_transports_run_the_backend_exactly(transport, per_node):
    """cuda-ipc's code path on one node, nvshmem's on two emulated nodes (one rank each)."""
    res = H.all_ok(run_ranks(_device_ops, 2, timeout=120, device="cpu", transport=transport, per_node=per_node))
    for info in res.values():
        assert (info["transports"], info["found"]) == ({"cpu": transport}, {}), info
        _check_counts(info["counts"])


# -- without processes -------------------------------------------------------------------------------


def test_backend_is_registered_for_cpu_and_cuda():
    odc.register()
    assert dist.Backend.backend_capability["odc"] == ["cpu", "cuda"]


def test_odc_transport_picks_the_pair_it_names():
    pick, cuda = odc.backend._engines.transports, odc.backend._engines.cuda_transport
    assert pick(None) == ("auto", None)
    for name in ("auto", "shm", "fabric", "mixed", "emu-ipc", "emu-shmem"):
        assert pick(name) == (name, None)
    for name, want in (("cuda-ipc", "cuda-ipc"), ("CUDA_IPC", "cuda-ipc"), ("nvshmem", "nvshmem")):
        assert pick(name) == ("auto", want)
    assert pick("carrier-pigeon") == ("carrier-pigeon", None)  # the CPU engine names every transport
    assert (cuda(None, 1), cuda(None, 2), cuda("cuda-ipc", 1), cuda("nvshmem", 1)) == (
        "cuda-ipc", "nvshmem", "cuda-ipc", "nvshmem"
    )
    with pytest.raises(odc.ConfigError, match=r"ODC_TRANSPORT='cuda-ipc' serves one node .* 2 nodes.*'nvshmem'"):
        cuda("cuda-ipc", 2)


def _one_rank_group(monkeypatch, transport):
    monkeypatch.setenv("ODC_TRANSPORT", transport)
    monkeypatch.setenv("ODC_JOB_KEY", f"pytest-bdev-{os.getpid()}")
    return odc.backend.ProcessGroupODC(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))


def test_a_cuda_transport_leaves_cpu_tensors_on_the_host_engines(monkeypatch):
    pg = _one_rank_group(monkeypatch, "cuda-ipc")
    try:
        assert (pg.transports, pg._cuda_requested) == ({}, "cuda-ipc")  # no engine before the first operation
        out = torch.empty(3)
        pg.all_gather_single(out, torch.arange(3.0)).wait()
        assert out.tolist() == [0.0, 1.0, 2.0]
        assert pg.transports == {"cpu": "shm"}
    finally:
        pg.shutdown()


def test_nvshmem_plans_the_reduce_scatter_engine_into_the_all_gather_engines_heap():
    # A process holds one NVSHMEM session: the device's first engine starts it with the second one's regions
    # planned in (heap_reserve), and the second shares it. Checked on the arguments (no GPU needed).
    bound = odc.backend.scratch_bytes()
    (ag, ag_kw), (rs, rs_kw) = odc.backend._engines.device_plan("nvshmem", torch.device("cuda", 0), 1, 1, bound)
    shard = odc.backend._parts.shard_classes(bound, 4)[-1]
    want = odc.engine.heap_bytes(odc.backend._parts.Reducer.buckets(1, shard), 1, local_world_size=1)
    assert want >= 2 * 4 * shard, want  # both f32 accumulators
    assert (ag, ag_kw) == ("ag", {"transport": "nvshmem", "device": 0, "heap_reserve": want})
    assert (rs, rs_kw) == ("rs", {"transport": "nvshmem", "device": 0})
    (_, ipc_kw), _ = odc.backend._engines.device_plan("cuda-ipc", torch.device("cuda", 1), 2, 2, bound)
    assert ipc_kw == {"transport": "cuda-ipc", "device": 1, "heap_reserve": 0}


def test_heap_bytes_counts_what_an_engine_allocates():
    # One f32 bucket of 1000 elements over 2 ranks: a 500-element shard (2000 bytes, 2048 aligned), two
    # landing slots per client (2 · 2 · 4096), the f32 accumulator (2000); each rounded up to 512 bytes.
    b = [odc.Bucket("w", 1000, torch.float32)]
    assert odc.engine.heap_bytes(b, 2, chunk_bytes=4096) == 2048 + 16384 + 2048
    assert odc.engine.heap_bytes(b, 2, chunk_bytes=8192) == 2048 + 32768 + 2048
    with pytest.raises(odc.ConfigError, match="hybrid"):
        odc.engine.heap_bytes(b, 2, sharding="hybrid-ish")


def test_unknown_transport_is_a_config_error(monkeypatch):
    with pytest.raises(odc.ConfigError, match="carrier-pigeon"):
        _one_rank_group(monkeypatch, "carrier-pigeon")


def test_tensors_on_other_devices_are_layout_errors_naming_them(monkeypatch):
    pg = _one_rank_group(monkeypatch, "emu-ipc")
    try:
        meta = torch.empty(2, device="meta")
        with pytest.raises(odc.LayoutError, match="all_gather_single: tensors on cpu and meta"):
            pg.all_gather_single(torch.empty(2), meta)
        with pytest.raises(odc.LayoutError, match="reduce_scatter_single: tensors on cpu and meta"):
            pg.reduce_scatter_single(meta, torch.ones(2))
        with pytest.raises(odc.LayoutError, match=r"broadcast: tensor on meta; .* CPU and CUDA tensors"):
            pg.broadcast([meta])
        with pytest.raises(odc.LayoutError, match="all_gather_single: tensors on cpu and meta"):
            pg.all_gather_single(torch.empty(2, dtype=torch.int64), meta.long())  # delegated: checked too
        # A CUDA op on another device than the group's CUDA engines (stood in for: no GPU needed).
        pg._set._devices["cuda"] = SimpleNamespace(device=torch.device("cuda", 0))
        with pytest.raises(odc.LayoutError, match=r"tensors on cuda:1, but .* CUDA engines are on cuda:0"):
            pg._run("all_gather_single", torch.device("cuda", 1), lambda engines: None)
        # None of this reached an engine: the group still works.
        assert pg._set.failure is None
        out = torch.empty(2)
        pg.all_gather_single(out, torch.ones(2)).wait()
        assert out.tolist() == [1.0, 1.0]
    finally:
        pg.shutdown()


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_tensors_run_on_cuda_ipc_engines_exactly():
    need_gpu()
    # Two processes share device 0 where there is only one GPU.
    res = H.all_ok(run_ranks(_device_ops, 2, timeout=240, device="cuda:0"))
    for info in res.values():
        assert info["transports"] == {"cpu": "shm", "cuda:0": "cuda-ipc"}, info
        _check_counts(info["counts"])
        assert "cpu" in info["found"]["mixed"] and "cuda:0" in info["found"]["mixed"], info["found"]
        if "other_gpu" in info["found"]:
            assert "cuda:1" in info["found"]["other_gpu"] and "cuda:0" in info["found"]["other_gpu"], info["found"]


@pytest.mark.gpu
def test_fsdp2_on_an_odc_group_with_cuda_parameters_matches_single_process():
    need_gpu()
    out = H.all_ok(run_ranks(H.cuda_fsdp_worker, 2, timeout=300, steps=4, comm="backend"))
    for rank, info in out.items():
        assert info["transport"] == "cuda-ipc", info["transport"]
        assert info["counts"].get("odc:all_gather_single", 0) > 0, info["counts"]
        assert info["counts"].get("odc:reduce_scatter_single", 0) > 0, info["counts"]
        assert info["grad_device"].startswith("cuda"), info["grad_device"]
        assert info["max_diff"] < 1e-5, (rank, info["max_diff"])
