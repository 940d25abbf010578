"""odc.Engine across real processes: exact gathers and sums, typed errors, dead peers."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_ranks

import odc

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gather_scatter(rank, world, store, numel, minibatches, transport="shm"):
    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-{os.getppid()}", transport=transport)
    assert eng.transport == transport
    eng.register([odc.Bucket(f"a-{odc.engine.dtype_name(d)}", numel, d) for d in DTYPES])
    for dtype in DTYPES:
        _check_bucket(eng, rank, world, f"a-{odc.engine.dtype_name(dtype)}", numel, dtype, minibatches)
    return True


def _check_bucket(eng, rank, world, name, numel, dtype, minibatches):
    info = eng.bucket(name)
    sl = info["shard_len"]
    full = torch.arange(sl * world, dtype=torch.float32) % 97
    for k in range(minibatches):
        shard = (full[rank * sl : (rank + 1) * sl] + k).to(dtype)
        eng.publish(name, shard, version=k)
        out = torch.empty(numel, dtype=dtype)
        eng.gather(name, k, out)
        want = (full[:numel] + k).to(dtype)
        assert torch.equal(out, want), f"rank {rank} minibatch {k}: gathered wrong values"
        # Every rank pushes (rank+1) * pattern; owners see sum_r (r+1) * pattern.
        grads = ((torch.arange(numel, dtype=torch.float32) % 13) * (rank + 1)).to(dtype)
        for _ in range(rank % 3):  # uneven microbatch counts, including zero
            eng.scatter_accumulate(name, grads, scale=1.0)
        eng.finish_minibatch(eng_minibatch(eng))
        g = eng.grad_shard(name).clone()
        pattern = torch.arange(numel, dtype=torch.float32) % 13
        weight = sum((r + 1) * (r % 3) for r in range(world))
        lo, hi = rank * sl, min((rank + 1) * sl, numel)
        want_g = torch.zeros(sl)
        if hi > lo:
            want_g[: hi - lo] = pattern[lo:hi] * weight
        assert torch.equal(g, want_g), f"rank {rank} minibatch {k}: wrong gradient sums"
        eng.zero_grad()


def eng_minibatch(eng):
    """Minibatch counter shared by every bucket checked on this engine."""
    k = getattr(eng, "_test_k", 0)
    eng._test_k = k + 1
    return k


@pytest.mark.parametrize("world", [2, 4])
def test_gather_and_scatter_exact_every_dtype(world):
    res = run_ranks(_gather_scatter, world, numel=1001, minibatches=3)
    assert all(s == "ok" for s, _ in res.values()), res


def test_gather_and_scatter_exact_over_libfabric():
    # The tcp provider over loopback: the same exact sums through fi_read / fi_writemsg.
    res = run_ranks(_gather_scatter, 2, numel=1001, minibatches=2, transport="fabric")
    assert all(s == "ok" for s, _ in res.values()), res


def _slow_reader(rank, world, store, delay, transport):
    """Push-only minibatches (no publish, no gather), as the odc process group's reduce-scatter runs them: each
    rank pushes, finishes and reads its sums; rank 1 is slow to read, so rank 0's first push of the next
    minibatch reaches it while it still holds the last one's. Returns each minibatch's sums."""
    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-{os.getppid()}", transport=transport)
    eng.register([odc.Bucket("w", 64, torch.float32)])
    sums = []
    for k, value in enumerate((1.0, 10.0, 100.0)):
        eng.scatter_accumulate("w", torch.full((64,), value), scale=1.0)
        eng.finish_minibatch(k)
        if rank == 1:
            time.sleep(delay)  # the owner still reads minibatch k's sums
        sums.append(sorted(set(eng.grad_shard("w").tolist())))
        eng.zero_grad()
    return sums


@pytest.mark.parametrize("transport", ["shm", "fabric"])
def test_a_push_of_the_next_minibatch_waits_until_a_slow_owner_read_the_last(transport):
    """Each owner's sums of minibatch k are exactly the world's pushes of k: none of k + 1 counted in k (landed
    before the read) or lost (landed between the read and the zeroing)."""
    res = run_ranks(_slow_reader, 2, delay=1.0, transport=transport)
    assert all(s == "ok" for s, _ in res.values()), res
    for rank, (_, sums) in res.items():
        for k, value in enumerate((1.0, 10.0, 100.0)):
            assert sums[k] in ([2 * value], [0.0, 2 * value]), (rank, k, sums)  # padding past numel reads 0


def _hybrid(rank, world, store, local, numel, transport):
    eng = odc.Engine(
        store, rank, world, local_world_size=local, timeout=30,
        job_key=f"pytest-{os.getppid()}", transport=transport, sharding="hybrid",
    )
    assert (eng.sharding, eng.local_world_size) == ("hybrid", local)
    eng.register([odc.Bucket("w", numel, torch.float32)])
    sl = eng.bucket("w")["shard_len"]
    assert sl * local >= numel, "hybrid shards span the node, not the world"
    me = rank % local
    pattern = torch.arange(numel, dtype=torch.float32) % 13
    weight = sum((r + 1) * (r % 3) for r in range(world))
    sums = []
    for k in range(3):
        full = torch.arange(sl * local, dtype=torch.float32) % 97 + k
        eng.publish("w", full[me * sl : (me + 1) * sl].clone(), version=k)
        out = torch.empty(numel)
        eng.gather("w", k, out)
        assert torch.equal(out, full[:numel]), f"rank {rank} minibatch {k}: gathered wrong values"
        for _ in range(rank % 3):  # uneven microbatch counts, including zero
            eng.scatter_accumulate("w", pattern * (rank + 1), scale=1.0)
        eng.finish_minibatch(k)
        g = eng.grad_shard("w").clone()
        lo, hi = me * sl, min((me + 1) * sl, numel)
        want = torch.zeros(sl)
        want[: hi - lo] = pattern[lo:hi] * weight
        assert torch.equal(g, want), f"rank {rank} minibatch {k}: the sum over every node is wrong"
        sums.append(g)
        eng.zero_grad()
    return [x.tolist() for x in sums]


@pytest.mark.parametrize(("world", "local", "transport"), [(4, 2, "shm"), (6, 2, "shm"), (4, 2, "mixed")])
def test_hybrid_sharding_sums_across_nodes(world, local, transport):
    res = run_ranks(_hybrid, world, local=local, numel=1001, transport=transport)
    assert all(s == "ok" for s, _ in res.values()), res
    # Replicas (same local rank on every node) hold bitwise the same sums.
    for r in range(world):
        assert res[r][1] == res[r % local][1], f"rank {r} differs from rank {r % local}"


def test_unknown_transport_is_a_config_error():
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(odc.ConfigError, match="carrier-pigeon"):
        odc.Engine(store, 0, 1, transport="carrier-pigeon")


@pytest.mark.parametrize("mb", [-1.0, float("nan"), float("inf")])
def test_a_node_cache_bound_that_is_not_a_size_is_a_config_error(mb):
    import torch.distributed as dist

    with pytest.raises(odc.ConfigError, match=r"node_cache_mb=.*finite number of MiB"):
        odc.Engine(dist.HashStore(), 0, 1, node_cache_mb=mb)


@pytest.mark.parametrize(("var", "value"), [("ODC_LANDING_MB", "lots"), ("ODC_LANDING_MB", "0"),
                                            ("ODC_NODE_CACHE_MB", "-5"), ("ODC_NODE_CACHE_MB", "1GiB"),
                                            ("ODC_CROSS_NODE", "nodes")])
def test_a_malformed_environment_variable_is_a_config_error_naming_it(monkeypatch, var, value):
    # Not the built-in default in its place: the engine refuses to start, naming the variable and its value.
    import torch.distributed as dist

    monkeypatch.setenv(var, value)
    with pytest.raises(odc.ConfigError, match=f"{var}=\"{value}\" is not"):
        odc.Engine(dist.HashStore(), 0, 1)
    monkeypatch.setenv(var, "  ")  # blank: unset
    odc.Engine(dist.HashStore(), 0, 1)


def _bad_input(rank, world, store):
    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-bad-{os.getppid()}")
    eng.register([odc.Bucket("a", 10, torch.float32)])
    errors = []
    for call in (
        lambda: eng.publish("a", torch.zeros(5, dtype=torch.float16), 0),  # wrong dtype
        lambda: eng.publish("a", torch.zeros(3), 0),  # wrong size
        lambda: eng.gather("nope", 0, torch.zeros(10)),  # unknown bucket
        lambda: eng.scatter_accumulate("a", torch.zeros(4), offset=30),  # overruns the padded bucket
        lambda: eng.gather("a", 0, torch.zeros(10, dtype=torch.int32)),  # unsupported dtype
        lambda: eng.gather("a", 0, torch.zeros(20)[::2]),  # not contiguous
    ):
        try:
            call()
        except odc.LayoutError as e:
            errors.append(str(e))
    # Nothing was corrupted: the engine still works.
    sl = eng.bucket("a")["shard_len"]
    eng.publish("a", torch.full((sl,), float(rank)), 0)
    out = torch.empty(10)
    eng.gather("a", 0, out)
    assert out.tolist() == [0.0] * min(sl, 10) + [1.0] * max(0, 10 - sl)
    return errors


def test_bad_input_gives_layout_errors_and_keeps_working():
    res = run_ranks(_bad_input, 2)
    for status, errors in res.values():
        assert status == "ok", res
        assert len(errors) == 6, errors
        assert "float16" in errors[0] or "f16" in errors[0]
        assert "nope" in errors[2]


def _mismatch(rank, world, store):
    eng = odc.Engine(store, rank, world, timeout=20, job_key=f"pytest-mm-{os.getppid()}")
    eng.register([odc.Bucket("a", 10, torch.float32), odc.Bucket("b", 10 + rank, torch.float32)])


def test_mismatched_registration_names_the_bucket():
    res = run_ranks(_mismatch, 2)
    for status, value in res.values():
        assert status == "error"
        cls, msg, _, _ = value
        assert cls == "RegistrationError", msg
        assert "#1" in msg and "b" in msg


def _dies(rank, world, store):
    eng = odc.Engine(store, rank, world, timeout=20, job_key=f"pytest-die-{os.getppid()}")
    eng.register([odc.Bucket("a", 64, torch.float32)])
    eng.publish("a", torch.zeros(eng.bucket("a")["shard_len"]), 0)
    if rank == 1:
        os._exit(3)  # dies mid-minibatch
    eng.scatter_accumulate("a", torch.ones(64))
    eng.finish_minibatch(0)


def test_dead_peer_is_named_not_a_hang():
    res = run_ranks(_dies, 2, timeout=60)
    status, value = res[0]
    assert status == "error", res
    cls, msg, peer, _ = value
    assert cls in ("PeerDied", "PeerTimeout"), msg
    assert peer == 1 and "rank 1" in msg


# Each odc_core::Error variant -> its own class of odc.errors, and that class's parent.
CORE_ERROR_CLASSES = {
    "PeerTimeout": (odc.PeerTimeout, odc.PeerError),
    "PeerDied": (odc.PeerDied, odc.PeerError),
    "Registration": (odc.RegistrationError, odc.OdcError),
    "Layout": (odc.LayoutError, odc.OdcError),
    "Protocol": (odc.ProtocolError, odc.OdcError),
    "Malformed": (odc.MalformedError, odc.ProtocolError),
    "Config": (odc.ConfigError, odc.OdcError),
    "Transport": (odc.TransportError, odc.OdcError),
    "Store": (odc.StoreError, odc.OdcError),
    "GpuUnavailable": (odc.GpuUnavailable, odc.OdcError),
    "Cuda": (odc.CudaError, odc.TransportError),
    "Nvshmem": (odc.NvshmemError, odc.TransportError),
    "Fabric": (odc.FabricError, odc.TransportError),
    "ShmSpace": (odc.ShmSpaceError, odc.TransportError),
    "Io": (odc.OdcOSError, odc.OdcError),
    "Dropped": (odc.NodeDropped, odc.OdcError),
    "Internal": (odc.InternalError, odc.OdcError),
}


def test_error_hierarchy():
    assert issubclass(odc.PeerDied, odc.OdcError)
    assert issubclass(odc.LayoutError, ValueError)
    # One class per Rust variant; subclasses keep `except TransportError` catching transport failures.
    for cls, parent in CORE_ERROR_CLASSES.values():
        assert cls.__bases__[0] is parent and issubclass(cls, odc.OdcError), cls
        assert getattr(odc, cls.__name__) is cls and getattr(odc.errors, cls.__name__) is cls
        assert cls.__name__ in odc.__all__ and cls.__name__ in odc.errors.__all__
    assert len({cls for cls, _ in CORE_ERROR_CLASSES.values()}) == len(CORE_ERROR_CLASSES)
    raised = odc._odc._core_error_examples()
    assert raised.keys() == CORE_ERROR_CLASSES.keys(), sorted(raised)
    for variant, exc in raised.items():
        assert type(exc) is CORE_ERROR_CLASSES[variant][0], (variant, type(exc), exc)
    assert raised["PeerDied"].peer == 1 and "rank 1" in str(raised["PeerDied"])
    assert "fi_getinfo" in str(raised["Fabric"]) and "nvshmemx_init_attr" in str(raised["Nvshmem"])
    assert "cuMemCreate" in str(raised["Cuda"])
    assert "node 1 was dropped" in str(raised["Dropped"]) and "minibatch 3" in str(raised["Dropped"])
    assert "rank 1" in str(raised["Malformed"]) and "bucket" in str(raised["Malformed"])
    with pytest.raises(odc.LayoutError):
        odc.Bucket("x", 0, torch.float32).spec()
    with pytest.raises(odc.LayoutError, match="int64"):
        odc.engine.dtype_name(torch.int64)


def test_a_failing_libfabric_call_raises_fabric_error(monkeypatch):
    """A real engine error from libfabric (a provider that does not exist) arrives as odc.FabricError."""
    monkeypatch.setenv("ODC_FABRIC_PROVIDER", "no-such-provider")
    with pytest.raises(odc.FabricError, match="fi_getinfo") as info:  # the engine brings the transport up
        odc.Engine(torch.distributed.HashStore(), 0, 1, timeout=5, transport="fabric",
                   job_key=f"pytest-fabric-err-{os.getpid()}")
    assert isinstance(info.value, odc.TransportError)


def _grad_view_outlives_engine(rank, world, store, numel):
    import gc

    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-view-{os.getppid()}")
    eng.register([odc.Bucket("w", numel, torch.float32)])
    eng.publish("w", torch.zeros(eng.bucket("w")["shard_len"]), version=0)
    eng.scatter_accumulate("w", torch.full((numel,), float(rank + 1)), scale=1.0)
    eng.finish_minibatch(0)
    view = eng.grad_shard("w")
    want = view.clone()
    del eng
    gc.collect()
    # A large accumulator is its own mapping: were it freed, this read would fault or see other data.
    return torch.equal(view, want), float(want[0])


def test_grad_shard_view_keeps_the_engine_memory_alive():
    out = run_ranks(_grad_view_outlives_engine, 2, timeout=60, numel=1 << 22)
    assert all(s == "ok" for s, _ in out.values()), out
    for rank, (_, (same, first)) in out.items():
        assert same and first == 3.0, (rank, same, first)  # ranks pushed 1 and 2


class _DictStore:
    """What ODC needs of a store (torch's ``set`` / ``get`` / ``check`` / ``add``), as a user's own
    store object may have it; ``multi_get`` only when asked for, and every read counted."""

    def __init__(self, multi_get: bool):
        import threading

        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.reads = {"get": 0, "multi_get": 0}
        if multi_get:
            self.multi_get = self._multi_get

    def set(self, key, value):
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def _wait(self, keys):
        # torch's get blocks until the key is set.
        import time

        deadline = time.monotonic() + 30
        while not self.check(keys):
            assert time.monotonic() < deadline, f"store: {keys} never set"
            time.sleep(0.001)

    def get(self, key):
        self._wait([key])
        with self.lock:
            self.reads["get"] += 1
            return self.data[key]

    def _multi_get(self, keys):
        self._wait(keys)
        with self.lock:
            self.reads["multi_get"] += 1
            return [self.data[k] for k in keys]

    def check(self, keys):
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key, delta):
        with self.lock:
            value = int(self.data.get(key, b"0")) + delta
            self.data[key] = str(value).encode()
            return value


@pytest.mark.parametrize("multi_get", [True, False], ids=["multi_get", "one-by-one"])
def test_registration_reads_every_post_in_one_request_where_the_store_can(multi_get):
    import threading

    world, store = 4, _DictStore(multi_get)
    gathered: dict[int, list[float]] = {}
    failures: list[BaseException] = []

    def rank(r):
        try:
            eng = odc.Engine(store, r, world, timeout=30, job_key=f"pytest-dict-{os.getpid()}")
            eng.register([odc.Bucket("a", 4096, torch.float32)])
            eng.publish("a", torch.full((eng.bucket("a")["shard_len"],), float(r)), 0)
            out = torch.empty(4096)
            eng.gather("a", 0, out)
            eng.finish_minibatch(0)
            gathered[r] = out.tolist()
            del eng
        except BaseException as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    # Every rank's shard of 1024 elements (4096 over 4 ranks) reached every rank.
    assert all(gathered[r] == [float(i // 1024) for i in range(4096)] for r in range(world))
    if multi_get:
        # Three steps read every rank's post (host names, bucket lists, endpoints): one request
        # each per rank, and the job id one get per rank: reads per rank do not grow with D.
        assert store.reads["multi_get"] == 3 * world, store.reads
        assert store.reads["get"] <= world, store.reads
    else:
        assert store.reads["get"] >= 2 * world * world, store.reads
