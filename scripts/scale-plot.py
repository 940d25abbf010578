#!/usr/bin/env python3
"""Log-log plot of `scale_perf` JSON files: one panel per figure, one line per file.

    .venv/bin/python scripts/scale-plot.py --out docs/scale.png full.json hybrid-zero.json
    .venv/bin/python scripts/scale-plot.py --table docs/scale/shm-full.json   # the README's table

Each line is labelled with the file's transport and sharding (or its "label", where a file has one
added by hand: a run with settings of its own) and each panel's title carries the
fitted growth exponents scale_perf wrote (slope of log figure against log D), so the plot and the
table in the README come from the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

PANELS = [
    ("register_s", "registration, slowest rank (s)"),
    ("register_cpu_s", "registration CPU per rank (s)"),
    ("store_bytes_per_rank", "store bytes read and written per rank"),
    ("rss_mib", "resident memory per rank (MiB)"),
    ("mappings", "mappings per rank"),
    ("minibatch_cpu_s", "CPU per rank per minibatch (s)"),
    ("idle_cpu_pct", "idle CPU per rank (% of a core)"),
    ("detect_s", "killed rank named by all (s)"),
    ("steal_s", "stealing phase, slowest rank (s)"),
    ("steal_rtt_ms", "steal round trip, median (ms)"),
]

# The README's table: (header, field, format); the exponent row shows the fitted exponent of each field that has one.
COLUMNS = [
    ("register s", "register_s", "{:.2f}"),
    ("register CPU ms / rank", "register_cpu_s", "ms"),
    ("store requests / rank", "store_calls_per_rank", "{:.0f}"),
    ("store KiB / rank", "store_bytes_per_rank", "kib"),
    ("RSS MiB / rank", "rss_mib", "{:.1f}"),
    ("mappings", "mappings", "{}"),
    ("fds", "fds", "{}"),
    ("/dev/shm MiB / rank", "shm_mib_per_rank", "{:.2f}"),
    ("minibatch s", "minibatch_s", "{:.3f}"),
    ("CPU ms / rank / minibatch", "minibatch_cpu_s", "ms"),
    ("idle % of a core", "idle_cpu_pct", "{:.3f}"),
]


def _cell(point: dict, field: str, fmt: str) -> str:
    v = point.get(field)
    if v is None:
        return ""
    if fmt == "ms":
        return f"{v * 1e3:.1f}"
    if fmt == "kib":
        return f"{v / 1024:.1f}"
    return fmt.format(v)


def table(doc: dict) -> str:
    """A markdown table of one scale_perf run: a row per world size, then the fitted exponents."""
    head = ["D"] + [h for h, _, _ in COLUMNS]
    head += ["stolen / list", "stealing s", "steal round trip ms", "killed rank named s (last / median)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in doc["points"]:
        row = [str(p["ranks"])] + [_cell(p, f, fmt) for _, f, fmt in COLUMNS]
        stolen = f"{p['stolen']} / {p['steal_items']}" if "stolen" in p else ""
        row += [stolen, _cell(p, "steal_s", "{:.3f}"), _cell(p, "steal_rtt_ms", "{:.3f}")]
        named = f"{p['named']}/{p['survivors']}" if "named" in p else ""
        row.append(f"{p['detect_s']:.2f} / {p['detect_p50_s']:.2f} ({named})" if "detect_s" in p else "")
        lines.append("| " + " | ".join(row) + " |")
    exps = doc.get("exponents", {})
    fields = [f for _, f, _ in COLUMNS] + [None, "steal_s", "steal_rtt_ms", "detect_s"]
    cells = ["" if exps.get(f) is None else f"{exps[f]:.2f}" for f in fields]
    if any(cells):  # one world size has no slope
        lines.append("| exponent | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="scale_perf -J output files")
    ap.add_argument("--out", help="the PNG to write")
    ap.add_argument("--table", action="store_true", help="print each file's markdown table instead of plotting")
    args = ap.parse_args(argv)
    if not args.table and not args.out:
        ap.error("--out PNG is needed to plot (or --table to print the tables)")
    docs = []
    for path in args.json:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("bench") != "scale_perf":
            print(f"scale-plot: {path} is not scale_perf output", file=sys.stderr)
            return 2
        docs.append(doc)
    if args.table:
        for path, doc in zip(args.json, docs, strict=True):
            print(f"{path}: {doc['transport']}, {doc['sharding']}\n")
            print(table(doc) + "\n")
        return 0
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"scale-plot: needs matplotlib ({e}): make setup installs it into .venv", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(2, 5, figsize=(20, 7.5))
    for ax, (field, title) in zip(axes.flat, PANELS, strict=True):
        slopes = []
        for doc in docs:
            pts = [(p["ranks"], p[field]) for p in doc["points"] if p.get(field)]
            if not pts:
                continue
            label = doc.get("label") or f"{doc['transport']} / {doc['sharding']}"
            ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=label)
            e = doc.get("exponents", {}).get(field)
            slopes.append("-" if e is None else f"{e:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{title}\nexponent {' / '.join(slopes)}", fontsize=9)
        ax.set_xlabel("ranks D")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("scale_perf: engine-level ranks on one 2-core host, emulated nodes of 8", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
