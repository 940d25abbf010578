"""Workers for the parameter side of the loop contract (test_fsdp_params.py) on the small model of _fsdp_helpers.

Whatever changes a parameter between two minibatches (a state-dict load, a second optimizer, an in-place
edit) must reach every peer's next gather, as it does under FSDP2's collectives; a change inside a
minibatch is refused. Each edit runs the same loop over gloo and under ODC; the plan gives one rank no
microbatch in the minibatch right after the edit (it publishes from its step alone), and over gloo a
rank pads its short minibatches with microbatches of weight 0 so that FSDP2's collectives pair up.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from _fsdp_helpers import build, data, full_params, init_pg, sample_loss
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import odc
import odc.fsdp

# PLAN[s][r]: rank r's microbatches at step s; the edits come after step EDIT_AFTER (rank 1 then idles).
PLAN = [(2, 2), (2, 1), (1, 0), (2, 2)]
EDIT_AFTER = 1
EDITS = ("load_after_enable", "set_model_state_dict", "load_state_dict", "halve", "clamp_every_step",
         "second_optimizer", "sgd_halve", "ema_eval")


def _evaluate_swapped(model, swap_in, comm, rank):
    """An EMA-style swap for evaluation: ``swap_in`` (this rank's shards) in place, a forward under no_grad on
    every rank, the training weights back in place. Under ODC inside odc.fsdp.evaluation."""
    params = dict(model.named_parameters())
    keep = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(swap_in[k])
    with odc.fsdp.evaluation(model) if comm == "odc" else contextlib.nullcontext(), torch.no_grad():
        loss = float(sample_loss(model, data(9, 0, rank)))
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(keep[k])
    return loss


def _full_sd(seed, world):
    """A full (unsharded) state dict of another initialisation: what a resume loads."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in build(world, seed=seed).state_dict().items()}


def _run(edit, comm, rank, world, resume):
    model = build(world)
    head = [p for n, p in model.named_parameters() if n.startswith("head.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    if edit == "second_optimizer":  # a separate optimizer for the head, stepped after the hooked one
        opt = torch.optim.AdamW(rest, lr=1e-2)
        opt2 = torch.optim.SGD(head, lr=0.5)
    elif edit == "sgd_halve":  # a scale-sensitive optimizer
        opt, opt2 = torch.optim.SGD(model.parameters(), lr=0.5), None
    else:
        opt, opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2), None
    if comm == "odc":
        odc.fsdp.enable(model, opt if opt2 is None else [opt, opt2], timeout=60)
    if edit == "load_after_enable":  # wrap, build the optimizer, enable, then resume
        set_model_state_dict(model, resume, options=StateDictOptions(full_state_dict=True))
    saved_full = saved_local = None
    norms, evals = [], []
    for s, counts in enumerate(PLAN):
        total = sum(counts)
        for m in range(max(counts)):
            weight = 1.0 if m < counts[rank] else 0.0
            if weight == 0.0 and comm == "odc":
                continue  # ODC needs no padding: ranks run their own counts
            loss = sample_loss(model, data(s, m, rank)) * weight * world / (27 * total)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        if opt2 is not None:
            opt2.step()
        opt.zero_grad()
        if opt2 is not None:
            opt2.zero_grad()
        if s == 0:
            saved_full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            saved_local = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if edit == "clamp_every_step":  # a weight projection after every step
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.1, 0.1)
        if s != EDIT_AFTER:
            continue
        if edit == "set_model_state_dict":  # back to the state after step 0, from a full state dict
            set_model_state_dict(model, saved_full, options=StateDictOptions(full_state_dict=True))
        elif edit == "load_state_dict":  # the same from this rank's sharded state dict
            model.load_state_dict(saved_local)
        elif edit in ("halve", "sgd_halve"):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        elif edit == "ema_eval":  # the weights after step 0 swapped in, evaluated, swapped back out
            evals.append(_evaluate_swapped(model, saved_local, comm, rank))
            evals.append(_evaluate_swapped(model, dict(model.named_parameters()), comm, rank))  # back to back
    if comm == "odc":
        odc.fsdp.disable(model)
    return {"norms": norms, "params": full_params(model), "evals": evals}


def param_edits_worker(rank, world, store, edits=EDITS):
    """Each edit over gloo and under ODC: per-step grad norms (torch's clip, active) and full parameters."""
    init_pg(rank, world, store)
    torch.set_num_threads(1)
    resume = _full_sd(7, world)
    return {edit: {comm: _run(edit, comm, rank, world, copy.deepcopy(resume)) for comm in ("gloo", "odc")}
            for edit in edits}


def inside_edit_worker(rank, world, store):
    """A parameter halved between two microbatches of one minibatch: refused at the next gather, naming it."""
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    odc.fsdp.enable(model, opt, timeout=60)
    sample_loss(model, data(0, 0, rank)).backward()
    with torch.no_grad():
        model.blocks[1].up.weight.mul_(0.5)
    try:
        sample_loss(model, data(0, 1, rank)).backward()
        found = "no error"
    except odc.ProtocolError as e:
        found = f"ProtocolError: {e}"
    dist.barrier()  # this rank's daemon serves the peer's pushes until the peer is refused too
    return found


def left_early_worker(rank, world, store):
    """Rank 0 breaks out of odc.fsdp.microbatches after the first of its three microbatches: its step names the
    two unrun ones; stepping again after the error finishes the minibatch, so that the peer is not left waiting."""
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt, timeout=60)
    found = "no error"
    for mb in odc.fsdp.microbatches(model, [[0, 1, 2], [0]], steal=False):
        sample_loss(model, data(0, mb, rank)).backward()
        if rank == 0:
            break
    try:
        opt.step()
    except odc.ProtocolError as e:
        found = f"ProtocolError: {e}"
        opt.step()
    opt.zero_grad()
    odc.fsdp.disable(model)
    return found


def frozen_after_enable_worker(rank, world, store):
    """A block frozen between two minibatches after enable: the next forward is refused naming it; disable,
    then enable again with it frozen, trains on, and the frozen block stays as it was (no gradient, no decay)."""
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    odc.fsdp.enable(model, opt, timeout=60)
    sample_loss(model, data(0, 0, rank)).backward()
    opt.step()
    opt.zero_grad()
    model.blocks[0].requires_grad_(False)  # a whole fully_shard unit (a group partly frozen is a LayoutError)
    try:
        sample_loss(model, data(1, 0, rank)).backward()
        found = "no error"
    except odc.ConfigError as e:
        found = f"ConfigError: {e}"
    odc.fsdp.disable(model)
    odc.fsdp.enable(model, opt, timeout=60)
    before = model.blocks[0].up.weight.to_local().clone()
    for s in (1, 2):
        sample_loss(model, data(s, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
    odc.fsdp.disable(model)
    frozen_moved = float((model.blocks[0].up.weight.to_local() - before).abs().max())
    return {"error": found, "frozen_moved": frozen_moved, "grad": model.blocks[0].up.weight.grad is None}


def evaluation_misuse_worker(rank, world, store):
    """odc.fsdp.evaluation entered after this rank's backward of a minibatch, and a backward inside it: each a
    ProtocolError naming what to do; training goes on after both."""
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt, timeout=60)
    found = []
    sample_loss(model, data(0, 0, rank)).backward()
    try:
        with odc.fsdp.evaluation(model):
            pass
        found.append("no error")
    except odc.ProtocolError as e:
        found.append(f"ProtocolError: {e}")
    opt.step()
    opt.zero_grad()
    try:
        with odc.fsdp.evaluation(model):
            sample_loss(model, data(1, 0, rank)).backward()
        found.append("no error")
    except odc.ProtocolError as e:
        found.append(f"ProtocolError: {e}")
    sample_loss(model, data(2, 0, rank)).backward()
    opt.step()
    opt.zero_grad()
    odc.fsdp.disable(model)
    return found
