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
    odc.weights: rollout weights: :class:`WeightReader` reads the versions a
        trainer serves (``odc.fsdp.serve_weights``) from outside its group.
"""

from __future__ import annotations

import os as _os
import site as _site
import sys as _sys

from . import errors, packing
from ._odc import __version__
from .engine import Bucket, Engine
from .errors import (
    ConfigError,
    CudaError,
    FabricError,
    GpuUnavailable,
    InternalError,
    LayoutError,
    MalformedError,
    NodeDropped,
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
from .weights import ReadResult, VersionRefused, WeightReader


def probe() -> dict[str, dict[str, object]]:
    """What GPU support this process finds, part by part: ``{"nvrtc": ..., "nvshmem": ..., "cuda": ...}``.

    Each part holds the facts (for NVRTC and NVSHMEM the file loaded and its
    version; for CUDA the device, its architecture and the driver's CUDA
    version) or ``{"error": ...}`` naming what is missing and where it was
    looked for. Never raises for a missing GPU or library.
    """
    from ._odc import probe as _probe

    return _probe()


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
    "InternalError",
    "LayoutError",
    "MalformedError",
    "NodeDropped",
    "NvshmemError",
    "OdcError",
    "OdcOSError",
    "PackingError",
    "PeerDied",
    "PeerError",
    "PeerTimeout",
    "ProtocolError",
    "ReadResult",
    "RegistrationError",
    "ShmSpaceError",
    "StoreError",
    "TransportError",
    "VersionRefused",
    "WeightReader",
    "__version__",
    "errors",
    "packing",
    "probe",
    "register",
]


def _site_packages_for_native_libraries() -> None:
    # The native core looks for NVRTC and NVSHMEM (loaded on first use, not at import) in PyPI wheels
    # (nvidia-cuda-nvrtc, nvidia-nvshmem-cu12/-cu13) under these folders first: the wheels of the interpreter
    # running ODC, wherever it lives (no venv needed).
    if _os.environ.get("ODC_SITE_PACKAGES"):
        return
    getsitepackages = getattr(_site, "getsitepackages", None)  # absent in some embedded interpreters
    dirs: list[str] = list(getsitepackages()) if getsitepackages is not None else []
    if _site.ENABLE_USER_SITE:  # `pip install --user`'s wheels (off under python -s)
        dirs.append(_site.getusersitepackages())
    dirs.extend(p for p in _sys.path if p.endswith(("site-packages", "dist-packages")))
    seen = [d for i, d in enumerate(dirs) if d and d not in dirs[:i] and _os.path.isdir(d)]
    if seen:
        _os.environ["ODC_SITE_PACKAGES"] = _os.pathsep.join(seen)


_site_packages_for_native_libraries()
