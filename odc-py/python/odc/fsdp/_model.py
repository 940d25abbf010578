"""The first step of ``odc.fsdp.enable`` and ``odc.fsdp.rejoin``: what the loop hands ODC, described once
(:func:`describe`, :func:`describe_joiner`) as a :class:`._private._Model`.

It tells FSDP2 from FSDP1, reads the parameter groups (one ODC bucket each) and this rank's place in the mesh
(through :mod:`._private` for FSDP2 and :mod:`._fsdp1` for FSDP1), checks the optimizers and what an elastic
replica copies, and makes every refusal that needs nothing registered. It hands the later steps the kind's own
ways to install ODC's comms (:mod:`._seams` for FSDP2, :mod:`._fsdp1` for FSDP1) and to reshard, so that no
later step asks which kind it has. The steps after it (:mod:`._engine`, :mod:`._binding`) read only what it
returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from ..errors import ConfigError
from . import _fsdp1, _seams
from ._binding import SHARDINGS
from ._private import NO_OPTIMIZER, Replica, _describe, _Group, _Layout, _Model, _node_layout, check_fsdp2
from ._transport import _pick_transport, requested


def describe(model: Any, optimizer: Any, *, sharding: str, elastic: bool | str, transport: str | None,
             scaler: Any, scheduler: Any) -> _Model:
    """``odc.fsdp.enable``'s model: FSDP2 over a 1-D mesh (``"full"``, ``"hybrid-zero"``) or a 2-D one
    (``"hybrid"``), or FSDP1's root module; every argument checked (see ``enable``'s Raises)."""
    what = "odc.fsdp.enable"
    check_fsdp2(stacklevel=4)  # the warning points at the caller of enable (rejoin)
    optimizers = _optimizers(optimizer, what)
    fsdp1 = _kind(model, what, "wrapped in FullyShardedDataParallel (FSDP1)")
    if sharding not in SHARDINGS:
        raise ConfigError(
            f"odc.fsdp.enable: unknown sharding {sharding!r}; use 'full' (shard over every rank, 1-D mesh), "
            "'hybrid' (shard within a node, 2-D (replicate, shard) mesh) or 'hybrid-zero' (shard within a "
            "node, optimizer state over every rank, 1-D mesh)"
        )
    check_elastic(elastic, what)
    if elastic and sharding != "hybrid":
        raise ConfigError(
            f"odc.fsdp.enable: elastic={elastic!r} needs sharding='hybrid' (a whole replica of the parameters and "
            f"the optimizer state on every node); under sharding={sharding!r} one copy of "
            f"{'each parameter and gradient shard' if sharding == 'full' else 'each shard of the optimizer state'} "
            "lives on one rank and dies with it"
        )
    replica = _replica(model, optimizers, scaler, scheduler, elastic, what)
    if fsdp1:
        groups, layout, process_group = _fsdp1.describe(model, sharding)
        if not groups and layout.world > 1:
            raise ConfigError("odc.fsdp.enable: the model has no FSDP parameter groups")
    else:
        groups = _describe(model, sharding)
        if not groups:
            raise ConfigError("odc.fsdp.enable: the model has no FSDP parameter groups")
        # The tensors' device fits the transport asked for before the layout (which may read the store).
        _pick_transport(groups, *requested(transport), nodes=None)
        layout = _node_layout(groups, sharding)
        process_group = cast(Any, groups[0].pg.mesh_info).shard_process_group
    return _made(model, fsdp1, groups, layout, process_group, optimizers, replica)


def describe_joiner(model: Any, optimizer: Any, *, rank: int, world_size: int, elastic: bool | str,
                    scaler: Any, scheduler: Any) -> _Model:
    """``odc.fsdp.rejoin``'s model: FSDP2 or FSDP1 over a mesh of this node's ranks only, ``rank`` at its local
    rank in it; the layout is the job's (``world_size`` ranks, node-major)."""
    what = "odc.fsdp.rejoin"
    check_fsdp2(stacklevel=4)  # the warning points at the caller of enable (rejoin)
    check_elastic(elastic, what)
    if not elastic:
        raise ConfigError("odc.fsdp.rejoin: elastic=False; a rejoined node takes part in an elastic job (True, "
                          "'drop' or 'rerun', as the members' enable)")
    optimizers = _optimizers(optimizer, what)
    if not optimizers:
        raise ConfigError(f"odc.fsdp.rejoin needs the loop's optimizer(s): {NO_OPTIMIZER}")
    replica = cast(Replica, _replica(model, optimizers, scaler, scheduler, elastic, what))
    fsdp1 = _kind(model, what, "over one node's (1, ranks per node) mesh, or FSDP1's root FullyShardedDataParallel "
                  "with HYBRID_SHARD over one")
    if fsdp1:
        groups, node, process_group = _fsdp1.describe(model, "hybrid")
    else:
        groups = _describe(model, "hybrid")
    if not groups:
        raise ConfigError("odc.fsdp.rejoin: the model has no FSDP parameter groups")
    if not fsdp1:
        node = _node_layout(groups, "hybrid")
        process_group = cast(Any, groups[0].pg.mesh_info).shard_process_group
    g_size, rank, world_size = node.shards, int(rank), int(world_size)
    if node.world != g_size or world_size % g_size or rank % g_size != node.index or not 0 <= rank < world_size:
        raise ConfigError(
            f"odc.fsdp.rejoin: rank {rank} of {world_size} with a mesh of {node.world} ranks, {g_size} per shard "
            f"group, this rank at index {node.index}: shard the model over this node's ranks only (a (1, "
            f"{g_size}) mesh), with this rank at its local rank ({rank % g_size if g_size else '?'})"
        )
    layout = _Layout("hybrid", world=world_size, rank=rank, shards=g_size, index=node.index,
                     members=tuple(range(world_size)))
    return _made(model, fsdp1, groups, layout, process_group, optimizers, replica)


def check_elastic(elastic: Any, what: str) -> None:
    """Refuses an ``elastic=`` value that is none of ``False``, ``True``, ``"drop"``, ``"rerun"``."""
    if elastic not in (False, True, "drop", "rerun"):
        raise ConfigError(f"{what}: elastic={elastic!r}; use True or 'drop' (a dead node's microbatches of the "
                          "minibatch are dropped), 'rerun' (they run again on the other nodes) or False")


def _made(model: Any, fsdp1: bool, groups: list[_Group], layout: _Layout, process_group: Any,
          optimizers: list[torch.optim.Optimizer], replica: Replica | None) -> _Model:
    """The description, with the kind's comm installer and reshard."""
    kind: Any = _fsdp1 if fsdp1 else _seams
    install = partial(kind.install, model=model, groups=groups) if fsdp1 else partial(kind.install, groups=groups)
    return _Model(model, fsdp1, groups, layout, process_group, optimizers, replica, install,
                  partial(kind.reshard, model))


def _kind(model: Any, what: str, fsdp1_form: str) -> bool:
    """Whether ``model`` is FSDP1's (else FSDP2's); refuses anything else, and a model enabled already."""
    fsdp1 = _fsdp1.is_fsdp1(model)
    if not fsdp1 and not isinstance(model, FSDPModule):
        raise ConfigError(
            f"{what} needs a module passed through torch.distributed.fsdp.fully_shard (FSDP2) or {fsdp1_form}; "
            f"got {type(model).__name__}"
        )
    if getattr(model, "_odc_fsdp", None) is not None:
        raise ConfigError(f"{what}: this model is already enabled")
    return fsdp1


def _optimizers(optimizer: Any, what: str) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list (None: none), each a torch optimizer, none twice."""
    if optimizer is None:
        return []
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in opts:
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"{what}: optimizer must be a torch.optim.Optimizer, a list of them or None; got {type(opt).__name__}"
            )
    if len({id(o) for o in opts}) != len(opts):
        raise ConfigError(f"{what}: the same optimizer was passed twice")
    return opts


def _replica(model: Any, optimizers: list[torch.optim.Optimizer], scaler: Any, scheduler: Any, elastic: Any,
             what: str) -> Replica | None:
    """What a rejoining node copies of this rank's replica (None without ``elastic``), checked: every value of
    it can be copied (else a ConfigError naming it)."""
    schedulers: Sequence[Any] = (
        [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler])
    if not elastic:
        if scaler is not None or schedulers:
            raise ConfigError(f"{what}: scaler= and scheduler= name what a rejoining node copies; they need "
                              "elastic=True (or 'drop', 'rerun')")
        return None
    for i, obj in enumerate([scaler, *schedulers]):
        if obj is not None and not (callable(getattr(obj, "state_dict", None))
                                    and callable(getattr(obj, "load_state_dict", None))):
            kind = "scaler" if i == 0 else f"scheduler {i - 1}"
            raise ConfigError(f"{what}: the {kind} is a {type(obj).__name__}, which has no state_dict() and "
                              "load_state_dict() to copy it by")
    replica = Replica(model, optimizers, scaler, list(schedulers))
    replica.check(what)
    return replica
