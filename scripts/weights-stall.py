#!/usr/bin/env python3
"""Reports the trainer's step time with readers reading its weights continuously against without, in one run.

2 FSDP2 trainer ranks (the tiny model of the tests, gloo, SGD) serve their weights (``odc.fsdp.serve_weights``) and
step through alternating phases: readers idle, readers reading (``odc.WeightReader.read`` in a loop, or every
``--pace`` seconds). The ratio of the median step time of the reading phases to the idle phases is the stall; the
publish (the snapshot copy) is timed on its own. The load average before and after is printed: on a machine with
fewer cores than processes the readers take CPU from the trainer, which no protocol can hide.

    .venv/bin/python scripts/weights-stall.py [--phases 8] [--steps 25] [--readers 2] [--pace 0] [--json out.json]

``--copy 16,256`` measures the copies instead, in one process: the publish of an f32 shard of that many MiB, the
reader's one-sided copy of it, a read into new bf16 tensors and into f32 tensors, and torch's ``copy_`` of the same
bytes (the ceiling); medians of 5, one thread. ``--overlap 64,256`` measures a step (a fixed compute, then the
update) not served, served with the copy in the step's hook, and with ``serve_weights(overlap=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "odc-py" / "tests"
sys.path.insert(0, str(TESTS))


def copies(sizes: list[int]) -> None:
    import datetime
    import statistics
    import time

    import torch
    import torch.distributed as dist

    import odc
    from odc.weights import serve_weights

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)

    def median(fn) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    def row(mib: int) -> list[float]:
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.randn(mib * 2**20 // 4 // 1024, 1024))
        srv = serve_weights(m, store=store, name=f"copy{mib}", slots=2)
        r = odc.WeightReader(store, name=f"copy{mib}")
        stage = [torch.empty(n, dtype=torch.uint8) for n in r._slot_bytes]
        bufs = [(t.data_ptr(), t.numel()) for t in stage]
        f32 = {"w": torch.empty_like(m.w)}
        dst = torch.empty_like(m.w)
        return [median(srv.publish), median(lambda: r._reader.read(None, bufs, 10.0, 4)),
                median(lambda: r.read(dtype=torch.bfloat16)), median(lambda: r.read(into=f32)),
                median(lambda: dst.copy_(m.w.detach()))]

    print("| f32 shard | publish | reader copy | read -> bf16 tensors | read into f32 | copy_ ceiling |")
    for mib in sizes:
        times = row(mib)
        cells = [f"{1e3 * t:.1f} ms ({mib * 2**20 / t / 1e9:.2f} GB/s)" for t in times]
        print(f"| {mib} MiB | " + " | ".join(cells) + " |")


def overlapped(sizes: list[int], rounds: int, steps: int) -> None:
    """One process, one intra-op thread: a step is a fixed compute (matmuls of about the copy's length, the
    microbatches' stand-in) then SGD's in-place update of an f32 parameter of ``mib`` MiB. Three arms, interleaved
    ``rounds`` times, ``steps`` steps each: not served; served with the copy in the step's hook; served with
    ``overlap=True`` (the copy on the server's thread while the next step's compute runs; the next update waits
    for it). Prints each arm's median step time and the served arms' ratio to the plain one."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from odc.weights import serve_weights

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    print(f"load average before: {os.getloadavg()}")
    print("| f32 parameter | compute | plain step | copy in the hook | overlap=True |")
    for mib in sizes:
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.randn(mib * 2**20 // 4 // 1024, 1024))
        m.w.grad = torch.full_like(m.w, 1e-6)
        a = torch.randn(512, 512)
        dst = torch.empty_like(m.w)
        t0 = time.perf_counter()
        dst.copy_(m.w.detach())
        copy_s = time.perf_counter() - t0
        reps = 1
        while True:  # a compute of about one copy's length
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ a
            if time.perf_counter() - t0 >= copy_s:
                break
            reps *= 2
        compute_s = time.perf_counter() - t0
        times: dict[str, list[float]] = {"plain": [], "sync": [], "overlap": []}
        for r in range(rounds):
            for arm, arm_times in times.items():
                opt = torch.optim.SGD([m.w], lr=1e-3)
                srv = None if arm == "plain" else serve_weights(m, opt, store=store, name=f"ov{mib}{arm}{r}",
                                                                 slots=2, overlap=arm == "overlap")
                for _ in range(steps):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        a @ a
                    opt.step()
                    arm_times.append(time.perf_counter() - t0)
                if srv is not None:
                    srv.close()
                del srv, opt
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {mib} MiB | {compute_s * 1e3:.0f} ms | {med['plain'] * 1e3:.0f} ms | {med['sync'] * 1e3:.0f} ms "
              f"({med['sync'] / med['plain']:.2f}x) | {med['overlap'] * 1e3:.0f} ms "
              f"({med['overlap'] / med['plain']:.2f}x) |")
    print(f"load average after: {os.getloadavg()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", type=int, default=8, help="alternating phases (even: idle, odd: reading)")
    ap.add_argument("--steps", type=int, default=25, help="steps per phase")
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--pace", type=float, default=0.0, help="seconds between a reader's reads (0: continuous)")
    ap.add_argument("--json", help="write the numbers here too")
    ap.add_argument("--copy", help="MiB sizes (comma-separated): measure the copies instead")
    ap.add_argument("--overlap", help="MiB sizes (comma-separated): the step with the copy in the hook against "
                    "overlap=True instead (--phases rounds of --steps steps per arm)")
    a = ap.parse_args()
    if a.copy:
        copies([int(x) for x in a.copy.split(",")])
        return 0
    if a.overlap:
        overlapped([int(x) for x in a.overlap.split(",")], a.phases, a.steps)
        return 0
    import _weights as W
    from _dist import run_ranks

    load0 = os.getloadavg()
    roles = ["trainer", "trainer"] + ["stall_reader"] * a.readers
    res = run_ranks(W.ranks, len(roles), timeout=600, roles=roles,
                    trainer={"trainers": 2, "steps": a.phases * a.steps, "slots": 2, "out": None,
                             "readers_first": a.readers, "stall": (a.phases, a.steps)},
                    stall_reader={"pace": a.pace})
    load1 = os.getloadavg()
    bad = {r: v for r, v in res.items() if v[0] != "ok"}
    if bad:
        print(f"failed: {bad}", file=sys.stderr)
        return 1
    out = {"cores": os.cpu_count(), "readers": a.readers, "pace": a.pace, "load_before": load0, "load_after": load1,
           "reads": [res[r][1]["reads"] for r in range(2, len(roles))], "ranks": []}
    for r in (0, 1):
        times = res[r][1]["times"]
        idle = [t for p, t in times if p % 2 == 0]
        busy = [t for p, t in times if p % 2 == 1]
        pub = res[r][1]["publish"][1:]
        row = {"rank": r, "idle_ms": 1e3 * statistics.median(idle), "reading_ms": 1e3 * statistics.median(busy),
               "publish_ms": 1e3 * statistics.median(pub), "slot_bytes": res[r][1]["slot_bytes"],
               "memory_bytes": res[r][1]["memory"]}
        row["ratio"] = row["reading_ms"] / row["idle_ms"]
        out["ranks"].append(row)
        print(f"rank {r}: step {row['idle_ms']:.2f} ms without readers, {row['reading_ms']:.2f} ms with "
              f"{a.readers} reading (ratio {row['ratio']:.3f}); publish {row['publish_ms'] * 1e3:.1f} us of "
              f"{row['slot_bytes']} B; slots hold {row['memory_bytes']} B")
    print(f"reads per reader: {out['reads']}; cores {out['cores']}; load average before {load0[0]:.2f}, "
          f"after {load1[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
