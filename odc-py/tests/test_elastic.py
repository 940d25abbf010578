"""Elastic hybrid sharding at the engine: 3 emulated nodes x 2 ranks (LOCAL_WORLD_SIZE=2), one rank SIGKILLed
during a minibatch. The other nodes' finish_minibatch returns the sum over the surviving nodes (the dead node's
microbatches of that minibatch dropped), they go on for the later minibatches, and the dead node's other rank
raises; ``elastic=True`` outside ``sharding="hybrid"`` is refused by name."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time

import _fsdp_helpers as H
import pytest
import torch
from _dist import pattern_shard, run_ranks

import odc

WORLD, LOCAL, NUMEL, STEPS = 6, 2, 1001, 4


def _count(rank: int, k: int) -> int:
    """Microbatches of `rank` in minibatch `k`: uneven, zero for some."""
    return (rank + 2 * k) % 3


def _value(rank: int, k: int) -> float:
    return float((rank + 1) * (k + 1))


def _dead(pid: int) -> bool:
    """The process is gone or a zombie (killed, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _hold_until_dead(store, victim: int, limit: float = 20.0) -> None:
    """Waits until the victim has set ``killed_at`` and its process is gone (at most ``limit`` seconds)."""
    store.wait(["killed_at"])  # the store's own timeout (60 s) bounds it
    pid, deadline = int(store.get(f"pid/{victim}").decode()), time.monotonic() + limit
    while not _dead(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {victim} (pid {pid}) still alive {limit} s after it set killed_at")
        time.sleep(0.001)


def _holder(victim: int) -> int:
    """The rank that holds off its finish until a "finish" kill landed: the victim's replica on the next node,
    whose partial sums the victim's cross-node sum reads before its read-in to the round."""
    return (victim + LOCAL) % WORLD


def _elastic(rank, world, store, victim, at, where, delay, transport, whole_node=False, deterministic=False,
             compress=None):
    """Kill points of the victim in minibatch ``at``, each with one minibatch its node is dropped at:
    ``start`` (before its publish) and ``pushed`` (after its pushes, before its finish): ``at``; ``finish``
    (``delay`` seconds into its finish_minibatch, while its replica on the next node holds off its own finish
    until the victim is dead: the victim's cross-node sum waits for that replica's partial sums, so it cannot
    have read in to the round, and the round cannot commit with its node):
    ``at``; ``after`` (once its finish_minibatch returned: the round committed with its node): ``at + 1``."""
    if rank == victim:
        store.set(f"pid/{rank}", str(os.getpid()))
    eng = odc.Engine(store, rank, world, local_world_size=LOCAL, timeout=30, job_key=f"pytest-{os.getppid()}",
                     transport=transport, sharding="hybrid", elastic=True, deterministic=deterministic,
                     compress=compress)
    eng.register([odc.Bucket("w", NUMEL, torch.float32)])
    sl, me = eng.bucket("w")["shard_len"], rank % LOCAL
    pattern = torch.arange(NUMEL, dtype=torch.float32) % 13
    sums, members, returned = [], [], {}
    for k in range(STEPS):
        if (rank == victim or (whole_node and rank // LOCAL == victim // LOCAL)) and k == at and where == "start":
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        full = torch.arange(sl * LOCAL, dtype=torch.float32) % 97 + k
        eng.publish("w", full[me * sl:(me + 1) * sl].clone(), version=k)
        out = torch.empty(NUMEL)
        eng.gather("w", k, out)
        for _ in range(_count(rank, k)):
            eng.scatter_accumulate("w", pattern * _value(rank, k), scale=1.0)
        if rank == victim and k == at:
            if where == "pushed":
                store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            if where == "finish":
                def kill():  # somewhere in this rank's finish_minibatch, the cross-node sum included
                    store.set("killed_at", repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

                threading.Timer(delay, kill).start()
        if where == "finish" and k == at and rank == _holder(victim):
            _hold_until_dead(store, victim)
        try:
            eng.finish_minibatch(k)
        except (odc.NodeDropped, odc.PeerDied) as e:
            return {"raised": type(e).__name__, "message": str(e), "k": k}
        returned[k] = time.time()
        sums.append(eng.grad_shard("w").clone().tolist())
        members.append(eng.members)
        eng.zero_grad()
        if rank == victim and k == at and where == "after":
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    killed_at = float(store.get("killed_at").decode())
    return {"sums": sums, "members": members, "events": eng.elastic_events(),
            "death_to_step_s": {k: t - killed_at for k, t in returned.items()}}


def _expected(k: int, nodes: list[int], me: int, sl: int) -> list[float]:
    weight = sum(_value(r, k) * _count(r, k) for r in range(WORLD) if r // LOCAL in nodes)
    return pattern_shard(weight, me, sl, NUMEL)


def _drop_at(where: str, at: int) -> int:
    """The minibatch whose cross-node sum leaves the victim's node out (see :func:`_elastic`)."""
    return at + 1 if where == "after" else at


def _check_run(res, victim, drop, rel=0.0):
    """Every survivor: the sums over every node before minibatch ``drop``, over the survivors from it on (within
    ``rel`` of the largest, for compressed sums); the members after each minibatch; one event naming the dead node
    at ``drop``."""
    dead = victim // LOCAL
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    sl = len(res[survivors[0]][1]["sums"][0])
    for r in survivors:
        status, out = res[r]
        assert status == "ok", (r, res[r])
        assert "sums" in out, (r, out)
        for k in range(STEPS):
            nodes = [0, 1, 2] if k < drop else [n for n in range(3) if n != dead]
            assert out["members"][k] == nodes, (r, k, "members", out["members"], "the drop at", drop)
            want = _expected(k, nodes, r % LOCAL, sl)
            if rel:
                peak = max(abs(w) for w in want)
                assert out["sums"][k] == pytest.approx(want, abs=rel * peak), (r, k, nodes, out["members"])
                assert out["sums"][k] != want, (r, k, "compressed sums, yet exact")
            else:
                assert out["sums"][k] == want, (r, k, nodes, out["members"])
        assert [(e["minibatch"], e["node"]) for e in out["events"]] == [(drop, dead)], (r, out["events"], drop)
    # Replicas on the surviving nodes step bitwise the same sums, and agree on when the node left.
    for r in survivors:
        twin = survivors[(survivors.index(r) + LOCAL) % len(survivors)]
        assert res[r][1]["sums"] == res[twin][1]["sums"], (r, twin)
        assert res[r][1]["events"][0]["minibatch"] == res[twin][1]["events"][0]["minibatch"], (r, twin)
    assert res[victim][0] == "hung" and res[victim][1] == -signal.SIGKILL, res[victim]
    mate = victim ^ 1
    status, out = res[mate]  # it raises in its gather, its finish_minibatch or the round
    name, msg = (out.get("raised"), out.get("message")) if status == "ok" else out[:2]
    assert name in ("NodeDropped", "PeerDied"), (mate, res[mate])
    assert f"rank {victim}" in msg or f"node {dead}" in msg, msg
    # From the death to each survivor's return from the minibatch that dropped the node (its step).
    return [res[r][1]["death_to_step_s"][res[r][1]["events"][0]["minibatch"]] for r in survivors]


@pytest.mark.parametrize(("transport", "where"), [("shm", "pushed"), ("mixed", "start")])
def test_a_killed_rank_drops_its_node_and_the_others_go_on(transport, where):
    victim, at = 3, 1  # node 1's second rank, in minibatch 1
    res = run_ranks(_elastic, WORLD, timeout=120, victim=victim, at=at, where=where, delay=0.0,
                    transport=transport)
    recovery = _check_run(res, victim, _drop_at(where, at))
    assert max(recovery) < 2.0, recovery
    for r in (0, 1, 4, 5):
        ev = res[r][1]["events"][0]
        assert ev["minibatch"] == at and ev["members"] == [0, 2], ev
        # Learnt within a few liveness periods of the survivors' reaching the sum; the round over the survivors
        # commits within a second after.
        assert ev["recovered_s"] < 2.0, ev


def test_a_killed_rank_drops_its_node_with_compressed_cross_node_sums():
    # int8 partial sums (error feedback on): each survivor quantised its partial sums once per minibatch; the
    # round that drops the dead node sums the survivors' same copies again, so the replicas still hold the same
    # bits (checked by _check_run) and each sum lies within one int8 rounding per node (amax/254 of a block) of
    # the exact one.
    victim, at, where = 1, 1, "pushed"
    res = run_ranks(_elastic, WORLD, timeout=120, victim=victim, at=at, where=where, delay=0.0, transport="shm",
                    compress={"push": "int8"})
    _check_run(res, victim, _drop_at(where, at), rel=3 / 254)


@pytest.mark.parametrize("transport", ["shm", "mixed"])
def test_a_whole_node_killed_at_once_is_dropped(transport):
    # Nobody on the node is left to say so: the other nodes' probes find it (a network probe of a killed host
    # may take its timeout, 2 s).
    res = run_ranks(_elastic, WORLD, timeout=120, victim=3, at=1, where="start", delay=0.0, transport=transport,
                    whole_node=True)
    assert res[2] == res[3] == ("hung", -signal.SIGKILL), (res[2], res[3])
    for r in (0, 1, 4, 5):
        status, out = res[r]
        assert status == "ok" and [(e["minibatch"], e["node"]) for e in out["events"]] == [(1, 1)], res[r]
        for k in range(STEPS):
            nodes = [0, 1, 2] if k < 1 else [0, 2]
            assert out["sums"][k] == _expected(k, nodes, r % LOCAL, len(out["sums"][0])), (r, k)
        assert max(out["death_to_step_s"][k] for k in (1,)) < 3.0, out["death_to_step_s"]


def _refused(rank, world, store, sharding):
    try:
        odc.Engine(store, rank, world, local_world_size=1, sharding=sharding, elastic=True, timeout=10)
    except odc.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("sharding", ["full", "hybrid-zero"])
def test_elastic_outside_hybrid_sharding_is_refused_by_name(sharding):
    import torch.distributed as dist

    msg = _refused(0, 1, dist.HashStore(), sharding)
    assert msg is not None and 'sharding="hybrid"' in msg and f"under {sharding} sharding" in msg, msg


def test_random_kill_points():
    """``ODC_ELASTIC_KILLS`` runs (default 1; ``ODC_ELASTIC_SEED`` picks them), each killing a random rank at a
    random point of a random minibatch: before its publish, after its pushes, a random time into its
    finish_minibatch (the cross-node sum included, before its read-in to the round), or once its finish
    returned. Each point has one minibatch the node must be dropped at (:func:`_elastic`); nothing lost,
    nothing counted twice, no hang. Every second run under ``deterministic=True`` (the cross-node sum of the
    exact sums, voided and summed again over the survivors alike)."""
    import random

    runs = int(os.environ.get("ODC_ELASTIC_KILLS", "1"))
    rng = random.Random(int(os.environ.get("ODC_ELASTIC_SEED", "0")))
    worst = 0.0
    for i in range(runs):
        victim, at = rng.randrange(WORLD), rng.randrange(STEPS - 1)
        # A kill 0-3 ms into finish_minibatch lands in its node's sum on this host, 0-50 ms also in the cross-node
        # sum, while its replica on the next node holds off its finish (a kill after the victim's read-in to the
        # round could count from either minibatch; "after" is the death after the commit).
        where = rng.choice(["start", "pushed", "finish", "after"])
        delay = rng.uniform(0.0, rng.choice([0.003, 0.05]))
        transport = rng.choice(["shm", "mixed"])
        case = {"victim": victim, "at": at, "where": where, "delay": round(delay, 4), "transport": transport,
                "deterministic": i % 2 == 1}
        res = run_ranks(_elastic, WORLD, timeout=120, **case)
        try:
            recovery = _check_run(res, victim, _drop_at(where, at))
        except AssertionError as e:
            raise AssertionError(f"run {i}: {case}: {e}") from e
        worst = max(worst, *recovery)
        dropped = res[next(r for r in range(WORLD) if r // LOCAL != victim // LOCAL)][1]["events"][0]["minibatch"]
        print(f"run {i}: {case}: node dropped at minibatch {dropped}; death to the survivors' step "
              f"{min(recovery):.3f}-{max(recovery):.3f} s")
    assert worst < 2.0, worst


# Microbatches per rank at each step of the FSDP2 run: nodes are ranks (0, 1), (2, 3), (4, 5).
TABLE = ((1, 2, 0, 1, 2, 1), (2, 1, 1, 2, 0, 1), (1, 0, 2, 1, 1, 2), (0, 2, 1, 1, 2, 1))


def _fsdp_elastic(rank, world, store, victim, at, transport, rerun=False, rerun_victim=None, deterministic=False,
                  max_norm=0.5):
    """FSDP2 HSDP under odc.fsdp with elastic=True and AdamW; `victim` is SIGKILLed after its first backward of
    step `at`. The loop normalizes by the plan's token count over the member nodes, and at the step that dropped
    a node rescales the gradients to the survivors' count (finish first, then look at the events)."""

    H.as_nodes(LOCAL, transport)
    H.init_pg(rank, world, store)
    model = H.build(world, mesh=H.hsdp_mesh(world, LOCAL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic=True, timeout=60, deterministic=deterministic)
    raised = _train_through_a_death(model, opt, rank, world, victim, at, clip=model.parameters, rerun=rerun,
                                    rerun_victim=rerun_victim, max_norm=max_norm)
    if raised:
        return raised
    return {"shards": H.local_shards(model), "events": odc.fsdp.elastic_events(model),
            "members": odc.fsdp.members(model)}


def _train_through_a_death(model, opt, rank, world, victim, at, clip, rerun=False, rerun_victim=None, max_norm=0.5):
    """TABLE's steps with AdamW and ODC's clip (of ``clip()``); `victim` SIGKILLed after its first backward of step
    `at`. Returns what a dropped node's rank raised, else None.

    Drop (``rerun`` false): the loss is normalized by the plan's tokens over the member nodes; at the step that
    dropped a node the gradients are rescaled to the survivors' tokens (finish first, then look at the drops).
    Rerun: nothing is left out, the loss is normalized by every rank's tokens; at the step that dropped a node
    its microbatches of that step run again on the member nodes in one more minibatch before the step
    (``odc.fsdp.dropped``, ``odc.fsdp.rerun_share``), and at the later steps the dead node's microbatches are
    spread over the members up front (the plan over the members). `rerun_victim` is SIGKILLed after its first
    backward of a rerun minibatch."""

    members = [0, 1, 2]
    tokens = lambda s, nodes: 27 * sum(TABLE[s][r] for r in range(world) if r // LOCAL in nodes)  # noqa: E731
    backward = lambda s, r, m, norm: (H.sample_loss(model, H.data(s, m, r)) / norm * world).backward()  # noqa: E731
    try:
        for s, plan in enumerate(TABLE):
            norm = tokens(s, range(world // LOCAL) if rerun else members)
            # Every member rank's own items, and (rerun) the items of nodes dropped earlier spread over them.
            ran = {r: [(r, m) for m in range(plan[r])] for r in range(world) if r // LOCAL in members}
            gone = [(r, m) for r in range(world) if r // LOCAL not in members for m in range(plan[r])]
            for r in ran:
                ran[r] += odc.fsdp.rerun_share(gone, members, r, LOCAL) if rerun else []
            for r, m in ran.get(rank, []):
                backward(s, r, m, norm)  # FSDP averages over D
                if rank == victim and s == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            odc.fsdp.finish(model)
            if not rerun:  # minibatches are steps (a rerun adds a minibatch)
                want = [{**e, "since": s} for e in odc.fsdp.elastic_events(model) if e["minibatch"] == s]
                assert odc.fsdp.dropped(model) == want, (odc.fsdp.dropped(model), want)
            first = None  # the step's first minibatch: every drop of its reruns reaches back to it
            while rerun and (drops := odc.fsdp.dropped(model)):
                first = drops[0]["minibatch"] if first is None else first
                assert all(d["since"] == first for d in drops), (drops, first)
                # `ran`: what each rank ran since the step (a rerun continues the minibatch's sums, so a node
                # dropped during it takes every microbatch it ran since the step out).
                members = drops[-1]["members"]
                lost = [it for r, its in sorted(ran.items()) if r // LOCAL not in members for it in its]
                share = {r: odc.fsdp.rerun_share(lost, members, r, LOCAL) for r in range(world)}
                ran = {r: ran.get(r, []) + share[r] for r in range(world) if r // LOCAL in members}
                with odc.fsdp.minibatch(model):
                    for r, m in share[rank]:
                        backward(s, r, m, norm)
                        if rank == rerun_victim:
                            os.kill(os.getpid(), signal.SIGKILL)
            if not rerun and (dropped := odc.fsdp.dropped(model)):
                members = dropped[-1]["members"]
                for p in model.parameters():
                    p.grad.mul_(norm / tokens(s, members))
            odc.fsdp.clip_grad_norm_(clip(), max_norm)
            opt.step()
            opt.zero_grad()
    except (odc.NodeDropped, odc.PeerDied) as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return None


def _reference(dead: int, at: int):
    """One process on every sample but the dead node's from step `at` on, normalized by the kept tokens."""

    return H.hybrid_reference(TABLE, WORLD, LOCAL, dead, range(at, len(TABLE)))


@pytest.mark.parametrize("transport", ["shm", "mixed"])
def test_fsdp2_hybrid_drops_a_dead_node_and_equals_one_process_without_its_microbatches(transport):
    victim, at = 3, 1
    dead = victim // LOCAL
    res = run_ranks(_fsdp_elastic, WORLD, timeout=240, victim=victim, at=at, transport=transport)
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    for r in survivors:
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        ev = res[r][1]["events"]
        assert [(e["minibatch"], e["node"], e["members"]) for e in ev] == [(at, dead, [0, 2])], (r, ev)
        assert res[r][1]["members"] == [0, 2], r
    for r in survivors[:LOCAL]:  # replicas on the surviving nodes hold bitwise the same parameters
        assert res[r][1]["shards"] == res[r + 2 * LOCAL][1]["shards"], r
    ref = _reference(dead, at)
    for r in survivors[:LOCAL]:
        H.assert_shards_near(res[r][1]["shards"], ref, r % LOCAL, LOCAL)
    assert res[victim] == ("hung", -signal.SIGKILL), res[victim]
    mate = res[victim ^ 1]
    name = mate[1].get("raised") if mate[0] == "ok" else mate[1][0]
    assert name in ("NodeDropped", "PeerDied"), mate


def test_fsdp2_hybrid_reruns_a_dead_nodes_microbatches_and_equals_one_process_on_every_sample():
    # rerun: the dead node's microbatches of the step that dropped it run again on the survivors in one more
    # minibatch before the step (adding onto the gradients), and its later microbatches go to the survivors up
    # front. Nothing is left out: the survivors equal one process that trained on every sample.
    victim, at = 3, 1
    dead = victim // LOCAL
    res = run_ranks(_fsdp_elastic, WORLD, timeout=240, victim=victim, at=at, transport="shm", rerun=True)
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    for r in survivors:
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        assert [(e["node"], e["members"]) for e in res[r][1]["events"]] == [(dead, [0, 2])], (r, res[r][1])
    for r in survivors[:LOCAL]:
        assert res[r][1]["shards"] == res[r + 2 * LOCAL][1]["shards"], r
    ref = _reference(dead, len(TABLE))  # every sample of every step
    for r in survivors[:LOCAL]:
        H.assert_shards_near(res[r][1]["shards"], ref, r % LOCAL, LOCAL)


@pytest.mark.parametrize("second", [None, 4], ids=["one death", "a death during the rerun"])
def test_a_deterministic_rerun_is_bitwise_one_process_on_every_sample(second):
    # deterministic=True: every node's sum is exact, the cross-node sum adds them as integers, and the rerun
    # minibatch (run onto the gradients the loop left as installed) continues the exact sums. So the dead node's
    # microbatches, rerun on other nodes, give every step's gradients as the nearest f32 to the exact sum of every
    # sample's gradient, whoever ran it: the survivors' final parameters are bit for bit those of one process that
    # summed every step's per-sample gradients exactly (numpy and Python integers, not ODC's kernels), with the
    # same AdamW, and a clip that does not clip. With a second death during the rerun, node 0 reruns what node 2
    # ran since the step and still ends with those bits.
    victim, at, max_norm = 3, 1, 1e9
    res = run_ranks(_fsdp_elastic, WORLD, timeout=240, victim=victim, at=at, transport="shm", rerun=True,
                    rerun_victim=second, deterministic=True, max_norm=max_norm)
    ref = H.exact_reference(TABLE, WORLD, max_norm)
    plain = H.exact_reference(TABLE, WORLD, max_norm, exact=False)
    # Not vacuous: summing in f32 instead moves bits.
    assert any(not torch.equal(ref[n], plain[n]) for n in ref), "an f32 sum gave the exact sum's bits"
    alive = [0, 1] if second else [0, 1, 4, 5]
    for r in alive:
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        assert len(res[r][1]["events"]) == (2 if second and r < LOCAL else 1), (r, res[r][1])
        for name, shard in res[r][1]["shards"].items():
            want = torch.chunk(ref[name].detach(), LOCAL, dim=0)[r % LOCAL]
            got = torch.tensor(shard)
            assert torch.equal(got, want), (r, name, (got != want).sum().item(), (got - want).abs().max().item())


def _fsdp_rerun_iterator(rank, world, store, victim, at, second, elastic, fsdp1=False):
    """FSDP2 HSDP with ``elastic=`` and deterministic sums; the loop iterates ``odc.fsdp.microbatches`` over the
    whole plan at every step (the dead node's lists included), normalized by every rank's tokens. `victim` is
    SIGKILLed after its first backward of step `at`, `second` after its first backward of the rerun (the iterator
    yields it once the finish dropped a node). ``fsdp1``: FSDP1's HYBRID_SHARD and ODC's clip. Returns the shards
    and events, or what a rank raised."""
    import _fsdp1 as F1

    H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    model = (F1.build(strategy="HYBRID_SHARD", nodes=world // LOCAL) if fsdp1
             else H.build(world, mesh=H.hsdp_mesh(world, LOCAL)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic=elastic, timeout=60, deterministic=True)
    yielded = []
    try:
        for s, plan in enumerate(TABLE):
            norm = 27 * sum(plan)
            lists = [[(r, m) for m in range(plan[r])] for r in range(world)]
            for r, m in odc.fsdp.microbatches(model, lists):
                yielded.append((s, r, m))
                (H.sample_loss(model, H.data(s, m, r)) / norm * world).backward()
                if rank == victim and s == at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == second and s == at and odc.fsdp.elastic_events(model):
                    os.kill(os.getpid(), signal.SIGKILL)
            odc.fsdp.clip_grad_norm_(model if fsdp1 else model.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
    except (odc.NodeDropped, odc.PeerDied, odc.ConfigError, odc.ProtocolError) as e:
        return {"raised": type(e).__name__, "message": str(e), "yielded": yielded}
    shards = F1.local_shards(model) if fsdp1 else H.local_shards(model)
    return {"shards": shards, "events": odc.fsdp.elastic_events(model), "yielded": yielded}


@pytest.mark.parametrize(("second", "fsdp1"), [(None, False), (4, False), (4, True)],
                         ids=["one death", "a death during the rerun", "fsdp1, a death during the rerun"])
def test_elastic_rerun_reruns_inside_the_iterator_bitwise_one_process(second, fsdp1):
    # enable(..., elastic="rerun"): the loop is the plain odc.fsdp.microbatches loop, unchanged by deaths. The
    # iterator's end finishes the minibatch and, while that drops a node, yields this rank's share of what the
    # dropped nodes ran since the step; later steps spread the dead node's lists over the members up front. Every
    # sample of every step trains: bit for bit one process with exact sums (deterministic=True).
    victim, at = 3, 1
    import _fsdp1 as F1

    res = run_ranks(_fsdp_rerun_iterator, WORLD, timeout=240, victim=victim, at=at, second=second,
                    elastic="rerun", fsdp1=fsdp1)
    ref = H.exact_reference(TABLE, WORLD, 1e9)
    alive = [0, 1] if second else [0, 1, 4, 5]
    ran = sorted(it for r in alive for it in res[r][1]["yielded"])
    for r in alive:
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        if fsdp1:
            F1.assert_flat_shards_near(res[r][1]["shards"], ref, LOCAL, tol=0)
            continue
        for name, shard in res[r][1]["shards"].items():
            want = torch.chunk(ref[name].detach(), LOCAL, dim=0)[r % LOCAL]
            assert torch.equal(torch.tensor(shard), want), (r, name)
    # The survivors ran the dead nodes' microbatches of the later steps themselves (spread up front).
    later = {(s, r, m) for s in range(at + 1, len(TABLE)) for r in range(WORLD) for m in range(TABLE[s][r])}
    assert later <= set(ran), sorted(later - set(ran))


def test_elastic_rerun_refuses_a_step_that_left_dropped_microbatches_out_and_drop_refuses_lists_of_dead_nodes():
    victim, at = 3, 1
    # A loop of its own that does not rerun, under elastic="rerun": the step after the drop is refused.
    res = run_ranks(_fsdp_elastic_loop_without_rerun, WORLD, timeout=240, victim=victim, at=at)
    for r in (0, 1, 4, 5):
        assert res[r][0] == "ok" and res[r][1].get("raised") == "ProtocolError", (r, res[r])
        assert "elastic='rerun'" in res[r][1]["message"] and "[1]" in res[r][1]["message"], res[r][1]
    # elastic=True (drop): the next step's lists still hold the dead node's microbatches: refused by name.
    res = run_ranks(_fsdp_rerun_iterator, WORLD, timeout=240, victim=victim, at=at, second=None, elastic=True)
    for r in (0, 1, 4, 5):
        assert res[r][0] == "ok" and res[r][1].get("raised") == "ConfigError", (r, res[r])
        assert "ranks [2, 3]" in res[r][1]["message"] and "would run nowhere" in res[r][1]["message"], res[r][1]


def _fsdp_elastic_loop_without_rerun(rank, world, store, victim, at):
    H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    model = H.build(world, mesh=H.hsdp_mesh(world, LOCAL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic="rerun", timeout=60)
    try:
        for s, plan in enumerate(TABLE):
            for m in range(plan[rank]):
                (H.sample_loss(model, H.data(s, m, rank)) / 27).backward()
                if rank == victim and s == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad()
    except (odc.NodeDropped, odc.PeerDied, odc.ProtocolError) as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


# Microbatches per rank at each step of the Hugging Face run (packed rows of 2-4 samples each).
HF_TABLE = ((2, 1, 3, 1, 0, 2), (1, 2, 2, 1, 2, 1), (2, 2, 1, 0, 1, 3))
HF_CLIP = 0.1


def _hf_elastic(rank, world, store, victim, at, mixed=False):
    """A user's loop, unchanged by deaths: a tiny Hugging Face Qwen2 (tied embeddings, grouped-query attention) in
    FSDP2 HSDP, elastic='rerun' with deterministic sums, the plan's lists through odc.fsdp.microbatches, the loss
    summed and divided by the step's global token count, torch's clip_grad_norm_ (which clips here) and AdamW.
    `victim` (if any) is SIGKILLed after its first backward of step `at`. ``mixed``: FSDP2's mixed precision (bf16
    parameters and gradients, f32 reduction) under CPU bf16 autocast."""
    import _loops as L
    from torch.distributed.fsdp import fully_shard

    H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    model = L.hf_model("qwen2")
    mesh = H.hsdp_mesh(world, LOCAL)
    kw = {"mesh": mesh}
    if mixed:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic="rerun", deterministic=True, timeout=60)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    norms = []
    try:
        for s, counts in enumerate(HF_TABLE):
            lists = [[(r, m) for m in range(counts[r])] for r in range(world)]
            total = sum(L.tokens(L.packed(s, r, m)) for r in range(world) for m in range(counts[r]))
            for r, m in odc.fsdp.microbatches(model, lists):
                with autocast:
                    loss = L.loss_sum(model, L.packed(s, r, m))
                (loss / total * world).backward()
                if rank == victim and s == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), HF_CLIP).full_tensor().item())
            opt.step()
            opt.zero_grad()
    except (odc.NodeDropped, odc.PeerDied) as e:
        return {"raised": type(e).__name__}
    shards = {k: v.to_local().detach().view(-1).view(torch.int32).tolist() for k, v in model.state_dict().items()}
    return {"shards": shards, "norms": norms, "events": odc.fsdp.elastic_events(model)}


@pytest.mark.parametrize("mixed", [False, True], ids=["f32", "bf16 mixed precision"])
def test_a_hugging_face_loop_under_elastic_rerun_is_one_process_and_bitwise_the_run_without_the_death(mixed):
    # As a user runs it: the same loop, the same data plan, torch's clip clipping (its norm summed over the node's
    # shards, equal with or without the death since every gradient is). Rank 3 dies in step 1; its node's packed
    # rows of that step and of step 2 run on nodes 0 and 2. Every rank's parameters after the job, and every
    # step's clip norm, are those of one process of plain torch on every sample of every step (no ODC, no
    # collective), and bit for bit those of the same job where nobody died.
    import _loops as L

    res = run_ranks(_hf_elastic, WORLD, timeout=300, victim=3, at=1, mixed=mixed)
    clean = run_ranks(_hf_elastic, WORLD, timeout=300, victim=None, at=1, mixed=mixed)
    # The loop's loss (summed, / the step's tokens, x D; FSDP2 averages over D) is the verl-shaped reference's;
    # under mixed precision the reference computes in a bf16 copy and sums the gradients in f32, as FSDP2 does.
    ref = L.reference({"loop": "verl", "model": "qwen2", "clip": HF_CLIP, "precision": "bf16" if mixed else "fp32",
                       "autocast": mixed}, WORLD, HF_TABLE)
    for r in (0, 1, 4, 5):
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        got = res[r][1]
        for s, (x, want) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            assert math.isclose(x, want, rel_tol=1e-5), f"rank {r} step {s}: grad norm {x}, one process {want}"
        assert got["shards"].keys() == ref["params"].keys(), (sorted(got["shards"]), sorted(ref["params"]))
        for name, bits in got["shards"].items():
            shard = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
            want = torch.chunk(torch.tensor(ref["params"][name]), LOCAL, dim=0)[r % LOCAL].reshape(-1)
            diff = (shard - want).abs().max().item()
            assert diff <= 2e-5, f"rank {r}: {name} differs from one process by {diff}"
    for r in (0, 1, 4, 5):
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        assert [e["node"] for e in res[r][1]["events"]] == [1], res[r][1]["events"]
        assert clean[r][0] == "ok" and not clean[r][1]["events"], (r, clean[r])
        assert res[r][1]["norms"] == clean[r][1]["norms"], (r, res[r][1]["norms"], clean[r][1]["norms"])
        assert any(n > HF_CLIP for n in res[r][1]["norms"]), res[r][1]["norms"]  # the clip clipped
        assert res[r][1]["shards"] == clean[r][1]["shards"], f"rank {r}: not the bits of the run without the death"


def test_a_death_during_a_rerun_is_rerun_too():
    # Rank 3 dies at step 1 (node 1 dropped); its node's microbatches of step 1 rerun on nodes 0 and 2, and rank 4
    # dies after its first rerun backward (node 2 dropped from the rerun minibatch; node 2's step-1 gradients were
    # in the committed sum already). The loop reruns node 2's share of the rerun on node 0: node 0 ends equal to
    # one process on every sample of every step.
    victim, at, second = 3, 1, 4
    res = run_ranks(_fsdp_elastic, WORLD, timeout=240, victim=victim, at=at, transport="shm", rerun=True,
                    rerun_victim=second)
    for r in (0, 1):
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        assert [(e["node"], e["members"]) for e in res[r][1]["events"]] == [(1, [0, 2]), (2, [0])], (r, res[r][1])
    ref = _reference(1, len(TABLE))  # every sample of every step
    for r in (0, 1):
        H.assert_shards_near(res[r][1]["shards"], ref, r, LOCAL)
    assert res[victim] == ("hung", -signal.SIGKILL) and res[second] == ("hung", -signal.SIGKILL), res


def _enable_refused(rank, world, store):

    H.init_pg(rank, world, store)
    out = {}
    for sharding, elastic in (("full", True), ("hybrid-zero", True), ("rerun/full", "rerun"), ("typo", "rerunn")):
        model = H.build(world)
        try:
            odc.fsdp.enable(model, None, sharding=sharding.split("/")[-1] if elastic is True else "full",
                            elastic=elastic)
        except odc.ConfigError as e:
            out[sharding] = str(e)
    return out


def test_fsdp_enable_refuses_elastic_outside_hybrid():
    res = run_ranks(_enable_refused, 2, timeout=120)
    for r, (status, out) in res.items():
        assert status == "ok", res[r]
        assert "elastic=True needs sharding='hybrid'" in out["full"] and "'full'" in out["full"], out
        assert "optimizer state" in out["hybrid-zero"] and "'hybrid-zero'" in out["hybrid-zero"], out
        assert "elastic='rerun' needs sharding='hybrid'" in out["rerun/full"], out
        assert "elastic='rerunn'" in out["typo"] and "'rerun'" in out["typo"], out


def _fsdp1_elastic(rank, world, store, victim, at):
    """The FSDP2 run's loop on FSDP1's HYBRID_SHARD (a (3, 2) mesh, flat parameters)."""
    import _fsdp1 as F1

    H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    model = F1.build(strategy="HYBRID_SHARD", nodes=world // LOCAL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic=True, timeout=60)
    raised = _train_through_a_death(model, opt, rank, world, victim, at, clip=lambda: model)
    if raised:
        return raised
    return {"shards": F1.local_shards(model), "events": odc.fsdp.elastic_events(model)}


def test_fsdp1_hybrid_shard_drops_a_dead_node_and_equals_one_process_without_its_microbatches():
    victim, at = 5, 2
    dead = victim // LOCAL
    res = run_ranks(_fsdp1_elastic, WORLD, timeout=240, victim=victim, at=at)
    survivors = [r for r in range(WORLD) if r // LOCAL != dead]
    import _fsdp1 as F1

    ref = _reference(dead, at)
    for r in survivors:
        assert res[r][0] == "ok" and "shards" in res[r][1], (r, res[r])
        assert [(e["minibatch"], e["node"]) for e in res[r][1]["events"]] == [(at, dead)], res[r][1]["events"]
        assert res[r][1]["shards"] == res[(r + LOCAL) % (2 * LOCAL)][1]["shards"], r  # replicas: bitwise
        F1.assert_flat_shards_near(res[r][1]["shards"], ref, LOCAL)
    assert res[victim] == ("hung", -signal.SIGKILL), res[victim]


def test_rerun_share_spreads_items_over_the_member_ranks_alike_on_every_rank():
    items = list(range(7))
    shares = {r: odc.fsdp.rerun_share(items, [2, 0], r, 2) for r in range(6)}
    # Member ranks in rank order: 0, 1 (node 0), 4, 5 (node 2); round robin; rank 2-3's node gets nothing.
    assert shares == {0: [0, 4], 1: [1, 5], 2: [], 3: [], 4: [2, 6], 5: [3]}, shares
    assert sorted(x for v in shares.values() for x in v) == items
    with pytest.raises(odc.ConfigError, match="ranks_per_node must be at least 1, got 0"):
        odc.fsdp.rerun_share(items, [0], 0, 0)
