"""The private FSDP2 state odc.fsdp reads, in this one module, guarded by torch version.

odc.fsdp installs ODC through FSDP2's public seams, but it must read some
private FSDP2 state (parameter groups, their mesh info, divide factors, the
all-gather inputs) and subclass FSDP2's comm base classes, which live in a
private module. A torch release may move or rename any of it. Importing
``odc.fsdp`` must still work then: every name is imported here inside a
guard, and :func:`check_fsdp2` (called by ``odc.fsdp.enable``) raises
:class:`odc.ConfigError` naming the running torch, the versions checked and
what is missing. Where everything is present but the version was not
checked, it warns once per call. This module also turns that state into
odc.fsdp's own description of the model (:class:`_Group`, :class:`_Layout`);
nothing else in the package touches FSDP2's private attributes except
through what these return (and ``_partial_reduce_output`` in the binding).

Checked on :data:`TORCH_VERSIONS_CHECKED`.
"""

from __future__ import annotations

import inspect
import os
import socket
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

#: torch versions whose private FSDP2 state this module was checked against.
TORCH_VERSIONS_CHECKED = ("2.15.0",)

_missing: list[str] = []


def _placeholder(name: str) -> type:
    """A stand-in base class for a name this torch lacks (so ``odc.fsdp`` still imports)."""
    return type(name, (), {"__doc__": f"{name} is missing from this torch; odc.fsdp.enable refuses to run."})


if TYPE_CHECKING:  # the checked torch's names, for the type checker
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
        _get_gradient_divide_factors,
        _get_param_all_gather_inputs,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo
else:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:  # pragma: no cover - depends on the torch build
        _missing.append(f"torch.distributed.fsdp._fully_shard._fsdp_api (AllGather, ReduceScatter): {e}")
        AllGather, ReduceScatter = _placeholder("AllGather"), _placeholder("ReduceScatter")

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
            _get_gradient_divide_factors,
            _get_param_all_gather_inputs,
        )
    except ImportError as e:  # pragma: no cover - depends on the torch build
        _missing.append(f"torch.distributed.fsdp._fully_shard._fsdp_collectives: {e}")
        DefaultAllGather, DefaultReduceScatter = _placeholder("DefaultAllGather"), _placeholder("DefaultReduceScatter")
        _get_gradient_divide_factors = _get_param_all_gather_inputs = None

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo
    except ImportError as e:  # pragma: no cover - depends on the torch build
        _missing.append(f"torch.distributed.fsdp._fully_shard._fsdp_common (mesh infos): {e}")
        DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo = (
            _placeholder(n) for n in ("DDPMeshInfo", "FSDPMeshInfo", "HSDPMeshInfo")
        )

__all__ = [
    "GROUP_STATE",
    "PARAM_STATE",
    "TORCH_VERSIONS_CHECKED",
    "AllGather",
    "DDPMeshInfo",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "ReduceScatter",
    "_Group",
    "_Layout",
    "_describe",
    "_get_gradient_divide_factors",
    "_get_param_all_gather_inputs",
    "_node_layout",
    "check_fsdp2",
    "check_state",
    "prefix_store",
]

#: What each FSDP2 parameter group must carry for odc.fsdp (read in odc.fsdp).
GROUP_STATE = (
    "fsdp_params",
    "mesh_info",
    "post_forward_mesh_info",
    "_reduce_scatter_param_indices",
    "gradient_divide_factor",
    "force_sum_reduction_for_comms",
    "all_reduce_grads",
    "_all_reduce_process_group",
    "_partial_reduce_output",
    "_partial_reduce_output_layout",
    "_module_fqn",
    "device",
)
#: What each FSDP2 parameter (FSDPParam) must carry.
PARAM_STATE = ("sharded_param", "sharded_size", "padded_sharded_param_size", "to_sharded_dtensor", "_param_fqn")


def running_version() -> str:
    """The running torch's version without its local part (``2.15.0+cu132`` -> ``2.15.0``)."""
    return str(torch.__version__).split("+", 1)[0]


def _where() -> str:
    return f"torch {running_version()} (odc.fsdp was checked on {', '.join(TORCH_VERSIONS_CHECKED)})"


def check_fsdp2(stacklevel: int = 3) -> None:
    """Refuses a torch whose private FSDP2 state is missing; warns on an unchecked version.

    Raises:
        ConfigError: a private FSDP2 name odc.fsdp needs cannot be imported.

    Warns:
        UserWarning: the running torch is not in :data:`TORCH_VERSIONS_CHECKED`.
    """
    if _missing:
        raise ConfigError(
            f"odc.fsdp cannot run on {_where()}: it reads private FSDP2 state that this torch does not have "
            f"({'; '.join(_missing)}); install one of the checked versions or keep FSDP2's own collectives"
        )
    if running_version() not in TORCH_VERSIONS_CHECKED:
        warnings.warn(
            f"odc.fsdp: torch {running_version()} is not a version odc.fsdp was checked on "
            f"({', '.join(TORCH_VERSIONS_CHECKED)}); it reads private FSDP2 state that may have changed, "
            "so compare a few steps against FSDP's own collectives before relying on it",
            UserWarning,
            stacklevel=stacklevel,
        )


def check_state(obj: Any, names: tuple[str, ...], what: str) -> None:
    """Raises :class:`ConfigError` naming the first of ``names`` that ``obj`` (an FSDP2 object) lacks."""
    for name in names:
        try:
            inspect.getattr_static(obj, name)  # without running properties (some assert on the mesh kind)
        except AttributeError:
            raise ConfigError(  # noqa: B904 - the missing name is the whole story
                f"odc.fsdp cannot run on {_where()}: FSDP2's {what} has no {name!r} (private state that "
                "odc.fsdp reads); install one of the checked versions or keep FSDP2's own collectives"
            )


@dataclass
class _Group:
    """One FSDP parameter group = one ODC bucket."""

    name: str
    pg: FSDPParamGroup
    module: FSDPModule  # the fully_shard-ed module that owns the group (its comm setters)
    n: int  # FSDP's padded shard length (the all-gather input numel)
    dtype: torch.dtype  # all-gather dtype
    shard_len: int = 0  # ODC's shard length (n rounded up to the engine's alignment)
    offsets: list[int] = field(default_factory=list)  # each parameter's offset in the shard
    shard: torch.Tensor | None = None  # staging buffer for publish (shard_len elements), made by enable
    index: int = 0  # position in the binding's group list (= bucket order)
    pushed_in: int = -1  # last minibatch in which this rank pushed the group's gradients

    def staging(self) -> torch.Tensor:
        """The staging buffer publishes copy this rank's shard into (made by ``enable``)."""
        if self.shard is None:
            raise ConfigError(f"odc.fsdp: {self.name} has no staging buffer; odc.fsdp.enable makes it")
        return self.shard


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits: D ranks in all, a bucket cut into ``shards`` shards."""

    sharding: str
    world: int  # D: every rank of the mesh (the gradient is the mean over all of them)
    rank: int  # this rank among the D, node-major
    shards: int  # FSDP2's shards per bucket: D (full, hybrid-zero) or G, the ranks of a node (hybrid)
    index: int  # this rank's shard
    members: tuple[int, ...]  # global ranks of the mesh, node-major
    per_node: int | None = None  # hybrid-zero: G, the ranks of a node (the engine's node shards)


def _states(model: FSDPModule) -> list[Any]:
    state = model._get_fsdp_state()
    state._lazy_init()  # what the first forward does; idempotent
    if not state._is_root:
        raise ConfigError("odc.fsdp.enable: pass the root fully_shard-ed module (the one that runs forward)")
    return list(state._state_ctx.all_states)


_HSDP_MESH = (
    "init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))"
)


def _describe(model: FSDPModule, sharding: str) -> list[_Group]:
    groups: list[_Group] = []
    modules = cast(torch.nn.Module, model).modules()
    owners = {id(m._get_fsdp_state()): m for m in modules if isinstance(m, FSDPModule)}
    for state in _states(model):
        if len(state._fsdp_param_groups) > 1:
            fqn = state._fsdp_param_groups[0]._module_fqn or "<root>"
            raise ConfigError(
                f"odc.fsdp: fully_shard({fqn}) made {len(state._fsdp_param_groups)} parameter groups "
                "(per-parameter meshes from shard_placement_fn); ODC installs its comms with "
                "FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, which take one group "
                "per module: give every parameter of a fully_shard call the same mesh"
            )
        for pg in state._fsdp_param_groups:
            check_state(pg, GROUP_STATE, "parameter group (FSDPParamGroup)")
            for fp in pg.fsdp_params:
                check_state(fp, PARAM_STATE, "parameter (FSDPParam)")
            mesh = pg.mesh_info
            name = f"fsdp{len(groups)}:{pg._module_fqn or '<root>'}"
            one_d = not isinstance(mesh, DDPMeshInfo) and isinstance(mesh, FSDPMeshInfo)
            if sharding in ("full", "hybrid-zero") and (not one_d or isinstance(mesh, HSDPMeshInfo)):
                raise ConfigError(
                    f"odc.fsdp: {name} uses a 2-D (HSDP / replicated) mesh, but sharding={sharding!r} "
                    "shards over one mesh dimension of every rank; pass sharding='hybrid' to odc.fsdp.enable "
                    "for a (replicate, shard) mesh, or fully_shard over a 1-D mesh"
                )
            if sharding == "hybrid" and not isinstance(mesh, HSDPMeshInfo):
                kind = "a replicate-only" if isinstance(mesh, DDPMeshInfo) else "a 1-D"
                raise ConfigError(
                    f"odc.fsdp: sharding='hybrid' needs a model fully_shard-ed over a 2-D mesh "
                    f"(replicate, shard) = (nodes, ranks per node), but {name} uses {kind} mesh; build it "
                    f"with {_HSDP_MESH}, or use sharding='full'"
                )
            if pg.post_forward_mesh_info is not None and pg.post_forward_mesh_info is not mesh:
                raise ConfigError(
                    f"odc.fsdp: {name} uses reshard_after_forward=<int> (gathers over a sub-mesh); "
                    "use True or False with ODC"
                )
            if pg._reduce_scatter_param_indices != list(range(len(pg.fsdp_params))):
                raise ConfigError(
                    f"odc.fsdp: {name} packs its gradients in another order than its parameters "
                    "(mixed gradient dtypes); give its parameters one grad dtype"
                )
            inputs = _get_param_all_gather_inputs(pg.fsdp_params)
            dtypes = {t.dtype for ts in inputs for t in ts}
            if any(len(ts) != 1 for ts in inputs) or len(dtypes) != 1:
                raise ConfigError(
                    f"odc.fsdp: {name} uses an all-gather extension (fsdp_pre_all_gather) or mixed "
                    "all-gather dtypes, which ODC does not support"
                )
            offsets, off = [], 0
            for fp, (t,) in zip(pg.fsdp_params, inputs, strict=True):
                if t.numel() != fp.padded_sharded_param_size.numel():
                    raise ConfigError(f"odc.fsdp: {name} has an all-gather input that is not its padded shard")
                offsets.append(off)
                off += t.numel()
            groups.append(
                _Group(name=name, pg=pg, module=owners[id(state)], n=off, dtype=dtypes.pop(), offsets=offsets,
                       index=len(groups))
            )
    return groups


def _node_layout(groups: list[_Group], sharding: str) -> _Layout:
    """This rank's place among the mesh's ranks; under hybrid, checks that each shard group is one node."""
    # FSDPMeshInfo (full) or HSDPMeshInfo (hybrid): _describe refused any other kind.
    info = cast(Any, groups[0].pg.mesh_info)
    grid = info.mesh.mesh.tolist()
    for g in groups:
        if g.pg.mesh_info.mesh.mesh.tolist() != grid:
            raise ConfigError(f"odc.fsdp: {g.name} is sharded over other ranks than {groups[0].name}")
    if sharding == "full":
        d, r = info.shard_mesh_size, info.shard_mesh_rank
        return _Layout("full", world=d, rank=r, shards=d, index=r, members=tuple(grid))
    if sharding == "hybrid-zero":
        return _hybrid_zero_layout(info, tuple(grid))
    # HSDPMeshInfo: dim 0 replicates (nodes), dim 1 shards (the ranks of a node).
    nodes, per_mesh_row = len(grid), len(grid[0])
    members = tuple(r for row in grid for r in row)
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    per_node = int(env) if env.isdigit() and int(env) > 0 else None
    where = f"LOCAL_WORLD_SIZE={per_node}, node-major ranks" if per_node else "by host name"

    def fix(g: int) -> str:
        return (
            f"sharding='hybrid' shards within a node: build the mesh with init_device_mesh(device, "
            f"({len(members) // g}, {g}), mesh_dim_names=('replicate', 'shard')) over node-major ranks"
        )

    if per_node is not None:
        if len(members) % per_node:
            raise ConfigError(
                f"odc.fsdp: the mesh's {len(members)} ranks are not whole nodes of {per_node} "
                "(LOCAL_WORLD_SIZE); sharding='hybrid' needs the same number of ranks on every node"
            )
        if per_mesh_row != per_node:
            raise ConfigError(
                f"odc.fsdp: the mesh's shard dimension has {per_mesh_row} ranks, but a node runs "
                f"{per_node} (LOCAL_WORLD_SIZE); {fix(per_node)}"
            )
        node_of = {r: r // per_node for r in members}
    else:
        node_of = _hosts(members)
    for row in grid:
        if len({node_of[r] for r in row}) != 1:
            raise ConfigError(
                f"odc.fsdp: the mesh's shard dimension groups ranks {row}, which are on different nodes "
                f"({where}); {fix(per_mesh_row)}"
            )
    if per_mesh_row == 1 and nodes > 1:
        raise ConfigError(
            "odc.fsdp: sharding='hybrid' with one rank per node shards nothing (FSDP skips its all-gather "
            "and reduce-scatter on a shard group of 1); use sharding='full' over a 1-D mesh"
        )
    node, index = info.replicate_mesh_rank, info.shard_mesh_rank
    return _Layout("hybrid", world=len(members), rank=node * per_mesh_row + index, shards=per_mesh_row,
                   index=index, members=members)


def _hybrid_zero_layout(info: Any, members: tuple[int, ...]) -> _Layout:
    """hybrid-zero: FSDP2's 1-D layout (shard r on mesh rank r) over node-major ranks of equal nodes."""
    d, r = info.shard_mesh_size, info.shard_mesh_rank
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    if env.isdigit() and int(env) > 0:
        per_node, where = int(env), f"LOCAL_WORLD_SIZE={env}"
        node_of: dict[int, Any] = {m: m // per_node for m in members}
    else:
        node_of, where = _hosts(members), "by host name"
        per_node = sum(1 for m in members if node_of[m] == node_of[members[0]])
    if d % per_node:
        raise ConfigError(
            f"odc.fsdp: the mesh's {d} ranks are not whole nodes of {per_node} ({where}); "
            "sharding='hybrid-zero' needs the same number of ranks on every node"
        )
    for i, m in enumerate(members):
        if node_of[m] != node_of[members[i - i % per_node]]:
            raise ConfigError(
                f"odc.fsdp: sharding='hybrid-zero' needs the mesh's ranks node-major (mesh ranks "
                f"{i - i % per_node}…{i - i % per_node + per_node - 1} on one node), but mesh rank {i} "
                f"(rank {m}) runs on another node than mesh rank {i - i % per_node} ({where}); build the "
                "mesh with init_device_mesh(device, (world,)) over torchrun's ranks"
            )
    return _Layout("hybrid-zero", world=d, rank=r, shards=d, index=r, members=members, per_node=per_node)


def _hosts(members: tuple[int, ...]) -> dict[int, str]:
    """Host name of every rank of the mesh, through the default store (each rank posts its own)."""
    store = prefix_store(f"odc-fsdp/hosts/{'-'.join(map(str, members))}/")
    me = dist.get_rank()
    store.set(str(me), socket.gethostname())
    return {r: store.get(str(r)).decode() for r in members}


def prefix_store(prefix: str) -> Any:
    """The default group's store (a ``dist.Store``) under ``prefix`` (torch's stubs export neither)."""
    make: Any = dist.PrefixStore  # type: ignore[attr-defined]
    return make(prefix, dist.distributed_c10d._get_default_store())
