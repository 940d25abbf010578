"""``odc-bench weights``: the time to a rollout worker's usable bf16 model, ODC's one-sided reader against the weight
sync RL frameworks do today, and the trainer's step time while readers read.

Trainer ranks (``--trainers``, default 4) shard an f32 model of ``--sizes`` bytes with FSDP2 (a stack of
``--dim`` x ``--dim`` linear layers, built on the meta device so that each rank only ever holds its shards), in a
gloo group of their own; reader processes (``--readers``, default 2) never join it. Each size runs, in one launch:

1. **baseline** (what verl, OpenRLHF and slime do): the trainers gather a full state dict on rank 0
   (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), and rank 0 broadcasts it tensor by tensor
   over gloo to the readers (a group of rank 0 and the readers), which cast each tensor to bf16. Timed from a barrier
   of every process to each reader's last cast.
2. **odc**: the trainers serve their shards (``serve_weights(slots=2)``, published once, the trainers idle), and
   the readers read it at the same time (``WeightReader(staging=...).read(dtype=torch.bfloat16)``): time to a
   reader's bf16 state dict.
3. **limit**: within one host, the bytes each reader reads over the copy rate measured in the same run (every
   reader copying a 256 MiB f32 buffer at the same time, median of 3); across namespaces, the bytes crossing the
   readers' link over its rate (``--rate``), or, unshaped, over a plain TCP stream's rate between the namespaces
   measured in the same run.
4. **stall**: the trainers' step (an in-place update of every shard, then the publish) ``--steps`` times with no
   reader reading, then ``--steps`` times while every reader reads continuously.

``--where``: ``host`` (every process on this host: shared memory), ``netns`` (trainers in one network namespace,
readers in another, libfabric across an unshaped veth), ``netns:RATE`` (the veth shaped to RATE both ways with
tc tbf, e.g. ``netns:10gbit``). Namespaces need root. ``--trainer-hosts N`` puts the trainer ranks in N namespaces
(each link shaped to RATE, the readers' left unshaped): a reader reads every trainer host at once, and the limit is
each trainer link carrying its share.

Memory: each trainer rank holds its shard and 2 slots (3x its shard); each reader its bf16 model and, for trainer
ranks over the network, its staging (``--staging pieces``: two 64 MiB pieces; ``whole``: every remote rank's slot);
rank 0 the full f32 state dict in the
baseline.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

from .report import UsageError, fmt, say_written, table, write_json

__all__ = ["command", "rank_fn"]

NAME = "bench"


def _stack(layers: int, dim: int) -> Any:
    import torch
    from torch import nn

    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def _wait(store: Any, key: str, timeout: float = 600.0) -> None:
    import datetime

    store.wait([key], datetime.timedelta(seconds=timeout))


def _copy_rate(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """This process's f32 copy rate (bytes/s), median of ``repeats`` copies of ``nbytes``."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        runs.append(time.perf_counter() - t0)
    return nbytes / statistics.median(runs)


def _tcp_rate(ctx: Any, trainers: int, role_rank: int, nbytes: int = 256 << 20) -> float | None:
    """A plain TCP stream of ``nbytes`` from trainer rank 0 to the first reader (the namespaces' link in this run,
    bytes/s, seen by that reader); None on the other processes."""
    store = ctx.store
    addr = os.environ.get("ODC_FABRIC_ADDR", "127.0.0.1")
    if ctx.rank == 0:
        payload = bytes(nbytes)
        with socket.socket() as listener:
            listener.bind((addr, 0))
            listener.listen(1)
            store.set("w/tcp", f"{addr}:{listener.getsockname()[1]}")
            conn, _ = listener.accept()
            with conn:
                conn.sendall(payload)
                conn.recv(1)
        return None
    if ctx.rank != trainers:
        return None
    _wait(store, "w/tcp")
    host, _, port = store.get("w/tcp").decode().rpartition(":")
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_connection((host, int(port))) as s:
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += s.recv_into(view[got:])
        seconds = time.perf_counter() - t0
        s.sendall(b"k")
    return nbytes / seconds


def rank_fn(ctx: Any, *, trainers: int, sizes: list[int], dim: int, repeats: int, steps: int, staging: str,
            tcp: bool, served: str = "f32") -> dict[str, Any]:
    """One process of the benchmark: ranks ``0..trainers-1`` train, the others read. Returns every process's
    measurements (rank 0 gathers them). ``served="bf16"``: the trainers serve bf16 (``serve_weights(dtype=...)``)
    and the baseline's rank 0 casts each tensor to bf16 before it broadcasts it (the same bytes on the wire)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import odc
    import odc.fsdp

    world = ctx.world
    readers = list(range(trainers, world))
    tgroup: Any = dist.new_group(list(range(trainers)))
    bgroup: Any = dist.new_group([0, *readers])
    trainer = ctx.rank < trainers
    mine: dict[str, Any] = {"rank": ctx.rank, "role": "trainer" if trainer else "reader", "sizes": {}}
    torch.manual_seed(ctx.rank)

    mine["copy_Bps"] = None
    if not trainer:
        ctx_barrier: Any = dist.new_group(readers)
        dist.barrier(group=ctx_barrier)
        mine["copy_Bps"] = _copy_rate()  # every reader at once, as they read below
    else:
        dist.new_group(readers)  # every process makes every group, in the same order
    mine["tcp_Bps"] = _tcp_rate(ctx, trainers, ctx.rank) if tcp else None

    for size in sizes:
        layers = max(1, round(size / (dim * dim * 4)))
        row: dict[str, Any] = {"layers": layers, "bytes": layers * dim * dim * 4}
        model: Any = None
        if trainer:
            model = _stack(layers, dim)
            mesh = DeviceMesh.from_group(tgroup, "cpu")
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().uniform_(-0.05, 0.05)
        names = [f"{i}.weight" for i in range(layers)]

        # 1. Baseline: full state dict on rank 0, broadcast over gloo, cast by the readers.
        runs = []
        for _ in range(repeats):
            ctx.barrier()
            t0 = time.perf_counter()
            if trainer:
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                full: Any = get_model_state_dict(model, options=opts)
                if ctx.rank == 0:
                    for n in names:
                        dist.broadcast(full[n] if served == "f32" else full[n].to(torch.bfloat16), src=0,
                                       group=bgroup)
                del full
                runs.append(time.perf_counter() - t0)
            else:
                got = {}
                buf = torch.empty(dim, dim, dtype=torch.float32 if served == "f32" else torch.bfloat16)
                for n in names:
                    dist.broadcast(buf, src=0, group=bgroup)
                    got[n] = buf.to(torch.bfloat16, copy=True)
                runs.append(time.perf_counter() - t0)
                sums = _sums(got)
                del got
        row["baseline_s"] = runs

        # 2. ODC: serve once, every reader reads the version at once.
        server: Any = None
        if trainer:
            server = odc.fsdp.serve_weights(model, None, name=f"{NAME}{size}", slots=2, store=ctx.store,
                                            group=tgroup, timeout=120,
                                            dtype=torch.bfloat16 if served == "bf16" else None)
            row["serve_memory_bytes"] = server.memory_bytes
            row["fabric"] = server.fabric
            row["publish_s"] = []
        reader: Any = None
        if not trainer:
            reader = odc.WeightReader(ctx.store, name=f"{NAME}{size}", timeout=120, staging=staging)
            row["routes"] = sorted(set(reader.routes))
        runs = []
        for _ in range(repeats):
            ctx.barrier()
            if reader is not None:
                t0 = time.perf_counter()
                res = reader.read(dtype=torch.bfloat16)
                runs.append(time.perf_counter() - t0)
                if res.version != 0 or res.tensors is None or _sums(res.tensors) != sums:
                    raise RuntimeError(f"reader {ctx.rank}: the bf16 model read (version {res.version}) differs "
                                       "from the one broadcast")
                del res
        row["odc_s"] = runs

        # 3. Stall: steps alone, then steps while every reader reads continuously.
        ctx.barrier()
        if trainer:
            assert model is not None and server is not None
            _step(model, server)  # the first publish into each slot faults its pages in: not timed
            _step(model, server)
            row["step_alone_s"] = [_step(model, server) for _ in range(steps)]
        ctx.barrier()
        if trainer:
            assert model is not None and server is not None
            row["step_read_s"] = [_step(model, server) for _ in range(steps)]
            ctx.store.add("w/stepped", 1)
        else:
            assert reader is not None
            reads = refused = 0
            while int(ctx.store.add("w/stepped", 0)) < trainers * (sizes.index(size) + 1):
                try:
                    reader.read(dtype=torch.bfloat16, retries=4)
                    reads += 1
                except odc.VersionRefused:
                    refused += 1
            row["stall_reads"], row["stall_refused"] = reads, refused
        ctx.barrier()
        if server is not None:
            row["publish_s"] = list(server.publish_seconds)
        del server, reader, model
        ctx.barrier()
        mine["sizes"][str(size)] = row
    every = ctx.all_gather_object(mine)
    return {"ranks": every}


def _step(model: Any, server: Any) -> float:
    """A trainer step: every local shard updated in place, then published; returns its seconds."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(0.999).add_(1e-4)
    server.publish()
    return time.perf_counter() - t0


def _sums(tensors: dict[str, Any]) -> list[float]:
    """Each tensor's sum in f64, in name order: two bf16 models that agree on these agree (the check of each read)."""
    import torch

    return [float(tensors[n].to(torch.float64).sum()) for n in sorted(tensors)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise(where: str, rate_bps: float | None, out: dict[str, Any], sizes: list[int], trainers: int,
              readers: int, hosts: int = 1, served: str = "f32") -> list[dict[str, Any]]:
    """Per size: the median over repeats of the slowest reader's time, each arm; the limit; the stall. ``hosts``:
    the trainer hosts (namespaces) of a ``netns`` setup; ``served``: the dtype the versions are served (and the
    baseline broadcast) in, whose bytes the limit counts."""
    ranks = out["ranks"]
    rd = [r for r in ranks if r["role"] == "reader"]
    tr = [r for r in ranks if r["role"] == "trainer"]
    rows = []
    for size in sizes:
        k = str(size)
        nbytes = rd[0]["sizes"][k]["bytes"]
        wire = nbytes if served == "f32" else nbytes // 2  # the bytes a reader moves
        slowest = {arm: _median([max(r["sizes"][k][arm][i] for r in rd)
                                 for i in range(len(rd[0]["sizes"][k][arm]))]) for arm in ("baseline_s", "odc_s")}
        if where == "host":
            copy = min(r["copy_Bps"] for r in rd)
            limit, how = wire / copy, f"{served} bytes / copy rate ({copy / 1e9:.2f} GB/s per reader, all at once)"
        elif rate_bps and hosts > 1:  # each trainer host's link carries its ranks' share to every reader
            limit = readers * wire * 8 / (hosts * rate_bps)
            how = f"{readers} x {served} bytes over {hosts} trainer links of {rate_bps / 1e9:g} Gbit/s each"
        elif rate_bps:
            limit = readers * wire * 8 / rate_bps
            how = f"{readers} x {served} bytes over the {rate_bps / 1e9:g} Gbit/s link"
        else:
            tcp = next(r["tcp_Bps"] for r in rd if r["tcp_Bps"])
            limit = readers * wire / tcp
            how = f"{readers} x {served} bytes over a plain TCP stream ({tcp / 1e9:.2f} GB/s)"
        alone = _median([_median(r["sizes"][k]["step_alone_s"]) for r in tr])
        read = _median([_median(r["sizes"][k]["step_read_s"]) for r in tr])
        rows.append({
            "where": (where if hosts == 1 else f"{where} x{hosts}") + ("" if served == "f32" else f", {served} served"),
            "trainer_hosts": hosts, "served": served,
            "bytes": nbytes,
            "trainers": trainers, "readers": readers,
            "baseline_s": slowest["baseline_s"], "odc_s": slowest["odc_s"], "limit_s": limit, "limit": how,
            "speedup": slowest["baseline_s"] / slowest["odc_s"], "of_limit": slowest["odc_s"] / limit,
            "routes": rd[0]["sizes"][k]["routes"],
            "step_alone_s": alone, "step_read_s": read, "stall": read / alone,
            "stall_reads": sum(r["sizes"][k]["stall_reads"] for r in rd),
            "stall_refused": sum(r["sizes"][k]["stall_refused"] for r in rd),
            "publish_s": _median([_median(r["sizes"][k]["publish_s"]) for r in tr]),
            "serve_memory_bytes_per_rank": max(r["sizes"][k]["serve_memory_bytes"] for r in tr),
        })
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The table the command prints."""
    head = ("where", "f32 model", "baseline", "odc", "baseline/odc", "limit", "odc/limit", "step alone",
            "step + readers", "stall")
    body = [(r["where"], f"{r['bytes'] / 2**30:.2f} GiB", f"{fmt(r['baseline_s'])} s", f"{fmt(r['odc_s'])} s",
             f"{r['speedup']:.2f}x", f"{fmt(r['limit_s'])} s", f"{r['of_limit']:.2f}x", f"{fmt(r['step_alone_s'])} s",
             f"{fmt(r['step_read_s'])} s", f"{r['stall']:.2f}x") for r in rows]
    return table(head, body, [9, 10, 9, 9, 12, 9, 9, 10, 14, 6])


def command(args: Any) -> int:
    """``odc-bench weights``: runs every ``--where`` setup, prints the table, writes ``--json``."""
    from . import launch, netns
    from .report import parse_size

    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    for where in args.where.split(","):
        if where != "host" and where != "netns" and not where.startswith("netns:"):
            raise UsageError(f"--where {where!r}: expected host, netns or netns:RATE")
    world = args.trainers + args.readers
    hosts = args.trainer_hosts
    if args.trainers % hosts:
        raise UsageError(f"--trainer-hosts {hosts}: must divide --trainers {args.trainers} (the same ranks on each)")
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    for where in args.where.split(","):
        kind, _, rate = where.partition(":")
        kw = {"trainers": args.trainers, "sizes": sizes, "dim": args.dim, "repeats": args.repeats,
              "steps": args.steps, "staging": args.staging, "served": args.served_dtype}
        load0 = os.getloadavg()[0]
        if kind == "host":
            out = launch.run_ranks(rank_fn, world, backend="gloo", tcp=False, **kw)
            rate_bps = None
        elif kind == "netns":
            # Several trainer hosts: the readers' namespace stays unshaped (a rollout node whose link carries what
            # every trainer link sends), so that each trainer link bounds its own share.
            rates = [rate] * hosts + ([""] if hosts > 1 else [rate])
            with netns.Namespaces(hosts + 1, rate=rate, rates=rates) as ns:
                place = [_place(ns, r, hosts, args.trainers, args.readers) for r in range(world)]
                out = launch.run_ranks(rank_fn, world, backend="gloo", placement=place, store_host=ns.root_addr,
                                       tcp=not rate, **kw)
            rate_bps = netns.rate_bits(rate) if rate else None
        else:
            raise UsageError(f"--where {where!r}: expected host, netns or netns:RATE")
        got = summarise(where, rate_bps, out, sizes, args.trainers, args.readers, hosts if kind == "netns" else 1,
                        args.served_dtype)
        for r in got:
            r["load"] = [load0, os.getloadavg()[0]]
        rows += got
        runs[where] = out
        print(render(got), flush=True)
        if args.json:  # after every setup: a later setup that fails loses only itself
            write_json(args.json, {"bench": "weights", "rows": rows, "runs": runs,
                                   "settings": {k: v for k, v in vars(args).items() if k != "func"}})
    say_written(args.json, plots=False)
    return 0


def _place(ns: Any, r: int, hosts: int, trainers: int, readers: int) -> tuple[str, dict[str, str]]:
    """Rank ``r``'s namespace and environment: trainer ranks over the first ``hosts`` namespaces, consecutive ranks
    together; the readers in the last."""
    per_host = trainers // hosts
    i, per, local = (r // per_host, per_host, r % per_host) if r < trainers else (hosts, readers, r - trainers)
    return (ns.names[i], {"LOCAL_WORLD_SIZE": str(per), "LOCAL_RANK": str(local), "ODC_FABRIC_ADDR": ns.addrs[i],
                          "GLOO_SOCKET_IFNAME": ns.ifnames[i], "ODC_TRANSPORT": "shm"})
