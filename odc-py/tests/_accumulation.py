"""FSDP2's own gradient accumulation under odc.fsdp, for test_fsdp_accumulation.py and scripts/soak.py.

The loop: every rank runs its own number of microbatches (zero included); all but its last run with
``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, so FSDP2 keeps the
parameters unsharded and sums the gradients unsharded until the last microbatch, whose backward makes the
one reduce-scatter per group (ODC's push). The loss is the per-token sum over the minibatch's global token
count times the world (FSDP2 averages over the ranks); torch's ``clip_grad_norm_`` before AdamW's step.
The model, the data and the single-process reference are _loops' (its verl-shaped loss).
"""

from __future__ import annotations

import os

import _loops as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import odc.fsdp

VARIANT = {"loop": "verl", "model": "qwen2"}
"""What the reference trains: the verl-shaped loss (sum / global count · world), torch's clip."""


def step_accum(model, opt, mbs, world, clip):
    """One minibatch with FSDP2's accumulation; returns torch's grad norm (before clipping)."""
    opt.zero_grad()
    count = torch.tensor(float(sum(L.tokens(mb) for mb in mbs)), dtype=torch.float64)
    dist.all_reduce(count)  # once per minibatch, on every rank
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        (L.loss_sum(model, mb) / count.item() * world).backward()
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    opt.step()
    return float(norm)


def accumulation_worker(rank, world, store, plan, clip=1.0, lr=1e-2, ref=True):
    """Trains ``plan[s][r]`` microbatches on rank r at step s under ODC; rank 0 adds the reference."""
    L.quiet()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = L.shard(L.hf_model(VARIANT["model"]))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    odc.fsdp.enable(model, opt, timeout=60)
    norms = []
    for s, counts in enumerate(plan):
        mbs = [L.packed(s, rank, j) for j in range(counts[rank])]
        norms.append(step_accum(model, opt, mbs, world, clip))
    out = {"norms": norms, "params": L.full_params(model)}
    odc.fsdp.disable(model)
    if ref and rank == 0:
        out["ref"] = L.reference({**VARIANT, "clip": clip, "lr": lr}, world, plan)
    return out


def teardown_main(comm: str) -> None:
    """One rank as torchrun starts it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the
    accumulation loop on the Tiny model (``comm`` "odc": under odc.fsdp; "gloo": FSDP2's own collectives), then
    ``destroy_process_group()`` and a normal return, so that the interpreter tears down torch's state as a
    user's script does (what the tests' ranks skip with ``os._exit``). scripts/soak.py's ``teardown`` case."""
    from _fsdp_helpers import build, data, sample_loss

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if comm == "odc":
        odc.fsdp.enable(model, opt, timeout=60)
    # Uneven counts under ODC; FSDP2's collectives need the same count on every rank.
    plan = [(2, 1, 3), (1, 3, 0), (0, 1, 2)] if comm == "odc" else [(2, 2, 2), (1, 1, 1), (3, 3, 3)]
    for s, counts in enumerate(plan):
        mine = counts[rank % len(counts)]
        for m in range(mine):
            last = m == mine - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            (sample_loss(model, data(s, m, rank)) / (27 * sum(counts)) * world).backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    if comm == "odc":
        odc.fsdp.disable(model)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
