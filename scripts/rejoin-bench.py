#!/usr/bin/env python3
"""What a rejoin costs at the engine, against moving the same state through a checkpoint file, in one run.

Runs 2 emulated nodes of ``--per-node`` ranks on this host (``LOCAL_WORLD_SIZE`` emulation, a torch ``TCPStore``).
Node 0 trains alone (an elastic generation with ``members=[0]``: minibatches of a publish, a gather, a push and
``finish_minibatch`` of one f32 bucket, ``--compute-ms`` of sleep each, then an AdamW-like step of its state: the
parameter shard, two moments and a step count, ``--state-mb`` per rank in all); node 1's ranks call
``odc.Engine.rejoin`` at once and join at a boundary. Reported per size: the members' admit (the new
generation's registration and the serving of their state; every other boundary's admit is one store read), the
joiner's ``rejoin`` (asking, waiting for the boundary, registration, the one-sided copy) and the copy alone; and
the baseline, measured by the joiner's ranks on the same bytes after the run: ``torch.save`` of the state to
``--ckpt-dir`` with an ``fsync``, then ``torch.load`` of it (from the page cache: a lower bound of a restart's
state movement, which also reruns every step since the checkpoint and restarts every node).
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


def rank_fn(rank: int, world: int, port: int, per_node: int, transport: str, state_mb: float, minibatches: int,
            compute_ms: float, ckpt_dir: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import odc

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300))
    # The parameter shard and two moments (f32) and a step count: state_mb per rank.
    sl = max(16, int(state_mb * 2**20 / 12) // 16 * 16)
    numel = sl * per_node
    buckets = [odc.Bucket("w", numel, torch.float32)]
    state = [torch.zeros(sl), torch.zeros(sl), torch.zeros(sl), torch.zeros((), dtype=torch.int64)]
    kw = {"local_world_size": per_node, "sharding": "hybrid", "transport": transport, "timeout": 300,
          "job_key": f"rejoin-bench-{os.getppid()}"}
    node = rank // per_node
    t0 = time.perf_counter()
    if node == 0:
        eng = odc.Engine(store, rank, world, prefix="bench", members=[0], elastic=True, **kw)
        eng.register(buckets)
        state[0].copy_(torch.arange(sl, dtype=torch.float32) / 7 + rank)
        first = 0
    else:
        eng = odc.Engine.rejoin(store, rank, world, buckets, state, prefix="bench", **kw)
        first = int(eng.first_minibatch or 0)
    rejoin_s = time.perf_counter() - t0
    copy_s = next((e["copy_s"] for e in eng.elastic_events() if e["kind"] == "join"), None) if node else None
    grads, full, boundary = torch.ones(numel), torch.empty(eng.bucket("w")["padded_len"]), {}
    for k in range(first, minibatches):
        time.sleep(compute_ms / 1e3)
        eng.publish("w", state[0], version=k)
        eng.gather("w", k, full)
        eng.scatter_accumulate("w", grads, scale=1.0)
        eng.finish_minibatch(k)
        g = eng.grad_shard("w")
        state[1].mul_(0.9).add_(g, alpha=0.1)
        state[2].mul_(0.999).addcmul_(g, g, value=0.001)
        state[0].sub_(1e-3 * state[1] / (state[2].sqrt() + 1e-8))
        state[3].add_(1)
        eng.zero_grad()
        t = time.perf_counter()
        eng = eng.admit(state)
        boundary[k] = time.perf_counter() - t
    result: dict[str, Any] = {"rank": rank, "first": first, "rejoin_s": rejoin_s, "copy_s": copy_s,
                              "boundary": boundary, "state_bytes": sum(t.numel() * t.element_size() for t in state)}
    if node == 1:
        path = os.path.join(ckpt_dir, f"rejoin-bench-{os.getpid()}.pt")
        try:
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            result["save_s"] = time.perf_counter() - t
            t = time.perf_counter()
            loaded = torch.load(path)
            result["load_s"] = time.perf_counter() - t
            assert all(torch.equal(a, b) for a, b in zip(loaded, state, strict=True))
        finally:
            os.unlink(path)
    out.put(result)


def run(args: argparse.Namespace, state_mb: float) -> dict[str, Any]:
    import torch.distributed as dist

    world = 2 * args.per_node
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_fn, args=(r, world, master.port, args.per_node, args.transport, state_mb,
                                                args.minibatches, args.compute_ms, args.ckpt_dir, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = {r["rank"]: r for r in (out.get(timeout=900) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"rejoin-bench: a rank exited with {p.exitcode}")
    members = [r for r in range(world) if r < args.per_node]
    joiners = [r for r in range(world) if r >= args.per_node]
    back = res[joiners[0]]["first"]
    admit = max(res[r]["boundary"][back - 1] for r in members)
    other = statistics.median(v for r in members for k, v in res[r]["boundary"].items() if k != back - 1)
    row = {
        "state_mb": res[joiners[0]]["state_bytes"] / 2**20, "back": back,
        "admit_s": admit, "other_boundary_s": other,
        "rejoin_s": max(res[r]["rejoin_s"] for r in joiners), "copy_s": max(res[r]["copy_s"] for r in joiners),
        "save_s": max(res[r]["save_s"] for r in joiners), "load_s": max(res[r]["load_s"] for r in joiners),
    }
    row["copy_over_ckpt"] = row["copy_s"] / (row["save_s"] + row["load_s"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--state-mb", default="4,64,256", help="replica state per rank, MiB (comma-separated sizes)")
    ap.add_argument("--minibatches", type=int, default=12)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--ckpt-dir", default="/tmp")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    rows = []
    for mb in (float(x) for x in args.state_mb.split(",")):
        row = run(args, mb)
        rows.append(row)
        print(f"{row['state_mb']:.0f} MiB per rank: members' admit {row['admit_s']:.3f} s (other boundaries "
              f"{row['other_boundary_s'] * 1e3:.2f} ms), joiner's rejoin {row['rejoin_s']:.3f} s, of which the copy "
              f"{row['copy_s']:.3f} s; checkpoint save+load {row['save_s']:.3f}+{row['load_s']:.3f} s; copy / "
              f"checkpoint {row['copy_over_ckpt']:.2f}", flush=True)
    if args.json:
        from odc.bench.report import write_json

        write_json(args.json, {"bench": "rejoin-bench", "args": vars(args), "rows": rows,
                               "load_average": os.getloadavg(), "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
