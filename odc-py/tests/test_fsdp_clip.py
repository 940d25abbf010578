"""``odc.fsdp.clip_grad_norm_`` on non-finite gradients equals torch's ``clip_grad_norm_`` in one process.

Real enabled models (FSDP2 under full and hybrid sharding, FSDP1), a NaN, ``inf`` or ``-inf`` planted in one or
several ranks' gradient shards once the minibatch finished (through ``p.grad.to_local()``), every norm type torch
takes (1, 2, inf and other p), ``error_if_nonfinite`` off and on. The reference is independent of ODC and of
any collective: torch's own ``clip_grad_norm_`` in the test process over the full gradients, put together from
every rank's shards as they were before the clip. It must give every rank's norm (NaN, ``inf`` or the finite
value), the clipped shards, and torch's error on every rank alike with the gradients untouched.

(FSDP2 over gloo is no reference for this: its inf-norm all-reduces a MAX, and gloo's MAX drops a NaN that
is not on rank 0.)
"""

from __future__ import annotations

import math

import _fsdp_helpers as H
import pytest
import torch
from _dist import run_ranks

import odc
import odc.fsdp

pytestmark = pytest.mark.torch_versions  # runs on every torch leg of make test

NAN, INF = math.nan, math.inf
LOCAL = 2  # ranks per node under hybrid sharding


def _plants(world):
    """Where the non-finite values go: (rank, value) pairs; several ranks, and every rank; finite ones torch's
    float32 arithmetic overflows on."""
    last = world - 1
    return [
        [],
        [(0, NAN)],
        [(last, INF)],
        [(1, -INF)],
        [(0, INF), (last, NAN)],  # a NaN on one rank and an infinity on another: NaN
        [(r, -INF if r % 2 else INF) for r in range(world)],
        # Finite, but beyond what torch's float32 sums hold: |g|^2 of 1e30 (inf under p >= 2, finite under
        # p = 1), and two ranks' parts below float32's largest whose sum is above it.
        [(1, 1e30)],
        [(0, 1.5e19), (last, 1.5e19)],
    ]


def _cases(world, hybrid=False):
    """(norm_type, plant, error_if_nonfinite, max_norm): each case is one minibatch."""
    plants = _plants(world)
    if hybrid:
        # The cross-node sum gives every node a NaN one node's gradients hold: planted in node 0's shard only,
        # then in both replicas of the same shard (what a NaN gradient gives).
        plants = [[], [(0, NAN)], [(1, INF)], [(0, NAN), (LOCAL, NAN)], [(1, -INF), (1 + LOCAL, -INF)],
                  [(0, INF), (1 + LOCAL, NAN)]]
    cases = []
    for order in (2.0, 1.0, INF, 3.0):
        for i, plant in enumerate(plants):
            for strict in (False, True):
                # An inactive clip (the coefficient clamped to 1) for one finite case per norm type.
                cases.append((order, plant, strict, 1e9 if (i == 0 and strict) else 0.05))
    cases += [(p, plant, False, 0.05) for p in (0.5, -INF, -1.0) for plant in (plants[0], plants[1], plants[2])]
    return cases


def _grads(model, fsdp1):
    """This rank's gradient shards, flattened, in parameter order (FSDP1: its FlatParameters')."""
    out = []
    for p in model.parameters():
        g = p.grad
        g = g.to_local() if hasattr(g, "to_local") else g
        out.append(g.detach().reshape(-1).clone())
    return out


def _plant(grads, rank, plant):
    for r, value in plant:
        if r == rank:
            g = next(g for g in grads if g.numel() > 5)
            g[5 - rank % 3] = value  # a position of its own on each rank


def clip_worker(rank, world, store, cases, sharding="full", fsdp1=False):
    """Runs each case in a minibatch of its own: uneven microbatches (rank 1 none at even cases), the minibatch
    finished, the plant, ``odc.fsdp.clip_grad_norm_``. Returns per case this rank's shards before and after the
    clip, and the norm or the error; then ``norm_type=0`` refused."""
    import _fsdp1 as F1

    if sharding == "hybrid":
        H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    mesh = H.hsdp_mesh(world, LOCAL) if sharding == "hybrid" else None
    model = F1.build() if fsdp1 else H.build(world, mesh=mesh)
    odc.fsdp.enable(model, None, sharding=sharding, timeout=60)
    out = []
    for c, (order, plant, strict, max_norm) in enumerate(cases):
        with odc.fsdp.minibatch(model):
            for m in range(0 if rank == 1 and c % 2 == 0 else 1 + (rank + c) % 2):
                (H.sample_loss(model, H.data(c, m, rank)) / 54).backward()
        params = list(model.parameters())
        if fsdp1:
            _plant([p.grad for p in params], rank, plant)
        else:
            _plant([p.grad.to_local().view(-1) for p in params], rank, plant)
        before = [g.tolist() for g in _grads(model, fsdp1)]
        res = {"before": before}
        try:
            target = model if fsdp1 else model.parameters()
            norm = odc.fsdp.clip_grad_norm_(target, max_norm, order, error_if_nonfinite=strict)
            res["norm"] = float(norm)
        except RuntimeError as e:
            res["error"] = (type(e).__name__, str(e))
        res["after"] = [g.tolist() for g in _grads(model, fsdp1)]
        out.append(res)
        model.zero_grad()  # no step: the next case is a minibatch of its own
    with odc.fsdp.minibatch(model):
        H.sample_loss(model, H.data(99, 0, rank)).backward()
    try:
        odc.fsdp.clip_grad_norm_(model.parameters(), 1.0, 0)
        refused = "no error"
    except Exception as e:  # the test names what happened instead
        refused = f"{type(e).__name__}: {e}"
    odc.fsdp.disable(model)
    return {"cases": out, "refused": refused}


def _reference(shards, order, strict, max_norm):
    """torch's clip_grad_norm_ in one process over the full gradients (each the concatenation of the ranks'
    shards): the norm or the error, and the clipped gradients cut back into each rank's shards."""
    full = [torch.cat([torch.tensor(s[i]) for s in shards]) for i in range(len(shards[0]))]
    params = []
    for g in full:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        params.append(p)
    try:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, order, error_if_nonfinite=strict))
        error = None
    except RuntimeError as e:
        norm, error = None, (type(e).__name__, str(e))
    cut: list[list[torch.Tensor]] = [[] for _ in shards]
    for i, p in enumerate(params):
        at = 0
        for r, s in enumerate(shards):
            n = len(s[i])
            cut[r].append(p.grad[at:at + n])
            at += n
    return norm, error, cut


def _close(got, want, rtol, atol, what):
    """``got`` (a list) against ``want`` (a tensor), NaN where it is NaN."""
    torch.testing.assert_close(torch.tensor(got), want, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _check(out, cases, groups):
    """Every rank against the reference over its group's shards (the world; under hybrid sharding its node's)."""
    for c, (order, plant, strict, max_norm) in enumerate(cases):
        what = f"case {c}: norm_type={order} plant={plant} error_if_nonfinite={strict} max_norm={max_norm}"
        for group in groups:
            shards = [out[r]["cases"][c]["before"] for r in group]
            norm, error, clipped = _reference(shards, order, strict, max_norm)
            for j, r in enumerate(group):
                got = out[r]["cases"][c]
                if error is not None:
                    assert got.get("error") == error, (what, r, got.get("error"), got.get("norm"), error)
                    for a, b in zip(got["after"], got["before"], strict=True):  # untouched (NaN included)
                        _close(a, torch.tensor(b), 0.0, 0.0, f"{what}: rank {r}: changed by the error")
                    continue
                assert "error" not in got, (what, r, got["error"], norm)
                x = got["norm"]
                if math.isnan(norm) or math.isinf(norm):
                    assert (math.isnan(x) and math.isnan(norm)) or x == norm, (what, r, x, norm)
                else:
                    assert math.isclose(x, norm, rel_tol=1e-5, abs_tol=1e-12), (what, r, x, norm)
                for i, (a, want) in enumerate(zip(got["after"], clipped[j], strict=True)):
                    _close(a, want, 1e-5, 1e-9, f"{what}: rank {r} parameter {i}")


def _check_refused(out):
    for r, res in out.items():
        refused = res["refused"]
        assert refused.startswith("ConfigError") and "norm_type=0" in refused, (r, refused)
        assert "not supported" in refused, (r, refused)


def test_fsdp2_full_sharding_non_finite_gradients_on_any_rank_give_torchs_norm_clip_and_error():
    world = 3
    cases = _cases(world)
    out = H.all_ok(run_ranks(clip_worker, world, timeout=300, cases=cases))
    _check(out, cases, [list(range(world))])
    _check_refused(out)
    # Not vacuous: the cases hold every outcome (finite, inf, NaN, the error) and a clip that clips.
    seen = {("nan" if math.isnan(x) else "inf" if math.isinf(x) else "finite") if (x := res.get("norm")) is not None
            else "error" for res in out[0]["cases"]}
    assert seen == {"finite", "inf", "nan", "error"}, seen


def test_fsdp2_hybrid_sharding_each_replica_gives_torchs_norm_over_its_gradients():
    world = 2 * LOCAL
    cases = _cases(world, hybrid=True)
    out = H.all_ok(run_ranks(clip_worker, world, timeout=300, cases=cases, sharding="hybrid"))
    # torch's HSDP norm is a replica's (its all-reduce stays in the shard group): each node's ranks against the
    # norm of the gradients that node holds.
    _check(out, cases, [list(range(n * LOCAL, (n + 1) * LOCAL)) for n in range(world // LOCAL)])
    _check_refused(out)


def test_fsdp1_non_finite_gradients_give_torchs_norm_clip_and_error():
    world = 2
    cases = _cases(world)[::3]
    out = H.all_ok(run_ranks(clip_worker, world, timeout=300, cases=cases, fsdp1=True))
    _check(out, cases, [list(range(world))])
