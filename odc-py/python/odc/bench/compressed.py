"""The compressed modes of the cross-node benchmarks (``scripts/cross-node-bench.py``, ``scripts/hybrid-bench.py``):
what a mode's name asks for, and the bytes per element their formulas count.

A compressed mode is an uncompressed one's name with the formats appended: ``<base>-<push>`` (pushes compressed),
``<base>-<gather>g`` (gathers) or ``<base>-<gather>g-<push>`` (both), e.g. ``odc-node-fp8g-int8``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["GATHER_FORMATS", "HEADER_BYTES", "PUSH_FORMATS", "mode_compress", "tolerance", "unknown_mode", "width"]

PUSH_FORMATS = ("int8", "fp8", "bf16")
"""What a pushed gradient chunk may be compressed to."""
GATHER_FORMATS = ("fp8", "bf16", "int8")
"""What a gathered parameter copy may be compressed to."""
HEADER_BYTES = 64
"""Bytes of a pushed chunk's header (odc-core's ``control::HEADER_BYTES``)."""


def mode_compress(mode: str, base: str, plain: Sequence[str], block: int) -> dict[str, Any] | None:
    """The ``compress=`` setting mode ``mode`` names: None for one of the ``plain`` (uncompressed) modes, else
    ``base`` (e.g. ``"odc-node"``) with the formats appended. Raises ValueError for a name no mode has."""
    if mode in plain:
        return None
    head, _, tail = mode.partition(base + "-")
    parts = tail.split("-") if not head and tail else []
    if not 1 <= len(parts) <= 2:
        raise ValueError(mode)
    gather = parts[0][:-1] if parts[0].endswith("g") else None
    push = parts[-1] if len(parts) == 2 or gather is None else None
    if (gather is not None and gather not in GATHER_FORMATS) or (push is not None and push not in PUSH_FORMATS) \
            or (len(parts) == 2 and gather is None):
        raise ValueError(mode)
    return {"push": push, "gather": gather, "block": block, "feedback": True}


def unknown_mode(modes: Sequence[str], base: str, plain: Sequence[str]) -> str | None:
    """The error for the first of ``modes`` that is neither one of ``plain`` nor ``base`` with compression, or None
    when every one is a mode."""
    for mode in modes:
        try:
            mode_compress(mode, base, plain, 32)
        except ValueError:
            return (f"unknown mode {mode!r}; choose from {', '.join(plain)}, or {base} with compression: "
                    f"{base}-<push>, {base}-<gather>g or {base}-<gather>g-<push> (push: {', '.join(PUSH_FORMATS)}; "
                    f"gather: {', '.join(GATHER_FORMATS)})")
    return None


def width(fmt: str | None, block: int) -> float:
    """Bytes per element of ``fmt`` (``None``: f32), its f32 scales (one per ``block`` elements) included."""
    if fmt is None:
        return 4.0
    if fmt == "bf16":
        return 2.0
    return 1.0 + 4.0 / block


def tolerance(fmt: str | None) -> float:
    """The largest relative error a value moved in ``fmt`` may carry (half a step, and some)."""
    return {None: 0.0, "bf16": 2.0**-8, "fp8": 2.0**-4, "int8": 1.0 / 127}[fmt]
