#!/usr/bin/env python3
"""Cross-node bytes and time per minibatch of the three sharding layouts, across network namespaces.

Runs the ``odc-bench train`` model (a Qwen2-style decoder from a tiny config)
with FSDP2 on ranks spread over ``--netns`` network namespaces (veth +
bridge: every byte between "nodes" crosses the kernel's TCP stack), in each of

- ``collective-hsdp``: FSDP2's own HSDP over gloo (2-D mesh; gradient sync
  only on the last microbatch of a minibatch, as an accumulating loop does);
- ``collective-full``: FSDP2's full sharding over gloo (1-D mesh; an
  all-gather per layer in the forward and again in the backward, a
  reduce-scatter per layer every microbatch, as ODC pushes);
- ``odc-full``: ``odc.fsdp`` with ``sharding="full"`` and the defaults
  across nodes: the node cache (each remote shard version crosses once per
  node) and node sums (``cross_node="node"``: each node's gradient for a
  remote owner crosses once);
- ``odc-full-<P>`` / ``odc-full-<G>g`` / ``odc-full-<G>g-<P>``: ``odc-full``
  with compressed chunks across nodes (``compress={"push": P, "gather": G}``,
  ``--block`` elements per f32 scale, error feedback on): ``P`` one of
  ``int8``, ``fp8``, ``bf16`` (the node sums' pushes), ``G`` one of ``fp8``,
  ``bf16``, ``int8`` (the node cache's fetches), e.g. ``odc-full-int8``,
  ``odc-full-fp8g-int8``; its formula column is ``odc-full``'s at the
  formats' widths (one f32 scale per block; bf16 none) plus the pushes'
  64-byte chunk headers;
- ``odc-full-direct``: the same with ``cross_node="direct"`` and no node
  cache (every gather and push of every rank crosses itself);
- ``odc-full-cache``, ``odc-full-sums``: one node rule each (the cache with
  direct pushes; node sums without the cache);
- ``odc-full-bounded``: ``odc-full`` with the node cache bounded to one
  bucket's remote shards per gather FSDP2 keeps in flight (2: the layer
  and the next one it prefetches), so that every layer's shards are evicted
  before the backward needs them again; its formula column is
  ``odc-full-direct``'s gathers over G (node-mates in phase: one fetch per
  node per gather) plus the node sums;
- ``odc-full-bounded-node``: the same with the bound counted over the node:
  one bucket per gather in flight on it (G ranks × 2), for node-mates that
  run out of phase; on the default 4 layers that holds every layer, so run
  it with more (``--layers 16``: 8 of 17 buckets); its formula column is
  ``odc-full-bounded``'s;
- ``odc-hybrid``: ``sharding="hybrid"`` (HSDP layout, optimizer replicated
  per node);
- ``odc-hybrid-elastic``: ``odc-hybrid`` with ``elastic=True`` (each
  minibatch's membership round in the store: its cost when nothing dies);
- ``odc-hybrid-zero``: ``sharding="hybrid-zero"`` (1-D mesh, optimizer 1/D);
- ``odc-hybrid-zero-raf``: the same with ``reshard_after_forward=G`` on the
  layers (ZeRO++'s hpZ: FSDP2 keeps 1/G of each gathered layer after the
  forward and re-gathers it over the node in the backward, which ODC serves
  from hybrid-zero's node copy: no more cross-node bytes than without it);
- ``odc-hybrid-<P>``, ``odc-hybrid-zero-<P>``: those two with the
  end-of-minibatch sum across nodes compressed (``compress={"push": P}``,
  error feedback on): each rank reads the other nodes' quantised partial
  sums; ``odc-hybrid-zero-<G>g`` / ``odc-hybrid-zero-<G>g-<P>``: the
  updated parameter pieces hybrid-zero copies across nodes at each publish
  read from their owners' quantised copies too (no gather crosses nodes
  under ``hybrid``, so no gather format there); the formula column is
  theirs at the formats' widths.

Every rank runs the same microbatches (``--micros`` per minibatch of
``--seq`` tokens) and the same AdamW loop with torch's clip. Each rank reads
its namespace's veth counters from ``/proc/self/net/dev`` (the namespace's
own view) at a barrier before and after the timed minibatches; cross-node
bytes per minibatch per rank are the bytes all namespaces received, over
minibatches and ranks. The formula column is the payload the layout must
move (P parameters, 4-byte fp32 parameters and gradients, N namespaces of G
ranks), computed from the model's parameter count and, for
``odc-full-direct``, the gathers and pushes the engine was asked for
(counted); for ``collective-full`` it is a ring's (D − 1)/D of each
collective into each node; the measured column also carries TCP/IP and
libfabric headers and acknowledgements. ``--rate`` shapes every
namespace's link both ways (``tc ... tbf``, ``"1gbit"``).

Usage (root; about 3 minutes)::

    .venv/bin/python scripts/hybrid-bench.py --netns 2 -g 4 --minibatches 4 --micros 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from odc.bench.compressed import GATHER_FORMATS, HEADER_BYTES, PUSH_FORMATS, mode_compress, width

MODES = ("collective-hsdp", "collective-full", "odc-full", "odc-full-direct", "odc-full-cache", "odc-full-sums",
         "odc-full-bounded", "odc-full-bounded-node", "odc-hybrid", "odc-hybrid-elastic", "odc-hybrid-zero",
         "odc-hybrid-zero-raf")


#: The uncompressed modes a compressed one extends (longest name first: odc-hybrid-zero-int8 is hybrid-zero's).
COMPRESSIBLE = ("odc-full", "odc-hybrid-zero", "odc-hybrid")


def split_mode(mode: str, block: int) -> tuple[str, dict[str, Any] | None]:
    """The uncompressed mode ``mode`` extends and its ``compress=`` setting (``None``: uncompressed); raises
    ValueError for a name no mode has, a gather format on a hybrid mode among them (no gather crosses nodes)."""
    if mode in MODES:
        return mode, None
    for base in COMPRESSIBLE:
        try:
            compress = mode_compress(mode, base, MODES, block)
        except ValueError:
            continue
        if compress is not None and (base != "odc-hybrid" or compress["gather"] is None):
            return base, compress
    raise ValueError(mode)


def compress_of(mode: str, block: int) -> dict[str, Any] | None:
    """The ``compress=`` setting of a mode (``None``: uncompressed); raises ValueError for a name no mode has."""
    return split_mode(mode, block)[1]


def rank_fn(ctx: Any, *, mode: str, spec: dict[str, Any], minibatches: int, micros: int, seq: int,
            warmup: int, block: int = 32) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc.fsdp
    from odc.bench.netns import veth_bytes
    from odc.bench.train import ModelSpec, _loss, build_model, markov_tokens, packed_row

    g = ctx.local_world or ctx.world
    n = ctx.world // g
    model = build_model(ModelSpec(**spec), seed=0)
    compress = compress_of(mode, block)
    mode = split_mode(mode, block)[0] if mode.startswith("odc-hybrid") else mode  # odc-full-*: by its own name
    if mode in ("collective-hsdp", "odc-hybrid", "odc-hybrid-elastic"):
        mesh = init_device_mesh("cpu", (n, g), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ctx.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=g if mode == "odc-hybrid-zero-raf" else True)
    fully_shard(model, mesh=mesh)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    asked = {"gathered": 0, "pushed": 0}
    if mode.startswith("odc-"):
        sharding = "full" if mode.startswith("odc-full") else mode.removeprefix("odc-").removesuffix("-raf")
        elastic = mode == "odc-hybrid-elastic"
        sharding = "hybrid" if elastic else sharding
        if mode in ("odc-full-direct", "odc-full-sums"):
            os.environ["ODC_NODE_CACHE_MB"] = "0"  # read by the engine, in this rank's process only
        if mode == "odc-full-bounded":
            os.environ["ODC_NODE_CACHE_MB"] = str(bounded_cache_mb(model, n, g))
        if mode == "odc-full-bounded-node":
            os.environ["ODC_NODE_CACHE_MB"] = str(g * bounded_cache_mb(model, n, g))
        cross = {"odc-full-direct": "direct", "odc-full-cache": "direct", "odc-full-sums": "node"}.get(mode)
        odc.fsdp.enable(model, opt, sharding=sharding, timeout=120, cross_node=cross, elastic=elastic,
                        compress=compress)
        eng = model._odc_fsdp.engine
        gather, push = eng.gather, eng.scatter_accumulate

        def counted_gather(bucket: Any, version: int, out: Any, **kw: Any) -> Any:
            asked["gathered"] += eng.bucket(bucket)["padded_len"]
            return gather(bucket, version, out, **kw)

        def counted_push(bucket: Any, grads: Any, *a: Any, **kw: Any) -> Any:
            asked["pushed"] += eng.bucket(bucket)["padded_len"]
            return push(bucket, grads, *a, **kw)

        eng.gather, eng.scatter_accumulate = counted_gather, counted_push
    vocab = int(model.config.vocab_size)
    rows = [packed_row([markov_tokens(1000 * ctx.rank + j, seq, vocab)]) for j in range(micros)]
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    spans: list[float] = []
    before, t0 = (0, 0), 0.0
    for k in range(warmup + minibatches):
        if k == warmup:
            ctx.barrier()
            before, t0 = veth_bytes(ifname), time.perf_counter()
            asked.update(gathered=0, pushed=0)
        start = time.perf_counter()
        for j, row in enumerate(rows):
            if mode == "collective-hsdp":
                model.set_requires_all_reduce(j == len(rows) - 1)  # sync once per minibatch
            (_loss(model, row) / (seq * micros)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if k >= warmup:
            spans.append(time.perf_counter() - start)
    dist.barrier()
    total = time.perf_counter() - t0
    after = veth_bytes(ifname)
    counts = {"rx": after[0] - before[0], "tx": after[1] - before[1]}
    state = sum(t.to_local().numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim)
    regathers = model._odc_fsdp.state.regathers if mode.startswith("odc-") else 0  # reshard_after_forward=int's
    cross = cache = None
    if mode.startswith("odc-"):
        cross, cache = eng.cross_node, eng.node_cache_stats()
        odc.fsdp.disable(model)
    every = ctx.all_gather_object({"spans": spans, "total": total, "veth": counts, "asked": asked,
                                   "regathers": regathers, "cross_node": cross, "cache": cache,
                                   "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "state": state})
    return {"params": params, "ranks": every, "n": n, "g": g, "micros": micros,
            "buckets": len(model.model.layers) + 1}


#: Gathers FSDP2 keeps in flight in the forward: the layer computing and the next one it prefetches.
IN_FLIGHT = 2


def bounded_cache_mb(model: Any, n: int, g: int) -> float:
    """The node cache bound of ``odc-full-bounded`` in MiB: the remote shards, (N − 1)/N of the largest bucket
    (one per ``fully_shard`` module: a decoder layer, or the root's own parameters), times :data:`IN_FLIGHT`."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    root = sum(p.numel() for p in model.parameters()) - sum(layers)
    return IN_FLIGHT * max(*layers, root) * 4 * (n - 1) / n / 2**20


def formula(mode: str, res: dict[str, Any], minibatches: int, block: int = 32) -> float:
    """Payload bytes one rank receives from other nodes per minibatch (fp32, or a compressed mode's formats with
    their scales and the pushed chunks' headers), from P and the counted calls."""
    p, n, g = res["params"], res["n"], res["g"]
    d = n * g
    base, compress = split_mode(mode, block)
    if compress is not None and base == "odc-hybrid":
        return (n - 1) * p / g * width(compress["push"], block)  # the other nodes' quantised partial sums
    if compress is not None and base == "odc-hybrid-zero":  # the sums of its piece, then the updated pieces
        return (n - 1) * p / d * (width(compress["push"], block) + width(compress["gather"], block))
    if compress is not None:
        # The node rules at the formats' widths; a header per pushed chunk (each remote node's sums of this
        # rank's shard of every bucket: one chunk each at these sizes).
        return (n - 1) / n * p / g * (width(compress["gather"], block) + width(compress["push"], block)) \
            + (n - 1) * res["buckets"] * HEADER_BYTES * (compress["push"] is not None)
    if mode == "collective-hsdp":
        return 2 * (n - 1) / n * p / g * 4  # ring all-reduce of the node shard, once per minibatch
    if mode in ("odc-hybrid", "odc-hybrid-elastic"):
        return (n - 1) * p / g * 4  # reads every other node's partial sums of its node shard
    if mode in ("odc-hybrid-zero", "odc-hybrid-zero-raf"):
        return 2 * (n - 1) * p / d * 4  # reads its piece of the others' partials, then their updated pieces
    if mode == "odc-full":
        # The node rules: each parameter version crosses into a node once, and each other node's gradient sum.
        return 2 * (n - 1) / n * p / g * 4
    if mode == "collective-full":
        # A ring over D ranks in node order crosses into each node once per step: (D - 1) / D of the model per
        # collective, 2 all-gathers and a reduce-scatter per microbatch; per rank, 1 / G of the node's.
        return res["micros"] * 3 * (d - 1) / d * p * 4 / g
    once = (n - 1) / n * p / g * 4  # a node rule's share: the parameters, or the gradients, once per node

    def remote(*kinds: str) -> float:  # bytes per minibatch of the counted calls' elements owned on other nodes
        return statistics.mean(sum(r["asked"][k] for k in kinds) for r in res["ranks"]) / minibatches * (d - g) / d * 4

    if mode == "odc-full-cache":  # parameters once per node, the pushes every rank's own
        return once + remote("pushed")
    if mode == "odc-full-sums":  # every rank's own gathers, the gradients once per node
        return once + remote("gathered")
    # The bounded caches: a fetch per node per gather (node-mates in phase), the gradients once per node.
    if mode in ("odc-full-bounded", "odc-full-bounded-node"):
        return once + remote("gathered") / g
    return remote("gathered", "pushed")  # odc-full-direct: every gathered or pushed element owned elsewhere

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--netns", type=int, default=2)
    ap.add_argument("-g", "--world", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=4, help="timed minibatches per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--micros", type=int, default=2, help="microbatches per rank per minibatch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per microbatch")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated, from {', '.join(MODES)}, or odc-full with compression: odc-full-<push> "
                         f"({', '.join(PUSH_FORMATS)}), odc-full-<gather>g ({', '.join(GATHER_FORMATS)}) or both, "
                         "e.g. odc-full-int8, odc-full-fp8g-int8; odc-hybrid-<push> (the cross-node sum compressed) or "
                         "odc-hybrid-zero with compression as odc-full's; a mode may repeat (runs alternated by hand)")
    ap.add_argument("--block", type=int, default=32, help="elements per f32 scale of the compressed modes")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rate", default="", help="tc rate of every namespace's link, each way ('1gbit'; none)")
    ap.add_argument("--json", default="", help="write the results here too")
    args = ap.parse_args()
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    from odc.bench import netns

    spec = {"hidden": args.hidden, "layers": args.layers}
    rows, raw, loads = [], {}, []
    modes = args.modes.split(",")
    for mode in modes:
        try:
            split_mode(mode, args.block)
        except ValueError:
            ap.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}, odc-full or odc-hybrid-zero with "
                     f"compression (odc-full-<push>, odc-full-<gather>g or odc-full-<gather>g-<push>), or "
                     f"odc-hybrid-<push> (push: {', '.join(PUSH_FORMATS)}; gather: {', '.join(GATHER_FORMATS)})")
    for mode in modes:
        load_before = os.getloadavg()
        res = netns.run_ranks(rank_fn, args.world, netns=args.netns, transport="auto", backend="gloo", mode=mode,
                              rate=args.rate,
                              spec=spec, minibatches=args.minibatches, micros=args.micros, seq=args.seq,
                              warmup=args.warmup, block=args.block)
        raw[mode] = res
        loads.append([mode, load_before, os.getloadavg()])
        per_rank = sum(r["veth"]["rx"] for r in res["ranks"] if r["local_rank"] == 0) / args.minibatches / args.world
        ms = 1e3 * max(r["total"] for r in res["ranks"]) / args.minibatches
        rows.append((mode, ms, per_rank, formula(mode, res, args.minibatches, args.block), res["ranks"][0]["state"],
                     res["params"]))
        regathers = min(r["regathers"] for r in res["ranks"])
        print(f"# {mode}: done ({regathers} backward re-gathers over the node per rank)", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(f"{args.world} ranks over {args.netns} network namespaces (veth + bridge, libfabric tcp), "
          f"{args.micros} microbatches x {args.seq} tokens per rank per minibatch, {args.minibatches} timed "
          f"minibatches; model {rows[0][5] / 1e6:.2f} M parameters")
    print("| mode | ms / minibatch | vs first | cross-node MiB / minibatch / rank (veth rx) | payload by formula "
          "| measured / formula | AdamW state per rank (elements) |")
    print("|---|---|---|---|---|---|---|")
    for mode, ms, got, want, state, _ in rows:
        print(f"| {mode} | {ms:.0f} | {ms / base:.2f} | {got / 2**20:.2f} | {want / 2**20:.2f} | "
              f"{got / want:.2f} | {state} |")
    if args.json:
        from odc.bench.report import write_json  # with the command, commit and date that made it

        write_json(args.json, {"bench": "hybrid-bench", "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                               "args": vars(args), "rows": rows, "raw": raw, "loads": loads})
    return 0


if __name__ == "__main__":
    sys.exit(main())
