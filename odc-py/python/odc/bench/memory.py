"""``odc-bench memory``: memory per rank of FSDP2 over gloo and of ODC, full and hybrid sharding.

Each rank trains ``odc-bench train``'s model (a Hugging Face Qwen2 from a tiny
config) for a few AdamW minibatches, then measures, in bytes:

- ``params``, ``grads``, ``optimizer state``: the local tensors (torch);
- ``ODC shared memory``: the size of the ``/dev/shm`` segments this rank's
  engine created (published shards in the gather dtype, f32 gradient
  accumulators, landing slots ``2 · G · chunk``, signal words) — read from
  the file system, not computed;
- ``RSS``: the process's peak resident set.

Hybrid rows emulate nodes of ``--per-node`` ranks on this host (ranks are
node-major, as torchrun numbers them); ODC then uses shared memory between
the emulated nodes too.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from .report import table

__all__ = ["KEYS", "VARIANTS", "memory_rank", "render"]

# (label, comm, sharding)
VARIANTS = (
    ("FSDP2 full (gloo)", "collective", "full"),
    ("ODC full", "odc", "full"),
    ("FSDP2 HSDP (gloo)", "collective", "hybrid"),
    ("ODC hybrid", "odc", "hybrid"),
)
KEYS = ("params", "grads", "optim", "odc_shm", "rss_peak")
HEADER = {"params": "params", "grads": "grads", "optim": "optimizer state", "odc_shm": "ODC shared memory",
          "rss_peak": "process RSS (peak)"}


def _bytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return int(t.numel() * t.element_size())


def _shm_bytes(rank: int) -> int:
    """Bytes of the shared-memory segments this process created for rank ``rank``."""
    mark = f"-r{rank}-l{os.getpid()}-"
    total = 0
    for name in os.listdir("/dev/shm"):
        if mark in name:
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_size
            except FileNotFoundError:
                continue
    return total


def memory_rank(ctx: Any, *, spec: dict[str, Any], comm: str, sharding: str, per_node: int, steps: int, micros: int,
                length: int, timeout: float) -> list[dict[str, Any]]:
    """One rank of one variant: trains ``steps`` minibatches of ``micros`` rows; every rank's bytes by kind."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import odc.fsdp

    from .train import ModelSpec, _loss, build_model, markov_tokens, packed_row

    if sharding == "hybrid":
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        os.environ["ODC_TRANSPORT"] = "shm"
        mesh = init_device_mesh("cpu", (ctx.world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ctx.world,))
    spec_ = ModelSpec(**spec)
    model = build_model(spec_)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if comm == "odc":
        odc.fsdp.enable(model, opt, sharding=sharding, timeout=timeout)
    grads = 0
    for s in range(steps):
        for m in range(micros):
            index = (s * micros + m) * ctx.world + ctx.rank
            row = packed_row([markov_tokens(index, length, spec_.vocab)])
            (_loss(model, row) / length).backward()
        opt.step()
        grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.zero_grad()
    out = {
        "params": sum(_bytes(p) for p in model.parameters()),
        "grads": grads,
        "optim": sum(_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
        "odc_shm": _shm_bytes(ctx.rank) if comm == "odc" else None,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if comm == "odc":
        odc.fsdp.disable(model)
    per_rank: list[dict[str, Any]] = ctx.all_gather_object(out)
    return per_rank


def _cell(key: str, v: int | None) -> str:
    if v is None:
        return "–"
    if key == "rss_peak":
        return f"{v / 2**20:,.0f} MiB"
    return f"{v / 2**20:,.2f} MiB" if v >= 2**20 else f"{v / 2**10:,.0f} KiB"


def render(rows: list[dict[str, Any]], title: list[str], markdown: bool = False) -> str:
    """The table: one row per variant, the largest value over ranks per column."""
    header = ["per rank (max over ranks)", *[HEADER[k] for k in KEYS]]
    body = [[r["label"], *[_cell(k, r["max"][k]) for k in KEYS]] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in body]
        return "\n".join(lines)
    return table(header, body, [25, 10, 10, 15, 17, 18], title)
