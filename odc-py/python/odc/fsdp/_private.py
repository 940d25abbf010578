"""The private FSDP2 state odc.fsdp reads and writes, in this one module, guarded by torch version.

odc.fsdp installs ODC through FSDP2's public seams, but it must read some
private FSDP2 state (parameter groups, their mesh info, divide factors, the
all-gather inputs), write a little of it (hybrid's all-reduce flag and parked
partial outputs) and subclass FSDP2's comm base classes, which live in a
private module. Every such name is listed in :data:`PRIVATE` with the torch
releases (major.minor) odc.fsdp uses it on, checked against each release's
FSDP2 source (:data:`TORCH_VERSIONS_CHECKED`); where a release lacks a name,
the entry says what stands in for it, and the accessors here
(:func:`param_groups`, :func:`drop_partial_reduce`, the reduce-scatter
order check in :func:`_describe`) pick by the running release.

Supported: torch :data:`TORCH_RANGE` (2.11 to 2.15), tested at both ends
(:data:`TORCH_VERSIONS_TESTED`). Importing ``odc.fsdp`` works on any torch:
every name is imported inside a guard. :func:`check_fsdp2` (called first by
``odc.fsdp.enable``, before anything is registered) raises
:class:`odc.ConfigError` naming the running torch and the supported range
when the torch is outside it or a private module lacks a name, and
:func:`check_state` does the same for a missing attribute of an FSDP2
object. A torch newer than the range runs only with
``ODC_ALLOW_UNCHECKED_TORCH=1``, with a warning. This module also turns
that state into odc.fsdp's own description of the model (:class:`_Group`,
:class:`_Layout`); nothing else in the package touches FSDP2's private
attributes except through what these return.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import _rejoin
from ..errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

TORCH_RANGE = ("2.11", "2.15")
"""The supported torch releases, oldest and newest (major.minor): ``make test`` runs the suite on both;
:func:`odc.fsdp.enable` refuses a torch outside them (a newer one runs under ``ODC_ALLOW_UNCHECKED_TORCH=1``)."""
TORCH_VERSIONS_TESTED = ("2.11.0", "2.15.0")
"""The torch versions the test suite runs on (the two legs of ``make test``)."""
TORCH_VERSIONS_CHECKED = ("2.11.0", "2.12.0", "2.13.0", "2.14.0", "2.15.0")
"""The torch releases whose FSDP2 sources :data:`PRIVATE` was checked against, name by name."""
#: Set to ``1`` to run ``odc.fsdp`` on a torch newer than :data:`TORCH_RANGE` (it warns instead of refusing).
ALLOW_ENV = "ODC_ALLOW_UNCHECKED_TORCH"


@dataclass(frozen=True)
class PrivateName:
    """One private FSDP2 name odc.fsdp reads or writes, and the torch releases it does so on.

    ``first`` and ``last`` bound the checked releases (major.minor) on which
    odc.fsdp uses this name; outside them another entry stands in for it
    (``instead`` says which, and why).
    """

    owner: str  # the class or module that holds it
    name: str
    first: str
    last: str
    use: str  # what odc.fsdp does with it
    instead: str = ""  # what odc.fsdp uses on the checked releases outside first..last

    def used_on(self, minor: tuple[int, int]) -> bool:
        """Whether odc.fsdp uses this name on a torch of this major.minor."""
        return _minor(self.first) <= minor <= _minor(self.last)


_ALL = ("2.11", "2.15")
#: Every private FSDP2 name odc.fsdp touches, with the releases it was checked on (see TORCH_VERSIONS_CHECKED).
PRIVATE: tuple[PrivateName, ...] = (
    PrivateName("FSDPModule", "_get_fsdp_state", *_ALL, "the module's FSDPState"),
    PrivateName("FSDPState", "_lazy_init", *_ALL, "what the first forward does, run by enable (idempotent)"),
    PrivateName("FSDPState", "_is_root", *_ALL, "enable refuses a module that is not the root"),
    PrivateName("FSDPState", "_state_ctx", *_ALL, "its all_states: every fully_shard-ed module's state"),
    PrivateName("FSDPState", "_fsdp_param_group", "2.11", "2.11",
                "the state's one parameter group (None without parameters)",
                "2.12 made it a list, _fsdp_param_groups (several groups per fully_shard call)"),
    PrivateName("FSDPState", "_fsdp_param_groups", "2.12", "2.15", "the state's parameter groups (one per mesh)",
                "2.11 holds one group, _fsdp_param_group"),
    PrivateName("FSDPParamGroup", "fsdp_params", *_ALL, "the group's parameters, in all-gather order"),
    PrivateName("FSDPParamGroup", "mesh_info", *_ALL, "the mesh the group shards over (1-D or HSDP)"),
    PrivateName("FSDPParamGroup", "post_forward_mesh_info", *_ALL,
                "reshard_after_forward=int: the sub-mesh of the backward's re-gather (refused outside hybrid-zero)"),
    PrivateName("FSDPParamGroup", "is_sharded_post_forward", *_ALL,
                "reshard_after_forward=int: an all-gather that re-gathers over the sub-mesh"),
    PrivateName("FSDPParamGroup", "_reduce_scatter_param_indices", "2.15", "2.15",
                "refuses a group whose reduce-scatter packs gradients in another order than its parameters",
                "before 2.15 the reduce-scatter packs in parameter order (mixed reduce dtypes are refused by FSDP)"),
    PrivateName("FSDPParamGroup", "gradient_divide_factor", *_ALL, "the push's scale under AVG and SUM"),
    PrivateName("FSDPParamGroup", "force_sum_reduction_for_comms", *_ALL, "the post-divide ODC applies itself"),
    PrivateName("FSDPParamGroup", "all_reduce_grads", *_ALL,
                "written: hybrid switches FSDP's HSDP all-reduce off (restored by disable)"),
    PrivateName("FSDPParamGroup", "_all_reduce_process_group", *_ALL, "hybrid: the replicas of the divide factor"),
    PrivateName("FSDPParamGroup", "_partial_reduce_output", *_ALL,
                "written: hybrid drops FSDP's parked (zero) partial reduce output at each finish"),
    PrivateName("FSDPParamGroup", "_partial_reduce_output_layout", "2.15", "2.15",
                "written: cleared with _partial_reduce_output",
                "before 2.15 the partial output has no layout beside it"),
    PrivateName("FSDPParamGroup", "reduce_scatter_unused_params", "2.13", "2.15",
                "the LayoutError for a shrunk reduce-scatter names the setter that keeps unused parameters",
                "before 2.13 FSDP always drops a parameter without a gradient; the error says so"),
    PrivateName("FSDPParamGroup", "_module_fqn", *_ALL, "bucket names and errors"),
    PrivateName("FSDPParamGroup", "device", *_ALL, "the divide factors' device type"),
    PrivateName("FSDPParam", "sharded_param", *_ALL, "the parameter whose .grad the gradient contract keeps"),
    PrivateName("FSDPParam", "sharded_size", *_ALL, "the local gradient's shape"),
    PrivateName("FSDPParam", "padded_sharded_param_size", *_ALL, "the parameter's offset in the bucket shard"),
    PrivateName("FSDPParam", "to_sharded_dtensor", *_ALL, "wraps installed and pending local gradients"),
    PrivateName("FSDPParam", "_param_fqn", *_ALL, "names in errors"),
    PrivateName("FSDPParam", "sharded_state", *_ALL,
                "whether FSDP has the all-gather inputs (not while the group is unsharded)"),
    PrivateName("FSDPParam", "_sharded_param_data", *_ALL,
                "the padded flat shard, published while the group is unsharded (FSDP's all-gather input then)"),
    PrivateName("FSDPParam", "param_dtype", *_ALL, "the all-gather dtype the published shard is cast to"),
    PrivateName("FSDPParam", "sharded_grad_dtype", "2.15", "2.15", "the installed gradient's dtype",
                "before 2.15 the gradient takes the parameter's dtype"),
    PrivateName("_fsdp_api", "AllGather", *_ALL, "base class of ODC's all-gather seam"),
    PrivateName("_fsdp_api", "ReduceScatter", *_ALL, "base class of ODC's reduce-scatter seam"),
    PrivateName("_fsdp_collectives", "DefaultAllGather", *_ALL, "reinstalled by disable"),
    PrivateName("_fsdp_collectives", "DefaultReduceScatter", *_ALL, "reinstalled by disable"),
    PrivateName("_fsdp_collectives", "_get_param_all_gather_inputs", *_ALL, "this rank's shard, to publish"),
    PrivateName("_fsdp_collectives", "_get_gradient_divide_factors", *_ALL, "FSDP's post-divide under SUM"),
    PrivateName("_fsdp_common", "FSDPMeshInfo", *_ALL, "mesh kinds"),
    PrivateName("_fsdp_common", "HSDPMeshInfo", *_ALL, "mesh kinds"),
    PrivateName("_fsdp_common", "DDPMeshInfo", *_ALL, "mesh kinds"),
)


def _minor(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` / ``"2.16.0.dev20261101"`` / ``"2.11"`` -> ``(2, 11)``."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def running_minor() -> tuple[int, int]:
    """The running torch's (major, minor); a newer torch allowed by ``ODC_ALLOW_UNCHECKED_TORCH`` reads as the
    newest supported one (its names are checked as that one's)."""
    return min(_minor(running_version()), _minor(TORCH_RANGE[1]))


def names_of(owner: str) -> tuple[str, ...]:
    """The private names of ``owner`` that odc.fsdp uses on the running torch."""
    minor = running_minor()
    return tuple(n.name for n in PRIVATE if n.owner == owner and n.used_on(minor))


def at_least(version: str) -> bool:
    """Whether the running torch is ``version`` (major.minor) or newer."""
    return running_minor() >= _minor(version)


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
    "ALLOW_ENV",
    "PRIVATE",
    "TORCH_RANGE",
    "TORCH_VERSIONS_CHECKED",
    "TORCH_VERSIONS_TESTED",
    "AllGather",
    "DDPMeshInfo",
    "DefaultAllGather",
    "DefaultReduceScatter",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "PrivateName",
    "ReduceScatter",
    "_Group",
    "_Layout",
    "_Model",
    "_describe",
    "_get_gradient_divide_factors",
    "_get_param_all_gather_inputs",
    "_node_layout",
    "at_least",
    "check_fsdp2",
    "check_state",
    "drop_partial_reduce",
    "names_of",
    "param_groups",
    "prefix_store",
    "unused_params_advice",
]


def running_version() -> str:
    """The running torch's version without its local part (``2.15.0+cu132`` -> ``2.15.0``)."""
    return str(torch.__version__).split("+", 1)[0]


def _where() -> str:
    return (
        f"torch {running_version()} (odc.fsdp supports torch {TORCH_RANGE[0]} to {TORCH_RANGE[1]}; "
        f"its private FSDP2 state was checked on {', '.join(TORCH_VERSIONS_CHECKED)})"
    )


def check_fsdp2(stacklevel: int = 3) -> None:
    """Refuses a torch outside :data:`TORCH_RANGE`, or one whose private FSDP2 modules lack a name.

    A torch newer than the range runs only with ``ODC_ALLOW_UNCHECKED_TORCH=1``,
    and then with a warning: its private state is checked as the newest
    supported release's.

    Raises:
        ConfigError: the running torch is outside :data:`TORCH_RANGE`, or a
            private FSDP2 name odc.fsdp needs cannot be imported.

    Warns:
        UserWarning: a torch newer than the range, allowed by ``ODC_ALLOW_UNCHECKED_TORCH=1``.
    """
    minor = _minor(running_version())
    if minor < _minor(TORCH_RANGE[0]):
        raise ConfigError(
            f"odc.fsdp cannot run on {_where()}: install torch {TORCH_RANGE[0]} or newer, or keep FSDP2's "
            "own collectives"
        )
    if minor > _minor(TORCH_RANGE[1]):
        if os.environ.get(ALLOW_ENV) != "1":
            raise ConfigError(
                f"odc.fsdp has not been checked on {_where()}: it reads private FSDP2 state that a newer torch "
                f"may have changed; install torch {TORCH_RANGE[1]}, or set {ALLOW_ENV}=1 to try it (then "
                "compare a few steps against FSDP's own collectives)"
            )
        warnings.warn(
            f"odc.fsdp: running on {_where()} because {ALLOW_ENV}=1; compare a few steps against FSDP's own "
            "collectives before relying on it",
            UserWarning,
            stacklevel=stacklevel,
        )
    if _missing:
        raise ConfigError(
            f"odc.fsdp cannot run on {_where()}: it reads private FSDP2 state that this torch does not have "
            f"({'; '.join(_missing)}); install one of the checked versions or keep FSDP2's own collectives"
        )


def check_state(obj: Any, owner: str, names: tuple[str, ...] | None = None) -> None:
    """Raises :class:`ConfigError` naming the first private name of ``owner`` that ``obj`` lacks.

    Args:
        obj: an FSDP2 object (an ``FSDPState``, ``FSDPParamGroup``, ``FSDPParam`` or ``FSDPModule``).
        owner: its class name in :data:`PRIVATE`.
        names: the names to check (default: every name odc.fsdp uses on the running torch).
    """
    for name in names_of(owner) if names is None else names:
        try:
            inspect.getattr_static(obj, name)  # without running properties (some assert on the mesh kind)
        except AttributeError:
            raise ConfigError(  # noqa: B904 - the missing name is the whole story
                f"odc.fsdp cannot run on {_where()}: FSDP2's {owner} has no {name!r} (private state that "
                "odc.fsdp reads); install one of the checked versions or keep FSDP2's own collectives"
            )


def param_groups(state: Any) -> list[FSDPParamGroup]:
    """An ``FSDPState``'s parameter groups: a list from torch 2.12, one group (or None) on 2.11."""
    check_state(state, "FSDPState")
    if at_least("2.12"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def drop_partial_reduce(pg: FSDPParamGroup) -> None:
    """Hybrid: forgets the (zero) reduce-scatter output FSDP parked for an HSDP all-reduce that never comes."""
    pg._partial_reduce_output = None
    if at_least("2.15"):
        cast(Any, pg)._partial_reduce_output_layout.clear()


def unused_params_advice() -> str:
    """What a user whose reduce-scatter input shrank (a parameter got no gradient) can do on this torch."""
    if at_least("2.13"):
        return "call model.set_reduce_scatter_unused_params(True) before odc.fsdp.enable"
    return (
        f"torch {running_version()}'s FSDP2 always drops such a parameter from the reduce-scatter (torch 2.13 "
        "added set_reduce_scatter_unused_params(True) to keep it): let every trainable parameter of the group "
        "take part in each microbatch's loss, freeze the unused ones before fully_shard, or use torch 2.13 or newer"
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

    def gather_inputs(self) -> list[torch.Tensor]:
        """This rank's shard as its peers gather it (all-gather dtype), in flat pieces of ``n`` elements in all.

        A group left unsharded (FSDP2's root after a forward under ``no_grad``, ``reshard_after_forward=False``
        after an evaluation, ``set_reshard_after_backward(False)``) publishes when its minibatch starts with a
        push: FSDP2 has no all-gather inputs in that state, so they are built as it builds them, from the
        padded flat shard cast to the all-gather dtype (ODC refuses the tensor-subclass extensions that
        would build them otherwise).
        """
        fps = self.pg.fsdp_params
        if any(fp.sharded_state.name == "UNSHARDED" for fp in fps):
            return [fp._sharded_param_data.to(fp.param_dtype or fp._sharded_param_data.dtype) for fp in fps]
        return [t.reshape(-1) for ts in _get_param_all_gather_inputs(fps) for t in ts]

    def drop_parked(self) -> None:
        """Hybrid, at each finish: FSDP2's parked (zero) reduce output, awaiting an all-reduce that never comes."""
        drop_partial_reduce(self.pg)

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


@dataclass
class _Model:
    """An FSDP model as ``odc.fsdp.enable`` / ``rejoin`` see it, made once by ``odc.fsdp._model``: its kind, its
    parameter groups (one ODC bucket each), this rank's layout, what the loop hands ODC beside it, and the
    kind's own ways to install ODC's comms and to reshard. The later steps (the engine, the binding) read only
    this."""

    module: Any  # the root module (FSDP2's fully_shard-ed one, or FSDP1's FullyShardedDataParallel)
    fsdp1: bool
    groups: list[_Group]
    layout: _Layout
    process_group: Any  # the group FSDP shards over (its timeout is ODC's default deadline)
    optimizers: list[torch.optim.Optimizer]
    replica: Replica | None  # elastic: what a rejoining node copies beside the tensors; None otherwise
    install: Callable[[Any], None]  # installs ODC's gather and push in FSDP's seams, given the binding
    reshard: Callable[[], None]  # reshards every FSDP module (the next forward gathers)


def _states(model: FSDPModule) -> list[Any]:
    state = model._get_fsdp_state()
    check_state(state, "FSDPState", ("_lazy_init", "_is_root", "_state_ctx"))
    state._lazy_init()  # what the first forward does; idempotent
    if not state._is_root:
        raise ConfigError("odc.fsdp.enable: pass the root fully_shard-ed module (the one that runs forward)")
    # torch 2.11 lists the state of fully_shard([a, b]) once per module (2.12 and later once): one group, one bucket.
    return list({id(s): s for s in state._state_ctx.all_states}.values())


_HSDP_MESH = (
    "init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))"
)


def _describe(model: FSDPModule, sharding: str) -> list[_Group]:
    groups: list[_Group] = []
    check_state(model, "FSDPModule")
    modules = cast(torch.nn.Module, model).modules()
    owners = {id(m._get_fsdp_state()): m for m in modules if isinstance(m, FSDPModule)}
    for state in _states(model):
        pgs = param_groups(state)
        if len(pgs) > 1:
            fqn = pgs[0]._module_fqn or "<root>"
            raise ConfigError(
                f"odc.fsdp: fully_shard({fqn}) made {len(pgs)} parameter groups "
                "(per-parameter meshes from shard_placement_fn); ODC installs its comms with "
                "FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, which take one group "
                "per module: give every parameter of a fully_shard call the same mesh"
            )
        for pg in pgs:
            check_state(pg, "FSDPParamGroup")
            for fp in pg.fsdp_params:
                check_state(fp, "FSDPParam")
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
            post = pg.post_forward_mesh_info
            if post is not None and post is not mesh and sharding != "hybrid-zero":
                raise ConfigError(
                    f"odc.fsdp: {name} uses reshard_after_forward={post.shard_mesh_size} (a copy sharded over "
                    f"groups of {post.shard_mesh_size} ranks after the forward, re-gathered over them in the "
                    f"backward); under sharding={sharding!r} ODC's gathers read every owner, so the re-gather "
                    "would cross nodes all the same: pass odc.fsdp.enable(..., sharding='hybrid-zero'), where "
                    "every gather, the backward's included, reads within the node (docs/hybrid-zero.md), or "
                    "reshard_after_forward=True or False"
                )
            # Before 2.15 the reduce-scatter packs in parameter order (FSDP refuses mixed reduce dtypes).
            if at_least("2.15") and pg._reduce_scatter_param_indices != list(range(len(pg.fsdp_params))):
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


def prefix_store(prefix: str, store: Any = None) -> Any:
    """``store`` (default: the default group's, a ``dist.Store``) under ``prefix`` (torch's stubs export neither)."""
    make: Any = dist.PrefixStore  # type: ignore[attr-defined]
    return make(prefix, dist.distributed_c10d._get_default_store() if store is None else store)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (no autograd wrapper: writes reach the parameter), else ``t``."""
    with torch.no_grad():
        return t.to_local() if hasattr(t, "to_local") else t


def replica_state(groups: list[_Group], optimizers: list[torch.optim.Optimizer],
                  buffers: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
    """This rank's part of its node's replica, in an order every rank of every node agrees on: each group's
    parameters' local shards, then the model's ``buffers``, then each optimizer's tensor state of each of its
    parameters (keys sorted; what is not a tensor travels in :func:`odc._rejoin.scalar_state`). Elastic
    rejoin copies it, byte for byte, from a member to the joiner of the same local rank."""
    # FSDP1's FlatParameter: its full-precision local shard (the parameter itself holds a mixed-precision copy
    # while its handle unshards); between minibatches the same storage.
    out = [_local(getattr(fp.sharded_param, "_local_shard", fp.sharded_param)) for g in groups
           for fp in g.pg.fsdp_params]
    out.extend(buffers)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                out.extend(_local(v) for _, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
    return out


def _state_names(groups: list[_Group], optimizers: list[torch.optim.Optimizer], buffers: Sequence[str],
                 param_names: dict[int, str]) -> list[str]:
    """What each tensor of :func:`replica_state` is, in its order (for errors)."""
    out = [f"the local shard of parameter {fp._param_fqn or '<root>'}" for g in groups for fp in g.pg.fsdp_params]
    out.extend(f"buffer {name}" for name in buffers)
    for i, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                out.extend(f"optimizer {i}'s state {k!r} of parameter {param_names.get(id(p), '?')}"
                           for k, v in sorted(opt.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
    return out


#: Why a member enabled without an optimizer hook lets no restarted node in.
NO_OPTIMIZER = (
    "odc.fsdp.enable(model, None, elastic=...) hooks no optimizer, so odc.fsdp does not know the state the "
    "loop's optimizer keeps, and a rejoined replica would start it afresh (step 0, zero moments) and diverge; "
    "a job that lets restarted nodes rejoin passes its optimizer(s) to enable"
)


class Replica:
    """What an elastic member's replica holds beyond its parameter shards, which a rejoining node copies, and
    the joiner's side of that copy.

    Tensors (:meth:`tensors`, copied one-sidedly when the members let the
    node in, right after their step): the parameters' local shards, every
    module buffer (``model.named_buffers()``: BatchNorm statistics, any
    ``register_buffer`` state; FSDP leaves buffers whole on every rank) and
    each optimizer's tensor state. The rest (:meth:`scalars`, JSON, served as
    the members' next minibatch starts, at its first gather, push or finish:
    after the loop's ``scaler.update()`` and ``scheduler.step()``, which
    follow the step, and unaffected by weights an evaluation block swaps in):
    each optimizer's ``param_groups`` numbers and settings, its
    per-parameter state that is not a tensor, ``scaler``'s and each of
    ``schedulers``' ``state_dict()``.
    """

    def __init__(self, model: Any, optimizers: list[torch.optim.Optimizer], scaler: Any = None,
                 schedulers: Sequence[Any] = ()) -> None:
        self.model = model
        self.optimizers = optimizers
        self.scaler = scaler
        self.schedulers = list(schedulers)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The model's buffers, by name, in ``named_buffers()`` order (FSDP1's wrapper prefixes left out)."""
        return [(n.replace("_fsdp_wrapped_module.", ""), b) for n, b in self.model.named_buffers()]

    def tensors(self, groups: list[_Group]) -> list[torch.Tensor]:
        """The tensors a joiner copies (:func:`replica_state` with the model's buffers)."""
        return replica_state(groups, self.optimizers, [b for _, b in self.buffers()])

    def names(self, groups: list[_Group]) -> list[str]:
        """What each of :meth:`tensors` is, for errors."""
        params = {id(p): n.replace("_fsdp_wrapped_module.", "") for n, p in self.model.named_parameters()}
        return _state_names(groups, self.optimizers, [n for n, _ in self.buffers()], params)

    def refusal(self) -> str:
        """Why this replica cannot be copied to a rejoining node (empty: it can)."""
        return "" if self.optimizers else NO_OPTIMIZER

    def check(self, what: str) -> None:
        """Refuses (naming it) a buffer that is not a contiguous host tensor, or a value of the state that is
        not a tensor which cannot be copied (see :func:`odc._rejoin.encode`).

        Raises:
            ConfigError: naming the buffer or the value, and ``what`` refused it.
        """
        for name, buf in self.buffers():
            if buf.device.type != "cpu" or not buf.is_contiguous():
                raise ConfigError(
                    f"{what}: buffer {name} ({buf.dtype}, {tuple(buf.shape)}) is "
                    f"{'on ' + str(buf.device) if buf.device.type != 'cpu' else 'not contiguous'}: elastic rejoin "
                    "copies the bytes of contiguous host tensors"
                )
        try:
            _rejoin.scalar_state(self.optimizers, self.scaler, self.schedulers)
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}") from None

    def scalars(self) -> bytes:
        """The state that is not tensors, as JSON (:func:`odc._rejoin.scalar_state`); where a value cannot be
        copied, a refusal that names it (the joiner raises it, this rank warns and goes on)."""
        try:
            doc: dict[str, Any] = _rejoin.scalar_state(self.optimizers, self.scaler, self.schedulers)
        except ConfigError as e:
            warnings.warn(f"odc.fsdp: a rejoining node cannot copy this replica: {e}", RuntimeWarning, stacklevel=2)
            doc = {"refused": str(e)}
        return json.dumps(doc).encode()

    def serve(self, engine: Any, groups: list[_Group]) -> Any:
        """A member, where its last round admitted a node (after the step): lets it in (``engine.admit``:
        :meth:`tensors` served now, :meth:`scalars` at the new generation's first operation) and returns the
        engine to go on with; where this replica cannot be copied, declines the node alike on every member (an
        ``"abandoned"`` event naming why) and returns ``engine``."""
        why = self.refusal()
        state: list[torch.Tensor] = []
        if not why:
            try:
                state = self.tensors(groups)
                _rejoin.check_state(state, "odc.fsdp")
            except ConfigError as e:
                why = str(e)
        if why:
            engine._decline(why)
            return engine
        return engine.admit(state, extra=self.scalars)

    def load(self, raw: bytes, source: int) -> None:
        """The joiner: takes rank ``source``'s :meth:`scalars` (see :func:`odc._rejoin.load_scalar_state`)."""
        _rejoin.load_scalar_state(raw, self.optimizers, self.scaler, self.schedulers, source)


def materialize_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Makes each optimizer create its per-parameter state (torch's optimizers do at their first step) with one
    step on zero gradients: a joining rank's state then has the layout its source's has, and the copy
    overwrites every value that step changed (parameters, moments, step counts)."""
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
