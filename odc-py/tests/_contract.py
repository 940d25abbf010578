"""Workers for the gradient contract of odc.fsdp (test_fsdp_loops.py) on the small model of _fsdp_helpers.

Each worker runs on spawned ranks (``_dist.run_ranks``) with a gloo process
group: FSDP2's collectives where a loop is run "gloo", ``odc.fsdp.enable``
where it is run "odc".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _fsdp_helpers import Tiny, build, data, full_params, init_pg, sample_loss
from torch.distributed.tensor import DTensor

import odc
import odc.fsdp


def why_loop_worker(rank, world, store, steps=4, micros=2, max_norm=0.05):
    """The loop a new user writes: FSDP2, torch's clip_grad_norm_ before optimizer.step(), AdamW.

    Run over gloo, then under ODC; returns both runs' per-step norms (as torch returns them, made
    full) and full parameters, and this rank's local gradient shards of the first step as the
    loop would log them (read before the step).
    """
    init_pg(rank, world, store)
    out = {}
    for comm in ("gloo", "odc"):
        model = build(world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if comm == "odc":
            odc.fsdp.enable(model, opt, timeout=60)
        norms, logged = [], None
        for s in range(steps):
            for m in range(micros):
                (sample_loss(model, data(s, m, rank)) / (27 * micros)).backward()
            if s == 0:
                logged = {n: p.grad.to_local().tolist() for n, p in model.named_parameters()}
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            opt.step()
            opt.zero_grad()
        if comm == "odc":
            odc.fsdp.disable(model)
        out[comm] = {"norms": norms, "params": full_params(model), "logged": logged}
    return out


def _expect(found, key, exc, fn):
    try:
        fn()
    except exc as e:
        found[key] = f"{type(e).__name__}: {e}"
    except Exception as e:
        found[key] = f"wrong type {type(e).__name__}: {e}"
    else:
        found[key] = "no error"


def _enabled(world, optimizer=True, **kw):
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt if optimizer else None, timeout=30, **kw)
    return model, opt


def broken_loops_worker(rank, world, store):
    """Loops that break the contract; each must raise an odc error naming what to call instead.

    Every rank breaks it the same way (peers would otherwise wait for it), then the model is
    disabled and the next case starts on a fresh one.
    """
    init_pg(rank, world, store)
    found = {}

    # 1. Gradients read between two microbatches: the read finishes the minibatch; the next
    #    microbatch's forward is refused, naming the read.
    model, opt = _enabled(world)
    sample_loss(model, data(0, 0, rank)).backward()
    found["early_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor())
    _expect(found, "early_read", odc.ProtocolError, lambda: sample_loss(model, data(0, 1, rank)).backward())
    odc.fsdp.disable(model)

    # 2. Gradients read between a forward and its backward: the backward's push is refused.
    model, opt = _enabled(world)
    loss = sample_loss(model, data(0, 0, rank))
    [p.grad.sum().item() for p in model.parameters()]
    _expect(found, "read_before_backward", odc.ProtocolError, loss.backward)
    odc.fsdp.disable(model)

    # 3. Two steps in one minibatch.
    model, opt = _enabled(world)
    sample_loss(model, data(0, 0, rank)).backward()
    opt.step()
    _expect(found, "step_twice", odc.ProtocolError, opt.step)
    opt.zero_grad()
    odc.fsdp.disable(model)

    # 4. Gradients cleared in the middle of a minibatch, three ways.
    model, opt = _enabled(world)
    sample_loss(model, data(0, 0, rank)).backward()
    _expect(found, "zero_grad_mid", odc.ProtocolError, opt.zero_grad)
    _expect(found, "zero_mid", odc.ProtocolError, next(model.parameters()).grad.zero_)
    for p in model.parameters():
        p.grad = None
    _expect(found, "none_mid", odc.ProtocolError, lambda: sample_loss(model, data(0, 1, rank)).backward())
    # Nothing was lost or added twice: the minibatch holds the first microbatch, as in case 1.
    # (The aborted backward left FSDP's unsharded parameters registered: read the sharded ones.)
    odc.fsdp.finish(model)
    sharded = [fp.sharded_param for g in model._odc_fsdp.groups for fp in g.pg.fsdp_params]
    found["none_mid_norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor())
    odc.fsdp.disable(model)

    # 5. An optimizer in backward (post-accumulate-grad hooks) is refused at enable.
    model = build(world)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    _expect(found, "hook", odc.ConfigError, lambda: odc.fsdp.enable(model, None))

    # 6. A pending gradient prints what it is, without finishing anything.
    model, opt = _enabled(world)
    found["repr"] = repr(next(model.parameters()).grad)
    found["repr_open"] = model._odc_fsdp.state.open
    opt.zero_grad()
    odc.fsdp.disable(model)
    return found


def _sgd_reference(world, plan, lr, skip=(), clip=None):
    """One process, SGD on the summed loss of every rank's microbatches; steps in ``skip`` are skipped."""
    torch.manual_seed(0)
    ref = Tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    norms = []
    for s, counts in enumerate(plan):
        norm = 27 * sum(counts)
        for r in range(world):
            for m in range(counts[r]):
                (sample_loss(ref, data(s, m, r)) / norm).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))))
        if s not in skip:
            opt.step()
        opt.zero_grad()
    return norms, {k: v.detach().tolist() for k, v in ref.state_dict().items()}


def skipped_steps_worker(rank, world, store, plan, skip, lr=0.1):
    """Uneven microbatch counts (zero included), torch's clip, and steps skipped as verl and GradScaler
    skip them (clip, then optimizer.zero_grad() instead of step). Also a loop stepping by hand.

    Returns per-step norms on every rank; rank 0 adds the single-process reference and the parameter
    difference of each loop.
    """
    init_pg(rank, world, store)
    out = {}

    def scale(s):
        return world / (27 * sum(plan[s]))  # FSDP averages over ranks: the loss of the whole minibatch

    # verl's shape: zero_grad first, clip, skip on a "non-finite" norm (here: the steps in `skip`).
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    odc.fsdp.enable(model, opt, timeout=60)
    norms = []
    for s, counts in enumerate(plan):
        opt.zero_grad()
        for m in range(counts[rank]):
            (sample_loss(model, data(s, m, rank)) * scale(s)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        norms.append(float(norm.full_tensor()))
        if s in skip:
            opt.zero_grad()
        else:
            opt.step()
    odc.fsdp.disable(model)
    out["skip"] = {"norms": norms, "params": full_params(model)}

    # No optimizer hooks: the loop updates parameters by hand and clears with model.zero_grad().
    model = build(world)
    odc.fsdp.enable(model, None, timeout=60)
    norms = []
    for s, counts in enumerate(plan):
        for m in range(counts[rank]):
            (sample_loss(model, data(s, m, rank)) * scale(s)).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()))
        if s not in skip:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
        model.zero_grad()
    odc.fsdp.disable(model)
    out["by_hand"] = {"norms": norms, "params": full_params(model)}

    if rank == 0:
        ref_norms, ref_params = _sgd_reference(world, plan, lr, skip=set(skip))
        out["ref"] = {"norms": ref_norms, "params": ref_params}
    return out


def consumers_worker(rank, world, store):
    """Gradient consumers other than clip, each against FSDP2 over gloo on the same rank: optimizers
    (foreach, fused, a hand-written one), per-parameter logging, zero_grad(set_to_none=False)."""
    init_pg(rank, world, store)

    class PlainSGD(torch.optim.Optimizer):
        """A user's own optimizer: a loop over p.grad."""

        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    makers = {
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "adam_for_loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
        "plain_sgd": lambda ps: PlainSGD(ps, lr=0.1),
    }
    out = {}
    for name, make in makers.items():
        res = {}
        for comm in ("gloo", "odc"):
            model = build(world)
            opt = make(model.parameters())
            if comm == "odc":
                odc.fsdp.enable(model, opt, timeout=60)
            logs = []
            for s in range(3):
                for m in range(2):
                    (sample_loss(model, data(s, m, rank)) / 54).backward()
                # Per-parameter logging of local shards before the step, as loops do.
                logs.append([float(p.grad.to_local().norm()) for p in model.parameters()])
                opt.step()
                opt.zero_grad(set_to_none=(name != "adam_for_loop"))
            if comm == "odc":
                odc.fsdp.disable(model)
            res[comm] = {"logs": logs, "params": full_params(model)}
        out[name] = res
    return out


def barrier_free(rank, world, store):
    """Used by tests that only need the group to exist."""
    init_pg(rank, world, store)
    dist.barrier()
    return True


def deadline_worker(rank, world, store):
    """ODC's deadline under odc.fsdp follows the process group's timeout; a PeerTimeout says so."""
    import datetime
    import os
    import time

    os.environ.pop("ODC_TIMEOUT_S", None)
    # Rendezvous under a generous timeout (a loaded machine can take seconds to connect gloo's pairs), then the
    # short one the test is about (torch 2.14 made the setter public; before it, the private one does the same).
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(datetime.timedelta(seconds=3))
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt)
    eng = model._odc_fsdp.engine
    out = {"timeout": eng.timeout, "source": eng.deadline_source}
    sample_loss(model, data(0, 0, rank)).backward()
    if rank == 1:
        # Stalls before its step, alive and silent, so rank 0's minibatch cannot finish: until rank 0 has timed
        # out on it (30 s at most), no longer than that takes.
        store.wait(["deadline_seen"], datetime.timedelta(seconds=30))
        return out
    start = time.monotonic()
    try:
        opt.step()
    except odc.PeerTimeout as e:
        out["error"] = str(e)
        out["notes"] = list(getattr(e, "__notes__", []))
        out["peer"] = e.peer
    finally:
        out["waited"] = time.monotonic() - start
        store.set("deadline_seen", "1")
    return out
