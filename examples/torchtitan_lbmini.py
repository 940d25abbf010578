"""torchtitan's trainer on CPU ranks: LB-Micro over FSDP2's collectives against LB-Mini over ODC, same documents.

    python examples/torchtitan_lbmini.py --nproc 2 --steps 4

Writes a word-level tokenizer and lognormal-length documents (nothing is
downloaded), plans them twice with odc.packing (LB-Micro: the same number of
packed rows per rank each step, what collectives need; LB-Mini: each rank's
cost balanced, its own number of rows) and trains torchtitan's llama3 debug
model (smaller: ``--layers`` blocks, ``--seq-len``) with
``odc.integrations.torchtitan.Trainer`` on each plan, ODC off for LB-Micro.
Prints, per step, rows per rank, the logged loss and grad norm and the step
time of both runs; the losses and norms agree (torchtitan normalizes by the
global token count, and rows attend per document).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchtitan_cpu as T


def documents(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.steps * args.nproc * args.per_rank):
        n = max(2, min(args.seq_len - 1, int(rng.lognormvariate(args.mu, args.sigma))))
        out.append([1] + [rng.randrange(3, len(T.WORDS) + 3) for _ in range(n - 1)] + [2])
    return out


def run(trainer) -> list[tuple]:
    rows, log, step = [], trainer.metrics_processor.log, trainer.train_step

    def log_step(s, loss, max_loss, grad_norm, **k):
        rows[-1] += (loss, grad_norm)
        return log(s, loss, max_loss, grad_norm, **k)

    def train_step(it):
        t0 = time.perf_counter()
        step(it)
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        rows[-1] = (trainer.gradient_accumulation_steps, float(took)) + rows[-1]

    def wrapped(it):
        rows.append(())
        train_step(it)

    trainer.metrics_processor.log, trainer.train_step = log_step, wrapped
    trainer.train()
    return rows


def worker(rank: int, world: int, args) -> None:
    root = args.root
    T.install()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from odc.integrations.torchtitan import Trainer, plan_documents

    docs = documents(args)
    results = {}
    for name, strategy, odc in (("lb-micro, collectives", "lb-micro", False), ("lb-mini, odc", "lb-mini", True)):
        plan = plan_documents(docs, world, args.per_rank, args.seq_len, strategy=strategy, cost=args.cost)
        config = T.debug_config(os.path.join(root, "tokenizer"), os.path.join(root, "c4_test"), seq_len=args.seq_len,
                                steps=args.steps, layers=args.layers, dump=os.path.join(root, f"dump{rank}"),
                                spmd_backend="partial_dtensor")
        rows = run(Trainer(config, plan=plan, documents=docs, odc=odc))
        counts = [None] * world
        dist.all_gather_object(counts, [r[0] for r in rows])
        results[name] = (rows, counts)
    if rank == 0:
        print(f"{len(docs)} documents, {args.per_rank} per rank per step, seq_len {args.seq_len}, "
              f"cost {args.cost}; load average {os.getloadavg()[0]:.1f}")
        print("step | " + " | ".join(f"{n}: rows per rank, loss, grad norm, ms" for n in results))
        for s in range(args.steps):
            cells = [f"{[c[s] for c in counts]}, {rows[s][2]:.5f}, {rows[s][3]:.5f}, {rows[s][1] * 1e3:6.0f}"
                     for rows, counts in results.values()]
            print(f"{s + 1:4d} | " + " | ".join(cells))
        for n, (rows, _) in results.items():
            print(f"{n}: {sum(r[1] for r in rows[1:]) / max(1, len(rows) - 1) * 1e3:.0f} ms per step after the first")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.15's gloo sometimes aborts in interpreter teardown; the results are printed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--nproc", 2), ("--steps", 4), ("--per-rank", 4), ("--seq-len", 256), ("--layers", 2),
                          ("--seed", 4)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--mu", type=float, default=4.6, help="lognormal document length: mean of log(tokens)")
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cost", default="quadratic")
    args = p.parse_args()
    args.root = tempfile.mkdtemp(prefix="titan-")
    T.write_assets(args.root)
    from hf_sft import launch

    launch(worker, args)


if __name__ == "__main__":
    main()
