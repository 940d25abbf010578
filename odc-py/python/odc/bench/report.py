"""Output of the benchmarks: argument parsing helpers, the progress bar, tables, JSON and plots.

Owns presentation only; nothing here talks to peers. Conventions follow
nccl-tests (and the Rust ``*_perf`` binaries in ``benches/``): sizes accept
``K``/``M``/``G`` suffixes (powers of 1024), GB is 10⁹ bytes, and
``busbw = algbw · (n − 1) / n``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "LoadSampler",
    "Progress",
    "UsageError",
    "busbw_factor",
    "format_size",
    "parse_size",
    "png_metadata",
    "provenance",
    "require_matplotlib",
    "sample_load",
    "say_written",
    "set_command",
    "write_json",
]


class UsageError(ValueError):
    """A bad command-line value; the message names it. ``odc-bench`` exits with status 2."""


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str, flag: str) -> int:
    """Parses ``65536``, ``64K``, ``64KiB``, ``64M``, ``1G`` (powers of 1024); must be positive."""
    t = str(text).strip()
    digits = len(t) - len(t.lstrip("0123456789"))
    num, unit = t[:digits], t[digits:].strip().upper()
    if not num or unit not in _UNITS:
        raise UsageError(f"{flag} {text!r}: not a size (examples: 65536, 64K, 64M, 1G)")
    value = int(num) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"{flag} {text!r}: must be positive")
    return value


def format_size(n: float) -> str:
    """``65536`` → ``64K``; exact multiples of 1024 only, else plain bytes."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{int(n // mult)}{unit}"
    return str(int(n))


def busbw_factor(world: int) -> float:
    """nccl-tests' bus-bandwidth factor for all-gather / reduce-scatter: (n − 1) / n."""
    return (world - 1) / world


class Progress:
    """A progress bar on stderr (tqdm's), by default only when stderr is a terminal.

    tqdm is imported lazily, as an optional dependency: the distribution requires no package (torch is the
    user's own), and ``pip install 'fsdp-odc[bench]'`` brings it. Without it a bar that was asked for (``enabled=True``,
    ``--progress on``) is a :class:`UsageError` saying what to install; the default runs without a bar and
    says so once, on a terminal.

    Args:
        total: number of steps.
        label: what is running.
        enabled: ``None`` = when stderr is a TTY.
    """

    _told_missing = False

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total = max(1, int(total))
        self.done = 0
        self._bar: Any = None
        show = sys.stderr.isatty() if enabled is None else enabled
        if not show:
            return
        try:
            from tqdm import tqdm
        except ImportError as e:
            if enabled:
                raise UsageError(f"--progress on needs tqdm ({e}); install it with `pip install tqdm` or "
                                 f"`pip install 'fsdp-odc[bench]'`") from None
            if not Progress._told_missing:
                Progress._told_missing = True
                print("odc-bench: no progress bar: tqdm is not installed (`pip install 'fsdp-odc[bench]'`)",
                      file=sys.stderr)
            return
        self._bar = tqdm(total=self.total, desc=label, unit="step", file=sys.stderr, leave=False,
                         dynamic_ncols=True)

    def step(self, note: str = "", n: int = 1) -> None:
        """Counts ``n`` steps done (never past ``total``) and shows ``note`` beside the bar."""
        n = min(n, self.total - self.done)
        self.done += n
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        """Takes the bar off the terminal."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def say_written(json_path: str | None, plot_path: str | None = None, *, plots: bool = True) -> None:
    """The run's last line, on stderr: where its JSON and plot went, or how to keep them.

    Args:
        json_path: the ``--json`` file written, or None.
        plot_path: the ``--plot`` file written, or None.
        plots: whether the command takes ``--plot`` (for the hint when nothing was written).
    """
    written = [f"{os.path.abspath(path)} ({what})" for path, what in ((json_path, "JSON"), (plot_path, "plot"))
               if path is not None]
    sys.stdout.flush()
    if written:
        print(f"odc-bench: wrote {' and '.join(written)}", file=sys.stderr, flush=True)
    else:
        keep = "--json FILE or --plot FILE.png" if plots else "--json FILE"
        print(f"odc-bench: wrote no files (the results are printed above; {keep} keeps them)", file=sys.stderr,
              flush=True)


_COMMAND: list[str] | None = None


def set_command(argv: Sequence[str]) -> None:
    """The command line :func:`provenance` reports (``odc-bench`` sets its own; else ``sys.argv``)."""
    global _COMMAND  # noqa: PLW0603 - one command per process
    _COMMAND = list(argv)
    _identity.cache_clear()  # a new run (odc-bench's main called again in one process): its own date and command


# What a run's result does not depend on: the benchmarks' own output under docs/, so that rerunning one figure
# does not make the next figure's run "+dirty" (git pathspecs from the top of the checkout; odc_benches::provenance
# leaves out the same).
OUTPUTS = (":(top,exclude)docs/bench", ":(top,exclude)docs/scale", ":(top,exclude,glob)docs/*.png")


@functools.cache
def _identity() -> dict[str, Any]:
    """The run's command, commit, version and start of writing: the same for its JSON and its plot."""
    version: str | None = None
    with contextlib.suppress(ImportError):  # this file loaded by path without odc (scripts/scale-compare.py)
        from odc import __version__ as version

    if _COMMAND is not None:
        command = _COMMAND
    else:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name:  # python -m odc.bench.gpu ...
            prog = f"python -m {spec.name.removesuffix('.__main__')}"
        elif sys.argv and sys.argv[0]:
            prog = sys.argv[0] if not os.path.isabs(sys.argv[0]) else os.path.basename(sys.argv[0])
        else:
            prog = "python"
        command = [prog, *sys.argv[1:]]
    here = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", here, *args], check=False, capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit is not None and git("status", "--porcelain", "--untracked-files=no", "--", ":/", *OUTPUTS):
        commit += "+dirty"
    return {"command": shlex.join(command), "commit": commit, "version": version,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def provenance() -> dict[str, Any]:
    """What made a result: the command line, the commit of the ODC checkout it ran from, the UTC time, and the
    machine's load while it ran.

    ``commit`` ends in ``+dirty`` when tracked files differ from it (the benchmarks' output under ``docs/``
    aside), and is ``None`` outside a git checkout (an installed wheel: ``version`` says which). ``load`` holds
    the 1-minute load average sampled since :func:`sample_load` (``[seconds since the start, load]`` pairs, the
    last taken now) and the machine's core count; a run that never called it has one sample, taken now. The
    command, commit and date are the process's first call's, so that a run's JSON and plot name the same.
    """
    return {**_identity(), "load": _load_record()}


def sample_load(period: float = 5.0) -> None:
    """Starts sampling the machine's 1-minute load average every ``period`` seconds (a daemon thread), for the
    :func:`provenance` of this process's results; call it at the start of the run. A later call (another run in
    the same process) starts the samples anew."""
    global _LOAD  # noqa: PLW0603 - one sampler per process
    if _LOAD is not None:
        _LOAD.__exit__()
    _LOAD = LoadSampler(period)
    _LOAD.__enter__()


_LOAD: LoadSampler | None = None


def _load_record() -> dict[str, Any]:
    try:
        now = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this platform
        return {"cpus": os.cpu_count(), "period_s": None, "samples": []}
    if _LOAD is None:
        return {"cpus": os.cpu_count(), "period_s": None, "samples": [[0.0, now]]}
    samples = [[round(t, 3), v] for t, v in list(_LOAD.samples)]
    samples.append([round(time.monotonic() - _LOAD.t0, 3), now])
    return {"cpus": os.cpu_count(), "period_s": _LOAD.period, "samples": samples}


def png_metadata() -> dict[str, str]:
    """The text a plot's PNG carries (``savefig(..., metadata=png_metadata())``): its run's command, commit and
    date, so that the docs can tell which run drew a figure."""
    return {"Software": "odc-bench", "odc-provenance": json.dumps(_identity(), sort_keys=True)}


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Writes ``doc`` as indented JSON, with its :func:`provenance` under ``"provenance"``; the parent folder
    must exist."""
    doc = {**doc, "provenance": doc.get("provenance") or provenance()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")


def require_matplotlib() -> Any:
    """Imports matplotlib (Agg backend) or raises a :class:`UsageError` saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UsageError(
            f"--plot needs matplotlib ({e}); install it with `pip install matplotlib` or `pip install 'fsdp-odc[plot]'`"
        ) from None
    return plt


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], widths: Sequence[int],
          title: Sequence[str] = ()) -> str:
    """Fixed-width table, nccl-tests style: ``#`` header lines, right-aligned cells (one width per column)."""
    out = [f"# {line}" for line in title]
    out.append("# " + " ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for row in rows:
        out.append("  " + " ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)))
    return "\n".join(out)


def fmt(x: float, digits: int = 2) -> str:
    """A float cell; ``nan`` prints as ``-``."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def load_average() -> str:
    """``uptime``'s load averages (1, 5, 15 min), for reports on shared machines."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # pragma: no cover
        return "unknown"
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cpus)"


class LoadSampler:
    """Samples the 1-minute load average every ``period`` seconds on a thread while a benchmark runs.

    Use as a context manager; :attr:`samples` holds ``(seconds since start,
    load)`` pairs, the first taken at entry and the last at exit.
    """

    def __init__(self, period: float = 5.0) -> None:
        import threading

        self.period = period
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="odc-bench-load", daemon=True)
        self.t0 = 0.0

    def _take(self) -> None:
        with contextlib.suppress(OSError):  # no load average on this platform
            self.samples.append((time.monotonic() - self.t0, os.getloadavg()[0]))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._take()

    def __enter__(self) -> LoadSampler:
        self.t0 = time.monotonic()
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def describe(self) -> str:
        """The samples in one line: the range and median of the load average."""
        loads = [v for _, v in self.samples]
        if not loads:
            return "load average during the run: unknown"
        return (f"1-minute load average during the run {min(loads):.2f}..{max(loads):.2f} "
                f"(median {sorted(loads)[len(loads) // 2]:.2f}, {len(loads)} samples, {os.cpu_count()} cpus)")
