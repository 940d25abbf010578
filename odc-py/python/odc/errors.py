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
    "RegistrationError",
    "ShmSpaceError",
    "StoreError",
    "TransportError",
]


class OdcError(Exception):
    """Base class of every error raised by ODC.

    Catch it to handle any ODC failure in one place. Every engine error's
    message names what it needs to be acted on: the peer, the bucket, what was
    awaited, the native call that failed.
    """


class PackingError(OdcError, ValueError):
    """Bad input to the packer.

    Raised by every ``odc.packing`` function (the verl-compatible ones
    included) and, as exit status 2, by ``odc-pack``: empty input, a zero,
    negative or non-integer length, more partitions than items, a sample
    longer than ``max_tokens``, an unknown strategy or cost model, a size or
    seed out of range. The message names the value and its index.

    What to do: fix that value; raise ``max_tokens`` (or drop the sample) when
    one sample does not fit a microbatch.
    """


class LayoutError(OdcError, ValueError):
    """A buffer does not match its bucket.

    Raised by :class:`odc.Engine` calls and ``odc.fsdp`` when a tensor has the
    wrong size, dtype or device, is not contiguous, names an unknown bucket or
    an offset out of range; by ``odc.fsdp`` when a ``fully_shard`` unit is
    partly frozen or a parameter has no gradient where FSDP2 on torch 2.11 /
    2.12 cannot say so; by the ``odc`` backend on a dtype it does not move.

    What to do: pass tensors laid out as the bucket was registered (the
    message gives the expected and actual values); freeze whole ``fully_shard``
    units; on torch 2.13 and later call
    ``set_reduce_scatter_unused_params(True)`` for parameters without a
    gradient.
    """


class RegistrationError(OdcError):
    """Ranks registered different bucket lists, or a bucket was used before registration.

    Raised by :meth:`odc.Engine.register` (and ``odc.fsdp.enable``, which
    registers every FSDP parameter group) on every rank; the message names the
    first differing bucket, this rank's and the peer's.

    What to do: build the same model, wrapped the same way, on every rank,
    and register in the same order; register before any publish, gather or
    push.
    """


class ProtocolError(OdcError):
    """Calls in an order the protocol (or the loop contract) forbids.

    Raised by the engine for a publish before register, versions that do not
    increase or a corrupt landing slot; by ``odc.fsdp`` when a loop breaks the
    loop contract: gradients read before the minibatch's last backward, a
    second ``optimizer.step()`` in one minibatch, gradients cleared or
    parameters changed inside a minibatch (the message names the group or
    parameter), a loop that left ``odc.fsdp.microbatches`` early.

    What to do: read gradients, step and change parameters only between
    minibatches (the docs' loop-contract page); wrap an evaluation of other
    weights in ``odc.fsdp.evaluation(model)``.
    """


class MalformedError(ProtocolError):
    """A peer wrote a landing-slot header, control word or descriptor that does not fit the registered layout.

    It was refused, never applied; the message names the peer, what it wrote and the field.
    """


class ConfigError(OdcError, ValueError):
    """An invalid engine configuration or topology, or a setting ODC cannot honour.

    Raised before anything is registered: an unknown transport or sharding,
    a world that does not split into nodes, a landing budget too small for
    the shard group, a torch outside the supported range (``odc.fsdp``), FSDP
    settings ODC refuses (HSDP meshes under ``sharding="full"``, CPU offload,
    optimizer-in-backward hooks), a bad environment variable value.

    What to do: follow the message; it names the setting and the values it
    takes. ``ODC_ALLOW_UNCHECKED_TORCH=1`` runs a newer torch, with a warning.
    """


class OdcOSError(OdcError, OSError):
    """An operating-system error outside the transport (files, the file store, processes).

    What to do: read the ``errno`` and message; usually a path or permission.
    """


class TransportError(OdcError):
    """A transport operation failed: mapping, reading or writing a peer's region.

    Raised by gathers, pushes and registration; the message names the
    operation (``shm_open``, ``mmap``, ``get``, ...), what it was applied to and
    why. Its subclasses name the native library that failed.

    What to do: check that every rank runs on a host that reaches the others
    (same ``/dev/shm`` within a node, a routable ``ODC_FABRIC_ADDR`` between
    nodes) and that no stale process holds the job's segments.
    """


class FabricError(TransportError):
    """A libfabric call failed (the ``fabric`` transport); the message names the call and its fi errno.

    What to do: check ``ODC_FABRIC_PROVIDER`` (``tcp``, ``verbs``, ``efa``) and
    ``ODC_FABRIC_ADDR`` (this host's address on the fabric network), and that
    the provider's devices are visible in the container.
    """


class ShmSpaceError(TransportError):
    """``/dev/shm`` has too little room for the engine's shared memory.

    Raised at registration on every rank, before any rank allocates (instead
    of a SIGBUS at the first touch of a page); the message names the folder,
    the bytes needed and the bytes free.

    What to do: give the container a larger ``/dev/shm`` (``docker run
    --shm-size=16g``; the docs' containers page has the formula), lower
    ``ODC_LANDING_MB``, or remove other jobs' segments.
    """


class CudaError(TransportError):
    """A CUDA driver call failed (device memory, streams, kernels); the message names the call.

    What to do: check the device is visible and has memory free; a failure
    after an earlier CUDA error in the process is usually that error's
    consequence.
    """


class NvshmemError(TransportError):
    """An NVSHMEM call failed; the message names the call.

    What to do: check that every rank started NVSHMEM with the same world and
    that its symmetric heap fits the device (ODC sizes it from the registered
    buckets).
    """


class GpuUnavailable(OdcError):
    """A GPU transport cannot run here: the CUDA driver, a device, NVRTC or the NVSHMEM library is missing.

    Raised when a ``cuda-ipc`` or ``nvshmem`` engine is created (never a
    panic); the message names what is missing and where it was looked for.

    What to do: install what it names (``pip install nvidia-cuda-nvrtc`` /
    ``nvidia-nvshmem-cu12``, or set ``ODC_NVRTC_LIB`` / ``ODC_NVSHMEM_LIB``);
    ``odc.probe()`` prints what this process finds.
    """


class StoreError(OdcError):
    """The rendezvous store failed or a key never appeared.

    Raised at engine creation and registration, when ranks exchange their
    descriptors through the store (torch's ``TCPStore`` or a file store).

    What to do: check that every rank reaches the store (``MASTER_ADDR``,
    ``MASTER_PORT``) and that all ranks of the job started.
    """


class PeerError(OdcError):
    """A peer rank failed; ``peer`` names it.

    Attributes:
        peer: the rank that failed (for :class:`PeerDied`, the one that died
            first, also when another rank passed the news on), or ``None``.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTimeout(PeerError):
    """A wait on a peer passed its deadline while the peer still looked alive.

    The message names the peer, the bucket and what was awaited; a note names
    the deadline and where it came from (``timeout=``, ``ODC_TIMEOUT_S``, the
    process group's timeout, or the 300 s default).

    What to do: look at what that peer was doing (a rank stuck in a
    collective of its own, a much slower rank, a loop that makes a collective
    per microbatch with uneven counts); raise the deadline if the work is
    just slow.
    """


class PeerDied(PeerError):
    """A peer process exited (or closed its engine) while this rank depended on it.

    Seen within about 50 ms on one host (each rank holds a lock the kernel
    drops when it dies) and within seconds across hosts. Every survivor
    names the rank that died first; ``reported by rank N`` says who passed the
    news on.

    What to do: read that rank's own error or crash; this one is its
    consequence.
    """


class InternalError(OdcError):
    """A bug in ODC: its native code panicked, and the panic was caught instead of aborting the process.

    Raised by the :class:`odc.Engine` call that panicked, or, when the rank's
    shard server daemon (a thread of the engine) panicked, by every later call
    of that rank's engine. The message names the rank and what it was doing
    (the call, or the daemon's step: whose chunk of which bucket, which
    minibatch); the panic's location is on the rank's stderr. The other ranks
    see the rank as gone and raise :class:`PeerDied` naming it.

    What to do: report it with the message and the rank's stderr. The rank's
    engine cannot go on; the job restarts as after a crash.
    """


class NodeDropped(OdcError):
    """Elastic hybrid sharding dropped this rank's node from the job.

    Raised by ``finish_minibatch`` (and so by ``odc.fsdp``'s end of a
    minibatch) on the surviving ranks of a node one of whose ranks died or
    failed: a replica with a hole cannot serve, so the other nodes go on
    without it from that minibatch on (``odc.Engine(elastic=True)``,
    ``odc.fsdp.enable(..., elastic=True)``). The message names the node and
    the minibatch.

    What to do: let the rank exit. Rejoining a running job is not supported
    yet; the job goes on with the other nodes.
    """
