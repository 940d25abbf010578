#!/usr/bin/env python3
"""Times a weight reader's one-sided copy within a host (``shm``) and across 2 network namespaces (libfabric ``tcp``),
against a plain TCP stream of the same bytes between the same namespaces, in one run.

One trainer rank serves a plain f32 module of each size (``serve_weights``, shared memory and libfabric); a reader in
its namespace and then one in the other namespace each time the copy of a whole version and a read into new bf16
tensors (medians of 5, one reader at a time). Needs root (network namespaces).

    .venv/bin/python scripts/weights-remote.py [--mib 16,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "odc-py" / "tests"
sys.path.insert(0, str(TESTS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="16,256", help="f32 sizes in MiB, comma-separated")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    mib = [int(x) for x in args.mib.split(",")]
    from _netns import cluster

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d, cluster(Path(d), 2, 2) as c:
        c.start([("_weights_multinode:copy_rate", {"mib": mib})], timeout_s=60)
        outs = c.wait(600)
    bad = [o for o in outs.values() if o.status != "ok"]
    if bad:
        sys.exit("\n".join(o.describe() for o in bad))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    rows = []
    print("| f32 MiB | route | copy | GB/s | read -> bf16 | plain TCP, same bytes | GB/s | copy / TCP |")
    print("|---|---|---|---|---|---|---|---|")
    for m in mib:
        for r in (1, 2):
            row = outs[r].value[str(m)]
            rows.append({"mib": m, **row})
            gbs = row["bytes"] / row["copy_s"] / 1e9
            tcp = (f"{row['tcp_s'] * 1e3:.1f} ms | {row['bytes'] / row['tcp_s'] / 1e9:.2f} | "
                   f"{row['copy_s'] / row['tcp_s']:.2f}") if "tcp_s" in row else "— | — | —"
            print(f"| {m} | {row['route']} | {row['copy_s'] * 1e3:.1f} ms | {gbs:.2f} | {row['bf16_s'] * 1e3:.1f} ms "
                  f"| {tcp} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
