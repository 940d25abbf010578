#!/usr/bin/env python3
"""Prints odc-core's and odc.fsdp's module dependency edges and fails on a cycle or an arrow that points up.

An edge A -> B means a file of top-level module A names `crate::B` (in a `use` or a path).
The layers are DESIGN.md's, bottom first; an arrow must point to the same layer or a lower
one, `client` and `server` must not use each other, and the graph must have no cycle.
The same holds for the modules of the Python package `odc.fsdp` (an edge: `from .B import`,
including imports for the type checker only), whose layers follow its module doc.

    scripts/module-graph.py            # edges, then "ok" or the offending edges/cycles (exit 1)
    scripts/module-graph.py --dot      # the graph in Graphviz form
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "odc-core" / "src"

LAYERS = [
    {"error", "sync", "topology", "layout", "store", "control", "region", "protocol", "wait", "elastic"},
    {"transport", "plane", "gpu"},
    {"engine"},
    {"client", "server", "weights"},
    {"api", "fuzzing"},
]
FORBIDDEN = {("client", "server"), ("server", "client")}
SKIP = {"lib", "engine_tests", "loom_model"}  # the crate root and test-only modules

FSDP = Path(__file__).resolve().parents[1] / "odc-py" / "python" / "odc" / "fsdp"
# odc.fsdp, bottom first: FSDP2's private state and the transport choice; the minibatch state machine; the
# gradient contract on it; the binding (hooks) on that; the seams, the clip, work stealing and global sums; FSDP1
# (which reuses FSDP2's seam helpers); enable's first two steps (the model described, the engine made); the
# public API.
FSDP_LAYERS = [
    {"_private", "_transport"},
    {"_state"},
    {"_grads"},
    {"_binding"},
    {"_seams", "_clip", "_steal", "_sum"},
    {"_fsdp1"},
    {"_model", "_engine"},
    {"__init__"},
]


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.rs")):
        src = module_of(path)
        if src in SKIP:
            continue
        text = strip_comments(path.read_text())
        # Stop at an in-file test module: tests may reach anywhere.
        text = re.split(r"#\[cfg\((?:all\()?test", text, maxsplit=1)[0]
        targets = set(re.findall(r"\bcrate::(\w+)", text))
        targets |= {m for group in re.findall(r"\bcrate::\{([^}]*)\}", text) for m in re.findall(r"\b(\w+)", group)}
        for dst in sorted(targets):
            if dst == src or dst in SKIP or (not (SRC / f"{dst}.rs").exists() and not (SRC / dst).is_dir()):
                continue
            found.setdefault((src, dst), []).append(str(path.relative_to(SRC.parent)))
    return found


def fsdp_edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(FSDP.glob("*.py")):
        src = path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                dst = node.module.split(".")[0]
                found.setdefault((src, dst), []).append(str(path.relative_to(FSDP.parents[2])))
    return found


def layer(module: str, layers: list[set[str]] = LAYERS) -> int:
    for i, names in enumerate(layers):
        if module in names:
            return i
    raise SystemExit(f"module-graph: module {module!r} is in no layer; add it to its layers")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    out, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                out.append([*stack[stack.index(m):], m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return out


def check(what: str, found: dict[tuple[str, str], list[str]], layers: list[set[str]]) -> int:
    graph: dict[str, set[str]] = {}
    for a, b in found:
        graph.setdefault(a, set()).add(b)
    bad = []
    for (a, b), files in sorted(found.items()):
        up = layer(b, layers) > layer(a, layers)
        mark = "  UP" if up else ("  FORBIDDEN" if (a, b) in FORBIDDEN else "")
        print(f"{a} -> {b}{mark}")
        if up or (a, b) in FORBIDDEN:
            bad.append(f"{a} -> {b} ({', '.join(sorted(set(files)))})")
    for c in cycles(graph):
        bad.append("cycle: " + " -> ".join(c))
    if bad:
        print(f"module-graph: {what}'s module arrows must point down the layers, without cycles:", file=sys.stderr)
        for b in bad:
            print(f"  {b}", file=sys.stderr)
        return 1
    print(f"ok: {what}: {len(found)} edges between {len(graph)} modules, no cycle, none upward")
    return 0


def main() -> int:
    found = edges()
    if "--dot" in sys.argv:
        print("digraph odc_core {")
        for a, b in sorted(found):
            print(f"  {a} -> {b};")
        print("}")
        return 0
    return check("odc-core", found, LAYERS) | check("odc.fsdp", fsdp_edges(), FSDP_LAYERS)


if __name__ == "__main__":
    sys.exit(main())
