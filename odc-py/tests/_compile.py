"""Workers for torch.compile under ODC (test_fsdp_compile.py): the same compiled model trained over gloo and
over ODC must give the same per-step grad norms (torch's clip, active) and final parameters.

Orders compiled: every block before ``fully_shard`` (torchtitan's), every block after it, and the whole model
(``model.compile()`` after ``fully_shard``). Inductor on CPU; its caches make the second build of a graph cheap.

Uneven microbatch counts (a rank idle at a step) cannot run over gloo, whose collectives need every rank at
every layer: ``uneven_worker`` compares ODC with one process training the same microbatches (uncompiled).
"""

from __future__ import annotations

import torch
from _fsdp_helpers import DIM, Tiny, as_nodes, data, full_params, init_pg, sample_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import odc
import odc.fsdp

ORDERS = ("blocks_before", "blocks_after", "whole")


def _build(world, order):
    torch.manual_seed(0)
    model = Tiny(dim=DIM)
    mesh = init_device_mesh("cpu", (world,))
    if order == "blocks_before":
        for b in model.blocks:
            b.compile()
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if order == "blocks_after":
        for b in model.blocks:
            b.compile()
    elif order == "whole":
        model.compile()
    return model


def _reference(table, clip):
    """One process, every rank's microbatches of each step: the norms (torch's clip) and final parameters."""
    torch.manual_seed(0)
    ref = Tiny(dim=DIM)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    norms = []
    for s, plan in enumerate(table):
        norm = 27 * sum(plan)  # the tokens of the whole minibatch
        for r, count in enumerate(plan):
            for m in range(count):
                (sample_loss(ref, data(s, m, r)) / norm).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": {k: v.detach().tolist() for k, v in ref.state_dict().items()}}


def _uneven(rank, world, order, table, odc_kw):
    """The compiled model (``order``) under ODC, rank r running ``table[s][r]`` microbatches at step s; rank 0
    also trains the same microbatches in one process."""
    out = {"odc": _train(_build(world, order), rank, world, odc_kw, table)}
    if rank == 0:
        out["ref"] = _reference(table, 0.3)
    return out


def _dynamo(counters):
    """What dynamo compiled in the whole run (a later model of the same class reuses an earlier one's code), and
    where it broke graphs."""
    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "breaks": {str(k): int(v) for k, v in counters["graph_break"].items()}}


def uneven_worker(rank, world, store, order, table, odc_kw, per_node):
    """``_uneven`` on ranks that are emulated nodes of ``per_node`` (for ``sharding="hybrid-zero"``)."""
    from torch._dynamo.utils import counters

    as_nodes(per_node)
    init_pg(rank, world, store)
    torch.set_num_threads(1)
    counters.clear()
    out = _uneven(rank, world, order, table, odc_kw)
    out["dynamo"] = _dynamo(counters)
    return out


def _train(model, rank, world, odc_kw, table=None):
    """Three SGD steps on the minibatch's mean loss, torch's clip at 0.3, over gloo (``odc_kw`` None) or ODC;
    rank r runs ``table[s][r]`` microbatches at step s (default: two each)."""
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # scale-sensitive
    steal, sharding = False, None
    if odc_kw is not None:
        odc_kw = dict(odc_kw)
        steal = odc_kw.pop("steal", False)
        odc.fsdp.enable(model, opt, timeout=120, **odc_kw)
        sharding = model._odc_fsdp.engine.sharding
    norms, ran = [], []
    for s, plan in enumerate(table or [(2,) * world] * 3):
        # Microbatch (m, r) is data(s, m, r). Over gloo rank r runs (0, r) and (1, r); with stealing the same
        # four are listed unevenly (rank 0 three, the last rank one), so that the last rank steals.
        if steal:
            mine = [(m, r) for r in range(world) for m in range(2)]
            lists = [mine[:3]] + [[] for _ in range(world - 2)] + [mine[3:]]
            todo = odc.fsdp.microbatches(model, lists)
        else:
            todo = [(m, rank) for m in range(plan[rank])]
        ran.append([])
        for m, r in todo:
            # The minibatch's tokens (27 a microbatch), times the ranks FSDP2 averages over.
            (sample_loss(model, data(s, m, r)) / (27 * sum(plan) / world)).backward()
            ran[-1].append((m, r))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        opt.step()
        opt.zero_grad()
    if odc_kw is not None:
        odc.fsdp.disable(model)
    return {"norms": norms, "params": full_params(model), "compiled": len(compiled), "ran": ran,
            "sharding": sharding}


def compile_worker(rank, world, store, cases, uneven):
    """``cases``: (order, ODC options) pairs; each trains the compiled model over gloo, then over ODC.
    ``uneven``: (order, table) for ``_uneven`` under full sharding, in the same process (its graphs are
    compiled already)."""
    from torch._dynamo.utils import counters

    init_pg(rank, world, store)
    torch.set_num_threads(1)
    counters.clear()
    out: dict = {}
    for order, odc_kw in cases:
        name = order + "".join(f",{k}={v}" for k, v in odc_kw.items())
        out[name] = {"gloo": _train(_build(world, order), rank, world, None),
                     "odc": _train(_build(world, order), rank, world, odc_kw)}
    out["uneven"] = _uneven(rank, world, *uneven, {})
    # Under ODC and gloo alike, so a break ODC caused would show in the count.
    out["dynamo"] = _dynamo(counters)
    return out
