"""The exception hierarchy of ODC.

Every error raised by the native core maps one-to-one to a class here, all
rooted at :class:`OdcError`. Errors caused by bad input also derive from
:class:`ValueError`, so code that already catches ``ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CudaError",
    "FabricError",
    "GpuUnavailable",
    "LayoutError",
    "MalformedError",
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
]


class OdcError(Exception):
    """Base class of every error raised by ODC."""


class PackingError(OdcError, ValueError):
    """Bad input to the packer: lengths, strategy, cost model, budget or partition count."""


class LayoutError(OdcError, ValueError):
    """A buffer does not match its bucket: wrong size, dtype, unknown bucket, offset out of range."""


class RegistrationError(OdcError):
    """Ranks registered different bucket lists, or a bucket was used before registration."""


class ProtocolError(OdcError):
    """Calls in an order the protocol forbids: publish before register, versions that do not increase."""


class MalformedError(ProtocolError):
    """A peer wrote a landing-slot header, control word or descriptor that does not fit the registered layout.

    It was refused, never applied; the message names the peer, what it wrote and the field.
    """


class ConfigError(OdcError, ValueError):
    """An invalid engine configuration or topology."""


class OdcOSError(OdcError, OSError):
    """An operating-system error outside the transport."""


class TransportError(OdcError):
    """A transport operation failed (mapping, reading or writing a peer's region)."""


class FabricError(TransportError):
    """A libfabric call failed (the ``fabric`` transport); the message names the call and its fi errno."""


class ShmSpaceError(TransportError):
    """``/dev/shm`` has too little room for the engine's shared memory; the message names the bytes needed and free."""


class CudaError(TransportError):
    """A CUDA driver call failed (device memory, streams, kernels); the message names the call."""


class NvshmemError(TransportError):
    """An NVSHMEM call failed; the message names the call."""


class GpuUnavailable(OdcError):
    """A GPU transport cannot run here: the CUDA driver, a device, NVRTC or the NVSHMEM library is missing."""


class StoreError(OdcError):
    """The rendezvous store failed or a key never appeared."""


class PeerError(OdcError):
    """A peer rank failed; ``peer`` names it."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTimeout(PeerError):
    """A wait on a peer passed its deadline; the message names the peer, bucket and what was awaited."""


class PeerDied(PeerError):
    """A peer process exited while this rank depended on it."""
