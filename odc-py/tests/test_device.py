"""odc.Engine on the device transports: emu-ipc across real processes, cuda-ipc errors, GPU runs.

``emu-ipc`` runs the device data path (``*_device`` calls: data in a separate
landing region, adds on the daemon's stream, signals sent by stream work)
with host memory and host-thread streams; ``ODC_EMU_JITTER_US`` makes every
emulated stream sleep before each operation, so a signal that overtook its
data would show up here as a wrong gather or sum. The GPU tests skip where
torch sees no CUDA device, and fail instead under ``ODC_REQUIRE_GPU=1``.
"""

from __future__ import annotations

import os

import _fsdp_helpers as H
import pytest
import torch
from _dist import need_gpu, run_ranks

import odc
import odc.fsdp
import odc.weights

JITTER_US = "200"


# -- emu-ipc across processes -------------------------------------------------------------------


def _exact(rank, world, store, transport, device, numel=1001, hnumel=333, minibatches=3, local_world_size=None):
    """publish / gather / release / scatter_accumulate (offsets, uneven counts) / finish / grad_shard / zero_grad,
    f32 and bf16, checked exactly on every rank. Returns what the caller checks about the engine."""
    os.environ["ODC_EMU_JITTER_US"] = JITTER_US
    dev = torch.device(f"cuda:{rank}" if device == "cuda:rank" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-dev-{os.getppid()}", transport=transport,
                     device=dev.index if dev.type == "cuda" else None, local_world_size=local_world_size)
    eng.register([odc.Bucket("w", numel, torch.float32), odc.Bucket("h", hnumel, torch.bfloat16)])
    sl, hl = eng.bucket("w")["shard_len"], eng.bucket("h")["shard_len"]
    pattern = torch.arange(world * sl, dtype=torch.float32, device=dev) % 7
    hpattern = (torch.arange(world * hl, dtype=torch.float32, device=dev) % 5).to(torch.bfloat16)
    for k in range(minibatches):
        full = torch.arange(world * sl, dtype=torch.float32, device=dev) % 97 + 1000 * k
        hfull = (torch.arange(world * hl, dtype=torch.float32, device=dev) % 61 + k).to(torch.bfloat16)
        eng.publish("w", full[rank * sl : (rank + 1) * sl].clone(), version=k)
        eng.publish("h", hfull[rank * hl : (rank + 1) * hl].clone(), version=k)
        out = torch.empty(numel, device=dev)
        eng.gather("w", k, out)
        assert torch.equal(out, full[:numel]), f"rank {rank} minibatch {k}: gathered wrong f32 values"
        # skip_own leaves this rank's range alone (FSDP's copy-in).
        hout = torch.full((world * hl,), -1.0, dtype=torch.bfloat16, device=dev)
        eng.gather("h", k, hout, skip_own=True)
        want = hfull.clone()
        want[rank * hl : (rank + 1) * hl] = -1.0
        assert torch.equal(hout, want), f"rank {rank} minibatch {k}: gathered wrong bf16 values"
        eng.release("w", k)
        eng.release("h", k)
        # Rank r pushes r + 1 microbatches: r whole ones at scale 0.5, then one in two parts (offsets).
        grads = pattern[:numel] + rank
        for _ in range(rank):
            eng.scatter_accumulate("w", grads, scale=0.5)
        cut = 400
        eng.scatter_accumulate("w", grads[:cut].clone(), scale=0.5, offset=0)
        eng.scatter_accumulate("w", grads[cut:].clone(), scale=0.5, offset=cut)
        eng.scatter_accumulate("h", hpattern, scale=1.0)  # padded length
        eng.finish_minibatch(k)
        g = eng.grad_shard("w")
        assert g.device == dev and g.dtype == torch.float32 and g.numel() == sl, (g.device, g.dtype, g.numel())
        idx = torch.arange(rank * sl, (rank + 1) * sl, device=dev)
        want_g = sum(0.5 * (r + 1) * ((idx % 7).float() + r) for r in range(world))
        want_g[idx >= numel] = 0.0
        assert torch.equal(g, want_g), f"rank {rank} minibatch {k}: wrong f32 gradient sums"
        hg = eng.grad_shard("h")
        want_h = world * hpattern[rank * hl : (rank + 1) * hl].float()
        assert torch.equal(hg, want_h), f"rank {rank} minibatch {k}: wrong bf16 gradient sums"
        # The native copy to host agrees with the view.
        host = torch.empty(sl, dtype=torch.float32)
        eng._native.read_grad_shard_device(eng._id("w"), host.data_ptr(), sl)
        assert torch.equal(host, g.cpu())
        if k % 2:
            eng.zero_grad()
        else:
            eng.zero_grad("w")
            eng.zero_grad("h")
        assert not eng.grad_shard("w").any() and not eng.grad_shard("h").any(), f"rank {rank}: zero_grad"
    return {"transport": eng.transport, "is_device": eng.is_device, "device": str(eng.device)}


@pytest.mark.parametrize("world", [2, 3])
def test_emu_ipc_engine_is_exact_with_jittered_streams(world):
    res = H.all_ok(run_ranks(_exact, world, timeout=120, transport="emu-ipc", device="cpu"))
    for info in res.values():
        assert info == {"transport": "emu-ipc", "is_device": True, "device": "cpu"}, info


def test_emu_shmem_engine_is_exact_across_two_emulated_nodes():
    # 4 processes, 2 per node: control words over shm within a node and libfabric (tcp, loopback) across;
    # a push to the other node reaches it only at the stream's deliver (NVSHMEM's quiet).
    res = H.all_ok(run_ranks(_exact, 4, timeout=180, transport="emu-shmem", device="cpu", local_world_size=2,
                             minibatches=2))
    for info in res.values():
        assert info == {"transport": "emu-shmem", "is_device": True, "device": "cpu"}, info


def _fetcher_dies_with_its_fills_on_its_stream(rank, world, store):
    """Node 0 is ranks 0-1. Rank 0's gather claims both remote shards in the node cache and enqueues their fills
    on a stream that sleeps up to 50 ms before each operation; it dies before the stream marks them ready. Rank
    1 then gathers the same version: it finds the claims' fetcher dead, takes them over and gathers exactly."""
    import time

    os.environ["ODC_EMU_JITTER_US"] = "50000" if rank == 0 else JITTER_US
    eng = odc.Engine(store, rank, world, timeout=10, job_key=f"pytest-devfetch-{os.getppid()}",
                     transport="emu-shmem", local_world_size=2)
    eng.register([odc.Bucket("w", 4096, torch.float32)])
    sl = eng.bucket("w")["shard_len"]
    full = torch.arange(world * sl, dtype=torch.float32)
    eng.publish("w", full[rank * sl : (rank + 1) * sl].clone(), version=0)
    store.set(f"published/{rank}", "1")
    store.wait([f"published/{r}" for r in range(world)])
    out = torch.full((4096,), -1.0)
    if rank == 0:
        # The native call returns once the copies are enqueued (as on a GPU); the Python method would then wait
        # for the emulated stream, which a process dying mid-gather on a GPU never does.
        ptr, n, dt, stream = eng._device_buffer(out, "output")
        eng._native.gather_device(eng._id("w"), 0, ptr, n, dt, False, stream)
        store.set("claimed", "1")
        os._exit(3)
    if rank == 1:
        store.wait(["claimed"])
        time.sleep(0.2)
        t0 = time.monotonic()
        eng.gather("w", 0, out)
        took = time.monotonic() - t0
        exact = torch.equal(out, full)
        stats = eng.node_cache_stats()
        store.set("read", "1")
        return {"exact": exact, "stats": stats, "took": took}
    store.wait(["read"])  # ranks 2-3 own the shards rank 1 reads
    return None


def test_a_fetcher_killed_with_its_fills_on_its_stream_is_taken_over():
    # The device node cache: a fill is marked ready by work on the fetcher's stream, so a fetcher killed before
    # its stream ran leaves claims that no mark will follow. Its node-mate takes them over (one probe: 50 ms).
    res = run_ranks(_fetcher_dies_with_its_fills_on_its_stream, 4, timeout=120)
    assert res[0][0] != "ok", res
    status, out = res[1]
    assert status == "ok", res[1]
    assert out["exact"], out
    # Both remote shards: node 1's ranks 2 and 3 own one each.
    assert out["stats"]["taken_over"] == 2 and out["stats"]["entries"] == 2, out
    assert out["took"] < 2, out
    assert res[2] == ("ok", None) and res[3] == ("ok", None), res


def test_emu_ipc_refuses_wrong_tensors_and_host_calls(monkeypatch):
    # One rank in this process: the device path, its input checks and the host / device call split.
    monkeypatch.setenv("ODC_EMU_JITTER_US", "50")
    store = torch.distributed.HashStore()
    eng = odc.Engine(store, 0, 1, timeout=10, transport="EMU_IPC", job_key=f"pytest-emu1-{os.getpid()}")
    assert (eng.transport, eng.is_device, eng.device) == ("emu-ipc", True, torch.device("cpu"))
    eng.register([odc.Bucket("a", 100, torch.float32)])
    sl = eng.bucket("a")["shard_len"]
    with pytest.raises(odc.LayoutError, match="shard is on meta"):
        eng.publish("a", torch.empty(sl, device="meta"), 0)
    with pytest.raises(odc.LayoutError, match="not contiguous"):
        eng.gather("a", 0, torch.zeros(200)[::2])
    with pytest.raises(odc.LayoutError, match="full bucket"):
        eng.scatter_accumulate("a", torch.zeros(99))  # neither numel nor padded length
    with pytest.raises(odc.LayoutError, match="overrun"):
        eng.scatter_accumulate("a", torch.zeros(4), offset=sl)
    shard = torch.full((sl,), 3.0)
    with pytest.raises(odc.ConfigError, match="publish_device"):
        eng._native.publish(0, shard.data_ptr(), shard.nbytes, "f32", 0)  # a host call on a device engine
    # Nothing was corrupted: the engine still works.
    eng.publish("a", shard, 0)
    out = torch.zeros(100)
    eng.gather("a", 0, out)
    assert torch.equal(out, torch.full((100,), 3.0))
    eng.scatter_accumulate("a", torch.arange(100.0), scale=2.0)
    eng.finish_minibatch(0)
    assert torch.equal(eng.grad_shard("a")[:100], 2 * torch.arange(100.0))
    # A device call on a host engine.
    host = odc.Engine(store, 0, 1, timeout=10, transport="shm", prefix="host", job_key=f"pytest-emu1h-{os.getpid()}")
    host.register([odc.Bucket("a", 100, torch.float32)])
    assert not host.is_device and host.device == torch.device("cpu")
    with pytest.raises(odc.ConfigError, match="host memory"):
        host._native.publish_device(0, shard.data_ptr(), shard.nbytes, "f32", 0, eng._emu.handle)
    stream = odc._odc.EmuStream(10)
    assert stream.handle > 0 and stream.handle != eng._emu.handle
    stream.synchronize()


def test_bad_emu_jitter_is_a_config_error(monkeypatch):
    monkeypatch.setenv("ODC_EMU_JITTER_US", "soon")
    with pytest.raises(odc.ConfigError, match="ODC_EMU_JITTER_US"):
        odc.Engine(torch.distributed.HashStore(), 0, 1, transport="emu-ipc")


def test_the_single_gpu_figures_run_exactly_on_the_emulated_device_path(tmp_path):
    """python -m odc.bench.gpu (what scripts/gpu-run.sh measures on the GPU) on emu-ipc: every gather and sum
    exact, the rows and verdicts written; the numbers themselves mean nothing here."""
    import json
    import subprocess
    import sys

    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "odc.bench.gpu", "--device", "cpu", "--transport", "emu-ipc", "--sizes", "64K",
           "-n", "2", "-w", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    fig = json.loads(out.read_text())
    assert [r["latency_row"] for r in fig["rows"]] == [False, True], fig
    assert all(r["wrong"] == 0 and r["gather_us"] > 0 and r["copy_us"] > 0 for r in fig["rows"]), fig
    assert any("64 KiB gather latency" in v for v in fig["verdicts"]), fig


# -- cuda-ipc without a GPU, and errors that need none ---------------------------------------------


def test_cuda_ipc_without_a_gpu_names_libcuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda-ipc engines are created, see the GPU tests")
    for transport in ("cuda-ipc", "nvshmem"):
        for device in (None, 0):
            with pytest.raises(odc.GpuUnavailable, match="libcuda"):
                odc.Engine(torch.distributed.HashStore(), 0, 1, transport=transport, device=device)


@pytest.mark.torch_versions  # its interpreter differs per leg: each must find its own wheels first
def test_probe_finds_nvrtc_and_nvshmem_in_the_running_interpreters_wheels():
    """odc.probe() in a fresh interpreter, with no VIRTUAL_ENV nor ODC_* override: NVRTC and NVSHMEM come from
    the wheels of the interpreter running odc (CUDA 13's NVRTC first, where no CUDA 12 driver asks otherwise),
    and the probe names the file and the version; without a GPU the CUDA part names the missing driver."""
    import json
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    site = Path(sysconfig.get_paths()["purelib"])
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "ODC_SITE_PACKAGES", "ODC_NVRTC_LIB", "ODC_NVSHMEM_LIB")}
    code = "import json, odc; print(json.dumps(odc.probe()))"
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr
    probe = json.loads(p.stdout)
    nvrtc = [site / "nvidia/cu13/lib/libnvrtc.so.13", site / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"]
    expected = next((str(f) for f in nvrtc if f.exists()), None)
    if expected is None:
        pytest.fail(f"no NVRTC wheel in {site}: make setup and make setup-torch211 install one")
    if not torch.cuda.is_available():
        assert probe["nvrtc"].get("path") == expected, probe["nvrtc"]
        assert "libcuda" in probe["cuda"]["error"], probe["cuda"]
    major = int(probe["nvrtc"]["version"].split(".")[0])
    assert major in (12, 13) and probe["nvrtc"]["path"].endswith(f".so.{major}"), probe["nvrtc"]
    shmem = site / "nvidia/nvshmem/lib/libnvshmem_host.so.3"
    if shmem.exists():
        assert probe["nvshmem"].get("path") == str(shmem), probe["nvshmem"]
        assert probe["nvshmem"]["version"].startswith("3."), probe["nvshmem"]


def test_unknown_transport_lists_every_name():
    with pytest.raises(odc.ConfigError) as info:
        odc.Engine(torch.distributed.HashStore(), 0, 1, transport="carrier-pigeon")
    for name in ("carrier-pigeon", *odc.engine.TRANSPORTS):
        assert name in str(info.value), str(info.value)


def test_cuda_ipc_engine_refuses_cpu_tensors_naming_them():
    # The check runs before any CUDA call: an engine that believes it is on cuda:0 (no GPU needed).
    eng = odc.Engine.__new__(odc.Engine)
    from types import SimpleNamespace

    eng._cuda, eng._emu, eng._streams = torch.device("cuda", 0), None, {}
    for transport in odc.engine.CUDA_TRANSPORTS:
        eng._native = SimpleNamespace(transport=transport)
        for what in ("shard", "gradient"):
            with pytest.raises(odc.LayoutError, match=rf"{what} is on cpu; .*{transport} moves CUDA tensors on cuda:0"):
                eng._device_buffer(torch.zeros(4), what)


def test_fsdp_picks_a_transport_that_carries_the_parameters():
    from types import SimpleNamespace

    def group(name, device):
        return SimpleNamespace(name=name, pg=SimpleNamespace(device=torch.device(device)))

    pick = odc.fsdp._transport._pick_transport
    cpu, gpu = [group("fsdp0:blocks.0", "cpu")], [group("fsdp1:<root>", "cuda:0")]
    assert pick(cpu, None, "ODC_TRANSPORT", nodes=None) is None  # the engine's default (auto)
    assert pick(cpu, "emu-ipc", "ODC_TRANSPORT", nodes=1) == "emu-ipc"
    assert pick(cpu, "shm", "the transport argument", nodes=2) == "shm"
    with pytest.raises(odc.ConfigError, match=r"'cuda-ipc' \(from ODC_TRANSPORT\) moves CUDA tensors, but fsdp0"):
        pick(cpu, "cuda-ipc", "ODC_TRANSPORT", nodes=1)
    for requested in (None, "auto", "cuda-ipc", "CUDA_IPC"):
        assert pick(gpu, requested, "ODC_TRANSPORT", nodes=1) == "cuda-ipc"
    assert pick(gpu, None, "ODC_TRANSPORT", nodes=None) == "cuda-ipc"
    assert pick(gpu, "nvshmem", "ODC_TRANSPORT", nodes=1) == "nvshmem"
    for requested in ("shm", "emu-ipc", "emu-shmem", "fabric"):
        with pytest.raises(odc.ConfigError, match=rf"'{requested}' \(from .*\) cannot carry CUDA.*cuda:0"):
            pick(gpu, requested, "the transport argument", nodes=1)
    # Across nodes: nvshmem, full sharding only.
    for requested in (None, "auto", "nvshmem"):
        assert pick(gpu, requested, "ODC_TRANSPORT", nodes=2) == "nvshmem"
    with pytest.raises(odc.ConfigError, match=r"'cuda-ipc' \(from ODC_TRANSPORT\) serves one node.*2 nodes.*nvshmem"):
        pick(gpu, "cuda-ipc", "ODC_TRANSPORT", nodes=2)
    with pytest.raises(odc.ConfigError, match=r"2 nodes and sharding is 'hybrid'.*sharding='full'"):
        pick(gpu, None, "ODC_TRANSPORT", nodes=2, sharding="hybrid")
    assert pick(cpu, "emu-shmem", "ODC_TRANSPORT", nodes=2) == "emu-shmem"
    with pytest.raises(odc.ConfigError, match=r"'nvshmem' \(from ODC_TRANSPORT\) moves CUDA tensors, but fsdp0"):
        pick(cpu, "nvshmem", "ODC_TRANSPORT", nodes=2)
    with pytest.raises(odc.ConfigError, match=r"several devices.*fsdp0:blocks.0 on cpu.*fsdp1:<root> on cuda:0"):
        pick(cpu + gpu, None, "ODC_TRANSPORT", nodes=1)
    with pytest.raises(odc.ConfigError, match=r"unknown transport 'nvlink'.*cuda-ipc, emu-ipc, nvshmem, emu-shmem"):
        pick(gpu, "nvlink", "ODC_TRANSPORT", nodes=1)


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nvshmem_engine_is_exact_on_two_gpus():
    need_gpu()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"nvshmem places one PE per GPU: needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    res = H.all_ok(run_ranks(_exact, 2, timeout=300, transport="nvshmem", device="cuda:rank"))
    for rank, info in res.items():
        assert info == {"transport": "nvshmem", "is_device": True, "device": f"cuda:{rank}"}, info


@pytest.mark.gpu
def test_cuda_ipc_engine_is_exact_on_cuda_tensors():
    need_gpu()
    # Two processes share device 0 where there is only one GPU.
    device = "cuda:0"
    res = H.all_ok(run_ranks(_exact, 2, timeout=180, transport="cuda-ipc", device=device))
    for info in res.values():
        assert info == {"transport": "cuda-ipc", "is_device": True, "device": device}, info


def _weights_on_cuda(rank, world, store, steps=20):
    """serve_weights on CUDA parameters (a plain module: rank 0 serves it whole) and a reader in this process:
    after each step, the version of the step before is read (K = 2 keeps it) while this step's parameters are
    already written: it must be its own step's parameters, bit for bit. Then the step time with and without
    serving (each publish queues a device copy on a side stream)."""
    import time

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(64, 2048, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    timed(3)
    plain = timed(steps)
    server = odc.weights.serve_weights(model, opt, store=store, name="cuda", slots=2)
    # The same versions served in bf16: the device snapshot casts.
    halved = odc.weights.serve_weights(model, opt, store=store, name="cuda-bf16", slots=2, dtype=torch.bfloat16)
    reader = odc.WeightReader(store, name="cuda", timeout=30)
    reader16 = odc.WeightReader(store, name="cuda-bf16", timeout=30)
    want = {0: {k: p.detach().cpu() for k, p in model.named_parameters()}}
    for v in range(1, steps + 1):
        step()
        want[v] = {k: p.detach().cpu() for k, p in model.named_parameters()}
        got = reader.read(version=v - 1, dtype=torch.float32)
        got16 = reader16.read(version=v - 1, dtype=torch.bfloat16)
        for k, w in want[v - 1].items():
            assert torch.equal(got.tensors[k], w), f"version {v - 1}: {k} is not its step's"
            assert torch.equal(got16.tensors[k], w.to(torch.bfloat16)), f"bf16 version {v - 1}: {k}"
    halved.close()
    served = timed(steps)
    server.wait()
    return {"plain_ms": plain * 1e3, "served_ms": served * 1e3, "device_bytes": server.device_bytes,
            "slot_bytes": server.slot_bytes, "version": server.version}


@pytest.mark.gpu
def test_weights_of_cuda_parameters_are_each_steps_own():
    need_gpu()
    info = H.all_ok(run_ranks(_weights_on_cuda, 1, timeout=180))[0]
    print(f"serve_weights on CUDA: step {info['plain_ms']:.2f} ms plain, {info['served_ms']:.2f} ms served "
          f"({info['served_ms'] / info['plain_ms']:.2f}x); {info['device_bytes'] / 2**20:.0f} MiB device + pinned")
    assert info["version"] == 2 * 20, info  # 20 steps checked, 20 timed: one version each
    assert info["device_bytes"] == 2 * info["slot_bytes"], info


def _cuda_mixing(rank, world, store):
    eng = odc.Engine(store, rank, world, timeout=30, transport="cuda-ipc", device=0,
                     job_key=f"pytest-cudamix-{os.getppid()}")
    eng.register([odc.Bucket("a", 64, torch.float32)])
    found = {}
    for key, call in (
        ("cpu_shard", lambda: eng.publish("a", torch.zeros(eng.bucket("a")["shard_len"]), 0)),
        ("cpu_out", lambda: eng.gather("a", 0, torch.zeros(64))),
        ("strided", lambda: eng.scatter_accumulate("a", torch.zeros(128, device="cuda:0")[::2])),
    ):
        try:
            call()
        except odc.LayoutError as e:
            found[key] = str(e)
    if torch.cuda.device_count() > 1:
        try:
            eng.gather("a", 0, torch.zeros(64, device="cuda:1"))
        except odc.LayoutError as e:
            found["other_gpu"] = str(e)
    return found


@pytest.mark.gpu
def test_cuda_ipc_engine_refuses_cpu_and_other_device_tensors():
    need_gpu()
    for found in H.all_ok(run_ranks(_cuda_mixing, 2, timeout=120)).values():
        assert "shard is on cpu" in found["cpu_shard"] and "cuda:0" in found["cpu_shard"], found
        assert "output is on cpu" in found["cpu_out"], found
        assert "not contiguous" in found["strided"], found
        if "other_gpu" in found:
            assert "cuda:1" in found["other_gpu"] and "cuda:0" in found["other_gpu"], found


@pytest.mark.gpu
def test_fsdp_on_cuda_parameters_matches_single_process():
    need_gpu()
    out = H.all_ok(run_ranks(H.cuda_fsdp_worker, 2, timeout=300, steps=4))
    for rank, info in out.items():
        assert info["transport"] == "cuda-ipc", info["transport"]
        assert info["grad_device"].startswith("cuda"), info["grad_device"]
        assert info["max_diff"] < 1e-5, (rank, info["max_diff"])
