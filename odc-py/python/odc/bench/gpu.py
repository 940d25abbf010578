"""Single-GPU figures of ODC's ``cuda-ipc`` transport against a device-to-device copy measured in the same run.

The GPU test machine has one GPU, so there is no NCCL baseline there (NCCL
takes one GPU per rank): two ranks share the GPU, as ``cuda-ipc`` allows,
and each figure is set against ``dst.copy_(src)`` of the same bytes on the
same device in the same process:

- **gather**: rank r reads the peer's published shard (``skip_own``: the
  bytes that cross the IPC mapping), its bandwidth over the copy's, both as
  bytes moved / time (target: at least 0.9 at 64 MiB and above);
- **scatter-accumulate**: each rank pushes a whole bucket (the peer's half
  crosses) and finishes the minibatch, which returns once its own shard is
  final (the peer's daemon has added in what it pushed): bytes pushed to the
  peer / time, over the copy's;
- **latency**: the same gather of a 64 KiB bucket (two 32 KiB shards; target: at most 10 µs).

Every timed operation ends with a ``torch.cuda.synchronize`` and sits
between two barriers (untimed); a figure is the slower rank's mean. The sums
and gathers are checked exactly (``wrong`` counts wrong elements).

``--device cpu --transport emu-ipc`` runs the same code on host tensors
through the device code path (the emulated streams): how a machine without a
GPU checks the benchmark itself; its numbers mean nothing.

Usage: ``python -m odc.bench.gpu --json figures.json`` (on the GPU).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .primitives import _timed

__all__ = ["gpu_rank", "main"]

#: Targets from the GPU-run plan, checked and reported (not enforced: a figure is a figure).
GATHER_VS_COPY_TARGET = 0.9  # at 64 MiB and above
LATENCY_TARGET_US = 10.0


def _slowest(ctx: Any, seconds: float, wrong: int) -> tuple[float, int]:
    got = ctx.all_gather_object((seconds, wrong))
    return max(s for s, _ in got), sum(w for _, w in got)


def gpu_rank(ctx: Any, *, device: str, transport: str, sizes: list[int], latency_bytes: int, iters: int,
             warmup: int) -> list[dict[str, Any]]:
    """One rank of the benchmark; rank 0 returns a row per size (the latency row last)."""
    import torch

    import odc

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        sync: Any = torch.cuda.synchronize
        kw: dict[str, Any] = {"device": dev.index or 0}
    else:
        sync, kw = (lambda: None), {}
    eng = ctx.engine(timeout=120.0, transport=transport, **kw)
    plan = [(f"b{n}", n) for n in sizes] + [("latency", latency_bytes)]
    # A size row's bucket holds two shards of n bytes; the latency row's holds latency_bytes in all.
    eng.register([odc.Bucket(name, max(2, n // 4) if name == "latency" else 2 * max(1, n // 4), torch.float32)
                  for name, n in plan])
    for name, _ in plan:
        sl = eng.bucket(name)["shard_len"]
        eng.publish(name, torch.full((sl,), float(ctx.rank + 1), device=dev), version=0)
    peer = 1 - ctx.rank
    minibatch = 0
    rows = []
    for name, _ in plan:
        sl = eng.bucket(name)["shard_len"]
        nbytes = sl * 4  # what crosses per operation: the peer's shard

        src = torch.ones(sl, device=dev)
        dst = torch.empty_like(src)
        t_copy, _ = _slowest(ctx, _timed(ctx, warmup, iters, lambda d=dst, s=src: d.copy_(s), sync), 0)

        out = torch.zeros(2 * sl, device=dev)
        t_gather = _timed(ctx, warmup, iters, lambda nm=name, o=out: eng.gather(nm, 0, o, skip_own=True), sync)
        wrong = int((out[peer * sl : (peer + 1) * sl] != float(peer + 1)).sum())
        t_gather, wrong_gather = _slowest(ctx, t_gather, wrong)

        grads = torch.ones(2 * sl, device=dev)

        def push(nm: str = name, g: Any = grads) -> None:
            nonlocal minibatch
            eng.scatter_accumulate(nm, g, scale=1.0)
            eng.finish_minibatch(minibatch)
            minibatch += 1

        t_push = _timed(ctx, warmup, iters, push, sync)
        # Both ranks pushed ones into each owner's shard, warmup + iters times.
        wrong = int((eng.grad_shard(name).cpu() != float(2 * (warmup + iters))).sum())
        t_push, wrong_push = _slowest(ctx, t_push, wrong)
        ctx.barrier()  # every owner checked its sums before any zeroing
        eng.zero_grad(name)

        def gbps(seconds: float, moved: int = nbytes) -> float:
            return moved / seconds / 1e9 if seconds > 0 else float("nan")

        rows.append({
            "bytes": nbytes,
            "latency_row": name == "latency",
            "copy_us": t_copy * 1e6, "copy_GBps": gbps(t_copy),
            "gather_us": t_gather * 1e6, "gather_GBps": gbps(t_gather),
            "gather_vs_copy": t_copy / t_gather if t_gather > 0 else float("nan"),
            "scatter_accumulate_us": t_push * 1e6, "scatter_accumulate_GBps": gbps(t_push),
            "scatter_accumulate_vs_copy": t_copy / t_push if t_push > 0 else float("nan"),
            "wrong": wrong_gather + wrong_push,
        })
    return rows


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["latency_row"]:
            ok = r["gather_us"] <= LATENCY_TARGET_US
            out.append(f"{r['bytes'] * 2 // 1024} KiB gather latency {r['gather_us']:.1f} us "
                       f"({'meets' if ok else 'misses'} the {LATENCY_TARGET_US:.0f} us target)")
        elif r["bytes"] >= 64 << 20:
            ok = r["gather_vs_copy"] >= GATHER_VS_COPY_TARGET
            out.append(f"{r['bytes'] >> 20} MiB gather at {r['gather_vs_copy']:.2f} x the copy "
                       f"({'meets' if ok else 'misses'} the {GATHER_VS_COPY_TARGET} target)")
    return out


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the single-GPU figures (``python -m odc.bench.gpu``); returns the exit status.

    0 when every gather and sum was exact, 1 otherwise; ``--json`` writes the rows and verdicts.
    """
    p = argparse.ArgumentParser(prog="python -m odc.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="the device both ranks share (default cuda:0)")
    p.add_argument("--transport", default="cuda-ipc", help="cuda-ipc on a GPU; emu-ipc with --device cpu")
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="bytes per shard, comma-separated")
    p.add_argument("--latency-bytes", type=_size, default=64 << 10,
                   help="the latency row's whole bucket, both shards (default 64K)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows and verdicts here")
    args = p.parse_args(argv)
    from .launch import run_ranks

    sizes = [_size(s) for s in args.sizes.split(",") if s]
    rows = run_ranks(gpu_rank, 2, backend="gloo", device=args.device, transport=args.transport, sizes=sizes,
                     latency_bytes=args.latency_bytes, iters=args.iters, warmup=args.warmup)
    print(f"{'bytes':>12} {'copy us':>10} {'GB/s':>8} | {'gather us':>10} {'GB/s':>8} {'x copy':>7} | "
          f"{'push+finish us':>14} {'GB/s':>8} {'x copy':>7} | wrong")
    for r in rows:
        print(f"{r['bytes']:>12} {r['copy_us']:>10.1f} {r['copy_GBps']:>8.1f} | {r['gather_us']:>10.1f} "
              f"{r['gather_GBps']:>8.1f} {r['gather_vs_copy']:>7.3f} | {r['scatter_accumulate_us']:>14.1f} "
              f"{r['scatter_accumulate_GBps']:>8.1f} {r['scatter_accumulate_vs_copy']:>7.3f} | {r['wrong']}")
    verdicts = _verdicts(rows)
    for v in verdicts:
        print(f"# {v}")
    if args.json:
        from .report import write_json

        write_json(args.json, {"device": args.device, "transport": args.transport, "rows": rows, "verdicts": verdicts})
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
