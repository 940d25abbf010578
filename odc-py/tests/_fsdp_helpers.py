"""Worker functions for test_fsdp.py: a tiny model, FSDP2 training loops with gloo and with ODC.

Each worker runs under ``_dist.run_ranks`` (spawned ranks, shared TCPStore)
and initialises a gloo process group on that store.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import odc
import odc.backend
import odc.fsdp

DIM, VOCAB = 24, 37  # odd sizes: FSDP's shards are not 64-byte aligned
#: The running torch's (major, minor), for the few checks that exist on some supported releases only.
TORCH_MINOR = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim + 1)
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, dim: int = DIM, layers: int = 2, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        if unused:
            self.blocks[0].extra = nn.Linear(dim, dim)  # never called

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def init_pg(rank, world, store):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def build(world, seed=0, mp=None, reshard=True, mesh=None, unused=False, layers=2, tail=False):
    """Tiny, each block ``fully_shard``-ed, then the root; ``tail``: the last block and the head as one group of
    two modules, ``fully_shard([block, head])``, as accelerate shards a causal LM's tail."""
    torch.manual_seed(seed)
    model = Tiny(layers=layers, unused=unused)
    mesh = mesh or init_device_mesh("cpu", (world,))
    kw = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    for b in model.blocks[:-1] if tail else model.blocks:
        fully_shard(b, **kw)
    if tail:
        fully_shard([model.blocks[-1], model.head], **kw)
    fully_shard(model, **kw)
    return model


def sample_loss(model, tokens):
    """Per-sample summed next-token loss (a 1-D batch of token sequences)."""
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1),
                                             reduction="sum")


def data(step, micro, rank, n=3, length=9):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def full_params(model):
    """Full parameters as nested lists (tensors do not survive a worker's os._exit in transit)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().tolist()
            for k, v in model.state_dict().items()}


def bucket_dtypes(model):
    """dtype of the ODC bucket behind each FSDP group (what gathers read), as the engine registered it."""
    b = model._odc_fsdp
    return [b.engine.bucket(g.name)["dtype"] for g in b.groups]


def train(model, rank, world, *, steps, micros, odc_on, clip=None, lr=1e-2, sharding="full", sgd=False):
    """AdamW (or SGD, whose step scales with the gradient), ``micros`` microbatches per step; returns (losses,
    norms, params, ODC bucket dtypes or None, ODC transport or None)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr) if sgd else torch.optim.AdamW(model.parameters(), lr=lr,
                                                                                   weight_decay=0.01)
    dtypes = transport = None
    if odc_on:
        odc.fsdp.enable(model, opt, timeout=60, sharding=sharding)
        dtypes = bucket_dtypes(model)
        transport = model._odc_fsdp.engine.transport
    losses, norms = [], []
    for s in range(steps):
        total = 0.0
        for m in range(micros):
            loss = sample_loss(model, data(s, m, rank)) / (27 * micros)
            loss.backward()
            total += loss.item()
        if clip is not None:
            # The users' clip under both: torch's own, on the gradients ODC installs when it reads them.
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    params = full_params(model) if not odc_on else None
    if odc_on:
        odc.fsdp.disable(model)
        params = full_params(model)  # full_tensor() is a gloo collective: after disable is fine
    return losses, norms, params, dtypes, transport


#: Parity variants stepped with SGD: the ones exercising FSDP2's divide-factor branches (forced SUM, a divide factor
#: of one's own, an fp16 reduce dtype's pre- and post-divide).
SGD_VARIANTS = ("forcesum", "divide", "fp16reduce")


def parity_worker(rank, world, store, variants, transport=None):
    """FSDP2 over gloo, then over ODC, per variant. ``transport`` goes in ``ODC_TRANSPORT`` (emu-ipc runs
    with jittered emulated streams) and is checked to be one that carries CPU tensors."""
    if transport is not None:
        os.environ["ODC_TRANSPORT"] = transport
        os.environ["ODC_EMU_JITTER_US"] = "50"
    init_pg(rank, world, store)
    out = {}
    if transport is not None:
        # cuda-ipc cannot carry a CPU model: refused before anything is registered.
        try:
            odc.fsdp.enable(build(world), None, transport="cuda-ipc")
        except odc.ConfigError as e:
            out["cuda_ipc_on_cpu"] = str(e)
    for name in variants:
        mp = {"bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "fp16reduce": MixedPrecisionPolicy(reduce_dtype=torch.float16)}.get(name)
        res = {}
        for mode in ("gloo", "odc"):
            model = build(world, mp=mp, reshard=(name != "forcesum"))  # forcesum also keeps params unsharded
            if name == "forcesum":
                model.set_force_sum_reduction_for_comms(True)
            if name == "divide":
                # A divide factor of its own: PREMUL_SUM(1/3) where the backend has it (ODC reads op.factor);
                # gloo has no PREMUL_SUM, so FSDP2 sums there and divides the output.
                for m in model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_gradient_divide_factor(3.0)
                        m.set_force_sum_reduction_for_comms(mode == "gloo")
            # Every variant clips (the per-step norms see a wrong scale) and the divide-factor branches step
            # with SGD (AdamW is nearly scale-invariant: a wrong factor would pass through it).
            res[mode] = train(model, rank, world, steps=10, micros=2, odc_on=(mode == "odc"), clip=0.3,
                              sgd=name in SGD_VARIANTS, lr=0.1 if name in SGD_VARIANTS else 1e-2)
        out[name] = res
    if world == 4:
        # reshard_after_forward=<int> gathers over a sub-mesh: refused.
        model = build(world, reshard=2)
        try:
            odc.fsdp.enable(model, None)
        except odc.ConfigError as e:
            out["reshard_int_error"] = str(e)
    return out


def lbmini_worker(rank, world, store, counts, steps):
    """Ranks run counts[(s + r) % len(counts)] microbatches at step s; SGD on the summed loss.

    Trains twice (optimizer hooks, then odc.fsdp.minibatch); rank 0 compares
    both with a single-process reference on the same total loss.
    """
    init_pg(rank, world, store)
    lr = 0.1

    def plan(s, r):
        return counts[(s + r) % len(counts)]

    def mb_loss(model, s, r, m, norm):
        return sample_loss(model, data(s, m, r)) / norm

    got, seen = {}, []
    for explicit in (False, True):
        model = build(world)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        odc.fsdp.enable(model, None if explicit else opt, timeout=60)
        seen = []
        for s in range(steps):
            norm = 27 * sum(plan(s, r) for r in range(world))  # tokens in the whole minibatch
            with odc.fsdp.minibatch(model) if explicit else contextlib.nullcontext():
                for m in range(plan(s, rank)):
                    (mb_loss(model, s, rank, m, norm) * world).backward()  # FSDP averages over ranks
            seen.append(plan(s, rank))
            opt.step()
            opt.zero_grad()
        odc.fsdp.disable(model)
        got[explicit] = full_params(model)
    if rank != 0:
        return {"counts": seen}
    torch.manual_seed(0)
    ref = Tiny()
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    for s in range(steps):
        norm = 27 * sum(plan(s, r) for r in range(world))
        for r in range(world):
            for m in range(plan(s, r)):
                mb_loss(ref, s, r, m, norm).backward()
        ropt.step()
        ropt.zero_grad()
    diff = {
        mode: max((torch.tensor(p[k]) - v.detach()).abs().max().item() for k, v in ref.state_dict().items())
        for mode, p in got.items()
    }
    return {"counts": seen, "max_diff": diff}


def errors_worker(rank, world, store):
    init_pg(rank, world, store)
    found = {}

    def expect(key, exc, fn):
        try:
            fn()
        except exc as e:
            found[key] = f"{type(e).__name__}: {e}"
            found[key + "_peer"] = getattr(e, "peer", None)
        else:
            found[key] = "no error"

    expect("not_sharded", odc.ConfigError, lambda: odc.fsdp.enable(Tiny(), None))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    expect("hsdp", odc.ConfigError, lambda: odc.fsdp.enable(build(world, mesh=hsdp), None))
    expect("not_enabled", odc.ConfigError, lambda: odc.fsdp.disable(build(world)))

    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, None, timeout=30)
    expect("twice", odc.ConfigError, lambda: odc.fsdp.enable(model, opt))
    with odc.fsdp.minibatch(model):
        sample_loss(model, data(0, 0, rank)).backward()
    opt.step()
    expect("pending", odc.ProtocolError, lambda: _push_then_disable(model, rank))  # out of the block: skipped
    with odc.fsdp.minibatch(model):
        sample_loss(model, data(1, 0, rank)).backward()
    opt.step()  # by hand: no hook tells ODC
    # A forward between the finished minibatch and the next one would read stale parameters.
    expect("stale_forward", odc.ProtocolError, lambda: model(data(1, 0, rank)))
    odc.fsdp.disable(model)

    found["installs"] = _installs_through_public_setters(world)
    if TORCH_MINOR >= (2, 12):  # torch 2.11 has no per-parameter meshes (one group per fully_shard call)
        expect("per_param_mesh", odc.ConfigError, lambda: odc.fsdp.enable(_per_param_mesh_model(world), None))

    model = build(world, unused=True)
    odc.fsdp.enable(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=30)
    expect("unused", odc.LayoutError, lambda: sample_loss(model, data(0, 0, rank)).backward())
    expect("dead_peer", odc.PeerError, lambda: _die_mid_training(rank, world))
    return found


def missing_names_worker(rank, world, store):
    """Takes each private FSDP2 name odc.fsdp uses on this torch away from a real fully_shard-ed model in turn
    (from the instance, or from the class where the instance finds it) and calls ``enable``.

    Returns ``{"owner.name": message}``: the ConfigError's message, or what happened instead (another error,
    a model left enabled, a binding left alive, a comm left installed).
    """

    from odc.fsdp import _binding, _private

    init_pg(rank, world, store)
    model = build(world)
    model(data(0, 0, 0)).sum().backward()  # lazy init and one real step of FSDP's own collectives
    state = model._get_fsdp_state()
    groups = _private.param_groups(state)
    comms = [(pg._all_gather_comm, pg._reduce_scatter_comm) for pg in groups]
    holders = {"FSDPModule": [model], "FSDPState": [state], "FSDPParamGroup": groups,
               "FSDPParam": [fp for pg in groups for fp in pg.fsdp_params]}
    out = {}
    for owner, objs in holders.items():
        for name in _private.names_of(owner):
            out[f"{owner}.{name}"] = enable_without(model, objs[-1], name)
            left = [odc.fsdp.is_enabled(model) and "enabled", len(_binding._live) and "a live binding",
                    [(pg._all_gather_comm, pg._reduce_scatter_comm) for pg in groups] != comms and "comms"]
            if any(left):
                out[f"{owner}.{name}"] += f" | left behind: {[x for x in left if x]}"
    return out


def enable_without(model, obj, name):
    """Takes attribute ``name`` away from ``obj`` (from the instance, or from the class where the instance finds
    it), calls ``odc.fsdp.enable(model, None)`` and puts it back: the ConfigError's message, or what happened
    instead."""
    import inspect

    target = obj if name in vars(obj) else next(k for k in type(obj).__mro__ if name in vars(k))
    keep = vars(target)[name]
    delattr(target, name)
    try:
        inspect.getattr_static(obj, name)
        return "still there"
    except AttributeError:
        pass
    try:
        odc.fsdp.enable(model, None, timeout=30)
        return "no error"
    except odc.ConfigError as e:
        return str(e)
    except Exception as e:  # the test reports what escaped
        return f"{type(e).__name__}: {e}"
    finally:
        setattr(target, name, keep)


def _installs_through_public_setters(world):
    """Which comm classes FSDPModule.set_custom_all_gather / set_custom_reduce_scatter got, per module.

    Returns ``{"enable": [...], "disable": [...], "groups": G}`` with one
    ``(module class, all-gather class, reduce-scatter class)`` per call; after
    ``enable`` every group's comm must be the ODC object installed for it.
    """
    from torch.distributed.fsdp import FSDPModule

    calls = []
    orig_ag, orig_rs = FSDPModule.set_custom_all_gather, FSDPModule.set_custom_reduce_scatter

    def spy_ag(self, comm):
        calls.append(("ag", type(self).__name__, type(comm).__name__))
        return orig_ag(self, comm)

    def spy_rs(self, comm):
        calls.append(("rs", type(self).__name__, type(comm).__name__))
        return orig_rs(self, comm)

    model = build(world)
    FSDPModule.set_custom_all_gather, FSDPModule.set_custom_reduce_scatter = spy_ag, spy_rs
    try:
        odc.fsdp.enable(model, None, timeout=30)
        enabled, calls[:] = list(calls), []
        b = model._odc_fsdp
        own = all(g.pg._all_gather_comm._g is g and g.pg._reduce_scatter_comm._g is g for g in b.groups)
        with odc.fsdp.minibatch(model):
            sample_loss(model, data(0, 0, 0)).backward()
        odc.fsdp.disable(model)
        disabled = list(calls)
    finally:
        FSDPModule.set_custom_all_gather, FSDPModule.set_custom_reduce_scatter = orig_ag, orig_rs
    return {"enable": enabled, "disable": disabled, "groups": len(b.groups), "own": own}


def _per_param_mesh_model(world):
    """A block whose fully_shard puts one weight on another mesh: FSDP makes two groups for it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu"), shard_mesh_dim=0)
    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model.blocks[0],
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.ndim == 2 else None)
    fully_shard(model)
    return model


def _die_mid_training(rank, world):
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt, timeout=20)
    for s in range(3):
        if s == 1 and rank == 1:
            os._exit(3)  # dies between minibatches, without a word
        sample_loss(model, data(s, 0, rank)).backward()
        opt.step()
        opt.zero_grad()


def _push_then_disable(model, rank):
    with odc.fsdp.minibatch(model):
        sample_loss(model, data(2, 0, rank)).backward()
        odc.fsdp.disable(model)


# -- hybrid sharding (test_fsdp_hybrid.py): D ranks as nodes × G on one host --------------------


def hsdp_mesh(world, per_node):
    """FSDP2's HSDP mesh: (replicate, shard) = (nodes, ranks per node)."""
    return init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def as_nodes(per_node, transport=None):
    """Makes this worker one of ``per_node`` ranks of a node (node-major), as torchrun would say."""
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    if transport is not None:
        os.environ["ODC_TRANSPORT"] = transport


def local_shards(model):
    """This rank's parameter shards as nested lists (replicas on other nodes must hold the same)."""
    return {k: v.to_local().detach().tolist() for k, v in model.state_dict().items()}


def hybrid_uneven_worker(rank, world, store, per_node, table, transport, lr=1e-2, clip=0.5, torch_clip=False,
                         deterministic=False):
    """Hybrid ODC with AdamW and clipping (odc.fsdp.clip_grad_norm_, or torch's), ranks running
    table[s][r] microbatches at step s.

    Also counts collectives (CommDebugMode) over the first step, flips
    ``set_requires_gradient_sync(True)`` before every forward (it turns HSDP's
    all-reduce back on; ODC must keep it off), and returns this rank's shards.
    Rank 0 compares with a single-process reference on the same total loss.
    """
    from torch.distributed.tensor.debug import CommDebugMode

    as_nodes(per_node, transport)
    init_pg(rank, world, store)
    model = build(world, mesh=hsdp_mesh(world, per_node))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", timeout=60, deterministic=deterministic)
    engine = model._odc_fsdp.engine
    info = {"transport": engine.transport, "sharding": engine.sharding, "norms": [], "comms": None}
    comms: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def counted(on):
        # A CommDebugMode per forward: torch 2.11's fails on a module's second forward under one mode.
        if not on:
            yield
            return
        with CommDebugMode() as cm:
            yield
        comms.update({str(k): v for k, v in cm.get_comm_counts().items()})

    for s, plan in enumerate(table):
        norm = 27 * sum(plan)  # tokens in the whole minibatch
        for m in range(plan[rank]):
            with counted(s == 0):
                model.set_requires_gradient_sync(True)
                (sample_loss(model, data(s, m, rank)) / norm * world).backward()  # FSDP averages over D
        with counted(s == 0):
            clip_fn = torch.nn.utils.clip_grad_norm_ if torch_clip else odc.fsdp.clip_grad_norm_
            info["norms"].append(float(clip_fn(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    info["comms"] = dict(comms)
    info["all_reduce_off"] = all(not g.pg.all_reduce_grads for g in model._odc_fsdp.groups)
    info["shards"] = local_shards(model)
    odc.fsdp.disable(model)
    info["all_reduce_restored"] = all(pg.all_reduce_grads for pg in _groups(model))
    params = full_params(model)
    if rank != 0:
        return info
    torch.manual_seed(0)
    ref = Tiny()
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    ref_norms = []
    for s, plan in enumerate(table):
        norm = 27 * sum(plan)
        for r in range(world):
            for m in range(plan[r]):
                (sample_loss(ref, data(s, m, r)) / norm).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        ropt.step()
        ropt.zero_grad()
    info["ref_norms"] = ref_norms
    info["max_diff"] = max((torch.tensor(params[k]) - v.detach()).abs().max().item()
                           for k, v in ref.state_dict().items())
    return info


def _groups(model):
    state = model._get_fsdp_state()
    return [pg for st in state._state_ctx.all_states for pg in odc.fsdp._private.param_groups(st)]


def hybrid_parity_worker(rank, world, store, per_node, variants, transport):
    """Hybrid ODC against FSDP2's own HSDP over gloo (same microbatches on every rank)."""
    as_nodes(per_node, transport)
    init_pg(rank, world, store)
    out = {}
    for name in variants:
        res = {}
        for mode in ("gloo", "odc"):
            model = build(world, mesh=hsdp_mesh(world, per_node), reshard=(name != "forcesum"))
            if name == "forcesum":
                model.set_force_sum_reduction_for_comms(True)
            if name == "divide":
                model.set_gradient_divide_factor(float(per_node))  # sum over nodes, mean within one
            res[mode] = train(model, rank, world, steps=4, micros=2, odc_on=(mode == "odc"),
                              clip=0.5 if name == "fp32" else None, sharding="hybrid")
        out[name] = res
    return out


def hybrid_errors_worker(rank, world, store, per_node):
    """Settings that must be refused with a ConfigError naming the problem and the fix."""
    from torch.distributed.device_mesh import DeviceMesh

    as_nodes(per_node)
    init_pg(rank, world, store)
    found = {}

    def expect(key, fn):
        try:
            fn()
        except odc.ConfigError as e:
            found[key] = str(e)
        except Exception as e:  # reported, the test fails on it
            found[key] = f"wrong type {type(e).__name__}: {e}"
        else:
            found[key] = "no error"

    expect("unknown", lambda: odc.fsdp.enable(build(world), None, sharding="hsdp"))
    expect("one_d", lambda: odc.fsdp.enable(build(world), None, sharding="hybrid"))
    expect("full_on_2d", lambda: odc.fsdp.enable(build(world, mesh=hsdp_mesh(world, per_node)), None))
    wide = init_device_mesh("cpu", (world // (2 * per_node), 2 * per_node), mesh_dim_names=("replicate", "shard"))
    expect("wide", lambda: odc.fsdp.enable(build(world, mesh=wide), None, sharding="hybrid"))
    # Shard groups across nodes: ranks {0, G, ...} share shards.
    across = DeviceMesh("cpu", torch.arange(world).view(world // per_node, per_node).t().contiguous(),
                        mesh_dim_names=("replicate", "shard"))
    expect("across", lambda: odc.fsdp.enable(build(world, mesh=across), None, sharding="hybrid"))
    # hybrid-zero shards over the 1-D mesh of every rank, on whole nodes (torch itself refuses meshes out of
    # rank order).
    expect("zero_on_2d", lambda: odc.fsdp.enable(build(world, mesh=hsdp_mesh(world, per_node)), None,
                                                 sharding="hybrid-zero"))
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    expect("zero_uneven", lambda: odc.fsdp.enable(build(world), None, sharding="hybrid-zero"))
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    # HSDP's all-reduce turned back on between forward and backward (no
    # re-gather in backward, which would switch it off again).
    model = build(world, mesh=hsdp_mesh(world, per_node), reshard=False)
    odc.fsdp.enable(model, None, sharding="hybrid", timeout=30)
    with odc.fsdp.minibatch(model):
        loss = sample_loss(model, data(0, 0, rank))
        model.set_requires_all_reduce(True)
        expect("all_reduce_on", loss.backward)
    return found


# -- the example ---------------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_sft.py"


def run_hybrid_example(sharding, *extra):
    """examples/fsdp2_sft.py as 2 emulated nodes of 2 ranks under ``sharding`` (a small model, 2 steps,
    LB-Mini's uneven counts); asserts it ran and returns its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("LOCAL_WORLD_SIZE", None)
    cmd = [sys.executable, str(EXAMPLE), "--nproc", "4", "--local-world-size", "2", "--sharding", sharding,
           "--comm", "odc", "--steps", "2", "--dim", "32", "--layers", "2", "--samples", "16", "--minibatch", "2",
           "--max-len", "48", "--strategy", "lb-mini", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[odc/lb-mini] minibatch 1: loss" in p.stdout, p.stdout
    return p.stdout


# -- assertions shared by the FSDP test files ------------------------------------------------------


def all_ok(res):
    """The value every rank returned, asserting that every rank succeeded."""
    assert all(s == "ok" for s, _ in res.values()), res
    return {r: v for r, (_, v) in res.items()}


def assert_params_close(a, b, tol):
    """Two ``{name: nested list}`` parameter sets agree within ``tol`` (max absolute difference)."""
    assert a.keys() == b.keys()
    worst = max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)
    assert worst <= tol, f"max parameter difference {worst} > {tol}"


def assert_runs_match(label, gloo, odc_, clip, tol=1e-5):
    """An ODC run matches the same run over gloo: the clip at ``clip`` active at every step, per-step grad norms
    within ``tol`` relative, final parameters within ``tol``."""
    assert all(n > clip for n in gloo["norms"]), (label, gloo["norms"])
    for s, (x, y) in enumerate(zip(odc_["norms"], gloo["norms"], strict=True)):
        assert math.isclose(x, y, rel_tol=tol), (label, s, odc_["norms"], gloo["norms"])
    assert_params_close(gloo["params"], odc_["params"], tol)


# -- CUDA parameters (test_device.py, GPU only) --------------------------------------------------


def cuda_fsdp_worker(rank, world, store, steps, micros=2, lr=1e-2, comm="odc.fsdp"):
    """ODC on CUDA parameters against a single-process reference on the same GPU. ``comm``: ``"odc.fsdp"``
    (cuda-ipc picked by odc.fsdp.enable) or ``"backend"`` (FSDP2's own collectives on an ``"odc"`` process
    group). Ranks share GPUs when there are fewer than ranks. Returns this rank's max difference."""
    os.environ.pop("ODC_TRANSPORT", None)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if comm == "backend":
        odc.register()
        dist.init_process_group("odc", store=store, rank=rank, world_size=world)
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    else:
        init_pg(rank, world, store)  # gloo: ODC replaces FSDP's collectives, the group only builds the mesh
        mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    model = Tiny().to(dev)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if comm != "backend":
        odc.fsdp.enable(model, opt, timeout=60)
    info = {}
    for s in range(steps):
        for m in range(micros):
            (sample_loss(model, data(s, m, rank).to(dev)) / (27 * micros)).backward()  # FSDP averages over ranks
        opt.step()
        info["grad_device"] = str(next(p.grad for p in model.parameters() if p.grad is not None).device)
        opt.zero_grad()
    if comm == "backend":
        pg = odc.backend.get_process_group()
        info["transport"], info["counts"] = pg.transports.get(str(dev)), dict(pg.op_counts)
    else:
        info["transport"] = model._odc_fsdp.engine.transport
        odc.fsdp.disable(model)
    shards = {k: v.to_local().detach() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    ref = Tiny().to(dev)
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    for s in range(steps):
        for r in range(world):
            for m in range(micros):
                (sample_loss(ref, data(s, m, r).to(dev)) / (27 * micros * world)).backward()
        ropt.step()
        ropt.zero_grad()
    diff = 0.0
    for k, v in ref.state_dict().items():
        chunks = torch.chunk(v.detach(), world, dim=0)  # FSDP2's Shard(0) split
        want = chunks[rank] if rank < len(chunks) else v[:0]
        diff = max(diff, (shards[k] - want).abs().max().item() if want.numel() else 0.0)
    info["max_diff"] = diff
    return info


# -- ZeRO++-style hybrid (test_fsdp_hybrid_zero.py): a 1-D mesh, node shards in the engine ------------


def hybrid_zero_worker(rank, world, store, per_node, table, transport, torch_clip=False, lr=1e-2, clip=0.5,
                       deterministic=False, modes=(("hybrid-zero", True), ("full", True)), cross_node=None):
    """The same AdamW + clip loop under each (sharding, reshard_after_forward) of ``modes`` (by default
    sharding="hybrid-zero" and "full"), ranks running table[s][r] microbatches at step s, on FSDP2's ordinary
    1-D mesh; ``cross_node`` goes to ``odc.fsdp.enable``.

    Returns per mode (its sharding, with ",reshard=k" for an int) the clipped norms, the final full
    parameters, the optimizer state's local sizes, the engine's bucket geometry, the backward re-gathers,
    the engine's ``cross_node`` and its node-cache counts; rank 0 also runs the single-process reference.
    """
    as_nodes(per_node, transport)
    init_pg(rank, world, store)
    out = {}
    labels = []
    for mode, reshard in modes:
        label = mode if reshard is True else f"{mode},reshard={reshard}"
        labels.append(label)
        model = build(world, reshard=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        odc.fsdp.enable(model, opt, sharding=mode, timeout=60, deterministic=deterministic, cross_node=cross_node)
        engine = model._odc_fsdp.engine
        info = {"sharding": engine.sharding, "transport": engine.transport, "norms": [],
                "buckets": [engine.bucket(g.name) for g in model._odc_fsdp.groups],
                "cross_node": engine.cross_node}
        for s, plan in enumerate(table):
            norm = 27 * sum(plan)
            for m in range(plan[rank]):
                (sample_loss(model, data(s, m, rank)) / norm * world).backward()
            clip_fn = torch.nn.utils.clip_grad_norm_ if torch_clip else odc.fsdp.clip_grad_norm_
            info["norms"].append(float(clip_fn(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
        # AdamW's state lives on the local shard FSDP2 gives this rank: 1/D of each parameter.
        info["state"] = {name: [opt.state[p]["exp_avg"].to_local().numel(), p.to_local().numel(), p.shape[0],
                                p.numel()]
                         for name, p in model.named_parameters()}
        info["regathers"] = model._odc_fsdp.state.regathers
        info["cache"] = engine.node_cache_stats()
        odc.fsdp.disable(model)
        info["params"] = full_params(model)
        out[label] = info
    if rank == 0:
        torch.manual_seed(0)
        ref = Tiny()
        ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
        out["ref_norms"] = []
        for s, plan in enumerate(table):
            norm = 27 * sum(plan)
            for r in range(world):
                for m in range(plan[r]):
                    (sample_loss(ref, data(s, m, r)) / norm).backward()
            out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
            ropt.step()
            ropt.zero_grad()
        out["max_diff"] = {
            mode: max((torch.tensor(out[mode]["params"][k]) - v.detach()).abs().max().item()
                      for k, v in ref.state_dict().items())
            for mode in labels
        }
    return out


def hybrid_zero_death_worker(rank, world, store, per_node, victim, transport):
    """sharding="hybrid-zero": ``victim`` dies between minibatches; the survivors must fail naming a peer."""
    as_nodes(per_node, transport)
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    odc.fsdp.enable(model, opt, sharding="hybrid-zero", timeout=20)
    for s in range(3):
        if s == 1 and rank == victim:
            os._exit(3)  # dies between minibatches, without a word
        sample_loss(model, data(s, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
    return "no error"


# -- work stealing (test_fsdp_steal.py) ----------------------------------------------------------------


def steal_worker(rank, world, store, counts, slow_rank, slow_s, transport, steal=True, lr=1e-2, die=None,
                 deterministic=False, jitter=None):
    """AdamW over ``odc.fsdp.microbatches``: ``counts[s][r]`` microbatches of rank r's list at step s, each
    microbatch ``(s, m, r)`` loadable by any rank; ``slow_rank`` sleeps ``slow_s`` per microbatch it runs.

    Returns what this rank ran and a digest of the final parameters' bits; rank 0 also the largest difference
    from one process on every microbatch. ``die=(rank, runs)``: that rank exits without a word once it has run
    ``runs`` microbatches (holding the ones it claimed). ``jitter=seed``: every rank also sleeps a random
    0-30 ms (seeded by ``seed`` and the rank) before each microbatch, so who steals what and when pushes arrive
    change with the seed. ``deterministic`` is passed to ``odc.fsdp.enable``.

    The sleeps are the suite's smallest that keep the assertions meaningful: a microbatch of the tests' model
    computes in a few milliseconds, so ``slow_s`` of 0.05-0.15 s per microbatch keeps the slow rank on its own
    list long after the others have run theirs (its list is stolen from on every run, also under make test's
    load), and 0-30 ms of jitter is several microbatches' worth, enough to change who steals what; longer
    sleeps only add wall time.
    """
    import hashlib
    import random
    import time

    os.environ["ODC_TRANSPORT"] = transport
    init_pg(rank, world, store)
    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    odc.fsdp.enable(model, opt, timeout=20 if die else 60, deterministic=deterministic)
    ran = []
    rng = random.Random(f"{jitter}/{rank}")
    for s, plan in enumerate(counts):
        lists = [[(s, m, r) for m in range(plan[r])] for r in range(world)]
        norm = 27 * sum(plan)
        for mb in odc.fsdp.microbatches(model, lists, steal=steal):
            if rank == slow_rank:
                time.sleep(slow_s)
            if jitter is not None:
                time.sleep(rng.uniform(0.0, 0.03))
            (sample_loss(model, data(*mb)) / norm * world).backward()
            ran.append(mb)
            if die is not None and rank == die[0] and len(ran) >= die[1]:
                os._exit(3)
        opt.step()
        opt.zero_grad()
    odc.fsdp.disable(model)
    params = full_params(model)
    digest = hashlib.sha256()
    for k in sorted(params):
        digest.update(torch.as_tensor(params[k]).contiguous().numpy().tobytes())
    out = {"ran": ran, "digest": digest.hexdigest()}
    if rank == 0:
        torch.manual_seed(0)
        ref = Tiny()
        ropt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
        for s, plan in enumerate(counts):
            norm = 27 * sum(plan)
            for r in range(world):
                for m in range(plan[r]):
                    (sample_loss(ref, data(s, m, r)) / norm).backward()
            ropt.step()
            ropt.zero_grad()
        out["max_diff"] = max((torch.tensor(params[k]) - v.detach()).abs().max().item()
                              for k, v in ref.state_dict().items())
    return out


def hybrid_reference(plan, world, per_node, dead, out):
    """One process (AdamW, torch's clip at 0.5) on every rank's samples of ``plan`` (``plan[s][r]``
    microbatches of ``data(s, m, r)``), node ``dead``'s left out at the steps in ``out``, each step normalized
    by the kept tokens: what elastic hybrid training must equal."""
    torch.manual_seed(0)
    ref = Tiny()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for s, counts in enumerate(plan):
        ranks = [r for r in range(world) if s not in out or r // per_node != dead]
        norm = 27 * sum(counts[r] for r in ranks)
        for r in ranks:
            for m in range(counts[r]):
                (sample_loss(ref, data(s, m, r)) / norm).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


def exact_sum_f32(grads, scale):
    """What deterministic accumulation must give, computed apart from it: each ``scale · g`` (f32 tensors, one per
    microbatch) rounded to nearest-even units of 2^-72, the units added as Python integers, the sum rounded once to
    the nearest f32 (ties to even). Independent of ODC's kernels: numpy's rint and Python's integers."""
    import numpy as np

    shape = grads[0].shape
    scale64 = np.float64(np.float32(scale))
    total = [0] * grads[0].numel()
    for g in grads:
        units = np.rint(g.detach().double().numpy().reshape(-1) * scale64 * 2.0**72)  # exact: integers in f64
        for i, u in enumerate(units.tolist()):
            total[i] += int(u)

    def nearest(units):
        if units == 0:
            return 0.0
        a = abs(units)
        shift = a.bit_length() - 24
        if shift > 0:
            q, r = divmod(a, 1 << shift)
            half = 1 << (shift - 1)
            q += r > half or (r == half and q & 1)
            a, exp = q, shift - 72
        else:
            exp = -72
        return math.copysign(math.ldexp(a, exp), units)

    return torch.tensor([nearest(u) for u in total], dtype=torch.float32).view(shape)


def exact_reference(plan, world, max_norm, exact=True):
    """One process on every rank's samples of ``plan`` (``plan[s][r]`` microbatches of ``data(s, m, r)``), each
    step's gradient the exact sum of every microbatch's (:func:`exact_sum_f32`, scaled by 1/world as FSDP's
    average is), then torch's clip at ``max_norm`` and AdamW: what ``deterministic=True`` must equal bit for bit
    where the clip does not clip (a coefficient of 1.0 changes no bit). One thread, as the ranks compute.
    ``exact=False``: the same with the microbatches' scaled gradients added in f32 in order instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        ref = Tiny()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
        for s, counts in enumerate(plan):
            norm = 27 * sum(counts)
            per_mb = []
            for r in range(world):
                for m in range(counts[r]):
                    ref.zero_grad(set_to_none=True)
                    (sample_loss(ref, data(s, m, r)) / norm * world).backward()
                    per_mb.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            scale = torch.tensor(1.0 / world, dtype=torch.float32)
            for n, p in ref.named_parameters():
                gs = [g[n] for g in per_mb]
                p.grad = exact_sum_f32(gs, 1.0 / world) if exact else sum(g * scale for g in gs[1:]) + gs[0] * scale
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
        return ref.state_dict()
    finally:
        torch.set_num_threads(threads)


def assert_shards_near(shards, ref, index, per_node, tol=1e-5):
    """A rank's shards (``local_shards``) are dim-0 chunk ``index`` of ``per_node`` of the reference's, within
    ``tol``."""
    for name, shard in shards.items():
        want = torch.chunk(ref[name].detach(), per_node, dim=0)[index]
        got = torch.tensor(shard)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert (got - want).abs().max().item() < tol, (index, name, (got - want).abs().max().item())


def enable_steps_worker(rank, world, store, fsdp1):
    """The calls ``odc.fsdp.enable`` itself makes (``module.function``), traced on an FSDP2 or FSDP1 model."""
    import sys

    init_pg(rank, world, store)
    if fsdp1:
        from _fsdp1 import build as build1

        model = build1(strategy="FULL_SHARD")
    else:
        model = build(world)
    steps = []

    def trace(frame, event, _arg):
        up = frame.f_back
        if (event == "call" and up is not None and up.f_code.co_name == "enable"
                and up.f_globals.get("__name__") == "odc.fsdp"):
            steps.append(f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}")

    sys.setprofile(trace)
    try:
        odc.fsdp.enable(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout=30)
    finally:
        sys.setprofile(None)
    odc.fsdp.disable(model)
    return steps


def tail_group_worker(rank, world, store, comm):
    """Uneven microbatches on a model whose tail is one group of two modules (``build(tail=True)``), torch's clip
    reading the pending gradients (active: max_norm 0.05), AdamW; over FSDP2's gloo collectives or ODC. Returns
    each step's norm and the full parameters."""
    init_pg(rank, world, store)
    model = build(world, tail=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if comm == "odc":
        odc.fsdp.enable(model, opt, timeout=60)
    counts = [(1, 2), (2, 1), (1, 1)]
    norms = []
    for s, plan in enumerate(counts):
        for m in range(plan[rank]):
            (sample_loss(model, data(s, m, rank)) * world / (27 * sum(plan))).backward()
        if comm == "gloo":  # FSDP2 needs the same microbatch count on every rank: pad with a zero loss
            for _ in range(max(plan) - plan[rank]):
                (sample_loss(model, data(s, 0, rank)) * 0.0).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).full_tensor()))
        opt.step()
        opt.zero_grad()
    if comm == "odc":
        odc.fsdp.disable(model)
    return {"norms": norms, "params": full_params(model)}
