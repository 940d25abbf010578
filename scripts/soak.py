#!/usr/bin/env python3
"""A soak: one multi-rank test case run many times under load, watching for a rank that dies (an abort, a segfault).

Each run starts the case's ranks afresh, through the tests' harness (``odc-py/tests/_dist.py``: ranks forked from a
fork server that imported torch and odc) or, for the cases about a process's end, as fresh interpreters the way
torchrun starts them; with core dumps on, ``RUST_BACKTRACE=1`` and ``PYTHONFAULTHANDLER=1``.
A run's ranks write their stdout and stderr (faulthandler's stacks, a Rust panic's message, a C++ ``terminate``)
into ``OUT/run-NNNN.log``; a run is kept as ``ok`` (its log deleted, unless ``--keep-logs``), ``fail`` (a rank
raised or the check failed), ``hung`` or ``died`` (a rank ended by a signal other than the harness's SIGKILL, before
or after it reported). Every core a run leaves gets ``gdb -batch`` with every thread's backtrace beside it: while the
soak runs, ``core_pattern`` points into ``OUT/cores`` (restored after), unless it already names an absolute folder
(another soak's: soaks running at once share that folder, and each looks there). ``OUT/summary.tsv`` has a line per
run; the last line printed counts them.

Cases (``--case``, several alternate):

- ``accumulation``: test_fsdp_accumulation.py's case: 3 ranks, FSDP2's accumulation
  (``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` on all but a rank's last
  microbatch), uneven counts, torch's clip, odc.fsdp; checked against one process.
- ``verl``: test_fsdp_loops.py's 3-rank verl-shaped loop (no-sync accumulation, activation checkpointing), uneven
  counts, checked against one process.
- ``bench-torchrun``: ``torchrun --nproc-per-node 3 -m odc.bench train`` at tiny sizes with ``odc+lb-mini`` and
  ``fsdp2-accum`` (LB-Mini's uneven counts, FSDP2's accumulation, torch's clip, ODC in the same processes), each
  rank ending as the command does: a normal exit.
- ``teardown-odc`` / ``teardown-gloo``: 3 ranks as torchrun starts them (fresh interpreters), the same accumulation
  loop on a small model under odc.fsdp (uneven counts) or FSDP2's own gloo collectives (even counts), then
  ``destroy_process_group()`` and a normal exit: the interpreter's teardown, which the tests' ranks skip with
  ``os._exit``. A run is ``died`` when a rank's exit is a signal.

Load: where the 1-minute load average is below ``--min-load`` (4) before a run, ``--hogs`` (2) busy processes run
beside it (at nice 19, as the soak itself should: ``nice -n 19 scripts/soak.py``); they stop when the load is back.

Usage::

    nice -n 19 .venv/bin/python scripts/soak.py --runs 200 --out /tmp/odc-soak
    nice -n 19 .venv/bin/python scripts/soak.py --runs 50 --case accumulation --case verl --out /tmp/odc-soak2

Needs root for ``core_pattern`` (without it, cores go where the system's pattern says, and the soak says so).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "odc-py" / "tests"
CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")


def _case_accumulation() -> tuple[Any, int, dict[str, Any], Any]:
    import _accumulation as A
    import _loops as L
    import test_fsdp_accumulation as T

    def check(out: dict[int, Any]) -> None:
        for rank, res in out.items():
            L.assert_close(res, out[0]["ref"], 1e-5, 1e-4, f"rank {rank}")

    return A.accumulation_worker, 3, {"plan": T.PLAN, "clip": T.CLIP}, check


def _case_verl() -> tuple[Any, int, dict[str, Any], Any]:
    import _loops as L
    import test_fsdp_loops as T

    variants = [v for v in T.VARIANTS[3] if v["loop"] == "verl"]

    def check(out: dict[int, Any]) -> None:
        for i, variant in enumerate(variants):
            L.assert_close(out[0][i]["odc"], out[0][i]["ref"], 1e-5, 1e-4, str(variant))

    return L.loops_worker, 3, {"variants": variants, "plan": T.UNEVEN[3]}, check


def _teardown(comm: str, world: int, timeout: float) -> dict[int, tuple[str, Any]]:
    """``world`` fresh interpreters, as torchrun starts them, each running ``_accumulation.teardown_main(comm)``:
    a script that ends normally after ``destroy_process_group()``. ``{rank: (status, exit code)}``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); import _accumulation; "
            f"_accumulation.teardown_main({comm!r})")
    procs = []
    for r in range(world):  # their output goes where the soak's goes now: the run's log (output_to)
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code], env=env,
                                      stdin=subprocess.DEVNULL))
    res: dict[int, tuple[str, Any]] = {}
    end = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            res[r] = ("hung", p.returncode)
            continue
        if rc < 0:
            res[r] = ("died", (rc, signal.Signals(-rc).name, None))
        else:
            res[r] = ("ok" if rc == 0 else "error", rc)
    return res


# odc-bench train at tiny sizes, the configurations that run FSDP2's accumulation beside ODC.
BENCH = ["train", "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
         "--vocab", "64", "--synthetic", "lognormal:n=256,median=24,sigma=1.0,max=64,seed=0", "--max-tokens", "64",
         "--fit-repeats", "1", "--progress", "off", "--timeout", "120", "--minibatch-size", "6", "--minibatches", "3",
         "--repeats", "1", "--configs", "odc+lb-mini,fsdp2-accum"]


def _bench_torchrun(world: int, timeout: float) -> dict[int, tuple[str, Any]]:
    """``torchrun --nproc-per-node WORLD -m odc.bench train ...`` (:data:`BENCH`): each rank a fresh interpreter
    that ends as the command does (a normal exit, its process groups still held). torchrun prints a failed rank's
    exit code (``exitcode  : -6``); ``{rank: (status, exit code)}`` from that summary and torchrun's own status."""
    import re
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(world), "--master-port", str(port), "-m", "odc.bench", *BENCH]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "odc-py" / "python"),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        print(e.stdout or "", e.stderr or "", flush=True)
        return dict.fromkeys(range(world), ("hung", None))
    print(done.stdout, done.stderr, sep="\n", flush=True)
    res: dict[int, tuple[str, Any]] = dict.fromkeys(range(world), ("ok", 0))
    # torchrun's failure summary: "rank      : 2 (local_rank: 2)" ... "exitcode  : -6 (pid: 123)".
    for rank, code in re.findall(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)", done.stderr, re.S):
        rc = int(code)
        res[int(rank)] = ("died", (rc, signal.Signals(-rc).name, None)) if rc < 0 else ("error", rc)
    if done.returncode != 0 and all(s == "ok" for s, _ in res.values()):
        res[0] = ("error", done.returncode)
    return res


def _case_bench() -> tuple[Any, int, dict[str, Any], Any]:
    return _bench_torchrun, 3, {}, (lambda out: None)


def _case_teardown(comm: str) -> tuple[Any, int, dict[str, Any], Any]:
    return (lambda world, timeout: _teardown(comm, world, timeout)), 3, {}, (lambda out: None)


CASES = {"accumulation": _case_accumulation, "verl": _case_verl, "bench-torchrun": _case_bench,
         "teardown-odc": lambda: _case_teardown("odc"), "teardown-gloo": lambda: _case_teardown("gloo")}
"""Cases whose ranks are fresh interpreters ending normally, started by the soak itself (not _dist.run_ranks)."""
SUBPROCESS_CASES = {"teardown-odc", "teardown-gloo", "bench-torchrun"}


class Hogs:
    """Busy processes that keep the machine loaded while the load average is below a floor."""

    def __init__(self, count: int, min_load: float) -> None:
        self.count, self.min_load = count, min_load
        self.procs: list[subprocess.Popen[bytes]] = []

    def adjust(self) -> bool:
        """Starts the hogs where the load is below the floor, stops them where it is twice above; whether they run."""
        load = os.getloadavg()[0]
        if not self.procs and load < self.min_load:
            hog = "import os\nos.nice(19)\nwhile True:\n    pass\n"
            self.procs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(self.count)]
        elif self.procs and load > 2 * self.min_load + self.count:
            self.stop()
        return bool(self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)
        self.procs = []


@contextlib.contextmanager
def output_to(path: Path):
    """Points this process's stdout and stderr (and so the ranks', which write to them) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def backtraces(core: Path) -> Path:
    """Every thread's backtrace of the python process that left ``core``, beside it."""
    out = core.with_suffix(core.suffix + ".bt.txt")
    cmd = ["gdb", "-batch", "-ex", "info threads", "-ex", "thread apply all bt", "-ex", "bt", sys.executable,
           str(core)]
    try:
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        out.write_text(res.stdout + res.stderr)
    except (OSError, subprocess.TimeoutExpired) as e:
        out.write_text(f"gdb failed: {e}\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: accumulation")
    ap.add_argument("--out", type=Path, default=Path("/tmp/odc-soak"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run's ranks may take")
    ap.add_argument("--min-load", type=float, default=4.0)
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--stop-on-death", action="store_true", help="stop at the first run with a rank that died")
    args = ap.parse_args(argv)
    cases = args.case or ["accumulation"]
    out = args.out.resolve()
    cores = out / "cores"
    cores.mkdir(parents=True, exist_ok=True)

    os.environ["RUST_BACKTRACE"] = "1"
    os.environ["PYTHONFAULTHANDLER"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ours = f"{cores}/core.%e.%p.%t"
    old_pattern = CORE_PATTERN.read_text().strip()
    if old_pattern.startswith("/"):
        print(f"soak: core_pattern is {old_pattern!r} (another soak's?): cores are looked for there", flush=True)
        old_pattern = None
    else:
        try:
            CORE_PATTERN.write_text(ours + "\n")
        except OSError as e:
            print(f"soak: cannot set {CORE_PATTERN} ({e}); cores go to {old_pattern!r}", flush=True)
            old_pattern = None
    sys.path.insert(0, str(TESTS))
    import faulthandler

    import _dist

    faulthandler.enable(all_threads=True)
    built = {name: CASES[name]() for name in cases}
    # The ranks' fork server imports the cases' modules once (as pytest's does for the tests it selected).
    _dist.PRELOAD.extend(m for m in ("_loops", "_accumulation") if m in sys.modules and m not in _dist.PRELOAD)
    hogs = Hogs(args.hogs, args.min_load)
    counts: Counter[str] = Counter()
    summary = (out / "summary.tsv").open("a")
    summary.write("run\tcase\toutcome\tseconds\tload\thogs\tranks\tcores\n")
    try:
        for i in range(args.runs):
            name = cases[i % len(cases)]
            fn, world, kwargs, check = built[name]
            hogging = hogs.adjust()
            load = os.getloadavg()[0]
            log = out / f"run-{i:04d}.log"
            pattern = CORE_PATTERN.read_text().strip()
            where = Path(pattern).parent if pattern.startswith("/") else cores
            before = set(where.iterdir())
            start = time.monotonic()
            with output_to(log):
                print(f"soak run {i} case {name} load {load:.1f} hogs {hogging}", flush=True)
                if name in SUBPROCESS_CASES:
                    res = fn(world, args.timeout)
                else:
                    res = _dist.run_ranks(fn, world, timeout=args.timeout, **kwargs)
                statuses = {r: s for r, (s, _) in res.items()}
                if "died" in statuses.values():
                    outcome = "died"
                elif "hung" in statuses.values():
                    outcome = "hung"
                elif any(s != "ok" for s in statuses.values()):
                    outcome = "fail"
                else:
                    try:
                        check({r: v for r, (_, v) in res.items()})
                        outcome = "ok"
                    except AssertionError as e:
                        outcome = "fail"
                        print(f"soak: the check failed: {e}", flush=True)
                for r, (s, v) in sorted(res.items()):
                    if s != "ok":
                        print(f"soak: rank {r}: {s}: {v}", flush=True)
            seconds = time.monotonic() - start
            time.sleep(0.5)  # a dying rank's core may still be being written
            new = sorted(set(where.iterdir()) - before)
            for core in [c for c in new if ".bt." not in c.name]:
                backtraces(core)
            counts[outcome] += 1
            ranks = ",".join(f"{r}:{s}" for r, s in sorted(statuses.items()))
            summary.write(f"{i}\t{name}\t{outcome}\t{seconds:.1f}\t{load:.1f}\t{int(hogging)}\t{ranks}\t"
                          f"{' '.join(c.name for c in new)}\n")
            summary.flush()
            if outcome == "ok" and not new and not args.keep_logs:
                log.unlink()
            print(f"run {i}: {name} {outcome} in {seconds:.1f} s (load {load:.1f}, hogs {hogging})"
                  + (f", cores: {' '.join(c.name for c in new)}" if new else ""), flush=True)
            if outcome == "died" and args.stop_on_death:
                break
    finally:
        hogs.stop()
        summary.close()
        if old_pattern is not None and CORE_PATTERN.read_text().strip() == ours:
            CORE_PATTERN.write_text(old_pattern + "\n")
    print(f"soak: {sum(counts.values())} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; logs and cores in {out}", flush=True)
    return 0 if set(counts) <= {"ok"} else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally above restores core_pattern
    sys.exit(main())
