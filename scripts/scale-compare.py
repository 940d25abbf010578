#!/usr/bin/env python3
"""Time per minibatch of two `scale_perf` builds, alternated in one sitting: a baseline commit's and this tree's.

    scripts/scale-compare.py --base BIN --base-commit REV [--head BIN] --ranks 32,128 --pairs 3 --json OUT

Each pair runs both binaries once per world size (odd pairs the baseline first, even pairs this tree first, so
that the machine's load hits both alike) as `BIN --ranks D --transport mixed --no-kill --idle-s 0.2
--steal-items 0 --minibatches 10` (nodes of 8, full sharding, one 1 MiB bucket; every gathered element and sum
checked exactly by the binary). Reports each run's slowest-rank median minibatch and the mean rank's CPU per
minibatch, and head / base per pair. Build the baseline in a worktree of its own, e.g.
`git worktree add /tmp/base REV && (cd /tmp/base && CARGO_TARGET_DIR=/tmp/base-target cargo build --release -p
odc-benches --features odc-benches/fabric --bin scale_perf)`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(binary: str, ranks: int, minibatches: int) -> dict[str, Any]:
    """One scale_perf run at `ranks`; its point."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        cmd = [binary, "--ranks", str(ranks), "--transport", "mixed", "--no-kill", "--idle-s", "0.2",
               "--steal-items", "0", "--minibatches", str(minibatches), "-J", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            sys.exit(f"scale-compare: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        point: dict[str, Any] = json.loads(out.read_text())["points"][0]
    if point.get("wrong", 1) != 0:
        sys.exit(f"scale-compare: {binary} at {ranks} ranks got {point.get('wrong')} wrong elements")
    return point


def report() -> Any:
    """odc.bench.report, the benchmarks' provenance writer, loaded by path: this script needs neither torch nor
    odc's native module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_odc_bench_report", ROOT / "odc-py/python/odc/bench/report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the baseline's scale_perf binary")
    ap.add_argument("--base-commit", required=True, help="the commit it was built from (for the record)")
    ap.add_argument("--head", default=str(ROOT / "target/release/scale_perf"), help="this tree's (release build)")
    ap.add_argument("--ranks", default="32,128")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=10)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    rep = report()
    rep.set_command(["scripts/scale-compare.py", *argv])
    rep.sample_load()  # the load average while the run lasts, for the JSON's provenance
    rows = []
    for d in (int(x) for x in a.ranks.split(",")):
        for pair in range(a.pairs):
            order = [("base", a.base), ("head", a.head)]
            if pair % 2:
                order.reverse()
            got = {side: run(binary, d, a.minibatches) for side, binary in order}
            row = {"ranks": d, "pair": pair,
                   **{f"{side}_s": got[side]["minibatch_s"] for side in ("base", "head")},
                   **{f"{side}_cpu_s": got[side]["minibatch_cpu_s"] for side in ("base", "head")},
                   "ratio": got["head"]["minibatch_s"] / got["base"]["minibatch_s"],
                   "fetched": got["head"].get("cache_fetched"), "node_hits": got["head"].get("cache_hits")}
            rows.append(row)
            print(f"D={d} pair {pair}: base {row['base_s']:.4f} s ({row['base_cpu_s'] * 1e3:.1f} ms cpu), "
                  f"head {row['head_s']:.4f} s ({row['head_cpu_s'] * 1e3:.1f} ms cpu): {row['ratio']:.3f}",
                  flush=True)
    doc = {"bench": "scale-compare", "base_commit": a.base_commit, "node_ranks": 8, "bucket_bytes": 1 << 20,
           "minibatches": a.minibatches, "rows": rows, "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
           "provenance": rep.provenance()}
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
