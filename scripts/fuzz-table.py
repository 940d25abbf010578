#!/usr/bin/env python3
"""Renders fuzz/campaigns.json (written by `scripts/fuzz.sh --record`) as the campaign table of docs/fuzzing.md,
between its `<!-- campaigns -->` and `<!-- /campaigns -->` lines, so that no figure there is typed by hand.

    scripts/fuzz-table.py            # rewrites the table in docs/fuzzing.md
    scripts/fuzz-table.py --check    # exits 1 when the page's table is not the JSON's
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA, PAGE = ROOT / "fuzz" / "campaigns.json", ROOT / "docs" / "fuzzing.md"
BEGIN, END = "<!-- campaigns -->", "<!-- /campaigns -->"


def table() -> str:
    rows = json.loads(DATA.read_text())["campaigns"]
    out = [
        "| target | seconds | executions | executions/s | coverage | corpus | crashes | slowest input | peak RSS "
        "| commit | date |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rate = r["executions"] / max(r["seconds"], 1)
        # libFuzzer counts the slowest input in whole seconds.
        slowest = r.get("slowest_input_s", "?")
        slowest = "< 1" if slowest == 0 else slowest
        # libFuzzer's coverage: edges ("cov") / features ("ft"); not recorded before the field existed.
        cov = f"{r['coverage']:,} / {r['features']:,}" if "coverage" in r else "–"
        out.append(
            f"| `{r['target']}` | {r['seconds']} | {r['executions']:,} | {rate:,.0f} | {cov} | {r['corpus_size']} "
            f"| {r['crashes']} | {slowest} s | {r.get('peak_rss_mb', '?')} MB "
            f"| {r['commit']} | {r['date'][:10]} |"
        )
    commands = sorted({r["command"] for r in rows})
    out.append("")
    out.append("Command: " + "; ".join(f"`{c}`" for c in commands) + " (from `fuzz/campaigns.json`).")
    return "\n".join(out)


def main() -> int:
    page = PAGE.read_text()
    head, rest = page.split(BEGIN + "\n", 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--check" in sys.argv[1:]:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)}: the campaign table differs from {DATA.relative_to(ROOT)}; "
                  "run scripts/fuzz-table.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
