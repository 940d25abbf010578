"""``odc-bench primitives``: the collective baseline against ODC's gather and scatter-accumulate.

For every size of the sweep, on every rank, in one run:

- **all-gather**: torch.distributed ``all_gather_into_tensor`` (gloo on CPU,
  nccl on GPU) against ``Engine.gather`` of a version published once;
  against nccl, ODC runs on the same GPUs (``cuda-ipc`` within a node,
  ``nvshmem`` across nodes, or ``ODC_TRANSPORT``) on CUDA tensors, and each
  timed operation ends with a ``torch.cuda.synchronize`` as the collective's
  does;
- **reduce-scatter**: ``reduce_scatter_tensor`` (sum) against
  ``Engine.scatter_accumulate`` + ``Engine.finish_minibatch(k)`` — the
  latter returns when this rank's shard is final, which is reduce-scatter's
  contract. The accumulator keeps adding across iterations; its sums are
  checked at the end of the size and it is zeroed only then, after a barrier.

Every timed operation is framed like a collective benchmark: a barrier
(gloo control group, untimed), the operation (timed), a barrier. A row's
time is the slowest rank's mean. ``size`` is the gathered output for
all-gather and the input for reduce-scatter; ``algbw = size / time``,
``busbw = algbw · (n − 1) / n``, GB = 10⁹ B. ``#wrong`` counts wrong
elements over all ranks (exact integer-valued data, so any dtype checks
exactly).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from .report import busbw_factor, fmt, format_size, png_metadata, table

__all__ = ["OPS", "plot", "primitives_rank", "render"]

OPS = (
    ("all_gather", "none", "all_gather_into_tensor", "gather"),
    ("reduce_scatter", "sum", "reduce_scatter_tensor", "scatter_accumulate"),
)
"""The operations compared, ``(op key, redop, collective name, ODC name)``."""

ELEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def torch_dtype(name: str) -> Any:
    """The torch dtype of a ``-d`` name: ``f32``, ``bf16`` or ``f16``."""
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


def sweep(min_bytes: int, max_bytes: int, factor: int, dtype: str, world: int) -> list[tuple[int, int]]:
    """``(size bytes, count)`` of every size: whole elements, count a multiple of the world (as nccl-tests)."""
    elem = ELEM_BYTES[dtype]
    out = []
    s = min_bytes
    while s <= max_bytes:
        count = max(world, (s // elem) // world * world)
        out.append((count * elem, count))
        s *= factor
    return out


def _gather_pattern(count: int, owner_len: int) -> Any:
    """Value at element i of the gathered buffer: ((i + 3 · owner(i)) mod 8), owner(i) = i // owner_len."""
    import torch

    i = torch.arange(count, dtype=torch.int32)
    return (i + 3 * (i // owner_len)) % 8


def _push_pattern(count: int, rank: int) -> Any:
    """What rank ``rank`` reduces: ((i + rank) mod 4) + 1 — small integers, exact sums in every dtype."""
    import torch

    return (torch.arange(count, dtype=torch.int32) + rank) % 4 + 1


def _sum_pattern(count: int, world: int) -> Any:
    import torch

    total = torch.zeros(count, dtype=torch.int32)
    for r in range(world):
        total += _push_pattern(count, r)
    return total


def _timed(ctx: Any, warmup: int, iters: int, op: Any, sync: Any) -> float:
    """Mean seconds of ``op`` over ``iters`` runs, each between two barriers; warm-up untimed."""
    total = 0.0
    for i in range(warmup + iters):
        ctx.barrier()
        t0 = time.perf_counter()
        op()
        sync()
        dt = time.perf_counter() - t0
        ctx.barrier()
        if i >= warmup:
            total += dt
    return total / iters


def _slowest(ctx: Any, mean_s: float, wrong: int) -> tuple[float, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([mean_s], dtype=torch.float64)
    w = torch.tensor([wrong], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.ctrl)
    dist.all_reduce(w, op=dist.ReduceOp.SUM, group=ctx.ctrl)
    return float(t.item()), int(w.item())


def _result(name: str, size: int, world: int, mean_s: float, wrong: int) -> dict[str, Any]:
    algbw = size / mean_s / 1e9 if mean_s > 0 else float("nan")
    return {"name": name, "time_us": mean_s * 1e6, "algbw": algbw, "busbw": algbw * busbw_factor(world), "wrong": wrong}


def primitives_rank(ctx: Any, *, dtypes: list[str], min_bytes: int, max_bytes: int, factor: int, iters: int,
                    warmup: int, check: bool, timeout: float, chunk_bytes: int | None,
                    in_place: bool = False) -> list[dict[str, Any]]:
    """One rank of ``odc-bench primitives``; rank 0 returns the rows (and emits each as it completes)."""
    import torch
    import torch.distributed as dist

    import odc

    rank, world, dev = ctx.rank, ctx.world, ctx.device
    plan = [(d, size, count) for d in dtypes for size, count in sweep(min_bytes, max_bytes, factor, d, world)]
    eng = ctx.engine(timeout=timeout, chunk_bytes=chunk_bytes, **_device_engine(ctx))
    edev = eng.device  # where ODC's tensors live: the GPU against nccl, else host memory
    eng.register([odc.Bucket(f"{d}-{count}", count, torch_dtype(d)) for d, _, count in plan])
    # Publish every bucket's shard once (version 0): gathers read it from then on.
    for d, _, count in plan:
        info = eng.bucket(f"{d}-{count}")
        sl = info["shard_len"]
        shard = torch.zeros(sl, dtype=torch_dtype(d))
        lo, hi = min(rank * sl, count), min((rank + 1) * sl, count)
        shard[: hi - lo] = _gather_pattern(count, sl)[lo:hi].to(shard.dtype)
        eng.publish(info["name"], shard.to(edev), version=0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    odc_sync = torch.cuda.synchronize if edev.type == "cuda" else (lambda: None)
    minibatch = 0
    rows = []
    for d, size, count in plan:
        name = f"{d}-{count}"
        dt = torch_dtype(d)
        sl = eng.bucket(name)["shard_len"]
        part = count // world
        row_base = {"world": world, "size": size, "count": count, "type": d}

        # -- all-gather -------------------------------------------------------
        inp = _gather_pattern(count, part)[rank * part : (rank + 1) * part].to(dt).to(dev)
        out = torch.empty(count, dtype=dt, device=dev)
        t = _timed(ctx, warmup, iters, functools.partial(dist.all_gather_into_tensor, out, inp, group=ctx.group), sync)
        wrong = int((out.cpu() != _gather_pattern(count, part).to(dt)).sum()) if check else 0
        coll = _result(f"{ctx.backend} all_gather_into_tensor", size, world, *_slowest(ctx, t, wrong))
        del inp, out

        out = torch.empty(count, dtype=dt, device=edev)
        t = _timed(ctx, warmup, iters, functools.partial(eng.gather, name, 0, out), odc_sync)
        wrong = int((out.cpu() != _gather_pattern(count, sl).to(dt)).sum()) if check else 0
        odc_res = _result("odc gather", size, world, *_slowest(ctx, t, wrong))
        del out
        rows.append(_row(row_base, "all_gather", "none", coll, odc_res))
        ctx.emit("row", rows[-1])

        if in_place:
            # FSDP's case: this rank's shard already sits in the output (the
            # collective's input is a view of it; ODC copies only remote shards).
            out = torch.empty(count, dtype=dt, device=dev)
            view = out[rank * part : (rank + 1) * part]
            view.copy_(_gather_pattern(count, part)[rank * part : (rank + 1) * part].to(dt).to(dev))
            t = _timed(ctx, warmup, iters, functools.partial(dist.all_gather_into_tensor, out, view, group=ctx.group),
                       sync)
            wrong = int((out.cpu() != _gather_pattern(count, part).to(dt)).sum()) if check else 0
            coll = _result(f"{ctx.backend} all_gather_into_tensor in-place", size, world, *_slowest(ctx, t, wrong))
            del out, view
            want = _gather_pattern(count, sl).to(dt)
            out = torch.empty(count, dtype=dt, device=edev)
            lo, hi = min(rank * sl, count), min((rank + 1) * sl, count)
            out[lo:hi] = want[lo:hi].to(edev)
            t = _timed(ctx, warmup, iters, functools.partial(eng.gather, name, 0, out, skip_own=True), odc_sync)
            wrong = int((out.cpu() != want).sum()) if check else 0
            odc_res = _result("odc gather skip_own", size, world, *_slowest(ctx, t, wrong))
            del out
            rows.append(_row(row_base, "all_gather_in_place", "none", coll, odc_res))
            ctx.emit("row", rows[-1])

        # -- reduce-scatter ---------------------------------------------------
        inp = _push_pattern(count, rank).to(dt).to(dev)
        out = torch.empty(part, dtype=dt, device=dev)
        t = _timed(ctx, warmup, iters, functools.partial(dist.reduce_scatter_tensor, out, inp, group=ctx.group), sync)
        wrong = (int((out.cpu() != _sum_pattern(count, world)[rank * part : (rank + 1) * part].to(dt)).sum())
                 if check else 0)
        coll = _result(f"{ctx.backend} reduce_scatter_tensor", size, world, *_slowest(ctx, t, wrong))
        del out
        inp = inp.to(edev)

        def push(name: str, inp: Any) -> None:
            nonlocal minibatch
            eng.scatter_accumulate(name, inp, scale=1.0, offset=0)
            eng.finish_minibatch(minibatch)
            minibatch += 1

        t = _timed(ctx, warmup, iters, functools.partial(push, name, inp), odc_sync)
        wrong = 0
        if check:
            lo, hi = min(rank * sl, count), min((rank + 1) * sl, count)
            want = torch.zeros(sl, dtype=torch.float32)
            want[: hi - lo] = _sum_pattern(count, world)[lo:hi].to(torch.float32) * (warmup + iters)
            wrong = int((eng.grad_shard(name).cpu() != want).sum())
        odc_res = _result("odc scatter_accumulate", size, world, *_slowest(ctx, t, wrong))
        ctx.barrier()  # every owner has checked its sums before any zeroing
        eng.zero_grad(name)
        rows.append(_row(row_base, "reduce_scatter", "sum", coll, odc_res))
        ctx.emit("row", rows[-1])
    return rows


def _device_engine(ctx: Any) -> dict[str, Any]:
    """Engine arguments that put ODC on the baseline's GPU (nccl): ``ODC_TRANSPORT`` when it names a CUDA
    transport, else ``cuda-ipc`` on one node and ``nvshmem`` across nodes. Nothing for a CPU baseline."""
    import os

    from odc.engine import CUDA_TRANSPORTS, transport_name

    if ctx.device.type != "cuda":
        return {}
    requested = transport_name(os.environ.get("ODC_TRANSPORT") or None)
    one_node = ctx.local_world is None or ctx.local_world >= ctx.world
    transport = requested if requested in CUDA_TRANSPORTS else ("cuda-ipc" if one_node else "nvshmem")
    return {"transport": transport, "device": ctx.device}


def _row(base: dict[str, Any], op: str, redop: str, coll: dict[str, Any], odc_res: dict[str, Any]) -> dict[str, Any]:
    ratio = odc_res["busbw"] / coll["busbw"] if coll["busbw"] > 0 else float("nan")
    return {**base, "op": op, "redop": redop, "collective": coll, "odc": odc_res, "busbw_ratio": ratio}


_WIDTHS = (10, 11, 5, 6, 1, 10, 8, 8, 6, 1, 10, 8, 8, 6, 1, 7)


def render(rows: list[dict[str, Any]], title: list[str]) -> str:
    """nccl-tests-style tables, one per (world, op): collective columns | ODC columns | busbw ratio."""
    blocks: list[str] = []
    keys = []
    for r in rows:
        k = (r["world"], r["op"], r["type"])
        if k not in keys:
            keys.append(k)
    for world, op, dtype in keys:
        sel = [r for r in rows if (r["world"], r["op"], r["type"]) == (world, op, dtype)]
        coll_name, odc_name = sel[0]["collective"]["name"], sel[0]["odc"]["name"]
        header = ("size", "count", "type", "redop", "|", "time(us)", "algbw", "busbw", "#wrong", "|", "time(us)",
                  "algbw", "busbw", "#wrong", "|", "ratio")
        body = []
        for r in sel:
            c, o = r["collective"], r["odc"]
            body.append((r["size"], r["count"], r["type"], r["redop"], "|", fmt(c["time_us"]), fmt(c["algbw"]),
                         fmt(c["busbw"]), c["wrong"], "|", fmt(o["time_us"]), fmt(o["algbw"]), fmt(o["busbw"]),
                         o["wrong"], "|", fmt(r["busbw_ratio"]) + "x"))
        group = f"{world} ranks, {op.replace('_', '-')}: {coll_name} | {odc_name} | odc/collective busbw"
        blocks.append(table(header, body, _WIDTHS, [*(title if not blocks else []), group]))
    return "\n\n".join(blocks)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """busbw against size, one line per (op, backend, world size)."""
    from .report import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(11, 5))
    lines: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in rows:
        for side, style in (("collective", "--"), ("odc", "-")):
            label = f"{r['odc' if side == 'odc' else 'collective']['name']} ({r['world']} ranks, {r['type']})"
            lines.setdefault((label, style, r["op"]), []).append((r["size"], r[side]["busbw"]))
    # Colour: the operation; line: dashed collective, solid ODC; marker: the world size.
    colours = {"all_gather": "tab:blue", "all_gather_in_place": "tab:green", "reduce_scatter": "tab:red"}
    worlds = sorted({r["world"] for r in rows})
    markers = dict(zip(worlds, "os^Dv<>p*h", strict=False))  # ten markers; further worlds get "o" below
    for (label, style, op), pts in lines.items():
        pts.sort()
        world = int(label.rsplit("(", 1)[1].split()[0])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colours[op], marker=markers.get(world, "o"),
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["size"] for r in rows})
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s) for s in sizes])
    ax.set_xlabel("size (bytes: all-gather output / reduce-scatter input)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=png_metadata())  # which run drew it (the docs check it)
    plt.close(fig)
