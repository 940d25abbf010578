#!/usr/bin/env python3
"""Log-log plot of `scale_perf` JSON files: one panel per figure, one line per file.

    .venv/bin/python scripts/scale-plot.py --out docs/scale.png full.json hybrid-zero.json

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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="scale_perf -J output files")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"scale-plot: needs matplotlib ({e}): make setup installs it into .venv", file=sys.stderr)
        return 2
    docs = []
    for path in args.json:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("bench") != "scale_perf":
            print(f"scale-plot: {path} is not scale_perf output", file=sys.stderr)
            return 2
        docs.append(doc)
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
