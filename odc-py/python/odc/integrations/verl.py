"""verl on ODC: ``odc.integrations.verl.enable()`` before verl builds its engines.

verl's FSDP engine (``verl.workers.engine.fsdp``, FSDP2 or FSDP1) trains the actor and the
critic with ``train_batch``: ``optimizer_zero_grad``, then
``forward_backward_batch`` over the minibatch's microbatches (dynamic
batching packs them by tokens, ``rearrange_micro_batches``), then
``optimizer_step`` (``fsdp2_clip_grad_norm_``, skipped on a non-finite norm).
With FSDP2's collectives every rank must run as many microbatches as its
peers, so verl raises every rank's count to the largest one (an all-reduce
MAX in ``rearrange_micro_batches``); a rank that ran fewer would hang in
FSDP2's reduce-scatter.

:func:`enable` uses verl's own extension point, the engine registry
(``EngineRegistry``): every engine class registered for ``language_model``
or ``value_model`` under the ``fsdp`` / ``fsdp2`` backends is replaced by a
subclass that

- right after verl wraps the module and builds its optimizer
  (``_build_model_optimizer``, after ``apply_fsdp2``) calls
  ``odc.fsdp.enable(module, optimizer)`` -- for engines that train (the actor,
  the critic); forward-only engines (the reference model) keep FSDP2's own
  collectives;
- in ``forward_backward_batch`` first balances the minibatch across ranks with
  LB-Mini (``balance="lb-mini"``: Karmarkar–Karp over every rank's samples by
  verl's workload estimate, unequal counts, samples moved once with two
  all-to-alls), then lets verl pack this rank's samples into as many
  microbatches as its token budget needs, without the count all-reduce
  (``same_micro_num_in_dp=False``); with ``return_model_output=True`` the
  per-sample outputs go back to the rank each sample came from, in the
  caller's order (two more all-to-alls);
- reloads a checkpoint with ODC off and republishes the loaded parameters.

Everything else is verl's: the global token count for the loss
(``batch_num_tokens``, all-reduced once per minibatch on every rank), the
gradient-sync context (``set_requires_gradient_sync(False)`` on all but the
last microbatch), ``fsdp2_clip_grad_norm_`` (its reads of ``.grad`` finish the
minibatch under ODC's gradient contract) and the skip on a non-finite norm
(``optimizer.zero_grad()`` instead of a step). Each of those is a collective
made once per minibatch at the same point on every rank, which uneven counts
allow.

One verl function is patched: ``prepare_micro_batches`` as the FSDP engine
module imports it, so that calls made from an ODC engine pass
``same_micro_num_in_dp=False`` (other engines' calls are unchanged). That
patch, the registry replacement and every verl name this module reads are
checked here against :data:`VERL_VERSIONS_CHECKED`: a missing name is an
:class:`odc.ConfigError` naming it, an unchecked version a warning.

verl's default strategy, FSDP1 (``strategy="fsdp"``), runs the same way on
ODC's FSDP1 support (``odc.fsdp.enable`` on the ``FullyShardedDataParallel``
module): verl's ``no_sync()`` on all but each rank's last microbatch and
FSDP1's own ``clip_grad_norm_`` (one all-reduce per minibatch) are kept.

Settings ODC cannot keep are refused when the engine is built: parameter
offload (``param_offload``,
``offload_policy``), Ulysses sequence parallelism (its all-to-all per layer
would need equal counts); LB-Mini further needs dynamic batching
(``use_dynamic_bsz=True``) and no forced sample groups.

Rollout weights (independent of the above): :func:`register_checkpoint_engine`
registers the checkpoint engine ``odc`` (``odc.integrations._verl_weights``)
in verl's ``CheckpointEngineRegistry``: the rollout replicas read the actor's
FSDP2 shards one-sidedly as ODC weight versions instead of verl gathering
full tensors. Importing this module registers it once verl's
``verl.checkpoint_engine`` is loaded (at once where it is, as when verl
imports the module named in ``checkpoint_engine.custom_backend_module``; else
right after verl loads it, through a one-shot import hook)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=odc
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=odc.integrations.verl
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.abc
import importlib.util
import inspect
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import fsdp as odc_fsdp
from .. import packing
from ..engine import compress_args
from ..errors import ConfigError, PackingError
from . import _exchange
from ._guard import import_trainer

__all__ = ["BALANCES", "VERL_VERSIONS_CHECKED", "disable", "enable", "is_enabled", "register_checkpoint_engine"]

VERL_VERSIONS_CHECKED = ("0.9.1",)
"""verl versions whose engine internals this module was checked against (another one warns)."""
BALANCES = ("lb-mini", None)
"""``balance=`` values: LB-Mini across ranks per minibatch, or ``None``: each rank keeps the samples verl gave it."""
_MODEL_TYPES = ("language_model", "value_model")
_BACKENDS = ("fsdp", "fsdp2")


@dataclass(frozen=True)
class _Settings:
    balance: str | None
    cost: str
    timeout: float | None
    transport: str | None
    compress: tuple[tuple[str, Any], ...] | None = None  # the compress= mapping's items, sorted


@dataclass
class _Installed:
    settings: _Settings
    registry: dict[tuple[str, str, Any], type]  # (model type, backend, device key) -> the class replaced
    impl: Any  # verl.workers.engine.fsdp.transformer_impl
    tu: Any  # verl.utils.tensordict_utils
    prepare: Callable[..., Any]  # its prepare_micro_batches before the patch


@dataclass
class _State:
    installed: _Installed | None = None  # what enable() installed in this process


_state = _State()
# Set while an ODC engine runs forward_backward_batch: its prepare_micro_batches calls keep per-rank counts.
_uneven: contextvars.ContextVar[bool] = contextvars.ContextVar("odc_verl_uneven", default=False)


def _verl() -> tuple[Any, Any, Any]:
    """verl's registry, FSDP engine module and tensordict utilities; refuses a verl that lacks a name read here."""
    _, where = import_trainer("verl", VERL_VERSIONS_CHECKED, "it patches verl's engine registry and "
                              "prepare_micro_batches, so compare a few steps against verl without ODC before "
                              "relying on it")
    try:
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.base import EngineRegistry
        from verl.workers.engine.fsdp import transformer_impl as impl
    except ImportError as e:
        raise ConfigError(f"odc.integrations.verl cannot run on {where}: {e}") from None
    engine_methods = ("_build_model_optimizer", "forward_backward_batch", "load_checkpoint",
                      "get_data_parallel_group")
    for owner, names in ((EngineRegistry, ("_engines",)), (impl, ("FSDPEngine", "prepare_micro_batches")),
                         (tu, ("index_select_tensor_dict", "concat_tensordict", "get_non_tensor_data",
                               "assign_non_tensor_data")),
                         (getattr(impl, "FSDPEngine", None), engine_methods)):
        for name in names:
            if not hasattr(owner, name):
                raise ConfigError(
                    f"odc.integrations.verl cannot run on {where}: {getattr(owner, '__name__', owner)} has no "
                    f"{name!r}; install one of the checked versions or train without ODC"
                )
    prepare = impl.prepare_micro_batches  # imported there from verl.workers.engine.utils
    if "same_micro_num_in_dp" not in inspect.signature(prepare).parameters:
        raise ConfigError(
            f"odc.integrations.verl cannot run on {where}: prepare_micro_batches takes no same_micro_num_in_dp; "
            "install one of the checked versions or train without ODC"
        )
    return EngineRegistry, impl, tu


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect in this process."""
    return _state.installed is not None


def enable(*, balance: str | None = "lb-mini", cost: str = "verl", timeout: float | None = None,
           transport: str | None = None, compress: Mapping[str, Any] | None = None) -> None:
    """Makes verl's FSDP2 actor and critic engines built from now on in this process run on ODC.

    Call it in every process that builds engines, before they are built
    (in a verl job: ``actor_rollout_ref.model.external_lib=odc.integrations.verl_auto``
    and ``critic.model.external_lib=odc.integrations.verl_auto``, or
    ``VERL_USE_EXTERNAL_MODULES=odc.integrations.verl_auto`` in the workers'
    environment). Calling it again with the same settings does nothing.

    Args:
        balance: ``"lb-mini"`` balances each minibatch's cost across ranks
            (samples move between ranks, counts per rank differ); ``None``
            keeps the samples verl handed each rank and only lets each rank
            keep its own microbatch count.
        cost: the cost model LB-Mini balances (:data:`odc.packing.COST_MODELS`;
            ``"verl"`` is the workload estimate verl's own balancing uses).
        timeout: seconds a wait on a peer may take (default: as
            ``odc.fsdp.enable``, the process group's timeout).
        transport: as ``odc.fsdp.enable``.
        compress: as ``odc.fsdp.enable``: block-scaled low-precision gathers
            and pushes, by default only what crosses nodes (``None``: every
            byte as it is). Checked here, before any engine is built.

    Raises:
        ConfigError: verl is missing or lacks a name this integration reads, an
            unknown ``balance`` or ``cost``, a malformed ``compress``, or already
            enabled with other settings (call :func:`disable` first).
    """
    if balance not in BALANCES:
        raise ConfigError(f"odc.integrations.verl.enable: unknown balance {balance!r}; expected 'lb-mini' or None")
    try:
        packing.sequence_cost(1, cost)
    except PackingError as e:
        raise ConfigError(f"odc.integrations.verl.enable: cost {cost!r}: {e}") from None
    compress_args(compress)  # a malformed setting is refused by name now, not when verl builds an engine
    settings = _Settings(balance, cost, timeout, transport,
                         None if compress is None else tuple(sorted(compress.items())))
    installed = _state.installed
    if installed is not None:
        if installed.settings != settings:
            raise ConfigError(
                f"odc.integrations.verl.enable: already enabled with {installed.settings}; call disable() first"
            )
        return
    registry, impl, tu = _verl()
    replaced: dict[tuple[str, str, Any], type] = {}
    for model_type in _MODEL_TYPES:
        for backend in _BACKENDS:
            for key, cls in registry._engines.get(model_type, {}).get(backend, {}).items():
                if issubclass(cls, impl.FSDPEngine) and not issubclass(cls, _OdcEngine):
                    replaced[(model_type, backend, key)] = cls
                    registry._engines[model_type][backend][key] = _odc_class(cls)
    prepare = impl.prepare_micro_batches
    impl.prepare_micro_batches = _per_rank_counts(prepare)
    _state.installed = _Installed(settings, replaced, impl, tu, prepare)


def disable() -> None:
    """Restores verl's engine registry and ``prepare_micro_batches``. Engines built under ODC stay on ODC."""
    installed = _state.installed
    if installed is None:
        return
    registry, _, _ = _verl()
    for (model_type, backend, key), cls in installed.registry.items():
        registry._engines[model_type][backend][key] = cls
    installed.impl.prepare_micro_batches = installed.prepare
    _state.installed = None


def _per_rank_counts(prepare: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(prepare)
    def prepare_micro_batches(*args: Any, **kwargs: Any) -> Any:
        if _uneven.get():
            kwargs["same_micro_num_in_dp"] = False
        return prepare(*args, **kwargs)

    prepare_micro_batches.__odc_wrapped__ = prepare  # type: ignore[attr-defined]
    return prepare_micro_batches


@functools.cache
def _odc_class(base: type) -> type:
    return type(f"Odc{base.__name__}", (_OdcEngine, base), {"__module__": __name__, "__doc__": base.__doc__})


@contextlib.contextmanager
def _counts_per_rank() -> Iterator[None]:
    token = _uneven.set(True)
    try:
        yield
    finally:
        _uneven.reset(token)


class _OdcEngine:
    """Mixed in before one of verl's FSDP engine classes (see the module doc)."""

    engine_config: Any
    module: Any
    optimizer: Any

    def _build_model_optimizer(self) -> None:
        trains = not self.engine_config.forward_only  # the reference model keeps FSDP2's collectives
        if trains:
            _check_engine(self.engine_config)
        super()._build_model_optimizer()  # type: ignore[misc]
        if trains:
            self._odc_enable()

    def _odc_enable(self) -> None:
        s = _current().settings
        sharding = "hybrid" if getattr(getattr(self, "device_mesh", None), "ndim", 1) == 2 else "full"
        compress = None if s.compress is None else dict(s.compress)
        odc_fsdp.enable(self.module, self.optimizer, sharding=sharding, timeout=s.timeout, transport=s.transport,
                        compress=compress)

    def forward_backward_batch(self, data: Any, loss_function: Callable[..., Any], forward_only: bool = False) -> Any:
        if not odc_fsdp.is_enabled(self.module):
            return super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        s = _current().settings
        group = self.get_data_parallel_group()  # type: ignore[attr-defined]
        moved = None
        if s.balance == "lb-mini" and not forward_only:
            data, moved = _rebalance(data, group, s.cost, _current().tu)
        with _counts_per_rank():
            out = super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        if moved is not None and isinstance(out, dict) and out.get("model_output"):
            # return_model_output=True: each sample's outputs back to the rank and the place it came from.
            out["model_output"] = _return_outputs(out["model_output"], *moved, group)
        return out

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        if not odc_fsdp.is_enabled(self.module):
            return super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]
        # The loaded parameters must be published as the next version: leave ODC, load, enter again.
        odc_fsdp.disable(self.module)
        try:
            return super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._odc_enable()


def _current() -> _Installed:
    installed = _state.installed
    if installed is None:
        raise ConfigError(
            "odc.integrations.verl: an ODC engine was used after odc.integrations.verl.disable(); build engines "
            "while it is enabled"
        )
    return installed


def _check_engine(cfg: Any) -> None:
    """Refuses engine settings ODC cannot keep, naming the field."""
    refuse = []
    if cfg.strategy not in _BACKENDS:
        refuse.append(f"strategy={cfg.strategy!r} (ODC runs on FSDP1 and FSDP2: set strategy='fsdp' or 'fsdp2')")
    if getattr(cfg, "param_offload", False) or getattr(cfg, "offload_policy", False):
        refuse.append("param_offload / offload_policy (parameters must stay where ODC registered them)")
    if getattr(cfg, "ulysses_sequence_parallel_size", 1) > 1:
        refuse.append(
            f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} (its all-to-all per layer "
            "needs the same microbatch count on every rank)"
        )
    if refuse:
        raise ConfigError("odc.integrations.verl: this engine cannot run on ODC: " + "; ".join(refuse))


def _balance(data: Any, group: Any, cost: str, tu: Any) -> Any:
    """This rank's share of the minibatch under LB-Mini (a collective: lengths gathered, samples exchanged).

    ``tu`` is ``verl.utils.tensordict_utils``.
    """
    return _rebalance(data, group, cost, tu)[0]


def _rebalance(data: Any, group: Any, cost: str, tu: Any) -> tuple[Any, tuple[list[tuple[int, int]], int] | None]:
    """:func:`_balance`, and where each of the returned samples came from: ``(origin, n)``, ``origin[j]`` the
    (rank, index) of sample ``j``, ``n`` this rank's sample count before; None where nothing moved."""
    if not tu.get_non_tensor_data(data, "use_dynamic_bsz", True):
        raise ConfigError(
            "odc.integrations.verl: balance='lb-mini' packs microbatches by tokens and needs dynamic batching "
            "(use_dynamic_bsz=True); with a fixed micro_batch_size_per_gpu enable it with balance=None"
        )
    if tu.get_non_tensor_data(data, "force_group_size", 1) != 1:
        raise ConfigError(
            "odc.integrations.verl: balance='lb-mini' moves single samples and would split forced sample groups "
            "(force_group_size > 1); enable it with balance=None"
        )
    max_tokens = int(tu.get_non_tensor_data(data, "max_token_len_per_gpu", 0)) * int(
        tu.get_non_tensor_data(data, "sp_size", 1))
    lengths = _sample_lengths(data)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, lengths, group=group)
    runs = _exchange.assign(everyone, max_tokens=max_tokens, cost=cost)
    if not _exchange.moves_anything(runs):
        return data, None
    meta = [k for k, v in data.items() if _is_metadata(v)]
    samples = data.exclude(*meta)
    outgoing = []
    for dest in range(world):
        mine = [i for src, i in runs[dest] if src == me]
        outgoing.append(b"" if dest == me or not mine else
                        pickle.dumps(tu.index_select_tensor_dict(samples, mine), protocol=pickle.HIGHEST_PROTOCOL))
    received = _exchange.exchange(outgoing, group)
    pieces: list[Any] = []
    origin: list[tuple[int, int]] = []
    for src in range(world):
        local = [i for s, i in runs[me] if s == src]
        if not local:
            continue
        pieces.append(tu.index_select_tensor_dict(samples, local) if src == me else pickle.loads(received[src]))
        origin.extend((src, i) for i in local)
    out = tu.concat_tensordict(pieces)
    for k in meta:
        tu.assign_non_tensor_data(out, k, tu.get_non_tensor_data(data, k, None))
    return out, (origin, len(lengths))


def _return_outputs(outputs: dict[str, Any], origin: list[tuple[int, int]], n: int, group: Any) -> dict[str, Any]:
    """Per-sample model outputs (verl's jagged nested tensors, in the balanced order) back in the caller's order:
    sample ``j``'s rows go to rank ``origin[j][0]``, at index ``origin[j][1]``. Collective."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    rows = {k: v.unbind() for k, v in outputs.items()}
    outgoing: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in range(world)]
    for j, (src, i) in enumerate(origin):
        outgoing[src].append((i, {k: r[j] for k, r in rows.items()}))
    received = _exchange.exchange([b"" if d == me else pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
                                   for d, o in enumerate(outgoing)], group)
    mine: dict[int, dict[str, Any]] = dict(outgoing[me])
    for src in range(world):
        if src != me and received[src]:
            mine.update(pickle.loads(received[src]))
    if sorted(mine) != list(range(n)):
        raise ConfigError(
            f"odc.integrations.verl: model outputs came back for samples {sorted(mine)} of this rank's {n}: a sample "
            "made no output row or several (return_model_output needs one row per sample)"
        )
    return {k: torch.nested.as_nested_tensor([mine[i][k] for i in range(n)], layout=torch.jagged) for k in rows}


def _is_metadata(value: Any) -> bool:
    """Per-batch values (verl's NonTensorData: temperature, token budget, ...), not per-sample ones."""
    from tensordict import NonTensorData

    return isinstance(value, NonTensorData)


def _sample_lengths(data: Any) -> list[int]:
    """Tokens per sample, as verl's dynamic batching counts them."""
    ids = data["input_ids"]
    if getattr(ids, "is_nested", False):
        return [int(x) for x in ids.offsets().diff().tolist()]
    return [int(x) for x in data["attention_mask"].sum(dim=1).tolist()]


def register_checkpoint_engine() -> None:
    """Registers ODC's verl checkpoint engine as ``odc`` in verl's ``CheckpointEngineRegistry``. Idempotent.

    A verl job selects it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=odc`` and
    ``...checkpoint_engine.custom_backend_module=odc.integrations.verl`` (verl imports that module in its driver,
    actor and rollout workers before it makes the engine; the import registers it). Engine kwargs
    (``...checkpoint_engine.engine_kwargs.odc``): ``name``, ``slots``, ``rollout_dtype``, ``timeout``.
    docs/weights.md ("verl") says what it does and refuses.

    Raises:
        ConfigError: verl is missing or lacks a name the engine reads.
    """
    _, where = import_trainer("verl", VERL_VERSIONS_CHECKED, "it wraps verl's FSDPEngine.get_per_tensor_param, so "
                              "compare a rollout against verl's naive engine before relying on it")
    try:
        from verl.checkpoint_engine import CheckpointEngineRegistry
    except ImportError as e:
        raise ConfigError(f"odc.integrations.verl's checkpoint engine cannot run on {where}: {e}") from None
    if not hasattr(CheckpointEngineRegistry, "register"):
        raise ConfigError(f"odc.integrations.verl's checkpoint engine cannot run on {where}: "
                          "CheckpointEngineRegistry has no 'register'")
    from . import _verl_weights

    _verl_weights.register()


def _register_when_loaded() -> None:
    """Registers the checkpoint engine now if ``verl.checkpoint_engine`` is loaded (as where verl imports
    ``custom_backend_module``), else right after it is. Importing verl's checkpoint engines here would cost every
    user of this module verl's Ray stack, and cannot be done where verl imports this module while it is itself
    being imported (``VERL_USE_EXTERNAL_MODULES``): a later ``custom_backend_module`` import of this module would
    then find it imported and register nothing."""
    if "verl.checkpoint_engine" in sys.modules:
        register_checkpoint_engine()
    elif importlib.util.find_spec("verl") is not None and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``verl.checkpoint_engine`` is about to be imported, it removes itself and makes
    that module's own loader register the checkpoint engine after executing it."""

    name = "verl.checkpoint_engine"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module  # this module's own loader instance: nothing else is affected

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                register_checkpoint_engine()
            except Exception as e:  # verl itself must still import; selecting backend=odc then names what failed
                warnings.warn(f"odc.integrations.verl: the odc checkpoint engine was not registered: {e}",
                              UserWarning, stacklevel=2)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_register_when_loaded()
