"""Moving one minibatch's samples to the ranks LB-Mini picks, for trainer integrations.

A trainer hands each rank an equal share of a minibatch. LB-Mini balances
the minibatch's total cost per rank instead (Karmarkar–Karp over all ranks'
samples, unequal counts), so some samples change rank. Two pieces:

- :func:`assign` (pure, identical on every rank): who runs which sample,
  as ``(source rank, index on the source)`` pairs, keeping as many tokens
  in place as the plan allows.
- :func:`exchange` (collective, once per minibatch): carries each rank's
  outgoing payloads (bytes) to their destinations with two
  ``all_to_all_single`` calls, on every rank at the same point, so it is
  compatible with uneven microbatch counts afterwards.

Nothing here knows a trainer's data format; the integrations turn their
batches into payloads and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import packing
from ..errors import ConfigError

__all__ = ["assign", "exchange", "moves_anything"]


def assign(lengths: Sequence[Sequence[int]], *, max_tokens: int, cost: str = "verl") -> list[list[tuple[int, int]]]:
    """LB-Mini over the ranks' samples of one minibatch.

    Args:
        lengths: ``lengths[r]`` are the token counts of rank ``r``'s samples,
            in its local order.
        max_tokens: one microbatch's token budget (a longer sample is an error).
        cost: an :mod:`odc.packing` cost model (``"verl"`` is verl's workload
            estimate ``s² + 24576·s``).

    Returns:
        ``runs[r]``: the ``(source rank, local index)`` of every sample rank
        ``r`` runs, in ascending order. Every rank gets at least one sample
        while there are as many samples as ranks. Which balanced part goes to
        which rank is chosen to keep the most tokens where they are.

    Raises:
        PackingError: a length that is not a positive integer, or one over
            ``max_tokens``.
    """
    world = len(lengths)
    owner = [(r, i) for r, ls in enumerate(lengths) for i in range(len(ls))]
    flat = [int(x) for ls in lengths for x in ls]
    if world == 0:
        raise ConfigError("odc.integrations: no ranks to balance over")
    if not flat:
        return [[] for _ in range(world)]
    per_rank = -(-len(flat) // world)  # one global minibatch of per_rank * world samples
    plan = packing.plan(flat, world_size=world, minibatch_size=per_rank, strategy="lb-mini",
                        max_tokens=max_tokens, cost=cost)
    parts = [sorted(i for mb in plan.minibatches[0][r] for i in mb) for r in range(world)]
    _fill_empty(parts, [packing.sequence_cost(x, cost) for x in flat])
    match = _keep_in_place(parts, owner, flat, world)
    return [[owner[i] for i in parts[match[r]]] for r in range(world)]


def _fill_empty(parts: list[list[int]], costs: list[float]) -> None:
    """Gives an empty part the cheapest sample of the part with the most samples (while that has two or more).

    Karmarkar–Karp may leave a part empty even with as many samples as
    parts; trainers assume every rank holds data, so an empty rank takes
    the sample that unbalances least.
    """
    while True:
        empty = [p for p in parts if not p]
        donor = max(parts, key=len)
        if not empty or len(donor) < 2:
            return
        cheapest = min(donor, key=lambda i: (costs[i], i))
        donor.remove(cheapest)
        empty[0].append(cheapest)


def _keep_in_place(parts: list[list[int]], owner: list[tuple[int, int]], flat: list[int], world: int) -> list[int]:
    """``match[r]``: the part rank ``r`` runs, greedily maximizing the tokens that stay on their rank."""
    kept = [[0] * world for _ in parts]  # kept[p][r]: tokens of part p already on rank r
    for p, part in enumerate(parts):
        for i in part:
            kept[p][owner[i][0]] += flat[i]
    pairs = sorted(((kept[p][r], p, r) for p in range(len(parts)) for r in range(world)),
                   key=lambda t: (-t[0], t[1], t[2]))
    match = [-1] * world
    taken = [False] * len(parts)
    for _, p, r in pairs:
        if match[r] < 0 and not taken[p]:
            match[r], taken[p] = p, True
    return match


def moves_anything(runs: list[list[tuple[int, int]]]) -> bool:
    """Whether any sample changes rank (known on every rank, so all skip :func:`exchange` together)."""
    return any(src != r for r, run in enumerate(runs) for src, _ in run)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: host memory when it has a CPU backend, else the current GPU."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def exchange(outgoing: Sequence[bytes], group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Sends ``outgoing[d]`` to rank ``d`` of ``group``; returns what each rank sent here. Collective.

    ``outgoing[own rank]`` is returned as is without moving. Two
    ``all_to_all_single`` calls: the byte counts, then the bytes.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if len(outgoing) != world:
        raise ConfigError(f"odc.integrations: {len(outgoing)} payloads for a group of {world} ranks")
    dev = _device(group)
    sizes_out = [0 if d == me else len(b) for d, b in enumerate(outgoing)]
    sizes_in_t = torch.empty(world, dtype=torch.int64, device=dev)
    dist.all_to_all_single(sizes_in_t, torch.tensor(sizes_out, dtype=torch.int64, device=dev), group=group)
    sizes_in = sizes_in_t.tolist()
    blob = bytearray(b"".join(b for d, b in enumerate(outgoing) if d != me))
    send = (torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)).to(dev)
    recv = torch.empty(sum(sizes_in), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv, send, output_split_sizes=sizes_in, input_split_sizes=sizes_out, group=group)
    data = recv.cpu().numpy().tobytes()
    out, at = [], 0
    for src, n in enumerate(sizes_in):
        out.append(outgoing[me] if src == me else data[at:at + n])
        at += n
    return out
