"""Elastic rejoin on torch tensors: the state a replica copies, and who copies whose.

:meth:`odc.Engine.admit` (the member ranks, at the boundary where a round
admitted nodes) and :meth:`odc.Engine.rejoin` (the restarted node's ranks)
build the next generation of an elastic job with these helpers: its first
member nodes, the source of each joining rank (the same local rank on a
member node, the joining nodes spread over the members), and the state as
one flat byte buffer with its layout, which the joiner checks against its
own before it takes any of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    import torch


#: The longest the registration of a generation that admits a node waits for a rank by default, in seconds.
REGISTER_WINDOW_S = 60.0


def register_window(timeout: float, explicit: float | None) -> float:
    """How long a new generation's registration waits for its ranks: ``explicit``, else the engine's timeout
    up to :data:`REGISTER_WINDOW_S` (a rank that died meanwhile must not hold the members longer)."""
    return float(explicit) if explicit is not None else min(float(timeout), REGISTER_WINDOW_S)


def source_node(joining: Sequence[int], old: Sequence[int], node: int) -> int:
    """The member node whose replica joining ``node`` copies: joiners spread round robin over ``old``."""
    return sorted(old)[sorted(joining).index(node) % len(old)]


def readers(rank: int, local_world: int, joining: Sequence[int], old: Sequence[int]) -> list[int]:
    """The joining ranks that copy ``rank``'s replica state (same local rank, node by :func:`source_node`)."""
    node, local = divmod(rank, local_world)
    return [j * local_world + local for j in sorted(joining) if source_node(joining, old, j) == node]


def layout(state: Sequence[torch.Tensor]) -> list[list[Any]]:
    """``[dtype, shape]`` of each state tensor, in order (what source and joiner compare)."""
    return [[str(t.dtype), list(t.shape)] for t in state]


def check_state(state: Sequence[torch.Tensor], what: str) -> None:
    """Every state tensor lives in host memory and is contiguous (the copy is of its bytes)."""
    for i, t in enumerate(state):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ConfigError(
                f"{what}: state[{i}] ({t.dtype}, {tuple(t.shape)}) on {t.device}"
                f"{'' if t.is_contiguous() else ', not contiguous'}: the replica state is copied as the "
                "bytes of contiguous host tensors"
            )


def pack(state: Sequence[torch.Tensor]) -> torch.Tensor:
    """The state's bytes, one after another, as one flat uint8 tensor."""
    import torch

    parts = [t.detach().reshape(-1).view(torch.uint8) for t in state]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def unpack(flat: torch.Tensor, state: Sequence[torch.Tensor]) -> None:
    """Copies ``flat``'s bytes into the state tensors, in order (laid out as :func:`pack` made it)."""
    import torch

    at = 0
    with torch.no_grad():
        for t in state:
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(flat[at : at + n])
            at += n


def compare_layouts(mine: list[list[Any]], raw: bytes, source: int) -> None:
    """Raises ConfigError naming the first state tensor whose dtype or shape differs from the source's."""
    theirs = json.loads(raw.decode())
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            raise ConfigError(
                f"rejoin: state[{i}] is {a[0]} {tuple(a[1])} here but {b[0]} {tuple(b[1])} on rank {source}, "
                "whose replica this rank copies: pass the same tensors in the same order (the parameter "
                "shards, then the optimizer state) on both sides"
            )
    if len(mine) != len(theirs):
        raise ConfigError(
            f"rejoin: {len(mine)} state tensors here, {len(theirs)} on rank {source}, whose replica this rank "
            "copies: pass the same tensors in the same order on both sides"
        )
