#!/usr/bin/env python3
"""Checks that every public name of the ``odc`` Python package has a docstring (100 %, no threshold).

Read statically with griffe (what the docs site's API reference reads): nothing is imported, so neither
torch nor the native core is needed. Public means:

- modules: ``odc`` and every module under it whose dotted path has no part starting with ``_``;
- in a public module: every class and function defined there whose name has no leading ``_``, and
  within such a class its methods and properties, recursively (dunder methods excepted: a class's
  docstring documents its constructor); module attributes listed in ``__all__``;
- a name that a public module's ``__all__`` re-exports from elsewhere (a private module included): the
  object it names, and for a class its public methods and properties.

Needs a docstring: each of those. Instance attributes are documented in their class's docstring
(``Attributes:``), so they are not checked one by one.

Run by ``make lint`` with the venv's python (griffe is pinned in scripts/setup.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "odc-py" / "python"

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class Checker:
    """Collects the public objects without a docstring, each once, under the path a user writes."""

    def __init__(self) -> None:
        self.missing: dict[str, str] = {}  # public path -> where it is defined
        self.seen: set[str] = set()
        self.checked = 0

    def need(self, public_path: str, obj: griffe.Object) -> None:
        if obj.path in self.seen:
            return
        self.seen.add(obj.path)
        self.checked += 1
        if not (obj.docstring and obj.docstring.value.strip()):
            where = f"{obj.relative_filepath}:{obj.lineno}" if obj.lineno else str(obj.relative_filepath)
            self.missing[public_path] = where

    def cls(self, public_path: str, c: griffe.Class) -> None:
        self.need(public_path, c)
        for name, m in c.members.items():
            if m.is_alias or _private(name) or _dunder(name):
                continue
            if m.is_function or (m.is_attribute and "property" in m.labels):
                self.need(f"{public_path}.{name}", m)
            elif m.is_class:
                self.cls(f"{public_path}.{name}", m)  # type: ignore[arg-type]

    def module(self, mod: griffe.Module) -> None:
        self.need(mod.path, mod)
        exports = set(mod.exports or ())
        for name, m in mod.members.items():
            public_path = f"{mod.path}.{name}"
            if m.is_alias:
                if name not in exports or _dunder(name):  # __version__ and the like: conventional
                    continue
                try:
                    target = m.final_target
                except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                    continue  # a name from outside odc (torch, ...): not ours to document
                if target.is_module:
                    continue
                if target.is_class:
                    self.cls(public_path, target)  # type: ignore[arg-type]
                else:
                    self.need(public_path, target)
                continue
            if _private(name) or _dunder(name):
                continue
            if m.is_module:
                self.module(m)  # type: ignore[arg-type]
            elif m.is_class:
                self.cls(public_path, m)  # type: ignore[arg-type]
            elif m.is_function or (m.is_attribute and name in exports):
                self.need(public_path, m)


def main() -> int:
    package = griffe.load("odc", search_paths=[str(SOURCES)], allow_inspection=False, resolve_aliases=True,
                          resolve_external=False)
    checker = Checker()
    checker.module(package)  # type: ignore[arg-type]
    for path in sorted(checker.missing):
        print(f"docstring-check: {checker.missing[path]}: {path} has no docstring", file=sys.stderr)
    if checker.missing:
        return 1
    print(f"docstring-check: {checker.checked} public names have docstrings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
