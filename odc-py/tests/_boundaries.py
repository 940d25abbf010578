"""Workers for test_fsdp_boundaries.py: what happens at a minibatch's edges (the first push of the next
minibatch, an evaluation block, an exception out of a block or odc.fsdp.skip, an iterator left early, a clip
over a list of parameters), each against a reference computed in one process from the same samples.

The model is _fsdp_helpers' Tiny. Losses are per-sample sums over 27 targets per microbatch; FSDP2 averages
the D ranks' gradients, so each rank scales its loss by D.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist
from _fsdp_helpers import Tiny, build, data, full_params, init_pg, sample_loss

import odc
import odc.fsdp

LR = 0.1


def plain(seed=0):
    """The one-process reference model: Tiny with the initialisation ``build`` gives every rank."""
    torch.manual_seed(seed)
    return Tiny()


def params_of(model):
    return {k: v.detach().float().tolist() for k, v in model.named_parameters()}


# -- 1. the first push of a minibatch and a slow owner ---------------------------------------------------------


def push_first_worker(rank, world, store, steps, delay, comm):
    """Every group keeps its parameters unsharded after the first gather (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``), so from minibatch 1 on a rank's first operation of a minibatch is
    a push. Rank 1 (an owner) is slow between the engine's finish and reading its gradients, so rank 0's first
    pushes of the next minibatch reach it while it still holds the last one's sums. SGD; returns the full
    parameters (over gloo: the same loop on FSDP2's collectives)."""
    init_pg(rank, world, store)
    model = build(world, reshard=False)
    model.set_reshard_after_backward(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if comm == "odc":
        odc.fsdp.enable(model, opt, timeout=60)
        eng = model._odc_fsdp.engine
        finish = eng.finish_minibatch

        def slow_finish(k):
            finish(k)
            if rank == 1:
                time.sleep(delay)  # the owner is slow to read its gradients of minibatch k

        eng.finish_minibatch = slow_finish
    for s in range(steps):
        for m in range(2):
            (sample_loss(model, data(s, m, rank)) * world / (27 * 2 * world)).backward()
        opt.step()
        opt.zero_grad()
    if comm == "odc":
        odc.fsdp.disable(model)
    return full_params(model)


# -- 2. an evaluation block between minibatches -----------------------------------------------------------------


def _build_variant(variant, world):
    if variant.startswith("fsdp1"):
        from _fsdp1 import build as build1
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817 - FSDP1's own name

        strategy = {"fsdp1-full-shard": "FULL_SHARD", "fsdp1-shard-grad-op": "SHARD_GRAD_OP"}[variant]
        return build1(strategy=strategy), FSDP
    # fully_shard's default (None): the root keeps its parameters unsharded after a forward, the others not.
    return build(world, reshard={"fsdp2-root": None, "fsdp2-no-reshard": False}[variant]), None


def _full(model, fsdp1):
    if fsdp1 is not None:
        with fsdp1.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().float().clone().tolist()
                    for k, v in model.module.named_parameters()}
    return full_params(model)


#: Microbatches per rank per step (rank 1 idle at step 1); the evaluation comes after step EVAL_AFTER.
EVAL_PLAN = [(2, 1), (1, 0), (1, 2), (2, 2)]
EVAL_AFTER = 1


def evaluation_worker(rank, world, store, variant):
    """Trains EVAL_PLAN under ODC; after step EVAL_AFTER every rank halves its shards in place (the weights to
    evaluate), evaluates under ``odc.fsdp.evaluation``, and doubles them back. FSDP2's root (default), every
    FSDP2 module with ``reshard_after_forward=False``, or FSDP1 under ``SHARD_GRAD_OP`` keeps its parameters
    unsharded after the evaluation's forward; the next minibatch must gather the restored ones. Returns the
    evaluation's loss and the final parameters."""
    init_pg(rank, world, store)
    model, fsdp1 = _build_variant(variant, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    odc.fsdp.enable(model, opt, timeout=60)
    evals = []
    for s, counts in enumerate(EVAL_PLAN):
        for m in range(counts[rank]):
            (sample_loss(model, data(s, m, rank)) * world / (27 * sum(counts))).backward()
        opt.step()
        opt.zero_grad()
        if s == EVAL_AFTER:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
            with odc.fsdp.evaluation(model), torch.no_grad():
                evals.append(float(sample_loss(model, data(99, 0, rank))))
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2.0)
    odc.fsdp.disable(model)
    return {"evals": evals, "params": _full(model, fsdp1)}


def evaluation_reference(world):
    """One process: the same steps on every rank's microbatches, the evaluation on each rank's sample."""
    model = plain()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    evals = []
    for s, counts in enumerate(EVAL_PLAN):
        for r in range(world):
            for m in range(counts[r]):
                (sample_loss(model, data(s, m, r)) / (27 * sum(counts))).backward()
        opt.step()
        opt.zero_grad()
        if s == EVAL_AFTER:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
                evals.append([float(sample_loss(model, data(99, 0, r))) for r in range(world)])
                for p in model.parameters():
                    p.mul_(2.0)
    return {"evals": evals, "params": params_of(model)}


# -- 3. an exception out of odc.fsdp.minibatch ---------------------------------------------------------------


class BadBatch(Exception):
    """What a loop's data path raises for a sample it cannot use."""


#: Microbatches per rank per step; at step SKIP rank 0 raises before its microbatch 1 and skips the step.
SKIP_PLAN = [(2, 2), (3, 1), (1, 2), (2, 1)]
#: The same for 2 nodes of 2 ranks (hybrid sharding): rank 0 raises; the skip crosses to node 1 in the
#: cross-node sum.
SKIP_PLAN_4 = [(2, 2, 1, 1), (3, 1, 2, 0), (1, 2, 1, 2), (2, 1, 1, 1)]
SKIP = 1


def _shard_rows(n, world, r):
    per = -(-n // world)
    return slice(r * per, min((r + 1) * per, n))


def skip_worker(rank, world, store, variant="fsdp2"):
    """The skip-a-bad-batch loop over ``odc.fsdp.minibatch`` (enable(model, None)): rank 0's data raises in
    the middle of minibatch SKIP, after it pushed its first microbatch's gradients; the loop catches it and
    moves on without stepping (``continue``), while rank 1 runs the minibatch to its end and steps as usual.
    Returns each minibatch's warnings and ``odc.fsdp.skipped``, the versions and the full parameters."""
    plan = SKIP_PLAN_4 if variant == "hybrid" else SKIP_PLAN
    if variant == "hybrid":
        from _fsdp_helpers import as_nodes, hsdp_mesh

        as_nodes(2, "shm")
        init_pg(rank, world, store)
        model, fsdp1 = build(world, mesh=hsdp_mesh(world, 2)), None
    else:
        init_pg(rank, world, store)
        model, fsdp1 = _build_variant({"fsdp2": "fsdp2-root", "fsdp1": "fsdp1-full-shard"}[variant], world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    odc.fsdp.enable(model, None, timeout=60, sharding="hybrid" if variant == "hybrid" else "full")
    caught, skipped = [], []
    for s, counts in enumerate(plan):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with odc.fsdp.minibatch(model):
                    for m in range(counts[rank]):
                        if rank == 0 and s == SKIP and m == 1:
                            raise BadBatch(f"sample {s}/{m} is unreadable")
                        (sample_loss(model, data(s, m, rank)) * world / (27 * sum(counts))).backward()
            except BadBatch:
                continue  # skip the step, as any PyTorch loop skips a bad batch
            finally:
                caught.append([str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
                skipped.append(odc.fsdp.skipped(model))
        opt.step()
        model.zero_grad()
    version = getattr(model._odc_fsdp, "state", model._odc_fsdp).version
    odc.fsdp.disable(model)
    return {"warnings": caught, "skipped": skipped, "version": version, "params": _full(model, fsdp1)}


def skip_reference(world, skip=SKIP, plan=SKIP_PLAN):
    """One process that skipped minibatch ``skip`` whole (SGD): every other minibatch's gradient is the sum of
    what ran on every rank."""
    model = plain()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s, counts in enumerate(plan):
        if s == skip:
            continue
        for r in range(world):
            for m in range(counts[r]):
                (sample_loss(model, data(s, m, r)) / (27 * sum(counts))).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def hooked_skip_worker(rank, world, store, optimizer):
    """The same plan with the optimizer hooked (enable(model, opt)) and no ``odc.fsdp.minibatch``: rank 0's
    handler calls ``odc.fsdp.skip(model)`` and then steps and zero_grads as every rank does. ``optimizer``:
    "sgd" or "adamw" (AdamW would move every parameter on a step on zero gradients: weight decay, momentum).
    Returns the skipped counts, the warnings and the full parameters."""
    init_pg(rank, world, store)
    model = build(world)
    opt = (torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    odc.fsdp.enable(model, opt, timeout=60)
    caught, skipped = [], []
    for s, counts in enumerate(SKIP_PLAN):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for m in range(counts[rank]):
                try:
                    if rank == 0 and s == SKIP and m == 1:
                        raise BadBatch(f"sample {s}/{m} is unreadable")
                    (sample_loss(model, data(s, m, rank)) * world / (27 * sum(counts))).backward()
                except BadBatch:
                    odc.fsdp.skip(model)
                    break
            odc.fsdp.finish(model)
            skipped.append(odc.fsdp.skipped(model))
            opt.step()
            opt.zero_grad()
        caught.append([str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
    odc.fsdp.disable(model)
    return {"warnings": caught, "skipped": skipped, "params": full_params(model)}


def hooked_skip_reference(world, optimizer):
    """One process that skipped minibatch SKIP whole, with the optimizer of :func:`hooked_skip_worker`."""
    model = plain()
    opt = (torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    for s, counts in enumerate(SKIP_PLAN):
        if s == SKIP:
            continue
        for r in range(world):
            for m in range(counts[r]):
                (sample_loss(model, data(s, m, r)) / (27 * sum(counts))).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def interrupted_worker(rank, world, store):
    """A KeyboardInterrupt out of rank 0's block (the minibatch cannot be finished there): its next block is
    refused naming the minibatch; rank 1, waiting for it at its finish, is told which rank it waits for."""
    init_pg(rank, world, store)
    model = build(world)
    odc.fsdp.enable(model, None, timeout=5)
    found = ""
    try:
        with odc.fsdp.minibatch(model):
            sample_loss(model, data(0, 0, rank)).backward()
            if rank == 0:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        try:
            with odc.fsdp.minibatch(model):
                sample_loss(model, data(1, 0, rank)).backward()
        except odc.ProtocolError as e:
            found = f"ProtocolError: {e}"
    except odc.PeerError as e:
        found = f"{type(e).__name__}: {e}"
    return found


# -- 4. leaving odc.fsdp.microbatches early, the iterator held -------------------------------------------------


#: Each rank's own list in the one minibatch: the sample indices of its microbatches.
LISTS = [[0, 1, 2, 3], [4]]


def held_iterator_worker(rank, world, store, steal):
    """Rank 0 keeps the iterator and leaves the loop after its first microbatch (the generator is neither
    exhausted nor closed); the step finishes the minibatch, names what it left, and skips it on every rank.
    Returns the microbatches each rank ran, the error, what resuming the iterator says, the skipped count and
    the full parameters."""
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    odc.fsdp.enable(model, opt, timeout=60)
    ran, error, resumed = [], "", ""
    it = odc.fsdp.microbatches(model, LISTS, steal=steal)
    for mb in it:
        ran.append(mb)
        (sample_loss(model, data(0, mb, 0)) * world / (27 * 5)).backward()
        if rank == 0:
            if steal:
                time.sleep(1.0)  # the thief takes some of what is left before this rank's step
            break
    try:
        odc.fsdp.finish(model)  # what the step does first
    except odc.ProtocolError as e:
        error = str(e)
    skipped = odc.fsdp.skipped(model)
    opt.step()  # the minibatch finished (skipped): this step trains on nothing, on either rank
    opt.zero_grad()
    try:
        next(it)
    except odc.ProtocolError as e:
        resumed = str(e)
    except StopIteration:
        resumed = "StopIteration"
    dist.barrier()  # this rank's daemon serves the peer's steal requests until the peer is done too
    odc.fsdp.disable(model)
    return {"ran": ran, "error": error, "resumed": resumed, "skipped": skipped, "params": full_params(model)}


# -- 5. odc.fsdp.clip_grad_norm_ over a list of parameters -----------------------------------------------------


def clip_list_worker(rank, world, store):
    """FSDP1 with ``use_orig_params=True``: the root's FlatParameter holds the embedding and the head, and the
    head's bias lies wholly in rank 1's shard. ``odc.fsdp.clip_grad_norm_(list(model.parameters()))`` is
    accepted on every rank and gives every rank FSDP1's own norm; a list with a tensor of no enabled model is
    refused on every rank before any exchange."""
    from _fsdp1 import build as build1

    init_pg(rank, world, store)
    out = {}
    for comm in ("fsdp1", "odc"):
        model = build1(orig=True)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if comm == "odc":
            odc.fsdp.enable(model, opt, timeout=20)
            local = {n for n, p in model.named_parameters() if id(p) in model._odc_fsdp.param_ids}
            out["missing"] = sorted(n for n, p in model.named_parameters() if p.numel() == 0 and n not in local)
        norms = []
        for s in range(2):
            (sample_loss(model, data(s, 0, rank)) * world / (27 * world)).backward()
            if comm == "odc":
                norms.append(float(odc.fsdp.clip_grad_norm_(list(model.parameters()), 0.05)))
            else:
                norms.append(float(model.clip_grad_norm_(0.05)))
            opt.step()
            opt.zero_grad()
        if comm == "odc":
            try:
                odc.fsdp.clip_grad_norm_([*model.parameters(), torch.zeros(3, requires_grad=True)], 0.05)
                out["foreign"] = "no error"
            except odc.ConfigError as e:
                out["foreign"] = f"ConfigError: {e}"
            odc.fsdp.disable(model)
        out[comm] = norms
    return out


# -- 6. world size 1 -------------------------------------------------------------------------------------------


def solo_worker(rank, world, store):
    """World size 1: every odc.fsdp call works and trains as one process without FSDP would (the
    reference, in the test's process)."""
    init_pg(rank, world, store)
    model = build(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    odc.fsdp.enable(model, opt)
    enabled = odc.fsdp.is_enabled(model)
    norms = []
    for s in range(3):
        with odc.fsdp.minibatch(model):
            for m in odc.fsdp.microbatches(model, [[0, 1, 2]]):
                (sample_loss(model, data(s, m, 0)) / 81).backward()
        odc.fsdp.finish(model)
        # Both forms of ODC's clip: the model, and its parameters.
        target = model if s % 2 == 0 else list(model.parameters())
        norms.append(float(odc.fsdp.clip_grad_norm_(target, 0.05)))
        opt.step()
        opt.zero_grad()
    odc.fsdp.disable(model)
    return {"enabled": enabled, "disabled": not odc.fsdp.is_enabled(model), "norms": norms,
            "params": full_params(model)}


def solo_reference():
    """The one-process loop of :func:`solo_worker` on a plain Tiny: torch's clip, no FSDP, no ODC."""
    model = plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for s in range(3):
        for m in (0, 1, 2):
            (sample_loss(model, data(s, m, 0)) / 81).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": params_of(model)}


def close(a, b, tol):
    """The largest absolute difference of two ``{name: nested list}`` parameter sets, and whether it is within
    ``tol``."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)
    return worst, worst <= tol and not math.isnan(worst)

