"""The private torch state ODC reads, imported in this one module and guarded by torch version.

``odc.fsdp`` installs ODC through FSDP2's public seams, but it must read some
private FSDP2 state (parameter groups, their mesh info, divide factors, the
all-gather inputs) and subclass FSDP2's comm base classes, which live in a
private module. A torch release may move or rename any of it. Importing
``odc.fsdp`` or ``odc.backend`` must still work then: every name is imported
here inside a guard, and :func:`check_fsdp2` (called by
``odc.fsdp.enable``) raises :class:`odc.ConfigError` naming the running torch,
the versions checked and what is missing. Where everything is present but the
version was not checked, it warns once per call.

Checked on :data:`TORCH_VERSIONS_CHECKED`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from .errors import ConfigError

#: torch versions whose private FSDP2 state this module was checked against.
TORCH_VERSIONS_CHECKED = ("2.15.0",)

_missing: list[str] = []


def _placeholder(name: str) -> type:
    """A stand-in base class for a name this torch lacks (so ``odc.fsdp`` still imports)."""
    return type(name, (), {"__doc__": f"{name} is missing from this torch; odc.fsdp.enable refuses to run."})


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
    _get_gradient_divide_factors = _get_param_all_gather_inputs = None  # type: ignore[assignment]

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo
except ImportError as e:  # pragma: no cover - depends on the torch build
    _missing.append(f"torch.distributed.fsdp._fully_shard._fsdp_common (mesh infos): {e}")
    DDPMeshInfo, FSDPMeshInfo, HSDPMeshInfo = (_placeholder(n) for n in ("DDPMeshInfo", "FSDPMeshInfo", "HSDPMeshInfo"))

try:
    # Not re-exported by torch.distributed; the backend's default-options fallback needs it.
    from torch.distributed.distributed_c10d import AllgatherOptions
except ImportError:  # pragma: no cover - depends on the torch build
    AllgatherOptions = None  # type: ignore[assignment,misc]

#: What each FSDP2 parameter group must carry for odc.fsdp (read in odc.fsdp and odc._fsdp_grads).
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
            raise ConfigError(
                f"odc.fsdp cannot run on {_where()}: FSDP2's {what} has no {name!r} (private state that "
                "odc.fsdp reads); install one of the checked versions or keep FSDP2's own collectives"
            )
