"""Workers for test_integrations_verl_weights.py: verl's checkpoint engines between an FSDP2 actor and a rollout.

One ``run_ranks`` launch: ranks ``< ACTORS`` are verl's FSDP2 actor (its own engine, built through verl's registry
on CPU, examples/verl_cpu.py) in a gloo group of their own; the last rank is a rollout process that never joins it
and holds one rollout worker per dtype of ``ROLLOUTS`` (an unsharded Hugging Face model each, transformers'
``generate`` standing in for the inference engine). Each round the actor trains a PPO step, then both sides drive
the checkpoint engines as verl's ``CheckpointEngineManager.update_weights`` does (``prepare`` everywhere,
``build_topology`` once, ``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``), the
metadata travelling through the shared store. In the same round the actor hands verl's ``naive`` engine verl's
full-tensor generator (``get_per_tensor_param``), and rank 0 saves what it yields for the rollout to compare.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import verl_cpu as V

ACTORS = 2
ROLLOUTS = ("bfloat16", "float32")  # one rollout worker (one odc engine, one model) per dtype
ROUNDS = 2
MAX_TOKENS = 64
NAME = "policy"
NEW_TOKENS = 16
# Enough elements that the transfer times mean something (about 1.7 M parameters, 6.6 MB in f32).
MODEL = {"layers": 2, "hidden": 256, "vocab": 2048}
WAIT = 300.0
TIMEOUT = 60.0  # the engines' own deadline (engine_kwargs timeout): a version never published fails in a minute


def _wait(store, key: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if store.check(["t/failed"]):
            raise RuntimeError(f"waiting for test key {key}: {store.get('t/failed').decode()} failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"test key {key} not set in {timeout} s")
        time.sleep(0.005)


def _topology(store, g: int, mine: dict[int, dict]) -> tuple[dict, dict]:
    """Every worker's ``prepare`` metadata through the store (worker index: actor ranks, then rollout workers);
    ``build_topology`` on all of it, as the manager runs it."""
    from odc.integrations._verl_weights import OdcCheckpointEngine

    for i, meta in mine.items():
        store.set(f"t/{g}/meta/{i}", json.dumps(meta))
    metas = []
    for i in range(ACTORS + len(ROLLOUTS)):
        _wait(store, f"t/{g}/meta/{i}")
        metas.append(json.loads(store.get(f"t/{g}/meta/{i}")))
    return OdcCheckpointEngine.build_topology(ACTORS, len(ROLLOUTS), metas)


def _register() -> None:
    """What verl's workers do with ``checkpoint_engine.custom_backend_module`` before they make the engine (they have
    ``verl.checkpoint_engine`` loaded): import it; importing odc.integrations.verl registers ``odc``."""
    import verl.checkpoint_engine  # noqa: F401
    from verl.utils.import_utils import import_external_libs

    import_external_libs("odc.integrations.verl")


def _batch(g: int, rank: int):
    lengths = ([40, 30, 12], [50, 20, 25])[rank]
    return V.ppo_batch(lengths, seed=100 * g + rank, width=50 - V.PROMPT, global_batch=6, max_tokens=MAX_TOKENS)


def actor(rank: int, world: int, store, *, model_dir: str, out_dir: str, odc_training: bool = False,
          strategy: str = "fsdp2") -> dict:
    from torch.distributed.tensor import DTensor

    import odc.fsdp

    _register()
    dist.init_process_group("gloo", store=dist.PrefixStore("actor", store), rank=rank, world_size=ACTORS)
    V.install_cpu_platform()
    from verl.checkpoint_engine import CheckpointEngineRegistry

    # odc_training: the actor trains on ODC too (verl's external_lib hook), the checkpoint engine unchanged.
    engine = V.build_engine(model_dir, MAX_TOKENS, strategy=strategy,
                            external_lib="odc.integrations.verl_auto" if odc_training else None)
    loss = V.ppo_loss(model_dir, MAX_TOKENS)
    # As verl's ActorRolloutRefWorker.init_model makes its checkpoint engine.
    odc_ce = CheckpointEngineRegistry.new("odc", is_master=rank == 0, bucket_size=1 << 20, name=NAME,
                                         timeout=TIMEOUT)
    naive = CheckpointEngineRegistry.new("naive", is_master=rank == 0, bucket_size=1 << 20)

    # Gathers: full_tensor() calls (each all-gathers one parameter) and all_gather / all_gather_into_tensor calls
    # (FSDP1's state_dict() unshards each unit with one: all_gather for CPU parameters).
    gathers = [0]
    originals = {(DTensor, "full_tensor"): DTensor.full_tensor, (dist, "all_gather"): dist.all_gather,
                 (dist, "all_gather_into_tensor"): dist.all_gather_into_tensor}

    def counting(fn):
        def counted(*a, **k):
            gathers[0] += 1
            return fn(*a, **k)

        return counted

    for (owner, attr), fn in originals.items():
        setattr(owner, attr, counting(fn))
    rounds = []
    for g in range(1, ROUNDS + 1):
        with engine.train_mode():
            engine.train_batch(_batch(g, rank), loss_function=loss)
        actor_kw, _ = _topology(store, g, {rank: odc_ce.prepare()})
        odc_ce.init_process_group(**{k: v[rank] for k, v in actor_kw.items()})
        # ActorRolloutRefWorker.update_weights: the engine's generator to the checkpoint engine.
        before = gathers[0]
        t0 = time.perf_counter()
        weights, _ = engine.get_per_tensor_param()
        metrics = asyncio.run(odc_ce.send_weights(weights, global_steps=g))
        send_s = time.perf_counter() - t0
        odc_gathers = gathers[0] - before
        # verl's naive engine on the same weights: the full tensors, gathered as its consumer iterates them.
        before = gathers[0]
        t0 = time.perf_counter()
        weights, _ = engine.get_per_tensor_param()
        naive.send_weights(weights, global_steps=g)
        full = list(naive.receive_weights(global_steps=g))  # full_tensor() made each tensor anew
        naive_s = time.perf_counter() - t0
        naive_gathers = gathers[0] - before
        t0 = time.perf_counter()
        _ = [t.to(torch.bfloat16) for _, t in full]
        cast_s = time.perf_counter() - t0
        if rank == 0:
            torch.save(full, f"{out_dir}/naive{g}.pt")
            store.set(f"t/{g}/naive", "1")
        odc_ce.finalize()
        for i in range(len(ROLLOUTS)):  # the manager returns when every worker has
            _wait(store, f"t/{g}/done{i}")
        rounds.append({"metrics": metrics, "send_s": send_s, "odc_gathers": odc_gathers, "naive_s": naive_s,
                       "naive_cast_s": cast_s, "naive_gathers": naive_gathers, "params": len(full)})
    for (owner, attr), fn in originals.items():
        setattr(owner, attr, fn)

    refused = {}
    try:
        asyncio.run(odc_ce.send_weights(iter([("w", torch.zeros(2))]), global_steps=ROUNDS + 1))
    except Exception as e:
        refused["foreign"] = f"{type(e).__name__}: {e}"
    # A parameter whose storage is replaced after it was served (what an offload or a reload does).
    if strategy == "fsdp":
        fp = engine.module._handle.flat_param  # the root unit's
        fp._local_shard = fp._local_shard.clone()
    else:
        p = next(engine.module.parameters())
        p._local_tensor = p._local_tensor.clone()
    weights, _ = engine.get_per_tensor_param()
    try:
        asyncio.run(odc_ce.send_weights(weights, global_steps=ROUNDS + 1))
    except Exception as e:
        refused["moved"] = f"{type(e).__name__}: {e}"
    return {"rounds": rounds, "refused": refused, "version": odc_ce.server.version,
            "odc_training": odc.fsdp.is_enabled(engine.module),
            "memory_bytes": odc_ce.server.memory_bytes}


async def _collect(stream) -> list:
    return [(n, t) async for n, t in stream]


def _generate(model, prompts: torch.Tensor) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:].tolist()


def rollout(rank: int, world: int, store, *, model_dir: str, out_dir: str, odc_training: bool = False,
            workers: tuple[int, ...] = tuple(range(len(ROLLOUTS))), strategy: str = "fsdp2") -> dict:
    """The rollout workers ``workers`` (indices into ``ROLLOUTS``) in this process."""
    from transformers import Qwen2ForCausalLM

    import odc
    from odc.integrations import _verl_weights

    _register()
    from verl.checkpoint_engine import CheckpointEngineRegistry

    # As verl's CheckpointEngineWorker makes it (no is_master), one per rollout worker.
    engines = [CheckpointEngineRegistry.new("odc", bucket_size=1 << 20, name=NAME, rollout_dtype=ROLLOUTS[i],
                                           timeout=TIMEOUT) for i in workers]
    dtypes = [getattr(torch, ROLLOUTS[i]) for i in workers]
    models = {(dt, kind): Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=dt, attn_implementation="sdpa")
              for dt in dtypes for kind in ("odc", "naive")}
    prompts = torch.randint(1, V.VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
    initial = {str(dt): _generate(models[(dt, "odc")], prompts) for dt in dtypes}
    rounds, previous = [], None
    for g in range(1, ROUNDS + 1):
        _, rollout_kw = _topology(store, g, {ACTORS + i: e.prepare() for i, e in zip(workers, engines, strict=True)})
        for i, e in zip(workers, engines, strict=True):
            e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})
        got, seconds = {}, {}
        for dt, e in zip(dtypes, engines, strict=True):
            t0 = time.perf_counter()
            got[dt] = asyncio.run(_collect(e.receive_weights(global_steps=g)))
            seconds[str(dt)] = time.perf_counter() - t0
        _wait(store, f"t/{g}/naive")
        full = torch.load(f"{out_dir}/naive{g}.pt")
        record: dict = {"seconds": seconds, "read": {str(dt): dict(e.last_read) for dt, e in
                                                     zip(dtypes, engines, strict=True)}}
        for dt in dtypes:
            mine = got[dt]
            mismatched = [n for (n, t), (_, want) in zip(mine, full, strict=True)
                          if t.dtype != dt or not torch.equal(t, want.to(dt))]
            models[(dt, "odc")].load_state_dict(dict(mine), strict=True)
            models[(dt, "naive")].load_state_dict(dict(full), strict=True)
            record[str(dt)] = {
                "names": [n for n, _ in mine] == [n for n, _ in full], "count": len(mine), "mismatched": mismatched,
                "odc_tokens": _generate(models[(dt, "odc")], prompts),
                "naive_tokens": _generate(models[(dt, "naive")], prompts)}
        if previous is not None:  # training moved the weights between versions: an older one cannot pass
            record["moved"] = max(float((t - p).abs().max()) for (_, t), (_, p) in zip(full, previous, strict=True))
        previous = full
        for e in engines:
            e.finalize()
        for i in workers:
            store.set(f"t/{g}/done{i}", "1")
        rounds.append(record)

    refused: dict = {}
    if workers[0] != 0:
        return {"rounds": rounds, "initial": initial, "refused": refused}
    metas = [{"node": "a/1", "store": "127.0.0.1:1", "name": NAME, "published": 3} for _ in range(ACTORS)]
    try:  # a rollout worker on another node cannot reach a store on a loopback address
        _verl_weights.OdcCheckpointEngine.build_topology(ACTORS, 1, [*metas, {**metas[0], "node": "b/2"}])
    except odc.ConfigError as e:
        refused["loopback"] = str(e)
    metas = [{**m, "store": "10.1.2.3:1", "fabric": r == 0, "fabric_error": "no address"}
             for r, m in enumerate(metas)]
    try:  # ... nor read an actor rank that serves its own node only
        _verl_weights.OdcCheckpointEngine.build_topology(ACTORS, 1, [*metas, {**metas[0], "node": "b/2"}])
    except odc.ConfigError as e:
        refused["fabric"] = str(e)
    fake = types.SimpleNamespace(module=types.SimpleNamespace(peft_config={}), _qat_enabled=True,
                                 _is_offload_param=True)
    try:
        _verl_weights.check_actor(fake)
    except odc.ConfigError as e:
        refused["settings"] = str(e)
    try:
        CheckpointEngineRegistry.new("odc", bucket_size=1, rollout_dtype="int8")
    except odc.ConfigError as e:
        refused["dtype"] = str(e)
    return {"rounds": rounds, "initial": initial, "refused": refused}


def worker(rank: int, world: int, store, *, split: bool = False, **kw) -> dict:
    """Ranks ``< ACTORS``: the actor; then the rollout process (``split``: one per rollout worker)."""
    try:
        if rank < ACTORS:
            return actor(rank, world, store, **kw)
        return rollout(rank, world, store, workers=(rank - ACTORS,) if split else tuple(range(len(ROLLOUTS))), **kw)
    except BaseException:
        store.set("t/failed", f"rank {rank}")  # the others stop waiting for it
        raise


def across(ctx, **kw) -> dict:
    """``_multihost_worker`` scenario: the actor's ranks on the first (emulated) host, one rollout worker per rank on
    the second."""
    return worker(ctx.rank, ctx.world, ctx.store, split=True, **kw)
