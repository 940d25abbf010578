#!/usr/bin/env python3
"""The membership rounds' cost at the engine: time per minibatch of hybrid sharding with and without elastic=True.

Runs ``--world`` ranks on this host as nodes of ``--per-node`` (``LOCAL_WORLD_SIZE`` emulation, shared memory
inside and between the emulated nodes, a torch ``TCPStore`` for the rounds), each minibatch a publish, a gather,
one push and ``finish_minibatch`` of one f32 bucket; the two settings alternate ``--pairs`` times in one sitting.
Reports the median time per minibatch of each run (the slowest rank's) and the ratio of each pair. Nothing dies:
this is what a job pays for being able to survive a death.
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


def rank_fn(rank: int, world: int, port: int, per_node: int, elastic: bool, numel: int, minibatches: int,
            warmup: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import odc

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    eng = odc.Engine(store, rank, world, local_world_size=per_node, sharding="hybrid", elastic=elastic,
                     transport="shm", timeout=120, job_key=f"elastic-bench-{os.getppid()}-{int(elastic)}")
    eng.register([odc.Bucket("w", numel, torch.float32)])
    sl = eng.bucket("w")["shard_len"]
    shard, full, grads = torch.ones(sl), torch.empty(numel), torch.ones(numel)
    spans = []
    for k in range(warmup + minibatches):
        start = time.perf_counter()
        eng.publish("w", shard, version=k)
        eng.gather("w", k, full)
        eng.scatter_accumulate("w", grads, scale=1.0)
        eng.finish_minibatch(k)
        eng.zero_grad()
        if k >= warmup:
            spans.append(time.perf_counter() - start)
    out.put((rank, spans))


def run(world: int, per_node: int, elastic: bool, numel: int, minibatches: int, warmup: int) -> list[float]:
    """Per minibatch, the slowest rank's seconds."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_fn, args=(r, world, master.port, per_node, elastic, numel, minibatches,
                                                warmup, out)) for r in range(world)]
    for p in procs:
        p.start()
    spans = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"elastic-bench: a rank exited with {p.exitcode}")
    return [max(spans[r][i] for r in range(world)) for i in range(minibatches)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1 << 16, help="bucket elements (f32)")
    ap.add_argument("--minibatches", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    if args.world % args.per_node or args.world // args.per_node < 2:
        ap.error("--world must be at least two nodes of --per-node ranks")
    rows = []
    for i in range(args.pairs):
        pair = {}
        for elastic in (False, True):
            per = run(args.world, args.per_node, elastic, args.numel, args.minibatches, args.warmup)
            pair["elastic" if elastic else "hybrid"] = statistics.median(per) * 1e3
        pair["ratio"] = pair["elastic"] / pair["hybrid"]
        rows.append(pair)
        print(f"pair {i}: hybrid {pair['hybrid']:.2f} ms, elastic {pair['elastic']:.2f} ms, "
              f"ratio {pair['ratio']:.2f}", flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    print(f"{args.world} ranks as {args.world // args.per_node} nodes of {args.per_node}: median ratio "
          f"{statistics.median(ratios):.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    if args.json:
        from odc.bench.report import write_json

        write_json(args.json, {"bench": "elastic-bench", "args": vars(args), "rows": rows,
                               "load_average": os.getloadavg(), "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
