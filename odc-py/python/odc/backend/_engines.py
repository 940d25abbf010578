"""The engines behind ``odc`` process groups: made at the first operation that needs them, sized by the
largest operation seen up to a bound, shared by every group of the same ranks, freed with the last of
those groups (the module doc of :mod:`odc.backend`, *Memory*, says what that costs).

Owns :class:`EngineSet` (one per rank set: the engines of each device it ran on), the order in which the
groups sharing a set take their turns on it (:meth:`EngineSet.acquire`), and the registry that hands a
group the set of its ranks (:func:`engine_set`). Knows nothing of torch.distributed's process groups: a
group hands in its store and a fresh store prefix whenever an engine must be made.

Groups that share a set cannot cross. An engine matches operations by its own counters (a bucket's
version, the minibatch), not by group, so every rank must run the same group's operation in each turn,
whatever order its threads issued them in. Each group of a rank set has an index equal on every rank
(the order torch creates groups in, which must be the same on every rank); each of its ODC operations is
a ticket ``(group index, operation index)``. From the second group of a rank set on, the set's rank 0
decides the order: at each turn it posts the ticket it runs under the turn's number in the store, and
the other ranks run the operation of that ticket there (a thread holding another group's operation waits
for its own turn). A set with one group has only one order and skips this, so a set switches to posted
turns when its second group is made, without waiting for any operation in progress: rank 0 posts from its
next turn on and says which that is, each other rank reads from then, or from its own next turn if that is
later, and the new group's creation waits until every rank has switched. A turn a rank ran unread after
rank 0 began posting is safe: until the switch completes, no rank has made the new group, so the turn was
an operation of the one group that rank had (in that group's order). And no rank runs the new group's
operations before the latest turn any rank switched at (rank 0 gathers them and hands the latest to every
rank): a rank behind another would otherwise run one in a turn the other already ran, unposted, with the
first group's operation.
"""

from __future__ import annotations

import datetime
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..engine import (
    CUDA_TRANSPORTS,
    DEVICE_TRANSPORTS,
    TRANSPORTS,
    Engine,
    _local_world_size,
    heap_bytes,
    transport_name,
)
from ..errors import ConfigError, LayoutError, PeerTimeout, ProtocolError
from ._parts import WIRE_BYTES, Gatherer, Reducer, class_for, shard_classes

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

SCRATCH_ENV = "ODC_BACKEND_SCRATCH_MB"
"""The environment variable that bounds a rank set's scratch shards, in MiB."""
DEFAULT_SCRATCH_MB = 16.0
"""The bound on a rank set's scratch shard per rank and engine when :data:`SCRATCH_ENV` is unset, in MiB."""
#: The landing chunk of an all-gather engine, which never pushes: its landing slots only have to exist.
_GATHER_CHUNK = 4096


def scratch_bytes() -> int:
    """The bound on a group's scratch shards per rank, in bytes (``ODC_BACKEND_SCRATCH_MB``, default 16)."""
    raw = os.environ.get(SCRATCH_ENV)
    try:
        mb = DEFAULT_SCRATCH_MB if raw is None else float(raw)
    except ValueError:
        raise ConfigError(f"{SCRATCH_ENV}={raw!r} is not a number of MiB") from None
    if not mb > 0:
        raise ConfigError(f"{SCRATCH_ENV}={raw!r} must be positive")
    return int(mb * 2**20)


def transports(requested: str | None) -> tuple[str, str | None]:
    """The transports of the CPU engines and of the CUDA engines for ``ODC_TRANSPORT`` (None: picked by node
    count).

    A transport that moves CUDA tensors goes to the CUDA engines; any other name (``emu-ipc`` and
    ``emu-shmem`` included: device transports on CPU tensors) goes to the CPU engines, an unknown one too:
    its engine raises :class:`odc.ConfigError` listing the names it knows.
    """
    name = transport_name(requested)
    if name is None:
        return "auto", None
    if name in CUDA_TRANSPORTS:
        return "auto", name
    return str(requested), None


def cuda_transport(requested: str | None, nodes: int) -> str:
    """The CUDA engines' transport: ``requested``, else ``cuda-ipc`` on one node and ``nvshmem`` across nodes."""
    if requested == "cuda-ipc" and nodes > 1:
        raise ConfigError(
            f"odc backend: ODC_TRANSPORT={requested!r} serves one node and the group spans {nodes} nodes; "
            "use 'nvshmem' (the default for CUDA tensors across nodes)"
        )
    if requested is not None:
        return requested
    return "cuda-ipc" if nodes == 1 else "nvshmem"


def job_key(store: Store, rank: int, key: str) -> str:
    """Equal on every rank, distinct per job: ``ODC_JOB_KEY``, torchelastic's run id, or a token rank 0 posts
    under ``key`` (fresh in ``store``)."""
    for env in ("ODC_JOB_KEY", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(env):
            return os.environ[env]
    if rank == 0:
        store.set(key, "pg" + secrets.token_hex(8))
    return store.get(key).decode()


@dataclass(frozen=True)
class SetKey:
    """What makes two groups' engines interchangeable: the same global ranks in the same order, the same
    transports, bound and deadline."""

    ranks: tuple[int, ...]
    cpu_transport: str
    cuda_requested: str | None
    bound: int
    seconds: float
    deadline_source: str


#: Makes an engine of a rank set through the calling group's store: ``make(role, **engine_kwargs)``.
Maker = Callable[..., Engine]


class Engines:
    """The engines of one device of a rank set: a :class:`Gatherer` and a :class:`Reducer`.

    On a host transport each is made by the first operation that needs it, with the shard classes that
    operation needs, and made again, larger, by an operation that needs more (up to the bound); on a
    device transport both are made at the bound by the device's first operation (a device engine cannot
    be dropped while a peer's stream may still read it, and an ``nvshmem`` heap is fixed when it starts).
    """

    def __init__(self, set_: EngineSet, device: torch.device, transport: str) -> None:
        self.set = set_
        self.device = device
        self.transport = transport
        self.on_device = transport_name(transport) in DEVICE_TRANSPORTS
        self._gather_classes = shard_classes(set_.key.bound, WIRE_BYTES)  # every class up to the bound
        self._reduce_classes = shard_classes(set_.key.bound, 4)
        self.gatherer_: Gatherer | None = None
        self.reducer_: Reducer | None = None
        self._last_stream: Any = None

    def begin(self) -> None:
        """Orders a CUDA op after the previous one when the caller switched streams.

        The engines order an op's work on the current stream only, and the scratch buffers and
        accumulators are reused from op to op.
        """
        if self.device.type != "cuda":
            return
        current = torch.cuda.current_stream(self.device)
        last = self._last_stream
        if last is not None and last.cuda_stream != current.cuda_stream:
            current.wait_stream(last)
        self._last_stream = current

    def gatherer(self, make: Maker, words: int) -> Gatherer:
        """The gatherer, with a shard class of at least ``words`` 2-byte words (or the bound's)."""
        g = self.gatherer_
        if g is not None and (words <= g.capacity or g.capacity == self._gather_classes[-1]):
            return g
        classes = self._gather_classes
        want = class_for(words, classes)
        if self.on_device:
            self._make_both(make)
        else:
            engine = make("ag", transport=self.transport, chunk_bytes=_GATHER_CHUNK)
            self.gatherer_ = Gatherer(engine, [c for c in classes if c <= want])  # then the old one goes
        if self.gatherer_ is None:  # pragma: no cover - made just above
            raise ProtocolError("the odc group's all-gather engine was not made")
        return self.gatherer_

    def reducer(self, make: Maker, elems: int) -> Reducer:
        """The reducer, with shards of at least ``elems`` elements (or the bound's)."""
        r = self.reducer_
        if r is not None and (elems <= r.capacity or r.capacity == self._reduce_classes[-1]):
            return r
        want = class_for(elems, self._reduce_classes)
        if self.on_device:
            self._make_both(make)
        else:
            engine = make("rs", transport=self.transport, chunk_bytes=Reducer.chunk_bytes(want))
            self.reducer_ = Reducer(engine, want)  # then the old one goes
        if self.reducer_ is None:  # pragma: no cover - made just above
            raise ProtocolError("the odc group's reduce-scatter engine was not made")
        return self.reducer_

    def _make_both(self, make: Maker) -> None:
        """A device transport's two engines, at the bound (see :func:`device_plan`)."""
        key = self.set.key
        (ag, ag_kw), (rs, rs_kw) = device_plan(self.transport, self.device, self.set.world, self.set.local_world,
                                               key.bound)
        self.gatherer_ = Gatherer(make(ag, **ag_kw), self._gather_classes)
        self.reducer_ = Reducer(make(rs, **rs_kw), self._reduce_classes[-1])


def device_plan(
    transport: str, device: torch.device, world: int, local_world: int | None, bound: int
) -> list[tuple[str, dict[str, Any]]]:
    """The engines a device transport makes, as ``(role, engine arguments)``: the all-gather engine first,
    which starts an ``nvshmem`` session (fixed when it starts) with the reduce-scatter engine's regions
    planned in (``heap_reserve``), then the reduce-scatter engine, which shares it."""
    kw: dict[str, Any] = {"transport": transport}
    if device.type == "cuda":
        kw["device"] = device.index
    reserve = 0
    if transport == "nvshmem":
        shard = shard_classes(bound, 4)[-1]
        reserve = heap_bytes(Reducer.buckets(world, shard), world, local_world_size=local_world)
    return [("ag", {**kw, "heap_reserve": reserve}), ("rs", kw)]


class EngineSet:
    """The engines of one rank set, by device, shared by every ``odc`` group of those ranks.

    Operations on it take turns (:meth:`acquire`, :meth:`release`; groups of the same ranks may run in
    several threads, in any order: see the module doc). A failure inside an operation leaves the engines'
    versions and minibatch counters out of step with the peers': the set records it in :attr:`failure` and
    refuses ODC work from then on; the registry hands later groups a fresh set.

    Args:
        key: the ranks, transports, bound and deadline.
        rank: this rank's index in ``key.ranks``.
        store: the store of the group that makes the set, where rank 0 posts its turns.
    """

    def __init__(self, key: SetKey, rank: int, store: Store) -> None:
        self.key = key
        self.rank = rank
        self.world = len(key.ranks)
        self.failure: BaseException | None = None
        self.local_world: int | None = None  # ranks per node, learned by the first engine made
        self._devices: dict[str, Engines] = {}
        # The turns (see the module doc): posted under the store of the group that made the set.
        self._order_store = store
        self._cv = threading.Condition()
        self._busy = False  # a thread holds the turn
        self._turn = 0  # turns taken so far, alike on every rank
        self._next: tuple[int, int] | None = None  # the ticket rank 0 posted for this turn, once read
        self._posted_from: int | None = None  # the first turn this rank posts (rank 0) or reads (the others)
        # The group made at the switch, and the first turn its operations may take: the latest turn any rank
        # switched at (before it, some rank ran the earlier group's operations unposted).
        self._held: tuple[int, int] | None = None

    # -- turns ---------------------------------------------------------------------------------------
    @property
    def posted(self) -> bool:
        """Whether this set's turns are posted (from its second group on)."""
        return self._posted_from is not None

    def post_turns(self, group_store: Store, seconds: float, group: int) -> None:
        """Switches this set to posted turns for ``group``, a new group of it (collective over the new group,
        through its store, before the group's creation completes: see the module doc)."""
        if self.world == 1 or self.posted:
            return
        deadline = time.monotonic() + seconds
        if self.rank == 0:
            first = self._switch(0)
            group_store.set("odc-turns/from", str(first))
            acks = [f"odc-turns/ack{r}" for r in range(1, self.world)]
            group_store.wait(acks, _delta(deadline))
            hold = max([first, *(int(v.decode()) for v in group_store.multi_get(acks))])
            group_store.set("odc-turns/hold", str(hold))
        else:
            group_store.wait(["odc-turns/from"], _delta(deadline))
            group_store.set(f"odc-turns/ack{self.rank}",
                            str(self._switch(int(group_store.get("odc-turns/from").decode()))))
            group_store.wait(["odc-turns/hold"], _delta(deadline))
            hold = int(group_store.get("odc-turns/hold").decode())
        with self._cv:
            self._held = (group, hold)

    def _switch(self, first: int) -> int:
        """Posts (rank 0) or reads (the others) every turn from ``first`` or this rank's next turn, whichever is
        later; returns that turn."""
        with self._cv:
            upcoming = self._turn + (1 if self._busy else 0)
            self._posted_from = max(first, upcoming)
            return self._posted_from

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        """Waits on the set's condition until ``ready()`` (holding it), or raises PeerTimeout naming ``what``."""
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (not self._cv.wait(remaining) and not ready()):
                raise PeerTimeout(
                    f"odc process group: waited {self.key.seconds:.0f} s ({self.key.deadline_source}) for "
                    f"{what} on the engines of ranks {list(self.key.ranks)} (turn {self._turn})"
                )

    def _may_run(self, ticket: tuple[int, int]) -> bool:
        """Whether ``ticket`` may take the next turn: not an operation of the group made at the switch (or a later
        one) before every rank switched (holding the set's condition)."""
        return self._held is None or ticket[0] < self._held[0] or self._turn >= self._held[1]

    def acquire(self, ticket: tuple[int, int], what: str) -> None:
        """Returns when this thread may run the operation ``ticket`` (group index, operation index) on the set:
        the set is free and, under posted turns, rank 0 runs the same ticket in this turn. Pair with
        :meth:`release`."""
        deadline = time.monotonic() + self.key.seconds
        while True:
            with self._cv:
                self._wait(lambda: not self._busy and self._next in (None, ticket) and self._may_run(ticket),
                           deadline,
                           f"its turn for {what} (group {ticket[0]}, operation {ticket[1]}) after "
                           f"group {self._next[0] if self._next else '?'}'s operation "
                           f"{self._next[1] if self._next else '?'}, which rank {self.key.ranks[0]} runs now")
                self._busy = True
                turn = self._turn
                if self._posted_from is None or turn < self._posted_from or self._next == ticket:
                    return
            try:
                chosen = self._post(turn, ticket) if self.rank == 0 else self._read(turn, deadline)
            except BaseException:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                raise
            with self._cv:
                self._next = chosen
                if chosen == ticket:
                    return
                self._busy = False  # another group's operation runs in this turn: its thread takes it
                self._cv.notify_all()

    def release(self) -> None:
        """Ends this thread's turn, used whether its operation ran or raised (every rank raises alike before an
        engine is reached; after, the set has failed)."""
        with self._cv:
            self._turn += 1
            self._next = None
            self._busy = False
            self._cv.notify_all()

    def _post(self, turn: int, ticket: tuple[int, int]) -> tuple[int, int]:
        store = self._order_store
        store.set(f"odc-turn/{turn}", f"{ticket[0]}:{ticket[1]}")
        if turn > 0:  # every rank read the previous turn's before it ran it, and rank 0 ran it with them
            store.delete_key(f"odc-turn/{turn - 1}")
        return ticket

    def _read(self, turn: int, deadline: float) -> tuple[int, int]:
        key = f"odc-turn/{turn}"
        try:
            self._order_store.wait([key], _delta(deadline))
            raw = self._order_store.get(key).decode()
        except RuntimeError as e:  # the store's timeout (DistStoreError), or rank 0's store gone
            raise PeerTimeout(
                f"odc process group: rank {self.key.ranks[0]} did not post turn {turn} of the engines of ranks "
                f"{list(self.key.ranks)} ({type(e).__name__}: {e})", peer=self.key.ranks[0]
            ) from e
        gid, seq = raw.split(":")
        return int(gid), int(seq)

    @property
    def transports(self) -> dict[str, str]:
        """The transport of the engines of each device that ran an ODC operation: ``{"cpu": "shm"}``."""
        out = {}
        for engines in self._devices.values():
            made = engines.gatherer_ or engines.reducer_
            if made is not None:
                out[str(engines.device)] = made.engine.transport
        return out

    def engines(self, device: torch.device, store: Store) -> Engines:
        """The engines of ``device`` (a CUDA device's are decided by its first operation, collectively)."""
        slot = "cpu" if device.type != "cuda" else "cuda"
        engines = self._devices.get(slot)
        if engines is None:
            if device.type == "cuda":
                transport = cuda_transport(self.key.cuda_requested, self.world // self.local_world_size(store))
            else:
                transport = self.key.cpu_transport
            engines = self._devices[slot] = Engines(self, device, transport)
        elif device.type == "cuda" and engines.device != device:
            raise LayoutError(
                f"tensors on {device}, but this odc process group's CUDA engines are on {engines.device} "
                "(decided by its first operation on CUDA tensors); use one CUDA device per group"
            )
        return engines

    def local_world_size(self, store: Store) -> int:
        """Ranks per node of this set: from ``LOCAL_WORLD_SIZE`` (torchrun's ranks per node) and the global
        ranks where it is set and they are node-major, else from every rank's host (collective, the first
        time: every rank posts its host through ``store``)."""
        if self.local_world is None:
            self.local_world = per_node(self.key.ranks, os.environ.get("LOCAL_WORLD_SIZE"))
        if self.local_world is None:
            self.local_world = _local_world_size(store, self.rank, self.world, "odc-local")
        return self.local_world

    def make(self, store: Store, prefix: str, **kw: Any) -> Engine:
        """Makes an engine of this set through ``store`` under ``prefix`` (fresh in that store; collective)."""
        return Engine(
            store, self.rank, self.world, timeout=self.key.seconds, deadline_source=self.key.deadline_source,
            job_key=job_key(store, self.rank, f"{prefix}/job_key"), prefix=prefix,
            local_world_size=self.local_world_size(store), **kw,
        )

    def check_transport(self) -> None:
        """Raises :class:`odc.ConfigError` now, at the group's creation, for a transport no engine knows."""
        name = transport_name(self.key.cpu_transport)
        if name not in TRANSPORTS:
            raise ConfigError(
                f"odc backend: unknown transport {self.key.cpu_transport!r} (ODC_TRANSPORT); "
                f"expected one of {', '.join(TRANSPORTS)}"
            )


def per_node(ranks: tuple[int, ...], local_world_size: str | None) -> int | None:
    """Ranks of ``ranks`` (global, in group order) per node when every node holds ``local_world_size``
    consecutive global ranks (torchrun's placement): None unless the group's ranks are node-major with the
    same count on each of their nodes, or without ``local_world_size``.

    >>> per_node((0, 2, 4, 6), "4"), per_node((0, 4), "4"), per_node((0, 1, 4), "4"), per_node((0, 1), None)
    (2, 1, None, None)
    """
    try:
        g = int(local_world_size or "")
    except ValueError:
        return None
    if g < 1:
        return None
    nodes = [r // g for r in ranks]
    if nodes != sorted(nodes):
        return None
    counts = {n: nodes.count(n) for n in nodes}
    return counts[nodes[0]] if len(set(counts.values())) == 1 else None


def _delta(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


_SETS: weakref.WeakValueDictionary[SetKey, EngineSet] = weakref.WeakValueDictionary()
#: Groups made so far per key in this process (never reset): a group's index, equal on every rank.
_MADE: dict[SetKey, int] = {}
_SETS_LOCK = threading.Lock()


def engine_set(key: SetKey, rank: int, store: Store) -> tuple[EngineSet, int]:
    """The engine set of ``key`` and the new group's index among the groups of ``key``: the set another live
    group of the same ranks holds, else a new one (which reserves nothing, and posts its turns under ``store``,
    the new group's). It lives as long as a group holds it. From the second group of ``key`` on, the caller
    switches the set to posted turns (:meth:`EngineSet.post_turns`)."""
    with _SETS_LOCK:
        found = _SETS.get(key)
        if found is None or found.failure is not None:
            found = _SETS[key] = EngineSet(key, rank, store)
        index = _MADE.get(key, 0)
        _MADE[key] = index + 1
        return found, index
