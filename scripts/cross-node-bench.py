#!/usr/bin/env python3
"""Cross-node bytes and time per minibatch of full sharding's gathers and pushes, across shaped network namespaces.

``--world`` ranks are spread over ``--netns`` network namespaces (veth +
bridge, each veth shaped to ``--rate`` both ways with ``tc ... tbf``: a
node's link). Every rank runs an FSDP-shaped minibatch on ``--buckets`` f32
buckets of ``--bucket-mb`` MiB (the "model"): per microbatch (``--micros``)
each bucket is gathered for the forward and again for the backward, and its
full gradient is reduced once; then the minibatch ends. Modes, each on the
same links:

- ``gloo``: FSDP2's collectives over gloo: ``all_gather_into_tensor`` twice
  and ``reduce_scatter_tensor`` once per bucket per microbatch;
- ``odc-direct``: ODC full sharding with ``cross_node="direct"`` and no node
  cache: every rank reads every remote shard and pushes to every remote
  owner itself (the engine before the node rules);
- ``odc-cache``: the node cache, pushes direct;
- ``odc-node``: the node cache and node sums (``cross_node="node"``);
- ``odc-node-<P>`` / ``odc-node-<G>g`` / ``odc-node-<G>g-<P>``: ``odc-node``
  with compressed chunks across nodes (``compress={"push": P, "gather": G}``,
  ``--block`` elements per f32 scale, error feedback on): ``P`` one of
  ``int8``, ``fp8``, ``bf16`` (the node sums' pushes), ``G`` one of ``fp8``,
  ``bf16``, ``int8`` (the node cache's fetches), e.g. ``odc-node-int8``,
  ``odc-node-fp8g-int8``.

Bytes: each namespace's veth counters (``/proc/self/net/dev`` inside it,
read by its first rank at barriers around the timed minibatches): received
bytes per minibatch per node (a node's link in; what it sends is the other
nodes' receive). The formula is the cross-node payload the node rules aim
at, per node per minibatch: ``(N − 1)/N`` of the gathered bytes (each
parameter version once) plus ``(N − 1)/N`` of the gradient bytes (each
node's gradient once); for a compressed mode each part at its format's
width with one f32 scale per block (bf16: none) and the pushes' 64-byte
chunk headers, against which the compressed modes are measured (and
against ``odc-node``'s bytes of the same run); and beside it what ``direct`` must move (G times
the gathers of every microbatch and G times the pushes). Time: the slowest
rank's mean minibatch.

The modes run ``--rounds`` times, alternating (odd rounds in the order
given, even rounds reversed), so that the machine's load hits every mode
alike; the tables give each mode's median round.

Usage (root; a few minutes)::

    .venv/bin/python scripts/cross-node-bench.py --netns 2 --world 8 --rate 1gbit \
        -J docs/bench/cross-node-2x4-1gbit.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from odc.bench.compressed import HEADER_BYTES, mode_compress, tolerance, unknown_mode, width

MODES = ("gloo", "odc-direct", "odc-cache", "odc-node")


def compress_of(mode: str, block: int) -> dict[str, Any] | None:
    """The ``compress=`` setting of a mode (``None``: uncompressed); raises ValueError for a name no mode has."""
    return mode_compress(mode, "odc-node", MODES, block)


def rank_fn(ctx: Any, *, mode: str, buckets: int, numel: int, micros: int, minibatches: int, warmup: int,
            timeout: float, compute_ms: float, block: int = 32) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from odc.bench.netns import veth_bytes
    from odc.engine import Bucket

    world, rank = ctx.world, ctx.rank
    shard = numel // world
    grads = [torch.full((numel,), 1.0 + b) for b in range(buckets)]
    full = [torch.empty(numel) for _ in range(buckets)]
    eng = None
    if mode == "gloo":
        params = [torch.full((shard,), float(rank)) for _ in range(buckets)]
        outs = [torch.empty(shard) for _ in range(buckets)]
    else:
        compress = compress_of(mode, block)
        kw: dict[str, Any] = {
            "odc-direct": {"cross_node": "direct", "node_cache_mb": 0},
            "odc-cache": {"cross_node": "direct"},
            "odc-node": {"cross_node": "node"},
        }[mode] if compress is None else {"cross_node": "node", "compress": compress}
        eng = ctx.engine(timeout=timeout, **kw)
        eng.register([Bucket(f"b{i}", numel, torch.float32) for i in range(buckets)])
        mine = [torch.full((eng.bucket(f"b{i}")["shard_len"],), float(rank)) for i in range(buckets)]

    def minibatch(k: int) -> None:
        if eng is not None:
            for b in range(buckets):
                eng.publish(f"b{b}", mine[b], k)
        # Emulated compute per microbatch (a sleep: the cores stay free for the transfers), a third in the
        # forward and two thirds in the backward, spread over the buckets.
        step = compute_ms / 1000.0 / (3 * buckets)
        for _ in range(micros):
            for b in range(buckets):  # forward
                time.sleep(step)
                if eng is None:
                    dist.all_gather_into_tensor(full[b], params[b], group=ctx.group)
                else:
                    eng.gather(f"b{b}", k, full[b])
            for b in reversed(range(buckets)):  # backward: re-gather, then the gradient
                time.sleep(2 * step)
                if eng is None:
                    dist.all_gather_into_tensor(full[b], params[b], group=ctx.group)
                    dist.reduce_scatter_tensor(outs[b], grads[b], group=ctx.group)
                else:
                    eng.gather(f"b{b}", k, full[b])
                    eng.scatter_accumulate(f"b{b}", grads[b])
        if eng is not None:
            eng.finish_minibatch(k)
            # Every rank pushed 1 + b into every element, every microbatch (a compressed push: within its
            # format's step).
            for b in range(buckets):
                want_sum = micros * world * (1.0 + b)
                if float((eng.grad_shard(f"b{b}") - want_sum).abs().max()) > push_tol * want_sum:
                    raise RuntimeError(f"rank {rank}: wrong gradient sum in bucket b{b}, minibatch {k}")
            eng.zero_grad()

    spec = compress_of(mode, block) or {}
    push_tol, gather_tol = tolerance(spec.get("push")), tolerance(spec.get("gather"))
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    for k in range(warmup):
        minibatch(k)
    ctx.barrier()
    before, t0 = veth_bytes(ifname), time.perf_counter()
    spans = []
    for k in range(warmup, warmup + minibatches):
        start = time.perf_counter()
        minibatch(k)
        spans.append(time.perf_counter() - start)
    ctx.barrier()
    total = time.perf_counter() - t0
    after = veth_bytes(ifname)
    # The last minibatch's values: every gathered element is its owner's rank (shards of equal length); a
    # compressed gather's within its format's step.
    want = torch.arange(world, dtype=torch.float32).repeat_interleave(shard)
    wrong = sum(int(((f - want).abs() > gather_tol * want).sum()) for f in full)
    stats = eng.node_cache_stats() if eng is not None else None
    every = ctx.all_gather_object({
        "spans": spans, "total": total, "rx": after[0] - before[0], "tx": after[1] - before[1],
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "cache": stats,
        "cross_node": eng.cross_node if eng is not None else None, "wrong": wrong,
        "transport": eng.transport if eng is not None else ctx.backend,
        "chunk_bytes": eng._native.chunk_bytes if eng is not None else None,
    })
    return {"ranks": every, "g": ctx.local_world or world, "n": world // (ctx.local_world or world)}


def compressed_formula(args: argparse.Namespace, n: int, g: int, compress: dict[str, Any],
                       chunk_bytes: int, cross_node: str = "node") -> float:
    """Cross-node bytes into one node per minibatch under the node cache with ``compress`` (its ``push`` and
    ``gather`` ``None``: f32): the gathered parameters at the gather format's width (one f32 scale per block;
    bf16 none), the other nodes' gradients at the push format's, and a header for every pushed chunk (as many
    whole blocks as a landing slot of ``chunk_bytes`` holds). ``cross_node`` is the rule the engine resolved:
    ``"node"``, each node's sum once per minibatch; ``"direct"`` (what ``"node"`` resolves to with one rank
    per node), every rank's own push every microbatch."""
    block = compress["block"]
    elems = args.buckets * args.numel
    remote = (n - 1) / n
    gathers = remote * elems * width(compress["gather"], block)
    shard = args.numel // args.world
    per_chunk = chunk_bytes // 4 if compress["push"] is None else \
        chunk_bytes // int(width(compress["push"], block) * block) * block
    # Into a node: every other node's sums of this node's G owners' shards, per bucket; or every other node's
    # G ranks' own pushes, every microbatch.
    senders = 1 if cross_node == "node" else g * args.micros
    pushes = senders * (n - 1) * g * args.buckets * (shard * width(compress["push"], block)
                                                     + -(-shard // per_chunk) * HEADER_BYTES)
    return gathers + pushes


def formulas(args: argparse.Namespace, n: int, g: int) -> dict[str, float]:
    """Cross-node payload bytes into one node per minibatch, by layout (f32 parameters and gradients)."""
    model = args.buckets * args.numel * 4
    remote, d = (n - 1) / n, args.world
    return {
        # Each parameter version once per node (its node cache), each other node's gradient sum once.
        "node": remote * model + remote * model,
        # Every rank reads the remote shards at both gathers of every microbatch, and every remote rank
        # pushes its part to this node's owners every microbatch.
        "direct": g * args.micros * (2 * remote * model + remote * model),
        # A ring over the D ranks in node order crosses into each node once per step: (D - 1) / D of the
        # bucket per collective, 2 all-gathers and a reduce-scatter per microbatch.
        "ring": args.micros * 3 * (d - 1) / d * model,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--netns", type=int, default=2)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rate", default="1gbit", help="tc rate of every namespace's link, each way ('' for none)")
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--micros", type=int, default=2)
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="emulated compute per microbatch (a sleep; a third forward, two thirds backward)")
    ap.add_argument("--minibatches", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated: gloo, odc-direct, odc-cache, odc-node, or odc-node with compression: "
                         "odc-node-<push> (int8, fp8, bf16), odc-node-<gather>g (fp8g, bf16g, int8g) or both, "
                         "e.g. odc-node-int8, odc-node-fp8g-int8")
    ap.add_argument("--block", type=int, default=32, help="elements per f32 scale of the compressed modes")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every mode, alternating the order")
    ap.add_argument("-J", "--json", default="", help="write the results here too")
    args = ap.parse_args()
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    args.numel = int(args.bucket_mb * (1 << 20) / 4) // (args.world * 16) * (args.world * 16)
    from odc.bench import netns

    load_before = os.getloadavg()
    modes = args.modes.split(",")
    bad = unknown_mode(modes, "odc-node", MODES)
    if bad is not None:
        ap.error(bad)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    raw: dict[str, Any] = {}
    for rnd in range(args.rounds):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            load_run = os.getloadavg()
            res = netns.run_ranks(rank_fn, args.world, netns=args.netns, transport="auto", backend="gloo",
                                  rate=args.rate, mode=mode, buckets=args.buckets, numel=args.numel,
                                  micros=args.micros, minibatches=args.minibatches, warmup=args.warmup,
                                  timeout=args.timeout, compute_ms=args.compute_ms, block=args.block)
            raw[mode] = res
            firsts = [r for r in res["ranks"] if r["local_rank"] == 0]
            run = {"ms": 1e3 * max(r["total"] for r in res["ranks"]) / args.minibatches,
                   "rx_per_node": [r["rx"] / args.minibatches for r in firsts],
                   "tx_per_node": [r["tx"] / args.minibatches for r in firsts],
                   "wrong": sum(r["wrong"] for r in res["ranks"]), "load_before": load_run,
                   "load": os.getloadavg()}
            runs[mode].append(run)
            print(f"# round {rnd + 1} {mode}: {run['ms']:.0f} ms / minibatch, rx per node "
                  f"{[f'{x / 2**20:.1f}' for x in run['rx_per_node']]} MiB, load {run['load'][0]:.1f}",
                  file=sys.stderr, flush=True)
    rows = []
    for mode in modes:
        ordered = sorted(runs[mode], key=lambda r: r["ms"])
        med = ordered[len(ordered) // 2]
        first = raw[mode]["ranks"][0]
        rows.append({"mode": mode, "ms": med["ms"], "ms_runs": [r["ms"] for r in runs[mode]],
                     "rx_per_node": med["rx_per_node"], "tx_per_node": med["tx_per_node"],
                     "wrong": sum(r["wrong"] for r in runs[mode]), "cross_node": first["cross_node"],
                     "transport": first["transport"], "cache": [r["cache"] for r in raw[mode]["ranks"]],
                     "load_runs": [[r["load_before"], r["load"]] for r in runs[mode]]})
    n, g = raw[rows[0]["mode"]]["n"], raw[rows[0]["mode"]]["g"]
    f = formulas(args, n, g)
    model = args.buckets * args.numel * 4
    for r in rows:
        # The node-cache modes' formula from the rule the engine resolved (one rank per node: direct pushes).
        spec = compress_of(r["mode"], args.block)
        if spec is not None or r["mode"] == "odc-node":
            chunk = raw[r["mode"]]["ranks"][0]["chunk_bytes"]
            if spec is not None:
                r["compress"] = spec
            plain_spec = {"push": None, "gather": None, "block": args.block}
            r["formula"] = compressed_formula(args, n, g, spec or plain_spec, chunk, r["cross_node"])
    plain = next((r for r in rows if r["mode"] == "odc-node"), None)
    print(f"{args.world} ranks over {args.netns} namespaces ({n} x {g}), links {args.rate or 'unshaped'}, "
          f"{args.compute_ms:g} ms of emulated compute per microbatch; model "
          f"{args.buckets} x {args.numel * 4 / 2**20:.2f} MiB f32 = {model / 2**20:.1f} MiB, {args.micros} "
          f"microbatches (2 gathers + 1 reduce each), {args.minibatches} timed minibatches")
    print("| mode | ms / minibatch | cross-node MiB in per node / minibatch (veth rx, mean) | / node-rule formula |"
          " / its own formula (rule resolved, scales, headers) | bytes / odc-node's | ms / odc-node's | wrong |")
    print("|---|---|---|---|---|---|---|---|")
    plain_rx = sum(plain["rx_per_node"]) / len(plain["rx_per_node"]) if plain else None
    for r in rows:
        mean_rx = sum(r["rx_per_node"]) / len(r["rx_per_node"])
        own = f"{mean_rx / r['formula']:.3f}" if "formula" in r else "–"
        vs_b = f"{mean_rx / plain_rx:.3f}" if plain and plain_rx else "–"
        vs_t = f"{r['ms'] / plain['ms']:.2f}" if plain else "–"
        print(f"| {r['mode']} | {r['ms']:.0f} | {mean_rx / 2**20:.1f} | {mean_rx / f['node']:.2f} | {own} | {vs_b} "
              f"| {vs_t} | {r['wrong']} |")
    print(f"# formula per node per minibatch: node rules {f['node'] / 2**20:.1f} MiB, direct "
          f"{f['direct'] / 2**20:.1f} MiB, a ring {f['ring'] / 2**20:.1f} MiB")
    if args.json:
        from odc.bench.report import write_json  # with the command, commit and date that made it

        write_json(args.json, {"bench": "cross-node", "load_average": os.getloadavg(), "load_before": load_before,
                               "cpus": os.cpu_count(), "args": vars(args), "n": n, "g": g,
                               "model_bytes": model, "formula": f, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
