"""Which transport an enabled model's engine gets: by the parameters' device and the node count,
unless ``transport=`` or ``ODC_TRANSPORT`` says; checked before anything is registered."""

from __future__ import annotations

import os

import torch

from ..engine import CUDA_TRANSPORTS, TRANSPORTS, transport_name
from ..errors import ConfigError
from ._private import _Group


def requested(transport: str | None) -> tuple[str | None, str]:
    """The transport asked for and where it was asked: the ``transport=`` argument, else ``ODC_TRANSPORT``."""
    if transport is not None:
        return transport, "the transport argument"
    return os.environ.get("ODC_TRANSPORT") or None, "ODC_TRANSPORT"


def _param_device(groups: list[_Group]) -> torch.device:
    """The one device every parameter group lives on (CPU or CUDA)."""
    devices = {g.pg.device: g.name for g in groups}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ConfigError(f"odc.fsdp.enable: the parameter groups live on several devices ({where}); ODC needs one")
    (device,) = devices
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"odc.fsdp.enable: {groups[0].name} is on {device}; ODC moves CPU tensors (shm, libfabric, emu-ipc, "
            "emu-shmem) and CUDA tensors (cuda-ipc, nvshmem)"
        )
    return device


def _pick_transport(
    groups: list[_Group], requested: str | None, source: str, nodes: int | None, sharding: str = "full"
) -> str | None:
    """The transport the engine gets for these parameter groups, checked before anything is registered.

    Args:
        groups: the parameter groups (all on one device).
        requested: the ``transport=`` argument, else ``ODC_TRANSPORT``, else None.
        source: where ``requested`` came from (for messages).
        nodes: how many nodes the ranks span (None: not known yet, not checked).
        sharding: ``"full"``, ``"hybrid"`` or ``"hybrid-zero"``.

    Returns:
        For CUDA parameters ``"cuda-ipc"`` on one node, ``"nvshmem"``
        across nodes (or ``requested`` when it names one of them); for CPU
        ones ``requested`` (None: the engine's default).
    """
    device = _param_device(groups)
    name = transport_name(requested)
    if name is not None and name not in TRANSPORTS:
        raise ConfigError(
            f"odc.fsdp.enable: unknown transport {requested!r} (from {source}); "
            f"expected one of {', '.join(TRANSPORTS)}"
        )
    where = f"{groups[0].name} is on {device}"
    if device.type == "cuda":
        if name not in (None, "auto", *CUDA_TRANSPORTS):
            raise ConfigError(
                f"odc.fsdp.enable: transport {requested!r} (from {source}) cannot carry CUDA tensors and {where}; "
                "CUDA parameters take 'cuda-ipc' (the default on one node) or 'nvshmem' (the default across nodes)"
            )
        if nodes is None or nodes == 1:
            return name if name in CUDA_TRANSPORTS else "cuda-ipc"
        if sharding == "hybrid-zero":
            raise ConfigError(
                f"odc.fsdp.enable: {where} and sharding is 'hybrid-zero', which ODC runs on its host "
                "transports only (the reduce across nodes and the piece exchange work on host memory); use "
                "sharding='full' (cuda-ipc / nvshmem) or keep FSDP2's own collectives for this model"
            )
        if sharding == "hybrid":
            raise ConfigError(
                f"odc.fsdp.enable: {where}, the job spans {nodes} nodes and sharding is 'hybrid': ODC sums "
                "the replicas' gradient shards across nodes in host memory, which its GPU transports do not "
                "keep; use sharding='full' (nvshmem) or keep FSDP2's own collectives for this model"
            )
        if name == "cuda-ipc":
            raise ConfigError(
                f"odc.fsdp.enable: transport {requested!r} (from {source}) serves one node and the job spans "
                f"{nodes} nodes; use 'nvshmem' (the default for CUDA parameters across nodes)"
            )
        return "nvshmem"
    if name in CUDA_TRANSPORTS:
        raise ConfigError(
            f"odc.fsdp.enable: transport {requested!r} (from {source}) moves CUDA tensors, but {where}; "
            "use 'shm' / 'auto' for CPU parameters ('emu-ipc' / 'emu-shmem' run the GPU transports' device "
            "code paths on them)"
        )
    return requested


