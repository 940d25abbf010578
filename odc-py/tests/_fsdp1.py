"""Workers for test_fsdp1.py: FSDP1 (FullyShardedDataParallel, use_orig_params=False) on ODC and over gloo.

The model is _fsdp_helpers' Tiny, each block its own FSDP1 instance (verl's auto-wrap of decoder layers),
the root wrapping the embedding and head. Losses are per-sample sums divided by the minibatch's tokens,
times D (FSDP1 averages over the ranks), so a minibatch's gradient is the same whichever rank ran which
microbatch, and one process computes it on the whole minibatch.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from _fsdp_helpers import Block, Tiny, data, enable_without, init_pg, sample_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817 - FSDP1's own docs' name
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import odc
import odc.fsdp

TOKENS = 27  # per microbatch: data()'s 3 sequences of 9, 8 predicted tokens... summed loss over 3·9 = 27 targets


def build(seed=0, strategy="FULL_SHARD", mp=False, orig=False, offload=False, nodes=None, freeze=False):
    """Tiny under FSDP1; ``nodes``: a hybrid strategy over a (nodes, ranks per node) mesh, as verl builds one;
    ``freeze``: each block's LayerNorm frozen, the rest of its FlatParameter trained (LoRA's pattern; FSDP1
    needs use_orig_params=True for it)."""
    torch.manual_seed(seed)
    model = Tiny()
    if freeze:
        for b in model.blocks:
            b.norm.requires_grad_(False)
    kw = {}
    if nodes is not None:
        world = torch.distributed.get_world_size()
        kw["device_mesh"] = init_device_mesh("cpu", (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    if offload:
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    if mp:  # verl's: bf16 compute, f32 reduce and buffers
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               buffer_dtype=torch.float32)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy[strategy],
                use_orig_params=orig, device_id=torch.device("cpu"), **kw)


def local_shards(model):
    """This rank's own shard of every FlatParameter (use_orig_params=False), read without any all-gather, with
    the names of the parameters it flattens in order and the shard's index: a reference checks it directly."""
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module")
             for n, m in model.named_modules()}
    out = []
    for inst in FSDP.fsdp_modules(model):
        fp = inst._handle.flat_param
        prefix = names.get(id(inst), "")
        prefix = f"{prefix}." if prefix else ""
        out.append({"names": [prefix + f for f in fp._fqns], "shard": fp._local_shard.detach().float().tolist(),
                    "index": dist.get_rank(inst.process_group)})
    return out


def full_params(model):
    with FSDP.summon_full_params(model):
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().float().clone().tolist()
                for k, v in model.module.named_parameters()}


def train(model, rank, world, table, *, odc_on, clip="fsdp1", lr=1e-2, deterministic=False, no_sync=False,
          keep=False, sharding="full", compress=None):
    """AdamW; ranks run table[s][r] microbatches at step s; clip: "fsdp1" (model.clip_grad_norm_), "torch"
    (torch.nn.utils.clip_grad_norm_ on this rank's shards, as a user might), "odc" or None; ``no_sync``: all
    but each rank's last microbatch under FSDP1's no_sync() (verl's default); ``keep``: no zero_grad after the
    first step, so the second minibatch's gradients add onto the first's."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if odc_on:
        odc.fsdp.enable(model, opt, timeout=60, deterministic=deterministic, sharding=sharding, compress=compress)
    norms, losses = [], []
    for s, plan in enumerate(table):
        norm = TOKENS * sum(plan)
        total = 0.0
        for m in range(plan[rank]):
            with model.no_sync() if no_sync and m < plan[rank] - 1 else contextlib.nullcontext():
                loss = sample_loss(model, data(s, m, rank)) / norm * world
                loss.backward()
            total += loss.item()
        if clip == "fsdp1":
            norms.append(float(model.clip_grad_norm_(0.5)))
        elif clip == "torch":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        elif clip == "odc":
            norms.append(float(odc.fsdp.clip_grad_norm_(model, 0.5)))
        opt.step()
        if not (keep and s == 0):
            opt.zero_grad()
        losses.append(total)
    if odc_on:
        odc.fsdp.disable(model)
    local = local_shards(model) if not getattr(model._handle, "_use_orig_params", True) else None
    return {"norms": norms, "losses": losses, "params": full_params(model), "local": local}


def reference(table, world, lr=1e-2, clip=True):
    """One process, the whole minibatch: norms and parameters the D-rank runs must match."""
    torch.manual_seed(0)
    ref = Tiny()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    norms = []
    for s, plan in enumerate(table):
        norm = TOKENS * sum(plan)
        for r in range(world):
            for m in range(plan[r]):
                (sample_loss(ref, data(s, m, r)) / norm).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": {k: v.detach().tolist() for k, v in ref.named_parameters()}}


#: Uneven-count variants: build() and train() settings.
UNEVEN = {
    "full": {"clip": "fsdp1"},
    "shard_grad_op": {"strategy": "SHARD_GRAD_OP", "clip": "odc"},
    "deterministic": {"clip": "fsdp1", "deterministic": True},
    "no_sync": {"clip": "fsdp1", "no_sync": True},
    "orig": {"clip": "fsdp1", "orig": True},
    "orig_no_sync": {"clip": "odc", "orig": True, "no_sync": True},
    "orig_shard_grad_op": {"strategy": "SHARD_GRAD_OP", "clip": "odc", "orig": True},
}


def uneven_worker(rank, world, store, table, variants):
    """ODC on FSDP1 with uneven counts (a rank idle at some steps), one run per variant of UNEVEN; rank 0 adds
    the one-process reference."""
    init_pg(rank, world, store)
    out = {}
    for v in variants:
        kw = dict(UNEVEN[v])
        model = build(strategy=kw.pop("strategy", "FULL_SHARD"), orig=kw.pop("orig", False))
        out[v] = train(model, rank, world, table, odc_on=True, **kw)
    if rank == 0:
        out["ref"] = reference(table, world)
    return out


def gloo_parity_worker(rank, world, store, table, variants):
    """The same even-count loop over FSDP1's own collectives (gloo) and over ODC; ``variants``: name ->
    build() and train() settings (clip, mp, orig, keep, freeze)."""
    init_pg(rank, world, store)
    out = {}
    for name, settings in variants.items():
        kw = dict(settings)
        made = {k: kw.pop(k) for k in ("mp", "orig", "freeze") if k in kw}
        gloo = train(build(**made), rank, world, table, odc_on=False, **kw)
        odc_ = train(build(**made), rank, world, table, odc_on=True, **kw)
        out[name] = {"gloo": gloo, "odc": odc_}
    return out


def hybrid_worker(rank, world, store, table, per_node):
    """FSDP1's HYBRID_SHARD and _HYBRID_SHARD_ZERO2 over emulated nodes (LOCAL_WORLD_SIZE) under
    sharding="hybrid": uneven counts against one process (a whole node idle at a step), even counts against
    the same FSDP1 over gloo; each rank's shards, which the other node's replica must hold too."""
    from _fsdp_helpers import as_nodes

    as_nodes(per_node)
    init_pg(rank, world, store)
    nodes = world // per_node
    out = {}
    for strategy, orig in (("HYBRID_SHARD", False), ("_HYBRID_SHARD_ZERO2", True)):
        model = build(strategy=strategy, orig=orig, nodes=nodes)
        out[strategy] = train(model, rank, world, table, odc_on=True, sharding="hybrid")
        out[strategy]["local"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    even = [[1] * world, [2] * world]
    out["gloo"] = train(build(strategy="HYBRID_SHARD", nodes=nodes), rank, world, even, odc_on=False)
    out["odc_even"] = train(build(strategy="HYBRID_SHARD", nodes=nodes), rank, world, even, odc_on=True,
                            sharding="hybrid")
    try:
        odc.fsdp.enable(build(strategy="HYBRID_SHARD", nodes=nodes), None, timeout=30)
        out["full"] = "no error"
    except odc.ConfigError as e:
        out["full"] = str(e)
    if rank == 0:
        out["ref"] = reference(table, world)
    return out


def hybrid_compressed_worker(rank, world, store, table, per_node):
    """FSDP1's HYBRID_SHARD under sharding="hybrid" with the cross-node sum in int8 (and uncompressed, the same
    table): each run's norms, parameters and this rank's shards; rank 0 adds the one-process reference."""
    from _fsdp_helpers import as_nodes

    as_nodes(per_node)
    init_pg(rank, world, store)
    nodes = world // per_node
    out = {}
    for name, compress in (("plain", None), ("int8", {"push": "int8"})):
        model = build(strategy="HYBRID_SHARD", nodes=nodes)
        out[name] = train(model, rank, world, table, odc_on=True, sharding="hybrid", compress=compress)
        out[name]["local"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    if rank == 0:
        out["ref"] = reference(table, world)
    return out


def _load_run(rank, odc_on, kind, orig):
    """Three steps; after step 1 the checkpoint saved after step 0 is loaded (FSDP1 ``kind`` state dict)."""
    from torch.distributed.fsdp import StateDictType

    model = build(orig=orig)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if odc_on:
        odc.fsdp.enable(model, opt, timeout=60)
    saved, norms = None, []
    for s in range(3):
        sample_loss(model, data(s, 0, rank)).backward()
        norms.append(float(model.clip_grad_norm_(0.5)))
        opt.step()
        opt.zero_grad()
        with FSDP.state_dict_type(model, StateDictType[kind]):
            if s == 0:
                saved = {k: v.clone() for k, v in model.state_dict().items()}
            elif s == 1:
                model.load_state_dict(saved)
    if odc_on:
        odc.fsdp.disable(model)
    return {"norms": norms, "params": full_params(model)}


def params_worker(rank, world, store):
    """The parameter contract on FSDP1: a checkpoint loaded between minibatches (full and sharded state dicts)
    is what every peer gathers next, as over gloo; an in-place edit inside a minibatch is refused."""
    init_pg(rank, world, store)
    out = {}
    for orig in (False, True):
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            out[f"{kind}{'/orig' if orig else ''}"] = {"gloo": _load_run(rank, False, kind, orig),
                                                      "odc": _load_run(rank, True, kind, orig)}
        model = build(orig=orig)
        odc.fsdp.enable(model, torch.optim.AdamW(model.parameters(), lr=1e-2), timeout=60)
        sample_loss(model, data(0, 0, rank)).backward()
        with torch.no_grad():
            # up.bias: the original parameter with a part in both ranks' shards
            (model.blocks[1].up.bias if orig else model.blocks[1]._flat_param).mul_(0.5)
        try:
            sample_loss(model, data(0, 1, rank)).backward()
            out["inside" + ("/orig" if orig else "")] = "no error"
        except odc.ProtocolError as e:
            out["inside" + ("/orig" if orig else "")] = str(e)
        dist.barrier()  # this rank's daemon serves the peer's pushes until the peer is refused too
    return out


def refusals_worker(rank, world, store):
    """What odc.fsdp.enable refuses on FSDP1, by message; and that nothing was left enabled."""
    init_pg(rank, world, store)
    out = {}
    cases = {
        "offload": functools.partial(build, offload=True),
        "hybrid": functools.partial(build, strategy="HYBRID_SHARD"),
        "no_shard": functools.partial(build, strategy="NO_SHARD"),
    }
    for name, make in cases.items():
        try:
            model = make()
        except Exception as e:  # a strategy this torch cannot build on CPU: reported, the test decides
            out[name] = f"build failed: {type(e).__name__}: {e}"
            continue
        try:
            odc.fsdp.enable(model, None, timeout=30)
            out[name] = "no error"
        except odc.ConfigError as e:
            out[name] = str(e)
        out[name + "_enabled"] = odc.fsdp.is_enabled(model)
    for sharding in ("hybrid-zero", "hybrid"):
        try:
            odc.fsdp.enable(build(), None, timeout=30, sharding=sharding)
            out[f"sharding={sharding}"] = "no error"
        except odc.ConfigError as e:
            out[f"sharding={sharding}"] = str(e)
    return out


def missing_names_worker(rank, world, store):
    """Takes each private FSDP1 attribute odc.fsdp reads of an FSDP1 object away in turn (from the instance, or
    from the class where the instance finds it) and calls enable: ``{"owner.name": message or what happened}``."""
    from odc.fsdp import _fsdp1

    init_pg(rank, world, store)
    model = build()
    model.check_is_root()  # FSDP1's lazy init (the first forward's), which sets the flat parameters' attributes
    handle = model.blocks[0]._handle
    holders = {"FullyShardedDataParallel": model.blocks[0], "FlatParamHandle": handle,
               "FlatParameter": handle.flat_param}
    out = {}
    for n in _fsdp1.PRIVATE_FSDP1:
        obj = holders.get(n.owner)
        if obj is None or n.name in ("_saved_grad_shard", "_inter_node_pg"):  # a module, or set only sometimes
            continue
        out[f"{n.owner}.{n.name}"] = enable_without(model, obj, n.name)
        if odc.fsdp.is_enabled(model):
            out[f"{n.owner}.{n.name}"] += " | left enabled"
    return out


def death_worker(rank, world, store, orig):
    """Rank 1 dies (os._exit) between two microbatches of minibatch 1, after pushing the first one's
    gradients; rank 0 runs its two and steps: the error it gets, the peer it names and how long it took."""
    import os
    import time

    init_pg(rank, world, store)
    model = build(orig=orig)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    odc.fsdp.enable(model, opt, timeout=20)
    t0 = time.monotonic()
    try:
        for s in range(3):
            for m in range(2):
                if s == 1 and m == 1 and rank == 1:
                    os._exit(3)  # dies in the middle of the minibatch, without a word
                sample_loss(model, data(s, m, rank)).backward()
            t0 = time.monotonic()
            opt.step()
            opt.zero_grad()
    except odc.OdcError as e:
        return {"error": type(e).__name__, "peer": getattr(e, "peer", None), "message": str(e),
                "seconds": time.monotonic() - t0, "step": s, "peer_error": isinstance(e, odc.PeerError)}
    return {"error": None}


def assert_flat_shards_near(shards, ref, per_node, tol=1e-5):
    """Each FlatParameter shard of ``local_shards`` is its slice of the flattened, padded reference (a state
    dict), within ``tol`` (``tol=0``: bit for bit)."""
    for s in shards:
        flat = torch.cat([ref[n].detach().flatten() for n in s["names"]])
        n = len(s["shard"])
        padded = torch.zeros(n * per_node)
        padded[: flat.numel()] = flat
        want = padded[s["index"] * n:(s["index"] + 1) * n]
        if tol == 0:
            assert torch.equal(torch.tensor(s["shard"]), want), s["names"]
        else:
            assert (torch.tensor(s["shard"]) - want).abs().max().item() < tol, s["names"]
