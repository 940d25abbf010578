"""Helpers to run a function on N local ranks (spawned processes) with a shared torch TCPStore, and the GPU skip."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def need_gpu() -> None:
    """Skips the calling test where torch sees no CUDA device; under ``ODC_REQUIRE_GPU=1`` fails it instead."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("ODC_REQUIRE_GPU") == "1":
        pytest.fail("ODC_REQUIRE_GPU=1, but torch.cuda.is_available() is False")
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False); ODC_REQUIRE_GPU=1 makes this a failure")


def _entry(fn, rank, world, port, queue, kwargs):
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, store, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException as e:  # report everything to the parent
        queue.put((rank, "error", (type(e).__name__, str(e), getattr(e, "peer", None), traceback.format_exc())))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, timeout: float = 120.0, **kwargs) -> dict[int, tuple[str, Any]]:
    """Runs ``fn(rank, world, store, **kwargs)`` on ``world`` processes; returns {rank: (status, value)}.

    ``status`` is ``"ok"`` with the return value, or ``"error"`` with
    ``(class name, message, peer, traceback)``. A rank that reports nothing
    within ``timeout`` seconds is killed and reported as ``("hung", None)``.
    """
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, master.port, queue, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    import queue as q

    deadline = __import__("time").monotonic() + timeout
    while len(results) < world:
        remaining = deadline - __import__("time").monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, value = queue.get(timeout=min(remaining, 1.0))
            results[rank] = (status, value)
        except q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        results.setdefault(r, ("hung" if p.exitcode is None or p.exitcode < 0 else "exited", p.exitcode))
    del master
    return results
