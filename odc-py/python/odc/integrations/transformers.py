"""Hugging Face ``Trainer``, TRL's ``SFTTrainer`` and ``GRPOTrainer`` on ODC: ``odc.integrations.transformers.enable``.

A ``Trainer`` runs ``gradient_accumulation_steps`` microbatches per rank per
optimizer step and decides when to step from a global microbatch counter, so
every rank must run the same count: the heaviest rank's packed rows set
everyone's pace. One call before ``trainer.train()`` changes that, the user's
script, ``TrainingArguments`` and launch command (``accelerate launch`` with
an FSDP2 config, or ``torchrun``) otherwise unchanged::

    trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset)
    odc.integrations.transformers.enable(trainer)
    trainer.train()

:func:`enable` turns the trainer into an instance of a subclass of its own
class (so ``SFTTrainer``'s own ``compute_loss``, callbacks and logging stay)
that

- plans each optimizer step's samples over the whole global batch
  (``per_device_train_batch_size × gradient_accumulation_steps × world``
  dataset rows; rows that TRL packed are cut back into their samples) with
  LB-Mini, every rank alike from every sample's length, and hands each rank
  its own packed microbatches (rows of whole samples with ``position_ids``
  restarting per sample, TRL's padding-free format), some ranks none;
- keeps the Trainer's step point: from the Trainer's side every rank still
  takes ``gradient_accumulation_steps`` batches per step, all of them empty but
  the last, which is this rank's whole share; its ``training_step`` runs a
  forward and backward per microbatch (ODC pushes the gradients) and returns
  the rank's share of the loss. The clip (``max_grad_norm``: its read of
  ``.grad`` finishes the minibatch under ODC's gradient contract), the
  optimizer step, the scheduler, logging, evaluation and ``save_steps`` then
  happen at the same point on every rank;
- normalizes the loss by the step's global count of loss tokens, which every
  rank knows from the plan (Trainer's ``num_items_in_batch``, here without its
  all-gather): the gradients are those of one process over the step's
  samples, and the logged loss (Trainer's mean over ranks of each rank's
  share) is the step's global mean;
- puts the model and optimizer as accelerate prepared them (FSDP2,
  ``fsdp_version: 2``) on ODC with ``odc.fsdp.enable`` at the first training
  step, after any checkpoint was loaded.

Under TRL's ``SFTTrainer`` its per-microbatch metric gathers (entropy, token
accuracy, token count) would be a collective per microbatch, which uneven
counts cannot make: they run locally and are summed once per step instead.

Refused by name (:class:`odc.ConfigError`): DeepSpeed, FSDP1 through
accelerate, no FSDP, tensor, context and sequence parallelism, HSDP
(``dp_replicate_size``), a model split over devices or sharded at load time,
parameter offload, an iterable dataset, ``auto_find_batch_size``, a sampling
strategy other than ``random`` or ``sequential``,
``average_tokens_across_devices=False``, a loss that is not normalized by
``num_items_in_batch``, and TRL trainers other than ``SFTTrainer`` and
``GRPOTrainer``.

TRL's ``GRPOTrainer`` keeps its own loader, generation (once per optimizer
step, at the step's first batch), rewards and advantages; at the step's last
batch each rank runs its own completions in as few microbatches as a token
budget allows, its count its own, with TRL's loss normalized over the whole
step (:mod:`._hf_grpo`, which also lists what it refuses).

``enable(trainer, accumulation="fsdp2-accum")`` runs the same plan without
ODC, under FSDP2's own gradient accumulation: the baseline ``odc-bench
trainer`` measures ODC against. ``accumulation="odc-accum"`` is both: each
rank accumulates its own microbatches' gradients as FSDP2 does and pushes
them on ODC once, at its last microbatch (ZeRO-2's gradient memory, one
push per step, and still no collective: a rank the plan gives nothing runs
nothing).

On CPU ranks (``use_cpu=True``) accelerate 1.15 turns FSDP off whatever its
config says (its FSDP is for accelerators); :func:`enable` turns accelerate's
FSDP on for them, with the plugin the launch asked for, so the same script
runs on a CPU machine over gloo.

The transformers, accelerate and TRL internals read here are checked against
:data:`TRANSFORMERS_VERSIONS_CHECKED`, :data:`ACCELERATE_VERSIONS_CHECKED` and
:data:`TRL_VERSIONS_CHECKED` (another version warns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from .. import fsdp as odc_fsdp
from .. import packing
from ..engine import check_engine_options, compress_args
from ..errors import ConfigError, PackingError, ProtocolError
from . import _hf_data, _hf_grpo
from ._guard import import_trainer

__all__ = ["ACCELERATE_VERSIONS_CHECKED", "ACCUM_ON_ODC", "FSDP2_ACCUM", "TRANSFORMERS_VERSIONS_CHECKED",
           "TRL_VERSIONS_CHECKED", "enable"]

TRANSFORMERS_VERSIONS_CHECKED = ("5.9.0", "5.24.0")
"""transformers versions whose ``Trainer`` this module was checked against (another one warns)."""
ACCELERATE_VERSIONS_CHECKED = ("1.15.0",)
"""accelerate versions checked (another one warns)."""
TRL_VERSIONS_CHECKED = ("1.16.0",)
"""TRL versions whose ``SFTTrainer`` this module was checked against (another one warns)."""

_ADVICE = "compare a few steps against the same trainer without ODC"
FSDP2_ACCUM = "fsdp2-accum"
"""``enable``'s ``accumulation`` without ODC: LB-Mini's plan under FSDP2's own gradient accumulation."""
ACCUM_ON_ODC = "odc-accum"
"""``enable``'s ``accumulation`` on ODC with FSDP2's own accumulation: one push per group per step and rank."""
_ACCUMULATIONS = ("odc", ACCUM_ON_ODC, FSDP2_ACCUM)
_CROSS_NODE = ("auto", "node", "direct")
_WHAT = "odc.integrations.transformers"


def enable(trainer: Any, *, max_tokens: int | None = None, strategy: str = "lb-mini",
           cost: str | packing.CostFit = "quadratic", timeout: float | None = None,
           transport: str | None = None, accumulation: str = "odc", compress: Mapping[str, Any] | None = None,
           cross_node: str | None = None, deterministic: bool = False) -> Any:
    """Makes ``trainer`` (a ``transformers.Trainer``, ``trl.SFTTrainer`` or ``trl.GRPOTrainer``, or a subclass) train
    on ODC.

    Call on every rank, after building the trainer and before ``trainer.train()``. The trainer is changed in
    place (its class becomes a subclass of its own) and returned. Calling it again does nothing.

    Args:
        trainer: the trainer, set up for FSDP2 through accelerate (``fsdp_version: 2`` in accelerate's config,
            or ``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``).
        max_tokens: a microbatch's token budget. Default: ``per_device_train_batch_size`` times TRL's
            ``max_length`` where the arguments have one (a row of TRL's packing), else times the step's
            longest sample: what one of the Trainer's own microbatches holds at most.
        strategy: how a step's samples are planned (:data:`odc.packing.STRATEGIES`): ``"lb-mini"`` (each rank
            its own microbatch count), or ``"lb-micro"`` / ``"local-sort"`` (the same count on every rank).
        cost: the planner's cost model (a name of :data:`odc.packing.COST_MODELS` or a
            :class:`odc.packing.CostFit`).
        timeout: seconds any wait on a peer may take (default: as ``odc.fsdp.enable``).
        transport: as ``odc.fsdp.enable``.
        accumulation: ``"odc"``, or ``"fsdp2-accum"``: the same plan without ODC, under FSDP2's own gradient
            accumulation (``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` on all but
            each rank's last microbatch, so that every rank makes one reduce-scatter per group whatever its count;
            a rank the plan gives nothing runs one zero-loss microbatch). Pair it with
            ``fsdp_config={"reshard_after_forward": False}`` for one all-gather per group per step: ZeRO-2's
            memory. The baseline ``odc-bench trainer`` measures ODC against; ``Trainer`` and ``SFTTrainer`` only.
            ``"odc-accum"``: on ODC, with the same toggles: each rank's gradients accumulate unsharded over its
            microbatches and are pushed once, at its last one (ZeRO-2's gradient memory, one push per group per
            step); a rank the plan gives nothing runs nothing, as under ``"odc"``. ``Trainer`` and
            ``SFTTrainer`` only.
        compress: as ``odc.fsdp.enable``: compressed pushes and gathers across nodes, e.g. ``{"gather": "fp8",
            "push": "int8"}`` (docs/benchmarks/compression.md). Default None: nothing compressed.
        cross_node: as ``odc.fsdp.enable``: how gradients cross nodes (``"auto"``, ``"node"``, ``"direct"``).
        deterministic: as ``odc.fsdp.enable``: bitwise-reproducible sums, whichever rank ran which microbatch.

    Returns:
        The same trainer.

    Raises:
        ConfigError: transformers or accelerate is missing, or a setting ODC does not support (named).
    """
    trainer_cls = _imports()
    if not isinstance(trainer, trainer_cls):
        raise ConfigError(f"{_WHAT}.enable takes a transformers.Trainer; got {type(trainer).__name__}")
    if isinstance(trainer, (_OdcTrainer, _OdcGRPOTrainer)):
        return trainer
    if strategy not in packing.STRATEGIES or strategy == "verl-native":
        raise ConfigError(f"{_WHAT}: strategy={strategy!r}; one of 'lb-mini', 'lb-micro', 'local-sort'")
    if accumulation not in _ACCUMULATIONS:
        raise ConfigError(f"{_WHAT}: accumulation={accumulation!r}; one of {', '.join(map(repr, _ACCUMULATIONS))}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"{_WHAT}: max_tokens={max_tokens!r}; a positive number of tokens, or None")
    try:  # the cost model's name, checked before the first step plans with it
        packing.plan([1], world_size=1, minibatch_size=1, strategy=strategy, max_tokens=1, cost=cost)
    except PackingError as e:
        raise ConfigError(f"{_WHAT}: cost={cost!r}: {e}") from None
    engine_options = _engine_options(accumulation, compress, cross_node, deterministic)
    kind = _trl_kind(trainer)
    _fsdp_on_cpu(trainer)
    _refuse(trainer)
    if kind == "grpo":
        if accumulation != "odc":
            raise ConfigError(f"{_WHAT}: accumulation={accumulation!r} is for Trainer and SFTTrainer; GRPOTrainer "
                              "runs on ODC")
        _hf_grpo.refuse(trainer)
    if accumulation == FSDP2_ACCUM and getattr(trainer.accelerator.state.fsdp_plugin, "reshard_after_forward",
                                               None) is not False:
        raise ConfigError(f"{_WHAT}: accumulation={FSDP2_ACCUM!r} needs fsdp_config={{'reshard_after_forward': False}} "
                          "(accelerate's fsdp_reshard_after_forward: false): each rank gathers once per step, whatever "
                          "its microbatch count")
    args = trainer.args
    rows_limit = getattr(args, "max_length", None) if kind == "sft" else None
    trainer._odc = _Settings(max_tokens=max_tokens, row_limit=rows_limit, strategy=strategy, cost=cost,
                             timeout=timeout, transport=transport, trl=kind == "sft",
                             accumulation=accumulation, engine_options=engine_options)
    trainer.__class__ = _subclass(type(trainer), _OdcGRPOTrainer if kind == "grpo" else _OdcTrainer)
    return trainer


def _engine_options(accumulation: str, compress: Mapping[str, Any] | None, cross_node: str | None,
                    deterministic: bool) -> dict[str, Any]:
    """``odc.fsdp.enable``'s settings given to :func:`enable`, checked before training starts."""
    options: dict[str, Any] = {}
    if compress is not None:
        compress_args(compress)  # keys, formats, block size: named now, not at the first step
        options["compress"] = dict(compress)
    if cross_node is not None:
        if cross_node not in _CROSS_NODE:
            raise ConfigError(f"{_WHAT}: cross_node={cross_node!r}; one of {', '.join(map(repr, _CROSS_NODE))}")
        options["cross_node"] = cross_node
    if not isinstance(deterministic, bool):
        raise ConfigError(f"{_WHAT}: deterministic={deterministic!r}; True or False")
    if deterministic:
        options["deterministic"] = True
    try:  # what the engine would refuse at the first step: named now
        check_engine_options(compress=compress, cross_node=cross_node, deterministic=deterministic)
    except ConfigError as e:
        raise ConfigError(f"{_WHAT}: {e}") from None
    if options and accumulation == FSDP2_ACCUM:
        raise ConfigError(f"{_WHAT}: {', '.join(sorted(options))} with accumulation={FSDP2_ACCUM!r}, which trains "
                          "on FSDP2's collectives, not on ODC")
    return options


@dataclasses.dataclass
class _Settings:
    """What :func:`enable` was given, and the state of the ODC trainer."""

    max_tokens: int | None
    row_limit: int | None
    strategy: str
    cost: Any
    timeout: float | None
    transport: str | None
    trl: bool
    accumulation: str = "odc"  # one of _ACCUMULATIONS
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # odc.fsdp.enable's, as given
    sampler: _hf_data.StepSampler | None = None
    optimizer: Any = None
    started: float = 0.0  # GRPO: when the step's first batch began
    calls: int = 0  # GRPO: the Trainer's batches so far (its step's position)
    rollout: Any = None  # GRPO: this rank's completions of the step, generated at its first batch


def _imports() -> Any:
    import_trainer("transformers", TRANSFORMERS_VERSIONS_CHECKED, _ADVICE, extra="hf", integration=_WHAT)
    import_trainer("accelerate", ACCELERATE_VERSIONS_CHECKED, _ADVICE, extra="hf", integration=_WHAT)
    from transformers import Trainer

    return Trainer


def _trl_kind(trainer: Any) -> str | None:
    """``"sft"`` for TRL's ``SFTTrainer``, ``"grpo"`` for its ``GRPOTrainer`` (or a subclass), None for a trainer of
    transformers; other TRL trainers are refused."""
    trl_classes = [c for c in type(trainer).__mro__ if c.__module__.split(".", 1)[0] == "trl"]
    if not trl_classes:
        return None
    import_trainer("trl", TRL_VERSIONS_CHECKED, _ADVICE, extra="hf", integration=_WHAT)
    from trl import GRPOTrainer, SFTTrainer

    if isinstance(trainer, SFTTrainer):
        return "sft"
    if isinstance(trainer, GRPOTrainer):
        return "grpo"
    raise ConfigError(
        f"{_WHAT}: {trl_classes[0].__name__} is not supported (its step is not a loss over dataset rows that "
        "can be packed); TRL's SFTTrainer and GRPOTrainer are"
    )


def _fsdp_on_cpu(trainer: Any) -> None:
    """On CPU ranks accelerate leaves FSDP off (its FSDP is for accelerators): turn it on with the plugin the launch
    asked for (``accelerate launch``'s FSDP config, or the ``fsdp`` training arguments)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    asked = trainer.args.fsdp_plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if state.distributed_type != DistributedType.MULTI_CPU or not asked or trainer.is_fsdp_enabled:
        return
    kwargs = trainer.args.fsdp_plugin_args or {}
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True


def _refuse(trainer: Any) -> None:
    """Raises ConfigError naming the first setting ODC does not support."""
    args = trainer.args
    no = f"{_WHAT}: "
    if trainer.is_deepspeed_enabled:
        raise ConfigError(no + "DeepSpeed is not supported (ODC replaces FSDP2's collectives); use FSDP2 through "
                          "accelerate (fsdp_version: 2)")
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise ConfigError(no + "a model sharded at load time (its distributed_config / tp_plan) is not supported; "
                          "load it whole and let accelerate shard it with FSDP2")
    config = getattr(trainer.accelerator, "parallelism_config", None)
    sizes = {"tensor parallelism (tp_size)": (trainer.get_tp_size(), getattr(config, "tp_size", 1)),
             "context parallelism (cp_size)": (trainer.get_cp_size(), getattr(config, "cp_size", 1)),
             "sequence parallelism (sp_size)": (trainer.get_sp_size(), getattr(config, "sp_size", 1))}
    on = [f"{name} = {max(size)}" for name, size in sizes.items() if max(size) > 1]
    if on:
        raise ConfigError(no + ", ".join(on) + ": these make per-layer collectives of their own, which need the same "
                          "microbatch count on every rank")
    if getattr(trainer, "is_model_parallel", False):
        raise ConfigError(no + "a model split over several devices (device_map: pipeline-style model parallelism) is "
                          "not supported")
    if not trainer.is_fsdp_enabled:
        raise ConfigError(no + "needs FSDP2 through accelerate: fsdp_version: 2 in accelerate's config "
                          "(accelerate launch --config_file), or TrainingArguments(fsdp=True, "
                          "fsdp_config={'version': 2})")
    plugin = trainer.accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError(no + f"FSDP1 through accelerate (fsdp_version {plugin.fsdp_version}) is not supported; set "
                          "fsdp_version: 2")
    if config is not None and getattr(config, "dp_replicate_size", 1) > 1:
        raise ConfigError(no + f"HSDP (dp_replicate_size = {config.dp_replicate_size}) is not supported; shard over "
                          "every rank")
    if type(getattr(plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy":
        raise ConfigError(no + "parameter offload (accelerate's fsdp_offload_params, fsdp_config's cpu_offload) is "
                          "not supported")
    if trainer.train_dataset is None or isinstance(trainer.train_dataset, (torch.utils.data.IterableDataset,
                                                                            *_datasets("IterableDataset"))):
        raise ConfigError(no + "needs a train_dataset of known length with indexed rows (each step's rows are "
                          "planned from every sample's length); an iterable dataset is not supported")
    if args.auto_find_batch_size:
        raise ConfigError(no + "auto_find_batch_size is not supported (set the token budget with max_tokens)")
    if args.train_sampling_strategy not in ("random", "sequential"):
        raise ConfigError(no + f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported: LB-Mini "
                          "balances each step itself; use 'random' or 'sequential'")
    if not args.average_tokens_across_devices:
        raise ConfigError(no + "average_tokens_across_devices=False is not supported: ODC normalizes every step's "
                          "loss by its global token count, as one process over the step would")
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = bool(trainer.model_accepts_loss_kwargs) or trainer.compute_loss_func is not None
    if not scaled:
        raise ConfigError(no + "the loss is a mean over each microbatch (the model's forward takes no "
                          "num_items_in_batch and there is no compute_loss_func), which would weigh each sample by "
                          "how the plan packed it; pass compute_loss_func or use a model whose loss takes "
                          "num_items_in_batch")


def _datasets(name: str) -> tuple[type, ...]:
    """``datasets.<name>`` where the datasets package is installed (TRL needs it, a plain Trainer does not)."""
    try:
        import datasets
    except ImportError:
        return ()
    return (getattr(datasets, name),)


class _OdcTrainer:
    """The methods :func:`enable` puts in front of the trainer's own class."""

    _odc: _Settings

    def get_train_dataloader(self) -> Any:
        """This rank's step loader (not prepared by accelerate, which would shard it across ranks)."""
        trainer: Any = self
        args = trainer.args
        dataset = trainer.train_dataset
        collator = trainer.data_collator
        if isinstance(dataset, _datasets("Dataset")):
            dataset = trainer._remove_unused_columns(dataset, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
        world, calls = args.world_size, args.gradient_accumulation_steps
        s = self._odc
        row = s.max_tokens or (args.per_device_train_batch_size * s.row_limit if s.row_limit else None)
        config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
        attention = str(getattr(config, "_attn_implementation", "") or "")
        layout = _hf_data.Layout(
            world=world, rank=args.process_index, rows_per_step=args.per_device_train_batch_size * calls * world,
            calls=calls, shuffle=args.train_sampling_strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
            max_tokens=row, rows_per_device=args.per_device_train_batch_size, strategy=s.strategy, cost=s.cost,
            trl=s.trl, flash="flash" in attention, no_cache=getattr(config, "use_cache", None) is not None,
            at_least_one=s.accumulation == FSDP2_ACCUM)
        steps = _hf_data.steps_per_epoch(len(dataset), layout)
        if steps < 1:
            raise ConfigError(f"{_WHAT}: {len(dataset)} rows make no step of {layout.rows_per_step} rows "
                              "(dataloader_drop_last)")
        s.sampler = _hf_data.StepSampler(steps, calls)
        workers = args.dataloader_num_workers
        extra = {"persistent_workers": args.dataloader_persistent_workers,
                 "prefetch_factor": args.dataloader_prefetch_factor} if workers > 0 else {}
        return torch.utils.data.DataLoader(_hf_data.StepDataset(dataset, collator, layout), batch_sampler=s.sampler,
                                           collate_fn=_hf_data.first, num_workers=workers, **extra)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # The step loader's epoch, also where a resumed epoch's loader is rebuilt around the same sampler.
        epoch = kwargs["epoch"] if "epoch" in kwargs else args[1]
        if self._odc.sampler is not None:
            self._odc.sampler.set_epoch(epoch)
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: torch.device) -> tuple[list[Any], torch.Tensor | None]:
        """The step's batches and its global count of loss tokens, known from the plan (no all-gather)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        steps = [b for b in batches if isinstance(b, _hf_data.Step)]
        if not steps:
            return batches, None
        return batches, torch.tensor(steps[-1].tokens, dtype=torch.int64, device=device)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Runs this rank's microbatches of the step (none for a placeholder); returns its share of the loss."""
        trainer: Any = self
        self._odc_enable(model)
        if not isinstance(inputs, _hf_data.Step):
            if inputs is _hf_data.PLACEHOLDER:
                return torch.zeros((), device=trainer.args.device)
            return cast(torch.Tensor, super().training_step(model, inputs, num_items_in_batch))  # type: ignore[misc]
        if num_items_in_batch is None:
            num_items_in_batch = torch.tensor(inputs.tokens, dtype=torch.int64, device=trainer.args.device)
        # Per-microbatch terms that are means (a MoE router's aux loss) average over the step's microbatches.
        trainer.current_gradient_accumulation_steps = max(inputs.count, 1) / trainer.args.world_size
        loss = torch.zeros((), device=trainer.args.device)
        accum = self._odc.accumulation != "odc"
        with _sft_metrics(trainer, model, inputs) if self._odc.trl else contextlib.nullcontext():
            for j, mb in enumerate(inputs.microbatches):
                if accum:  # one reduce-scatter (push) per group, at this rank's last microbatch
                    last = j == len(inputs.microbatches) - 1
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                loss = loss + super().training_step(model, mb, num_items_in_batch)  # type: ignore[misc]
        return loss

    def _odc_enable(self, model: Any) -> None:
        """Puts the prepared model and its optimizer on ODC (once; again if a later ``train()`` made another
        optimizer)."""
        trainer: Any = self
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        s = self._odc
        if s.accumulation == FSDP2_ACCUM:
            return
        if odc_fsdp.is_enabled(model):
            if s.optimizer is optimizer:
                return
            odc_fsdp.disable(model)
        odc_fsdp.enable(model, optimizer, timeout=s.timeout, transport=s.transport, **s.engine_options)
        s.optimizer = optimizer

    def floating_point_ops(self, inputs: Any) -> int:
        """The Trainer's count summed over this rank's microbatches (0 for a placeholder)."""
        if isinstance(inputs, _hf_data.Step):
            count = super().floating_point_ops  # type: ignore[misc]
            return sum(int(count(mb)) for mb in inputs.microbatches)
        if inputs is _hf_data.PLACEHOLDER:
            return 0
        return int(super().floating_point_ops(inputs))  # type: ignore[misc]

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # Once per step on every rank (the Trainer's all-gather of the count), at the step's last batch.
        trainer: Any = self
        if inputs is _hf_data.PLACEHOLDER:
            return
        if not isinstance(inputs, _hf_data.Step):
            super()._track_num_input_tokens(inputs)  # type: ignore[misc]
            return
        if trainer.args.include_num_input_tokens_seen in ("no", False):
            return
        count = torch.tensor(inputs.rank_tokens, dtype=torch.int64, device=trainer.args.device)
        trainer.state.num_input_tokens_seen += int(trainer.accelerator.gather(count).sum().item())


class _OdcGRPOTrainer:
    """The methods :func:`enable` puts in front of TRL's ``GRPOTrainer`` (see :mod:`._hf_grpo`): TRL's own loader
    and generation, then this rank's completions in its own microbatches at the step's last batch."""

    _odc: _Settings

    def _odc_enable(self, model: Any) -> None:
        _OdcTrainer._odc_enable(cast(Any, self), model)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The step's first batch generates and scores (TRL's ``_generate_and_score_completions``, every rank alike);
        its last runs this rank's completions; the others run nothing."""
        trainer: Any = self
        self._odc_enable(model)
        s, args = self._odc, trainer.args
        calls = args.gradient_accumulation_steps
        call, s.calls = s.calls % calls, s.calls + 1
        if call == 0:
            s.started = time.perf_counter()
            model.train()
            s.rollout = trainer._generate_and_score_completions(inputs)
        if call < calls - 1:
            return torch.zeros((), device=args.device)
        rollout, s.rollout = s.rollout, None
        lengths = [int(rollout["prompt_ids"].shape[1]) + n for n in _hf_grpo.completion_lengths(rollout)]
        longest = getattr(trainer, "max_completion_length", None) or int(rollout["completion_ids"].shape[1])
        budget = s.max_tokens or args.per_device_train_batch_size * (int(rollout["prompt_ids"].shape[1]) + longest)
        plan = _hf_grpo.plan_rows(lengths, budget)
        from transformers import Trainer

        loss = torch.zeros((), device=args.device)
        held = trainer.current_gradient_accumulation_steps
        try:
            with _hf_grpo.local_metrics(trainer, lambda: odc_fsdp.finish(model), len(plan),
                                        ", ".join(TRL_VERSIONS_CHECKED)):
                for rows in plan:
                    trainer.current_gradient_accumulation_steps = _hf_grpo.accumulation(
                        trainer.loss_type, args.steps_per_generation, len(lengths) * args.world_size,
                        args.world_size, len(rows))
                    loss = loss + Trainer.training_step(trainer, model, _hf_grpo.select(rollout, rows), None)
        finally:
            trainer.current_gradient_accumulation_steps = held
        trainer._metrics["train"]["step_time"].append(time.perf_counter() - s.started)
        return loss

    def _prepare_inputs(self, inputs: Any) -> Any:
        if isinstance(inputs, _hf_grpo.Ready):
            return inputs
        return super()._prepare_inputs(inputs)  # type: ignore[misc]


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _subclass(cls: type, front: type) -> type:
    """``cls`` with ``front`` in front (one class per trainer class)."""
    if (cls, front) not in _SUBCLASSES:
        _SUBCLASSES[cls, front] = type(f"Odc{cls.__name__}", (front, cls), {"__module__": cls.__module__})
    return _SUBCLASSES[cls, front]


@contextlib.contextmanager
def _sft_metrics(trainer: Any, model: Any, step: _hf_data.Step) -> Iterator[None]:
    """TRL's ``SFTTrainer.compute_loss`` gathers its metrics across ranks in every microbatch (a collective per
    microbatch, which uneven counts cannot make). Inside this block they gather nothing; at its end their sums
    cross the ranks once, and the step logs one entry of each: entropy and token accuracy over every rank's
    loss tokens of the step, the tokens seen, the MoE aux loss's mean over the step's microbatches."""
    acc = trainer.accelerator
    seen: list[torch.Tensor] = []

    def local(value: Any, *_: Any, **__: Any) -> torch.Tensor:
        t = torch.as_tensor(value)
        seen.append(t.detach().double().sum().cpu())
        return t.reshape(1) if t.dim() == 0 else t

    metrics = trainer._metrics["train"]
    before = {key: len(values) for key, values in metrics.items()}
    tokens_before = trainer._total_train_tokens
    acc.gather_for_metrics = local
    try:
        yield
    finally:
        del acc.gather_for_metrics
    # TRL 1.16's order per microbatch: loss tokens, entropy sum, correct top-1, input tokens, then the aux loss.
    per = 5 if trainer.aux_loss_enabled else 4
    ran = len(step.microbatches)
    if len(seen) != per * ran:
        raise ProtocolError(
            f"{_WHAT}: TRL's SFTTrainer.compute_loss gathered {len(seen)} metrics over {ran} microbatches, expected "
            f"{per} per microbatch (checked on TRL {', '.join(TRL_VERSIONS_CHECKED)})"
        )
    sums = torch.zeros(per + 1, dtype=torch.float64)
    sums[0] = ran
    for i, value in enumerate(seen):
        sums[1 + i % per] += value
    sums[4] -= step.dummy  # a zero-loss microbatch's tokens are not the step's
    sums = sums.to(trainer.args.device)
    # Finished first: a rank that ran nothing has published nothing of this minibatch yet, and its peers' gathers
    # wait for that while it would wait in the all-reduce. The clip's read of the gradients comes next anyway.
    if odc_fsdp.is_enabled(model):
        odc_fsdp.finish(model)
    dist.all_reduce(sums)  # once per step, on every rank
    sums = sums.cpu()
    for key in list(metrics):
        del metrics[key][before.get(key, 0):]
    valid = float(sums[1])
    metrics["entropy"].append(float(sums[2]) / valid if valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append(float(sums[3]) / valid if valid > 0 else 0.0)
    trainer._total_train_tokens = tokens_before + int(sums[4]) // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    if per == 5:
        metrics["aux_loss"].append(float(sums[5]) / max(float(sums[0]), 1.0))
    for key in [k for k, values in metrics.items() if not values]:
        del metrics[key]  # TRL's log divides by each list's length
