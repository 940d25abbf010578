"""``odc-bench trainer``: the same TRL ``SFTTrainer`` job four ways, as a user runs it.

The job: a causal LM from a tiny config (:func:`odc.bench.train.build_model`: Qwen2, random weights, per-sample
causal attention over packed rows, what flash-attention's varlen kernels compute on GPUs), samples of LongAlign's
length shape (``--synthetic``, as ``odc-bench train`` and ``odc-pack`` take it, or ``--lengths FILE``; tokens a
fixed Markov walk), TRL's ``SFTTrainer`` with ``packing=True`` (``bfd``), ``padding_free=True`` and ``max_length``,
``per_device_train_batch_size=1`` and ``gradient_accumulation_steps=M`` (the minibatch size: packed rows per rank
per optimizer step), FSDP2 through the training arguments (CPU, gloo), constant learning rate, the clip, and
``train_sampling_strategy="sequential"``, so that every arm's step ``k`` takes the same dataset rows. The arms:

- ``trl-default``: the stock trainer, TRL's best default (every rank runs ``M`` packed rows per step over FSDP2's
  collectives);
- ``odc+lb-mini``: the same trainer with ``odc.integrations.transformers.enable(trainer)``: each step's samples
  planned by LB-Mini over the ranks, each rank its own count of microbatches, on ODC;
- ``odc-accum``: the same on ODC with FSDP2's own accumulation (``enable(trainer, accumulation="odc-accum")`` with
  ``reshard_after_forward=False``: one gather and one push per group per step and rank, ZeRO-2's memory, a rank
  with nothing to run runs nothing);
- ``fsdp2-accum``: the same plan without ODC, under FSDP2's own accumulation
  (``enable(trainer, accumulation="fsdp2-accum")`` with ``reshard_after_forward=False``: one all-gather and one
  reduce-scatter per group per step, at least one microbatch per rank, ZeRO-2's memory).

Every arm trains the same model from the same weights on the same rows, interleaved: for each minibatch size, each
repeat runs the arms in an order rotated by the repeat. Reported per arm: the time per optimizer step (rank
0's wall time between the ends of the first and the last step, over the steps between: the first step is not
timed), the peak memory per rank (the process's peak resident set during the arm, Linux ``VmHWM`` reset before the
arm: on CPU torch's allocator keeps no figures, and ODC's shared-memory segments, counted separately), the loss
curve, and the ratios against ``trl-default`` measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from typing import Any

from .report import UsageError

BASELINE = "trl-default"
ODC = "odc+lb-mini"
ACCUM_ON_ODC = "odc-accum"
ACCUM = "fsdp2-accum"
ARMS = (BASELINE, ODC, ACCUM_ON_ODC, ACCUM)
DEFAULT_SYNTHETIC = "lognormal:n=4096,median=312,sigma=1.0,max=2048,seed=0"
"""LongAlign's length shape scaled 1/32, as ``odc-bench train``'s."""
RANK_PRELOAD = ["torch.distributed.fsdp", "transformers.trainer", "accelerate", "datasets", "trl",
                "trl.trainer.sft_trainer", "transformers.models.qwen2.modeling_qwen2"]
SAME_SAMPLES_TOLERANCE = 1e-4
"""How far the arms' step-0 losses may stray from each other (relative): same rows, same weights."""


def needed_tokens(steps: int, minibatch: int, world: int, max_length: int) -> int:
    """Sample tokens that fill ``steps`` steps of ``minibatch`` packed rows per rank (bfd fills rows to ~95%)."""
    return int(1.1 * steps * minibatch * world * max_length)


def rotated(repeat: int) -> list[str]:
    """The arms in repeat ``repeat``'s order."""
    k = repeat % len(ARMS)
    return list(ARMS[k:] + ARMS[:k])


# -- rank side ---------------------------------------------------------------------------------------


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated in transformers
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")), pad_token="t0", eos_token=f"t{vocab - 1}")


def _clock() -> Any:
    """A callback that records when each optimizer step ends."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    return StepClock()


def _arm(ctx: Any, arm: str, spec: Any, dataset: Any, minibatch: int, steps: int, max_length: int, lr: float,
         clip: float, timeout: float, out_dir: str) -> dict[str, Any]:
    """One training run of ``arm`` on this rank: its step ends, losses, microbatches per step, memory."""
    import collections

    import torch
    from trl import SFTConfig, SFTTrainer

    import odc.fsdp
    import odc.integrations.transformers as odc_hf

    from . import memory, train

    rss_start = memory.reset_peak_rss()
    model = train.build_model(spec, seed=0)
    config = SFTConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], per_device_train_batch_size=1,
        gradient_accumulation_steps=minibatch, max_steps=steps, logging_steps=1, save_strategy="no",
        learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=clip, seed=0, bf16=False,
        disable_tqdm=True, train_sampling_strategy="sequential", dataloader_num_workers=0,
        packing=True, packing_strategy="bfd", padding_free=True, max_length=max_length, dataset_num_proc=None,
        fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
                                "reshard_after_forward": arm not in (ACCUM, ACCUM_ON_ODC)})
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=_tokenizer(spec.vocab))
    rows = len(trainer.train_dataset)
    if rows < steps * minibatch * ctx.world:
        raise ValueError(f"{rows} packed rows make fewer than {steps} steps of {minibatch} rows on {ctx.world} ranks")
    if arm == ODC:
        odc_hf.enable(trainer, timeout=timeout)
    elif arm == ACCUM_ON_ODC:
        odc_hf.enable(trainer, timeout=timeout, accumulation=odc_hf.ACCUM_ON_ODC)
    elif arm == ACCUM:
        odc_hf.enable(trainer, timeout=timeout, accumulation=odc_hf.FSDP2_ACCUM)
    else:
        odc_hf._fsdp_on_cpu(trainer)  # accelerate leaves FSDP off on CPU ranks (see the integration)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the table is the output, not every rank's log lines
    clock = _clock()
    trainer.add_callback(clock)
    counts: collections.Counter[int] = collections.Counter()
    running = [trainer]  # train() may replace trainer.state (transformers 5.9 does)

    def count(module: Any, _: Any) -> None:
        if module.training and torch.is_grad_enabled():
            counts[running[0].state.global_step] += 1

    hook = trainer.model.register_forward_pre_hook(count)
    ctx.barrier()
    trainer.train()
    peak = memory.peak_rss()
    shm = memory.shm_bytes(ctx.rank) if odc.fsdp.is_enabled(trainer.model) else None
    hook.remove()
    running.clear()
    losses = [float(line["loss"]) for line in trainer.state.log_history
              if "loss" in line and "train_loss" not in line]
    if odc.fsdp.is_enabled(trainer.model):
        odc.fsdp.disable(trainer.model)
    del trainer, model
    gc.collect()
    ctx.barrier()
    return {"ends": clock.ends, "losses": losses, "microbatches": [counts[s] for s in range(steps)],
            "rss_start": rss_start, "rss_peak": peak, "odc_shm": shm, "rows": rows}


def trainer_rank(ctx: Any, *, spec: dict[str, Any], lengths: list[int], sizes: list[int], steps: int, repeats: int,
                 max_length: int, lr: float, clip: float, timeout: float, seed: int) -> dict[str, Any] | None:
    """Every point and repeat and arm on this rank; rank 0 returns every rank's runs."""
    from datasets import Dataset

    from . import train

    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world), MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT", "0"), HF_HUB_OFFLINE="1",
                      HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1")
    import datasets

    datasets.disable_progress_bars()
    model_spec = train.ModelSpec(**spec)
    ids = [train.markov_tokens(i, n, model_spec.vocab, seed).tolist() for i, n in enumerate(lengths)]
    dataset = Dataset.from_dict({"input_ids": ids})
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="odc-bench-trainer-") as out_dir:
        for m in sizes:
            for r in range(repeats):
                for arm in rotated(r):
                    ctx.emit("progress", f"M={m} repeat {r + 1} {arm}")
                    run = _arm(ctx, arm, model_spec, dataset, m, steps, max_length, lr, clip, timeout,
                               os.path.join(out_dir, f"{arm}-{m}-{r}"))
                    runs.append({"minibatch_size": m, "repeat": r, "arm": arm, "ranks": ctx.all_gather_object(run)})
    return {"runs": runs} if ctx.rank == 0 else None


# -- caller side -------------------------------------------------------------------------------------


def step_seconds(ends: list[float]) -> float:
    """Seconds per optimizer step from the steps' end times, the first step left out (it warms up)."""
    if len(ends) < 2:
        raise ValueError("need at least 2 steps (the first is not timed)")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def summarize(runs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Per minibatch size: per arm the median time per step over the repeats, the peak memory (the largest over
    ranks and repeats), the loss curve (repeat 0's), the microbatches per rank per step; the ratios against
    ``trl-default``; and how far the arms' step-0 losses are apart."""
    points = []
    for m in sizes:
        arms: dict[str, Any] = {}
        for arm in ARMS:
            sel = [r for r in runs if r["minibatch_size"] == m and r["arm"] == arm]
            times = [step_seconds(r["ranks"][0]["ends"]) for r in sel]
            peaks = [rank["rss_peak"] for r in sel for rank in r["ranks"] if rank["rss_peak"] is not None]
            grown = [rank["rss_peak"] - rank["rss_start"] for r in sel for rank in r["ranks"]
                     if rank["rss_peak"] is not None and rank["rss_start"] is not None]
            shm = [rank["odc_shm"] for r in sel for rank in r["ranks"] if rank["odc_shm"] is not None]
            first = sorted(sel, key=lambda r: r["repeat"])[0]
            arms[arm] = {
                "step_s": statistics.median(times), "step_s_runs": times,
                "rss_peak": max(peaks) if peaks else None, "rss_grown": max(grown) if grown else None,
                "odc_shm": max(shm) if shm else None, "losses": first["ranks"][0]["losses"],
                "microbatches": [rank["microbatches"] for rank in first["ranks"]],
            }
        base = arms[BASELINE]
        ratios = {arm: {"speedup": base["step_s"] / arms[arm]["step_s"],
                        "memory": (arms[arm]["rss_peak"] / base["rss_peak"]
                                   if arms[arm]["rss_peak"] and base["rss_peak"] else None)}
                  for arm in ARMS if arm != BASELINE}
        zero = [arms[arm]["losses"][0] for arm in ARMS]
        spread = (max(zero) - min(zero)) / max(abs(zero[0]), 1e-12)
        points.append({"minibatch_size": m, "arms": arms, "ratios": ratios, "step0_loss_spread": spread,
                       "same_samples": spread <= SAME_SAMPLES_TOLERANCE})
    return points


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def render(points: list[dict[str, Any]], title: list[str]) -> str:
    """The table: per minibatch size and arm, time per step, speedup, peak memory and its ratio, step-0 loss."""
    from .report import fmt, table

    header = ["M", "arm", "s/step", f"speedup vs {BASELINE}", "peak RSS/rank", "RSS grown", "memory ratio",
              "ODC shm", "loss step 0", "microbatches/rank (step 0)"]
    rows = []
    for p in points:
        for arm in ARMS:
            a, ratio = p["arms"][arm], p["ratios"].get(arm)
            rows.append([p["minibatch_size"], arm, fmt(a["step_s"], 3), "1.00" if ratio is None else
                         fmt(ratio["speedup"]), _mib(a["rss_peak"]), _mib(a["rss_grown"]),
                         "1.00" if ratio is None else ("-" if ratio["memory"] is None else fmt(ratio["memory"])),
                         _mib(a["odc_shm"]), f"{a['losses'][0]:.6f}",
                         "/".join(str(c[0]) for c in a["microbatches"])])
    lines = [*title, table(header, rows, [3, 12, 8, 20, 14, 10, 13, 8, 12, 26])]
    off = [p["minibatch_size"] for p in points if not p["same_samples"]]
    if off:
        lines.append(f"WARNING: the arms' step-0 losses differ beyond {SAME_SAMPLES_TOLERANCE:g} at M = {off}")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: str, title: str) -> None:
    """Left: time per step per arm and minibatch size (ratio to trl-default on the bars); right: the loss curves of
    the largest minibatch size."""
    from .report import png_metadata, require_matplotlib

    plt = require_matplotlib()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        xs = [j + (i - (len(ARMS) - 1) / 2) * width for j in range(len(points))]
        ys = [p["arms"][arm]["step_s"] for p in points]
        bars = left.bar(xs, ys, width, color=f"C{i}", label=arm)
        for bar, p in zip(bars, points, strict=True):
            ratio = p["ratios"].get(arm)
            if ratio is not None:
                left.annotate(f"{ratio['speedup']:.2f}x", (bar.get_x() + width / 2, bar.get_height()), ha="center",
                              va="bottom", fontsize=7)
    left.set_xticks(range(len(points)))
    left.set_xticklabels([f"M={p['minibatch_size']}" for p in points])
    left.set_ylabel("seconds per optimizer step (median)")
    left.legend(fontsize=8)
    left.grid(True, axis="y", alpha=0.3)
    last = points[-1]
    for i, arm in enumerate(ARMS):
        losses = last["arms"][arm]["losses"]
        right.plot(range(len(losses)), losses, color=f"C{i}", label=arm, lw=1.2, ls=("-", "--", "-.", ":")[i])
    right.set_xlabel("optimizer step")
    right.set_ylabel("loss")
    right.set_title(f"loss, M={last['minibatch_size']}", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=png_metadata())
    plt.close(fig)


def command(args: argparse.Namespace, spec: Any) -> int:
    """Runs ``odc-bench trainer`` (the parsed command line, the model); returns the exit status."""
    import dataclasses

    from . import _check_outputs, _input_lengths, _minibatch_sizes, _progress_flag, _title, launch
    from .report import Progress, say_written, write_json

    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else args.world
    if world < 2:
        raise UsageError(f"--world {world}: need at least 2 ranks")
    cores = os.cpu_count() or 1
    if world > cores and not launch.under_torchrun():
        raise UsageError(f"--world {world}: real compute needs a core per rank and this host has {cores}")
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: need at least 2 (the first step is not timed)")
    sizes = _minibatch_sizes(args, "trainer")
    _check_outputs(args)
    lengths, synthetic = _input_lengths(args, DEFAULT_SYNTHETIC)
    long = [n for n in lengths if n > args.max_length]
    if long:
        raise UsageError(f"{len(long)} samples are longer than --max-length {args.max_length} (the longest "
                         f"{max(long)}); TRL's bfd packing would cut them")
    need = needed_tokens(args.steps, max(sizes), world, args.max_length)
    total, take = 0, 0
    while take < len(lengths) and total < need:
        total += lengths[take]
        take += 1
    if total < need:
        raise UsageError(f"the samples hold {total} tokens; {args.steps} steps of {max(sizes)} packed rows of "
                         f"{args.max_length} tokens on {world} ranks need about {need} (more samples, or fewer steps)")
    title = [_title("trainer"), f"{spec.describe()}; {world} ranks; SFTTrainer packing=bfd padding_free, max_length "
             f"{args.max_length}; {args.steps} steps (the first not timed), {args.repeats} interleaved repeats; "
             f"{take} samples of {'--lengths ' + args.lengths if synthetic is None else '--synthetic ' + synthetic}"]
    bar = Progress(len(sizes) * args.repeats * len(ARMS), "trainer", _progress_flag(args))
    try:
        res = launch.run_ranks(trainer_rank, world, backend="gloo",
                               on_event=lambda kind, note: bar.step(note) if kind == "progress" else None,
                               spec=dataclasses.asdict(spec), lengths=lengths[:take], sizes=sizes, steps=args.steps,
                               repeats=args.repeats, max_length=args.max_length, lr=args.lr, clip=args.clip,
                               timeout=args.timeout, seed=args.seed)
    finally:
        bar.close()
    if res is None:  # a rank of a torchrun job other than 0
        return 0
    points = summarize(res["runs"], sizes)
    print(render(points, title))
    if args.json:
        write_json(args.json, {"bench": "trainer", "arms": list(ARMS), "baseline": BASELINE, "world": world,
                               "model": spec.describe(), "samples": take, "lengths_source": synthetic or args.lengths,
                               "args": {k: v for k, v in vars(args).items() if k != "func"}, "points": points,
                               "runs": res["runs"]})
    if args.plot:
        plot(points, args.plot, title[0])
    say_written(args.json, args.plot)
    return 0 if all(p["same_samples"] for p in points) else 1
