#!/usr/bin/env python3
"""What the gradient contract of odc.fsdp costs per minibatch, on examples/hf_sft.py, in one run.

Three ODC runs of the same plan on the same process group, repeated in rotated order:

- ``step-hook``: gradients installed only by the optimizer's step pre-hook (``.grad`` holds FSDP's
  zeros until then) and clipped with ``odc.fsdp.clip_grad_norm_``, which finishes the minibatch
  first. This is how odc.fsdp worked before the contract, emulated here by switching the contract's
  bookkeeping off; torch's own clip would read zeros in it.
- ``contract``: the contract (pending gradients, final on first read), still clipped with
  ``odc.fsdp.clip_grad_norm_``: against ``step-hook``, the contract's own cost.
- ``contract+torch-clip``: the users' loop, torch's ``clip_grad_norm_`` (one norm all-reduce per
  minibatch): against ``contract``, the cost of torch's clip.

    python scripts/contract-cost.py --nproc 2 --rounds 3 --steps 8
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import odc.fsdp
from odc.fsdp import _grads as _fsdp_grads

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hf_sft", ROOT / "examples" / "hf_sft.py")
hf_sft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf_sft)


class StepHookOnly:
    """odc.fsdp before the contract: nothing pending; the step pre-hook copies the final shards in."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def pend(self, *a, **k): pass
    def pend_group(self, *a, **k): pass
    def hand_to_fsdp(self, *a, **k): pass
    def ensure_hooked(self, *a, **k): pass
    def stepped_twice(self): return False

    def finish(self, reason, install=True):
        s = self.real.state  # the contract's finish with this install
        if not s.open:
            return
        s.end(reason, check=install)
        if install:
            self.install([s.engine.grad_shard(g.name) for g in s.groups])
        s.clear()

    def install(self, accums):
        for rec in self.real.params:
            src = accums[rec.group][rec.offset : rec.offset + rec.numel].view(rec.fp.sharded_size)
            rec.param.grad = rec.fp.to_sharded_dtensor(src.to(device=rec.device, dtype=rec.dtype, copy=True))


BOOKKEEPING = ("pend", "hand_to_fsdp", "_after_fsdp", "pend_group")


def timed(cls, spent):
    """Wraps the contract's per-microbatch and per-minibatch bookkeeping with timers (restored by the caller)."""
    saved = {n: getattr(cls, n) for n in BOOKKEEPING}
    for n, f in saved.items():
        def wrap(self, *a, _f=f, **k):
            t = time.perf_counter()
            try:
                return _f(self, *a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        setattr(cls, n, wrap)
    return saved


def run(args, mode, data, rank, world):
    real_enable = odc.fsdp.enable
    spent = [0.0]
    saved = timed(_fsdp_grads.GradContract, spent) if mode != "step-hook" else {}

    def enable(model, opt, **kw):
        real_enable(model, opt, **kw)
        if mode == "step-hook":
            b = model._odc_fsdp
            b.grads.remove_hooks()
            for rec in b.grads.params:
                rec.param.grad = None  # enable made them pending
            b.grads = StepHookOnly(b.grads)

    odc.fsdp.enable = enable
    try:
        clip = torch.nn.utils.clip_grad_norm_ if mode == "contract+torch-clip" else odc.fsdp.clip_grad_norm_
        table = hf_sft.train(args, "odc", args.strategy, data, rank, world, torch.device("cpu"), quiet=True, clip=clip)
    finally:
        odc.fsdp.enable = real_enable
        for n, f in saved.items():
            setattr(_fsdp_grads.GradContract, n, f)
    times = [t for _, _, t in table[1:]]  # the first minibatch warms up
    return sum(times) / len(times), [n for _, n, _ in table], spent[0] / len(table)


MODES = ["step-hook", "contract", "contract+torch-clip"]


def worker(rank, world, args):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = hf_sft.make_data(args)
    per = {m: [] for m in MODES}
    norms, books = {}, []
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[: r % 3]:
            t, n, b = run(args, mode, data, rank, world)
            per[mode].append(t)
            norms[mode] = n
            if mode != "step-hook":
                books.append(b)
    if rank == 0:
        print(f"examples/hf_sft.py model, {world} ranks, {args.steps} minibatches x {args.rounds} rounds, "
              f"strategy {args.strategy}; ms per minibatch (slowest rank, mean after the first), median of rounds")
        base = statistics.median(per["step-hook"])
        for m in MODES:
            med = statistics.median(per[m])
            print(f"  {m:22s} {med * 1e3:8.1f} ms  ({med / base - 1:+.1%} vs step-hook)  rounds: "
                  + ", ".join(f"{x * 1e3:.1f}" for x in per[m]))
        worst = max(abs(a / b - 1) for a, b in zip(norms["contract"], norms["contract+torch-clip"], strict=True))
        print(f"  grad norms, odc's clip vs torch's clip: largest relative difference {worst:.1e}")
        print(f"  the contract's bookkeeping (pending .grad in every push, hook and zero_grad): "
              f"{statistics.median(books) * 1e3:.2f} ms per minibatch on rank 0 (median over runs)")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main():
    argv = sys.argv[1:]
    rounds = 3
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i : i + 2]
    args = hf_sft.parse(argv)
    args.rounds = rounds
    hf_sft.launch(worker, args)


if __name__ == "__main__":
    main()
