"""verl's PPO actor step on CPU ranks: verl's equalized microbatch counts over gloo against ODC with LB-Mini.

    python examples/verl_ppo.py --nproc 2 --repeats 5                  # LongAlign-shaped lengths scaled down 40x
    python examples/verl_ppo.py --nproc 2 --repeats 5 --balance none   # ODC on verl's own split

Each rank builds two actors through verl's engine registry from the same
random Qwen2 checkpoint: one as verl builds it (FSDP2 over gloo; dynamic
batching raises every rank to the largest microbatch count) and one under
``odc.integrations.verl.enable()`` (LB-Mini moves samples between ranks,
each rank packs its own count). The global batch is split across ranks as
verl's trainer does (``balance_batch``: Karmarkar-Karp by token count into
equal-size parts), each rank's part into minibatches of ``--per-rank``
samples. Every minibatch is a ``train_batch`` with ``ppo_loss`` on both
actors, one after the other, their order alternating between repeats; a
step's time is the slowest rank's. A microbatch's samples are packed into one
row attended per sample (``use_remove_padding``, as with flash-attention's
varlen kernel on GPUs; ``--pad`` pads them to the longest instead). Prints,
per minibatch and rank, microbatches and tokens, and the median step time of
each actor; then the medians over all steps, their ratio, and how far the two
actors' grad norms ever differ (they train the same data from the same
weights).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_cpu as V


def split_like_verl(lengths: list[int], world: int, per_rank: int) -> list[list[list[int]]]:
    """``minibatches[m][r]``: sample indices of rank r's share of minibatch m, as verl's trainer hands them out."""
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    parts = get_seqlen_balanced_partitions(lengths, k_partitions=world, equal_size=True)
    count = len(parts[0]) // per_rank
    return [[part[m * per_rank:(m + 1) * per_rank] for part in parts] for m in range(count)]


@contextlib.contextmanager
def count_tokens(module):
    """Per forward (one per microbatch): (tokens, tokens with padding) -- verl pads a microbatch to its longest."""
    rows: list[tuple[int, int]] = []

    def hook(_, args, kwargs):
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids")
        rows.append((int(mask.sum()) if mask is not None else ids.numel(), ids.numel()))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    model_dir = args.model_dir
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    V.install_cpu_platform()
    import odc.integrations.verl as odc_verl
    from odc import packing

    n = args.minibatches * world * args.per_rank
    lengths = packing.synthetic(f"lognormal:n={n},median={args.median},sigma={args.sigma},max={args.max_len},"
                                f"seed={args.seed}")
    lengths = [max(x, V.PROMPT + 1) for x in lengths]
    minibatches = split_like_verl(lengths, world, args.per_rank)
    width = max(lengths) - V.PROMPT
    kw = {"lr": 1e-4, "remove_padding": not args.pad}
    engines = {"verl (gloo)": V.build_engine(model_dir, args.max_tokens, **kw)}
    odc_verl.enable(balance=None if args.balance == "none" else args.balance)
    engines[f"odc ({args.balance})"] = V.build_engine(model_dir, args.max_tokens, **kw)
    loss = V.ppo_loss(model_dir, args.max_tokens)
    times = {name: [[] for _ in minibatches] for name in engines}
    counts = {name: [None] * len(minibatches) for name in engines}
    norms: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for m, shares in enumerate(minibatches):
            for name in order:
                engine = engines[name]
                data = V.ppo_batch([lengths[i] for i in shares[rank]], seed=1000 * m + rank, width=width,
                                   global_batch=sum(len(s) for s in shares), max_tokens=args.max_tokens,
                                   remove_padding=not args.pad)
                dist.barrier()
                t0 = time.perf_counter()
                with engine.train_mode(), count_tokens(engine.module) as rows:
                    out = engine.train_batch(data, loss_function=loss)
                norms[name].append(float(out["metrics"]["grad_norm"]))
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                mine = torch.tensor([len(rows), sum(r for r, _ in rows), sum(p for _, p in rows)])
                everyone = [torch.zeros(3, dtype=torch.long) for _ in range(world)]
                dist.all_gather(everyone, mine)
                times[name][m].append(float(took))
                counts[name][m] = [tuple(int(x) for x in e) for e in everyone]
    if rank == 0:
        report(args, lengths, minibatches, times, counts, norms)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.15's gloo sometimes aborts in interpreter teardown; the results are printed


def report(args, lengths, minibatches, times, counts, norms) -> None:
    names = list(times)
    print(f"lengths: {len(lengths)} samples, lognormal median {args.median} sigma {args.sigma} max {args.max_len} "
          f"(longest {max(lengths)}), {args.per_rank} per rank per minibatch, budget {args.max_tokens} tokens "
          f"per microbatch, {args.repeats} repeats; load average {os.getloadavg()[0]:.1f}")
    print("per rank: microbatches / tokens / tokens with padding; the step's median time (slowest rank)")
    print("minibatch | " + " | ".join(f"{n:>44s}" for n in names))
    for m in range(len(minibatches)):
        cells = []
        for n in names:
            per_rank = " ".join(f"{c}/{t}/{p}" for c, t, p in counts[n][m])
            cells.append(f"{per_rank:>33s} {statistics.median(times[n][m]) * 1e3:7.0f} ms")
        print(f"{m:9d} | " + " | ".join(cells))
    medians = {n: statistics.median(t for per in times[n] for t in per) for n in names}
    for n, v in medians.items():
        padded = sum(max(p for _, _, p in counts[n][m]) for m in range(len(minibatches)))
        print(f"{n}: median {v * 1e3:.0f} ms per step over {sum(len(p) for p in times[n])} steps; "
              f"the busiest rank's padded tokens summed over minibatches: {padded}")
    a, b = names
    print(f"{b} / {a}: {medians[b] / medians[a]:.3f} (median time per step)")
    worst = max(abs(x - y) / abs(y) for x, y in zip(norms[b], norms[a], strict=True))
    print(f"grad norms of the {len(norms[a])} steps: largest relative difference {worst:.1e} (the same data, "
          "the same initial weights)")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    # LongAlign's lengths (lognormal, median ~10k tokens, up to 64k) scaled down 40x for CPU ranks.
    for flag, default in (("--minibatches", 4), ("--per-rank", 8), ("--median", 250), ("--max-len", 1600),
                          ("--max-tokens", 1600), ("--repeats", 3), ("--layers", 4), ("--hidden", 256),
                          ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--balance", choices=["lb-mini", "none"], default="lb-mini",
                   help="ODC's balance: LB-Mini across ranks per minibatch, or none (verl's split, own counts)")
    p.add_argument("--pad", action="store_true",
                   help="pad each microbatch's samples to its longest (verl's use_remove_padding=False) instead of "
                        "packing them into one row attended per sample")
    args = p.parse_args(argv)
    if args.max_len > args.max_tokens:
        p.error(f"--max-len {args.max_len} exceeds --max-tokens {args.max_tokens}: a sample must fit a microbatch")
    return args


def main() -> None:
    from hf_sft import launch

    args = parse()
    args.model_dir = V.write_model(tempfile.mkdtemp(prefix="verl-ppo-"), layers=args.layers, hidden=args.hidden)
    launch(worker, args)


if __name__ == "__main__":
    main()
