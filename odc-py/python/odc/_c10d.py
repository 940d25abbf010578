"""torch.distributed (c10d) behaviour that differs across the supported torch releases (2.11 to 2.15).

The FSDP2 state odc.fsdp reads is described in ``odc.fsdp._private``; this module holds the few c10d
names the backend and the FSDP2 seams read whose shape changed between releases, each with the
releases it was checked on.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._C import _distributed_c10d as _c10d

__all__ = ["backend_base", "gloo_method", "init_backend", "premul_factor", "python_backends"]

#: Backend methods whose names torch 2.13 added beside older ones with the same signature: gloo on torch 2.11
#: and 2.12 has only the older names (``alltoall_base``, ``_allgather_base``), which 2.13 to 2.15 keep.
_GLOO_OLD_NAMES = {"all_to_all_single": "alltoall_base", "all_gather_single": "_allgather_base"}


def gloo_method(backend: Any, op: str) -> Any:
    """``backend``'s method for the process-group operation ``op``, by the name every supported torch has."""
    return getattr(backend, _GLOO_OLD_NAMES.get(op, op))


def premul_factor(op: Any) -> float | torch.Tensor | None:
    """The factor of a ``PREMUL_SUM`` ``ReduceOp`` (``dist._make_nccl_premul_sum(f)``), else None.

    torch 2.13 to 2.15 expose it as ``op.factor``; 2.11 and 2.12 have no such
    property, and the op's pickled state ``(RedOpType, factor)`` carries it
    (checked on 2.11.0, 2.12.0; ``factor`` on 2.13.0, 2.14.0, 2.15.0).
    """
    factor = getattr(op, "factor", None)
    if factor is not None:
        return factor  # type: ignore[no-any-return]
    state = getattr(op, "__getstate__", None)
    if state is None:
        return None
    try:
        parts = state()
    except (TypeError, RuntimeError):
        return None
    if isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[1], (float, int, torch.Tensor)):
        return parts[1]
    return None


@functools.cache
def python_backends() -> bool:
    """Whether a Python class derived from ``torch._C._distributed_c10d.Backend`` can stand behind a
    ``ProcessGroup``: torch's dispatcher reaching the ``c10d`` ops' CPU and CUDA kernels then calls its
    methods (``all_gather_single``, ``allreduce``, ...) through a pybind trampoline (``PyBackend``,
    ``torch/csrc/distributed/c10d/py/PyBackend.hpp``).

    True on torch 2.15.0. False on 2.11.0, whose ``Backend`` binding has no trampoline and no
    constructor (``TypeError: ... No constructor defined!``): there :mod:`odc.backend._route` registers
    the ``c10d`` ops' kernels for ``odc`` groups instead. Decided by trying, not by version number.
    """

    class _Probe(_c10d.Backend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:
        return False
    return True


def backend_base() -> type:
    """The base class of the ``odc`` backend object: torch's ``Backend`` where :func:`python_backends`,
    else ``object`` (a plain object that the group of :mod:`odc.backend._route` holds)."""
    return _c10d.Backend if python_backends() else object


def init_backend(backend: Any, rank: int, size: int) -> None:
    """Initializes the ``Backend`` part of ``backend`` (a no-op where the base is ``object``)."""
    if python_backends():
        _c10d.Backend.__init__(backend, rank, size)
