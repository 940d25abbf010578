"""SFT of a Hugging Face causal LM with FSDP2 on packed variable-length sequences, over collectives or ODC.

    python examples/hf_sft.py --nproc 2 --comm both                 # tiny random Qwen2, forked CPU ranks
    python examples/hf_sft.py --nproc 4 --comm odc --strategy lb-mini
    torchrun --nproc-per-node 8 examples/hf_sft.py --model ./my-config-dir --comm odc --attn flash_attention_2

The loop is a user's ordinary FSDP2 loop (``fully_shard`` per decoder layer and
the root, torch's ``clip_grad_norm_`` before ``optimizer.step()``); under
``--comm odc`` the only added line is ``odc.fsdp.enable(model, optimizer)``.
Each microbatch is one packed row: its samples back to back, ``position_ids``
restarting at 0 per sample. ``--model`` takes any local config (a directory
with ``config.json`` or the file itself; random weights, nothing downloaded).
``--attn varlen`` (the default) is per-sample causal sdpa, what flash-attention's
varlen kernel computes, so it runs on CPU; ``sdpa`` uses transformers' packed
mask, ``flash_attention_2`` the kernel on GPUs.

Prints, per minibatch, the loss, torch's grad norm and the slowest rank's time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import odc.fsdp
import odc.packing

VARLEN = "odc_varlen_sdpa"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None, **_):
    """Per-sample causal attention over one packed row (samples start where ``position_ids`` is 0)."""
    s = query.shape[2]
    starts = [*(position_ids.view(-1) == 0).nonzero().view(-1).tolist(), s]
    parts = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                       scale=scaling, enable_gqa=True)
        for a, b in itertools.pairwise(starts)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def config(args):
    from transformers import AutoConfig, Qwen2Config

    if args.model:
        return AutoConfig.from_pretrained(args.model)
    # Tiny Qwen2: tied embeddings, grouped-query attention, rotary.
    return Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=args.layers,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=4096)


def build_model(args):
    from transformers import AttentionInterface, AutoModelForCausalLM

    cfg = config(args)
    cfg.use_cache = False
    attn = {"varlen": VARLEN}.get(args.attn, args.attn)
    if attn == VARLEN:
        AttentionInterface.register(VARLEN, varlen_attention)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if args.ckpt:
        # transformers 5.2x renamed gradient_checkpointing_enable; verl's pin (5.9) has only the old name.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def packed_row(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, labels)`` of one packed row; a sample's first token carries no label."""
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in samples])[None]
    return ids, pos, labels


def train(args, comm: str, strategy: str, data: list[torch.Tensor], rank: int, world: int, device, quiet=False,
          clip=torch.nn.utils.clip_grad_norm_):
    """One training run; returns per-minibatch (loss, grad norm, slowest rank's seconds) as rank 0 sees them."""
    model = build_model(args).to(device)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": bf16} if args.dtype == "bf16" else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if comm == "odc":
        odc.fsdp.enable(model, opt)  # the one added line
    lengths = [len(s) for s in data]
    plan = odc.packing.plan(lengths, world, args.minibatch, strategy, max_tokens=args.max_tokens, cost=args.cost)
    rows = []
    dist.barrier()
    for ranks in plan.minibatches[: args.steps]:
        t0 = time.perf_counter()
        tokens_total = sum(lengths[i] - 1 for r in ranks for mb in r for i in mb)  # labels in the minibatch
        local = 0.0
        for mb in ranks[rank]:
            ids, pos, labels = (t.to(device) for t in packed_row([data[i] for i in mb]))
            logits = model(input_ids=ids, position_ids=pos).logits
            loss = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100, reduction="sum")
            (loss * world / tokens_total).backward()  # FSDP averages over ranks
            local += loss.item() / tokens_total
        norm = clip(model.parameters(), args.clip)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        opt.step()
        opt.zero_grad()
        rows.append((local, float(norm), time.perf_counter() - t0))
    dist.barrier()
    if comm == "odc":
        odc.fsdp.disable(model)
    everyone = [None] * world  # reporting only, outside the timed loop
    dist.all_gather_object(everyone, rows)
    table = [(sum(e[m][0] for e in everyone), rows[m][1], max(e[m][2] for e in everyone)) for m in range(len(rows))]
    if rank == 0 and not quiet:
        print(f"[{comm}/{strategy}] predicted bubble: collective {plan.bubble_rate('collective'):.3f}, "
              f"odc {plan.bubble_rate('odc'):.3f}")
    return table


def make_data(args) -> list[torch.Tensor]:
    """Synthetic samples with long-tailed lengths (lognormal, as in long-context SFT)."""
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    lengths = [min(args.max_len, max(8, int(rng.lognormvariate(4.0, 0.8)))) for _ in range(args.samples)]
    vocab = config(args).vocab_size
    return [torch.randint(0, vocab, (n,)) for n in lengths]


def worker(rank: int, world: int, args) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=rank, world_size=world)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = make_data(args)
    tables = {}
    for comm in ["collective", "odc"] if args.comm == "both" else [args.comm]:
        strategy = "lb-micro" if comm == "collective" and args.strategy == "lb-mini" else args.strategy
        tables[comm] = (strategy, train(args, comm, strategy, data, rank, world, device))
    if rank == 0:
        names = list(tables)
        print("minibatch | " + " | ".join(f"{c} ({tables[c][0]}): loss, grad norm, ms" for c in names))
        for m in range(len(tables[names[0]][1])):
            cells = [f"{t[1][m][0]:.4f}, {t[1][m][1]:.4f}, {t[1][m][2] * 1e3:8.1f}" for t in tables.values()]
            print(f"{m:9d} | " + " | ".join(cells))
        means = {c: sum(r[2] for r in t[1][1:]) / max(1, len(t[1]) - 1) for c, t in tables.items()}
        for c, v in means.items():
            print(f"{c}: {v * 1e3:.1f} ms per minibatch (mean after the first)")
        if len(means) == 2:
            print(f"odc time per minibatch vs collective: {means['odc'] / means['collective'] - 1:+.1%}")
    dist.destroy_process_group()
    # torch 2.15's gloo sometimes aborts in interpreter teardown after destroy_process_group; the work is
    # done and printed, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="local config (directory or config.json); default: tiny Qwen2")
    p.add_argument("--attn", default="varlen", help="varlen (per-sample sdpa), sdpa, flash_attention_2, ...")
    p.add_argument("--comm", choices=["collective", "odc", "both"], default="both")
    p.add_argument("--strategy", choices=["lb-micro", "lb-mini", "local-sort"], default="lb-micro")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: FSDP2 mixed precision")
    p.add_argument("--cost", default="quadratic", help="the planner's cost model (see odc-pack --help)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to start when not under torchrun")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    # --minibatch: samples per rank per minibatch; --max-tokens: token budget of one packed row.
    for flag, default in (("--steps", 6), ("--samples", 512), ("--minibatch", 16), ("--max-len", 512),
                          ("--max-tokens", 1024), ("--layers", 4), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    args = p.parse_args(argv)
    if args.comm == "collective" and args.strategy == "lb-mini":
        p.error("lb-mini gives ranks different microbatch counts: it needs --comm odc (or both)")
    if args.max_len > args.max_tokens:
        p.error(f"--max-len {args.max_len} exceeds --max-tokens {args.max_tokens}: a sample must fit a row")
    return args


def launch(fn, args) -> None:
    """Runs ``fn(rank, world, args)`` on this rank under torchrun, else on ``--nproc`` local ranks (forked on CPU,
    spawned on CUDA)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "RANK" in os.environ:  # torchrun
        fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    # CPU ranks start as forks of this process, which has imported torch, FSDP2, ODC and the model code: a fresh
    # interpreter per rank would import them again (about 15 s of CPU each on a 2-core machine). CUDA ranks are
    # spawned, the safe start for processes that will each open a CUDA context.
    method = "fork" if getattr(args, "device", "cpu") == "cpu" else "spawn"
    torch.multiprocessing.start_processes(fn, args=(args.nproc, args), nprocs=args.nproc, start_method=method)


def main() -> None:
    args = parse()
    if args.device == "cpu" and "RANK" not in os.environ:
        # The forked ranks (launch) find the model's code imported: transformers' modeling module of its config.
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(config(args))]
    launch(worker, args)


if __name__ == "__main__":
    main()
