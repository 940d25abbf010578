"""A griffe extension for the docs site (mkdocs.yml names it): Sphinx roles in docstrings become links.

The package's docstrings are Google style with Sphinx roles (``:class:`Engine```, ``:func:`odc.fsdp.enable```,
``:meth:`finish_minibatch```), which mkdocstrings would show as they are typed. This rewrites each role,
once the package is loaded:

- to a cross-reference ``[`Engine`][odc.engine.Engine]`` when its target resolves (from the docstring's own
  scope outwards, or as a full ``odc.`` path) to an object the API pages render: public, with a docstring,
  under the path the pages show it (a class defined in a private module and exported by a public one is shown
  under the public one);
- to plain code (```Engine```) otherwise: a private helper, an attribute without a docstring, a name of torch.

A cross-reference that mkdocs then cannot find fails the strict build, so a link here is never dead.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in path.split("."))


def _target(obj: Any) -> Any:
    try:
        return obj.final_target if obj.is_alias else obj
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles into mkdocstrings cross-references (or code) after the package is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, str] = {}  # the path an object is defined at -> the path the API pages show it at

    def _collect(self, mod: Any, aliases: bool) -> None:
        """Which objects the pages render, and under which path: public modules and their public members with a
        docstring (first pass), then what their ``__all__`` re-exports from elsewhere (second pass: a class of a
        private module shows under the public module that exports it). ``odc`` itself renders only its own
        functions."""
        exports = set(mod.exports or ())
        for name, member in mod.members.items():
            if name.startswith("_"):
                continue
            if member.is_alias:  # an imported name: only what __all__ re-exports, and not from odc itself
                if not aliases or name not in exports or mod.path == "odc":
                    continue
                target = _target(member)
                if target is None or target.is_module or not target.docstring:
                    continue
            else:
                if member.is_module:
                    if member.docstring:
                        self.shown.setdefault(member.path, member.path)
                        self._collect(member, aliases)
                    continue
                if aliases or not member.docstring:
                    continue
                target = member
            public = f"{mod.path}.{name}"
            if target.path in self.shown:
                continue
            self.shown[target.path] = public
            if target.is_class:
                self._collect_class(target, public)

    def _collect_class(self, cls: Any, public: str) -> None:
        for name, member in cls.members.items():
            if name.startswith("_") or member.is_alias or not member.docstring:
                continue
            self.shown.setdefault(member.path, f"{public}.{name}")
            if member.is_class:
                self._collect_class(member, f"{public}.{name}")

    def _resolve(self, scope: Any, name: str) -> Any:
        """The object ``name`` names from ``scope``: a full ``odc.`` path, else looked up from the scope out."""
        parts = name.split(".")
        starts = []
        if parts[0] == "odc":
            starts.append((self.pkg, parts[1:]))
        else:
            s = scope
            while s is not None:
                if parts[0] in s.members:
                    starts.append((s.members[parts[0]], parts[1:]))
                    break
                s = s.parent
        for start, rest in starts:
            found = _target(start)
            for part in rest:
                if found is None or part not in found.members:
                    found = None
                    break
                found = _target(found.members[part])
            if found is not None:
                return found
        return None

    def _rewrite(self, obj: Any) -> None:
        if obj.docstring is None:
            return
        scope = obj if (obj.is_class or obj.is_module) else obj.parent

        def one(m: re.Match[str]) -> str:
            short, name = m.group(2), m.group(3).strip()
            shown = name.rsplit(".", 1)[-1] if short else name
            target = None if name.startswith(".") else self._resolve(scope, name)
            if m.group(1) in ("func", "meth") and not shown.endswith(")"):
                shown += "()"
            if target is not None and target.path in self.shown:
                return f"[`{shown}`][{self.shown[target.path]}]"
            return f"`{shown}`"

        obj.docstring.value = ROLE.sub(one, obj.docstring.value)

    def _walk(self, obj: Any) -> None:
        self._rewrite(obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member)

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        """Once ``odc`` is loaded: collect what the pages render, then rewrite every docstring's roles."""
        if pkg.name != "odc":
            return
        self.pkg = pkg
        self.shown = {"odc": "odc"}
        for name in ("probe", "register"):
            self.shown[f"odc.{name}"] = f"odc.{name}"
        self._collect(pkg, aliases=False)
        self._collect(pkg, aliases=True)
        self._walk(pkg)
