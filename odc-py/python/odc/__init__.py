"""ODC: on-demand communication for FSDP.

FSDP's per-layer all-gather and reduce-scatter make every rank wait for the
slowest one. ODC replaces them with one-sided **gather** (read a parameter
shard from its owner) and **scatter-accumulate** (push a gradient chunk to its
owner, whose server daemon adds it in), so ranks synchronize once per
minibatch and may run different numbers of microbatches.

Modules:
    odc.packing: microbatch plans (LocalSort, LB-Micro, LB-Mini, verl-native),
        Karmarkar–Karp, bubble-rate predictions.
    odc.engine: :class:`Engine`, the worker API (gather, scatter_accumulate,
        finish_minibatch) on torch tensors: CPU tensors over shared memory and
        libfabric, CUDA tensors over ``cuda-ipc`` (one node) or ``nvshmem``
        (several nodes).
    odc.fsdp: ``odc.fsdp.enable(model, optimizer)``, FSDP2 on ODC (picks
        ``cuda-ipc`` / ``nvshmem`` for CUDA parameters).
    odc.errors: the exception hierarchy rooted at :class:`OdcError`.
"""

from __future__ import annotations

from . import errors, packing
from ._odc import __version__
from .engine import Bucket, Engine
from .errors import (
    ConfigError,
    CudaError,
    FabricError,
    GpuUnavailable,
    LayoutError,
    NvshmemError,
    OdcError,
    OdcOSError,
    PackingError,
    PeerDied,
    PeerError,
    PeerTimeout,
    ProtocolError,
    RegistrationError,
    ShmSpaceError,
    StoreError,
    TransportError,
)


def register() -> None:
    """Registers the torch.distributed backend ``"odc"`` (also done by torch's entry point)."""
    from .backend import register as _register

    _register()


__all__ = [
    "Bucket",
    "ConfigError",
    "CudaError",
    "Engine",
    "FabricError",
    "GpuUnavailable",
    "LayoutError",
    "NvshmemError",
    "OdcError",
    "OdcOSError",
    "PackingError",
    "PeerDied",
    "PeerError",
    "PeerTimeout",
    "ProtocolError",
    "RegistrationError",
    "ShmSpaceError",
    "StoreError",
    "TransportError",
    "__version__",
    "errors",
    "packing",
    "register",
]
