"""Fuzz target ``rejoin_layout``: the rejoin layout a member rank writes to the store and a joining rank reads
(``odc._rejoin.compare_layouts``), on arbitrary bytes, coverage-guided by atheris (libFuzzer for Python).

Properties: ``compare_layouts`` raises :class:`odc.MalformedError` exactly when a spelled-out reader refuses
the bytes (not UTF-8 JSON, not a list of ``[dtype, shape]`` pairs, a dtype that is not a torch dtype's
name, a shape that is not a list of at most 64 integers in ``[0, 2**63)``), naming the source rank and the
field the reader names; :class:`odc.ConfigError` exactly for a well-formed layout that differs from this
rank's, naming the source rank; nothing for an equal one; never any other exception.

    .venv/bin/python fuzz/python/rejoin_layout.py CORPUS... -max_total_time=S   # scripts/fuzz.sh runs it

The first input byte picks this rank's layout and the source rank, the rest is what the store returned.
:func:`check` is the target's body; ``odc-py/tests/test_rejoin_layout.py`` replays the committed corpus and
regressions through it without atheris.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

#: Layouts this rank may hold (what ``_rejoin.layout`` writes for some state).
MINE: list[list[list[Any]]] = [
    [],
    [["torch.float32", [4]]],
    [["torch.float32", [2, 3]], ["torch.float32", [2, 3]], ["torch.int64", []]],
    [["torch.bfloat16", [0]], ["torch.uint8", [9223372036854775807, 1]]],
]

FIELD = re.compile(r"rank (\d+) wrote a malformed rejoin state layout: (\S+) is ")


def spelled_out(raw: bytes) -> tuple[str | None, Any]:
    """The field a reader following the layout's definition refuses first (``None``: well formed), and the
    layout it read."""
    try:
        theirs = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "layout", None
    if type(theirs) is not list:
        return "layout", None
    for i, entry in enumerate(theirs):
        if type(entry) is not list or len(entry) != 2:
            return f"state[{i}]", None
        dtype, shape = entry
        if type(dtype) is not str or re.fullmatch(r"torch\.[A-Za-z_][A-Za-z0-9_]{0,31}", dtype) is None:
            return f"state[{i}].dtype", None
        if type(shape) is not list or len(shape) > 64:
            return f"state[{i}].shape", None
        for j, size in enumerate(shape):
            if type(size) is not int or size < 0 or size >= 1 << 63:
                return f"state[{i}].shape[{j}]", None
    return None, theirs


def check(data: bytes) -> None:
    """One input: raises AssertionError when a property fails (or lets an unexpected exception out)."""
    from odc import _rejoin
    from odc.errors import ConfigError, MalformedError

    if not data:
        return
    mine, source, raw = MINE[data[0] % len(MINE)], data[0] // len(MINE), data[1:]
    field, theirs = spelled_out(raw)
    raised: Exception | None = None
    try:
        _rejoin.compare_layouts(mine, raw, source)
    except (MalformedError, ConfigError) as e:
        raised = e
    if isinstance(raised, MalformedError):
        m = FIELD.match(str(raised))
        assert m is not None, f"{raw!r}: {raised}"
        assert (int(m.group(1)), m.group(2)) == (source, field), f"{raw!r}: {raised}; the reader: {field}"
    elif isinstance(raised, ConfigError):
        assert field is None and theirs != mine, f"{raw!r}: {raised}; the reader: {field}"
        assert f"rank {source}," in str(raised), str(raised)
    else:
        assert field is None and theirs == mine, f"{raw!r} accepted; the reader: {field}, {theirs!r}"


def main() -> None:
    import atheris

    # Coverage of the decoder alone (its module; json's scanner is C).
    with atheris.instrument_imports(include=["odc._rejoin"]):
        import odc._rejoin  # noqa: F401
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
