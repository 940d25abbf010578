"""torchtitan on ODC: ``odc.integrations.torchtitan.Trainer(config)`` instead of torchtitan's ``Trainer(config)``.

torchtitan's ``Trainer.train_step`` runs a fixed number of microbatches per
rank (``gradient_accumulation_steps``), sums the global token count once per
step (``dist_utils.dist_sum_tensor``), divides each microbatch's summed loss
by it, clips with ``dist_utils.clip_grad_norm_`` and steps the optimizers.
FSDP2's collectives make every rank run the same count.

This :class:`Trainer` subclass

- checks, as the model spec's ``parallelize_fn`` runs, that the model is
  sharded by FSDP alone (tensor, context, pipeline and expert parallelism
  make per-layer collectives of their own, which need equal counts);
- puts the model on ODC (``odc.fsdp.enable(model, optimizers)``) at the first
  training step: after torchtitan initialized the weights, built the
  optimizers and loaded any checkpoint (enabling inside ``parallelize_fn``
  would be too early: the weights are initialized after it, the optimizers
  built after that, a checkpoint loaded at the start of ``train()``);
- given an :class:`odc.packing.Plan` over documents (:func:`plan_documents`),
  feeds each rank its planned microbatches, one packed row per microbatch
  (documents back to back, positions restarting per document, as
  torchtitan's own text loader emits them), and sets each step's
  ``gradient_accumulation_steps`` to this rank's count in the plan, so ranks
  run different counts (LB-Mini).

Everything else is torchtitan's own ``train_step``: the token count summed
once per step on every rank, ``dist_utils.clip_grad_norm_`` (its reads of
``.grad`` finish the minibatch under ODC's gradient contract, its norm
all-reduce is once per step), ``optimizers.step()`` (ODC's step hooks on the
optimizers container publish the new parameters).

torchtitan's internals read here are checked against
:data:`TORCHTITAN_VERSIONS_CHECKED` (an unchecked version warns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import fsdp as odc_fsdp
from .. import packing
from ..engine import compress_args
from ..errors import ConfigError
from ._guard import import_trainer

__all__ = ["TORCHTITAN_VERSIONS_CHECKED", "PlannedDataLoader", "Trainer", "plan_documents"]

TORCHTITAN_VERSIONS_CHECKED = ("0.3.0",)
"""torchtitan versions whose trainer this module was checked against (another one warns)."""


def _torchtitan() -> Any:
    import_trainer("torchtitan", TORCHTITAN_VERSIONS_CHECKED, "compare a few steps against torchtitan's own trainer",
                   min_torch="2.12")
    import torchtitan.trainer
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX

    return torchtitan.trainer.Trainer, BaseDataLoader, IGNORE_INDEX


_TitanTrainer, _BaseDataLoader, _IGNORE_INDEX = _torchtitan()


def plan_documents(documents: Sequence[Sequence[int]], world_size: int, minibatch_size: int, seq_len: int,
                   strategy: str = "lb-mini", cost: str = "quadratic", seed: int | None = None) -> packing.Plan:
    """An :func:`odc.packing.plan` over tokenized documents for :class:`Trainer`.

    A document of ``n`` tokens fills ``n - 1`` positions of a packed row
    (inputs ``doc[:-1]``, labels ``doc[1:]``), and a row holds at most
    ``seq_len`` positions.

    Raises:
        PackingError: a document shorter than two tokens or longer than ``seq_len + 1``.
    """
    lengths = [len(d) - 1 for d in documents]
    return packing.plan(lengths, world_size=world_size, minibatch_size=minibatch_size, strategy=strategy,
                        max_tokens=seq_len, cost=cost, seed=seed)


class PlannedDataLoader(_BaseDataLoader):  # type: ignore[misc,valid-type]
    """This rank's planned microbatches, each one packed row ``({"input", "positions"}, labels)`` of shape (1, T).

    Minibatch ``m`` of the plan is training step ``m + 1`` (the plan repeats
    when the steps outrun it). Stateful: a checkpoint keeps the position.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_BaseDataLoader.Config):  # type: ignore[misc,name-defined]
        """What torchtitan's config holds for this loader: the plan, its documents and the row padding."""
        plan: Any = None
        """An odc.packing.Plan over ``documents`` (see plan_documents)."""
        documents: Any = None
        """Token ids of every document the plan indexes."""
        pad_multiple: int = 1
        """Rows are padded to a multiple of this many positions (torchtitan's chunked loss splits rows into
        equal chunks); padding is a separate document whose labels are ignored."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, **_: Any) -> None:
        plan, docs = config.plan, config.documents
        self.pad_multiple = max(1, int(config.pad_multiple))
        if plan is None or docs is None:
            raise ConfigError("odc.integrations.torchtitan.PlannedDataLoader needs a plan and its documents")
        if plan.world_size != dp_world_size:
            raise ConfigError(
                f"odc.integrations.torchtitan: the plan is for {plan.world_size} ranks, the data-parallel world "
                f"has {dp_world_size}"
            )
        self.minibatches = plan.rank(dp_rank)
        for m, mbs in enumerate(self.minibatches):
            if not mbs:
                raise ConfigError(
                    f"odc.integrations.torchtitan: the plan gives rank {dp_rank} no microbatch in minibatch {m} "
                    "(fewer documents than ranks?); torchtitan's step needs one per rank"
                )
            for mb in mbs:
                tokens = sum(len(docs[i]) - 1 for i in mb)
                if tokens > seq_len:
                    raise ConfigError(
                        f"odc.integrations.torchtitan: minibatch {m} of rank {dp_rank} packs {tokens} positions "
                        f"into one row, over seq_len {seq_len}; plan with max_tokens=seq_len (plan_documents)"
                    )
        self.documents = docs
        self.consumed = 0  # microbatches handed out

    def microbatches(self, step: int) -> int:
        """How many microbatches this rank runs in training step ``step`` (1-based)."""
        return len(self.minibatches[(step - 1) % len(self.minibatches)])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        flat = [mb for mbs in self.minibatches for mb in mbs]
        while True:
            mb = flat[self.consumed % len(flat)]
            self.consumed += 1
            yield self.row(mb)

    def row(self, microbatch: Sequence[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One microbatch's documents packed back to back into one row: ``({'input', 'positions'}, labels)``.

        Positions restart at every document, as torchtitan's own loader emits them; the row is padded to a
        multiple of ``pad_multiple`` with a document whose labels are ignored.
        """
        inputs: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in microbatch:
            doc = list(self.documents[i])
            inputs += doc[:-1]
            labels += doc[1:]
            positions += range(len(doc) - 1)
        pad = -len(inputs) % self.pad_multiple
        inputs += [0] * pad
        labels += [_IGNORE_INDEX] * pad
        positions += range(pad)
        row = {"input": torch.tensor([inputs]), "positions": torch.tensor([positions])}
        return row, torch.tensor([labels])

    def state_dict(self) -> dict[str, Any]:
        """The loader's position (microbatches handed out), for torchtitan's checkpoint."""
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the position :meth:`state_dict` saved."""
        self.consumed = int(state_dict["consumed"])


class Trainer(_TitanTrainer):  # type: ignore[misc,valid-type]
    """torchtitan's trainer with FSDP's communication on ODC (see the module doc).

    Args:
        config: a torchtitan ``Trainer.Config``.
        plan: an :class:`odc.packing.Plan` over ``documents``
            (:func:`plan_documents`); each rank then runs its own microbatch
            count per step. ``None`` keeps torchtitan's data loader and its
            fixed count.
        documents: token ids of the documents ``plan`` indexes.
        odc: ``False`` keeps FSDP's collectives (a plan then needs the same
            count on every rank per step, e.g. ``strategy="lb-micro"``).
        timeout: seconds a wait on a peer may take (default: as ``odc.fsdp.enable``).
        transport: as ``odc.fsdp.enable``.
        compress: as ``odc.fsdp.enable``: compressed pushes and gathers
            across nodes (under ``data_parallel_replicate_degree > 1``, the
            cross-node sum of the gradient shards). Default ``None``.

    Raises:
        ConfigError: tensor, context, pipeline or expert parallelism is on,
            CUDA graphs are (``training.disable_cuda_graphs`` False, torchtitan's
            default), the plan does not fit the data-parallel world or
            ``seq_len``, or ``compress`` is not a setting (checked here,
            before anything is built) or is given with ``odc=False``.
    """

    def __init__(self, config: Any, *, plan: packing.Plan | None = None,
                 documents: Sequence[Sequence[int]] | None = None, odc: bool = True, timeout: float | None = None,
                 transport: str | None = None, compress: Mapping[str, Any] | None = None) -> None:
        if odc and not config.training.disable_cuda_graphs:
            raise ConfigError(
                "odc.integrations.torchtitan: torchtitan captures its forward and backward in a CUDA graph "
                "(training.disable_cuda_graphs is False, its default), but ODC's gathers and pushes wait for "
                "peers on the host, which a replayed graph skips, and each rank's microbatch shapes differ; set "
                "config.training.disable_cuda_graphs = True (--training.disable_cuda_graphs)"
            )
        self._odc = odc
        self._odc_timeout, self._odc_transport = timeout, transport
        self._odc_engine: dict[str, Any] = {}
        if compress is not None:
            if not odc:
                raise ConfigError("odc.integrations.torchtitan: compress with odc=False, which trains on FSDP's "
                                  "collectives")
            compress_args(compress)  # keys, formats, block size: named now, not at the first step
            self._odc_engine["compress"] = dict(compress)
        config.model_spec = dataclasses.replace(config.model_spec,
                                                parallelize_fn=_fsdp_only(config.model_spec.parallelize_fn))
        if plan is not None:
            chunks = getattr(config.loss, "num_chunks", 1)  # torchtitan's ChunkedLossWrapper
            config.dataloader = PlannedDataLoader.Config(plan=plan, documents=documents, pad_multiple=chunks)
        super().__init__(config)

    def train_step(self, data_iterator: Any) -> Any:
        """torchtitan's ``train_step``, with this rank's planned microbatch count and ODC on from the first step.

        At the first step it calls ``odc.fsdp.enable(model, optimizers)`` (after torchtitan initialized the
        weights, built the optimizers and loaded a checkpoint), with ``set_reduce_scatter_unused_params(True)``.
        """
        if isinstance(self.dataloader, PlannedDataLoader):
            self.gradient_accumulation_steps = self.dataloader.microbatches(self.step)
        model = self.model_parts[0]
        if self._odc and not odc_fsdp.is_enabled(model):
            # torchtitan's chunked loss reduce-scatters the (norm, lm_head) group at its last chunk, before the
            # norm's gradient exists, and again when the decoder's backward reaches the norm: both pushes carry
            # every parameter (zeros where there is no gradient yet) and ODC adds them up.
            model.set_reduce_scatter_unused_params(True)
            hybrid = self.parallel_dims.dp_replicate > 1
            odc_fsdp.enable(model, self.optimizers, sharding="hybrid" if hybrid else "full",
                            timeout=self._odc_timeout, transport=self._odc_transport, **self._odc_engine)
        return super().train_step(data_iterator)


def _fsdp_only(parallelize: Any) -> Any:
    def parallelize_fn(model: Any, *, parallel_dims: Any, **kw: Any) -> Any:
        on = {name: getattr(parallel_dims, name) for name in ("tp", "cp", "pp", "ep")
              if getattr(parallel_dims, name, 1) > 1}
        if on:
            raise ConfigError(
                "odc.integrations.torchtitan: ODC replaces FSDP's collectives only; "
                + ", ".join(f"{k}={v}" for k, v in on.items())
                + " make per-layer collectives of their own, which need the same microbatch count on every rank"
            )
        return parallelize(model, parallel_dims=parallel_dims, **kw)

    return parallelize_fn
