"""The data path of :mod:`odc.integrations.transformers`: a step loader that hands each rank its packed microbatches.

A Hugging Face ``Trainer`` takes ``gradient_accumulation_steps`` batches per
optimizer step from its data loader and steps after the last. This loader
keeps that count and that point on every rank: per optimizer step it yields
``calls`` items, the first ``calls - 1`` of them :data:`PLACEHOLDER` (nothing
to run) and the last a :class:`Step`, this rank's whole share of the step
(possibly no microbatch at all). So the Trainer's clip, optimizer step,
scheduler, logging, saving and evaluation come at the same point on every
rank, whatever each rank runs.

A step's samples are ``rows_per_step`` consecutive rows of the epoch's order
(a permutation fixed by ``seed + epoch``, as accelerate seeds its sampler, or
the dataset's order); a row that packs several samples (TRL's ``packing=True``:
a ``seq_lengths`` column) is cut back into them. Every rank computes the same
:func:`odc.packing.plan` of the step from every sample's length (no
collective), runs its own microbatches, and knows the step's global count of
loss tokens. A microbatch is one row of whole samples back to back with
``position_ids`` restarting at each, the label at each sample's start set to
-100 (what TRL's and transformers' padding-free collators emit).

Nothing here imports transformers or TRL: the caller passes the trainer's
collator and says which format the rows take.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import packing
from ..errors import ConfigError, PackingError

#: Keys a per-sample collator output may hold: what a packed row carries, and what it recomputes (positions and
#: the sequence boundaries of padding-free collators).
_PER_TOKEN = ("input_ids", "labels", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
              "max_length_q", "max_length_k", "seq_idx")


class _Placeholder:
    """An item of the loader with nothing to run (the Trainer's first ``gradient_accumulation_steps - 1`` batches
    of a step)."""

    def __repr__(self) -> str:
        return "PLACEHOLDER"

    def __reduce__(self) -> str:
        return "PLACEHOLDER"  # one object across the loader's worker processes


PLACEHOLDER = _Placeholder()


@dataclasses.dataclass
class Step:
    """This rank's share of one optimizer step.

    Attributes:
        microbatches: this rank's packed rows, each a dict of model inputs with a batch dimension of 1.
        tokens: the step's loss tokens over every rank (labels other than -100 after the causal shift).
        count: the step's microbatches over every rank.
        rank_tokens: this rank's input tokens (every position of its rows).
        dummy: tokens of the zero-loss microbatch among ``microbatches`` (:attr:`Layout.at_least_one`), else 0.
    """

    microbatches: list[dict[str, Any]]
    tokens: int
    count: int
    rank_tokens: int
    dummy: int = 0


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the step loader cuts, plans and packs (the same on every rank).

    Attributes:
        world: the ranks; rank: this one.
        rows_per_step: dataset rows per optimizer step (``per_device_train_batch_size ×
            gradient_accumulation_steps × world``).
        calls: the Trainer's batches per step (``gradient_accumulation_steps``).
        shuffle: a new order every epoch (``seed + epoch``); else the dataset's order.
        seed: the order's seed.
        drop_last: leave out the last step where it has fewer rows than ``rows_per_step``.
        max_tokens: a microbatch's token budget, or None: ``rows_per_device`` times the step's longest sample.
        rows_per_device: ``per_device_train_batch_size``.
        strategy, cost: as :func:`odc.packing.plan` takes them.
        trl: rows in TRL's padding-free format (with ``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``); else
            transformers' ``DataCollatorWithFlattening`` format, its flash-attention keys only when ``flash``.
        flash: add the sequence boundaries flash attention reads (``cu_seq_lens_*``, ``max_length_*``).
        no_cache: add ``use_cache=False`` (a model with a cache builds no per-sample mask from ``position_ids``).
        at_least_one: a rank the plan gives no microbatch runs one zero-loss one (:data:`DUMMY_LENGTH` tokens, every
            label -100), so that collectives at each rank's last microbatch happen on every rank.
    """

    world: int
    rank: int
    rows_per_step: int
    calls: int
    shuffle: bool
    seed: int
    drop_last: bool
    max_tokens: int | None
    rows_per_device: int
    strategy: str = "lb-mini"
    cost: Any = "quadratic"
    trl: bool = False
    flash: bool = False
    no_cache: bool = False
    at_least_one: bool = False


DUMMY_LENGTH = 16
"""Tokens of the zero-loss microbatch of :attr:`Layout.at_least_one`."""


def steps_per_epoch(rows: int, layout: Layout) -> int:
    """Optimizer steps in one pass over ``rows`` dataset rows."""
    whole, rest = divmod(rows, layout.rows_per_step)
    return whole if layout.drop_last or not rest else whole + 1


def epoch_order(rows: int, epoch: int, layout: Layout) -> list[int]:
    """The rows of epoch ``epoch`` in the order the steps take them."""
    if not layout.shuffle:
        return list(range(rows))
    return torch.randperm(rows, generator=torch.Generator().manual_seed(layout.seed + epoch)).tolist()


def split_row(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples of one dataset row: the row itself, or, where it packs several (a ``seq_lengths`` list, as
    TRL's packing adds), each sample's slice of every per-token field."""
    if "seq_lengths" not in row:
        return [row]
    lengths = [int(n) for n in row["seq_lengths"]]
    total = sum(lengths)
    samples: list[dict[str, Any]] = [{} for _ in lengths]
    for key, value in row.items():
        if key == "seq_lengths":
            continue
        if hasattr(value, "__len__") and not isinstance(value, str) and len(value) == total:
            at = 0
            for sample, n in zip(samples, lengths, strict=True):
                sample[key] = value[at:at + n]
                at += n
        else:
            for sample in samples:
                sample[key] = value
    return samples


def collate_sample(collator: Callable[[list[Any]], Any], sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of one sample, 1-D, as the trainer's collator makes them for a batch of this sample
    alone, its padding (``attention_mask`` 0) left out.

    Raises:
        ConfigError: the collator gives no ``labels``, or keys a packed row cannot carry.
    """
    out = collator([sample])
    if "labels" not in out:
        raise ConfigError(
            "odc.integrations.transformers: the data collator gives no 'labels' (keys: "
            f"{sorted(out)}); the loss of a packed row needs them"
        )
    extra = sorted(k for k in out if k not in _PER_TOKEN)
    if extra:
        raise ConfigError(
            f"odc.integrations.transformers: the data collator gives {extra}, which a packed row of several "
            f"samples does not carry (it holds {list(_PER_TOKEN[:2])} and recomputes the others of {list(_PER_TOKEN)})"
        )
    ids = torch.as_tensor(out["input_ids"]).reshape(-1)
    labels = torch.as_tensor(out["labels"]).reshape(-1)
    if "attention_mask" in out:
        keep = torch.as_tensor(out["attention_mask"]).reshape(-1).bool()
        ids, labels = ids[keep], labels[keep]
    return ids, labels


def loss_tokens(labels: torch.Tensor) -> int:
    """The positions of one sample that carry a loss: its labels after the causal shift that are not -100."""
    return int((labels[1:] != -100).sum())


def pack(samples: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: Layout) -> dict[str, Any]:
    """One microbatch: ``samples`` back to back in one row, in the padding-free format (see :class:`Layout`)."""
    ids = torch.cat([s[0] for s in samples])[None]
    labels = torch.cat([s[1] for s in samples]).clone()[None]
    positions = torch.cat([torch.arange(len(s[0])) for s in samples])[None]
    labels[positions == 0] = -100  # no sample predicts the next one's first token
    row: dict[str, Any] = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if layout.trl or layout.flash:
        cu = torch.tensor([0, *torch.tensor([len(s[0]) for s in samples]).cumsum(0).tolist()], dtype=torch.int32)
        row["cu_seq_lens_q"] = row["cu_seq_lens_k"] = cu
        row["max_length_q"] = row["max_length_k"] = int(cu.diff().max())
        if layout.trl:
            row["seq_idx"] = torch.repeat_interleave(torch.arange(len(samples), dtype=torch.int32), cu.diff())[None]
    if layout.no_cache:
        row["use_cache"] = False
    return row


class StepSampler(torch.utils.data.Sampler[list[tuple[int, int, int]]]):
    """The loader's batch sampler: ``[(epoch, step, call)]`` for every step of the epoch and call of the step.

    Its epoch is set by the Trainer (``set_epoch``) and by the integration before each epoch (a resumed epoch's
    loader is rebuilt by accelerate's ``skip_first_batches`` around this same sampler).
    """

    def __init__(self, steps: int, calls: int) -> None:
        self.steps, self.calls, self.epoch = steps, calls, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps * self.calls

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        epoch = self.epoch
        for step in range(self.steps):
            for call in range(self.calls):
                yield [(epoch, step, call)]


class StepDataset(torch.utils.data.Dataset[Any]):
    """Item ``(epoch, step, call)``: :data:`PLACEHOLDER`, or this rank's :class:`Step` at the step's last call.

    Its length is the dataset's row count (what the Trainer reports as examples); the sampler decides what is
    taken.
    """

    def __init__(self, rows: Any, collator: Callable[[list[Any]], Any], layout: Layout) -> None:
        self.rows, self.collator, self.layout = rows, collator, layout

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: tuple[int, int, int]) -> Any:
        epoch, step, call = index
        if call != self.layout.calls - 1:
            return PLACEHOLDER
        return self.step(epoch, step)

    def step_rows(self, epoch: int, step: int) -> list[int]:
        """The dataset rows of optimizer step ``step`` (counted from the epoch's start) of epoch ``epoch``."""
        order = epoch_order(len(self.rows), epoch, self.layout)
        per = self.layout.rows_per_step
        return order[step * per:(step + 1) * per]

    def step(self, epoch: int, step: int) -> Step:
        """This rank's :class:`Step`: every rank plans the same samples alike and keeps its own microbatches."""
        layout = self.layout
        samples = [collate_sample(self.collator, s) for i in self.step_rows(epoch, step)
                   for s in split_row(dict(self.rows[i]))]
        if not samples:
            raise ConfigError(f"odc.integrations.transformers: step {step} of epoch {epoch} has no sample")
        lengths = [len(ids) for ids, _ in samples]
        budget = layout.max_tokens or layout.rows_per_device * max(lengths)
        try:
            plan = packing.plan(lengths, world_size=layout.world, minibatch_size=math.ceil(len(lengths) / layout.world),
                                strategy=layout.strategy, max_tokens=budget, cost=layout.cost)
        except PackingError as e:
            raise ConfigError(
                f"odc.integrations.transformers: step {step} of epoch {epoch}: samples of {sorted(lengths)[-3:]} "
                f"tokens (the longest) under a microbatch budget of {budget} tokens: {e}"
            ) from None
        if plan.num_minibatches != 1:  # the planner's contract: M·D samples make one minibatch
            raise ConfigError(f"odc.integrations.transformers: the plan of step {step} has {plan.num_minibatches} "
                              "minibatches, expected 1")
        ranks = plan.minibatches[0]
        mine = [pack([samples[i] for i in mb], layout) for mb in ranks[layout.rank]]
        rank_tokens = sum(int(mb["input_ids"].numel()) for mb in mine)
        dummy = 0
        if not mine and layout.at_least_one:
            mine = [pack([(samples[0][0][:1].repeat(DUMMY_LENGTH), torch.full((DUMMY_LENGTH,), -100))], layout)]
            dummy = DUMMY_LENGTH
        return Step(microbatches=mine, tokens=sum(loss_tokens(labels) for _, labels in samples),
                    count=sum(len(r) for r in ranks), rank_tokens=rank_tokens, dummy=dummy)


def first(batch: list[Any]) -> Any:
    """The loader's collate function: its batches hold one item."""
    return batch[0]
