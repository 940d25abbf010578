"""Work stealing within a minibatch: :func:`microbatches`, the iterator a training loop runs its microbatches from
(and, under ``elastic="rerun"``, the rerun of what a dropped node ran).

Every rank's list of microbatches (from the plan, equal on every rank) becomes claimable work: a rank runs its own
list from the front, then takes unstarted microbatches from the back of the list of the rank with the most
predicted work left. Claims go through the engine (``Engine.claim_own`` / ``Engine.steal``): one compare-and-swap
in the owner's memory per claim, made by the owner or, for a thief, by the owner's server daemon, so every
microbatch runs exactly once whichever ranks race for it. It uses the binding
(:mod:`._binding`) and its minibatch state machine only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import ConfigError, ProtocolError
from ._binding import _Binding, _bound, solo

T = TypeVar("T")


def microbatches(model: Any, lists: Sequence[Sequence[T]], *, cost: Callable[[T], float] | None = None,
                 steal: bool = True) -> Iterator[T]:
    """Yields the microbatches this rank should run in the running minibatch: its own, then stolen ones.

    ``lists[r]`` is rank ``r``'s list of microbatches in this minibatch, the same object on every rank (for an
    :func:`odc.packing.plan`, ``plan.minibatches[m]``: each microbatch a tuple of sample indices). The loop must be
    able to load any sample by its index, since a rank may run another rank's microbatch::

        for m, lists in enumerate(plan.minibatches):
            for mb in odc.fsdp.microbatches(model, lists, cost=lambda mb: sum(lengths[i] for i in mb)):
                loss = model(batch(mb)) * world / tokens[m]   # scale by the minibatch's tokens, not this rank's
                loss.backward()
            optimizer.step(); optimizer.zero_grad()

    Every rank must iterate it once per minibatch, to the end (a rank with no microbatch of its own too: it
    starts the minibatch for thieves and may steal).

    Elastic (``enable(..., elastic=...)``): the lists of ranks on nodes dropped before the minibatch must be empty
    under ``elastic=True`` / ``"drop"`` (their microbatches would run nowhere: plan over :func:`odc.fsdp.members`),
    and are spread over the member nodes' ranks up front under ``"rerun"``. Under ``"rerun"`` the iteration's end
    also finishes the minibatch and, while that finish drops a node, goes on yielding: this rank's share of
    everything the dropped nodes ran since the step, in a minibatch that continues the sums (so ``.grad`` after
    the loop holds every microbatch of the lists; under ``deterministic=True``, the bits of a run without the
    death). Left early (a ``break``, an exception out of the
    loop, an iterator kept and no longer iterated) with microbatches of its own list unclaimed, of its share of
    a rerun not handed out, or the one it was handed last not finished (the iterator was not asked for the next
    one), those run nowhere: the minibatch's finish on this rank (the gradient read or the step) counts them,
    skips the minibatch on every rank (:func:`odc.fsdp.skip`) and raises :class:`odc.ProtocolError` naming
    them. An iterator resumed after its minibatch finished raises too. With ``steal=False`` it yields this
    rank's own list only.

    Args:
        model: the model :func:`odc.fsdp.enable` was called on.
        lists: every rank's list of microbatches, indexed by rank (the mesh's ranks, node-major).
        cost: predicted cost of a microbatch (e.g. its tokens); the victim is the rank with the most predicted
            cost left. Default: every microbatch costs 1.
        steal: take other ranks' unstarted microbatches once this rank's own are done.

    Raises:
        ConfigError: ``lists`` does not have one list per rank.
        PeerDied, PeerTimeout: a victim died or stalled while this rank waited for its answer.
    """
    if solo(model) is not None:
        if len(lists) != 1:
            raise ConfigError(f"odc.fsdp.microbatches: lists has {len(lists)} entries, one per rank of the 1")
        return iter(lists[0])
    b = _bound(model)
    s = b.state
    world = s.layout.world
    if len(lists) != world:
        raise ConfigError(f"odc.fsdp.microbatches: lists has {len(lists)} entries, one per rank of the {world}")
    s.begin("odc.fsdp.microbatches")
    lists = _over_members(b, lists)
    # The finish checks from the claim counts that this rank's own list was claimed to the end, whatever
    # becomes of the iterator.
    s.iterating(len(lists[s.layout.rank]))
    weigh = None if cost is None else (lambda r, i: cost(lists[r][i]))
    claims = b.engine.claimed(s.version, [len(x) for x in lists], ranks=_stealable(b), cost=weigh, steal=steal)
    if b.rerun:
        return _rerunning(b, claims, lists)
    return _yield(b, s.version, claims, lists)


def rerun_share(items: Sequence[Any], members: Sequence[int], rank: int, ranks_per_node: int) -> list[Any]:
    """This rank's share of ``items`` (work a dropped node had, in an order every rank agrees on) spread over
    the ranks of the member nodes ``members``: item ``i`` goes to the ``i``-th member rank in rank order, round
    robin. Empty for a rank of no member node. Pure: every rank computes every share alike."""
    if ranks_per_node < 1:
        raise ConfigError(f"odc.fsdp.rerun_share: ranks_per_node must be at least 1, got {ranks_per_node}")
    ranks = [n * ranks_per_node + q for n in sorted(set(members)) for q in range(ranks_per_node)]
    if rank not in ranks:
        return []
    at = ranks.index(rank)
    return list(items[at :: len(ranks)])


def _over_members(b: _Binding, lists: Sequence[Sequence[T]]) -> Sequence[Sequence[T]]:
    """Elastic: ``lists`` over the member nodes. The lists of ranks on nodes dropped before this minibatch are
    spread over the members' ranks (``elastic="rerun"``) or refused where not empty (their microbatches would run
    nowhere); ``lists`` as it is otherwise."""
    members = b.engine.members
    if members is None:
        return lists
    per = b.state.layout.shards
    gone = [(r, len(x)) for r, x in enumerate(lists) if r // per not in members and len(x)]
    if not gone:
        return lists
    if not b.rerun:
        raise ConfigError(
            f"odc.fsdp.microbatches: ranks {[r for r, _ in gone]} are on nodes dropped before minibatch "
            f"{b.state.version} (members now {members}), yet their lists hold {sum(n for _, n in gone)} "
            "microbatches, which would run nowhere; plan over odc.fsdp.members(model), or enable with "
            "elastic='rerun' to have them spread over the member nodes"
        )
    lost = [it for r, x in enumerate(lists) if r // per not in members for it in x]
    return [list(x) + rerun_share(lost, members, r, per) if r // per in members else []
            for r, x in enumerate(lists)]


def _rerunning(b: _Binding, claims: Iterator[tuple[int, int]], lists: Sequence[Sequence[T]]) -> Iterator[T]:
    """``elastic="rerun"``: the minibatch's microbatches (:func:`_yield`), then its finish; while a finish drops
    nodes, this rank's share of what they ran since the step (their ranks' lists, stealing staying within a
    node under hybrid sharding, and their shares of earlier reruns), in a minibatch that continues the sums."""
    s = b.state
    per, me = s.layout.shards, s.layout.rank
    yield from _yield(b, s.version, claims, lists)
    ran = {r: list(x) for r, x in enumerate(lists) if r // per in (b.engine.members or [])}
    b.finish("odc.fsdp.microbatches (elastic='rerun')")
    while not s.skipped and (drops := b.drops()):
        members = drops[-1]["members"]
        lost = [it for r, x in sorted(ran.items()) if r // per not in members for it in x]
        share = {r: rerun_share(lost, members, r, per) for r in ran}
        ran = {r: x + share[r] for r, x in ran.items() if r // per in members}
        b.enter_minibatch()  # no step, no zero_grad: continues the minibatch's sums
        version = s.version
        mine = share.get(me, [])
        s.owed[version] = len(mine)  # the finish counts what the loop did not finish (it left early)
        for item in mine:
            if s.version != version or not s.open:
                raise ProtocolError(
                    f"odc.fsdp.microbatches: the rerun of minibatch {version} was resumed after it finished; "
                    "iterate to the end before reading gradients or stepping"
                )
            yield item
            s.owed[version] -= 1  # resumed: the loop finished the item
        b.finish("odc.fsdp.microbatches (elastic='rerun')")


def _yield(b: _Binding, version: int, claims: Iterator[tuple[int, int]], lists: Sequence[Sequence[T]]) -> Iterator[T]:
    """The microbatches of ``claims``, as long as minibatch ``version`` runs."""
    while True:
        if b.state.version != version or not b.state.open:
            raise ProtocolError(
                f"odc.fsdp.microbatches: the iterator of minibatch {version} was resumed after that minibatch "
                f"finished (this rank is at minibatch {b.state.version}); start a new iteration each minibatch"
            )
        try:
            owner, i = next(claims)
        except StopIteration:
            return
        b.state.owed[version] = 1  # in the loop's hands: a loop that leaves with it did not finish it
        yield lists[owner][i]
        b.state.owed[version] = 0


def _stealable(b: Any) -> range:
    """The ranks this rank may steal from: its shard group (every rank, or its node under hybrid sharding)."""
    layout = b.state.layout
    if layout.sharding == "full":
        return range(layout.world)
    g = layout.shards if layout.sharding == "hybrid" else (layout.per_node or layout.world)
    start = layout.rank // g * g
    return range(start, start + g)
