"""Helpers to run a function on N local ranks (processes forked from a fork server that has imported torch and
odc) with a shared torch TCPStore, and the GPU skip."""

from __future__ import annotations

import datetime
import faulthandler
import functools
import importlib.util
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver, reduction
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


def need_hf() -> None:
    """At a module's top: skips the module where fsdp-odc[hf]'s packages (TRL, accelerate, datasets) are missing;
    under ``ODC_REQUIRE_HF=1`` (make test, on both torch legs) fails it instead."""
    import pytest

    missing = [p for p in ("trl", "accelerate", "datasets") if importlib.util.find_spec(p) is None]
    if not missing:
        return
    why = f"{', '.join(missing)} not installed here (make setup installs fsdp-odc[hf]'s trl and accelerate)"
    if os.environ.get("ODC_REQUIRE_HF") == "1":
        pytest.fail(f"ODC_REQUIRE_HF=1, but {why}", pytrace=False)
    pytest.skip(f"{why}; ODC_REQUIRE_HF=1 makes this a failure", allow_module_level=True)


# Ranks start from a fork server that has imported these once per pytest process: a rank costs a fork, not
# an interpreter importing torch (5-10 s each on a 2-core machine, the larger part of most tests before).
# Each rank is still a new process (nothing is shared between cases), with the test's environment as it was
# when the case started (see _entry). The fork server skips a module it cannot import; the rank then fails
# naming it (see _entry).
# transformers' model code is most of a Hugging Face test's start-up (several seconds per rank, more than torch).
# torch._dynamo (and the inductor modules it brings) is what fully_shard imports lazily in every rank; named here
# so the fork server keeps it even if the model code stops importing it.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo", "odc",
           "odc.fsdp", "odc.backend", "_fsdp_helpers", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama"]


def python_with_verl_auto(code: str) -> str:
    """Runs ``code`` in a new interpreter started as verl's workers start under ODC training
    (``VERL_USE_EXTERNAL_MODULES=odc.integrations.verl_auto``, ``ODC_VERL_BALANCE=none``, no ``VERL_PLATFORM``), this
    process's ``sys.path`` on its path; returns its last line of output. A non-zero exit fails the test, with its
    stderr."""
    import subprocess

    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="odc.integrations.verl_auto", ODC_VERL_BALANCE="none",
               PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("VERL_PLATFORM", None)
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=False, capture_output=True, text=True,
                       env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def preload_for(modules: Any) -> None:
    """Adds to ``PRELOAD`` what the ranks of these test modules import (each module's ``RANK_PRELOAD``, e.g. a
    trainer that takes 15 s of CPU to import in every rank), where its package is installed. conftest.py calls
    it with the modules of the tests pytest selected, before the first rank starts the fork server, so a run
    that selects none of them does not pay for their imports."""
    if _context.cache_info().currsize:
        raise RuntimeError("preload_for: the fork server has started already; call it before the first rank")
    for module in modules:
        for name in getattr(module, "RANK_PRELOAD", ()):
            if name not in PRELOAD and importlib.util.find_spec(name.split(".")[0]) is not None:
                PRELOAD.append(name)


@functools.cache
def _context():
    """The fork-server context; its server starts with the first rank and lives as long as pytest."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # multiprocessing has one fork server per process: one already started (by odc.bench's launcher, in a test
    # that ran odc-bench first) holds other preloads. Stopped here (its children live on) so that this one has ours.
    if forkserver._forkserver._forkserver_pid is not None:
        forkserver._forkserver._stop()
    # Python 3.11's fork server is a new interpreter that never applies the sys.path it is handed (only each
    # forked child does): the helpers beside this file reach its preload through PYTHONPATH, at its start.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [before])])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


class _Fd:
    """A file descriptor of the test process handed to a rank (duplicated while the rank is being started)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _Fd._open, (reduction.DupFd(self.fd),)

    @staticmethod
    def _open(dup: Any) -> int:
        return dup.detach() if hasattr(dup, "detach") else dup


def adopt(env: dict[str, str], stdout: int, stderr: int) -> None:
    """Makes a rank forked from the fork server run in the test's environment as it is now (not the server's
    from its start), writing to ``stdout`` / ``stderr`` (file descriptors) instead of the server's output."""
    os.environ.clear()
    os.environ.update(env)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)


def _share_cores(world: int) -> None:
    """Gives each of the ``world`` ranks its share of the cores for torch's intra-op threads, as torchrun does
    (``OMP_NUM_THREADS=1`` per process when it starts several) unless the test's environment sets it. With the
    default (a thread per core in every rank), ranks on a 2-core machine wait on each other's spinning OpenMP
    threads: ten steps of a tiny FSDP2 model took 1.7 s instead of 0.8 s (2 ranks)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _entry(fn, rank, world, port, queue, kwargs, env=None, out=None, preload=()):
    if env is not None:  # forked: the test's environment and output now (pytest's capture of this test)
        adopt(env, out[0], out[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks asks a rank that hangs for its stacks
    # A rank that dies of a signal (SIGABRT from a C++ terminate or a Rust abort, SIGSEGV) prints every thread's
    # Python stack into the test's stderr first; the signal then takes its default action (a core dump where on).
    faulthandler.enable(all_threads=True)
    _share_cores(world)
    try:
        # A fork server skips a module it fails to import without a word: name it here, or every rank would
        # import it again (seconds each) and nothing would say so.
        missing = [m for m in preload if m not in sys.modules]
        if missing:
            raise ImportError(f"the tests' fork server did not import {', '.join(missing)} (listed in _dist.PRELOAD "
                              "or a test module's RANK_PRELOAD): renamed, or failing to import")
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, store, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException as e:  # report everything to the parent
        queue.put((rank, "error", (type(e).__name__, str(e), getattr(e, "peer", None), traceback.format_exc())))
    finally:
        queue.close()
        queue.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, timeout: float = 120.0, fresh: bool = False,
              **kwargs) -> dict[int, tuple[str, Any]]:
    """Runs ``fn(rank, world, store, **kwargs)`` on ``world`` processes; returns {rank: (status, value)}.

    The ranks are forked from a server that has imported torch and odc (``PRELOAD``); ``fresh=True`` spawns
    new interpreters instead, for a case about what happens at import.

    ``status`` is ``"ok"`` with the return value, or ``"error"`` with
    ``(class name, message, peer, traceback)``. A rank that reports nothing
    within ``timeout`` seconds prints the stack of each of its threads to the
    test's stderr (shown with the failure), is killed and reported as
    ``("hung", exit code)``; one killed by SIGKILL from outside reads the same.
    A rank that dies of another signal (an abort, a segfault), before or after
    it reported, is ``("died", (exit code, signal name, what it reported or
    None))``, and a line naming it goes to the test's stderr.
    """
    master = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    fresh = fresh or os.environ.get("ODC_TEST_SPAWN") == "1"  # every rank a new interpreter, as before
    ctx = mp.get_context("spawn") if fresh else _context()
    queue = ctx.Queue()
    env, out, preload = (None, None, ()) if fresh else (dict(os.environ), (_Fd(1), _Fd(2)), tuple(PRELOAD))
    procs = [ctx.Process(target=_entry, args=(fn, r, world, master.port, queue, kwargs, env, out, preload))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    import queue as q

    deadline = time.monotonic() + timeout
    while len(results) < world:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, value = queue.get(timeout=min(remaining, 1.0))
            results[rank] = (status, value)
        except q.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    hung = [p for r, p in enumerate(procs) if r not in results and p.is_alive()]
    for p in hung:  # each prints every thread's stack to the test's stderr before it is killed
        os.kill(p.pid, signal.SIGUSR1)
    if hung:
        time.sleep(1.0)
    for r, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        # SIGKILL is how the harness and the tests end a rank, and a rank the harness found hung may die of the
        # SIGUSR1 it sent before it is killed: those are hung. Any other signal is the rank's own death: never
        # quiet, also after a report.
        sent = -signal.SIGUSR1 if p in hung else -signal.SIGKILL
        if p.exitcode is not None and p.exitcode < 0 and p.exitcode not in (-signal.SIGKILL, sent):
            name = signal.Signals(-p.exitcode).name
            print(f"run_ranks: rank {r} (pid {p.pid}) died of {name} (exit code {p.exitcode}), "
                  f"{'after it reported' if r in results else 'before reporting'}", file=sys.stderr, flush=True)
            results[r] = ("died", (p.exitcode, name, results.get(r)))
        results.setdefault(r, ("hung" if p.exitcode is None or p.exitcode < 0 else "exited", p.exitcode))
    del master
    return results


def pattern_shard(weight: float, index: int, shard_len: int, numel: int) -> list[float]:
    """Shard ``index`` (``shard_len`` elements, zero-padded) of ``weight`` times the pattern ``arange(numel) % 13``:
    the gradient shard the engine tests' pushes of that pattern sum to."""
    import torch

    pattern = torch.arange(numel, dtype=torch.float32) % 13
    lo, hi = index * shard_len, min((index + 1) * shard_len, numel)
    want = torch.zeros(shard_len)
    want[: hi - lo] = pattern[lo:hi] * weight
    return want.tolist()
