#!/usr/bin/env python3
"""Checks that the table of environment variables (odc-py/python/odc/_env.py) is the set ODC's code reads.

The rule: a name ODC reads is every string literal that is exactly ``ODC_[A-Z0-9_]+`` in a Rust or Python
file git tracks (the crates odc-core, odc-kernels, packing, odc-py with its package and its tests, the
cross-crate tests and benchmarks, scripts, examples), outside comments and docstrings. A literal counts
whether ``std::env::var`` / ``os.environ`` takes it directly or through a constant or a helper
(``pub const ISA_ENV: &str = "ODC_KERNELS_ISA"``, ``env("ODC_CRASH_AT", ..)``); a name only set for a child
process counts too, since the child reads it. Names inside longer strings (error messages, shell snippets)
are not reads. The table's own file is not scanned.

Fails, naming each one, when a name read is missing from the table or the table names one nothing reads.
Run by ``make lint`` (no dependencies: it parses the table, it does not import odc).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = Path("odc-py/python/odc/_env.py")
NAME = re.compile(r"ODC_[A-Z0-9_]+")
RUST_LITERAL = re.compile(r'"(ODC_[A-Z0-9_]+)"')


def table_names() -> dict[str, int]:
    """The names the table lists, with the line of each (read from the source: no import)."""
    tree = ast.parse((ROOT / TABLE).read_text(encoding="utf-8"))
    names: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "EnvVar" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                if first.value in names:
                    raise SystemExit(f"env-check: {TABLE}:{first.lineno}: {first.value} is listed twice")
                names[first.value] = first.lineno
    return names


def python_reads(path: Path, text: str) -> list[tuple[str, int]]:
    """String constants that are exactly a name; docstrings never are."""
    out = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            out.append((node.value, node.lineno))
    return out


def strip_rust_comment(line: str) -> str:
    """The line up to a ``//`` that is outside a string literal."""
    in_string = False
    i = 0
    while i < len(line):
        c = line[i]
        if in_string and c == "\\":
            i += 2
            continue
        if c == '"':
            in_string = not in_string
        elif not in_string and line.startswith("//", i):
            return line[:i]
        i += 1
    return line


def rust_reads(text: str) -> list[tuple[str, int]]:
    """``"ODC_..."`` literals outside line comments (block comments are not used in these sources)."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        out.extend((m.group(1), lineno) for m in RUST_LITERAL.finditer(strip_rust_comment(line)))
    return out


def reads() -> dict[str, list[str]]:
    """Every name read, with where (``path:line``)."""
    files = subprocess.run(["git", "ls-files", "*.rs", "*.py"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()
    found: dict[str, list[str]] = {}
    for rel in files:
        path = Path(rel)
        if path == TABLE or not (ROOT / path).is_file():
            continue
        text = (ROOT / path).read_text(encoding="utf-8")
        hits = python_reads(path, text) if path.suffix == ".py" else rust_reads(text)
        for name, lineno in hits:
            found.setdefault(name, []).append(f"{rel}:{lineno}")
    return found


def main() -> int:
    listed = table_names()
    read = reads()
    errors = []
    for name in sorted(set(read) - set(listed)):
        where = ", ".join(read[name][:3]) + (", ..." if len(read[name]) > 3 else "")
        errors.append(f"{name} is read ({where}) but missing from {TABLE}: add a row (name, default, reader, "
                      "meaning, section)")
    for name in sorted(set(listed) - set(read)):
        errors.append(f"{TABLE}:{listed[name]}: {name} is in the table but nothing reads it: remove the row")
    for e in errors:
        print(f"env-check: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"env-check: the {len(listed)} variables of {TABLE} are exactly the ones the code reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
