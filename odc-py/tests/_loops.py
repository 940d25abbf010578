"""Users' training loops, unchanged, for test_fsdp_loops.py: the models they train and the steps they run.

Models: Hugging Face ``transformers`` Qwen2 and Llama from tiny configs with
random weights (tied embeddings, grouped-query attention, rotary buffers),
``fully_shard`` per decoder layer and the root, trained on packed
variable-length rows (one row per microbatch, ``position_ids`` restarting per
sample) through a registered varlen attention (per-sample causal sdpa, what
flash-attention's varlen kernel computes; examples/hf_sft.py's). Loops, each as its trainer writes
it: a torchtitan-shaped step (global token count summed once per minibatch,
loss divided by it, divide factor 1.0, torch's ``clip_grad_norm_`` pieces as
torchtitan calls them), a verl-shaped actor update (uneven microbatch
counts, ``set_requires_gradient_sync(False)`` on all but the last
microbatch, loss scaled by the global token count · dp size, verl's FSDP2
clip, the norm returned, a non-finite norm skips the step) and a Hugging
Face Trainer-shaped step (mean loss per microbatch over the accumulation
count, torch's ``clip_grad_norm_``, an LR scheduler, ``model.zero_grad()``).

The single-process reference trains an unsharded copy on every rank's
microbatches with the same loss; under a mixed-precision policy it computes
in a copy of the parameters cast to the policy's dtype and sums the
microbatches' gradients in f32, which is what FSDP2 does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import odc
import odc.fsdp

VOCAB = 96
ATTN = "odc_cpu_varlen"


# -- models ------------------------------------------------------------------------------------------


@functools.cache
def _example():
    """examples/hf_sft.py as a module: its varlen attention is the one the tests register."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "hf_sft.py"
    spec = importlib.util.spec_from_file_location("hf_sft", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_model(kind, ckpt=False, layers=2):
    """A tiny random ``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` (same seed on every rank)."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    AttentionInterface.register(ATTN, _example().varlen_attention)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[kind]
    cfg = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=256, use_cache=False)
    cfg._attn_implementation = ATTN
    torch.manual_seed(0)
    model = model_cls(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    if ckpt:
        # transformers 5.2x renamed gradient_checkpointing_enable; verl's pin (5.9) has only the old name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard(model, mp=None):
    """``fully_shard`` per decoder layer, then the root, as users do."""
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


# -- data: packed variable-length rows ----------------------------------------------------------------


def packed(step, rank, micro):
    """One packed row of 2–4 samples of 3–24 tokens: ``(input_ids, position_ids, labels)``, each (1, T).

    Labels ignore each sample's first token (the row's previous token is another sample's).
    """
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    n = int(torch.randint(2, 5, (1,), generator=g))
    ids, pos, lab = [], [], []
    for length in torch.randint(3, 25, (n,), generator=g).tolist():
        s = torch.randint(0, VOCAB, (length,), generator=g)
        ids.append(s)
        pos.append(torch.arange(length))
        lab.append(torch.cat([torch.tensor([-100]), s[1:]]))
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(lab)[None]


def tokens(mb):
    """Tokens that carry a loss in a microbatch (the model predicts labels[t + 1] from position t)."""
    return int((mb[2][0, 1:] != -100).sum())


def loss_sum(model, mb):
    ids, pos, lab = mb
    logits = model(input_ids=ids, position_ids=pos).logits
    return F.cross_entropy(logits[0, :-1].float(), lab[0, 1:], ignore_index=-100, reduction="sum")


def loss_hf(model, mb):
    """The model's own loss (mean over the microbatch's tokens), as the HF Trainer reads it."""
    ids, pos, lab = mb
    return model(input_ids=ids, position_ids=pos, labels=lab).loss


# -- the loops, each as its trainer writes it --------------------------------------------------------


def titan_clip(parameters, max_norm):
    """torchtitan's ``dist_utils.clip_grad_norm_`` (no pipeline / expert parallelism)."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, None)
    return total


def verl_clip(parameters, max_norm):
    """verl's ``fsdp2_clip_grad_norm_`` (torch's private norm helpers, as verl calls them)."""
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm

    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _get_total_norm(grads, 2.0, False, None)
    _clip_grads_with_norm_(parameters, max_norm, total, None)
    return total


def shard_sq(parameters):
    """The sum of squares of this rank's gradient shards (``p.grad.to_local()``), in float64: what it holds
    before any exchange, which a test combines over the ranks to check each rank's norm independently."""
    total = 0.0
    for p in parameters:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            total += float(g.detach().double().pow(2).sum())
    return total


def _log_shards(model, log):
    if log is not None:
        log.append(shard_sq(model.parameters()))


def step_titan(model, opt, mbs, world, clip, scaler=None, log=None):
    """torchtitan's ``train_step``: zero, global token count, sum-loss / count per microbatch, clip, step.
    ``log`` (a list): gets :func:`shard_sq` just before the clip (every step function's)."""
    opt.zero_grad()
    count = torch.tensor(float(sum(tokens(mb) for mb in mbs)), dtype=torch.float64)
    dist.all_reduce(count)  # once per minibatch, on every rank
    if scaler is not None and not mbs:
        scaler.scale(torch.zeros(()))  # GradScaler makes its scale on the first scale() call
    for mb in mbs:
        loss = loss_sum(model, mb) / count.item()
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler is not None:
        scaler.unscale_(opt)
    _log_shards(model, log)
    norm = titan_clip(model.parameters(), clip)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return float(norm)


def step_verl(model, opt, mbs, world, clip, scaler=None, log=None):
    """verl's ``train_batch``: zero, global token count, gradient sync only on the last microbatch,
    loss · dp / count, FSDP2 clip, skip the step on a non-finite norm."""
    opt.zero_grad()
    count = torch.tensor(float(sum(tokens(mb) for mb in mbs)), dtype=torch.float64)
    dist.all_reduce(count)
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        with contextlib.nullcontext() if last else _no_sync(model):
            loss = loss_sum(model, mb) / count.item() * world
            loss.backward()
    _log_shards(model, log)
    norm = verl_clip(model.parameters(), clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        opt.zero_grad()
    else:
        opt.step()
    return float(norm)


@contextlib.contextmanager
def _no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def step_hf(model, opt, mbs, world, clip, scaler=None, sched=None, log=None):
    """The Hugging Face Trainer's step: mean loss / accumulation count, torch's clip, step, schedule, zero."""
    for mb in mbs:
        (loss_hf(model, mb) / len(mbs)).backward()
    _log_shards(model, log)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    opt.step()
    if sched is not None:
        sched.step()
    model.zero_grad()
    return float(norm)


STEPS = {"titan": step_titan, "verl": step_verl, "hf": step_hf}


# -- the distributed run and its single-process reference -------------------------------------------


def mp_policy(name):
    return {
        "fp32": None,
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    }[name]


def full_params(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().tolist()
            for k, v in model.state_dict().items()}


def train(variant, rank, world, plan, comm):
    """Trains ``variant`` with FSDP2 (``comm`` "gloo": its collectives; "odc": ``odc.fsdp.enable``) on
    ``plan[s][r]`` microbatches of rank r at step s; returns per-step grad norms, this rank's :func:`shard_sq`
    before each clip and the full parameters."""
    loop, kind, prec = variant["loop"], variant["model"], variant.get("precision", "fp32")
    model = shard(hf_model(kind, ckpt=variant.get("ckpt", False)), mp_policy(prec))
    if loop == "titan":
        # torchtitan's disable_fsdp_gradient_division: sum, the loss is already divided by the global count.
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                if comm == "gloo":
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=variant.get("lr", 1e-2), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if loop == "hf" else None
    scaler = torch.amp.GradScaler("cpu", init_scale=variant.get("init_scale", 2.0**8)) if prec == "fp16" else None
    if comm == "odc":
        odc.fsdp.enable(model, opt, timeout=60, deterministic=variant.get("deterministic", False),
                        compress=variant.get("compress"))
    norms, shards = [], []
    for s, counts in enumerate(plan):
        mbs = [packed(s, rank, j) for j in range(counts[rank])]
        kw = {"sched": sched} if loop == "hf" else {"scaler": scaler}
        norms.append(STEPS[loop](model, opt, mbs, world, variant.get("clip", 1.0), log=shards, **kw))
    out = {"norms": norms, "shard_sq": shards, "params": full_params(model),
           "scale": None if scaler is None else float(scaler.get_scale())}
    if comm == "odc":
        engine = model._odc_fsdp.engine
        out.update(transport=engine.transport, cross_node=engine.cross_node, cache=engine.node_cache_stats())
        odc.fsdp.disable(model)
    return out


def reference(variant, world, plan):
    """One process, every rank's microbatches, the same loss; returns per-step norms, parameters and, per step,
    each rank's :func:`shard_sq` as FSDP2 shards the gradients (dim 0 in ``world`` chunks). ``variant["autocast"]``:
    the forward under CPU autocast to the precision's dtype, for a loop that computes under it."""
    loop, kind, prec = variant["loop"], variant["model"], variant.get("precision", "fp32")
    model = hf_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=variant.get("lr", 1e-2), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if loop == "hf" else None
    scale = 2.0**8 if prec == "fp16" else 1.0
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec)
    autocast = contextlib.nullcontext
    if variant.get("autocast"):
        autocast = functools.partial(torch.autocast, "cpu", dtype=low)
    norms, shards = [], []
    for s, counts in enumerate(plan):
        mbs = [(r, packed(s, r, j)) for r in range(world) for j in range(counts[r])]
        count = sum(tokens(mb) for _, mb in mbs)
        # A copy to compute in (under mixed precision, FSDP2's: parameters cast, gradients summed in f32).
        compute = copy.deepcopy(model)
        if low is not None:
            for p in compute.parameters():
                p.data = p.data.to(low)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for r, mb in mbs:
            # The loss as rank r computes it; FSDP2 averages over the ranks (hf, verl) after summing in f32.
            with autocast():
                if loop == "hf":
                    loss = loss_hf(compute, mb) / counts[r]
                elif loop == "verl":
                    loss = loss_sum(compute, mb) / count * world
                else:
                    loss = loss_sum(compute, mb) / count
            compute.zero_grad()
            (loss * scale).backward()
            for p, q in zip(model.parameters(), compute.parameters(), strict=True):
                p.grad += q.grad.float()
        for p in model.parameters():
            p.grad /= scale * (1 if loop == "titan" else world)
        shards.append([sum(float(c[r].double().pow(2).sum()) if r < len(c) else 0.0
                           for c in (torch.chunk(p.grad, world, dim=0) for p in model.parameters()))
                       for r in range(world)])
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), variant.get("clip", 1.0))))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
    return {"norms": norms, "shard_sq": shards,
            "params": {k: v.detach().float().tolist() for k, v in model.state_dict().items()}}


def loops_worker(rank, world, store, variants, plan, comms=("odc",), ref=True):
    """Each variant with each comm; rank 0 adds the single-process reference."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = {}
    for i, variant in enumerate(variants):
        res = {comm: train(variant, rank, world, plan, comm) for comm in comms}
        if ref and rank == 0:
            res["ref"] = reference(variant, world, plan)
        out[i] = res
    return out


def max_diff(a, b):
    """Largest absolute difference between two ``{name: nested list}`` parameter sets, and where."""
    assert a.keys() == b.keys()
    return max(((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item(), k) for k in a)


def assert_close(got, want, norm_rel, param_abs, what):
    for s, (x, y) in enumerate(zip(got["norms"], want["norms"], strict=True)):
        assert math.isclose(x, y, rel_tol=norm_rel), f"{what}: step {s} grad norm {x} != {y}"
    diff, name = max_diff(got["params"], want["params"])
    assert diff <= param_abs, f"{what}: parameters differ by {diff} at {name} (> {param_abs})"


def assert_norms_from_shards(by_rank, ref, what, norm_rel=1e-5, shard_rel=2e-5):
    """Each rank's grad norms against the ones computed without its exchange: every rank's :func:`shard_sq`
    (what it held before its clip) against the one-process reference's for that rank's shards, and every
    rank's norm against both the reference's norm and the square root of the ranks' own shards' sum.
    ``by_rank``: rank -> ``train``'s result."""
    world = len(by_rank)
    for s, want in enumerate(ref["norms"]):
        own = [by_rank[r]["shard_sq"][s] for r in range(world)]
        for r in range(world):
            assert math.isclose(own[r], ref["shard_sq"][s][r], rel_tol=shard_rel, abs_tol=1e-12), \
                f"{what}: step {s} rank {r}'s gradient shards: sum of squares {own[r]} != {ref['shard_sq'][s][r]}"
        combined = math.sqrt(sum(own))
        for r in range(world):
            got = by_rank[r]["norms"][s]
            assert math.isclose(got, want, rel_tol=norm_rel), f"{what}: step {s} rank {r}: grad norm {got} != {want}"
            assert math.isclose(got, combined, rel_tol=norm_rel), \
                f"{what}: step {s} rank {r}: grad norm {got} != {combined}, the norm of the ranks' own shards"


def quiet():
    """transformers deprecation notes are not test failures."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
