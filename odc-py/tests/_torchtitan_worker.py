"""Workers for test_integrations_torchtitan.py: torchtitan's trainer on CPU with FSDP2's collectives and with ODC.

examples/torchtitan_cpu.py makes torchtitan 0.3.0 run on CPU (its shims are installed before torchtitan is
imported) and writes a tokenizer and a c4-shaped dataset. Every trainer here trains the llama3 debug model
(two blocks, sequence length 128) for two steps.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torchtitan_cpu as T

SEQ_LEN = 128


def documents(n: int = 16, seed: int = 3) -> list[list[int]]:
    """Token ids of ``n`` documents (lognormal lengths, at most 128 tokens).

    LB-Mini gives rank 0 three rows and rank 1 two in both minibatches; LB-Micro two, then three, to both.
    """
    rng = random.Random(seed)
    lengths = [max(2, min(126, int(rng.lognormvariate(3.8, 0.8)))) for _ in range(n)]
    return [[1] + [rng.randrange(3, 400) for _ in range(k)] + [2] for k in lengths]


def train(cls, config, **kw) -> dict:
    """Runs ``trainer.train()``; returns the logged (loss, grad norm) per step and each step's microbatch count."""
    import odc.fsdp

    trainer = cls(config, **kw)
    logged, counts = [], []
    log, step = trainer.metrics_processor.log, trainer.train_step

    def log_step(s, loss, max_loss, grad_norm, **k):
        logged.append((loss, grad_norm))
        return log(s, loss, max_loss, grad_norm, **k)

    def train_step(it):
        out = step(it)
        counts.append(trainer.gradient_accumulation_steps)
        return out

    trainer.metrics_processor.log, trainer.train_step = log_step, train_step
    trainer.train()
    return {"logged": logged, "counts": counts, "odc": odc.fsdp.is_enabled(trainer.model_parts[0])}


def _setup(rank: int, world: int, store, root: str, spmd_backend: str):
    T.install()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    assets, data = os.path.join(root, "tokenizer"), os.path.join(root, "c4_test")

    def config(**kw):
        return T.debug_config(assets, data, seq_len=SEQ_LEN, dump=os.path.join(root, f"dump{rank}"),
                              spmd_backend=spmd_backend, **kw)

    return config


def default_worker(rank: int, world: int, store, root: str, comm: str) -> dict:
    """torchtitan's own trainer (``comm="gloo"``) or ODC's, on its c4-shaped data and default SPMD backend."""
    config = _setup(rank, world, store, root, "spmd_types")
    if comm == "gloo":
        from torchtitan.trainer import Trainer
    else:
        from odc.integrations.torchtitan import Trainer
    return train(Trainer, config())


def planned_worker(rank: int, world: int, store, root: str) -> dict:
    """The same documents under LB-Micro over gloo and LB-Mini over ODC, in one process (partial_dtensor)."""
    config = _setup(rank, world, store, root, "partial_dtensor")
    import odc
    import odc.integrations.torchtitan as odc_titan

    out = {}
    docs = documents()
    mini = odc_titan.plan_documents(docs, world, 4, SEQ_LEN, strategy="lb-mini")
    micro = odc_titan.plan_documents(docs, world, 4, SEQ_LEN, strategy="lb-micro")
    out["lb_micro_gloo"] = train(odc_titan.Trainer, config(), plan=micro, documents=docs, odc=False)
    out["lb_mini_odc"] = train(odc_titan.Trainer, config(), plan=mini, documents=docs)
    # One host: only scope "all" compresses anything (every push, every read of the other rank's shard).
    out["lb_mini_odc_compressed"] = train(odc_titan.Trainer, config(), plan=mini, documents=docs,
                                          compress={"gather": "fp8", "push": "int8", "scope": "all"})
    try:
        odc_titan.Trainer(config(), compress={"push": "int4"})
        out["bad_compress"] = "built"
    except odc.ConfigError as e:
        out["bad_compress"] = str(e)
    bad = config()
    bad.parallelism.tensor_parallel_degree, bad.parallelism.data_parallel_shard_degree = 2, 1
    try:
        odc_titan.Trainer(bad)
        out["refused"] = "built"
    except odc.ConfigError as e:
        out["refused"] = str(e)
    return out
