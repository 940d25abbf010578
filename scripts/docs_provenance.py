"""Whether each committed benchmark file is one a clean commit reproduces, and the command that rewrites it if not.

Every JSON under ``docs/bench/`` and ``docs/scale/`` must carry the ``provenance`` its run wrote
(``odc.bench.report.provenance``, ``odc_benches::provenance``):

- a ``command`` and a ``commit``;
- a commit without ``+dirty`` (a tree with uncommitted changes is one no commit reproduces), and one this
  repository holds (checked where git is at hand and the clone is not shallow);
- a ``date`` with its time of day: a provenance added to a file after its run (the run predating the field)
  has a date only, and its commit is the one that committed the data, not the one that made it.

A file shown first — the README's figure and measured-results rows, the figures of ``docs/index.md`` — must
also come from a run whose sampled 1-minute load average stayed below the machine's core count (the samples,
``provenance.load``, not one number at the end), and a figure must be the one that run drew (its PNG names the
JSON's commit and date: ``odc.bench.report.png_metadata``).

A file a page renders that no run has written yet is listed too, with the command that writes it (``PENDING``).

Each refusal names the file and the command that rewrites it: the JSON's own command, with its ``--json`` /
``-J`` pointed at the file and its ``--plot`` at the figure the docs show (``FIGURES``), and an estimate of how
long it runs on the machine that made it. ``scripts/docs_hooks.py --check-provenance`` prints the list,
``--stale`` the same as tab-separated lines for ``scripts/rerun-figures.sh``. Nothing here imports odc.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DATA = ("bench", "scale")  # folders of docs/ that hold benchmark JSON

# Every figure under docs/: the JSON files it is drawn from, and the command that draws it from them (None: the
# run of its one JSON drew it, through the command's --plot). A figure is redrawn when its data is rerun.
FIGURES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "train-2ranks.png": (("bench/train.json",), None),
    "train-baselines.png": (("bench/train-baselines.json",), None),
    "train-curves.png": (("bench/train-curves.json",), None),
    "compress-curves.png": (("bench/compress-curves.json",), None),
    "trainer.png": (("bench/trainer.json",), None),
    "imbalance-4ranks.png": (("bench/imbalance-4ranks.json",), None),
    "imbalance-8ranks-peak.png": (("bench/imbalance-8ranks-peak.json",), None),
    "imbalance-baselines.png": (("bench/imbalance-baselines.json",), None),
    "imbalance-baselines-8.png": (("bench/imbalance-baselines-8.json",), None),
    "primitives.png": (("bench/primitives.json",), None),
    "scale.png": (("scale/*.json",), "scripts/scale-plot.py --out docs/scale.png docs/scale/*.json"),
}
# Files a page renders that no run has written yet: the command that writes each, and a guess at its time. Until
# the file exists the page shows that command in the table's place and the check lists the file with the others
# (an entry whose file exists is not used).
PENDING: dict[str, tuple[str, float]] = {}
FRONT_PAGES = ("README.md", "docs/index.md")  # a figure on these is shown first
OUTPUT_FLAGS = ("--json", "-J")
PLOT_FLAGS = ("--plot",)

# What a run costs beyond what its JSON timed, on the 2-core machine that made these files: starting a Python
# rank (an interpreter importing torch, the cores shared) and a namespace run's set-up. Guesses, said so.
PY_RANK_START_S = 4.0
NETNS_SETUP_S = 10.0


@dataclass(frozen=True)
class Stale:
    """A benchmark file no clean commit reproduces: why, and how to rewrite it."""

    rel: str  # relative to docs/
    reasons: tuple[str, ...]
    rerun: str | None  # the command that rewrites it (None: its JSON names none)
    estimate_s: float | None
    estimate_basis: str


def _provenance(doc: dict[str, Any]) -> dict[str, Any]:
    p = doc.get("provenance")
    return p if isinstance(p, dict) else {}


def load_samples(doc: dict[str, Any]) -> tuple[list[float], int | None]:
    """The 1-minute load averages sampled during the run, and the machine's core count.

    ``provenance.load`` (every writer since the field was added); ``odc-bench train`` wrote its samples beside
    it before (``load_samples``), which count too.
    """
    load = _provenance(doc).get("load")
    if isinstance(load, dict):
        samples, cpus = load.get("samples") or [], load.get("cpus")
    else:
        samples, cpus = doc.get("load_samples") or [], doc.get("cpus")
    values = [float(s[1]) for s in samples if isinstance(s, (list, tuple)) and len(s) == 2]
    return values, cpus if isinstance(cpus, int) and cpus > 0 else None


def _missing_commits(commits: set[str], root: Path) -> set[str]:
    """Of ``commits``, those this repository does not hold; none where git cannot tell (no git, no checkout, a
    shallow clone)."""
    if not commits:
        return set()
    try:
        shallow = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=30, check=False)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return set()
        names = sorted(commits)
        out = subprocess.run(["git", "-C", str(root), "cat-file", "--batch-check"],
                             input="".join(f"{c}^{{commit}}\n" for c in names), capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return set()
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return set()
    return {c for c, line in zip(names, lines, strict=True) if line.endswith(" missing")}


def file_reasons(doc: dict[str, Any]) -> list[str]:
    """Why a benchmark file is not one a clean commit reproduces (empty: it is)."""
    p = _provenance(doc)
    command, commit, date = p.get("command"), p.get("commit"), p.get("date")
    if not command or not commit:
        missing = " and ".join(k for k, v in (("command", command), ("commit", commit)) if not v)
        return [f"no {missing} in its provenance"]
    out = []
    if str(commit).endswith("+dirty"):
        out.append(f"written from a tree with uncommitted changes (commit {commit})")
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d.*", str(date or "")):
        out.append(f"its provenance was added after the run, not written by it (date {date!r} has no time of day; "
                   f"commit {commit} is the one that committed the data)")
    return out


def front_reasons(doc: dict[str, Any]) -> list[str]:
    """Why a file shown first does not qualify: its load average, sampled during the run, reached the cores."""
    values, cpus = load_samples(doc)
    if len(values) < 2 or cpus is None:
        return ["no load average sampled during the run (a file shown first needs the samples and the core count)"]
    if max(values) >= cpus:
        return [f"the load average reached {max(values):.1f} on {cpus} cores during the run (a file shown first "
                f"needs it below the core count throughout)"]
    return []


def png_text(path: Path) -> dict[str, str]:
    """A PNG's tEXt and uncompressed iTXt chunks (what matplotlib writes from ``savefig(metadata=...)``)."""
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return {}
    out, i = {}, 8
    while i + 8 <= len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        kind, body = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        if kind == b"tEXt" and b"\0" in body:
            key, value = body.split(b"\0", 1)
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"iTXt" and b"\0" in body:
            key, rest = body.split(b"\0", 1)
            if rest[:1] == b"\0":  # compression flag 0, then the method, the language tag, the translated keyword
                parts = rest[2:].split(b"\0", 2)
                if len(parts) == 3:
                    out[key.decode("latin-1")] = parts[2].decode("utf-8")
        if kind == b"IEND":
            break
        i += 12 + n
    return out


def figure_reasons(png: Path, doc: dict[str, Any]) -> list[str]:
    """Why ``png`` is not the figure the run of ``doc`` drew (empty: it is)."""
    text = png_text(png).get("odc-provenance")
    if text is None:
        return [f"its figure docs/{png.name} names no run (a plot drawn before plots carried their provenance)"]
    try:
        drew = json.loads(text)
    except ValueError:
        return [f"its figure docs/{png.name} carries an unreadable provenance"]
    p = _provenance(doc)
    if (drew.get("commit"), drew.get("date")) != (p.get("commit"), p.get("date")):
        return [f"its figure docs/{png.name} was drawn by another run (commit {drew.get('commit')} at "
                f"{drew.get('date')})"]
    return []


def front_figures(root: Path = ROOT) -> dict[str, str]:
    """The figures the front pages show: file name under docs/ → the page."""
    out = {}
    for page in FRONT_PAGES:
        text = (root / page).read_text(encoding="utf-8")
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", text):
            name = os.path.normpath(os.path.join(os.path.dirname(page), target))
            out[os.path.relpath(name, "docs")] = page
    return out


def _figure_of(rel: str) -> str | None:
    """The figure the run of ``rel`` draws itself (through its --plot), if the docs show one."""
    return next((png for png, (srcs, cmd) in FIGURES.items() if cmd is None and rel in srcs), None)


def rerun_command(rel: str, doc: dict[str, Any]) -> str | None:
    """The JSON's own command with its output pointed at ``docs/REL`` and its plot at the figure the docs show
    (or ``out/``); None where it names no command or no output flag."""
    command = _provenance(doc).get("command")
    if not command:
        return None
    try:
        argv = shlex.split(str(command))
    except ValueError:
        return None
    out, wrote = [], False
    args = iter(argv)
    for a in args:
        flag, eq, value = a.partition("=")
        if flag in OUTPUT_FLAGS or flag in PLOT_FLAGS:
            if not eq:
                value = next(args, "")
            if flag in OUTPUT_FLAGS:
                value, wrote = f"docs/{rel}", True
            else:
                png = _figure_of(rel)
                value = f"docs/{png}" if png else f"out/{os.path.basename(value)}"
            out += [f"{flag}={value}"] if eq else [flag, value]
        else:
            out.append(a)
    return shlex.join(out) if wrote else None


def estimate(doc: dict[str, Any]) -> tuple[float | None, str]:
    """How long a rerun takes, in seconds, and what the figure rests on: the run's own length where it recorded
    one (its load samples span it), else what its JSON timed plus a guess at the start-up."""
    load = _provenance(doc).get("load")
    # Sampled from the run's start on; else odc-bench train's own samples, from before the load moved into the
    # provenance.
    samples = load.get("samples") if isinstance(load, dict) and load.get("period_s") else doc.get("load_samples")
    if isinstance(samples, list) and len(samples) >= 2:
        return float(samples[-1][0]), "the run's own length (its load samples)"
    a = doc.get("args") or {}
    bench = doc.get("bench") or doc.get("benchmark")
    guess = "the JSON's timed work, plus a guess at start-up"
    try:
        if bench == "hybrid-bench":
            per = a["minibatches"] + a.get("warmup", 1)
            t = sum(r[1] / 1e3 * per + a["world"] * PY_RANK_START_S + NETNS_SETUP_S for r in doc["rows"])
            return t, guess
        if bench == "cross-node":
            per = a["minibatches"] + a.get("warmup", 1)
            t = sum(ms / 1e3 * per + a["world"] * PY_RANK_START_S + NETNS_SETUP_S
                    for r in doc["rows"] for ms in r["ms_runs"])
            return t, guess
        if bench == "elastic-bench":
            per = a["minibatches"] + a["warmup"]
            t = sum((r["hybrid"] + r["elastic"]) / 1e3 * per + 2 * a["world"] * PY_RANK_START_S for r in doc["rows"])
            return t, guess
        if bench == "rejoin-bench":
            world = 2 * a["per_node"]
            t = sum(a["minibatches"] * a["compute_ms"] / 1e3 + r["rejoin_s"] + r["save_s"] + r["load_s"]
                    + world * PY_RANK_START_S for r in doc["rows"])
            return t, guess
        if bench == "imbalance" and a.get("run_seconds"):
            t = len(doc["rows"]) * a.get("repeats", 1) * a["run_seconds"]
            return t + max(a.get("world") or 8, 8) * PY_RANK_START_S, "--run-seconds per configuration and point"
        if bench == "primitives":
            per = a["iters"] + a["warmup_iters"]
            t = sum(per * (r["collective"]["time_us"] + r["odc"]["time_us"]) / 1e6 for r in doc["rows"])
            return t + 2 * max(a["ranks"]) * PY_RANK_START_S, guess
        if bench == "scale_perf":
            t = sum(q["register_s"] + doc["minibatches"] * q["minibatch_s"] + doc.get("idle_s", 0) + q["detect_s"]
                    + q.get("steal_s", 0) + 0.05 * q["ranks"] for q in doc["points"])
            return t, "the JSON's timed phases, plus 50 ms per process started"
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return None, "the JSON records no timing to estimate from"


def stale(front: dict[str, str], docs: Path = DOCS, root: Path = ROOT) -> list[Stale]:
    """Every benchmark file under ``docs/bench/`` and ``docs/scale/`` that fails the checks, in path order.

    Args:
        front: the files shown first (relative to ``docs/``) → where (e.g. "README.md's measured results"); they
            must also have run below the core count's load, and their figures be the ones their runs drew.
        docs: the docs folder.
        root: the checkout (for git, and the front pages' figures).
    """
    files = sorted(str(p.relative_to(docs)) for d in DATA for p in (docs / d).glob("*.json"))
    loaded: dict[str, dict[str, Any]] = {}
    reasons: dict[str, list[str]] = {}
    for rel in files:
        try:
            loaded[rel] = json.loads((docs / rel).read_text(encoding="utf-8"))
            reasons[rel] = file_reasons(loaded[rel])
        except ValueError as e:
            loaded[rel], reasons[rel] = {}, [f"not JSON: {e}"]
    commits = {str(_provenance(d).get("commit", "")).removesuffix("+dirty") for d in loaded.values()}
    for missing in _missing_commits({c for c in commits if c}, root):
        for rel, d in loaded.items():
            if str(_provenance(d).get("commit", "")).removesuffix("+dirty") == missing:
                reasons[rel].append(f"commit {missing} is not in this repository")
    for rel, where in sorted(front.items()):
        if rel not in loaded:
            continue
        why = front_reasons(loaded[rel])
        png = _figure_of(rel)
        if png and png in front_figures(root):
            why += figure_reasons(docs / png, loaded[rel])
        reasons[rel] += [f"{r} — it is shown first ({where})" for r in why]
    out = []
    for rel in files:
        if reasons[rel]:
            t, basis = estimate(loaded[rel])
            out.append(Stale(rel, tuple(reasons[rel]), rerun_command(rel, loaded[rel]), t, basis))
    for rel, (command, guess) in PENDING.items():
        if not (docs / rel).exists():
            out.append(Stale(rel, ("no run has written it yet (a page renders it)",), command, guess,
                             "a guess: the run has not been made on a quiet machine"))
    return sorted(out, key=lambda s: s.rel)


def figure_problems(docs: Path = DOCS, root: Path = ROOT) -> list[str]:
    """Figures the docs hold or show that ``FIGURES`` does not tie to their data (a figure with no data behind it is
    typed by hand)."""
    out = [f"docs/{p.name}: not in scripts/docs_provenance.py's FIGURES (name the JSON it is drawn from)"
           for p in sorted(docs.glob("*.png")) if p.name not in FIGURES]
    for png, page in front_figures(root).items():
        srcs, cmd = FIGURES.get(png, ((), None))
        if cmd is not None or len(srcs) != 1:
            out.append(f"{page} shows docs/{png}: a figure shown first must be drawn by the run of one JSON")
    return out


def redraw_commands(rels: list[str]) -> list[str]:
    """The commands that redraw the figures drawn from any of ``rels`` by a command of their own (a figure its
    run drew itself is redrawn by the rerun)."""
    return [cmd for srcs, cmd in FIGURES.values()
            if cmd is not None and any(fnmatch.fnmatch(rel, src) for rel in rels for src in srcs)]


def minutes(seconds: float | None) -> str:
    """An estimate in words."""
    if seconds is None:
        return "unknown"
    return f"about {max(1, round(seconds / 60))} min" if seconds >= 90 else f"about {max(1, round(seconds))} s"


def report(items: list[Stale]) -> str:
    """The list as ``make docs`` prints it: each file, why, and the command that rewrites it."""
    total = sum(s.estimate_s or 0 for s in items)
    unknown = sum(s.estimate_s is None for s in items)
    lines = [f"{len(items)} benchmark file(s) that no clean commit reproduces (or no run wrote yet); rerun each from "
             f"a clean commit on a quiet machine (scripts/rerun-figures.sh runs exactly these, {minutes(total)} in all"
             + (f" plus {unknown} unestimated" if unknown else "") + "):"]
    for s in items:
        lines.append(f"  docs/{s.rel}:")
        lines += [f"      - {r}" for r in s.reasons]
        lines.append(f"      rerun ({minutes(s.estimate_s)}: {s.estimate_basis}): "
                     + (s.rerun or "its JSON names no command with --json/-J: rerun it by hand"))
    return "\n".join(lines)


def tsv(items: list[Stale]) -> str:
    """One line per file: REL, estimated seconds (or -), the rerun command (or -)."""
    return "".join(f"{s.rel}\t{'-' if s.estimate_s is None else round(s.estimate_s)}\t{s.rerun or '-'}\n"
                   for s in items)
