"""One-line FSDP2 integration: ``odc.fsdp.enable(model, optimizer)``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) re-assembles each parameter
group with an all-gather and shards its gradients with a reduce-scatter.
:func:`enable` swaps both for ODC through FSDP2's own seams
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``); no
FSDP function is patched. Ranks then synchronize once per minibatch, not per
layer, and may run different numbers of microbatches (LB-Mini), zero included.

How the protocol maps onto FSDP2 (``k`` is the minibatch, equal to the
version of the parameters it reads):

- ``enable``: every FSDP parameter group becomes one ODC bucket, registered
  collectively in FSDP's group order (numel = D · the group's padded shard
  length, dtype = its all-gather dtype).
- publish: a rank's first operation of minibatch ``k`` (its first gather or
  push, a gradient read, its step pre-hook where it ran nothing) publishes
  version ``k`` of its shards, FSDP's all-gather inputs as they are then. So
  whatever changed the parameters since the last step (a state-dict or DCP
  load, a second optimizer, ``clamp_`` or another in-place edit under
  ``no_grad``) is what every peer gathers: the parameter side of the loop
  contract. A parameter changed in place later in the minibatch is refused
  at this rank's next gather (:class:`odc.ProtocolError` naming it).
- all-gather (forward, and backward for groups resharded after forward):
  FSDP has already copied this rank's shard into the output; ODC reads the
  D − 1 other owners' shards of version ``k``.
- reduce-scatter (post-backward): pushes each owner's rows with
  scatter-accumulate (scale 1/D for AVG, ``op.factor`` for PREMUL_SUM, the
  lost post-divide for SUM), writes zeros into the output and does not wait.
- the gradient contract (``odc.fsdp._grads``): while minibatch ``k`` runs,
  every sharded ``.grad`` is a pending gradient; the first read of its values
  (torch's ``clip_grad_norm_``, ``GradScaler.unscale_``, a norm for the logs,
  the optimizer) finishes the minibatch: ``finish_minibatch(k)`` (this rank
  waits only for its own gradient shards), the final shards installed as
  ``.grad`` (also on ranks that ran no microbatch), the accumulators zeroed.
  The optimizer's step pre-hook does the same where nothing read them.
- optimizer step post-hook: starts minibatch ``k + 1``, whose first
  operation publishes the updated parameters. There is no barrier: each wait
  is a causal edge. A loop that
  clears the gradients of a finished minibatch without stepping (a skipped
  step) starts minibatch ``k + 1`` on the unchanged parameters.

The loop contract: read gradients (clip, unscale, log) only after the
minibatch's last backward; step once per minibatch (or skip the step and
call ``optimizer.zero_grad()``); clear gradients only between minibatches;
change parameters only between minibatches (after the step, before the next
forward). A loop that breaks it gets an :class:`odc.ProtocolError` naming the group
and what to call instead; optimizer-in-backward hooks (post-accumulate-grad
hooks) are refused at :func:`enable`. :func:`enable` wraps
``optimizer.zero_grad`` and ``model.zero_grad`` (on the instances) so a rank
with no microbatch still holds pending gradients; :func:`disable` restores
them.

Without an optimizer (``enable(model, None)``) the same two steps run from
:func:`minibatch`: leaving it finishes the minibatch, entering the next one
starts it (or a read finishes it, and ``model.zero_grad()`` after a step made
by hand starts the next one at the next forward).

Hybrid sharding (``enable(..., sharding="hybrid")``) runs on FSDP2's HSDP
layout: the model is ``fully_shard``-ed over a 2-D mesh ``(replicate, shard)``
= (nodes, ranks per node). A bucket then has G shards, one per rank of a
node; gathers and pushes stay inside the node and ``finish_minibatch`` sums
each shard over the N nodes once (the engine's cross-node reduce), so every
node's replica of the optimizer steps bitwise-identical gradients. FSDP's own
replicate all-reduce (a direct ``dist.all_reduce`` in ``foreach_reduce``,
not a seam) is switched off with ``set_requires_all_reduce(False)``; FSDP
then parks its (zero) reduce-scatter output as a pending partial instead of
assigning ``.grad``; ODC drops it when the minibatch finishes. FSDP's divide
factor under HSDP covers all D = N·G ranks (AVG on both collectives, or
PREMUL_SUM(1/f) then SUM), so pushes are scaled by 1/D, ``op.factor``, or
the post-divide computed over both groups.

Transports. CPU parameters use the engine's default (``shm`` within a node,
libfabric between nodes) unless told otherwise; CUDA parameters use
``cuda-ipc`` on one node (published shards, landing slots and accumulators
in device memory shared between the node's processes; every copy runs on the
stream FSDP made current for the comm, and the optimizer reads the
accumulators in place) and ``nvshmem`` across nodes (the same regions on
NVSHMEM's symmetric heap; full sharding only: hybrid sharding across nodes
on CUDA is refused). The ``transport=`` argument of :func:`enable`, else
``ODC_TRANSPORT``, overrides the choice; a transport that cannot carry the
parameters' tensors (``shm`` for CUDA parameters, ``cuda-ipc`` for CPU ones)
is refused before anything is registered. ``emu-ipc`` and ``emu-shmem`` run
CPU parameters through cuda-ipc's and nvshmem's device code paths (host
memory and host-thread streams).

Settings whose semantics ODC cannot keep are refused with :class:`odc.ConfigError`:
2-D meshes under ``sharding="full"``, 1-D meshes under ``sharding="hybrid"``,
shard groups that are not the ranks of one node, ``reshard_after_forward=int``
outside ``sharding="hybrid-zero"`` (whose gathers, the backward's re-gather included, read within the node),
tensor-subclass all-gather extensions, groups whose gradients are packed in
another order than their parameters (mixed gradient dtypes). A group whose
reduce-scatter input shrinks because a parameter got no gradient raises
:class:`odc.LayoutError` (use ``set_reduce_scatter_unused_params(True)``).
``set_force_sum_reduction_for_comms(True)`` and fp16 reduce dtypes are
handled: ODC applies FSDP's post-divide itself.

The comms are installed with the public ``FSDPModule.set_custom_all_gather``
/ ``set_custom_reduce_scatter`` of the module that owns each group (one call
per module; torch refuses a module whose ``fully_shard`` made several groups,
from per-parameter meshes, and so does :func:`enable`).

FSDP1 (``FullyShardedDataParallel``, verl's default ``strategy: fsdp``):
:func:`enable` takes the root FSDP1 module as well, under
``sharding="full"`` with ``ShardingStrategy.FULL_SHARD`` or ``SHARD_GRAD_OP``
and under ``sharding="hybrid"`` with ``HYBRID_SHARD`` or
``_HYBRID_SHARD_ZERO2``, ``use_orig_params`` False or True. Each ``FlatParameter`` is one bucket; the
push goes through FSDP1's public ``register_comm_hook`` and the gather
replaces each handle's ``_all_gather_flat_param`` (``odc.fsdp._fsdp1``,
which lists the private FSDP1 names it uses). The loop contract, the
minibatch protocol, deterministic sums and the clips (torch's, FSDP1's own
``model.clip_grad_norm_`` and :func:`clip_grad_norm_`) are the same;
``summon_full_params`` and FSDP1's state dicts unshard with FSDP1's own
all-gather, so a checkpoint loaded between minibatches reaches every peer.
Refused: ``NO_SHARD``, ``sharding="hybrid-zero"``, CPU offload,
``keep_low_precision_grads``.

Supported torch: :data:`TORCH_RANGE` (2.11 to 2.15), tested on both ends.
Private FSDP2 state is imported and checked in one module,
``odc.fsdp._private``, whose ``PRIVATE`` table lists every name read or
written with the releases it was checked on (:data:`TORCH_VERSIONS_CHECKED`)
and what stands in for it where a release lacks it (torch 2.11 holds one
parameter group per module, ``_fsdp_param_group``, where 2.12 and later hold
a list). Importing ``odc.fsdp`` never fails on another torch; :func:`enable`
raises :class:`odc.ConfigError` naming the running torch and the supported
range where the torch is outside it or a name it reads is missing, before
anything is registered (a newer torch runs with ``ODC_ALLOW_UNCHECKED_TORCH=1``
and a warning).

:func:`enable` (and :func:`rejoin`) is a pipeline of four steps, each in one
module: ``_model`` describes the model once (FSDP2 or FSDP1, its groups and
this rank's layout, the optimizers and what an elastic replica copies, every
refusal that needs nothing registered); ``_engine`` picks the transport and
makes the engine, its buckets registered; ``_binding.bind`` binds the
gradient contract and the optimizer hooks; and the kind's installer
(``_seams`` for FSDP2, ``_fsdp1`` for FSDP1), which the description carries,
puts ODC's gather and push in FSDP's seams.

The package, one way from the top: this module is the public API; ``_model``
and ``_engine`` (the pipeline's first steps) over ``_seams`` FSDP2's comm
seams and ``_fsdp1`` FSDP1's buckets, gather and comm hook (the only reader
of private FSDP1 state), with ``_clip`` (:func:`clip_grad_norm_`), ``_steal``
(:func:`microbatches`, work stealing) and ``_sum`` (:func:`global_sum`)
beside them; all of them call ``_binding``, the hooks of one enabled model,
which drive ``_grads``, the gradient contract, which drives ``_state``, the
minibatch state machine. ``_private`` (the only reader of private FSDP2
state) and ``_transport`` (the transport and device choice) sit under them
all. No module imports one above it (``make lint`` checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..errors import ProtocolError
from ..weights import serve_weights
from . import _binding, _engine, _model
from ._binding import _bound, _live, solo
from ._clip import clip_grad_norm_
from ._private import (
    TORCH_RANGE,
    TORCH_VERSIONS_CHECKED,
    TORCH_VERSIONS_TESTED,
    DefaultAllGather,
    DefaultReduceScatter,
)
from ._seams import _install_comms
from ._steal import microbatches, rerun_share
from ._sum import global_sum

__all__ = ["TORCH_RANGE", "TORCH_VERSIONS_CHECKED", "TORCH_VERSIONS_TESTED", "bytes_across_nodes", "clip_grad_norm_",
           "disable", "dropped", "elastic_events", "enable", "evaluation", "finish", "global_sum", "is_enabled",
           "members", "microbatches", "minibatch", "rejoin", "rerun_share", "serve_weights", "skip", "skipped"]


def is_enabled(model: Any) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    return getattr(model, "_odc_fsdp", None) is not None


def enable(
    model: Any,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    *,
    sharding: str = "full",
    chunk_bytes: int | None = None,
    timeout: float | None = None,
    transport: str | None = None,
    deterministic: bool = False,
    cross_node: str | None = None,
    elastic: bool | str = False,
    store: Any = None,
    compress: dict[str, Any] | None = None,
    scaler: Any = None,
    scheduler: Any = None,
) -> None:
    """Makes a ``fully_shard``-ed model's all-gathers and reduce-scatters ODC operations.

    Call on every rank, after ``fully_shard`` and before the first forward.
    Collective once (registration); afterwards no call waits on the slowest
    rank. Ranks may run different numbers of microbatches per minibatch.

    Hybrid sharding keeps parameters and gradients sharded within a node and
    every gather and push inside it; at the end of a minibatch each gradient
    shard is summed across the nodes once. Each node keeps a replica of the
    optimizer state for its shards, stepped on bitwise-identical gradients
    (as HSDP does). Shard the model over FSDP2's 2-D mesh::

        mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        odc.fsdp.enable(model, optimizer, sharding="hybrid")

    Ranks are node-major (node n runs ranks n·G … n·G + G − 1, as torchrun
    numbers them); ``LOCAL_WORLD_SIZE``, where set, is the node size G.
    FSDP's own cross-node all-reduce is switched off
    (``set_requires_all_reduce(False)``) until :func:`disable`.

    ZeRO++-style hybrid sharding (``sharding="hybrid-zero"``) keeps every
    gather and push inside the node too, but the optimizer state is sharded
    over all D ranks, as under full sharding: shard the model over the
    ordinary 1-D mesh of every rank and keep the optimizer over
    ``model.parameters()``::

        fully_shard(block, mesh=init_device_mesh("cuda", (world,)))  # every block, then the root
        odc.fsdp.enable(model, optimizer, sharding="hybrid-zero")

    FSDP2's shard of rank r (n·G + l) is then the piece of local rank l's
    node shard that ODC reduces across nodes into rank r alone; the engine
    keeps the node shards every gather reads (docs/hybrid-zero.md).

    Args:
        model: the root module returned by ``fully_shard``: over a 1-D mesh
            (``sharding="full"`` or ``"hybrid-zero"``) or a 2-D
            ``(replicate, shard)`` mesh (``sharding="hybrid"``); or the root
            ``FullyShardedDataParallel`` module (FSDP1: ``sharding="full"``, or ``"hybrid"`` for its
            hybrid strategies).
        optimizer: its optimizer; a step pre-hook finishes the minibatch and
            installs the gradients, a post-hook starts the next minibatch.
            Several (a list: a separate optimizer for the embeddings, say):
            the next minibatch starts once each has stepped (or at the first
            forward after a ``zero_grad``), and each one's ``zero_grad`` keeps
            the gradients of a rank with no microbatch pending.
            ``None``: wrap each minibatch in :func:`minibatch` instead.
        sharding: ``"full"`` (shard over every rank), ``"hybrid"`` (shard
            within a node, reduce gradients across nodes once per minibatch,
            a replica of the optimizer state per node) or ``"hybrid-zero"``
            (shard parameters and gradients within a node, optimizer state
            over every rank; host transports only).
        chunk_bytes: landing-slot size (default: the engine's). Each rank
            keeps ``2 · clients · chunk_bytes`` of landing slots, clients
            being every rank (full) or the ranks of its node (hybrid).
        timeout: seconds any wait on a peer may take (default
            ``ODC_TIMEOUT_S``, else the timeout of the process group FSDP
            shards over); past it :class:`odc.PeerTimeout` names the peer,
            with a note naming the deadline and where it came from.
        transport: the engine's transport (default ``ODC_TRANSPORT``, else
            picked by device): CPU parameters get the engine's default
            (``"auto"``: shm within a node, libfabric between nodes), CUDA
            parameters ``"cuda-ipc"`` (one node) or ``"nvshmem"`` (several
            nodes). See :class:`odc.Engine`.
        deterministic: make the final gradients the same bits run after run,
            whatever the order in which pushes reach their owners and
            whichever rank ran which microbatch (with
            :func:`microbatches` stealing, say): every contribution is added
            exactly, as a fixed-point integer, and read out once as the
            nearest f32 (16 more bytes per gradient-shard element; host
            transports only). The gradients are then at least as accurate as
            an f32 sum. Each microbatch's own gradient must itself be
            reproducible (the same kernels on the same hardware, e.g.
            ``torch.use_deterministic_algorithms(True)`` on GPU). Under
            hybrid sharding the cross-node sum is exact too, so the bits do
            not depend on which node ran which microbatch, and a minibatch
            run onto the gradients of the last one (a rerun,
            :func:`dropped`) gives the bits of one minibatch of both. See
            :class:`odc.Engine`.
        cross_node: under full sharding across nodes, how gradients for
            owners on other nodes cross the network: ``"direct"`` (every
            rank pushes its own, overlapped with the backward), ``"node"``
            (summed on the node and pushed once per node when its last rank
            finished the minibatch: G times fewer bytes, for waiting on the
            node's slowest rank) or ``"auto"`` (``"node"`` where nodes are
            joined by a network, ``"direct"`` on ``nvshmem``). Default ``ODC_CROSS_NODE``, else
            ``"auto"``. ``"node"`` with ``deterministic=True`` is a
            ``ConfigError``. See :class:`odc.Engine` and docs/many-nodes.md.
        compress: compressed pushes and gathers, e.g. ``{"gather": "fp8",
            "push": "int8", "block": 32, "feedback": True}``: by default
            only what crosses nodes (the node sums' pushes, the node cache's
            fetches of shards owned on another node) carries block-scaled
            values; ``"scope": "all"`` compresses every push and every read
            of another rank's shard; under ``sharding="hybrid"`` or
            ``"hybrid-zero"`` ``push`` compresses the end-of-minibatch sum
            across nodes (and under ``"hybrid-zero"`` ``gather`` the
            parameter pieces copied across nodes). Default ``None``
            (nothing compressed). On the GPU transports the device's
            kernels quantise and dequantise (a gather format there takes
            f32 and bf16 parameters, not f16).
            Not with ``deterministic=True``. See the ``compress`` argument
            of :class:`odc.Engine`.
        elastic: under ``sharding="hybrid"`` across nodes, go on when a rank
            dies: its node is dropped at the end of that minibatch, the other
            nodes' gradients are summed without its microbatches of that
            minibatch, and training continues on the surviving nodes; the
            dead node's other ranks raise :class:`odc.NodeDropped` (or
            :class:`odc.PeerDied`) and should exit. ``True`` or ``"drop"``:
            the dead node's microbatches are dropped; :func:`elastic_events`
            says what was dropped, so a loop can renormalize by the
            survivors' token count (call :func:`finish` before the optimizer
            step to look). ``"rerun"``: nothing is dropped. A loop on
            :func:`microbatches` gets the dead node's microbatches rerun on
            the member nodes by the iterator itself (the iteration's end
            finishes the minibatch and, while that drops a node, yields this
            rank's share of what the dropped nodes ran, continuing the
            minibatch), and the microbatches of nodes dropped earlier are
            spread over the members up front; a loop of its own reruns them
            with :func:`dropped`, and a step on gradients that left dropped
            microbatches out is refused. Refused under ``"full"`` and
            ``"hybrid-zero"``, where one copy of a shard or of its optimizer
            state dies with its rank. A restarted node comes back through
            :func:`rejoin`; the members let it in as their next minibatch
            starts, serving it their replica state. See
            docs/elastic.md.
        store: the store the engine meets its peers through (default: the
            default process group's). Elastic jobs that let a restarted node
            rejoin pass the job's store here (a client of the rendezvous
            store, say) and the same to :func:`rejoin`, whose process group
            cannot be the members' default one.
        scaler: under ``elastic``: the loop's ``GradScaler`` (or any object
            with ``state_dict()`` / ``load_state_dict()``), whose state a
            rejoining node copies beside the replica (the parameters, the
            module buffers, the optimizers' state and ``param_groups``).
        scheduler: under ``elastic``: the loop's LR scheduler(s), one or a
            list, copied the same way. Both are taken as the next minibatch
            starts (after the loop's ``scaler.update()`` and
            ``scheduler.step()``); a value in them that cannot be copied is
            refused here, naming it. See docs/elastic.md.

    Warns:
        UserWarning: a torch newer than :data:`TORCH_RANGE`, allowed by
            ``ODC_ALLOW_UNCHECKED_TORCH=1``.

    Raises:
        ConfigError: the running torch is outside :data:`TORCH_RANGE` or lacks
            private FSDP2 state odc.fsdp reads; the model is not ``fully_shard``-ed, already enabled,
            ``sharding`` is unknown or does not fit the mesh (a 2-D mesh under
            ``"full"``, a 1-D mesh under ``"hybrid"``, shard groups that are
            not the ranks of one node), or it uses a setting ODC cannot keep
            (see the module doc); the parameters live on several devices, on
            CUDA across several nodes with hybrid sharding, or ``transport``
            cannot carry their tensors (``shm`` for CUDA, ``cuda-ipc`` /
            ``nvshmem`` for CPU, ``cuda-ipc`` across nodes).
        RegistrationError: ranks built different models.
    """
    m = _model.describe(model, optimizer, sharding=sharding, elastic=elastic, transport=transport, scaler=scaler,
                        scheduler=scheduler)  # 1. FSDP2 or FSDP1, its groups and layout; every refusal
    if m.layout.world == 1:
        _binding.bind_solo(model)  # FSDP bypasses both seams at world size 1: nothing to replace
        return
    engine = _engine.make(m, store=store, transport=transport, chunk_bytes=chunk_bytes, timeout=timeout,
                          deterministic=deterministic, cross_node=cross_node, elastic=elastic,
                          compress=compress)  # 2. buckets registered
    b = _binding.bind(m, engine, rerun=elastic == "rerun")  # 3. the gradient contract, the optimizer hooks
    m.install(b)  # 4. FSDP's comm seams


def rejoin(
    model: Any,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    store: Any,
    rank: int,
    world_size: int,
    chunk_bytes: int | None = None,
    timeout: float | None = None,
    transport: str | None = None,
    deterministic: bool = False,
    elastic: bool | str = True,
    scaler: Any = None,
    scheduler: Any = None,
) -> int:
    """A restarted node's rank joins a running elastic job (``enable(..., sharding="hybrid", elastic=True)``);
    returns the first minibatch it runs.

    Each rank of the node builds the model as every rank did (the same
    seed-independent structure), shards it with ``fully_shard`` over a mesh
    of its own node (``init_device_mesh(device, (1, G), mesh_dim_names=
    ("replicate", "shard"))`` in a process group of the node's G ranks: it
    cannot join the members' default group; FSDP1: ``HYBRID_SHARD`` with
    that mesh as ``device_mesh``), creates its optimizer (and its
    ``GradScaler`` and LR scheduler, where the members passed theirs to
    :func:`enable`), and calls this in place of :func:`enable`, with the
    job's ``store`` (what the members passed to :func:`enable`), its rank in
    the job and the job's world size. It asks the members' membership round
    to admit its node, waits for the generation that does (the members begin
    it after their optimizer step), registers with them, and copies its local
    rank's replica from a member: one-sidedly the parameters' local shards,
    the module buffers and every optimizer's tensor state (created here first
    by one step on zero gradients, then overwritten bit for bit); then, as
    the members start their next minibatch (after the loop's
    ``scaler.update()`` and ``scheduler.step()``), each optimizer's
    ``param_groups`` (every number copied, every other setting compared),
    ``scaler``'s and each scheduler's ``state_dict()``. From then on the model
    is enabled as :func:`enable` leaves it; run the loop from the returned
    minibatch, with that minibatch's plan (the data position), as every
    member does.

    Args:
        model: the ``fully_shard``-ed root module over a ``(1, G)`` mesh, or
            FSDP1's root module with ``HYBRID_SHARD`` over one.
        optimizer: its optimizer(s), as passed to :func:`enable` on the
            members (their state is copied in the same order). A job whose
            members enabled without an optimizer (``enable(model, None,
            ...)``) lets no node rejoin: their optimizer's state is unknown
            to ODC.
        store: the job's store (a client of the store the members passed as
            ``store=`` to :func:`enable`).
        rank: this rank in the job (node n's ranks are n·G … n·G + G − 1;
            the local rank is its index in the node's mesh).
        world_size: the job's ranks D.
        chunk_bytes: as the members' :func:`enable`.
        timeout: as the members' :func:`enable`; also how long to wait for
            the admission, and then for the members' next minibatch to start.
        transport: as the members' :func:`enable`.
        deterministic: as the members' :func:`enable`.
        elastic: as the members' :func:`enable` (``True``, ``"drop"`` or ``"rerun"``).
        scaler: as the members' :func:`enable`: its state is copied.
        scheduler: as the members' :func:`enable` (one or a list): their state is copied.

    Raises:
        ConfigError: not an FSDP model, a mesh that is not one node's, a rank
            whose local rank is not its mesh index, no optimizer (or members
            without one), state laid out unlike its source's, a setting, a
            scaler or a scheduler unlike the source's (each named), or a value
            of them that cannot be copied.
        StoreError: no round admitted the node within the timeout.
        PeerTimeout: the source did not start its next minibatch within the timeout.
    """
    m = _model.describe_joiner(model, optimizer, rank=rank, world_size=world_size, elastic=elastic, scaler=scaler,
                               scheduler=scheduler)
    engine = _engine.make_joining(m, store=store, transport=transport, chunk_bytes=chunk_bytes, timeout=timeout,
                                  deterministic=deterministic)
    first = int(engine.first_minibatch or 0)
    b = _binding.bind(m, engine, first=first, rerun=elastic == "rerun")
    m.install(b)
    return first


def disable(model: Any) -> None:
    """Restores FSDP2's default collectives. Call on every rank, after an optimizer step.

    Raises:
        ProtocolError: this rank pushed gradients that no optimizer step consumed.
    """
    if solo(model) is not None:
        del model.__dict__["_odc_fsdp"]
        return
    b = _bound(model)
    if b.state.open and b.state.pushed:
        raise ProtocolError(
            f"odc.fsdp.disable: gradients of minibatch {b.state.version} are pending; step the optimizer first"
        )
    # A teardown fence: once every peer finished, nobody reads this rank's shards.
    b.finish("odc.fsdp.disable", install=False)
    b.grads.release()
    for h in b.hooks:
        h.remove()  # FSDP1: restores its all-gather and clears the comm hook
    if isinstance(model, FSDPModule):
        _install_comms(b.groups, [(DefaultAllGather(), DefaultReduceScatter()) for _ in b.groups])
    if b.all_reduce_was:  # FSDP2 under hybrid sharding
        for g, was in zip(b.groups, b.all_reduce_was, strict=True):
            g.pg.all_reduce_grads = was
    del model.__dict__["_odc_fsdp"]
    _live.discard(b)
    b.state.engine = None  # type: ignore[assignment]  # drops the engine (unmaps, joins the daemon)


@contextlib.contextmanager
def minibatch(model: Any) -> Iterator[None]:
    """One minibatch with explicit boundaries instead of optimizer hooks.

    Entering starts the next minibatch (its first gather publishes the
    parameters as they are then); leaving finishes the minibatch and installs the gradients as ``.grad``.
    Step the optimizer after the block::

        with odc.fsdp.minibatch(model):
            for mb in microbatches:       # any number per rank, zero included
                model(mb).sum().backward()
        optimizer.step(); optimizer.zero_grad()

    Entered right after a finish, with no step and no ``zero_grad`` between
    and the gradients as that finish installed them, the block continues that
    minibatch's sums (a rerun, :func:`dropped`): ``.grad`` after it is what one
    minibatch of both would have made (under ``deterministic=True`` the very
    bits). Gradients changed in between (a clip) are added onto instead.

    An exception out of the block skips the minibatch on every rank
    (:func:`skip`): this rank finishes it with its skip mark, so the peers are
    not left waiting, every rank's finish of it clears its sums and leaves
    ``.grad`` as it was before the minibatch (``None`` after a ``zero_grad``:
    torch's optimizers then step nothing), and it warns on every rank
    (``RuntimeWarning``; :func:`skipped` tells a loop). A loop that catches the
    exception and moves on (skipping a bad batch) needs nothing else; the next
    block is the next minibatch. Where the minibatch cannot be finished (a
    peer died or stalled, a ``KeyboardInterrupt``, the finish failing too),
    every later ODC operation on the model raises :class:`odc.ProtocolError`
    naming the minibatch and the exception.
    """
    if solo(model) is not None:
        yield
        return
    b = _bound(model)
    b.enter_minibatch()
    try:
        yield
    except BaseException as exc:
        b.leave_minibatch(exc)
        raise
    b.leave_minibatch(None)


@contextlib.contextmanager
def evaluation(model: Any) -> Iterator[None]:
    """Forwards on other weights between two minibatches (an EMA swap for evaluation), on every rank.

    Swap the other weights in, evaluate inside the block, swap back after
    it::

        optimizer.step(); optimizer.zero_grad()
        swap_in(ema)                      # in place, on this rank's shards
        with odc.fsdp.evaluation(model):  # every rank, at the same point of its loop
            with torch.no_grad():
                evaluate(model)
        swap_back()                       # the next minibatch gathers these again

    The block is a minibatch of its own: its first gather publishes the
    swapped-in weights, which every peer's gathers in it read, and leaving
    it synchronizes once, like a minibatch's finish, so no peer still reads
    them when the next minibatch publishes the swapped-back ones. Leaving it
    also reshards every FSDP module (FSDP2 keeps the root, and any module with
    ``reshard_after_forward=False``, unsharded after a forward; FSDP1 likewise
    under ``SHARD_GRAD_OP``), so the next forward gathers the swapped-back
    weights instead of computing with the evaluated ones. Enter it
    between minibatches (after the step, or after ``zero_grad`` where the
    step was skipped); a backward inside it is refused. Without it, the
    swap back is refused as a change inside the minibatch the evaluation's
    forward started.
    """
    if solo(model) is not None:
        yield
        return
    b = _bound(model)
    b.begin_evaluation()
    try:
        yield
    finally:
        b.end_evaluation()


def bytes_across_nodes(model: Any) -> dict[str, int] | None:
    """Bytes this rank's gathers read from, its pushes sent to and its hybrid cross-node sum read from other nodes
    since :func:`enable` (``{"gathered": ..., "pushed": ..., "summed": ...}``, see
    :meth:`odc.Engine.bytes_across_nodes`): what ``compress=`` cuts.
    ``None`` at world size 1 and on a device engine."""
    if solo(model) is not None:
        return None
    return _bound(model).engine.bytes_across_nodes()


def members(model: Any) -> list[int] | None:
    """Under ``enable(..., elastic=True)``: the nodes the next minibatch's gradient sum counts; else ``None``."""
    if solo(model) is not None:
        return None
    return _bound(model).engine.members


def elastic_events(model: Any) -> list[dict[str, Any]]:
    """Under ``enable(..., elastic=True)``: every node drop this rank saw, oldest first (see
    :meth:`odc.Engine.elastic_events`); empty otherwise. An event's ``minibatch`` is the minibatch (counted
    from 0 since :func:`enable`) whose gradients left out the dropped ``node``'s microbatches."""
    if solo(model) is not None:
        return []
    return _bound(model).engine.elastic_events()


def dropped(model: Any) -> list[dict[str, Any]]:
    """Under ``enable(..., elastic=True)``: the drops of the minibatch this rank finished last (see
    :func:`elastic_events`), whose gradients leave out those nodes' microbatches; empty while a minibatch runs,
    when it dropped nothing, and without ``elastic``. Each drop's ``since`` is the first minibatch whose sums
    the finished one continues (itself, unless it is a rerun): the dropped node's microbatches of every
    minibatch from ``since`` on are out.

    To **rerun** what a drop left out instead of training without it, run the dropped nodes' microbatches of
    that minibatch on the members in one more minibatch before the step (``odc.fsdp.minibatch``, no
    ``zero_grad`` between), and again while that one drops a node. The rerun continues the minibatch's sums
    (under ``deterministic=True`` exactly: the bits of the minibatch without the death), so a node dropped
    during it takes out every microbatch it ran since the step; ``ran`` keeps them::

        odc.fsdp.finish(model)
        while drops := odc.fsdp.dropped(model):
            members = drops[-1]["members"]
            lost = [mb for r, mbs in sorted(ran.items()) if r // ranks_per_node not in members for mb in mbs]
            share = {r: odc.fsdp.rerun_share(lost, members, r, ranks_per_node) for r in ran}
            ran = {r: ran[r] + share[r] for r in ran if r // ranks_per_node in members}
            with odc.fsdp.minibatch(model):
                for mb in share[rank]:
                    (loss(model, mb) / norm).backward()
        optimizer.step()
    """
    if solo(model) is not None:
        return []
    return _bound(model).drops()


def skip(model: Any) -> None:
    """Skips the running minibatch on every rank: for a loop with hooked optimizers that catches an exception
    in the middle of a minibatch (a bad batch, a non-finite loss seen on this rank only).

    This rank finishes the minibatch with its skip mark (the peers are not left
    waiting); at their own finish every rank learns it, alike: the minibatch's
    sums are cleared, each ``.grad`` is what it held before the minibatch
    (zeros where that was nothing, so that reads, clips and a ``GradScaler``
    find a gradient), and the hooked optimizers' next step trains on nothing.
    Then step (or ``zero_grad``) as after any minibatch, or go straight to the
    next one. An exception out of :func:`minibatch` and a loop that leaves
    :func:`microbatches` early skip the same way by themselves::

        for batch in minibatch_batches:
            try:
                loss_fn(model, batch).backward()
            except BadBatch:
                odc.fsdp.skip(model)
                break
        optimizer.step(); optimizer.zero_grad()   # on every rank: a no-op step where the minibatch was skipped

    Raises:
        ProtocolError: the minibatch has finished already (its gradients were read): skip the step on every
            rank alike instead (every rank reads the same gradients and norm).
    """
    if solo(model) is None:
        _bound(model).skip("odc.fsdp.skip")


def skipped(model: Any) -> int:
    """How many ranks abandoned the minibatch this rank finished last (an exception out of :func:`minibatch`,
    :func:`skip`, a loop that left :func:`microbatches` early): non-zero where it was skipped on every rank.
    0 while a minibatch runs, and at world size 1."""
    if solo(model) is not None:
        return 0
    s = _bound(model).state
    return 0 if s.open else s.skipped


def finish(model: Any) -> None:
    """Finishes the running minibatch now: ``.grad`` holds the reduced gradients.

    The optimizer pre-hook does this too; call it to read gradients before
    ``optimizer.step()``.
    """
    if solo(model) is None:
        _bound(model).finish("odc.fsdp.finish")


