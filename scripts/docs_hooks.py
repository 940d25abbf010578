"""The docs site's generated parts (a mkdocs hook, named in mkdocs.yml): tables rendered from the code and from
committed JSON, so that no figure on a page is typed by hand.

A page asks for a part with a marker on a line of its own:

    <!-- odc:env -->                              the environment variables (odc-py/python/odc/_env.py)
    <!-- odc:error-tree -->                       the exception hierarchy (odc-py/python/odc/errors.py)
    <!-- odc:bench KIND FILE... -->               a benchmark table from FILE (relative to docs/), e.g.
                                                  <!-- odc:bench primitives bench/primitives.json -->
                                                  (memory-fits takes several files: one table of all)
    <!-- odc:exceptions PATH... -->               each exception class at PATH (odc.backend.NotInitialized, ...):
                                                  its bases and docstring, linked to its API entry
    <!-- odc:quickstart NAME -->                  the README's block marked <!-- quickstart:NAME --> (the one
                                                  make test runs), so that the docs' copy cannot drift

Every benchmark table is followed by the command, commit and date that made its JSON (its "provenance") and
the load average sampled while it ran. A marker with an unknown kind, a missing file, a file outside
``docs/bench/`` and ``docs/scale/`` or JSON the renderer cannot read fails the build. Before the pages build,
every file of those folders is checked (``scripts/docs_provenance.py``: a command and a clean commit that made
it; for the files shown first, a load average below the core count throughout the run): each one that fails
is a warning naming it and the command that rewrites it, so the strict build fails and lists them all.
Nothing here imports odc (no torch): the table of variables is read by path, the errors from their source.

``python scripts/docs_hooks.py --readme`` prints the README's measured-results table (the block between
``<!-- results:begin -->`` and ``<!-- results:end -->``), ``--write-readme`` writes it there, and
``--check-readme`` (in ``make docs``) fails when a benchmark file fails the provenance check, the README's
table differs or a README link names a missing file. ``--check-provenance`` prints the provenance check alone
(the files to rerun, each with its command and an estimate of its time), ``--stale`` the same as tab-separated
lines (``scripts/rerun-figures.sh`` reads them).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- odc:([a-z-]+)((?: [^ \n]+)*) -->$", re.M)


class DocsError(Exception):
    """A marker that cannot be rendered; mkdocs reports it and the build fails."""


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DocsError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


prov = _load(ROOT / "scripts" / "docs_provenance.py", "docs_provenance")


def _md(text: str) -> str:
    """A table cell: pipes escaped."""
    return text.replace("|", "\\|")


def table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    out = ["| " + " | ".join(_md(h) for h in head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# -- the code's tables ---------------------------------------------------------------------------------------


def env_tables() -> str:
    """Every section of odc._env.ENVIRONMENT as a heading and a table."""
    env = _load(ROOT / "odc-py" / "python" / "odc" / "_env.py", "_odc_env_for_docs")
    out = []
    for key, title in env.SECTIONS.items():
        rows = [[f"`{v.name}`", v.default, v.meaning, v.reader] for v in env.ENVIRONMENT if v.section == key]
        if not rows:
            raise DocsError(f"odc/_env.py: section {key!r} has no variable")
        out += [f"## {title} {{#{key}}}", "", table(["variable", "default", "meaning", "read by"], rows), ""]
    unknown = {v.section for v in env.ENVIRONMENT} - set(env.SECTIONS)
    if unknown:
        raise DocsError(f"odc/_env.py: unknown sections {sorted(unknown)}")
    return "\n".join(out)


def error_tree() -> str:
    """The exception classes of odc/errors.py as a nested list, each linked to its entry on the page."""
    tree = ast.parse((ROOT / "odc-py" / "python" / "odc" / "errors.py").read_text(encoding="utf-8"))
    bases: dict[str, list[str]] = {}
    summary: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
            summary[node.name] = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ")
    if "OdcError" not in bases:
        raise DocsError("odc/errors.py defines no OdcError")
    lines: list[str] = []

    def walk(name: str, depth: int) -> None:
        also = [b for b in bases[name] if b not in bases]  # ValueError, OSError: builtins
        extra = f" (also `{'`, `'.join(also)}`)" if also and name != "OdcError" else ""
        lines.append(f"{'    ' * depth}- [`{name}`][odc.errors.{name}]{extra}: {summary[name]}")
        for child in bases:
            if bases[child] and bases[child][0] == name:
                walk(child, depth + 1)

    walk("OdcError", 0)
    return "\n".join(lines)


def quickstart(name: str) -> str:
    """The fenced block that follows ``<!-- quickstart:NAME -->`` in the README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(rf"^<!-- quickstart:{re.escape(name)} -->\n(```[a-z]*\n.*?^```)$", text, re.M | re.S)
    if m is None:
        raise DocsError(f"README.md has no block marked <!-- quickstart:{name} -->")
    return m.group(1)


@functools.cache
def _package() -> Any:
    """The odc package as the API pages read it (griffe, statically; the same role rewriting)."""
    import griffe

    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_griffe import SphinxRoles

    return griffe.load("odc", search_paths=[str(ROOT / "odc-py" / "python")], allow_inspection=False,
                       extensions=griffe.load_extensions(SphinxRoles()))


def exceptions(paths: list[str]) -> str:
    """Each exception class as a heading, its bases and its docstring, linked to its entry in the API pages."""
    import griffe

    out = []
    for path in paths:
        try:
            obj = _package()[path.removeprefix("odc.")]
            cls = obj.final_target if obj.is_alias else obj
        except (KeyError, griffe.AliasResolutionError) as e:
            raise DocsError(f"no class {path}: {e}") from None
        if not cls.is_class or not cls.docstring:
            raise DocsError(f"{path} is not a documented class")
        bases = ", ".join(f"`{b}`" for b in cls.bases)
        out += [f"### `{path.rsplit('.', 1)[1]}`", "", f"`{path}` ({bases}): [API][{path}]", "",
                cls.docstring.value, ""]
    return "\n".join(out)


# -- provenance ----------------------------------------------------------------------------------------------


def provenance(doc: dict[str, Any], rel: str, link: str) -> str:
    """The line under a benchmark table: command, commit, date, and the machine's load while it ran (whether a
    clean commit reproduces it is ``docs_provenance``'s check, over every file, before the pages build)."""
    p = doc.get("provenance")
    if not isinstance(p, dict) or not p.get("command") or not p.get("date"):
        raise DocsError(f"{rel}: no provenance (command, commit, date); rerun the benchmark that writes it")
    commit = p.get("commit") or f"none (version {p.get('version', '?')})"
    load = doc.get("load_average")
    samples, cpus = prov.load_samples(doc)
    load_txt = ""
    if len(samples) >= 2:
        load_txt = (f"; load average {min(samples):.1f}–{max(samples):.1f} during the run ({len(samples)} "
                    "samples)" + (f" on {cpus} cores" if cpus else ""))
    elif isinstance(load, list) and load:
        load_txt = f"; load average {' '.join(f'{x:.1f}' for x in load)} at the end"
        if doc.get("cpus"):
            load_txt += f" on {doc['cpus']} cores"
    note = f" ({p['note']})" if p.get("note") else ""
    return (f"<small>Made by `{p['command']}` at commit `{commit}` on {str(p['date'])[:10]}{load_txt}{note}; "
            f"the data: [`docs/{rel}`]({link}).</small>")


def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _size(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def _straggler(value: Any) -> str:
    """``--straggler`` as it was stored (``[rank, factor]`` or ``"rank:factor"``), in words."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"rank {value[0]} {value[1]:g}× slower"
    if isinstance(value, str) and ":" in value:
        rank, factor = value.split(":", 1)
        return f"rank {rank} {factor}× slower"
    return str(value)


def _pct(x: Any) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


# -- benchmark renderers -------------------------------------------------------------------------------------


def bench_primitives(doc: dict[str, Any]) -> str:
    """odc-bench primitives: busbw (GB/s) of the collective and of ODC, and their ratio, per size and world."""
    ops = [("all_gather", "all-gather", "gather"), ("all_gather_in_place", "all-gather in place", "gather in place"),
           ("reduce_scatter", "reduce-scatter", "scatter-accumulate")]
    ops = [o for o in ops if any(r["op"] == o[0] for r in doc["rows"])]
    coll = doc.get("backend", "collective")
    out = []
    for world in sorted({r["world"] for r in doc["rows"]}):
        for dtype in sorted({r["type"] for r in doc["rows"] if r["world"] == world}):
            head = ["size"]
            for _, c, o in ops:
                head += [f"{coll} {c}", f"ODC {o}", "ratio"]
            by = {(r["size"], r["op"]): r for r in doc["rows"] if r["world"] == world and r["type"] == dtype}
            rows = []
            for size in sorted({s for s, _ in by}):
                row = [_size(size)]
                for op, _, _ in ops:
                    r = by.get((size, op))
                    row += ([_f(r["collective"]["busbw"]), _f(r["odc"]["busbw"]), f"{r['busbw_ratio']:.1f}×"]
                            if r else ["–"] * 3)
                rows.append(row)
            wrong = sum(r["collective"]["wrong"] + r["odc"]["wrong"] for r in by.values())
            out += [f"{world} ranks, {dtype}, busbw in GB/s (#wrong {wrong}):", "", table(head, rows), ""]
    return "\n".join(out)


def bench_perf(doc: dict[str, Any]) -> str:
    """gather_perf / scatter_accumulate_perf: time, busbw, the copy limit and ceiling, %ceil."""
    gather = doc["benchmark"] == "gather_perf"
    rows = []
    for r in doc["rows"]:
        best = r.get("best_busbw")
        ceil = r.get("ceiling_busbw")
        pct = f"{100 * best / ceil:.0f} %" if best and ceil else "–"
        row = [_size(r["size"]), _f(r["time_us"]), _f(r["busbw"])]
        if gather:
            ip = r.get("in_place") or {}
            row += [_f(ip.get("time_us")), _f(ip.get("busbw"))]
        row += [_f(r.get("limit_busbw")), _f(ceil), pct, str(r["wrong"] + (r.get("in_place") or {}).get("wrong", 0))]
        rows.append(row)
    name = "gather" if gather else "scatter-accumulate"
    head = ["size", f"{name} µs", "busbw"] + (["in place µs", "busbw"] if gather else [])
    head += ["limit", "ceiling", "%ceil", "#wrong"]
    return (f"{doc['ranks']} ranks, {doc['dtype']}, transport {doc['transport']}, {doc['warmup']} warm-up + "
            f"{doc['iters']} timed iterations; busbw, limit and ceiling in GB/s:\n\n" + table(head, rows))


def _train_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in doc["rows"]:
        mbs = r["microbatches"]
        counts = sorted({c for per in mbs for c in per}) if mbs and isinstance(mbs[0], list) else []
        spread = f"{min(counts)}–{max(counts)}" if counts and min(counts) != max(counts) else str(
            r.get("max_microbatches", "–"))
        name = f"**{r['config']}**" if r["config"] == "odc+lb-mini" else r["config"]
        rows.append([str(r["minibatch_size"]), name, spread, _f(r["time_per_minibatch_s"], 3),
                     f"{r['speedup_measured']:.3f}× [{r['speedup_min']:.2f}–{r['speedup_max']:.2f}]",
                     f"{r['speedup_predicted']:.3f}× ({100 * r['error']:+.1f} %)",
                     f"{r['speedup_predicted_with_overheads']:.3f}× ({100 * r['error_with_overheads']:+.1f} %)",
                     "–" if r["dparam"] is None else f"{r['dparam']:.1e}"])
    return rows


def bench_train(doc: dict[str, Any]) -> str:
    """odc-bench train: measured speedup against the packer's prediction, per minibatch size and configuration."""
    fit = doc["fit"]
    ovh = doc.get("overheads", {})
    ovh_txt = "; ".join(f"{m}: {1e3 * o['microbatch_s']:.0f} ms per microbatch, {1e3 * o['minibatch_s']:.0f} ms per "
                        f"minibatch" for m, o in ovh.items())
    head = ["minibatch size", "config", "microbatches / rank", "s / minibatch", "speedup measured [min–max]",
            "packer (error)", "+fixed (error)", "dparam"]
    return (f"{doc['world']} ranks, real compute; speedup against `collective+lb-micro`; cost model fitted in the "
            f"run: `{fit['cost']}`, residual {100 * fit['rms_relative']:.0f} % rms; fixed costs measured apart: "
            f"{ovh_txt or '–'}.\n\n" + table(head, _train_rows(doc)))


def bench_train_steal(doc: dict[str, Any]) -> str:
    """odc-bench train with stealing / deterministic configurations: time, speedup, busy fraction, stolen."""
    rows = []
    for r in doc["rows"]:
        rows.append([r["config"], _f(r["time_per_minibatch_s"], 3), f"{r['speedup_measured']:.3f}×",
                     _pct(r["busy"]) if r.get("busy") is not None else "–",
                     _pct(1 - r["steal_bound"]) if r.get("steal_bound") is not None else "",
                     _f(r.get("stolen_per_minibatch"), 1) if "+steal" in r["config"] else "",
                     "–" if r["dparam"] is None else f"{r['dparam']:.1e}"])
    head = ["configuration", "s / minibatch", "speedup vs collective + LB-Micro", "busy (1 − bubble)",
            "busy the stealing policy can reach", "stolen / minibatch", "parameters vs the same plan"]
    straggler = doc["args"].get("straggler")
    where = f"; {_straggler(straggler)}" if straggler else ""
    return f"{doc['world']} ranks, minibatch size {doc['args']['minibatch_size']}{where}:\n\n" + table(head, rows)


def bench_train_curves(doc: dict[str, Any]) -> str:
    """odc-bench train --curves: the loss at a few minibatches, and the largest differences from the baseline."""
    s = doc["curves"]
    names = list(s["losses"])
    n = len(s["losses"][names[0]])
    picks = sorted(set(range(0, n, max(1, n // 8))) | {n - 1})
    rows = [[str(k), *[f"{s['losses'][c][k]:.6f}" for c in names]] for k in picks]
    diffs = [[name, f"{d:.1e}"] for name, d in s["max_abs_loss_diff"].items()]
    return (table(["minibatch", *names], rows) + "\n\nLargest |loss difference| from `collective+lb-micro` over "
            f"all {n} minibatches (the control, `collective+local-sort`, differs only in the order of float sums):"
            "\n\n" + table(["configuration", "max abs loss difference"], diffs))


def bench_imbalance(doc: dict[str, Any]) -> str:
    """odc-bench imbalance: speedup measured / predicted per swept value and configuration."""
    sweep = doc["args"].get("sweep")
    key = sweep.split("=")[0] if sweep else None
    col = {"minibatch-size": "minibatch_size", "world": "world", None: "minibatch_size"}.get(key, "label")
    configs = list(dict.fromkeys(r["config"] for r in doc["rows"]))
    points = list(dict.fromkeys(r[col] for r in doc["rows"]))
    by = {(r[col], r["config"]): r for r in doc["rows"]}
    rows = []
    for p in points:
        row = [str(p)]
        for c in configs:
            r = by.get((p, c))
            comm = "" if r is None or r.get("speedup_predicted_with_comm") is None \
                else f" / {r['speedup_predicted_with_comm']:.3f}"
            row.append("–" if r is None else f"{r['speedup_measured']:.3f} / {r['speedup_predicted']:.3f}{comm}")
        rows.append(row)
    head = [(key or "minibatch size").replace("-", " "), *configs]
    with_comm = any(r.get("speedup_predicted_with_comm") is not None for r in doc["rows"])
    wrong = sum(r["wrong"] for r in doc["rows"])
    a = doc["args"]
    fixed = [f"{a['world']} ranks" if key != "world" else None,
             f"minibatch size {a['minibatch_size']}" if key != "minibatch-size" else None]
    return (f"Emulated compute; {', '.join(x for x in fixed if x)}, {a['minibatches']} minibatches, "
            f"{a['layers']} layers of {_size(a['layer_bytes'])}; speedup against `collective+lb-micro`, "
            f"measured / predicted" + (" / predicted +comm (each plan's run without compute added)" if with_comm
                                        else "") + f" (#wrong {wrong}):\n\n" + table(head, rows))


def bench_imbalance_bubbles(doc: dict[str, Any]) -> str:
    """odc-bench imbalance with noise, a straggler or stealing: bubbles measured against the policy's bound."""
    rows = []
    for r in doc["rows"]:
        bound = _pct(r["steal_bound"]) if r.get("steal_bound") is not None else ""
        stolen = _f(r.get("stolen_per_minibatch"), 1) if "+steal" in r["config"] else ""
        rows.append([r["config"], _pct(r["bubble_measured"]), _pct(r["bubble_predicted"]), bound, stolen,
                     f"{r['speedup_measured']:.3f}×"])
    a = doc["args"]
    strays = [f"noise σ {a['noise']}" if a.get("noise") else "",
              _straggler(a["straggler"]) if a.get("straggler") else ""]
    what = ", ".join(s for s in strays if s) or "the cost model exactly"
    head = ["configuration", "bubble measured", "bubble predicted", "stealing policy's bound", "stolen / minibatch",
            "speedup"]
    return (f"Emulated compute; {a['world']} ranks, minibatch size {a['minibatch_size']}, {a['minibatches']} "
            f"minibatches; compute: {what} (#wrong {sum(r['wrong'] for r in doc['rows'])}):\n\n" + table(head, rows))


def bench_hybrid(doc: dict[str, Any]) -> str:
    """scripts/hybrid-bench.py: time per minibatch, cross-node bytes measured against the formula, optimizer state."""
    rows = doc["rows"]
    base = rows[0][1]
    out = []
    for mode, ms, got, want, state, _params in rows:
        out.append([f"`{mode}`", f"{ms:.0f}", f"{ms / base:.2f}", f"{got / 2**20:.2f}", f"{want / 2**20:.2f}",
                    f"{got / want:.2f}" if want else "–", f"{state:,}" if isinstance(state, int) else str(state)])
    a = doc["args"]
    head = ["mode", "ms / minibatch", f"vs {rows[0][0]}", "cross-node MiB / minibatch / rank (veth rx)",
            "payload by formula", "measured / formula", "AdamW state per rank (elements)"]
    link = f", every link shaped to {a['rate']} each way" if a.get("rate") else ""
    return (f"{a['world']} ranks as {a['netns']} network namespaces{link}, a model of {rows[0][5] / 1e6:.2f} M "
            f"parameters, {a['micros']} microbatches of {a['seq']} tokens per rank per minibatch, {a['minibatches']} "
            f"timed minibatches:\n\n" + table(head, out) + _alternated(rows))


def _alternated(rows: list[list[Any]]) -> str:
    """For a run of two modes, each run the same number of times (alternated): the ratio of each pair's times (the
    second mode's over the first's, the i-th run of each), and their median."""
    modes = list(dict.fromkeys(r[0] for r in rows))
    if len(modes) != 2:
        return ""
    runs = [[r[1] for r in rows if r[0] == m] for m in modes]
    if len(runs[0]) != len(runs[1]) or len(runs[0]) < 2:
        return ""
    ratios = [b / a for a, b in zip(*runs, strict=True)]
    return (f"\n\n`{modes[1]}` over `{modes[0]}`, pair by pair (the i-th run of each): "
            f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}).")


def bench_cross_node(doc: dict[str, Any]) -> str:
    """scripts/cross-node-bench.py: time per minibatch and bytes into each node against the node rules' formula."""
    a, f, rows = doc["args"], doc["formula"], doc["rows"]
    base = next((r for r in rows if r["mode"] == "odc-direct"), rows[0])
    out = []
    for r in rows:
        rx = statistics.mean(r["rx_per_node"])
        runs = ", ".join(f"{ms:.0f}" for ms in r["ms_runs"])
        out.append([f"`{r['mode']}`", f"{r['ms']:.0f} ({runs})", f"{r['ms'] / base['ms']:.2f}",
                    f"{rx / 2**20:.1f}", f"{rx / f['node']:.2f}", str(r["wrong"])])
    head = ["mode", "ms / minibatch (each run)", f"vs `{base['mode']}`",
            "MiB into each node / minibatch (veth rx)", "/ node rules' formula", "#wrong"]
    mib = doc["model_bytes"] / 2**20
    compute = f"{a['compute_ms']:g} ms of emulated compute (a sleep)" if a.get("compute_ms") else "no compute"
    return (f"{a['world']} ranks as {doc['n']} network namespaces × {doc['g']}, every link shaped to "
            f"{a['rate'] or 'no limit'} each way; a model of {a['buckets']} f32 buckets, {mib:.0f} MiB; {compute} per "
            f"microbatch; "
            f"{a['micros']} microbatches per rank per minibatch (each bucket gathered twice and reduced once "
            f"per microbatch), {a['minibatches']} timed minibatches, the median of {a['rounds']} alternating "
            f"runs:\n\n" + table(head, out) + "\n\n"
            f"Formula, MiB into each node per minibatch: the node rules {f['node'] / 2**20:.1f} "
            f"(`(N − 1)/N` of the parameters once, `(N − 1)/N` of the gradients once), `direct` "
            f"{f['direct'] / 2**20:.1f} (G ranks × every microbatch's two gathers and its push), a ring "
            f"all-gather / reduce-scatter {f['ring'] / 2**20:.1f}.")


def bench_cross_node_compress(doc: dict[str, Any]) -> str:
    """scripts/cross-node-bench.py with compressed modes: time and bytes into each node against odc-node's in the same
    run and against each mode's own formula (formats' widths, scales, chunk headers), the load around each run."""
    a, f, rows = doc["args"], doc["formula"], doc["rows"]
    plain = next(r for r in rows if r["mode"] == "odc-node")
    plain_rx = statistics.mean(plain["rx_per_node"])
    out = []
    for r in rows:
        rx = statistics.mean(r["rx_per_node"])
        want = r.get("formula", None if r["mode"] == "gloo" else f["node"])
        loads = ", ".join(f"{b[0]:.1f}→{e[0]:.1f}" for b, e in r.get("load_runs", []))
        out.append([f"`{r['mode']}`", f"{r['ms']:.0f} ({', '.join(f'{ms:.0f}' for ms in r['ms_runs'])})",
                    f"{r['ms'] / plain['ms']:.2f}", f"{rx / 2**20:.2f}", f"{rx / plain_rx:.3f}",
                    "–" if want is None else f"{want / 2**20:.2f}", "–" if want is None else f"{rx / want:.3f}",
                    loads or "–", str(r["wrong"])])
    head = ["mode", "ms / minibatch (each run)", "time vs `odc-node`", "MiB into each node / minibatch (veth rx)",
            "bytes vs `odc-node`", "formula MiB", "measured / formula", "load average before→after each run",
            "#wrong"]
    return (f"{a['world']} ranks as {doc['n']} network namespaces × {doc['g']}, every link shaped to "
            f"{a['rate'] or 'no limit'} each way; {a['buckets']} f32 buckets, {doc['model_bytes'] / 2**20:.0f} MiB; "
            f"{a['micros']} microbatches per minibatch, {a['minibatches']} timed minibatches, the median of "
            f"{a['rounds']} alternating runs; blocks of {a.get('block', 32)} elements per f32 scale:\n\n"
            + table(head, out) + "\n\nFormula: `odc-node` the node "
            "rules (`(N − 1)/N` of the parameters once and of the gradients once), a compressed mode the same at its "
            "formats' widths with one f32 scale per block and a 64-byte header per pushed chunk.")


def bench_train_curves_compress(doc: dict[str, Any]) -> str:
    """odc-bench train --curves with compressed configurations: each one's distance from the uncompressed ODC run
    and from the baseline, against the float-reordering control's."""
    s = doc["curves"]
    control = s["max_abs_loss_diff"]["collective+local-sort"]
    n = len(s["losses"]["collective+lb-micro"])
    rows = [["`collective+local-sort` (control)", "–", "–", f"{control:.1e}",
             f"{s['mean_abs_loss_diff']['collective+local-sort']:.1e}", "1.0×", ""],
            ["`odc+lb-mini`", "–", "–", f"{s['max_abs_loss_diff']['odc+lb-mini']:.1e}",
             f"{s['mean_abs_loss_diff']['odc+lb-mini']:.1e}", "", ""]]
    for name, c in s["compressed"].items():
        setting = ", ".join(f"{k}={v}" for k, v in c["compress"].items())
        rows.append([f"`{name}` ({setting})", f"{c['max_vs_odc']:.1e}", f"{c['mean_vs_odc']:.1e}",
                     f"{c['max_vs_baseline']:.1e}", f"{c['mean_vs_baseline']:.1e}",
                     f"{c['max_vs_odc'] / control:.0f}×" if control else "–", "yes" if c["within"] else "no"])
    head = ["configuration", "max |Δloss| vs `odc+lb-mini`", "mean vs `odc+lb-mini`",
            "max |Δloss| vs `collective+lb-micro`", "mean vs `collective+lb-micro`", "max vs odc / control's max",
            "within 2× the control"]
    return f"Over {n} minibatches (optimizer steps):\n\n" + table(head, rows)


def _bytes(n: float) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.2f} {unit}"
    return f"{n:.0f} B"


def bench_memory(doc: dict[str, Any]) -> str:
    """odc-bench memory (measured, or --formula): bytes per rank by kind, max over ranks."""
    rows = [{"label": r["label"], **r["max"]} if "max" in r else r for r in doc["rows"]]  # measured: max over ranks
    keys = [k for k in ("params", "grads", "optim", "published", "accum", "exact", "cross", "landing", "odc_shm",
                        "rss_peak", "total") if any(k in r for r in rows)]
    names = {"params": "params", "grads": "grads", "optim": "optimizer state", "published": "ODC published",
             "accum": "ODC f32 accumulators", "exact": "ODC exact (deterministic)", "cross": "ODC cross-node sums",
             "landing": "ODC landing slots", "odc_shm": "ODC shared memory", "rss_peak": "process RSS (peak)",
             "total": "total"}
    body = [[r["label"], *[("–" if r.get(k) is None else _bytes(r[k])) for k in keys]] for r in rows]
    return table(["per rank", *[names[k] for k in keys]], body)


def bench_scale(doc: dict[str, Any]) -> str:
    """scale_perf: one row per world size (scripts/scale-plot.py's table)."""
    plot = _load(ROOT / "scripts" / "scale-plot.py", "_odc_scale_plot_for_docs")
    t: str = plot.table(doc)
    return f"Transport `{doc['transport']}`, sharding `{doc['sharding']}`, nodes of {doc['node_ranks']}:\n\n{t}"


def _mib(v: Any) -> str:
    return "–" if v is None else f"{v / 2**20:.0f} MiB"


def bench_baselines(doc: dict[str, Any]) -> str:
    """odc-bench train with the baselines: per minibatch size, ODC + LB-Mini against each configuration (time,
    prediction) and every configuration's memory and same-samples check."""
    rows = {(r["minibatch_size"], r["config"]): r for r in doc["rows"]}
    grads = any(r.get("dgrad_baseline") is not None for r in doc["rows"])  # runs made before the check lack it
    tol = 1e-5
    timing = []
    for p in doc["pairs"]:
        them = rows[(p["label"], p["other"])]
        mbs = them["microbatches"]
        counts = sorted({c for per in mbs for c in per})
        spread = f"{min(counts)}–{max(counts)}" if min(counts) != max(counts) else str(counts[0])
        timing.append([str(p["label"]), p["other"], spread, _f(them["time_per_minibatch_s"], 3),
                       f"**{p['measured']:.3f}×** [{p['min']:.2f}–{p['max']:.2f}]",
                       f"{p['packer']:.3f}× ({100 * p['error']:+.1f} %)",
                       f"{p['with_fixed']:.3f}× ({100 * p['error_with_fixed']:+.1f} %)"])
    head = ["minibatch size", "against", "its microbatches / rank (over the minibatches)", "its s / minibatch",
            "ODC + LB-Mini is faster by: measured [min–max]", "predicted: packer (error)",
            "predicted: +fixed (error)"]
    mem = []
    for r in doc["rows"]:
        m = r["memory"]
        same = "yes" if r["dloss"] <= tol and (r["config"] == "collective+lb-micro" or r["dparam_baseline"] <= tol) \
            else "**no**"
        grad = r.get("dgrad_baseline")
        mem.append([str(r["minibatch_size"]), r["config"], _mib(m["rss_peak"]), _mib(m["rss_rise"]),
                    f"{m['held'] / 2**10:.0f} KiB", _mib(m["odc_shm"]), f"{r['dloss']:.1e}",
                    "–" if r["config"] == "collective+lb-micro" else f"{r['dparam_baseline']:.1e}", same]
                   + ([] if not grads else ["–" if r["config"] == "collective+lb-micro" else f"{grad:.1e}"]))
    mem_head = ["minibatch size", "config", "peak RSS", "RSS rise in the run", "params + grads held",
                "ODC shared memory", "loss vs collective + LB-Micro", "parameters vs it", f"both ≤ {tol:g}"]
    if grads:
        mem_head.append("first minibatch's gradients vs it (relative)")
    return (f"{doc['world']} ranks, real compute; the time of each configuration over the time of `odc+lb-mini` "
            "on the same minibatches (median of the per-repeat ratios of interleaved runs; above 1: ODC + LB-Mini "
            "is faster); *packer* predicts it from the fitted per-sample costs alone, *+fixed* with the fixed costs "
            f"measured before the runs.\n\n{table(head, timing)}\n\nMemory per rank (the largest over ranks; CPU: "
            "the process's resident set, torch has no allocator figures there), and the losses and final parameters "
            "against `collective+lb-micro` on the same samples (the first repeat's"
            + ("; the gradients: the largest |difference| of the first minibatch's, before clipping, over their "
               "largest |entry|" if grads else "") + "):\n\n" + table(mem_head, mem))


def bench_trainer(doc: dict[str, Any]) -> str:
    """odc-bench trainer: per minibatch size, each arm's time per optimizer step and peak memory per rank, with
    their ratios to TRL's default in the same run, and the arms' step-0 losses (same rows, same weights)."""
    base = doc["baseline"]
    rows = []
    for p in doc["points"]:
        for arm in doc["arms"]:
            a, ratio = p["arms"][arm], p["ratios"].get(arm)
            runs = a["step_s_runs"]
            counts = sorted({c for per in a["microbatches"] for c in per})
            rows.append([str(p["minibatch_size"]), f"`{arm}`",
                         f"{a['step_s']:.3f} [{min(runs):.3f}–{max(runs):.3f}]",
                         "1 (baseline)" if ratio is None else f"**{ratio['speedup']:.3f}×**",
                         _mib(a["rss_peak"]), _mib(a["rss_grown"]),
                         "1 (baseline)" if ratio is None or ratio["memory"] is None else f"{ratio['memory']:.3f}",
                         _mib(a["odc_shm"]), f"{min(counts)}–{max(counts)}" if len(counts) > 1 else str(counts[0]),
                         f"{a['losses'][0]:.6f}"])
    head = ["minibatch size (rows / rank / step)", "arm", "s / step: median [min–max]", f"speedup vs `{base}`",
            "peak RSS / rank", "RSS grown in the arm", f"peak RSS vs `{base}`", "ODC shared memory",
            "microbatches / rank / step", "loss at step 0"]
    same = all(p["same_samples"] for p in doc["points"])
    return (f"{doc['world']} ranks, real compute, {doc['model']}; {doc['samples']} samples. Time per optimizer "
            "step: rank 0's wall time over the steps after the first, the median of the interleaved repeats "
            "(arm order rotated per repeat). Memory per rank: the largest over ranks and repeats of the process's "
            "peak resident set during the arm (CPU: torch keeps no allocator figures there); ODC's shared-memory "
            "segments apart. Step-0 losses " + ("agree" if same else "**disagree**") + " across the arms.\n\n"
            + table(head, rows))


def bench_weights(doc: dict[str, Any]) -> str:
    """odc-bench weights: per setup and size, the slowest reader's time to a bf16 model by ODC's reader and by the
    gather-and-broadcast baseline, the limit, and the trainers' step time without and with readers reading."""
    rows = []
    for r in doc["rows"]:
        rows.append([r["where"], f"{r['bytes'] / 2**30:.2f} GiB", ", ".join(r["routes"]),
                     f"{r['baseline_s']:.2f} s", f"{r['odc_s']:.2f} s", f"**{r['speedup']:.1f}×**",
                     f"{r['limit_s']:.2f} s ({r['limit']})", f"**{r['of_limit']:.2f}×**",
                     f"{r['step_alone_s'] * 1e3:.0f} ms", f"{r['step_read_s'] * 1e3:.0f} ms", f"{r['stall']:.2f}×",
                     f"{r['stall_reads']} / {r['stall_refused']}", f"{r['load'][0]:.1f} → {r['load'][1]:.1f}"])
    head = ["setup", "f32 model", "reader's route", "gather + broadcast", "ODC reader", "speedup", "limit",
            "ODC / limit", "trainer step alone", "step, readers reading", "ratio", "reads / refused while stepping",
            "load before → after"]
    s = doc["settings"]
    return (f"{s['trainers']} trainer ranks (FSDP2, gloo), {s['readers']} reader processes, `--staging "
            f"{s['staging']}`; times are the slowest reader's, median of {s['repeats']} (every reader at once); "
            f"the step is an in-place update of every shard and the publish, median of {s['steps']}.\n\n"
            + table(head, rows))


def bench_baselines_with_control(docs: list[dict[str, Any]]) -> str:
    """bench_baselines, and from a second file (an odc-bench train run with ``collective+local-sort``) how far the
    control strays from its baseline: what reordering float sums alone does to losses and parameters."""
    out = bench_baselines(docs[0])
    for doc in docs[1:]:
        control = [r for r in doc["rows"] if r["config"] == "collective+local-sort"]
        if not control:
            raise DocsError("the second file has no collective+local-sort rows")
        params = [r["dparam_baseline"] for r in control]
        losses = [r["dloss"] for r in control]
        out += ("\n\nFor scale, the control of the second file below: `collective+local-sort` (FSDP2's own "
                "collectives, the same samples, only packed one per microbatch) differs from `collective+lb-micro` "
                f"by {min(params):.1e}–{max(params):.1e} in final parameters and up to {max(losses):.1e} in loss "
                f"over minibatch sizes {', '.join(str(r['minibatch_size']) for r in control)}: what reordering float "
                f"sums alone does through {doc['args']['minibatches']} AdamW steps.")
    return out


def bench_memory_fits(docs: list[dict[str, Any]]) -> str:
    """Several odc-bench memory --formula runs: each configuration's bytes per rank, and whether they fit 80 GB."""
    limit = 80e9
    labels = ["FSDP2 full", "verl-maxcount", "dummy-pad", "fsdp2-accum", "ODC full"]
    head = ["per rank (excl. activations)"]
    cols = []
    for d in docs:
        a = d["args"]
        head.append(f"{d['params'] / 1e9:g}B, D = {a['world']}")
        cols.append({r["label"]: r for r in d["rows"]})
    body = []
    for label in labels:
        row = [label]
        for c in cols:
            t = c[label]["total"]
            row.append(f"{t / 1e9:.1f} GB {'fits' if t <= limit else '**does not fit**'}")
        body.append(row)
    a = docs[0]["args"]
    return (f"By formula, not measured: {a['param_dtype']} parameters and gradients, {a['optim_bytes']} bytes of "
            f"optimizer state per parameter (f32 Adam moments), gathers in {a['gather_dtype']}; the working set of a "
            f"ZeRO-3 step (two layers' parameters, one layer's gradients) included; activations left out (the same "
            f"in every row). *fits*: at most {limit / 1e9:.0f} GB (an 80 GB GPU, nothing left for activations).\n\n"
            + table(head, body))


def bench_elastic(doc: dict[str, Any]) -> str:
    """scripts/elastic-bench.py: time per minibatch of hybrid sharding with and without elastic=True, alternated."""
    a = doc["args"]
    out = [[str(i), f"{r['hybrid']:.2f}", f"{r['elastic']:.2f}", f"{r['elastic'] - r['hybrid']:.2f}",
            f"{r['ratio']:.2f}"] for i, r in enumerate(doc["rows"])]
    return (f"{a['world']} ranks as {a['world'] // a['per_node']} emulated nodes of {a['per_node']} (shared memory), "
            f"one f32 bucket of {a['numel']:,} elements, no compute, the median of {a['minibatches']} minibatches "
            "(the slowest rank's) per run:\n\n"
            + table(["pair", "ms / minibatch, hybrid", "ms / minibatch, elastic", "ms the round adds",
                     "elastic / hybrid"], out))


def bench_rejoin(doc: dict[str, Any]) -> str:
    """scripts/rejoin-bench.py: a rejoin's cost at the engine, against a checkpoint file of the same state."""
    a = doc["args"]
    out = [[f"{r['state_mb']:.0f}", f"{r['admit_s']:.3f}", f"{r['other_boundary_s'] * 1e3:.2f}",
            f"{r['rejoin_s']:.3f}", f"{r['copy_s']:.3f}", f"{r['state_mb'] * 2**20 / r['copy_s'] / 1e9:.2f}",
            f"{r['save_s']:.3f}", f"{r['load_s']:.3f}", f"{r['copy_over_ckpt']:.2f}"] for r in doc["rows"]]
    return (f"2 emulated nodes of {a['per_node']} ranks (`{a['transport']}`), node 1 joining node 0's running job "
            f"({a['compute_ms']:g} ms of compute per minibatch); the state per rank: a parameter shard, two f32 "
            "moments and a step count. *admit*: the members' boundary that let node 1 in (the slowest member); "
            "*other*: the median of their other boundaries; *rejoin*: the joiner's call, from its start (asking "
            "and waiting for the boundary included); *copy*: its one-sided read of the state (and its rate, GB = "
            "10⁹ B); *save*, *load*: the same state through `torch.save` (with `fsync`) and `torch.load` (page "
            "cache) on the joiner, after the run:\n\n"
            + table(["MiB per rank", "admit s", "other ms", "rejoin s", "copy s", "copy GB/s", "save s", "load s",
                     "copy / (save + load)"], out))


def _span(values: list[float], digits: int = 3) -> str:
    """``min–max`` of ``values`` (one value when they are equal at ``digits``)."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def _by_transport(rows: list[dict[str, Any]], series: str) -> list[tuple[str, list[dict[str, Any]]]]:
    return [(t, got) for t in ("shm", "mixed")
            if (got := [r for r in rows if r["series"] == series and r["case"]["transport"] == t])]


def bench_elastic_drop(doc: dict[str, Any]) -> str:
    """scripts/elastic-timings.py: from a death to the survivors' return from the minibatch that dropped its node."""
    what = {"random": "a random rank killed at a random point of a random minibatch (`test_random_kill_points`)",
            "whole node": "a whole node killed at once (`test_a_whole_node_killed_at_once_is_dropped`)"}
    out = []
    for series, text in what.items():
        for transport, rows in _by_transport(doc["drop"], series):
            times = [t for r in rows for t in r["death_to_step_s"]]
            out.append([text, f"`{transport}`", str(len(rows)), _span(times)])
    return (f"{doc['world']} ranks as {doc['world'] // doc['per_node']} emulated nodes of {doc['per_node']} "
            "(`shm`: shared memory between the nodes too; `mixed`: libfabric `tcp` between them), each run checked "
            "as its test checks it (every sum exact over its minibatch's members, the replicas bitwise equal):\n\n"
            + table(["kill", "transport", "runs", "death → each survivor's return from that minibatch, s"], out))


def bench_elastic_rejoin(doc: dict[str, Any]) -> str:
    """scripts/elastic-timings.py: a restarted node's rejoin, the members' boundary that admits it and the joiner's
    wait."""
    what = {"one kill": "rank 3 killed in minibatch 1, its node restarted (`test_a_restarted_node_rejoins_...`)",
            "random": "a random kill, its node restarted at once (`test_random_kills_and_rejoins`)"}
    out = []
    for series, text in what.items():
        for transport, rows in _by_transport(doc["rejoin"], series):
            back = sorted({r["back"] - r["drop"] for r in rows})
            out.append([text, f"`{transport}`", str(len(rows)), _span([t for r in rows for t in r["admit_s"]]),
                        f"{max(r['other_boundary_max_s'] for r in rows):.4f}",
                        _span([t for r in rows for t in r["joiner_s"]]), ", ".join(map(str, back))])
    return (f"{doc['world']} ranks as {doc['world'] // doc['per_node']} emulated nodes of {doc['per_node']}, a "
            "4 KB state per rank (a parameter shard, a momentum, a step count), each run checked as its test "
            "checks it (every sum exact over its minibatch's members, the copy bitwise its source's, the rejoined "
            "replica equal to the others after every later step). *admit*: each member's boundary that built the "
            "new generation and served the copy; *other*: the longest of the members' other boundaries; *joiner*: "
            "each joiner's `rejoin` call (asking, the members' step, registration and copy); *back*: minibatches "
            "from the drop to the first the node ran again:\n\n"
            + table(["kill", "transport", "runs", "admit s", "other boundaries, at most s", "joiner s", "back after"],
                    out))


def bench_scale_compare(doc: dict[str, Any]) -> str:
    """scripts/scale-compare.py: scale_perf's time per minibatch against a baseline commit's, alternated."""
    out = [[str(r["ranks"]), str(r["pair"]), f"{r['base_s'] * 1e3:.1f}", f"{r['base_cpu_s'] * 1e3:.1f}",
            f"{r['head_s'] * 1e3:.1f}", f"{r['head_cpu_s'] * 1e3:.1f}", f"{r['ratio']:.3f}"] for r in doc["rows"]]
    base = doc["base_commit"]
    return (f"`scale_perf --transport mixed`, full sharding, nodes of {doc['node_ranks']}, one f32 bucket of "
            f"{_size(doc['bucket_bytes'])}, the median of {doc['minibatches']} minibatches (the slowest rank's; CPU: "
            f"the mean rank's per minibatch), every element exact; `{base}` and this commit alternated:\n\n"
            + table(["ranks", "pair", f"ms, {base}", f"CPU ms, {base}", "ms, this", "CPU ms, this",
                     f"this / {base}"], out))


BENCHES: dict[str, Callable[[dict[str, Any]], str]] = {
    "primitives": bench_primitives,
    "perf": bench_perf,
    "train": bench_train,
    "train-steal": bench_train_steal,
    "train-curves": bench_train_curves,
    "imbalance": bench_imbalance,
    "imbalance-bubbles": bench_imbalance_bubbles,
    "hybrid": bench_hybrid,
    "elastic": bench_elastic,
    "elastic-drop": bench_elastic_drop,
    "elastic-rejoin": bench_elastic_rejoin,
    "rejoin": bench_rejoin,
    "cross-node": bench_cross_node,
    "cross-node-compress": bench_cross_node_compress,
    "train-curves-compress": bench_train_curves_compress,
    "memory": bench_memory,
    "scale": bench_scale,
    "scale-compare": bench_scale_compare,
    "train-baselines": bench_baselines,
    "trainer": bench_trainer,
    "weights": bench_weights,
}
# Kinds that render several files as one table.
MULTI: dict[str, Callable[[list[dict[str, Any]]], str]] = {"memory-fits": bench_memory_fits,
                                                            "train-baselines-control": bench_baselines_with_control}


def read_json(rel: str, docs: Path = DOCS) -> dict[str, Any]:
    """A committed benchmark file, relative to docs/ (in one of the folders whose every file the provenance check
    reads)."""
    path = docs / rel
    if Path(rel).parent.as_posix() not in prov.DATA:
        raise DocsError(f"docs/{rel}: benchmark data lives in docs/{' or docs/'.join(prov.DATA)}/ (where the "
                        "provenance check reads every file)")
    if not path.is_file():
        raise DocsError(f"docs/{rel}: no such file")
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


def bench(kind: str, rel: str | list[str], page_dir: str, docs: Path = DOCS) -> str:
    """One benchmark table and its provenance line (one per file); links relative to the page's folder."""
    rels = [rel] if isinstance(rel, str) else list(rel)
    if kind not in BENCHES and kind not in MULTI:
        raise DocsError(f"unknown benchmark kind {kind!r} (known: {', '.join([*BENCHES, *MULTI])})")
    if kind in BENCHES and len(rels) != 1:
        raise DocsError(f"benchmark kind {kind!r} renders one file, got {len(rels)}")
    pending = [r for r in rels if r in prov.PENDING and not (docs / r).exists()]
    if pending:  # listed by the provenance check too, so the strict build fails until the run is made
        return "\n\n".join(f"*Not measured yet: `{prov.PENDING[r][0]}` writes `docs/{r}`, this table's data.*"
                             for r in pending)
    loaded = [read_json(r, docs) for r in rels]
    try:
        body = MULTI[kind](loaded) if kind in MULTI else BENCHES[kind](loaded[0])
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, statistics.StatisticsError) as e:
        raise DocsError(f"docs/{', docs/'.join(rels)}: cannot render as {kind}: {type(e).__name__}: {e}") from None
    lines = [provenance(d, r, os.path.relpath(r, page_dir or ".")) for d, r in zip(loaded, rels, strict=True)]
    return body + "\n\n" + "\n".join(lines)


def render(markdown: str, page_path: str, docs: Path = DOCS) -> str:
    """Every marker of a page replaced by its part; ``page_path`` is the page's path relative to ``docs``."""
    page_dir = os.path.dirname(page_path)

    def one(m: re.Match[str]) -> str:
        kind, args = m.group(1), m.group(2).split()
        if kind == "env" and not args:
            return env_tables()
        if kind == "error-tree" and not args:
            return error_tree()
        if kind == "exceptions" and args:
            return exceptions(args)
        if kind == "quickstart" and len(args) == 1:
            return quickstart(args[0])
        if kind == "bench" and len(args) >= 2:
            return bench(args[0], args[1] if len(args) == 2 else args[1:], page_dir, docs)
        raise DocsError(f"{page_path}: cannot read the marker {m.group(0)!r}")

    return MARKER.sub(one, markdown)


# -- mkdocs --------------------------------------------------------------------------------------------------


def on_pre_build(config: Any) -> None:
    """mkdocs' hook, before any page: the provenance check of every benchmark file, each failure a warning (the
    strict build then fails, listing every file to rerun and the pages' own problems alike)."""
    import logging

    from mkdocs.exceptions import PluginError

    try:
        problems = provenance_problems()
    except DocsError as e:
        raise PluginError(str(e)) from None
    if problems:
        logging.getLogger("mkdocs.plugins.odc").warning("docs: %s", problems)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: renders the page's markers; an error stops the build, naming the page."""
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown, page.file.src_uri, Path(config["docs_dir"]))
    except DocsError as e:
        raise PluginError(str(e)) from None


# -- the README's measured results ---------------------------------------------------------------------------


def _load_avg(doc: dict[str, Any]) -> str:
    """The highest 1-minute load average sampled during a run (older files: the one at its end), against the
    machine's cores."""
    samples, cpus = prov.load_samples(doc)
    if len(samples) >= 2:
        return f"{max(samples):.1f} at most" + (f" on {cpus} cores" if cpus else "")
    load, cpus = doc.get("load_average"), doc.get("cpus")
    if not isinstance(load, list) or not load:
        return "–"
    return f"{load[0]:.1f} at the end" + (f" on {cpus} cores" if cpus else "")


def readme_results(read: Callable[[str], dict[str, Any]] = read_json) -> str:
    """The README's measured-results table: each row a headline figure from a committed JSON (``read`` from
    docs/), linked to its page."""
    def rows_of(doc: dict[str, Any], config: str) -> list[dict[str, Any]]:
        rows = [r for r in doc["rows"] if r["config"] == config]
        if not rows:
            raise DocsError(f"no {config} row")
        return rows

    site = "docs/benchmarks"
    out: list[list[str]] = []
    peak = read("bench/imbalance-8ranks-peak.json")
    r = max(rows_of(peak, "odc+lb-mini"), key=lambda x: x["speedup_predicted"])
    out.append([f"emulated compute, {r['world']} ranks, minibatch size {r['minibatch_size']}: ODC + LB-Mini, measured "
                "/ predicted", f"{r['speedup_measured']:.2f}× / {r['speedup_predicted']:.2f}×", _load_avg(peak),
                f"[imbalance]({site}/imbalance.md#where-the-prediction-peaks)"])
    steal = read("bench/imbalance-steal-straggler.json")
    plain, stolen = rows_of(steal, "odc+lb-mini")[0], rows_of(steal, "odc+lb-mini+steal")[0]
    out.append([f"one rank 1.5× slower, {stolen['world']} ranks (emulated): bubble without → with work stealing",
                f"{_pct(plain['bubble_measured'])} → {_pct(stolen['bubble_measured'])}", _load_avg(steal),
                f"[imbalance]({site}/imbalance.md#work-stealing)"])
    train = read("bench/train.json")
    sp = [r["speedup_measured"] for r in rows_of(train, "odc+lb-mini")]
    out.append(["real training (FSDP2, 2 CPU ranks, tiny Qwen2): ODC + LB-Mini against FSDP2's gloo collectives "
                "+ LB-Micro", f"{min(sp):.2f}–{max(sp):.2f}× per minibatch", _load_avg(train),
                f"[real training]({site}/train.md#odc-bench-train)"])
    base = read("bench/train-baselines.json")
    without = [p for p in base["pairs"] if p["other"] in ("verl-maxcount", "dummy-pad", "fsdp2-accum")]
    # The strongest baseline: the one ODC + LB-Mini beats by the least (over the minibatch sizes, the median).
    best = min({p["other"] for p in without},
               key=lambda o: statistics.median(p["measured"] for p in without if p["other"] == o))
    ratios = [p["measured"] for p in without if p["other"] == best]
    out.append([f"real training (2 CPU ranks): ODC + LB-Mini against the strongest baseline without ODC, `{best}` "
                "(of verl-maxcount, dummy-pad, fsdp2-accum)", f"{min(ratios):.2f}–{max(ratios):.2f}× per minibatch",
                _load_avg(base),
                f"[baselines]({site}/baselines.md)"])
    curves_doc = read("bench/train-curves.json")
    curves = curves_doc["curves"]
    d = curves["max_abs_loss_diff"]["odc+lb-mini"]
    out.append([f"loss over {len(curves['losses']['odc+lb-mini'])} minibatches, ODC + LB-Mini against the same "
                "samples over gloo", f"within {d:.1e}", _load_avg(curves_doc),
                f"[real training]({site}/train.md#convergence)"])
    prim = read("bench/primitives.json")
    for op, what in (("all_gather_in_place", "gather in place (FSDP's case)"),
                     ("reduce_scatter", "scatter-accumulate")):
        big = max((x for x in prim["rows"] if x["op"] == op), key=lambda x: x["size"])
        out.append([f"{what} against gloo, {_size(big['size'])}, {big['world']} ranks on one host",
                    f"{big['busbw_ratio']:.1f}× busbw", _load_avg(prim), f"[collectives vs ODC]({site}/primitives.md)"])
    hyb = read("bench/hybrid.json")
    modes = {m[0]: m for m in hyb["rows"]}
    if "odc-hybrid-zero" in modes and "odc-full" in modes:
        hz, full = modes["odc-hybrid-zero"], modes["odc-full"]
        out.append(["cross-node bytes per rank, `hybrid-zero` against `full` sharding, 2 network namespaces",
                    f"{hz[2] / full[2]:.2f}× (measured on the veth)", _load_avg(hyb), f"[hybrid]({site}/hybrid.md)"])
    scale = read("scale/shm-full.json")
    top = max(scale["points"], key=lambda p: p["ranks"])
    out.append([f"{top['ranks']} processes on one host: a killed rank named by every survivor",
                f"in {top['detect_s']:.2f} s", "–", f"[number of ranks]({site}/scale.md)"])
    return table(["what", "measured", "load average", "details"], out)


def front_files() -> dict[str, str]:
    """The benchmark files shown first (relative to docs/) and where: the README's first measured-results row, and
    the JSON behind each figure of the README and the front page."""
    read: list[str] = []

    def record(rel: str) -> dict[str, Any]:
        read.append(rel)
        return read_json(rel)

    readme_results(record)
    # The first row is what a reader sees first (the rows after it state their runs' load).
    out = dict.fromkeys(read[:1], "the first row of README.md's measured results")
    for png, page in prov.front_figures(ROOT).items():
        for src in prov.FIGURES.get(png, ((), None))[0]:
            out.setdefault(src, f"the figure docs/{png} on {page}")
    return out


def provenance_problems() -> str:
    """What the provenance check finds, as ``make docs`` prints it ("" when every file passes)."""
    items = prov.stale(front_files())
    figures = prov.figure_problems()
    parts = ([prov.report(items)] if items else []) + figures
    return "\n".join(parts)


def _readme_block() -> tuple[str, str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- results:begin -->\n", "<!-- results:end -->"
    if begin not in text or end not in text:
        raise DocsError("README.md has no <!-- results:begin --> ... <!-- results:end --> block")
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    return head + begin, block, end + tail


def main(argv: list[str]) -> int:
    """``--readme``: print the README's results table; ``--check-readme``: fail when a benchmark file fails the
    provenance check or the README's table differs; ``--check-provenance``: the provenance check alone;
    ``--stale``: the files that fail it, as lines of REL, estimated seconds and the command that rewrites it;
    ``--redraw REL...``: the commands that redraw the figures drawn from those files by a command of their own."""
    if argv == ["--readme"]:
        print(readme_results())
        return 0
    if argv in (["--check-provenance"], ["--check-readme"]):
        problems = provenance_problems()
        if problems:
            print(f"docs: {problems}\nAfter the reruns: python3 scripts/docs_hooks.py --write-readme, then commit "
                  "the JSON and figures.", file=sys.stderr)
            return 1
        if argv == ["--check-provenance"]:
            print("docs: every benchmark file names the clean commit and command that made it, and the files "
                  "shown first ran below the core count's load")
            return 0
    if argv == ["--stale"]:
        print(prov.tsv(prov.stale(front_files())), end="")
        return 0
    if argv[:1] == ["--redraw"]:
        print("".join(f"{cmd}\n" for cmd in prov.redraw_commands([a.removeprefix("docs/") for a in argv[1:]])), end="")
        return 0
    if argv == ["--check-readme"]:
        _, block, _ = _readme_block()
        want = readme_results() + "\n"
        if block != want:
            print("docs: README.md's measured results differ from the committed JSON; regenerate the block with\n"
                  "    python3 scripts/docs_hooks.py --write-readme\n"
                  f"expected:\n{want}", file=sys.stderr)
            return 1
        text = (ROOT / "README.md").read_text(encoding="utf-8")
        dead = [t for t in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text) if not (ROOT / t).exists()]
        if dead:
            print(f"docs: README.md links to files that do not exist: {', '.join(dead)}", file=sys.stderr)
            return 1
        print("docs: README.md's measured results match the committed JSON, and its links reach files")
        return 0
    if argv == ["--write-readme"]:
        head, _, tail = _readme_block()
        (ROOT / "README.md").write_text(head + readme_results() + "\n" + tail, encoding="utf-8")
        return 0
    print("usage: scripts/docs_hooks.py --readme | --check-readme | --write-readme | --check-provenance | --stale | "
          "--redraw REL...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
