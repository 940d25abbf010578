"""Two ``odc`` groups over the same ranks share their engines and still cannot cross: each is driven from its own
thread, rank 0 issuing group A's operations first and rank 1 group B's, and every result is its own group's."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc
import odc.backend

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

TIMEOUT = datetime.timedelta(seconds=30)
ROUNDS, N = 4, 1000


def _data(rank: int, group: int, i: int, n: int = N) -> torch.Tensor:
    """Integer-valued data that differs per rank, group and round (exact in f32 sums)."""
    return torch.arange(n, dtype=torch.float32) % 97 + 1000 * group + 100 * rank + 10 * i


def _ops(group, rank, world, g):
    """All-gather, reduce-scatter and all-reduce on ``group``, ROUNDS times; what differs from its own data."""
    wrong = []
    for i in range(ROUNDS):
        x = _data(rank, g, i)
        full = torch.empty(world * N)
        dist.all_gather_into_tensor(full, x, group=group)
        if not torch.equal(full, torch.cat([_data(q, g, i) for q in range(world)])):
            wrong.append(("all_gather", i, full[::N].tolist()))
        rows = torch.cat([_data(rank, g, i, N // world) + q for q in range(world)])
        rs = torch.empty(N // world)
        dist.reduce_scatter_tensor(rs, rows, group=group)
        if not torch.equal(rs, sum(_data(q, g, i, N // world) + rank for q in range(world))):
            wrong.append(("reduce_scatter", i, rs[:1].tolist()))
        ar = x.clone()
        dist.all_reduce(ar, group=group)
        if not torch.equal(ar, sum(_data(q, g, i) for q in range(world))):
            wrong.append(("all_reduce", i, ar[:1].tolist()))
    return wrong


def _two_threads(rank, world, store):
    odc.register()
    dist.init_process_group("odc", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    groups = [dist.group.WORLD, dist.new_group(backend="odc", timeout=TIMEOUT)]
    for g, group in enumerate(groups):  # the engines exist (made in one order) before the threads race
        assert _ops(group, rank, world, g) == [], g
    out: dict[int, object] = {}

    def drive(g: int) -> None:
        try:
            out[g] = _ops(groups[g], rank, world, g)
        except Exception as e:
            out[g] = f"{type(e).__name__}: {e}"

    first = 0 if rank == 0 else 1  # rank 0 issues A first, rank 1 B first
    threads = [threading.Thread(target=drive, args=(first,)), threading.Thread(target=drive, args=(1 - first,))]
    threads[0].start()
    time.sleep(0.5)  # the first thread is in its first operation, waiting on the other rank
    threads[1].start()
    for t in threads:
        t.join(timeout=120)
    shared = odc.backend.get_process_group(groups[0])._set is odc.backend.get_process_group(groups[1])._set
    return {"results": out, "alive": [t.is_alive() for t in threads], "shared": shared}


def test_two_groups_of_the_same_ranks_driven_from_two_threads_in_opposite_orders_do_not_cross():
    """Before, the groups' operations met on the shared engines in each rank's own order: group A's all-gather on
    rank 0 read group B's data from rank 1 (or the ranks waited on each other's engine until the deadline)."""
    res = run_ranks(_two_threads, 2, timeout=240)
    for rank, (status, value) in res.items():
        assert status == "ok", (rank, value)
        assert value["alive"] == [False, False], (rank, value)
        assert value["results"] == {0: [], 1: []}, (rank, value["results"])
        assert value["shared"], "the two groups of the same ranks no longer share one set of engines"


# -- the turns themselves, in one process: two ranks' engine sets over one store --------------------------------
def _engine_op(store: dist.Store, rank: int, turn: int, ticket: tuple[int, int], seen: list) -> None:
    """An engine operation's pairing, emulated: each rank posts the ticket it runs in ``turn`` and waits for the
    other's (as a gather waits for the peer's publish), recording a crossing if they differ."""
    store.set(f"op/{turn}/{rank}", f"{ticket[0]}:{ticket[1]}")
    store.wait([f"op/{turn}/{1 - rank}"], datetime.timedelta(seconds=20))
    other = tuple(int(x) for x in store.get(f"op/{turn}/{1 - rank}").decode().split(":"))
    seen.append((turn, ticket, other))


def test_turns_pair_every_rank_on_the_same_groups_operation_also_when_the_switch_meets_one_in_flight():
    """Two emulated ranks, two threads each (group 0 and group 1; rank 0 tends to issue group 0's operation first
    and rank 1 group 1's), the switch to posted turns made while group 0's operations are in flight: in every
    turn both ranks run the same ticket (with the posting disabled, turns cross from the switch on)."""
    import random

    from odc.backend._engines import EngineSet, SetKey

    store = dist.HashStore()
    key = SetKey((0, 1), "shm", None, 1 << 20, 20.0, "test")
    sets = [EngineSet(key, r, dist.PrefixStore("order/", store)) for r in range(2)]
    seen: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    created = [threading.Event(), threading.Event()]  # the second group exists on that rank

    def drive(rank: int, group: int, ops: int) -> None:
        rng = random.Random(10 * rank + group)
        lag = 0.003 if rank != group else 0.0  # rank 0 tends to issue group 0's first, rank 1 group 1's
        try:
            if group == 1:
                created[rank].wait(20)
            for i in range(ops):
                time.sleep(lag * rng.random())
                sets[rank].acquire((group, i), "op")
                try:
                    _engine_op(store, rank, sets[rank]._turn, (group, i), seen[rank])
                    time.sleep(rng.random() * 0.002)
                finally:
                    sets[rank].release()
        except BaseException as e:
            errors.append(e)

    def make_second_group(rank: int) -> None:
        time.sleep(0.05 * (rank + 1))  # group 0's operations are running meanwhile
        try:
            sets[rank].post_turns(dist.PrefixStore("group1/", store), 20.0, 1)
        except BaseException as e:
            errors.append(e)
        created[rank].set()

    threads = [threading.Thread(target=drive, args=(r, g, 60)) for r in (0, 1) for g in ((0, 1) if r == 0 else (1, 0))]
    threads += [threading.Thread(target=make_second_group, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert sets[0].posted and sets[1].posted
    for rank in (0, 1):
        assert len(seen[rank]) == 120, len(seen[rank])
        crossed = [(turn, mine, other) for turn, mine, other in seen[rank] if mine != other]
        assert crossed == [], crossed[:5]


def test_the_new_groups_operation_waits_for_the_latest_turn_any_rank_switched_at():
    """The race above, made certain: rank 1 is in turn 2 (group 0's operation 2, waiting for rank 0) when the second
    group is made, so rank 0 switches at turn 2 and rank 1 at turn 3; rank 0's new-group thread then asks first.
    Before, it took turn 2 (posted, but rank 1 read from turn 3 on): rank 0 ran group 1's operation 0 against rank
    1's group 0 operation 2, and the next turns waited on each other until the deadline."""
    from odc.backend._engines import EngineSet, SetKey

    store = dist.HashStore()
    key = SetKey((0, 1), "shm", None, 1 << 20, 5.0, "test")
    sets = [EngineSet(key, r, dist.PrefixStore("order/", store)) for r in range(2)]
    seen: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def op(rank: int, ticket: tuple[int, int]) -> None:
        try:
            sets[rank].acquire(ticket, "op")
            try:
                _engine_op(store, rank, sets[rank]._turn, ticket, seen[rank])
            finally:
                sets[rank].release()
        except BaseException as e:
            errors.append(e)

    def run(*calls: tuple[int, tuple[int, int]]) -> list[threading.Thread]:
        threads = [threading.Thread(target=op, args=c) for c in calls]
        for t in threads:
            t.start()
        return threads

    for i in (0, 1):  # turns 0 and 1: group 0 on both ranks
        for t in run((0, (0, i)), (1, (0, i))):
            t.join(10)
    (late,) = run((1, (0, 2)))  # rank 1 takes turn 2 and waits for rank 0 there
    deadline = time.monotonic() + 5
    while not sets[1]._busy and time.monotonic() < deadline:
        time.sleep(0.001)
    switch = [threading.Thread(target=sets[r].post_turns, args=(dist.PrefixStore("group1/", store), 5.0, 1))
              for r in (0, 1)]
    for t in switch:
        t.start()
    for t in switch:
        t.join(10)
    assert (sets[0]._posted_from, sets[1]._posted_from) == (2, 3)
    new = run((0, (1, 0)), (1, (1, 0)))  # rank 0's new group asks before its group 0's operation 2
    time.sleep(0.2)
    old = run((0, (0, 2)))
    for t in [late, *new, *old]:
        t.join(15)
    assert not errors, errors
    for rank in (0, 1):
        assert [(turn, mine) for turn, mine, _ in seen[rank]] == [(0, (0, 0)), (1, (0, 1)), (2, (0, 2)), (3, (1, 0))]
        assert all(mine == other for _, mine, other in seen[rank]), seen[rank]
