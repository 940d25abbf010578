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
    """Registers the torch.distributed backend ``"odc"`` (idempotent).

    ``import odc`` already does it, so ``init_process_group("odc")`` works
    after the import on every supported torch; torch 2.14 and later also
    find the backend without any import, through the
    ``torch.distributed.backends`` entry point (which calls this).
    """
    from .backend import register as _register

    _register()


def _register_backend_on_import() -> None:
    # torch 2.11 to 2.13 do not read the torch.distributed.backends entry point: importing odc
    # must be enough there. A torch built without distributed support has no backends to register.
    import torch.distributed

    if torch.distributed.is_available():
        register()


_register_backend_on_import()


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
