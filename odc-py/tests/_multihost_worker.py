"""One rank of a test_multihost.py scenario, run inside its network namespace.

``python _multihost_worker.py FOLDER STEPS_JSON`` (or :func:`run`, in a rank
forked into its namespace by ``_netns.py``) runs the steps
``[[scenario, params], ...]`` in order (several scenarios share one process
start); the rank's identity and addresses come from the environment (see
``_netns.py``). Each step has its own store prefix and job key, and ends
with a store barrier. The outcome of step i goes to
``FOLDER/rank<r>.s<i>.json``: ``{"status": "ok", "value": ...}``,
``{"status": "error", "type", "message", "peer", "elapsed", "traceback"}``,
or ``{"status": "unavailable", "message"}`` when the feature a scenario
exercises is absent from this build (an unknown keyword or transport).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STARTED = time.monotonic()

import torch  # noqa: E402 - after the clock that times the start
import torch.distributed as dist  # noqa: E402

import odc  # noqa: E402


class Unavailable(Exception):
    """The feature under test is not in this build."""


@dataclass
class Rank:
    rank: int
    world: int
    local_world: int
    store: Any
    folder: Path
    job_key: str
    step: int
    engines: list = field(default_factory=list)  # kept open until every rank is through the step

    def ready(self) -> None:
        (self.folder / f"ready-{self.rank}").write_text("")

    def wait_go(self, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while not (self.folder / "go").exists():
            if time.monotonic() > end:
                raise TimeoutError(f"rank {self.rank}: no go signal within {timeout_s:.0f} s")
            time.sleep(0.01)


def engine(ctx: Rank, *, transport: str, sharding: str = "full", **kw: Any) -> odc.Engine:
    """An engine on this rank; :class:`Unavailable` when ``transport`` / ``sharding`` is unknown here."""
    if sharding != "full":
        kw["sharding"] = sharding
    try:
        eng = odc.Engine(ctx.store, ctx.rank, ctx.world, local_world_size=ctx.local_world, transport=transport,
                         job_key=ctx.job_key, **kw)
    except odc.ConfigError as e:
        # A transport this build was compiled without (libfabric's): a limit of the build, not an ODC error.
        if f"unknown transport {transport!r}" in str(e) or f'unknown transport "{transport}"' in str(e):
            raise Unavailable(f"transport {transport!r}") from e
        raise
    ctx.engines.append(eng)
    return eng


# -- exact gathers and sums ---------------------------------------------------------------------------

BUCKETS = (("small", 1001, torch.float32), ("large", 3 * 65536 + 17, torch.float32), ("half", 1001, torch.bfloat16))


def pushes(rank: int, world: int, k: int) -> int:
    """Microbatches of ``rank`` in minibatch ``k``: 1..world in minibatch 0, world-1..0 in minibatch 1."""
    return rank + 1 if k % 2 == 0 else world - 1 - rank


def exact(ctx: Rank, transport: str, sharding: str, minibatches: int = 2) -> dict:
    """Gathers of published versions and scatter-accumulate sums, checked exactly (integer-valued data)."""
    eng = engine(ctx, transport=transport, sharding=sharding, chunk_bytes=64 << 10)
    eng.register([odc.Bucket(name, numel, dtype) for name, numel, dtype in BUCKETS])
    # What this rank publishes and reads gradients for is block `mine` of `shards` equal blocks: its
    # shard (full, hybrid) or, under hybrid-zero, its 1/D piece (the engine keeps node shards of pieces).
    hybrid = sharding == "hybrid"
    shards = ctx.local_world if hybrid else ctx.world
    mine = ctx.rank % ctx.local_world if hybrid else ctx.rank
    for k in range(minibatches):
        for name, numel, dtype in BUCKETS:
            sl = eng.bucket(name)["piece_len"]
            assert sl * shards >= numel, f"bucket {name}: shard_len {sl} x {shards} shards < {numel}"
            full = torch.arange(sl * shards, dtype=torch.float32) % 97 + k
            eng.publish(name, full[mine * sl : (mine + 1) * sl].to(dtype), version=k)
        for name, numel, dtype in BUCKETS:
            out = torch.full((numel,), -1.0, dtype=dtype)
            eng.gather(name, k, out)
            want = (torch.arange(numel, dtype=torch.float32) % 97 + k).to(dtype)
            bad = (out != want).nonzero()
            assert bad.numel() == 0, (f"rank {ctx.rank} minibatch {k} bucket {name}: {bad.numel()} wrong elements, "
                                      f"first at {int(bad[0])}: {out[int(bad[0])]} != {want[int(bad[0])]}")
        for name, numel, dtype in BUCKETS:
            grads = ((torch.arange(numel, dtype=torch.float32) % 13) * (ctx.rank + 1)).to(dtype)
            for m in range(pushes(ctx.rank, ctx.world, k)):
                if m == 1:  # one microbatch pushed in two parts, the second at an offset
                    half = numel // 2
                    eng.scatter_accumulate(name, grads[:half], scale=1.0, offset=0)
                    eng.scatter_accumulate(name, grads[half:].contiguous(), scale=1.0, offset=half)
                else:
                    eng.scatter_accumulate(name, grads, scale=1.0)
        eng.finish_minibatch(k)
        weight = sum((r + 1) * pushes(r, ctx.world, k) for r in range(ctx.world))
        for name, numel, _ in BUCKETS:
            sl = eng.bucket(name)["piece_len"]
            lo, hi = min(mine * sl, numel), min((mine + 1) * sl, numel)
            want = torch.zeros(sl)
            want[: hi - lo] = (torch.arange(lo, hi, dtype=torch.float32) % 13) * weight
            got = eng.grad_shard(name)
            bad = (got != want).nonzero()
            assert bad.numel() == 0, (f"rank {ctx.rank} minibatch {k} bucket {name}: {bad.numel()} wrong sums, "
                                      f"first at shard offset {int(bad[0])}: {got[int(bad[0])]} != {want[int(bad[0])]}")
        eng.zero_grad()
    return {"transport": eng.transport}


# -- FSDP2, hybrid sharding ---------------------------------------------------------------------------


def fsdp_hybrid(ctx: Rank, transport: str, steps: int, micros: int, lr: float = 0.1, sharding: str = "hybrid",
                table: list[list[int]] | None = None) -> dict:
    """ODC hybrid sharding, rank 0 compares with one process: HSDP on a (nodes, ranks per node) mesh
    (``"hybrid"``), or FSDP2's 1-D mesh (``"hybrid-zero"``). ``table[s][r]``: microbatches of rank r at
    step s (default ``micros`` everywhere); the loss is the mean over the step's microbatches."""
    table = table or [[micros] * ctx.world for _ in range(steps)]
    import _fsdp_helpers as H
    from torch.distributed.device_mesh import init_device_mesh

    import odc.fsdp

    os.environ["ODC_TRANSPORT"] = transport

    dist.init_process_group("gloo", store=dist.PrefixStore("pg", ctx.store), rank=ctx.rank, world_size=ctx.world,
                            timeout=datetime.timedelta(seconds=60))
    if sharding == "hybrid":
        mesh = init_device_mesh("cpu", (ctx.world // ctx.local_world, ctx.local_world),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ctx.world,))
    model = H.build(ctx.world, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    try:
        odc.fsdp.enable(model, opt, sharding=sharding, timeout=60)
    except odc.ConfigError as e:
        if "unknown transport" in str(e):  # a transport this build was compiled without
            raise Unavailable(f"transport {os.environ.get('ODC_TRANSPORT')!r}") from e
        raise
    losses = []
    for s, plan in enumerate(table):
        total = 0.0
        for m in range(plan[ctx.rank]):
            loss = H.sample_loss(model, H.data(s, m, ctx.rank)) * ctx.world / (27 * sum(plan))
            loss.backward()  # FSDP averages over all ranks: the mean over the step's microbatches
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    odc.fsdp.disable(model)
    params = H.full_params(model)
    dist.destroy_process_group()
    if ctx.rank != 0:
        return {"losses": losses}
    torch.manual_seed(0)
    ref = H.Tiny()
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    for s, plan in enumerate(table):
        for r in range(ctx.world):
            for m in range(plan[r]):
                (H.sample_loss(ref, H.data(s, m, r)) / (27 * sum(plan))).backward()
        ropt.step()
        ropt.zero_grad()
    diff = max((torch.tensor(params[k]) - v.detach()).abs().max().item() for k, v in ref.state_dict().items())
    torch.manual_seed(0)
    moved = max((torch.tensor(params[k]) - v).abs().max().item() for k, v in H.Tiny().state_dict().items())
    return {"losses": losses, "max_diff": diff, "moved": moved}


# -- faults -------------------------------------------------------------------------------------------


def _mid_minibatch(ctx: Rank, transport: str) -> odc.Engine:
    """An engine that has published, gathered and pushed once: mid-way through minibatch 0.

    ``transport`` may name a sharding too: ``"auto:hybrid-zero"``.
    """
    kind, _, sharding = transport.partition(":")
    eng = engine(ctx, transport=kind, sharding=sharding or "full", prefix=f"fault-{kind}-{sharding}")
    eng.register([odc.Bucket("a", 1 << 16, torch.float32)])
    sl = eng.bucket("a")["piece_len"]
    eng.publish("a", torch.full((sl,), float(ctx.rank)), version=0)
    eng.gather("a", 0, torch.empty(1 << 16))
    eng.scatter_accumulate("a", torch.ones(1 << 16))
    return eng


def fault(ctx: Rank, kind: str, transports: list[str], victim: int | None = None) -> dict:
    """Every rank gets mid-minibatch on one engine per transport and says it is ready; the test then
    SIGKILLs ``victim`` (``kind="kill"``) or takes a link down (``kind="link"``) and says go. Each
    engine then pushes once more and finishes the minibatch, which must fail naming a peer.

    Returns, per transport: the error (type, message, peer, seconds from go to the error), or
    ``{"status": "ok"}`` if nothing failed, or ``{"status": "unavailable"}``.
    """
    engines: dict[str, Any] = {}
    for t in transports:
        try:
            engines[t] = _mid_minibatch(ctx, t)
        except Unavailable as e:
            engines[t] = str(e)
    ctx.ready()
    if kind == "kill" and ctx.rank == victim:
        time.sleep(3600)
    ctx.wait_go()
    out = {}
    for t, eng in engines.items():
        if isinstance(eng, str):
            out[t] = {"status": "unavailable", "message": eng}
            continue
        t0 = time.monotonic()
        try:
            eng.scatter_accumulate("a", torch.ones(1 << 16))
            eng.finish_minibatch(0)
            out[t] = {"status": "ok", "elapsed": time.monotonic() - t0}
        except odc.OdcError as e:
            out[t] = {"status": "error", "type": type(e).__name__, "message": str(e), "peer": getattr(e, "peer", None),
                      "elapsed": time.monotonic() - t0}
    return out


SCENARIOS = {"exact": exact, "fsdp_hybrid": fsdp_hybrid, "fault": fault}
FAULTS = ("fault",)


def _scenario(name: str) -> Any:
    """A scenario of this module, or ``"module:function"`` from a test's own worker module (which marks a scenario
    that leaves peers gone or unreachable with ``function.fault = True``, as :data:`FAULTS` does here)."""
    if ":" in name:
        import importlib

        module, _, fn = name.partition(":")
        return getattr(importlib.import_module(module), fn)
    return SCENARIOS[name]


def _run_step(ctx: Rank, scenario: str, params: dict) -> dict:
    t0 = time.monotonic()
    try:
        return {"status": "ok", "value": _scenario(scenario)(ctx, **params)}
    except Unavailable as e:
        return {"status": "unavailable", "message": str(e)}
    except BaseException as e:  # every failure goes to the test
        tb = traceback.format_exc()
        print(f"step {ctx.step} ({scenario}):\n{tb}", file=sys.stderr, flush=True)
        return {"status": "error", "type": type(e).__name__, "message": str(e), "peer": getattr(e, "peer", None),
                "elapsed": getattr(e, "elapsed", time.monotonic() - t0), "traceback": tb}


def main() -> None:
    run(Path(sys.argv[1]), json.loads(sys.argv[2]))


def run(folder: Path, steps: list[Any]) -> None:
    """Runs ``steps`` on this rank (its identity and addresses from the environment), writing each outcome."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    for i, (scenario, params) in enumerate(steps):
        ctx = Rank(rank, world, int(os.environ["LOCAL_WORLD_SIZE"]), dist.PrefixStore(f"step{i}", store), folder,
                   f"{os.environ['ODC_JOB_KEY']}s{i}", i)
        t0 = time.monotonic()
        res = _run_step(ctx, scenario, params)
        res["seconds"] = time.monotonic() - t0
        res["started"] = t0 - STARTED
        path = folder / f"rank{rank}.s{i}.json"
        path.with_suffix(".tmp").write_text(json.dumps(res))
        path.with_suffix(".tmp").rename(path)
        if scenario in FAULTS or getattr(_scenario(scenario), "fault", False):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # peers are gone or unreachable: no orderly engine close to wait for
        # Engines of this step close only once every rank is through it.
        ctx.store.set(f"through/{rank}", "1")
        ctx.store.wait([f"through/{r}" for r in range(world)], datetime.timedelta(seconds=120))
        del ctx
        gc.collect()


if __name__ == "__main__":
    main()
