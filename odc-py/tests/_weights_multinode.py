"""Scenarios for test_weights_multinode.py, run by ``_multihost_worker`` in each rank's network namespace
(``"_weights_multinode:<function>"``).

The ranks listed in ``trainers`` form a gloo group of their own (FSDP2 over the tiny model of ``_fsdp_helpers``, SGD)
and serve their weights (``transport="auto"``: the cluster sets ``ODC_FABRIC_ADDR``, so every trainer rank serves its
slots over libfabric too); the other ranks only read, through ``odc.WeightReader`` (shared memory for trainer ranks in
their own namespace, libfabric for the others). Ranks meet through the step's store keys under ``t/``; big results go
to files in ``out`` (the file system is shared by every namespace).
"""

from __future__ import annotations

import datetime
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _fsdp_helpers import build, data, sample_loss
from _weights import _local_shards, _wait

import odc
import odc.fsdp


def _trainer_setup(ctx: Any, trainers: list[int], name: str, slots: int) -> tuple[Any, Any, Any, int]:
    rank = trainers.index(ctx.rank)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=rank, world_size=len(trainers),
                            timeout=datetime.timedelta(seconds=60))
    model = build(len(trainers), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    server = odc.fsdp.serve_weights(model, opt, name=name, slots=slots, store=ctx.store, timeout=30)
    return model, opt, server, rank


def race(ctx: Any, *, trainers: list[int], steps: int, slots: int, out: str, fault_every: int = 3,
         min_reads: int = 5, node_cache: bool = False, pieces: int | None = None) -> dict:
    """Trainer ranks step ``steps`` times as fast as they can (after every reader attached), recording each version's
    local shards; readers loop on the latest version until the trainers are done, every ``fault_every``-th read
    sleeping 1-400 ms in the middle of its last copy (so slots are overwritten under some reads). ``node_cache``:
    the readers share each version through their node's cache. ``pieces``: the readers copy remote slots in pieces
    of that many bytes (``staging="pieces"``), a piece in flight while the one before is cast."""
    name = f"policy{ctx.step}"
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    readers = [r for r in range(ctx.world) if r not in trainers]
    store = ctx.store
    if ctx.rank in trainers:
        model, opt, server, rank = _trainer_setup(ctx, trainers, name, slots)
        versions = [_local_shards(model)]
        _wait(store, f"t/attached{len(readers)}", 120)
        t0 = time.perf_counter()
        for s in range(steps):
            sample_loss(model, data(s, 0, rank)).backward()
            opt.step()
            opt.zero_grad()
            versions.append(_local_shards(model))
        seconds = time.perf_counter() - t0
        assert server.version == steps, (server.version, steps)
        store.set(f"t/trained{rank}", "1")
        torch.save(versions, folder / f"trainer{rank}.pt")
        for r in readers:  # the slots stay served until every reader is through
            _wait(store, f"t/read_done{r}", 120)
        dist.destroy_process_group()
        publish = sorted(server.publish_seconds)
        return {"role": "trainer", "fabric": server.fabric, "fabric_error": server.fabric_error,
                "steps_per_s": steps / seconds, "publish_median_s": publish[len(publish) // 2]}
    if pieces is not None:
        odc.weights.PIECE_BYTES = pieces
    reader = odc.WeightReader(store, name=name, timeout=30, node_cache=node_cache,
                              staging="whole" if pieces is None else "pieces")
    n = store.add("t/attached", 1)
    store.set(f"t/attached{n}", "1")
    rng = random.Random(ctx.rank)
    reads, seconds = [], []
    trained = [f"t/trained{r}" for r in range(len(trainers))]
    while not store.check(trained) or len(reads) < min_reads:
        if fault_every and len(reads) % fault_every == 0:
            reader._set_fault(rng.uniform(0.001, 0.4), 1)
        got = reader.read(dtype=torch.bfloat16, retries=1000)
        reads.append((got.version, got.age, got.attempts, got.tensors))
        seconds.append(got.seconds)
    torch.save(reads, folder / f"reader{ctx.rank}.pt")
    store.set(f"t/read_done{ctx.rank}", "1")
    if reader.cache_fetches is not None:  # the node's other readers read its copies until they are through
        for r in readers:
            _wait(store, f"t/read_done{r}", 120)
    return {"role": "reader", "routes": reader.routes, "reads": len(reads), "cache_fetches": reader.cache_fetches,
            "retried": sum(a > 1 for _, _, a, _ in reads), "read_min_s": min(seconds)}


def gone(ctx: Any, *, trainers: list[int], timeout: float, pace: float = 0.02, run_for: float = 120.0,
         node_cache: bool = False) -> dict:
    """Trainer ranks serve and step every ``pace`` seconds until they are killed (or ``run_for`` passes); readers read
    once, say they are ready, and after the go read in a loop until a read fails. Returns a reader's error (type,
    peer, message, seconds from the go to the error) or ``{"type": None}``."""
    name = f"policy{ctx.step}"
    store = ctx.store
    readers = [r for r in range(ctx.world) if r not in trainers]
    if ctx.rank in trainers:
        model, opt, _server, rank = _trainer_setup(ctx, trainers, name, 2)  # kept: it serves the slots
        for r in readers:
            _wait(store, f"t/first_read{r}", 120)
        ctx.ready()
        end = time.monotonic() + run_for
        s = 0
        while time.monotonic() < end:  # killed by the test long before
            sample_loss(model, data(s, 0, rank)).backward()
            opt.step()
            opt.zero_grad()
            s += 1
            time.sleep(pace)
        return {"role": "trainer", "steps": s}
    reader = odc.WeightReader(store, name=name, timeout=timeout, node_cache=node_cache)
    first = reader.read()
    store.set(f"t/first_read{ctx.rank}", "1")
    ctx.ready()
    ctx.wait_go()
    t0 = time.monotonic()
    reads = 0
    try:
        while time.monotonic() - t0 < 60:
            reader.read(timeout=timeout)
            reads += 1
    except odc.PeerError as e:
        return {"type": type(e).__name__, "peer": e.peer, "message": str(e), "elapsed": time.monotonic() - t0,
                "reads_after_go": reads, "routes": reader.routes, "first": first.version}
    return {"type": None, "reads_after_go": reads, "pid": os.getpid()}


gone.fault = True  # type: ignore[attr-defined]  # the trainers are gone: no orderly end of the step


def copy_rate(ctx: Any, *, mib: list[int], repeats: int = 5) -> dict:
    """Measurement (``scripts/weights-remote.py``): rank 0 serves a plain module of each size (f32) over shared memory
    and libfabric; rank 1 (rank 0's namespace: ``shm``) and then rank 2 (the other namespace: ``fi_read``) time the
    reader's one-sided copy of a whole version and a read into new bf16 tensors; rank 2 also times a plain TCP stream
    of the same bytes from rank 0 (the link's ceiling in this run). Medians of ``repeats``, one reader at a time."""
    import socket
    import statistics

    store = ctx.store
    out: dict[str, Any] = {}

    def median(fn: Any) -> float:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    for m in mib:
        name = f"rate{ctx.step}x{m}"
        if ctx.rank == 0:
            module = torch.nn.Module()
            module.w = torch.nn.Parameter(torch.randn(m * 2**20 // 4 // 1024, 1024))
            server = odc.fsdp.serve_weights(module, name=name, slots=2, store=store, timeout=30)
            assert server.fabric, server.fabric_error
            payload = module.w.detach().numpy().tobytes()
            with socket.socket() as listener:
                listener.bind((os.environ["ODC_FABRIC_ADDR"], 0))
                listener.listen(1)
                store.set(f"t/tcp{m}", f"{os.environ['ODC_FABRIC_ADDR']}:{listener.getsockname()[1]}")
                conn, _ = listener.accept()
                with conn:
                    for _ in range(repeats):
                        conn.sendall(payload)
                        conn.recv(1)
            _wait(store, f"t/rate_done{m}", 300)
            del server
        elif ctx.rank in (1, 2):
            if ctx.rank == 2:
                _wait(store, f"t/rate_shm{m}", 300)
            reader = odc.WeightReader(store, name=name, timeout=30)
            stage = [torch.empty(n, dtype=torch.uint8) for n in reader._slot_bytes]
            bufs = [(t.data_ptr(), t.numel()) for t in stage]
            raw = median(lambda r=reader, b=bufs: r._reader.read(None, b, 30.0, 0))
            bf16 = median(lambda r=reader: r.read(dtype=torch.bfloat16))
            row = {"route": reader.routes[0], "bytes": sum(n for _, n in bufs), "copy_s": raw, "bf16_s": bf16}
            if ctx.rank == 2:
                _wait(store, f"t/tcp{m}", 60)
                host, _, port = store.get(f"t/tcp{m}").decode().rpartition(":")
                buf = bytearray(m * 2**20)
                view = memoryview(buf)
                with socket.create_connection((host, int(port))) as s:

                    def stream(s: Any = s, buf: bytearray = buf, view: memoryview = view) -> None:
                        got = 0
                        while got < len(buf):
                            got += s.recv_into(view[got:])
                        s.sendall(b"k")

                    row["tcp_s"] = median(stream)
                store.set(f"t/rate_done{m}", "1")
            else:
                store.set(f"t/rate_shm{m}", "1")
            out[str(m)] = row
    return out
