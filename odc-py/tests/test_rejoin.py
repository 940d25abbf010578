"""Elastic rejoin at the engine: 3 emulated nodes x 2 ranks (LOCAL_WORLD_SIZE emulation), a rank SIGKILLed, its
node dropped, and the node restarted: its two new processes ask the job to admit it, the member ranks build the
next generation at the boundary after their step, and the joiners copy a live replica's state one-sidedly. Every
sum is exact over the members of its minibatch, and the replicas stay bitwise equal, the rejoined one included."""

from __future__ import annotations

import math
import os
import signal
import time

import _fsdp_helpers as H
import pytest
import torch
from _dist import pattern_shard, run_ranks

import odc

WORLD, LOCAL, NUMEL, STEPS = 6, 2, 1001, 7


def _count(rank: int, k: int) -> int:
    return 1 + (rank + k) % 2


def _value(rank: int, k: int) -> float:
    return float((rank % 5 + 1) * (k + 1))


def _shard_len() -> int:
    """A rank's shard of the bucket: ceil(NUMEL / LOCAL) rounded up to 64 bytes (what a joiner's model, built as
    its replicas' were, holds without asking an engine)."""
    return math.ceil(math.ceil(NUMEL / LOCAL) / 16) * 16


def _state(sl: int) -> list[torch.Tensor]:
    """A replica's state on one rank: a parameter shard, a momentum and a step counter (AdamW-like)."""
    return [torch.zeros(sl), torch.zeros(sl), torch.zeros((), dtype=torch.int64)]


def _step(state: list[torch.Tensor], g: torch.Tensor) -> None:
    p, m, step = state
    m.mul_(0.9).add_(g)
    p.sub_(0.01 * m)
    step.add_(1)


def _die(store):
    store.set("killed_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _lr(k: int) -> float:
    """The learning rate of minibatch ``k``, as a scheduler stepped after each optimizer step would set it."""
    return 0.5 ** k


def _train(eng, rank, store, state, start, victim, at, log, where="start", delay=0.0):
    """Minibatches ``start``.. of publish, gather, pushes, finish, step, admit and a "scheduler" step; ``victim``
    SIGKILLed in minibatch ``at``: before its publish (``where="start"``), after its pushes (``"pushed"``), or
    ``delay`` s into its finish_minibatch (``"finish"``: in the cross-node sum, the round, or after it returned).
    Admit serves the loop's learning rate as ``extra``, which the loop changes only after admit returned."""
    import json
    import threading

    pattern = torch.arange(NUMEL, dtype=torch.float32) % 13
    sl = eng.bucket("w")["shard_len"]
    sched = {"lr": _lr(start)}
    for k in range(start, STEPS):
        time.sleep(0.02)  # the minibatch's compute
        if victim is not None and k > at:
            # The restarted node must find minibatches left to join, however slow it is to start (a loaded host):
            # past the death the members wait until its ranks call rejoin, then take 0.1 s more per minibatch.
            store.wait([f"joining/{victim // LOCAL * LOCAL + i}" for i in range(LOCAL)])
            time.sleep(0.1)
        doomed = rank == victim and k == at
        if doomed and where == "start":
            _die(store)
        eng.publish("w", state[0].clone(), version=k)
        out = torch.empty(NUMEL)
        eng.gather("w", k, out)
        for _ in range(_count(rank, k)):
            eng.scatter_accumulate("w", pattern * _value(rank, k), scale=1.0)
        if doomed and where == "pushed":
            _die(store)
        if doomed and where == "finish":
            threading.Timer(delay, _die, (store,)).start()
        try:
            eng.finish_minibatch(k)
        except (odc.NodeDropped, odc.PeerDied) as e:
            log["raised"] = (type(e).__name__, str(e), k)
            return log
        if doomed:
            time.sleep(30)  # the timer's kill lands here at the latest
        g = eng.grad_shard("w").clone()
        assert g.numel() == sl
        log["sums"][k] = (g.tolist(), eng.members)
        eng.zero_grad()
        _step(state, g)
        log["state"][k] = [t.tolist() for t in state]  # exact: f32 values are Python floats
        t0 = time.perf_counter()
        eng = eng.admit(state, register_timeout=3, extra=lambda: json.dumps(sched).encode())
        log["boundary_s"][k] = time.perf_counter() - t0
        sched["lr"] = _lr(k + 1)  # after the step (and admit): what the joiner's copy must hold
    log["events"] = eng.elastic_events()
    return log


def _kill_joiner(store, me, when):
    """SIGKILLs this process as soon as the members begin the generation that admits it (``when="admitted"``:
    before it registers there), or once it read the first chunk of its source's state (``"copy"``: of more
    than one)."""
    import threading

    def watch():
        while (gen := store.get("odc/elastic/current") if store.check(["odc/elastic/current"]) else None) is None:
            time.sleep(0.0005)
        key = f"{gen.decode()}/state/{me}/read"
        while when == "copy" and not store.check([key]):
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def _rejoin_run(rank, world, store, victim, at, transport, joiner_killed=None, killed_when="copy", where="start",
                delay=0.0, compress=None):
    """Ranks 0-5 train; processes 6 and 7 are the dead node's ranks restarted once the victim is dead. With
    ``joiner_killed`` the restarted rank of that number is SIGKILLed (``_kill_joiner``). A new generation's
    registration waits 3 s for a rank."""
    kw = {"timeout": 30, "job_key": f"pytest-{os.getppid()}", "transport": transport, "sharding": "hybrid",
          "compress": compress}
    log = {"sums": {}, "state": {}, "boundary_s": {}}
    if rank < WORLD:
        eng = odc.Engine(store, rank, WORLD, local_world_size=LOCAL, elastic=True, **kw)
        eng.register([odc.Bucket("w", NUMEL, torch.float32)])
        assert eng.bucket("w")["shard_len"] == _shard_len()
        state = _state(_shard_len())
        state[0].copy_(torch.arange(state[0].numel(), dtype=torch.float32) / 7 + rank % LOCAL)
        return _train(eng, rank, store, state, 0, victim, at, log, where, delay)
    me = (victim // LOCAL) * LOCAL + rank - WORLD
    store.wait(["killed_at"])
    store.set(f"joining/{me}", b"1")
    if me == joiner_killed:
        _kill_joiner(store, me, killed_when)
    state = _state(_shard_len())
    t0 = time.perf_counter()
    eng = odc.Engine.rejoin(store, me, WORLD, [odc.Bucket("w", NUMEL, torch.float32)], state,
                            local_world_size=LOCAL, register_timeout=3, extra=True, **kw)
    log["rejoin_s"] = time.perf_counter() - t0
    log["copied"] = (eng.first_minibatch, [t.tolist() for t in state])
    log["extra"] = (eng.rejoin_source, eng.extra_state)
    return _train(eng, me, store, state, eng.first_minibatch, None, None, log)


def _expected(k: int, nodes: list[int], me: int, sl: int) -> list[float]:
    weight = sum(_value(r, k) * _count(r, k) for r in range(WORLD) if r // LOCAL in nodes)
    return pattern_shard(weight, me, sl, NUMEL)


def _check_rejoin(res, victim, at, rel=0.0):
    """Asserts a run of ``_rejoin_run`` (the victim killed in minibatch ``at``, its node restarted); returns the
    minibatches that dropped the node and readmitted it. ``rel``: compressed sums, each within ``rel`` of its
    largest exact element and none exact (the replicas' bitwise equality holds all the same)."""
    dead = victim // LOCAL
    assert res[victim] == ("hung", -signal.SIGKILL), res[victim]
    for mate in range(dead * LOCAL, (dead + 1) * LOCAL):  # a node-mate raises in a gather, a finish or the round
        status, out = res[mate]
        if mate != victim:
            assert (out["raised"][0] if status == "ok" else out[0]) in ("NodeDropped", "PeerDied"), res[mate]
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    joiners = {WORLD + i: dead * LOCAL + i for i in range(LOCAL)}
    for r in [*live, *joiners]:
        assert res[r][0] == "ok" and "events" in res[r][1], (r, str(res[r])[:3000])
    first = {res[j][1]["copied"][0] for j in joiners}
    assert len(first) == 1, first
    back = first.pop()
    drop = res[live[0]][1]["events"][0]["minibatch"]
    assert at <= drop <= at + 1 and drop < back < STEPS, (at, drop, back)  # a death after the commit: at + 1
    for r in live:
        kinds = [(e["kind"], e["minibatch"], e["node"]) for e in res[r][1]["events"]]
        assert kinds == [("drop", drop, dead), ("join", back, dead)], (r, kinds)
    # Every member's every sum: exact over the nodes that were members of its minibatch (nothing lost,
    # nothing counted twice), and the replicas' bitwise equal.
    for r, rank in [*((r, r) for r in live), *joiners.items()]:
        for k, (got, members) in res[r][1]["sums"].items():
            nodes = [0, 1, 2] if (k < drop or k >= back) else [n for n in range(3) if n != dead]
            assert members == nodes, (r, k, members)
            want = _expected(k, nodes, rank % LOCAL, len(got))
            if rel:
                assert got == pytest.approx(want, abs=rel * max(map(abs, want))) and got != want, (r, k)
            else:
                assert got == want, (r, k)
        assert sorted(res[r][1]["sums"]) == list(range(0 if r in live else back, STEPS)), r
    for j, rank in joiners.items():
        # The copy is bitwise its source replica's state at the boundary (the same local rank).
        _, copied = res[j][1]["copied"]
        src = next(r for r in live if r % LOCAL == rank % LOCAL)
        assert copied == res[src][1]["state"][back - 1], j
        # What the source served beside the tensors is what its loop set after the step and admit (the learning
        # rate of minibatch `back`), not what it held when admit served the tensors (that of `back - 1`).
        assert res[j][1]["extra"] == (src, f'{{"lr": {_lr(back)}}}'.encode()), (j, res[j][1]["extra"], back)
        # And stays so: every later step's state equals every replica's, bit for bit.
        for k in range(back, STEPS):
            for r in live:
                if r % LOCAL == rank % LOCAL:
                    assert res[j][1]["state"][k] == res[r][1]["state"][k], (j, r, k)
    return drop, back


def test_a_rejoin_under_compressed_cross_node_sums_keeps_the_replicas_bitwise_equal():
    # int8 sums with error feedback: the rejoined node's engine starts from zero residuals and the members' new
    # generation too, so every replica, the rejoined one included, still adds the same dequantised copies: the
    # states stay equal bit for bit (checked by _check_rejoin), each sum within one int8 rounding per node
    # (amax/254 of a block, with the residual carried) of the exact one.
    victim, at = 3, 1
    res = run_ranks(_rejoin_run, WORLD + LOCAL, timeout=180, victim=victim, at=at, transport="shm",
                    compress={"push": "int8"})
    _check_rejoin(res, victim, at, rel=4 / 254)


@pytest.mark.parametrize("transport", ["shm", "mixed"])
def test_a_restarted_node_rejoins_with_a_replicas_state_and_every_sum_counts_it_again(transport):
    victim, at = 3, 1
    res = run_ranks(_rejoin_run, WORLD + LOCAL, timeout=180, victim=victim, at=at, transport=transport)
    _, back = _check_rejoin(res, victim, at)
    live = [r for r in range(WORLD) if r // LOCAL != victim // LOCAL]
    # The live ranks lose one boundary: the admit that built the next generation and served the copy; at every
    # other boundary admit returns at once (one native call, nothing admitted).
    for r in live:
        b = res[r][1]["boundary_s"]
        assert max(v for k, v in b.items() if k != back - 1) < 0.1, (r, b)
        print(f"rank {r}: admit at the boundary before minibatch {back}: {b[back - 1]:.3f} s; other boundaries "
              f"at most {max(v for k, v in b.items() if k != back - 1):.4f} s")


def test_random_kills_and_rejoins():
    """``ODC_REJOIN_KILLS`` runs (default 1; ``ODC_REJOIN_SEED`` picks them): a random rank killed at a random
    point of a random minibatch (as test_elastic's random kills), its node restarted at once; every sum exact
    over its minibatch's members, the rejoined replica bitwise its source's, no hang."""
    import random

    runs = int(os.environ.get("ODC_REJOIN_KILLS", "1"))
    rng = random.Random(int(os.environ.get("ODC_REJOIN_SEED", "0")))
    for i in range(runs):
        victim, at = rng.randrange(WORLD), rng.randrange(STEPS - 3)
        where, delay = rng.choice(["start", "pushed", "finish"]), rng.uniform(0.0, rng.choice([0.003, 0.05]))
        case = {"victim": victim, "at": at, "where": where, "delay": round(delay, 4),
                "transport": rng.choice(["shm", "mixed"])}
        res = run_ranks(_rejoin_run, WORLD + LOCAL, timeout=180, **case)
        try:
            drop, back = _check_rejoin(res, victim, at)
        except AssertionError as e:
            raise AssertionError(f"run {i}: {case}: {e}") from e
        joiner = res[WORLD][1]
        live = next(r for r in range(WORLD) if r // LOCAL != victim // LOCAL)
        print(f"run {i}: {case}: dropped at {drop}, back at {back}; the joiner waited {joiner['rejoin_s']:.3f} s; "
              f"members' admit {res[live][1]['boundary_s'][back - 1]:.3f} s")


def test_a_joiner_killed_during_its_copy_is_dropped_again_and_the_members_go_on():
    victim, at, killed = 3, 1, 3  # node 1's rank 3 dies, then dies again while it copies rank 1's state
    dead = victim // LOCAL
    res = run_ranks(_rejoin_run, WORLD + LOCAL, timeout=180, victim=victim, at=at, transport="shm",
                    joiner_killed=killed)
    assert res[WORLD + killed % LOCAL] == ("hung", -signal.SIGKILL), res[WORLD + killed % LOCAL]
    status, out = res[WORLD + (killed ^ 1) % LOCAL]  # the other joiner: copied its state, then its node dropped
    assert (out["raised"][0] if status == "ok" else out[0]) in ("NodeDropped", "PeerDied"), (status, out)
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    for r in live:
        assert res[r][0] == "ok" and "events" in res[r][1], (r, str(res[r])[:3000])
        kinds = [(e["kind"], e["node"]) for e in res[r][1]["events"]]
        assert kinds == [("drop", dead), ("join", dead), ("drop", dead)], (r, kinds)
        back = res[r][1]["events"][1]["minibatch"]
        assert res[r][1]["events"][2]["minibatch"] == back, res[r][1]["events"]  # its first round drops it
        for k, (got, members) in res[r][1]["sums"].items():
            nodes = [0, 1, 2] if k < at else [0, 2]
            assert (members, got) == (nodes, _expected(k, nodes, r % LOCAL, len(got))), (r, k)
        assert sorted(res[r][1]["sums"]) == list(range(STEPS)), r
    for r in live:  # the replicas stay bitwise equal
        twin = live[(live.index(r) + LOCAL) % len(live)]
        assert res[r][1]["state"] == res[twin][1]["state"], (r, twin)


# FSDP2: microbatches per rank at each step; nodes are ranks (0, 1), (2, 3), (4, 5).
PLAN = ((1, 2, 0, 1, 2, 1), (2, 1, 1, 2, 0, 1), (1, 0, 2, 1, 1, 2), (0, 2, 1, 1, 2, 1), (2, 1, 1, 0, 1, 2),
        (1, 1, 2, 1, 0, 1), (1, 2, 1, 2, 1, 0))


def _member_or_joiner(rank, store, dead, fsdp1=False, deterministic=False):
    """Ranks 0-5: the job's FSDP2 HSDP model (FSDP1 HYBRID_SHARD with ``fsdp1``) and AdamW, enabled elastic with
    the job's store. Processes 6 and 7: node `dead` restarted once its victim is killed (``killed_at``): a process
    group of their own, the model over a (1, 2) mesh from another seed (the copy must set the parameters), and
    rejoin. Returns (model, optimizer, the rank it plays, its first minibatch)."""
    import _fsdp1 as F1
    import torch.distributed as dist

    if rank < WORLD:
        H.init_pg(rank, WORLD, store)
        model = (F1.build(strategy="HYBRID_SHARD", nodes=WORLD // LOCAL) if fsdp1
                 else H.build(WORLD, mesh=H.hsdp_mesh(WORLD, LOCAL)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        odc.fsdp.enable(model, opt, sharding="hybrid", elastic=True, timeout=60, store=store,
                        deterministic=deterministic)
        return model, opt, rank, 0
    me = dead * LOCAL + rank - WORLD
    store.wait(["killed_at"])
    dist.init_process_group("gloo", store=dist.PrefixStore(f"node{dead}/", store), rank=me % LOCAL,
                            world_size=LOCAL)
    model = (F1.build(seed=1, strategy="HYBRID_SHARD", nodes=1) if fsdp1
             else H.build(LOCAL, seed=1, mesh=H.hsdp_mesh(LOCAL, LOCAL)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    store.set(f"joining/{me}", b"1")
    first = odc.fsdp.rejoin(model, opt, store=store, rank=me, world_size=WORLD, timeout=60,
                            deterministic=deterministic)
    return model, opt, me, first


def _fsdp_rejoin(rank, world, store, victim, at, transport, flavour):
    """FSDP2 HSDP (``flavour="fsdp2"``, torch's own clip) or FSDP1's HYBRID_SHARD (``"fsdp1"``, flat parameters,
    ODC's clip) under odc.fsdp (elastic, AdamW) on ranks 0-5; `victim` SIGKILLed after its first backward of step `at`;
    processes 6 and 7 rebuild its node (a process group of their own, a (1, 2) mesh) and rejoin. Each rank runs
    its plan's microbatches, the loss normalized by the member nodes' tokens (rescaled to the survivors' at a
    step that dropped a node). Returns the shards after every step."""
    import _fsdp1 as F1

    H.as_nodes(LOCAL, transport)
    dead = victim // LOCAL
    fsdp1 = flavour == "fsdp1"
    model, opt, me, first = _member_or_joiner(rank, store, dead, fsdp1=fsdp1)
    tokens = lambda s, nodes: 27 * sum(PLAN[s][r] for r in range(WORLD) if r // LOCAL in nodes)  # noqa: E731
    out = {"first": first, "shards": {}, "members": {}, "norms": {}}
    try:
        for s in range(first, len(PLAN)):
            if rank < WORLD and s > at:
                # The restarted node must find minibatches left to join, however slow it is to start (a loaded
                # host): the members wait until its ranks call rejoin, then take half a second per step.
                store.wait([f"joining/{dead * LOCAL + i}" for i in range(LOCAL)])
                time.sleep(0.5)
            members = odc.fsdp.members(model)
            out["members"][s] = members
            norm = tokens(s, members)
            for m in range(PLAN[s][me]):
                (H.sample_loss(model, H.data(s, m, me)) / norm * WORLD).backward()  # FSDP averages over D
                if me == victim and s == at and rank < WORLD:
                    store.set("killed_at", repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            odc.fsdp.finish(model)
            if dropped := odc.fsdp.dropped(model):
                for p in model.parameters():
                    p.grad.mul_(norm / tokens(s, dropped[-1]["members"]))
            if fsdp1:
                norm_s = odc.fsdp.clip_grad_norm_(model, 0.5)
            else:  # the user's unchanged loop: torch's own clip (within the node under HSDP)
                norm_s = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                norm_s = norm_s.full_tensor() if hasattr(norm_s, "full_tensor") else norm_s
            out["norms"][s] = float(norm_s)
            opt.step()
            opt.zero_grad()
            out["shards"][s] = F1.local_shards(model) if fsdp1 else H.local_shards(model)
    except (odc.NodeDropped, odc.PeerDied) as e:
        out["raised"] = type(e).__name__
    out["events"] = [(e["kind"], e["minibatch"], e["node"]) for e in odc.fsdp.elastic_events(model)]
    return out


@pytest.mark.torch_versions  # the torch the trainer pins too (verl: 2.11)
@pytest.mark.parametrize("flavour", ["fsdp2", "fsdp1"])
def test_a_restarted_node_rejoins_an_fsdp_job_that_then_equals_one_process_that_skipped_only_its_absence(flavour):
    import _fsdp1 as F1

    victim, at = 3, 1
    dead = victim // LOCAL
    res = run_ranks(_fsdp_rejoin, WORLD + LOCAL, timeout=300, victim=victim, at=at, transport="shm",
                    flavour=flavour)
    assert res[victim] == ("hung", -signal.SIGKILL), res[victim]
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    joiners = {WORLD + i: dead * LOCAL + i for i in range(LOCAL)}
    for r in [*live, *joiners]:
        assert res[r][0] == "ok" and "raised" not in res[r][1], (r, str(res[r])[:3000])
    back = res[WORLD][1]["first"]
    assert at < back < len(PLAN) and res[WORLD + 1][1]["first"] == back, (back, res[WORLD + 1][1]["first"])
    for r in [*live, *joiners]:
        assert res[r][1]["events"][-2:] == [("drop", at, dead), ("join", back, dead)][-len(res[r][1]["events"]):], (
            r, res[r][1]["events"])
        assert res[r][1]["members"][len(PLAN) - 1] == [0, 1, 2], r
    # Every replica of a local rank holds bitwise the same shards after every step the rejoined node ran, and
    # every rank clipped by the same norm at each of them (the joiner's first step included).
    for j, rank in joiners.items():
        for s in range(back, len(PLAN)):
            assert {res[r][1]["norms"][s] for r in [*live, *joiners]} == {res[j][1]["norms"][s]}, (j, s)
            for r in live:
                if r % LOCAL == rank % LOCAL:
                    assert res[j][1]["shards"][s] == res[r][1]["shards"][s], (j, r, s)
    # One process on every sample but the dead node's between its death and its return.
    ref = H.hybrid_reference(PLAN, WORLD, LOCAL, dead, range(at, back))
    for r in live[:LOCAL]:
        if flavour == "fsdp1":
            F1.assert_flat_shards_near(res[r][1]["shards"][len(PLAN) - 1], ref, LOCAL)
        else:
            H.assert_shards_near(res[r][1]["shards"][len(PLAN) - 1], ref, r % LOCAL, LOCAL)


def _fsdp_rejoin_two_per_step(rank, world, store, victim, at):
    """FSDP2 HSDP under odc.fsdp (elastic, deterministic sums, AdamW, torch's clip) with two minibatches per step
    (two odc.fsdp.minibatch blocks, no step between: the second continues the first's sums). `victim` SIGKILLed
    in step `at`'s first block; processes 6 and 7 rebuild its node and rejoin. The members pause before each
    step's first block, so a restarted node asks that block's round and is admitted from the second block: the
    middle of a step, which the members decline (it asks the next round). Returns the shards after every step."""
    H.as_nodes(LOCAL, "shm")
    dead = victim // LOCAL
    model, opt, me, first = _member_or_joiner(rank, store, dead, deterministic=True)
    out = {"first": first, "shards": {}, "norms": {}}
    try:
        for s in range(first // 2, len(PLAN)):
            if rank < WORLD and s > at:
                store.wait([f"joining/{dead * LOCAL + i}" for i in range(LOCAL)])
                time.sleep(0.5)
            for half in (0, 1):
                with odc.fsdp.minibatch(model):
                    for m in range(PLAN[s][me]):
                        if m % 2 == half:
                            (H.sample_loss(model, H.data(s, m, me)) / 27).backward()
                        if me == victim and s == at and rank < WORLD:
                            store.set("killed_at", repr(time.time()))
                            os.kill(os.getpid(), signal.SIGKILL)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            out["norms"][s] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            opt.step()
            opt.zero_grad()
            out["shards"][s] = H.local_shards(model)
    except (odc.NodeDropped, odc.PeerDied) as e:
        out["raised"] = type(e).__name__
    out["events"] = [(e["kind"], e["minibatch"], e.get("reason", "")) for e in odc.fsdp.elastic_events(model)]
    return out


def test_a_node_is_let_in_only_where_a_step_begins_when_minibatches_share_a_step():
    # Two minibatches per step: a node admitted from the second would start in the middle of the step, without
    # the gradients of the first (its replica would step on half of them, silently). The members decline that
    # admission alike (an "abandoned" event), the restarted node asks the next round and comes in where a step
    # begins; from then every replica holds the same bits and every rank clips by the same norm.
    victim, at = 3, 1
    dead = victim // LOCAL
    res = run_ranks(_fsdp_rejoin_two_per_step, WORLD + LOCAL, timeout=300, victim=victim, at=at)
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    joiners = {WORLD + i: dead * LOCAL + i for i in range(LOCAL)}
    for r in [*live, *joiners]:
        assert res[r][0] == "ok" and "raised" not in res[r][1], (r, str(res[r])[:3000])
    back = res[WORLD][1]["first"]
    assert back % 2 == 0 and back // 2 < len(PLAN), back  # where a step begins
    for r in live:
        kinds = [(k, mb) for k, mb, _ in res[r][1]["events"]]
        assert ("join", back) in kinds, (r, res[r][1]["events"])
        declined = [(mb, why) for k, mb, why in res[r][1]["events"] if k == "abandoned"]
        assert declined and all(mb % 2 == 1 and "continues" in why for mb, why in declined), (r, declined)
    for j, rank in joiners.items():
        for s in range(back // 2, len(PLAN)):
            assert {res[r][1]["norms"][s] for r in [*live, *joiners]} == {res[j][1]["norms"][s]}, (j, s)
            for r in live:
                if r % LOCAL == rank % LOCAL:
                    assert res[j][1]["shards"][s] == res[r][1]["shards"][s], (j, r, s)


def test_a_joiner_that_dies_before_it_registers_is_abandoned_and_the_members_go_on():
    # Rank 3's new process dies as soon as the members begin the generation that admits node 1, before it
    # registers there: every rank's registration gives up after 3 s, the generation is abandoned alike on all,
    # the members go on with their engines over nodes 0 and 2, and the other joiner's rejoin raises.
    victim, at, killed = 3, 1, 3
    dead = victim // LOCAL
    res = run_ranks(_rejoin_run, WORLD + LOCAL, timeout=180, victim=victim, at=at, transport="shm",
                    joiner_killed=killed, killed_when="admitted")
    assert res[WORLD + killed % LOCAL] == ("hung", -signal.SIGKILL), res[WORLD + killed % LOCAL]
    status, out = res[WORLD + (killed ^ 1) % LOCAL]
    assert status == "error" and out[0] == "ProtocolError" and "abandoned" in out[1], (status, out)
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    for r in live:
        assert res[r][0] == "ok" and "events" in res[r][1], (r, str(res[r])[:3000])
        events = res[r][1]["events"]
        assert [e["kind"] for e in events] == ["drop", "abandoned"], (r, events)
        back = events[1]["minibatch"]
        assert at < back < STEPS and events[1]["nodes"] == [dead] and 2.5 < events[1]["waited_s"] < 10, events
        for k, (got, members) in res[r][1]["sums"].items():
            nodes = [0, 1, 2] if k < at else [0, 2]
            assert (members, got) == (nodes, _expected(k, nodes, r % LOCAL, len(got))), (r, k)
        assert sorted(res[r][1]["sums"]) == list(range(STEPS)), r
        twin = live[(live.index(r) + LOCAL) % len(live)]
        assert res[r][1]["state"] == res[twin][1]["state"], (r, twin)


class _Normed(H.Tiny):
    """Tiny with module buffers that change in training: a BatchNorm's statistics of the embeddings (changed by
    every forward, from this rank's data) and a step counter the loop advances in each minibatch (the same on
    every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(H.DIM)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens):
        x = self.bn(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _normed(nodes, seed, fsdp1):
    """_Normed under FSDP2 HSDP (each block, then the root) or FSDP1 HYBRID_SHARD (each block its own instance),
    over a (nodes, LOCAL) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    model = _Normed()
    mesh = init_device_mesh("cpu", (nodes, LOCAL), mesh_dim_names=("replicate", "shard"))
    if fsdp1:
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({H.Block}), device_mesh=mesh,
                                        sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_tensor(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().tolist()


def _whole(model, opt, scaler, sched):
    """Every piece of a rank's replica state, as plain data (exact: f32 values are Python floats)."""
    return {
        "params": {n: _local_tensor(p) for n, p in model.named_parameters()},
        "buffers": {n: _local_tensor(b) for n, b in model.named_buffers()},
        "optimizer": [sorted((k, _local_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in st.items())
                      for st in (opt.state[p] for g in opt.param_groups for p in g["params"])],
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "scaler": scaler.state_dict(),
        "scheduler": sched.state_dict(),
    }


def _evaluate(model, s, me):
    """An EMA-style evaluation at the start of step ``s``: other weights swapped in (the parameters halved), an
    eval-mode forward inside odc.fsdp.evaluation (a minibatch of its own), the trained weights swapped back."""
    with torch.no_grad():
        keep = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.mul_(0.5)
        model.eval()
        with odc.fsdp.evaluation(model):
            model(H.data(s, 0, me)[:, :-1])
        model.train()
        for p, k in zip(model.parameters(), keep, strict=True):
            p.copy_(k)


def _fsdp_rejoin_whole(rank, world, store, victim, at, flavour):
    """As _fsdp_rejoin, with replica state beyond the parameters and the optimizer's tensors: module buffers
    (_Normed), a OneCycleLR (it moves the learning rate and AdamW's beta1 at every step) and a GradScaler
    (growth_interval=2: its scale and growth tracker move), passed to enable and rejoin, and an EMA-style
    evaluation at the start of every step (so step s is minibatches 2s, the evaluation, and 2s + 1). The loss's
    normaliser is odc.fsdp.global_sum of every rank's tokens, the gradients divided by it after the finish.
    Returns the counts and each step's whole replica state (the joiner's also as copied, at its first step - 1)."""
    import torch.distributed as dist

    H.as_nodes(LOCAL, "shm")
    dead = victim // LOCAL
    fsdp1 = flavour == "fsdp1"
    member = rank < WORLD
    me = rank if member else dead * LOCAL + rank - WORLD
    if member:
        H.init_pg(rank, WORLD, store)
    else:
        store.wait(["killed_at"])
        dist.init_process_group("gloo", store=dist.PrefixStore(f"node{dead}/", store), rank=me % LOCAL,
                                world_size=LOCAL)
    model = _normed(WORLD // LOCAL if member else 1, 0 if member else 1, fsdp1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=len(PLAN))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    extras = {"scaler": scaler, "scheduler": sched}
    steps = next(b for n, b in model.named_buffers() if n.endswith("steps"))
    out = {"first": 0, "whole": {}, "counts": {}}
    if member:
        odc.fsdp.enable(model, opt, sharding="hybrid", elastic=True, timeout=60, store=store, **extras)
    else:
        store.set(f"joining/{me}", b"1")
        out["first"] = odc.fsdp.rejoin(model, opt, store=store, rank=me, world_size=WORLD, timeout=60, **extras)
        out["whole"][out["first"] // 2 - 1] = _whole(model, opt, scaler, sched)  # as copied
    try:
        for s in range(out["first"] // 2, len(PLAN)):
            if member and s > at:
                store.wait([f"joining/{dead * LOCAL + i}" for i in range(LOCAL)])
                time.sleep(0.5)
            if 2 * s >= out["first"]:  # (a joiner let in at an evaluation's end starts with the step's training)
                _evaluate(model, s, me)
            scaler.scale(torch.zeros(()))  # a rank without a microbatch: the scaler's lazy init
            for m in range(PLAN[s][me]):
                scaler.scale(H.sample_loss(model, H.data(s, m, me)) * WORLD).backward()  # FSDP averages over D
                if me == victim and s == at and member:
                    store.set("killed_at", repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            count = odc.fsdp.global_sum(model, 27 * PLAN[s][me])  # finishes the minibatch
            out["counts"][s] = count.item()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(count)
            with torch.no_grad():
                steps.add_(1)
            scaler.unscale_(opt)
            if fsdp1:
                odc.fsdp.clip_grad_norm_(model, 0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            out["whole"][s] = _whole(model, opt, scaler, sched)
    except (odc.NodeDropped, odc.PeerDied) as e:
        out["raised"] = type(e).__name__
    out["events"] = [(e["kind"], e["minibatch"], e.get("node", e.get("reason"))) for e in
                     odc.fsdp.elastic_events(model)]
    return out


def _check_whole(res, victim, at):
    """Asserts a run of _fsdp_rejoin_whole: the joiners' replica state as copied is bitwise their sources'
    at the boundary, and every piece of it that is the same on every replica stays so after every later step
    (the BatchNorm's statistics follow each rank's own data from then on); every rank's token count is the
    member nodes' tokens of the step, the rejoined node's included once it is back. Returns where it came back."""
    dead = victim // LOCAL
    live = [r for r in range(WORLD) if r // LOCAL != dead]
    joiners = {WORLD + i: dead * LOCAL + i for i in range(LOCAL)}
    for r in [*live, *joiners]:
        assert res[r][0] == "ok" and "raised" not in res[r][1], (r, str(res[r])[:3000])
    first = res[WORLD][1]["first"]
    back = first // 2  # the step it comes back at
    assert at < back < len(PLAN) and res[WORLD + 1][1]["first"] == first, first
    for j, rank in joiners.items():
        src = next(r for r in live if r % LOCAL == rank % LOCAL)  # the first member node's (one joining node)
        copied, theirs = res[j][1]["whole"][back - 1], res[src][1]["whole"][back - 1]
        differ = [piece for piece in theirs if copied[piece] != theirs[piece]]
        assert not differ, (j, src, differ, {p: (str(copied[p])[:200], str(theirs[p])[:200]) for p in differ})
    assert first % 2 == 0, first  # let in where a step ended, not at an evaluation's end
    for r in live:
        events = res[r][1]["events"]
        # It asks the round of an evaluation's minibatch (the members pause before it): admitted there, it would
        # be let in at the block's end, with the evaluated weights still swapped in; the members decline that
        # alike (it asks the next round), so it comes in where a step ended: `first` is even.
        declined = [e for e in events if e[0] == "abandoned"]
        assert all(mb % 2 == 1 and "evaluation" in why for _, mb, why in declined), (r, events)
        assert [e for e in events if e[0] != "abandoned"] == [("drop", 2 * at + 1, dead), ("join", first, dead)], (
            r, events)

    def same_on_replicas(whole):  # BatchNorm's statistics follow this rank's own data; its step counter does not
        return {**whole, "buffers": {n: v for n, v in whole["buffers"].items() if n.endswith("steps")}}

    for j, rank in joiners.items():
        for s in range(back, len(PLAN)):
            for r in live:
                if r % LOCAL == rank % LOCAL:
                    mine, twin = same_on_replicas(res[j][1]["whole"][s]), same_on_replicas(res[r][1]["whole"][s])
                    differ = [piece for piece in mine if mine[piece] != twin[piece]]
                    assert not differ, (j, r, s, differ)
    for r in [*live, *joiners]:
        for s, count in res[r][1]["counts"].items():
            nodes = [n for n in range(WORLD // LOCAL) if not (at <= s < back and n == dead)]
            assert count == 27 * sum(PLAN[s][q] for q in range(WORLD) if q // LOCAL in nodes), (r, s, count)
        assert sorted(res[r][1]["counts"]) == list(range(0 if r in live else back, len(PLAN))), r
    return back


@pytest.mark.torch_versions
@pytest.mark.parametrize("flavour", ["fsdp2", "fsdp1"])
def test_a_rejoined_replica_is_whole_and_every_ranks_token_count_counts_it(flavour):
    # A model with buffers, a OneCycleLR and a GradScaler passed to enable and rejoin: the joiner's buffers,
    # parameter groups (learning rate, betas), scaler and scheduler are its source's as the members' next
    # minibatch starts (after scaler.update() and scheduler.step()), bitwise, and stay its replicas' after every
    # later step; odc.fsdp.global_sum counts the rejoined node's tokens from its first minibatch on.
    victim, at = 3, 1
    res = run_ranks(_fsdp_rejoin_whole, WORLD + LOCAL, timeout=300, victim=victim, at=at, flavour=flavour)
    back = _check_whole(res, victim, at)
    counts = {s: res[WORLD][1]["counts"][s] for s in range(back, len(PLAN))}  # steps, not minibatches
    declined = [e for e in res[0][1]["events"] if e[0] == "abandoned"]
    print(f"{flavour}: node {victim // LOCAL} dropped at step {at}, back at step {back} (declined at an evaluation's "
          f"end: {declined}); the joiners' token counts from then on, every rank's too: {counts}")


def _rejoin_without_optimizer(rank, world, store):
    """Ranks 0-5 enable elastic without an optimizer hook (a loop on odc.fsdp.minibatch) and train a step;
    processes 6 and 7 build node 1's model over a process group of their own and try to rejoin: with an
    optimizer (the members' replica has no optimizer state ODC knows) and without one."""
    import torch.distributed as dist

    H.as_nodes(LOCAL, "shm")
    if rank < WORLD:
        H.init_pg(rank, WORLD, store)
        model = H.build(WORLD, mesh=H.hsdp_mesh(WORLD, LOCAL))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        odc.fsdp.enable(model, None, sharding="hybrid", elastic=True, timeout=60, store=store)
        with odc.fsdp.minibatch(model):
            H.sample_loss(model, H.data(0, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
        store.set(f"enabled/{rank}", b"1")
        store.wait([f"tried/{r}" for r in (WORLD, WORLD + 1)])
        return {}
    store.wait([f"enabled/{r}" for r in range(WORLD)])
    me = LOCAL + rank - WORLD
    dist.init_process_group("gloo", store=dist.PrefixStore("node1/", store), rank=me % LOCAL, world_size=LOCAL)
    model = H.build(LOCAL, seed=1, mesh=H.hsdp_mesh(LOCAL, LOCAL))
    out = {}
    for name, opt in (("with", torch.optim.AdamW(model.parameters(), lr=1e-2)), ("without", None)):
        t0 = time.perf_counter()
        try:
            odc.fsdp.rejoin(model, opt, store=store, rank=me, world_size=WORLD, timeout=60)
            out[name] = "rejoined"
        except odc.ConfigError as e:
            out[name] = (str(e), time.perf_counter() - t0)
    store.set(f"tried/{rank}", b"1")
    return out


def test_a_job_without_an_optimizer_hook_refuses_a_rejoin_by_name_at_once():
    # enable(model, None, elastic=True) serves no optimizer state (ODC does not know it): a joiner would restart
    # the optimizer at step 0 with zero moments and diverge silently. Its rejoin raises at once, naming why.
    res = run_ranks(_rejoin_without_optimizer, WORLD + LOCAL, timeout=180)
    assert all(res[r][0] == "ok" for r in res), res
    for j in (WORLD, WORLD + 1):
        with_opt, without = res[j][1]["with"], res[j][1]["without"]
        assert "the members let no node rejoin: odc.fsdp.enable(model, None, elastic=...) hooks no optimizer" in \
            with_opt[0] and with_opt[1] < 5, with_opt
        assert "odc.fsdp.rejoin needs the loop's optimizer(s)" in without[0], without
