"""``odc-bench memory``: memory per rank of FSDP2 over gloo and of ODC, full, hybrid and hybrid-zero sharding.

Each rank trains ``odc-bench train``'s model (a Hugging Face Qwen2 from a tiny
config) for a few AdamW minibatches, then measures, in bytes:

- ``params``, ``grads``, ``optimizer state``: the local tensors (torch);
- ``ODC shared memory``: the size of the ``/dev/shm`` segments this rank's
  engine created (published shards in the gather dtype, f32 gradient
  accumulators, landing slots ``2 · G · chunk``, signal words) — read from
  the file system, not computed;
- ``RSS``: the process's peak resident set.

Hybrid and hybrid-zero rows emulate nodes of ``--per-node`` ranks on this
host (ranks are node-major, as torchrun numbers them); ODC then uses shared
memory between the emulated nodes too.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from . import train as _train
from .report import table

__all__ = ["FORMULA_KEYS", "KEYS", "VARIANTS", "formula", "landing_chunk", "memory_rank", "parse_count", "peak_rss",
           "render", "render_formula", "reset_peak_rss", "shm_bytes"]

# The ranks train odc-bench train's model: its fork server preloads the same modules (odc.bench.launch).
RANK_PRELOAD = _train.RANK_PRELOAD

VARIANTS = (
    ("FSDP2 full (gloo)", "collective", "full"),
    ("ODC full", "odc", "full"),
    ("FSDP2 HSDP (gloo)", "collective", "hybrid"),
    ("ODC hybrid", "odc", "hybrid"),
    ("ODC hybrid-zero", "odc", "hybrid-zero"),
)
"""The measured rows, ``(label, comm, sharding)``."""
KEYS = ("params", "grads", "optim", "odc_shm", "rss_peak")
"""The measured columns, per rank: parameters, gradients, optimizer state, ODC's shared memory, peak RSS."""
HEADER = {"params": "params", "grads": "grads", "optim": "optimizer state", "odc_shm": "ODC shared memory",
          "rss_peak": "process RSS (peak)"}


def _bytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return int(t.numel() * t.element_size())


def reset_peak_rss() -> int | None:
    """Starts a new peak of this process's resident set; returns the resident set now, in bytes.

    Freed heap memory goes back to the system first (glibc's ``malloc_trim``), then the kernel's high-water mark
    is reset (``5`` into ``/proc/self/clear_refs``, Linux 4.0 and newer), so that :func:`peak_rss` reads the peak
    of what runs next rather than of the process's life. ``None`` where either is not available.
    """
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, AttributeError):
        return None
    return _status_bytes("VmRSS")


def peak_rss() -> int | None:
    """This process's peak resident set since :func:`reset_peak_rss` (or its start), in bytes (``VmHWM``)."""
    return _status_bytes("VmHWM")


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def shm_bytes(rank: int) -> int:
    """Bytes of the shared-memory segments this process created for rank ``rank`` (its ODC engine's)."""
    return _shm_bytes(rank)


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

    if sharding != "full":
        os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
        os.environ["ODC_TRANSPORT"] = "shm"
    if sharding == "hybrid":
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


# -- the formula -----------------------------------------------------------------------------------

FORMULA_KEYS = ("params", "grads", "optim", "unsharded", "published", "accum", "exact", "cross", "landing")
"""The columns of ``--formula``: FSDP2's tensors, the unsharded parameters and gradients a step holds, then ODC's
published copy, f32 accumulators, exact (deterministic) accumulators, cross-node sums and landing slots."""
FORMULA_HEADER = {"params": "params", "grads": "grads", "optim": "optimizer state",
                  "unsharded": "unsharded params + grads", "published": "ODC published",
                  "accum": "ODC f32 accumulators", "exact": "ODC exact (deterministic)",
                  "cross": "ODC cross-node sums", "landing": "ODC landing slots"}
# Deterministic accumulation: an i128 per f32 accumulator element (odc_kernels::cpu::exact).
EXACT_BYTES = 16


def landing_chunk(chunk: int, group: int, budget: int) -> int:
    """The landing chunk odc-core picks for a shard group of ``group`` ranks: the asked ``chunk`` shrunk so that
    ``2 * group * chunk`` fits ``budget`` (``odc.ConfigError``, a ``ValueError``, when even its floor does not)."""
    from .. import _odc

    return _odc.landing_chunk(chunk, group, budget)


def formula(params: int, world: int, per_node: int, *, param_bytes: int = 4, gather_bytes: int = 4,
            optim_bytes: int = 8, chunk: int = 2 << 20, landing_mb: int = 256,
            deterministic: bool = False, layers: int | None = None) -> list[dict[str, Any]]:
    """Bytes per rank by kind for a model of ``params`` parameters on ``world`` ranks in nodes of ``per_node``.

    FSDP2 keeps the sharded parameters (the optimizer's master copy, ``param_bytes`` each), the sharded gradients
    (as many bytes) and the optimizer state (``optim_bytes`` per parameter: AdamW's two f32 moments).
    ``verl-maxcount`` and ``dummy-pad`` run FSDP2 as it is (ZeRO-3) and keep the same. ``fsdp2-accum`` (FSDP2's
    gradient accumulation, :mod:`odc.bench.baselines`) keeps besides, for the whole minibatch, the unsharded
    parameters of every layer (``gather_bytes`` each) and their unsharded gradients (``param_bytes`` each): the
    ``unsharded`` column. For the other rows that column is the step's working set when ``layers`` (the model's
    decoder layers) is given: two layers' unsharded parameters (the one computing and the one prefetched) and one
    layer's unsharded gradients, else left out with the activations (which every row needs alike). ODC adds the
    published copy of the shard in the gather dtype, the f32 accumulators the owner's daemon adds into, across
    nodes an f32 buffer for the cross-node sum (of the node shard under hybrid, of the rank's 1/D piece under
    hybrid-zero), and the landing slots ``2 * group * chunk`` (the chunk shrunk to fit ``ODC_LANDING_MB``).
    With ``deterministic`` (``odc.fsdp.enable(..., deterministic=True)``) the daemon also keeps an exact
    fixed-point accumulator, 16 bytes per accumulator element, in private memory.
    Shards are ``params / group`` (FSDP2's padding and ODC's signal words, a few KiB, are left out). Shared memory
    (``odc_shm``) holds the published copy and the landing slots, and across nodes the accumulators too (the other
    nodes read them). Under hybrid-zero FSDP2 shards D ways and ODC keeps the node shard (``docs/hybrid-zero.md``).
    """
    if world < 1 or per_node < 1 or world % per_node:
        raise ValueError(f"world {world} must be a positive multiple of per_node {per_node}")
    budget = landing_mb << 20

    working = (2 * gather_bytes + param_bytes) * params / layers if layers else None

    def row(label: str, comm: str, group: int, fsdp_group: int, cross: float, clients: int,
            unsharded: float | None = working) -> dict[str, Any]:
        shard = params / group
        piece = params / fsdp_group
        r: dict[str, Any] = {"label": label, "comm": comm, "group": group,
                             "params": piece * param_bytes, "grads": piece * param_bytes,
                             "optim": piece * optim_bytes, "unsharded": unsharded}
        odc = comm == "odc"
        r["published"] = shard * gather_bytes if odc else None
        r["accum"] = shard * 4 if odc else None
        r["exact"] = shard * EXACT_BYTES if odc and deterministic else None
        r["cross"] = cross * 4 if odc else None
        r["landing"] = 2 * clients * landing_chunk(chunk, clients, budget) if odc else None
        r["odc_shm"] = r["published"] + (r["accum"] if cross else 0) + r["landing"] if odc else None
        r["total"] = sum(v for k, v in r.items() if k in FORMULA_KEYS and v is not None)
        return r

    g, nodes = per_node, world // per_node
    return [
        row("FSDP2 full", "collective", world, world, 0, world),
        row("ODC full", "odc", world, world, 0, world),
        row("verl-maxcount", "collective", world, world, 0, world),
        row("dummy-pad", "collective", world, world, 0, world),
        row("fsdp2-accum", "collective", world, world, 0, world, unsharded=(gather_bytes + param_bytes) * params),
        row("FSDP2 HSDP", "collective", g, g, 0, g),
        row("ODC hybrid", "odc", g, g, params / g if nodes > 1 else 0, g),
        # FSDP2 shards D ways (pieces of node shards); ODC keeps the node shard's working copy and accumulator and
        # a piece buffer for the cross-node sum; the pieces move by one-sided reads, through no landing slot.
        row("ODC hybrid-zero", "odc", g, world, params / world if nodes > 1 else 0, g),
    ]


def parse_count(text: str) -> int:
    """A parameter count: ``7B``, ``1.5M``, ``32e9`` or a plain integer."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        n = float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r}: a parameter count like 7B, 1.5M, 32e9 or 123456") from None
    if not n >= 1 or n != n:
        raise ValueError(f"{text!r}: the parameter count must be at least 1")
    return int(n)


def _size(v: float | None) -> str:
    if v is None:
        return "–"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= div:
            return f"{v / div:,.2f} {unit}"
    return f"{v:,.0f} B"


def render_formula(rows: list[dict[str, Any]], title: list[str], markdown: bool = False) -> str:
    """The formula's table: one row per mode, bytes per rank by kind and the total."""
    header = ["per rank", *[FORMULA_HEADER[k] for k in FORMULA_KEYS], "total"]
    body = [[r["label"], *[_size(r[k]) for k in FORMULA_KEYS], _size(r["total"])] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    return table(header, body, [58, 11, 11, 15, 24, 13, 20, 25, 19, 17, 11], title)
