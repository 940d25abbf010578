"""The second step of ``odc.fsdp.enable`` and ``odc.fsdp.rejoin``: the engine of a described model
(:func:`make`, :func:`make_joining`).

It picks the transport (:mod:`._transport`: by the parameters' device and the node count, unless asked, checked
before anything is registered), the deadline (the process group's timeout unless asked), the sharding, and
registers the buckets collectively: one per parameter group, then the clip's norm bucket, the skip bucket and
:func:`odc.fsdp.global_sum`'s. A rejoining rank's engine is the one of the generation that admits its node,
with the replica state it copied. It reads only the described model (:class:`._private._Model`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..deadline import deadline_for
from ..engine import Bucket, Engine, _local_world_size
from ..errors import ConfigError
from ._private import _Group, _Layout, _Model, materialize_optimizer_state, prefix_store
from ._state import _NORM_BUCKET, _SKIP_BUCKET
from ._sum import _SUM_BUCKET, sum_bucket_numel
from ._transport import _param_device, _pick_transport, requested

_enables = itertools.count()  # one per enable() or rejoin() in this process; equal on every rank
#: Where members enabled without an optimizer hook say so, under the store prefix a joiner's rejoin shares with them.
_REFUSED = "rejoin-refused"


def make(m: _Model, *, store: Any, transport: str | None, chunk_bytes: int | None, timeout: float | None,
         deterministic: bool, cross_node: str | None, elastic: bool | str,
         compress: dict[str, Any] | None = None) -> Engine:
    """The engine of ``m`` (more than one rank), its buckets registered with every peer's."""
    groups, layout = m.groups, m.layout
    device = _param_device(groups)
    store = _job_store(layout, store)
    # Ranks per node: the shard group under hybrid sharding; under full sharding only CUDA parameters need it
    # now (cuda-ipc or nvshmem).
    local = layout.shards if layout.sharding == "hybrid" else layout.per_node
    if local is None and device.type == "cuda":
        local = _local_world_size(store, layout.rank, layout.world, "odc")
    nodes = layout.world // local if local else None
    chosen = _pick_transport(groups, *requested(transport), nodes, layout.sharding)
    # ODC waits as long as FSDP's process group would (its timeout), unless ODC_TIMEOUT_S or timeout= says.
    seconds, deadline_source = deadline_for(m.process_group, explicit=timeout)
    kw: dict[str, Any] = {"chunk_bytes": chunk_bytes, "timeout": seconds, "deadline_source": deadline_source,
                          "transport": chosen, "deterministic": deterministic, "cross_node": cross_node,
                          "compress": compress}
    if device.type == "cuda":
        kw["device"] = device.index if device.index is not None else torch.cuda.current_device()
    if layout.sharding == "hybrid":
        engine = Engine(store, layout.rank, layout.world, local_world_size=layout.shards, sharding="hybrid",
                        elastic=bool(elastic), **kw)
    elif layout.sharding == "hybrid-zero":
        engine = Engine(store, layout.rank, layout.world, local_world_size=local, sharding="hybrid-zero", **kw)
    else:
        engine = Engine(store, layout.rank, layout.world, local_world_size=local, **kw)
    engine.register(buckets(groups, layout.shards, layout.world))
    if m.replica is not None and (why := m.replica.refusal()):
        # A job without an optimizer hook lets no node rejoin: a joiner's rejoin reads why here at once.
        store.set(_REFUSED, why)
    return engine


def make_joining(m: _Model, *, store: Any, transport: str | None, chunk_bytes: int | None, timeout: float | None,
                 deterministic: bool) -> Engine:
    """A restarted node's rank: the engine of the generation that admits its node, and its replica (``m.replica``)
    copied from a member's (the tensors one-sidedly, what is not a tensor as the member's next minibatch starts)."""
    groups, layout = m.groups, m.layout
    chosen = _pick_transport(groups, *requested(transport), layout.world // layout.shards, "hybrid")
    seconds, deadline_source = deadline_for(m.process_group, explicit=timeout)
    store = _job_store(layout, store)
    if store.check([_REFUSED]):
        raise ConfigError(f"odc.fsdp.rejoin: the members let no node rejoin: {store.get(_REFUSED).decode()}")
    replica = m.replica
    if replica is None:  # pragma: no cover - describe_joiner makes one
        raise ConfigError("odc.fsdp.rejoin: nothing to copy the replica into")
    materialize_optimizer_state(m.optimizers)
    engine = Engine.rejoin(store, layout.rank, layout.world, buckets(groups, layout.shards, layout.world),
                           replica.tensors(groups), local_world_size=layout.shards, timeout=seconds,
                           deadline_source=deadline_source, transport=chosen, sharding="hybrid",
                           deterministic=deterministic, chunk_bytes=chunk_bytes, extra=True,
                           names=replica.names(groups))
    replica.load(engine.extra_state or b"", int(engine.rejoin_source if engine.rejoin_source is not None else -1))
    return engine


def buckets(groups: list[_Group], ws: int, world: int) -> list[Bucket]:
    """The engine's buckets: one per parameter group (its ``ws`` shards), the clip's norm bucket, the skip
    bucket, and :func:`odc.fsdp.global_sum`'s (a block per rank of the ``world`` in each shard)."""
    return [Bucket(g.name, ws * g.n, g.dtype) for g in groups] + [
        Bucket(_NORM_BUCKET, ws, torch.float32),
        Bucket(_SKIP_BUCKET, ws, torch.float32),
        Bucket(_SUM_BUCKET, sum_bucket_numel(ws, world), torch.float32),
    ]


def _job_store(layout: _Layout, store: Any) -> Any:
    """The store this enable's engine meets its peers through: ``store`` (default: the default group's) under a
    prefix every rank of the job computes alike (the enable's number in this process, the mesh's ranks)."""
    return prefix_store(f"odc-fsdp/{next(_enables)}/{'-'.join(map(str, layout.members))}/", store)
