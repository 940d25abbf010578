"""The GRPO step of :mod:`odc.integrations.transformers`: TRL's ``GRPOTrainer`` optimisation step on ODC.

``GRPOTrainer`` generates a step's completions once (``steps_per_generation``
equal to ``gradient_accumulation_steps``) and then runs its loss over
``gradient_accumulation_steps`` equal slices of them on every rank, each
padded to its longest completion. Completion lengths differ (the RL case), so
a rank whose slices hold long completions sets everyone's pace. On ODC each
rank instead runs its own completions in as few microbatches as a token
budget allows (:func:`plan_rows`: longest first, each microbatch as many rows
as fit ``rows × width``), so the ranks run different microbatch counts.

Each microbatch's loss is TRL's own ``_compute_loss`` over its rows, with the
trainer's ``current_gradient_accumulation_steps`` set per microbatch
(:func:`accumulation`) so that the ranks' microbatch losses add up to the loss
of one process over the step's completions, whatever the split. TRL's metrics
(``accelerator.reduce`` / ``gather`` in every microbatch: a collective per
microbatch, which uneven counts cannot make) run locally and cross the ranks
once per step (:func:`local_metrics`).

Nothing here imports transformers or TRL; the caller passes the trainer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, ProtocolError

#: Loss types whose per-microbatch normalizer :func:`accumulation` can set to the step's global one.
LOSS_TYPES = ("dapo", "cispo", "vespo", "grpo", "sapo", "luspo", "dr_grpo")
_TOKEN_NORMALIZED = ("dapo", "cispo", "vespo")  # divide by num_items_in_batch (the step's loss tokens)
_ROW_NORMALIZED = ("grpo", "sapo", "luspo", "dr_grpo")  # a mean over the microbatch's rows
_WHAT = "odc.integrations.transformers"


class Ready(dict):  # type: ignore[type-arg]
    """A microbatch of completions already generated and scored (``_prepare_inputs`` hands it on as it is)."""


def refuse(trainer: Any) -> None:
    """Raises ConfigError naming the first ``GRPOTrainer`` setting the ODC step does not support."""
    args = trainer.args
    no = f"{_WHAT}: GRPOTrainer with "
    checks = [
        (getattr(trainer, "use_vllm", False), "use_vllm (generation outside the trainer's model) is not supported; "
         "generate with transformers' generate"),
        (getattr(trainer, "use_transformers_continuous_batching", False),
         "use_transformers_continuous_batching is not supported; use transformers' generate"),
        (getattr(trainer, "rollout_func", None) is not None, "a rollout_func is not supported"),
        (bool(getattr(trainer, "tools", None)) or getattr(trainer, "environment_factories", None) is not None,
         "tools or environments are not supported"),
        (getattr(trainer, "_is_vlm", False), "a vision-language model is not supported"),
        (getattr(trainer, "beta", 0.0) != 0.0, f"beta={trainer.beta} (a reference model's KL term) is not supported; "
         "set beta=0.0"),
        (getattr(trainer, "num_iterations", 1) != 1, f"num_iterations={trainer.num_iterations} is not supported; "
         "each step's completions are used once"),
        (args.steps_per_generation != args.gradient_accumulation_steps,
         f"steps_per_generation={args.steps_per_generation} is not supported; it must equal "
         f"gradient_accumulation_steps ({args.gradient_accumulation_steps}): one generation per optimizer step"),
        (trainer.loss_type not in LOSS_TYPES,
         f"loss_type={trainer.loss_type!r} is not supported (its loss is a mean over each microbatch's tokens, which "
         f"depends on how the plan packs); one of {', '.join(LOSS_TYPES)}"),
        (getattr(trainer, "_entropy_bonus_enabled", False),
         "an entropy bonus (entropy_coef / use_adaptive_entropy) is not supported"),
        (getattr(trainer, "top_entropy_quantile", 1.0) < 1.0,
         f"top_entropy_quantile={trainer.top_entropy_quantile} is not supported (a quantile over every rank's "
         "tokens in each microbatch)"),
        (getattr(trainer, "aux_loss_enabled", False), "a router aux loss (output_router_logits) is not supported"),
    ]
    for refused, why in checks:
        if refused:
            raise ConfigError(no + why)


def plan_rows(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """This rank's microbatches: indices into ``lengths`` (each row's tokens, padding excluded), longest first,
    each microbatch as many rows as ``rows × its longest row ≤ max_tokens`` allows (a row over the budget alone).

    Raises:
        ConfigError: ``max_tokens`` is not positive.
    """
    if max_tokens < 1:
        raise ConfigError(f"{_WHAT}: a microbatch budget of {max_tokens} tokens; a positive number")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def completion_lengths(rollout: dict[str, Any]) -> list[int]:
    """Each row's completion tokens (its ``completion_mask``; a row TRL masked out whole counts 0)."""
    return [int(n) for n in rollout["completion_mask"].sum(1).tolist()]


def select(rollout: dict[str, Any], rows: Sequence[int]) -> Ready:
    """The microbatch of ``rows`` of a rank's rollout, its completion columns cut to its longest completion.

    The prompt columns stay as generated (left padding included): the model's positions count from the row's
    start, so cutting them would change its logits.
    """
    n = int(rollout["completion_ids"].shape[0])
    width = max([1, *(completion_lengths(rollout)[i] for i in rows)])
    full = int(rollout["completion_ids"].shape[1])
    index = torch.tensor(list(rows), dtype=torch.long, device=rollout["completion_ids"].device)
    out = Ready()
    for key, value in rollout.items():
        kept = value
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n:
            kept = value.index_select(0, index)
            if kept.dim() >= 2 and kept.shape[1] == full and not key.startswith("prompt"):
                kept = kept[:, :width]
        out[key] = kept
    return out


def accumulation(loss_type: str, steps_per_generation: int, rows_global: int, world: int, rows: int) -> float:
    """The ``current_gradient_accumulation_steps`` under which TRL's ``_compute_loss`` of a microbatch of ``rows``
    rows is ``world ×`` its share of one process's loss over the step (ranks' gradients are averaged).

    Token-normalized losses divide by ``num_items_in_batch / world × this / steps_per_generation``: this is
    ``steps_per_generation``. Row means divide the microbatch's mean by this: ``rows_global / (world × rows)``
    makes it a sum over the step's ``rows_global`` rows.
    """
    if loss_type in _TOKEN_NORMALIZED:
        return float(steps_per_generation)
    if loss_type in _ROW_NORMALIZED:
        return rows_global / (world * rows)
    raise ConfigError(f"{_WHAT}: loss_type={loss_type!r}; one of {', '.join(LOSS_TYPES)}")


def metric_names(loss_type: str) -> tuple[list[str], list[tuple[str, str]]]:
    """TRL 1.16's metrics of one microbatch of ``_compute_loss`` (with ``beta=0``, no entropy bonus): the
    ``accelerator.reduce`` ones (a masked mean: sum and count) and the ``accelerator.gather`` ones (with their
    ``min`` / ``max``), each in call order."""
    reduces = ["entropy"]
    gathers: list[tuple[str, str]] = []
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        reduces += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
        gathers += [("clip_ratio/low_min", "min"), ("clip_ratio/high_max", "max")]
    elif loss_type == "cispo":
        reduces.append("cispo_clip_ratio")
    elif loss_type == "vespo":
        reduces.append("vespo/phi_seq_mean")
    return reduces, gathers


@contextlib.contextmanager
def local_metrics(trainer: Any, finish: Any, microbatches: int, checked: str) -> Iterator[None]:
    """Inside the block TRL's per-microbatch ``accelerator.reduce`` / ``gather`` of its metrics stay local; at its
    end ``finish()`` runs (the minibatch's gradients: a rank that ran less waits for nothing of its peers' in the
    all-reduces) and the step logs one entry of each metric over every rank's completions: masked means over
    every loss token, the clip ratios' min and max over every row."""
    acc = trainer.accelerator
    reduced: list[torch.Tensor] = []
    gathered: list[torch.Tensor] = []

    def reduce(tensor: torch.Tensor, reduction: str = "sum", **_: Any) -> torch.Tensor:
        reduced.append(tensor.detach().double().reshape(-1).cpu())
        return tensor

    def gather(tensor: torch.Tensor) -> torch.Tensor:
        gathered.append(tensor.detach().double().reshape(-1).cpu())
        return tensor

    metrics = trainer._metrics["train"]
    before = {key: len(values) for key, values in metrics.items()}
    acc.reduce, acc.gather = reduce, gather
    try:
        yield
    finally:
        del acc.reduce, acc.gather
    names, extremes = metric_names(trainer.loss_type)
    if len(reduced) != len(names) * microbatches or len(gathered) != len(extremes) * microbatches:
        raise ProtocolError(
            f"{_WHAT}: TRL's GRPOTrainer._compute_loss made {len(reduced)} reduces and {len(gathered)} gathers over "
            f"{microbatches} microbatches, expected {len(names)} and {len(extremes)} per microbatch (checked on TRL "
            f"{checked})"
        )
    device = trainer.args.device
    sums = torch.zeros(len(names), 2, dtype=torch.float64)
    for i, t in enumerate(reduced):
        sums[i % len(names)] += t[:2]
    lows = torch.full((max(len(extremes), 1),), math.inf, dtype=torch.float64)
    for i, t in enumerate(gathered):
        k = i % len(extremes)
        values = t[~torch.isnan(t)]
        if values.numel():
            lows[k] = min(float(lows[k]), float(values.min() if extremes[k][1] == "min" else -values.max()))
    finish()
    sums, lows = sums.to(device), lows.to(device)
    dist.all_reduce(sums)  # once per step, on every rank
    dist.all_reduce(lows, op=dist.ReduceOp.MIN)
    sums, lows = sums.cpu(), lows.cpu()
    for key in list(metrics):
        del metrics[key][before.get(key, 0):]
    for name, (total, count) in zip(names, sums.tolist(), strict=True):
        metrics[name].append(total / max(count, 1.0))
    for (name, kind), low in zip(extremes, lows.tolist(), strict=False):
        metrics[name].append(math.nan if math.isinf(low) else (low if kind == "min" else -low))
    for key in [k for k, values in metrics.items() if not values]:
        del metrics[key]  # TRL's log divides by each list's length
