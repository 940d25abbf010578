"""Starting the ranks of a benchmark: local spawned processes, or the processes torchrun started.

Owns process management and the per-rank setup (torch process groups and the
rendezvous store the :class:`odc.Engine` uses). It knows nothing about what a
benchmark measures: a rank function gets a :class:`RankContext`, returns a
value (rank 0's value is the result), and may send events (progress, rows)
that the caller receives while the ranks run.

- **Local** (default): the caller's process hosts a ``TCPStore`` and starts
  one process per rank, forked from a ``multiprocessing`` fork server that
  has imported torch, odc and the rank function's module once (a rank costs
  a fork rather than an interpreter importing torch; each rank is still a
  new process, with the caller's environment as it is at the launch).
  ``ODC_BENCH_SPAWN=1`` spawns each rank as a fresh interpreter instead
  (for settings torch reads only at import; the figures measured alike
  both ways: 64 KiB to 16 MiB primitives ratios, three alternating runs).
- **torchrun**: when ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set,
  this process is one rank; the default group's store is the rendezvous.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchError", "RankContext", "run_ranks", "under_torchrun"]

EventHandler = Callable[[str, Any], None]


class BenchError(RuntimeError):
    """A rank failed or the ranks could not be started; the message names the rank.

    ``odc-bench`` prints it and exits with status 1; ``ODC_BENCH_TRACEBACK=1``
    adds the rank's traceback.
    """


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


@dataclass
class RankContext:
    """What a rank function may use.

    Attributes:
        rank, world: this rank and the number of ranks.
        store: torch store shared by every rank (the engine's rendezvous).
        backend: the collective baseline's torch.distributed backend.
        device: device of the collective baseline's tensors.
        group: process group of the collective baseline.
        ctrl: gloo group for barriers and result exchange (never timed).
        job_key: names this run's shared-memory segments.
        local_world: ranks per node given to the engine when the ranks are
            spread over several (emulated) hosts; None: one node.
    """

    rank: int
    world: int
    store: Any
    backend: str
    device: Any
    group: Any
    ctrl: Any
    job_key: str
    _emit: EventHandler | None = None
    _engines: list[Any] = field(default_factory=list)
    local_world: int | None = None

    def emit(self, kind: str, payload: Any) -> None:
        """Sends an event to the caller (rank 0 only; other ranks' events are dropped)."""
        if self.rank == 0 and self._emit is not None:
            self._emit(kind, payload)

    def barrier(self) -> None:
        """A barrier of every rank, through the gloo control group."""
        import torch.distributed as dist

        dist.barrier(group=self.ctrl)

    def engine(self, *, timeout: float, chunk_bytes: int | None = None, tag: str = "e", **kw: Any) -> Any:
        """A new :class:`odc.Engine` for this rank (``kw``: more engine arguments), dropped when the rank ends."""
        import odc

        eng = odc.Engine(
            self.store,
            self.rank,
            self.world,
            local_world_size=self.local_world,
            timeout=timeout,
            chunk_bytes=chunk_bytes,
            job_key=f"{self.job_key}{tag}",
            prefix=f"odc-bench/{self.job_key}/{tag}",
            **kw,
        )
        self._engines.append(eng)
        return eng

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (through the gloo control group)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def close(self) -> None:
        """Drops this rank's engines, which unmaps and unlinks their shared memory.

        Called before the process exits: the spawned ranks exit with ``os._exit``, which runs no finalizers.
        """
        self._engines.clear()
        import gc

        gc.collect()


def _setup(store: Any, rank: int, world: int, backend: str, job_key: str, emit: EventHandler | None,
           env_init: bool = False) -> RankContext:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore  # torch.distributed's stubs do not export it

    timeout = datetime.timedelta(seconds=600)
    # Ranks share the host's cores: intra-op thread pools that spin-wait
    # (OpenMP) on an oversubscribed host turn a 64K-element sum into
    # milliseconds. Give each rank its share of the cores.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    device = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if env_init:
        dist.init_process_group(backend, timeout=timeout)
        store = dist.distributed_c10d._get_default_store()
    else:
        dist.init_process_group(backend, store=PrefixStore("odc-bench/pg", store), rank=rank,
                                world_size=world, timeout=timeout)
    group = dist.group.WORLD
    ctrl = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return RankContext(rank, world, store, backend, device, group, ctrl, job_key, emit)


def _context(fn: Callable[..., Any]) -> Any:
    """The fork server local ranks start from. What it imports is fixed by the first launch of the process:
    torch, odc, the module of that launch's rank function and what that module lists in ``RANK_PRELOAD``
    (the modules its ranks import lazily, e.g. FSDP2 and transformers' model code: seconds per rank). A later
    launch's own imports happen in its ranks."""
    import multiprocessing as mp

    if os.environ.get("ODC_BENCH_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    module = getattr(fn, "__module__", None)
    extra = [module, *getattr(sys.modules.get(module or ""), "RANK_PRELOAD", [])] if module != "__main__" else []
    ctx.set_forkserver_preload(["torch", "torch.distributed", "odc", "odc.bench.launch", *(m for m in extra if m)])
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, events: Any, backend: str, job_key: str,
           kwargs: dict[str, Any], place: tuple[str, dict[str, str]] | None = None,
           store_host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:  # pragma: no cover
    ctx = None
    try:
        if env is not None:  # the caller's environment at the launch, not the fork server's from its start
            os.environ.clear()
            os.environ.update(env)
        if place is not None:
            # Before any socket or thread: every later one lives in the namespace.
            from .netns import enter

            enter(place[0])
            os.environ.update(place[1])
        from torch._C._distributed_c10d import TCPStore  # torch.distributed's stubs do not export it

        store = TCPStore(store_host, port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=300))
        ctx = _setup(store, rank, world, backend, job_key, lambda k, p: events.put(("event", rank, (k, p))))
        if place is not None:
            ctx.local_world = int(place[1]["LOCAL_WORLD_SIZE"])
        result = fn(ctx, **kwargs)
        events.put(("result", rank, result if rank == 0 else None))
    except BaseException as e:  # every failure goes to the caller
        events.put(("error", rank, (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        if ctx is not None:
            ctx.close()
        events.close()
        events.join_thread()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *, backend: str, on_event: EventHandler | None = None,
              launch_timeout: float = 24 * 3600.0, placement: list[tuple[str, dict[str, str]]] | None = None,
              store_host: str = "127.0.0.1", **kwargs: Any) -> Any:
    """Runs ``fn(ctx, **kwargs)`` on ``world`` ranks and returns rank 0's value.

    Under torchrun ``world`` must equal ``WORLD_SIZE`` and this process runs
    its own rank only (rank 0 returns the value, other ranks return None).

    ``placement`` (local ranks only) gives every rank a network namespace
    to enter and environment variables to set (see :mod:`odc.bench.netns`);
    the ranks then reach the store at ``store_host``.

    Raises:
        BenchError: a rank raised (the message names it and carries its
            error), died, or reported nothing within ``timeout`` seconds.
    """
    if under_torchrun():
        rank = int(os.environ["RANK"])
        key = "t" + (os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0"))[:12]
        ctx = _setup(None, rank, int(os.environ["WORLD_SIZE"]), backend, key, on_event, env_init=True)
        try:
            return fn(ctx, **kwargs)
        finally:
            ctx.close()

    from torch._C._distributed_c10d import TCPStore  # torch.distributed's stubs do not export it

    master = TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=datetime.timedelta(seconds=300),
                      wait_for_workers=False)
    job_key = f"b{os.getpid() % 100000}{uuid.uuid4().hex[:6]}"
    mpctx = _context(fn)
    events = mpctx.Queue()
    env = dict(os.environ)
    procs = [mpctx.Process(target=_child, args=(fn, r, world, master.port, events, backend, job_key, kwargs,
                                                None if placement is None else placement[r], store_host, env),
                           daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    reported: dict[int, Any] = {}
    failure: tuple[int, str, str] | None = None
    deadline = time.monotonic() + launch_timeout
    try:
        while len(reported) < world and failure is None:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(reported))
                raise BenchError(f"rank {missing[0]} reported nothing within {launch_timeout:.0f} s")
            try:
                kind, rank, value = events.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reported]
                if dead:
                    # Give its last words a moment to arrive through the queue.
                    try:
                        kind, rank, value = events.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise BenchError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
                else:
                    continue
            if kind == "event":
                if on_event is not None:
                    on_event(*value)
            elif kind == "result":
                reported[rank] = value
            else:
                failure = (rank, value[0], value[1])
        if failure is not None:
            rank, msg, tb = failure
            if os.environ.get("ODC_BENCH_TRACEBACK"):
                msg = f"{msg}\n{tb}"
            raise BenchError(f"rank {rank} failed: {msg}")
        return reported.get(0)
    finally:
        for p in procs:
            p.join(timeout=10 if failure is None else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del master
