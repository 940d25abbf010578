#!/usr/bin/env python3
"""What deterministic accumulation costs at a hybrid minibatch's end, across nodes and within one, in one run.

Runs ``--ranks`` ranks on this host as 2 emulated nodes (``LOCAL_WORLD_SIZE`` emulation, hybrid sharding: the
finish includes the cross-node sum, exact under ``deterministic=True``: every replica's fixed-point sums read
one-sidedly, 20 bytes per element where the f32 sum reads 4) and as 1 node (no cross-node sum), each with and
without ``deterministic=True``: 4 configurations, run in turn ``--pairs`` times so that the machine's load falls
on all of them alike. Each minibatch: a publish, a gather, one push of the whole bucket, then
``finish_minibatch``, timed, and ``zero_grad``. Reported: the median finish per configuration and the ratios
deterministic / plain, on 2 nodes and on 1; what the exact cross-node sum adds is the difference between them.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any


def rank_fn(rank: int, world: int, port: int, per_node: int, transport: str, numel: int, minibatches: int,
            deterministic: bool, tag: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import odc

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300))
    eng = odc.Engine(store, rank, world, local_world_size=per_node, sharding="hybrid", transport=transport,
                     deterministic=deterministic, timeout=300, prefix=tag, job_key=f"det-bench-{os.getppid()}-{tag}")
    eng.register([odc.Bucket("w", numel, torch.float32)])
    shard = torch.full((eng.bucket("w")["shard_len"],), 0.5)
    full = torch.empty(eng.bucket("w")["padded_len"])
    grads = torch.linspace(-1.0, 1.0, numel)
    times = []
    for k in range(minibatches):
        eng.publish("w", shard, version=k)
        eng.gather("w", k, full)
        eng.scatter_accumulate("w", grads, scale=0.25)
        t = time.perf_counter()
        eng.finish_minibatch(k)
        times.append(time.perf_counter() - t)
        eng.zero_grad()
    store.add(f"{tag}/done", 1)  # no rank leaves while a peer may still read its regions
    while int(store.add(f"{tag}/done", 0)) < world:
        time.sleep(0.01)
    out.put((rank, times))


def run(args: argparse.Namespace, nodes: int, deterministic: bool, tag: str) -> float:
    import torch.distributed as dist

    world = args.ranks
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_fn, args=(r, world, master.port, world // nodes, args.transport, args.numel,
                                                args.minibatches, deterministic, tag, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"det-hybrid-bench: a rank exited with {p.exitcode}")
    # The minibatch's end is the slowest rank's finish; the first minibatch warms up.
    return statistics.median(max(res[r][k] for r in res) for k in range(1, args.minibatches))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="even: 2 nodes of ranks/2, or 1 node of all")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--numel", type=int, default=4 << 20, help="elements of the one f32 bucket")
    ap.add_argument("--minibatches", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    if args.ranks < 2 or args.ranks % 2:
        ap.error("--ranks must be even and at least 2")
    configs = [(n, d) for n in (2, 1) for d in (False, True)]
    got: dict[tuple[int, bool], list[float]] = {c: [] for c in configs}
    for i in range(args.pairs):
        for n, d in configs:
            got[(n, d)].append(run(args, n, d, f"p{i}n{n}d{int(d)}"))
    med = {c: statistics.median(v) for c, v in got.items()}
    rows = [{"nodes": n, "deterministic": d, "finish_s": med[(n, d)], "runs_s": got[(n, d)]} for n, d in configs]
    for n in (2, 1):
        print(f"{n} node(s) x {args.ranks // n} ranks, {args.numel} elements: finish {med[(n, False)] * 1e3:.2f} ms "
              f"plain, {med[(n, True)] * 1e3:.2f} ms deterministic, ratio {med[(n, True)] / med[(n, False)]:.2f}",
              flush=True)
    if args.json:
        from odc.bench.report import write_json

        write_json(args.json, {"bench": "det-hybrid-bench", "args": vars(args), "rows": rows,
                               "load_average": os.getloadavg(), "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
