"""Workers for test_integrations_verl.py: verl's PPO step on CPU with and without ODC.

Each rank builds verl engines through verl's registry (examples/verl_cpu.py
makes verl run on CPU) and trains the same PPO minibatches: first with
verl's own FSDP2 collectives (verl equalizes microbatch counts), then under
``odc.integrations.verl.enable()`` (LB-Mini moves samples, each rank keeps
its own count), then, with ODC off again, the uneven plan itself on FSDP2's
collectives under a short process-group timeout.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import _baselines_worker
import verl_cpu as V

MAX_TOKENS = 64
# (rank 0's sample lengths, rank 1's, a NaN advantage on rank 0) per minibatch. verl hands each rank as many
# samples; LB-Mini (verl's cost, budget 64) runs {63, 63} on one rank (2 microbatches) and {40, 40, 40, 12} on the
# other (3), where verl raises both to 3. The NaN minibatch's norm is not finite: verl skips the step.
STEPS = [
    ([63, 40, 12], [63, 40, 40], False),
    ([30, 30, 20], [50, 10, 8], True),
    ([40, 40, 40], [20, 63, 12], False),
]
WIDTH = max(x for a, b, _ in STEPS for x in a + b) - V.PROMPT


def batch(step: int, rank: int):
    a, b, nan = STEPS[step]
    lengths = (a, b)[rank]
    return V.ppo_batch(lengths, seed=100 * step + rank, width=WIDTH, global_batch=len(a) + len(b),
                       max_tokens=MAX_TOKENS, nan=nan and rank == 0)


def infer(engine, rank: int) -> dict:
    """verl's forward-only pass (what compute_log_prob runs): per-token log-probs of the first minibatch.

    A sample's last position is left out: verl labels it with the next token of the microbatch's flattened
    row (the next sample's first), so it depends on which samples share the microbatch.
    """
    import numpy as np

    with engine.eval_mode(), V.count_forwards(engine.module) as calls:
        out = engine.infer_batch(batch(0, rank))
    per_sample = [t[:-1].float().numpy() for t in out["model_output"]["log_probs"].unbind()]
    return {"log_probs": np.concatenate(per_sample), "counts": len(calls)}


def train(engine, rank: int, model_dir: str, steps: int = len(STEPS), critic: bool = False) -> dict:
    loss = V.value_loss(MAX_TOKENS) if critic else V.ppo_loss(model_dir, MAX_TOKENS)
    init = {k: v.numpy() for k, v in V.full_params(engine.module).items()}
    forward_only = None if critic else infer(engine, rank)
    norms, counts = [], []
    for step in range(steps):
        with engine.train_mode(), V.count_forwards(engine.module) as calls:
            out = engine.train_batch(batch(step, rank), loss_function=loss)
        norms.append(float(out["metrics"]["grad_norm"]))
        counts.append(len(calls))
    params = {k: v.numpy() for k, v in V.full_params(engine.module).items()}  # by value through the queue
    return {"norms": norms, "counts": counts, "params": params, "init": init, "infer": forward_only}


def reload_and_repeat(engine, rank: int, model_dir: str, ckpt_dir: str) -> list[float]:
    """Saves, trains a step, loads the checkpoint back and trains the same step again: the two norms."""
    loss = V.ppo_loss(model_dir, MAX_TOKENS)
    engine.save_checkpoint(ckpt_dir, global_step=len(STEPS))
    norms = []
    for _ in range(2):
        with engine.train_mode():
            norms.append(float(engine.train_batch(batch(0, rank), loss_function=loss)["metrics"]["grad_norm"]))
        if len(norms) == 1:
            engine.load_checkpoint(ckpt_dir)
    return norms


def outputs_in_order(engine, rank: int, model_dir: str) -> dict:
    """A training step with ``return_model_output=True`` under LB-Mini, which moves samples between the ranks: its
    per-sample log-probs against a forward-only pass over the same batch with the same weights (verl's own order)."""
    from verl.utils import tensordict_utils as tu

    with engine.eval_mode():
        want = engine.infer_batch(batch(0, rank))["model_output"]["log_probs"].unbind()
    data = batch(0, rank)
    tu.assign_non_tensor(data, return_model_output=True)
    with engine.train_mode():
        got = engine.train_batch(data, loss_function=V.ppo_loss(model_dir, MAX_TOKENS))["model_output"]["log_probs"]
    got = got.unbind()
    # A sample's last position is left out, as in infer().
    diff = max(float((g[:-1].float() - w[:-1].float()).abs().max()) for g, w in zip(got, want, strict=True))
    return {"lengths": [len(t) for t in got], "want": [len(t) for t in want], "diff": diff}


def ppo_worker(rank: int, world: int, store, model_dir: str, ckpt_dir: str, hang_timeout: float,
               split_cases=()) -> dict:
    import odc
    import odc.fsdp
    import odc.integrations.verl as odc_verl

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    V.install_cpu_platform()
    out: dict = {"gloo": train(V.build_engine(model_dir, MAX_TOKENS), rank, model_dir)}
    out["gloo_critic"] = train(V.build_engine(model_dir, MAX_TOKENS, model_type="value_model"), rank, model_dir,
                               steps=1, critic=True)
    # verl's default strategy, FSDP1, on its own collectives (before the hook below replaces verl's engines).
    out["fsdp1"] = {"gloo": train(V.build_engine(model_dir, MAX_TOKENS, strategy="fsdp"), rank, model_dir)}

    # As a verl job turns it on: the model config's external_lib, imported before the engine is built.
    hook = "odc.integrations.verl_auto"
    actor = V.build_engine(model_dir, MAX_TOKENS, external_lib=hook)
    ref = V.build_engine(model_dir, MAX_TOKENS, external_lib=hook, forward_only=True)
    out["engine"] = {"actor": odc.fsdp.is_enabled(actor.module), "ref": odc.fsdp.is_enabled(ref.module),
                     "class": type(actor).__name__}
    try:
        V.build_engine(model_dir, MAX_TOKENS, param_offload=True)
        out["refused"] = "built"
    except odc.ConfigError as e:
        out["refused"] = str(e)
    out["odc"] = train(actor, rank, model_dir)
    out["reloaded"] = reload_and_repeat(actor, rank, model_dir, ckpt_dir)
    out["outputs"] = outputs_in_order(actor, rank, model_dir)
    critic = V.build_engine(model_dir, MAX_TOKENS, model_type="value_model", external_lib=hook)
    out["engine"]["critic"] = odc.fsdp.is_enabled(critic.module)
    out["odc_critic"] = train(critic, rank, model_dir, steps=1, critic=True)

    # FSDP1 (strategy="fsdp") on ODC through the same hook: no_sync on all but each rank's last microbatch,
    # FSDP1's clip_grad_norm_.
    fsdp1_actor = V.build_engine(model_dir, MAX_TOKENS, strategy="fsdp", external_lib=hook)
    out["fsdp1"].update(enabled=odc.fsdp.is_enabled(fsdp1_actor.module), cls=type(fsdp1_actor.module).__name__,
                        odc=train(fsdp1_actor, rank, model_dir))

    # compress= through the integration: every gather and push compressed (scope "all": these two ranks share a
    # host), the same PPO minibatches (the NaN one too) on a new FSDP2 actor.
    odc_verl.disable()
    odc_verl.enable(compress={"gather": "fp8", "push": "int8", "scope": "all"})
    packed = V.build_engine(model_dir, MAX_TOKENS)
    out["compressed"] = {"enabled": odc.fsdp.is_enabled(packed.module), "run": train(packed, rank, model_dir)}
    odc_verl.disable()
    odc_verl.enable()

    # odc-bench's verl-maxcount against verl's own split with its data-parallel all-reduces, in this group.
    out["maxcount_split"] = _baselines_worker.synced_split(rank, split_cases)

    # The same uneven plan without ODC: LB-Mini's samples, verl's packing without the count all-reduce.
    from verl.utils import tensordict_utils as tu

    data = odc_verl._balance(batch(0, rank), None, "verl", tu)
    odc_verl.disable()
    engine = V.build_engine(model_dir, MAX_TOKENS)
    from verl.workers.engine.fsdp import transformer_impl as impl

    verl_prepare = impl.prepare_micro_batches

    def uneven(*args, **kwargs):  # same_micro_num_in_dp=False: each rank packs its own count
        return verl_prepare(*args, **{**kwargs, "same_micro_num_in_dp": False})

    dist.barrier()
    # torch 2.14 made the process-group timeout setter public; before it, the private one does the same.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(datetime.timedelta(seconds=hang_timeout))
    t0 = time.monotonic()
    calls: list = []
    try:
        with mock.patch.object(impl, "prepare_micro_batches", uneven), engine.train_mode(), \
                V.count_forwards(engine.module) as calls:
            engine.train_batch(data, loss_function=V.ppo_loss(model_dir, MAX_TOKENS))
        out["without_odc"] = {"outcome": "completed", "seconds": time.monotonic() - t0}
    except Exception as e:
        out["without_odc"] = {"outcome": type(e).__name__, "error": str(e)[:400], "seconds": time.monotonic() - t0,
                              "forwards": len(calls), "stack": [f"{Path(f.filename).name}:{f.name}"
                                                                 for f in traceback.extract_tb(e.__traceback__)]}
    out["pid"] = os.getpid()
    return out

