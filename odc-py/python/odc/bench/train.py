"""``odc-bench train``: real FSDP2 training of a Hugging Face transformer on packed variable-length microbatches.

The workload (rank side): a causal LM from a tiny config (Qwen2 by default,
random weights), ``fully_shard`` per decoder layer and the root, AdamW,
torch's ``clip_grad_norm_`` before every step. Each microbatch is one packed
row: its samples back to back, ``position_ids`` restarting per sample and
**varlen attention** (:func:`varlen_attention`: every sample attends only to
itself, causal ``scaled_dot_product_attention`` per sample, what
flash-attention's varlen kernels compute on GPUs), so a microbatch costs the
sum of its samples' costs. Compute is real; one thread per rank.

Every configuration (collective = FSDP2's own gloo collectives, odc =
``odc.fsdp.enable``) trains the same model from the same initial weights on
the same global minibatches; only the packing differs, so every run computes
the same gradients up to the order of float sums. Three configurations are
what a user runs without ODC (:mod:`odc.bench.baselines`): ``verl-maxcount``
(verl's split of every rank's samples into the largest count, over gloo),
``dummy-pad`` (LB-Mini's plan, zero-loss padding microbatches up to the
largest count, over gloo) and ``fsdp2-accum`` (LB-Mini's plan under FSDP2's
own gradient accumulation: parameters and gradients unsharded for the whole
minibatch, one all-gather and one reduce-scatter per group). Each run also
records its memory: the process's peak resident set (CPU: no allocator
figures) and the bytes of parameters and gradients FSDP holds between
microbatches, read from the tensors. ``odc+lb-mini+steal``
(on request) runs LB-Mini's plan through :func:`odc.fsdp.microbatches`: a
rank that runs out of its own microbatches takes unstarted ones of the rank
with the most predicted seconds left, losses scaled by the minibatch's
tokens as before, so its final parameters match ``odc+lb-mini``'s up to the
order of float sums. Real compute on one host is fairly even; a straggler
(``--straggler RANK:FACTOR``: that rank sleeps ``FACTOR - 1`` times the CPU
time of every microbatch it runs) makes ranks run out at different times.
The compressed configurations (:data:`COMPRESSED`, on request and in
``--curves``) run LB-Mini's plan on ODC with block-scaled chunks on every
push (``compress={..., "scope": "all"}``: one host has no cross-node
traffic to compress), so their loss curves show what the formats round away.

The prediction is not built from the measurement: before any training, every
rank times forward + backward of single samples on an unsharded copy of the
model (:func:`odc.packing.time_samples`, all ranks at once, as they compute
during training), the pooled timings are fitted by
:func:`odc.packing.fit_cost`, and the planner predicts each plan's bubble with
that cost model. Then, still before the runs, each way of running
(collectives, ODC, FSDP2's accumulation) trains minibatches of 1 and of 4
microbatches of one short sample, which :func:`odc.packing.fit_cost` turns
into its fixed costs per microbatch and per minibatch; LB-Micro and LB-Mini
plan with them (fewer, fuller microbatches where that wins) and the second
prediction (``+fixed``) counts them.

Samples are token sequences of a fixed random first-order Markov chain (four
likely successors per token), so the loss has something to learn: it falls
from ``ln(vocab)`` towards the chain's entropy (about ``ln 4``).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import baselines

# The imbalance benchmark's configurations (name, mode, strategy); the first is the baseline.
from .imbalance import BASELINE, STEAL, EmulatedCompute, steal_bound
from .imbalance import CONFIGS as _IMBALANCE_CONFIGS

# What the ranks import lazily, imported once by the fork server they start from (odc.bench.launch):
# fully_shard imports torch._dynamo on first use.
RANK_PRELOAD = ["torch.distributed.fsdp", "torch._dynamo", "transformers.models.qwen2.modeling_qwen2"]

if TYPE_CHECKING:
    from odc.packing import CostFit

__all__ = ["BASELINE", "COMPRESSED", "CONFIGS", "DEFAULT_CONFIGS", "DET", "STEAL", "ModelSpec", "build_model",
           "fit_lengths", "markov_tokens", "packed_row", "plan_mode", "predict_span", "same_plan", "steals",
           "train_rank", "varlen_attention"]

VARLEN = "odc_bench_varlen"
DET = "+det"
"""The suffix of an ODC configuration with deterministic accumulation (``odc.fsdp.enable(..., deterministic=True)``),
run on request."""
COMPRESSED: dict[str, dict[str, Any]] = {
    "odc+lb-mini+int8": {"push": "int8", "scope": "all"},
    "odc+lb-mini+int8-nofb": {"push": "int8", "feedback": False, "scope": "all"},
    "odc+lb-mini+fp8g-int8": {"gather": "fp8", "push": "int8", "scope": "all"},
}
"""ODC configurations with compressed chunks: LB-Mini's plan under ``odc.fsdp.enable(..., compress=...)``, every
push (and gather) compressed (``"scope": "all"``: on one host nothing crosses nodes), int8 pushes with one f32 scale
per 32 elements, with error feedback (the default) or without it (``-nofb``), and fp8 gathers (``fp8g``); run on
request and by ``--curves``."""
CONFIGS = (_IMBALANCE_CONFIGS
           + tuple((name + DET, mode, strategy) for name, mode, strategy in _IMBALANCE_CONFIGS if mode == "odc")
           + tuple((name, "odc", "lb-mini") for name in COMPRESSED))
"""Every configuration ``odc-bench train`` can run, ``(name, mode, strategy)``: ``odc-bench imbalance``'s, their
deterministic twins and the compressed ones."""


def steals(name: str) -> bool:
    """Whether configuration ``name`` runs its plan through work stealing."""
    return name.removesuffix(DET).endswith(STEAL)

DEFAULT_CONFIGS = tuple(c[0] for c in CONFIGS if not steals(c[0]) and not c[0].endswith(DET) and c[0] not in COMPRESSED)
"""What runs without ``--configs``: every configuration but stealing, deterministic accumulation and compression."""
# The run each configuration's final parameters are compared with: a stealing configuration's, the same one without
# stealing (the same plan, microbatches run by whichever rank claims them); otherwise the collective run with the
# same plan (same samples in the same microbatches), else the baseline (same samples per minibatch, packed
# differently). A compressed configuration's is the same plan uncompressed (odc+lb-mini).
SAME_PLAN = {name: ("odc+lb-mini" if name in COMPRESSED
                    else name.removesuffix(DET) if name.endswith(DET)
                    else name.removesuffix(STEAL) if name.endswith(STEAL)
                    else f"collective+{strategy}" if any(c[0] == f"collective+{strategy}" for c in CONFIGS)
                    else BASELINE)
             for name, _, strategy in CONFIGS}


def same_plan(name: str, configs: Sequence[str]) -> str:
    """The configuration among ``configs`` whose final parameters ``name``'s are checked against: ``SAME_PLAN``;
    when that one does not run, its own reference; else the baseline (which always runs)."""
    ref = SAME_PLAN[name]
    if ref not in configs:
        ref = SAME_PLAN[ref] if SAME_PLAN[ref] in configs else BASELINE
    return ref


@dataclass(frozen=True)
class ModelSpec:
    """A Qwen2-style decoder from a tiny config (random weights), or any local config (``path``)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 352
    vocab: int = 512
    path: str = ""

    def describe(self) -> str:
        """The model in one line, for reports."""
        if self.path:
            return f"config {self.path}"
        return (f"Qwen2 hidden {self.hidden}, {self.layers} layers, {self.heads} heads ({self.kv_heads} kv), "
                f"MLP {self.intermediate}, vocab {self.vocab}")


def varlen_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                     dropout: float = 0.0, cu_seq_lens_q: Any = None, position_ids: Any = None,
                     **_: Any) -> tuple[Any, None]:
    """Per-sample causal attention over one packed row.

    Sample boundaries come from ``cu_seq_lens_q`` (cumulative lengths, the
    argument flash-attention's varlen kernels take), else from where
    ``position_ids`` restart at 0. Registered with transformers'
    ``AttentionInterface`` by :func:`build_model`.
    """
    import torch
    import torch.nn.functional as F

    if cu_seq_lens_q is not None:
        bounds = [int(x) for x in cu_seq_lens_q]
    else:
        bounds = [*(position_ids.view(-1) == 0).nonzero().view(-1).tolist(), query.shape[2]]
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                           scale=scaling, enable_gqa=True)
            for a, b in itertools.pairwise(bounds)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def build_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The causal LM of ``spec`` with varlen attention, weights drawn from ``seed`` (every rank alike)."""
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, Qwen2Config

    if spec.path:
        cfg = AutoConfig.from_pretrained(spec.path)
    else:
        cfg = Qwen2Config(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                          num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                          num_key_value_heads=spec.kv_heads, tie_word_embeddings=True,
                          max_position_embeddings=1 << 17)
    cfg.use_cache = False
    AttentionInterface.register(VARLEN, varlen_attention)
    cfg._attn_implementation = VARLEN
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]  # unannotated in transformers


def markov_tokens(index: int, length: int, vocab: int, seed: int = 0) -> Any:
    """Tokens of sample ``index``: a walk on a fixed random chain with 4 likely successors per token."""
    import torch

    table = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + index + 1)
    picks = torch.randint(0, 4, (length,), generator=g).tolist()
    tok = int(torch.randint(0, vocab, (1,), generator=g))
    out = []
    rows = table.tolist()
    for p in picks:
        out.append(tok)
        tok = rows[tok][p]
    return torch.tensor(out, dtype=torch.long)


def packed_row(samples: Sequence[Any]) -> dict[str, Any]:
    """Model inputs of one packed row, with ``labels`` (a sample's first token has none)."""
    import torch

    lengths = [len(s) for s in samples]
    bounds = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return {
        "input_ids": torch.cat(list(samples))[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "labels": torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in samples])[None],
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def fit_lengths(lengths: Sequence[int], points: int = 7) -> list[int]:
    """Lengths to time for the cost fit: geometric from the 5th percentile to the longest sample."""
    s = sorted(lengths)
    lo, hi = max(8, s[len(s) // 20]), s[-1]
    if hi <= lo:
        return sorted({max(2, hi // 2), hi})
    return sorted({round(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)})


# -- rank side ---------------------------------------------------------------------------------------


def _loss(model: Any, row: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    inputs = {k: v for k, v in row.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits[0, :-1].float(), row["labels"][0, 1:], ignore_index=-100, reduction="sum")


def _time_fit(ctx: Any, spec: ModelSpec, lengths: list[int], repeats: int) -> Any:
    """Times single samples on an unsharded copy on every rank at once; returns the pooled fit."""
    from odc import packing

    model = build_model(spec, seed=1)
    row_of = {s: packed_row([markov_tokens(10_000_000 + s, s, spec.vocab or _vocab(model))]) for s in lengths}

    def step(s: int) -> None:
        _loss(model, row_of[s]).backward()
        model.zero_grad(set_to_none=True)

    ctx.barrier()
    pairs = packing.time_samples(step, lengths, repeats=repeats, warmup=1)
    pooled = [p for rank_pairs in ctx.all_gather_object(pairs) for p in rank_pairs]
    return packing.fit_cost(pooled), pooled


def _seconds(fit: CostFit, lengths: Sequence[int], mb: Sequence[int]) -> float:
    """The fitted seconds of microbatch ``mb``."""
    return sum(fit.seconds(lengths[i]) for i in mb)


def _vocab(model: Any) -> int:
    return int(model.config.vocab_size)


def _run(ctx: Any, spec: ModelSpec, mode: str, minibatches: list[list[list[int]]], samples: list[Any],
         tokens: list[int], lr: float, clip: float, timeout: float, record: bool, *,
         lists: Sequence[Sequence[Sequence[Sequence[int]]]] | None = None,
         cost: Callable[[Sequence[int]], float] | None = None, slow: float = 1.0,
         deterministic: bool = False, pad_to: Sequence[int] | None = None,
         compress: dict[str, Any] | None = None) -> dict[str, Any]:
    """One training run of ``minibatches`` (this rank's microbatches per minibatch); timed from a barrier.

    ``mode``: ``collective`` (FSDP2's gloo collectives, every rank the same
    count), ``odc`` (``odc.fsdp.enable``), ``pad`` (collectives; after its own
    microbatches a rank runs zero-loss dummy microbatches up to ``pad_to[k]``,
    the largest count of minibatch ``k``) or ``accum`` (FSDP2's gradient
    accumulation: ``reshard_after_forward=False``, no gradient sync and no
    reshard after backward but at the rank's last microbatch; a rank without
    microbatches runs one dummy). Stealing (``lists``, ODC only): every rank's
    microbatches per minibatch (``plan.minibatches``); this rank runs what
    :func:`odc.fsdp.microbatches` hands it, its own list first, then other
    ranks' unstarted microbatches, ``cost`` the predicted seconds of a
    microbatch. Every rank's list is ordered largest first (the same order on
    every rank), so thieves take the short ones from the back. ``slow`` (a
    straggler, ``>= 1``): after each microbatch this rank sleeps ``slow - 1``
    times the microbatch's compute time (CPU time of this thread: waits on
    peers are not counted), so its compute takes ``slow`` times as long; the
    sleep counts as microbatch time. ``deterministic`` and ``compress`` (ODC
    only) are passed to ``odc.fsdp.enable``. The run's memory: the process's resident set at the
    start and its peak during the run (``/proc/self/clear_refs`` resets the
    peak), and the most bytes of parameters and gradients (sharded and
    unsharded) FSDP held after a microbatch.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import odc.fsdp

    from . import memory

    if lists is not None and mode != "odc":
        raise ValueError("stealing needs mode odc")
    if mode == "pad" and pad_to is None:
        raise ValueError("mode pad needs pad_to")
    rss_start = memory.reset_peak_rss()
    model = build_model(spec, seed=0)
    # fsdp2-accum keeps each group's parameters unsharded from its first forward to its last backward.
    kw: dict[str, Any] = {"reshard_after_forward": False} if mode == "accum" else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    sharded = list(model.parameters())  # the sharded DTensors; while unsharded, FSDP registers other tensors
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if mode == "odc":
        odc.fsdp.enable(model, opt, timeout=timeout, deterministic=deterministic, compress=compress)
    if lists is None:
        rows = [[packed_row([samples[i] for i in mb]) for mb in mine] for mine in minibatches]
    else:
        weigh = cost or (lambda mb: float(len(mb)))
        ordered = [[sorted((tuple(mb) for mb in r), key=lambda mb: -weigh(mb)) for r in m] for m in lists]
        # Any rank may run any microbatch: every one's row is built before the clock starts.
        row_of = {mb: packed_row([samples[i] for i in mb]) for m in ordered for r in m for mb in r}
    dummy = packed_row([markov_tokens(30_000_000, baselines.DUMMY_LENGTH, spec.vocab)])
    world = ctx.world
    compute = EmulatedCompute()  # the straggler's extra seconds, each sleep's overshoot carried into the next
    held = 0
    ctx.barrier()
    t0 = time.perf_counter()
    ends, losses, norms, micro, stolen = [], [], [], [], []
    grad0 = None  # the first minibatch's gradients (this rank's shards, before clipping), when recording
    for k in range(len(minibatches)):
        local = torch.zeros((), dtype=torch.float64)
        if lists is None:
            work: Any = list(zip(minibatches[k], rows[k], strict=True))
            own: set[tuple[int, ...]] = set()
            runs = baselines.padded_counts([len(work)], mode)[0] if mode != "pad" else int(pad_to[k])  # type: ignore[index]
            work += [((), dummy)] * (runs - len(work))  # zero-loss padding: the same collectives, no gradient
        else:
            work = ((mb, row_of[mb]) for mb in odc.fsdp.microbatches(model, ordered[k], cost=weigh))
            own = set(ordered[k][ctx.rank])
            runs = 0
        taken = 0
        for j, (mb, row) in enumerate(work):
            if mode == "accum":
                last = j == runs - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            m0, c0 = time.perf_counter(), time.thread_time()
            loss = _loss(model, row)
            if mb:
                (loss * world / tokens[k]).backward()  # FSDP averages over ranks
                local += loss.detach().double()
            else:
                (loss * 0.0).backward()
            if slow != 1.0:
                compute.run((slow - 1.0) * (time.thread_time() - c0))
            taken += lists is not None and mb not in own
            micro.append((k, list(mb), time.perf_counter() - m0))
            if mode != "odc":  # ODC's gradients may not be read before the minibatch's last backward
                held = max(held, _held_bytes(model, sharded))
        if record and k == 0:
            grad0 = {name: _local(p.grad).detach().clone() for name, p in model.named_parameters()
                     if p.grad is not None}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        held = max(held, _held_bytes(model, sharded))
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
        losses.append(float(local) / tokens[k])
        norms.append(norm)
        stolen.append(taken)
    norm_values = [float(n.full_tensor() if isinstance(n, DTensor) else n) for n in norms]
    dist.barrier()
    final = {name: p.to_local().detach().clone() for name, p in model.named_parameters()} if record else None
    mem = {"rss_start": rss_start, "rss_peak": memory.peak_rss(), "held": held,
           "odc_shm": memory.shm_bytes(ctx.rank) if mode == "odc" else None}
    if mode == "odc":
        odc.fsdp.disable(model)
    return {"t0": t0, "ends": ends, "losses": losses, "norms": norm_values, "micro": micro, "final": final,
            "grad0": grad0, "stolen": stolen, "slept_s": compute.requested, "memory": mem}


def _held_bytes(model: Any, sharded: Sequence[Any]) -> int:
    """Bytes of the storages behind the model's parameters and gradients: the sharded ones and, while a group is
    unsharded, the unsharded ones FSDP registers in their place (each storage once)."""
    seen: set[int] = set()
    total = 0
    for p in itertools.chain(sharded, model.parameters()):
        for t in (p, p.grad):
            if t is None:
                continue
            storage = _local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _local(t: Any) -> Any:
    """A DTensor's local shard; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _param_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Max absolute difference and the norm of the difference relative to the norm of ``b``."""
    worst, num, den = 0.0, 0.0, 0.0
    for k in b:
        d = (a[k].double() - b[k].double())
        if d.numel():
            worst = max(worst, float(d.abs().max()))
        num += float((d * d).sum())
        den += float((b[k].double() ** 2).sum())
    return worst, math.sqrt(num / den) if den > 0 else 0.0


def _grad_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """The first minibatch's gradients: the largest |difference| and the largest |gradient| of ``b``. Their
    ratio (over every rank) tells reordered float sums (~1e-7) from a lost or doubled microbatch (~1e-2 and up)."""
    worst, scale = 0.0, 0.0
    for k in b:
        if b[k].numel():
            worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
            scale = max(scale, float(b[k].abs().max()))
    return worst, scale


def plan_mode(mode: str) -> str:
    """Whose fixed costs a plan run under ``mode`` is made with: padding runs the collectives' microbatches."""
    return "collective" if mode == "pad" else mode


def train_rank(ctx: Any, *, spec: dict[str, Any], points: list[dict[str, Any]], configs: list[str], repeats: int,
               fit_lengths: list[int], fit_repeats: int, lr: float, clip: float, timeout: float, seed: int,
               skip: int = 1, calibrate: bool = True, straggler: tuple[int, float] | None = None) -> dict[str, Any]:
    """One rank of ``odc-bench train``: the cost fit, then every configuration of every point, interleaved.

    ``points`` carry the lengths, minibatch size and token budget of each
    sweep point; the first ``skip`` minibatches of a run train but are not
    timed (warm-up), and the predictions cover the others. ``calibrate``
    measures the fixed costs per microbatch and per minibatch of each way of
    running (:func:`_overheads`: collectives, also for padding; ODC; FSDP2's
    accumulation), which LB-Micro and LB-Mini plan with and the second
    prediction counts. LB-Micro plans with the collectives' costs wherever it
    runs (it is the collectives' strategy, and ``odc+lb-micro`` runs its
    plan); LB-Mini with the costs of the mode that runs it; verl-maxcount is
    verl's split (:func:`odc.bench.baselines.verl_maxcount_plan`). Rank 0
    returns the fit, the fixed costs, the plans' predictions and every run's
    timings, losses, memory and parameter differences. ``straggler``
    ``(rank, factor)``: that rank's microbatches take ``factor`` times their
    compute time in every configuration's runs (not in the cost fit nor the
    fixed-cost calibration; the predictions do not know of it, but the steal
    bound does).
    """
    import torch

    spec_ = ModelSpec(**spec)
    torch.manual_seed(seed)
    fit, pooled = _time_fit(ctx, spec_, fit_lengths, fit_repeats)
    ctx.emit("progress", "cost fit")
    table = {name: (mode, strategy) for name, mode, strategy in CONFIGS}
    slow = dict([straggler]) if straggler else {}
    overheads: dict[str, dict[str, Any]] = {}
    fits: dict[str, Any] = {}
    for mode in dict.fromkeys(plan_mode(table[name][0]) for name in configs) if calibrate else ():
        overheads[mode], fits[mode] = _overheads(ctx, spec_, mode, fit, pooled, lr, clip, timeout)
        ctx.emit("progress", f"{mode} overheads")
    out_points = []
    for point in points:
        lengths = point["lengths"]
        vocab = spec_.vocab
        samples = [markov_tokens(i, n, vocab, seed) for i, n in enumerate(lengths)]
        plans: dict[tuple[str, str], Any] = {}
        plan_of: dict[str, Any] = {}
        for name in ["collective+lb-micro", *configs]:
            mode, strategy = table[name]
            key = (strategy, "collective" if strategy == "lb-micro" else plan_mode(mode))
            if key not in plans:
                plans[key] = _plan(lengths, ctx.world, point, strategy, fits.get(key[1], fit))
            plan_of[name] = plans[key]
        ref = plan_of[BASELINE]
        # Labels per minibatch from the plan itself (every strategy holds the same samples per minibatch).
        tokens = [sum(lengths[i] - 1 for r in m for mb in r for i in mb) for m in ref.minibatches]
        cost = functools.partial(_seconds, fit, lengths)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        finals: dict[str, dict[str, Any]] = {}
        grads0: dict[str, dict[str, Any]] = {}
        for rep in range(repeats):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for name in order:
                mode, strategy = table[name]
                p = plan_of[name]
                pad_to = [max(len(r) for r in m) for m in p.minibatches] if mode == "pad" else None
                r = _run(ctx, spec_, mode, p.rank(ctx.rank), samples, tokens, lr, clip, timeout,
                         record=(rep == 0), lists=p.minibatches if steals(name) else None, cost=cost,
                         slow=slow.get(ctx.rank, 1.0), deterministic=name.endswith(DET), pad_to=pad_to,
                         compress=COMPRESSED.get(name))
                if rep == 0:
                    finals[name] = r.pop("final")
                    grads0[name] = r.pop("grad0")
                else:
                    r.pop("final")
                    r.pop("grad0")
                gathered = ctx.all_gather_object(r)
                runs[name].append(_aggregate(gathered, skip))
                ctx.emit("progress", f"{point['label']} {name} #{rep + 1}")
        diffs = {}
        for name in configs:
            for ref_name in {BASELINE, same_plan(name, configs)}:
                if ref_name in finals and ref_name != name:
                    local = _param_diff(finals[name], finals[ref_name])
                    every = ctx.all_gather_object(local)
                    g_local = _grad_diff(grads0[name], grads0[ref_name])
                    g_every = ctx.all_gather_object(g_local)
                    diffs[f"{name} vs {ref_name}"] = {"max_abs": max(e[0] for e in every),
                                                      "rel_norm": max(e[1] for e in every),
                                                      "grad0_rel": max(e[0] for e in g_every)
                                                      / max(*(e[1] for e in g_every), 1e-30)}
        dummy_s = fit.seconds(baselines.DUMMY_LENGTH)
        predictions = {name: _prediction(plan_of[name], table[name][0], ref, cost, dummy_s, skip) for name in configs}
        for name in configs:
            predictions[name]["source"] = getattr(plan_of[name], "source", "") or "odc.packing"
            if steals(name):
                p = plan_of[name]
                per_rank = [[[(cost(mb), 0) for mb in m] for m in p.rank(r)[skip:]] for r in range(ctx.world)]
                predictions[name]["steal_bound"] = steal_bound(per_rank, slow)
        if overheads:
            def fixed(mode: str) -> tuple[float, float]:
                o = overheads[plan_mode(mode)]
                return o["microbatch_s"], o["minibatch_s"]

            base_span = predict_span(ref, "collective", cost, fixed("collective"), dummy_s, skip)[1]
            for name, pred in predictions.items():
                mode = table[name][0]
                span = predict_span(plan_of[name], mode, cost, fixed(mode), dummy_s, skip)[1]
                pred.update(seconds_with_overheads=span, speedup_with_overheads=base_span / span)
        out_points.append({
            "predictions": predictions,
            "runs": runs,
            "diffs": diffs,
        })
    return {"fit": fit.to_dict(), "fit_timings": pooled, "overheads": overheads, "points": out_points}


def _plan(lengths: list[int], world: int, point: dict[str, Any], strategy: str, fit: CostFit) -> Any:
    """The plan of ``strategy`` for one sweep point: the packer's with ``fit`` (and its fixed costs), or
    verl-maxcount's."""
    from odc import packing

    if strategy == baselines.VERL_MAXCOUNT:
        return baselines.verl_maxcount_plan(lengths, world, point["minibatch_size"], point["max_tokens"])
    return packing.plan(lengths, world, point["minibatch_size"], strategy, point["max_tokens"], cost=fit)


# The calibration microbatch: a sample this short is nearly all fixed cost.
CALIBRATION_LENGTH = 16


def _overheads(ctx: Any, spec: ModelSpec, mode: str, fit: CostFit, pooled: list[tuple[int, float]], lr: float,
               clip: float, timeout: float, repeats: int = 4) -> tuple[dict[str, Any], CostFit]:
    """Seconds the fitted per-sample costs leave out under ``mode``, measured apart from the benchmark's runs.

    Trains minibatches of 1 and of 4 microbatches of one
    ``CALIBRATION_LENGTH``-token sample (the same on every rank, so nobody
    waits for anybody); :func:`odc.packing.fit_cost` fits the medians: the
    slope per microbatch minus the fit's cost of the sample is the fixed
    cost of a microbatch (interpreter, FSDP's hooks and copies, the
    communication of every layer under collectives), the rest of a
    minibatch's time the fixed cost of a minibatch (clip, optimizer step,
    finish; under FSDP2's accumulation the one all-gather and
    reduce-scatter of every group). Returns the figures and the fit with
    these fixed costs, which the plans of this mode are made with.
    """
    from odc import packing

    few, many = 1, 4
    sample = [markov_tokens(20_000_000, CALIBRATION_LENGTH, spec.vocab)]
    plan = [[[0]] * few] * (1 + repeats) + [[[0]] * many] * repeats  # the first minibatch warms up
    tokens = [ctx.world * len(m) * (CALIBRATION_LENGTH - 1) for m in plan]
    r = _run(ctx, spec, mode, plan, sample, tokens, lr, clip, timeout, record=False)
    r.pop("final")
    per_minibatch = _aggregate(ctx.all_gather_object(r), 0)["minibatch_s"]
    t_few = statistics.median(per_minibatch[1:1 + repeats])
    t_many = statistics.median(per_minibatch[1 + repeats:])
    fixed = packing.fit_cost(pooled, minibatch_timings=[(few, CALIBRATION_LENGTH, t_few),
                                                        (many, CALIBRATION_LENGTH, t_many)])
    return {"microbatch_s": fixed.microbatch_s, "minibatch_s": fixed.minibatch_s,
            "raw_microbatch_s": fixed.raw_fixed_s[0], "raw_minibatch_s": fixed.raw_fixed_s[1],
            "calibration_minibatch_s": per_minibatch}, fixed


def predict_span(plan: Any, mode: str, cost: Callable[[Sequence[int]], float], fixed: tuple[float, float] = (0.0, 0.0),
                 dummy_s: float = 0.0, skip: int = 0) -> tuple[float, float]:
    """(seconds of work, seconds the plan takes) over minibatches ``skip..``, with ``cost`` per microbatch's
    samples and ``fixed`` = (per microbatch, per minibatch) seconds.

    ``collective``: every microbatch step its slowest rank's microbatch (a
    rank without one runs an empty step) plus the per-microbatch cost;
    ``pad``: the same with a dummy microbatch (``dummy_s``) where a rank has
    none; ``odc`` and ``accum``: the slowest rank's microbatches, each with
    the per-microbatch cost (a rank without any runs one dummy under
    ``accum``). Every minibatch adds the per-minibatch cost. Work is the
    samples' costs alone. For a packer's plan made with the same fixed costs
    this is the packer's own predicted time (:meth:`odc.packing.Plan.time`).
    """
    per_micro, per_minibatch = fixed
    work = span = 0.0
    for ranks in plan.minibatches[skip:]:
        runs = baselines.padded_counts([len(r) for r in ranks], mode)
        work += sum(cost(mb) for r in ranks for mb in r)
        if mode in ("odc", "accum"):
            span += max(sum(cost(mb) for mb in r) + (n - len(r)) * dummy_s + n * per_micro
                        for r, n in zip(ranks, runs, strict=True))
        else:
            empty = dummy_s if mode == "pad" else 0.0
            span += sum(max(cost(r[j]) if j < len(r) else empty for r in ranks) + per_micro
                        for j in range(max(runs)))
        span += per_minibatch
    return work, span


def _prediction(plan: Any, mode: str, baseline: Any, cost: Callable[[Sequence[int]], float], dummy_s: float,
                skip: int) -> dict[str, Any]:
    """What the fitted per-sample costs alone predict for one configuration over the timed minibatches."""
    work, span = predict_span(plan, mode, cost, dummy_s=dummy_s, skip=skip)
    _, base_span = predict_span(baseline, "collective", cost, skip=skip)
    return {
        "bubble": 1.0 - work / (plan.world_size * span) if span > 0 else float("nan"),
        "speedup": base_span / span if span > 0 else float("nan"),
        "seconds": span,
        # What each rank runs (padding and dummies included).
        "microbatches": [baselines.padded_counts([len(r) for r in m], mode) for m in plan.minibatches],
    }


def _aggregate(per_rank: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    start = min(r["t0"] for r in per_rank)
    n = len(per_rank[0]["ends"])
    ends = [max(r["ends"][k] for r in per_rank) for k in range(n)]
    losses = [sum(r["losses"][k] for r in per_rank) for k in range(n)]
    return {
        "total_s": ends[-1] - start if ends else 0.0,
        "timed_s": ends[-1] - (ends[skip - 1] if skip > 0 else start) if ends else 0.0,
        "minibatch_s": [e - s for s, e in itertools.pairwise([start, *ends])],
        "losses": losses,
        "norms": per_rank[0]["norms"],
        "micro": [[(k, list(mb), t) for k, mb, t in r["micro"]] for r in per_rank],
        "stolen": [sum(r["stolen"][k] for r in per_rank) for k in range(n)],
        "slept_s": [r["slept_s"] for r in per_rank],
        "memory": [r["memory"] for r in per_rank],
    }
