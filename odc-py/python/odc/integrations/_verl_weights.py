"""verl's ``odc`` checkpoint engine: rollout replicas read the actor's FSDP2 shards as ODC weight versions.

verl moves the actor's weights to its rollout replicas through a checkpoint engine
(``verl.checkpoint_engine``): every update, ``CheckpointEngineManager`` calls ``prepare`` on every actor and
rollout worker, ``build_topology`` once with what they returned, ``init_process_group`` on each, then the actor's
``send_weights`` (handed ``get_per_tensor_param()``'s generator of full tensors, which all-gathers each parameter
as it is iterated) and the rollout's ``receive_weights`` at the same time, then ``finalize``.

:class:`OdcCheckpointEngine` (registered as ``odc``) replaces that gather with ODC's rollout weights
(:mod:`odc.weights`):

- **actor** (``send_weights``): serves the module behind verl's generator with
  ``odc.fsdp.serve_weights`` (once, on the first update; K slots per rank), then publishes this update's
  version: a copy of the rank's own shards into a slot, no collective. verl's generator is closed without
  being iterated: verl's FSDP2 engine makes it lazily (``state_dict()`` only collects the DTensors;
  ``full_tensor()`` runs per item as it is iterated), so nothing is gathered.
- **rollout** (``receive_weights``): reads that version whole from every actor rank one-sidedly
  (:class:`odc.WeightReader`), cast to the rollout's dtype, and yields ``(name, tensor)`` by the names verl's
  generator yields (``state_dict()`` keys through verl's ``convert_weight_keys``, tied parameters under each of
  their names, packed MoE experts split by verl's ``unfuse_moe_params``), in its order.

Which module: verl calls ``engine.get_per_tensor_param()`` and hands only the generator over. The engine is found
by a tag: verl's ``FSDPEngine.get_per_tensor_param`` is wrapped (on the class, when an actor-side engine is made)
to remember, weakly, which engine made each generator; it returns what verl's returns, unchanged.

Which version: both sides derive it from the same two numbers, so neither waits on the other to learn it: ``p``,
the version the actor had published when ``prepare`` ran (``build_topology`` hands it to the rollout workers), and
verl's ``global_steps``: the version is ``global_steps`` when that is newer than ``p``, else ``p + 1`` (verl syncs
twice at one step after validation, and ``global_steps`` may be None). A rollout worker reads exactly that version;
if it was overwritten meanwhile (a reader more than K versions behind) it reads the newest and logs which.

Where: each rollout worker reads each actor rank by the route :class:`odc.WeightReader` picks (shared memory on
that rank's node, libfabric from another node: the actor serves its slots over libfabric too where it has an address
other nodes can reach, ``ODC_FABRIC_ADDR`` or a non-loopback ``MASTER_ADDR``). Rollout workers that share a node
without every actor rank on it share each version through that node's memory (``node_cache``: fetched across once per
node), and copy what crosses in pieces (``staging="pieces"``: two 64 MiB pieces per worker, not the model).

FSDP1 actors (``strategy="fsdp"``): verl's ``get_per_tensor_param`` calls FSDP1's ``state_dict()`` at once, which
all-gathers every unit; on actor ranks of an ``odc`` engine that call is deferred until the generator is first
iterated (verl's naive path iterates it: unchanged), so ``send_weights`` gathers nothing there either.

Refused by name: LoRA / peft actors, QAT, ``param_offload`` (parameters that move), a state dict with buffers,
weights that verl's FSDP engine did not make (Megatron, ...), FSDP1's hybrid and ``NO_SHARD`` strategies
(:func:`odc.fsdp.serve_weights`), an actor store on a loopback address with rollout workers on other nodes, and (at
the first read) an actor rank that serves no libfabric endpoint to a worker on another node.

This module imports verl; :func:`odc.integrations.verl.register_checkpoint_engine` imports it. It uses only
:mod:`odc.weights`' public API (and its FSDP1 name cleaning, so that both name FSDP1 parameters alike) and never
touches the training engine's communication (``odc.fsdp.enable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import ipaddress
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from .. import weights as odc_weights
from .._odc import weights_node as _node_id
from ..errors import ConfigError, LayoutError, StoreError

__all__ = ["BACKEND", "OdcCheckpointEngine", "register"]

BACKEND = "odc"
"""The name verl's config selects: ``actor_rollout_ref.rollout.checkpoint_engine.backend=odc``."""

_log = logging.getLogger(__name__)
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_PACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # what verl's unfuse_moe_params splits

# verl's weights generator -> the FSDP engine whose get_per_tensor_param made it (weakly: gone with the generator).
_exported: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register() -> None:
    """Registers :class:`OdcCheckpointEngine` in verl's ``CheckpointEngineRegistry`` as ``odc``. Idempotent."""
    CheckpointEngineRegistry.register(BACKEND)(OdcCheckpointEngine)


def _tag_exports() -> None:
    """Wraps verl's ``FSDPEngine.get_per_tensor_param`` (once) so that :meth:`OdcCheckpointEngine.send_weights`
    learns which engine made the generator it is handed. What verl returns is returned unchanged."""
    from verl.workers.engine.fsdp import transformer_impl as impl

    get = getattr(getattr(impl, "FSDPEngine", None), "get_per_tensor_param", None)
    if get is None:
        raise ConfigError("odc checkpoint engine: verl's FSDP engine (verl.workers.engine.fsdp.transformer_impl."
                          "FSDPEngine) has no get_per_tensor_param here; this engine was checked on verl 0.9.1")
    if hasattr(get, "__odc_wrapped__"):
        return

    @functools.wraps(get)
    def get_per_tensor_param(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_fsdp1(self.module) and not _is_peft(self.module):
            # verl's FSDP1 path runs state_dict() (an all-gather of every unit) before it returns; deferred until the
            # generator is first iterated. Without peft, verl returns no peft config.
            def deferred() -> Any:
                yield from get(self, *args, **kwargs)[0]

            out = (deferred(), None)
        else:
            out = get(self, *args, **kwargs)
        with contextlib.suppress(TypeError):  # not weakly referable: send_weights refuses it by name
            _exported[out[0]] = self
        return out

    get_per_tensor_param.__odc_wrapped__ = get  # type: ignore[attr-defined]
    impl.FSDPEngine.get_per_tensor_param = get_per_tensor_param


def _is_fsdp1(module: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _is_peft(module: Any) -> bool:
    return hasattr(getattr(module, "_fsdp_wrapped_module", module), "peft_config")


def _unprefixed(store: Any) -> Any:
    """The store under its ``PrefixStore`` wrappers: where ``serve_weights`` writes, and readers find it by address."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _store_address() -> str | None:
    """``host:port`` of this process's default process-group store (what ``serve_weights`` writes to), if any."""
    if not dist.is_initialized():
        return None
    store = _unprefixed(dist.distributed_c10d._get_default_store())
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host and port else None


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, the reader tries it


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dt = _DTYPES.get(str(value).removeprefix("torch.").lower())
    if dt is None:
        raise ConfigError(f"odc checkpoint engine: rollout_dtype={value!r}; expected one of {sorted(_DTYPES)}")
    return dt


def version_for(published: int, global_steps: int | None) -> int:
    """The version an update publishes and reads: ``global_steps`` when newer than ``published`` (the actor's
    version at ``prepare``, -1 before the first), else the next one."""
    if global_steps is not None and int(global_steps) > published:
        return int(global_steps)
    return published + 1


def check_actor(engine: Any) -> None:
    """Refuses, naming the setting, a verl actor engine whose weights the odc checkpoint engine cannot serve."""
    module = engine.module
    refuse = []
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule) and not _is_fsdp1(module):
        refuse.append(f"the actor module is a {type(module).__name__}, neither FSDP2 (strategy='fsdp2') nor FSDP1 "
                      "(strategy='fsdp')")
    if _is_peft(module):
        refuse.append("LoRA / peft (verl sends adapters or merges them into the weights; this engine serves the "
                      "module's own parameters)")
    if getattr(engine, "_qat_enabled", False):
        refuse.append("QAT (verl sends quantized weights; this engine serves the parameters as trained)")
    if getattr(engine, "_is_offload_param", False):
        refuse.append("param_offload (the parameters move between devices between updates)")
    if refuse:
        raise ConfigError("odc checkpoint engine: cannot serve this actor: " + "; ".join(refuse))


def _verl_names(engine: Any) -> tuple[list[tuple[str, str]], str | None]:
    """``(name verl's generator yields, served parameter name)`` in verl's order, and the model type verl splits
    packed MoE experts by. verl's names: ``state_dict()`` keys through ``convert_weight_keys``."""
    from verl.utils.model import convert_weight_keys

    module = engine.module
    if _is_fsdp1(module):
        served = _fsdp1_names(module)
        state: dict[str, Any] = dict(served)
    else:
        canonical = {id(p): n for n, p in module.named_parameters()}
        state = module.state_dict(keep_vars=True)  # the parameter objects themselves: nothing is copied
        for key, value in state.items():
            if id(value) not in canonical:
                raise ConfigError(f"odc checkpoint engine: the actor's state dict holds {key!r}, which is not a "
                                  "parameter (a persistent buffer?); this engine serves parameters only")
        state = {key: canonical[id(value)] for key, value in state.items()}
    # convert_weight_keys renames keys only; the values (served names) pass through in order.
    names = list(convert_weight_keys(state, getattr(module, "_fsdp_wrapped_module", module)).items())
    hf_config = getattr(getattr(engine, "model_config", None), "hf_config", None)
    return names, getattr(hf_config, "model_type", None)


def _fsdp1_names(module: Any) -> list[tuple[str, str]]:
    """``(state-dict key, served name)`` of an FSDP1 model's parameters, in the order its ``state_dict()`` gives
    them, without calling it (that all-gathers every unit): each module of the model in ``named_modules`` order,
    its parameters as its units' ``FlatParameter`` records them (``_param_infos``), then the ones it shares with a
    module before it (``_shared_param_infos``: served under the first owner's name). Names without FSDP1's wrapper
    prefixes, as ``serve_weights`` serves them.

    Raises:
        ConfigError: the model holds a persistent buffer (a state-dict entry that is not a parameter).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    clean: dict[int, str] = {}
    for n, m in module.named_modules():
        clean.setdefault(id(m), odc_weights._fsdp1_clean_name(n))
        buffers = [b for b in m._buffers if b not in m._non_persistent_buffers_set and m._buffers[b] is not None]
        if buffers:
            raise ConfigError(f"odc checkpoint engine: the actor's state dict holds {clean[id(m)]}.{buffers[0]}, a "
                              "persistent buffer; this engine serves parameters only")
    owned: dict[int, list[tuple[str, Any, str]]] = {}  # module -> (its name, owner module, owner's name)
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        if unit._handle is None:
            continue
        fp = unit._handle.flat_param
        for info in fp._param_infos:
            owned.setdefault(id(info.module), []).append((info.param_name, info.module, info.param_name))
        for shared in fp._shared_param_infos:
            owned.setdefault(id(shared.module), []).append((shared.param_name, shared.prim_module,
                                                           shared.prim_param_name))

    def join(m: Any, leaf: str) -> str:
        return f"{clean[id(m)]}.{leaf}" if clean[id(m)] else leaf

    names = []
    for _, m in module.named_modules():
        for leaf, owner, owner_leaf in owned.pop(id(m), []):
            names.append((join(m, leaf), join(owner, owner_leaf)))
    return names


def _names_key(name: str) -> str:
    return f"odc/verl/{name}/names"


class OdcCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # verl is untyped
    """verl checkpoint engine ``odc``: the rollout reads the actor's FSDP2 shards one-sidedly (module doc).

    verl makes one per actor rank (``is_master`` given) and one per rollout worker (``is_master`` not given), with
    ``bucket_size`` and the config's ``checkpoint_engine.engine_kwargs.odc``.

    Args:
        bucket_size: verl's transfer bucket; unused (a version is read whole).
        is_master: given by verl on actor ranks only; ``None`` on a rollout worker.
        name: the served name (``serve_weights(name=...)``); one per actor worker group sharing a store.
        slots: K >= 2 versions each actor rank keeps (memory: K times the rank's shard bytes, on the host).
        rollout_dtype: the dtype ``receive_weights`` yields (``"bfloat16"``, ``"float32"``, a ``torch.dtype``):
            set it to the rollout's ``dtype``.
        timeout: seconds a rollout worker waits for the actor's version (and its first attach).
        node_cache: on a rollout worker whose node lacks some actor rank, share each version through the node's
            memory (:class:`odc.WeightReader`'s ``node_cache``: one worker of the node fetches it across, every
            worker there reads the node's copy; memory: K copies of the model on the node). None (default): where
            more than one rollout worker runs on the node.

    Attributes:
        last_read: on a rollout worker, what the last ``receive_weights`` read: ``version``, ``asked``,
            ``newest``, ``age``, ``attempts``, ``seconds``, ``routes`` (how each actor rank was reached: ``shm``,
            ``fabric``, ``node-cache``) and ``cache_fetches`` (versions this worker fetched for its node, or None).
        server: on an actor rank, its :class:`odc.weights.WeightServer` (after the first ``send_weights``).

    Raises:
        ConfigError: an unknown engine kwarg or dtype, ``slots`` < 2.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool | None = None, *, name: str = "actor", slots: int = 2,
                 rollout_dtype: Any = "bfloat16", timeout: float = 120.0, node_cache: bool | None = None,
                 **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"odc checkpoint engine: unknown engine_kwargs {sorted(unknown)}; it takes name, "
                              "slots, rollout_dtype, timeout, node_cache")
        if node_cache not in (None, True, False):
            raise ConfigError(f"odc checkpoint engine: node_cache={node_cache!r}; expected true, false or null")
        if not isinstance(slots, int) or slots < 2:
            raise ConfigError(f"odc checkpoint engine: slots={slots!r}; K must be an integer >= 2")
        self.bucket_size, self.is_master, self.name, self.slots = bucket_size, is_master, name, slots
        self.rollout_dtype, self.timeout, self.node_cache = _dtype(rollout_dtype), float(timeout), node_cache
        self.server: odc_weights.WeightServer | None = None
        self.last_read: dict[str, Any] = {}
        self._served: tuple[Any, dict[str, int]] | None = None  # (module, fqn -> local shard address)
        self._source: dict[str, Any] | None = None
        self._reader: odc_weights.WeightReader | None = None
        self._reader_of: tuple[str, str, bool] | None = None
        self._names: list[tuple[str, str]] = []
        self._model_type: str | None = None
        if is_master is not None:  # an actor rank: learn which engine makes the weights verl hands over
            _tag_exports()

    # ---- both sides -------------------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """What ``build_topology`` needs: this node, and on an actor rank the store, the served name, the version
        published so far (-1 before the first ``send_weights``) and whether other nodes can read its slots (None
        before the first); on a rollout worker its ``node_cache``."""
        meta = {"node": _node_id(), "store": _store_address(), "name": self.name,
                "published": -1 if self.server is None else self.server.version, "node_cache": self.node_cache}
        if self.server is not None:
            meta.update(fabric=self.server.fabric, fabric_error=self.server.fabric_error)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Hands the actor's store, name and published version to every rollout worker, and whether it shares what
        crosses through its node's memory (``node_cache``; None: where more than one rollout worker runs on the
        node). Refuses what a worker on another node could not read: a loopback store, an actor rank serving no
        libfabric endpoint."""
        actor, rollout = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if not actor or len(rollout) != rollout_world_size:
            raise ConfigError(f"odc checkpoint engine: {len(metadata)} workers' metadata for {actor_wg_world_size} "
                              f"actor ranks and {rollout_world_size} rollout workers")
        first = actor[0]
        if first["store"] is None:
            raise ConfigError("odc checkpoint engine: actor rank 0 has no TCPStore address (its default process "
                              "group's store); readers find the served weights through it")
        for r, m in enumerate(actor):
            for k in ("store", "name", "published"):
                if m[k] != first[k]:
                    raise ConfigError(f"odc checkpoint engine: actor rank {r} has {k}={m[k]!r}, rank 0 "
                                      f"{first[k]!r}")
        actor_nodes = [m["node"] for m in actor]
        per_node: dict[str, int] = {}
        for m in rollout:
            per_node[m["node"]] = per_node.get(m["node"], 0) + 1
        sources = []
        for i, m in enumerate(rollout):
            remote = [r for r, n in enumerate(actor_nodes) if n != m["node"]]
            if remote and _is_loopback(first["store"]):
                raise ConfigError(f"odc checkpoint engine: rollout worker {i} runs on another node than actor rank "
                                  f"{remote[0]}, and the actor's store is at {first['store']}, a loopback address it "
                                  "cannot reach: start the actor with a MASTER_ADDR other nodes reach")
            for r in remote:
                if actor[r].get("fabric") is False:
                    raise ConfigError(f"odc checkpoint engine: rollout worker {i} runs on another node than actor "
                                      f"rank {r}, which serves its weights to its own node only: "
                                      f"{actor[r].get('fabric_error')}")
            cache = m.get("node_cache")
            source = {k: first[k] for k in ("store", "name", "published")}
            source["node_cache"] = per_node[m["node"]] > 1 if cache is None else bool(cache)
            sources.append(source)
        return {}, {"source": sources}

    def init_process_group(self, source: dict[str, Any] | None = None, **_: Any) -> None:
        """Rollout worker: keeps where to read (``source``). Actor rank: nothing (no group is formed)."""
        if source is not None:
            self._source = dict(source)

    def finalize(self) -> None:
        """Nothing to free: the actor's slots and the rollout's mapping of them are kept for the next update."""
        self._source = None

    # ---- actor ------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        """Publishes this update's version of this rank's shards (a local copy, no collective) without iterating
        ``weights`` (which would all-gather every parameter). Returns verl metrics: the version and the publish's
        seconds.

        Raises:
            ConfigError: ``weights`` was not made by verl's FSDP engine, or the actor is one this engine refuses
                (see :func:`check_actor`), or its parameters moved since the first update.
        """
        try:
            engine = _exported.pop(weights, None)
        except TypeError:
            engine = None
        if engine is None:
            raise ConfigError(
                "odc checkpoint engine: send_weights was handed weights that verl's FSDP engine's "
                f"get_per_tensor_param did not make ({type(weights).__name__}); it serves FSDP2 actors only (the "
                "Megatron, VeOmni and TorchTitan engines are not served)")
        check_actor(engine)
        close = getattr(weights, "close", None)
        if close is not None:
            close()  # never started: verl's generator gathered nothing
        metrics: dict[str, float] = {}
        published = -1 if self.server is None else self.server.version
        version = version_for(published, global_steps)
        if self.server is None:
            t0 = time.perf_counter()
            self._serve(engine)
            metrics["checkpoint_engine/odc_serve_s"] = time.perf_counter() - t0
        else:
            self._check_unmoved(engine.module)
        assert self.server is not None
        seconds = 0.0
        if version > self.server.version:  # serving published version 0 already
            t0 = time.perf_counter()
            self.server.publish(version)
            seconds = time.perf_counter() - t0
        metrics.update({"checkpoint_engine/odc_version": float(version), "checkpoint_engine/odc_publish_s": seconds,
                        "checkpoint_engine/odc_shard_mbytes": self.server.slot_bytes / (1 << 20)})
        return metrics

    def _serve(self, engine: Any) -> None:
        import odc.fsdp

        module = engine.module
        names, model_type = _verl_names(engine)
        self.server = odc.fsdp.serve_weights(module, None, name=self.name, slots=self.slots, timeout=self.timeout)
        self._served = (module, self._addresses(module))
        if self.server.rank == 0:
            base = _unprefixed(dist.distributed_c10d._get_default_store())
            base.set(_names_key(self.name), json.dumps({"names": names, "model_type": model_type}))

    @staticmethod
    def _addresses(module: Any) -> dict[str, int]:
        """Where each served tensor's storage is: FSDP2's local shards by parameter; FSDP1's FlatParameter shards
        (``_local_shard``: what ``serve_weights`` copies from) by unit."""
        if _is_fsdp1(module):
            from torch.distributed.fsdp import FullyShardedDataParallel

            return {n or "(root)": getattr(u._handle.flat_param, "_local_shard", u._handle.flat_param).data_ptr()
                    for n, u in module.named_modules()
                    if isinstance(u, FullyShardedDataParallel) and u._handle is not None}
        return {n: (p.to_local() if hasattr(p, "to_local") else p).data_ptr() for n, p in module.named_parameters()}

    def _check_unmoved(self, module: Any) -> None:
        assert self._served is not None
        served, addresses = self._served
        if module is not served:
            raise ConfigError("odc checkpoint engine: send_weights got another actor module than the one it serves "
                              f"as {self.name!r}; make one checkpoint engine per actor")
        for n, a in self._addresses(module).items():
            if addresses.get(n) != a:
                what = f"FSDP1 unit {n!r}" if _is_fsdp1(module) else f"parameter {n!r}"
                raise ConfigError(f"odc checkpoint engine: {what}'s local shard moved since it was served "
                                  "(a parameter offload or a reload replaced its storage); this engine serves "
                                  "parameters that stay in place")

    # ---- rollout ----------------------------------------------------------------------------------------------

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Reads this update's version whole, in ``rollout_dtype``, and yields ``(name, tensor)`` by verl's names
        and in its order. Records what it read in :attr:`last_read`.

        Raises:
            ConfigError: no ``init_process_group`` (with the actor's source) came before.
            PeerTimeout: the actor published nothing newer within ``timeout``.
        """
        source = self._source
        if source is None:
            raise ConfigError("odc checkpoint engine: receive_weights before init_process_group handed this rollout "
                              "worker the actor's source (build_topology's rollout kwargs)")
        asked = version_for(int(source["published"]), global_steps)
        got = await asyncio.to_thread(self._read, source, asked)
        tensors = got.tensors
        assert tensors is not None
        items: Iterable[tuple[str, torch.Tensor]] = ((n, tensors[fqn]) for n, fqn in self._names)
        if any(n.endswith(_PACKED) for n, _ in self._names):
            from verl.workers.engine.fsdp.utils import unfuse_moe_params

            items = unfuse_moe_params(items, self._model_type)
        for item in items:
            yield item

    def _read(self, source: dict[str, Any], asked: int) -> odc_weights.ReadResult:
        key = (str(source["store"]), str(source["name"]), bool(source.get("node_cache")))
        if self._reader is None or self._reader_of != key:
            reader = odc_weights.WeightReader(key[0], name=key[1], timeout=self.timeout, node_cache=key[2],
                                              staging="pieces")
            names, model_type = self._fetch_names(key[0], key[1])
            missing = [fqn for _, fqn in names if fqn not in reader.params]
            if missing:
                raise LayoutError(f"odc checkpoint engine: the actor names {missing[0]!r}, which {key[1]!r} does "
                                  "not serve")
            self._reader, self._reader_of, self._names, self._model_type = reader, key, names, model_type
        try:
            got = self._reader.read(version=asked, dtype=self.rollout_dtype, timeout=self.timeout)
        except odc_weights.VersionRefused as e:
            _log.warning("odc checkpoint engine: version %d was overwritten while read (%s); reading the newest",
                         asked, e)
            got = self._reader.read(version="latest", dtype=self.rollout_dtype, timeout=self.timeout)
        self.last_read = {"version": got.version, "asked": asked, "newest": got.newest, "age": got.age,
                          "attempts": got.attempts, "seconds": got.seconds, "routes": list(self._reader.routes),
                          "cache_fetches": self._reader.cache_fetches}
        _log.info("odc checkpoint engine: read version %d (asked %d; newest %d) in %.3f s", got.version, asked,
                  got.newest, got.seconds)
        return got

    def _fetch_names(self, address: str, name: str) -> tuple[list[tuple[str, str]], str | None]:
        """verl's names for the served parameters and the model type, as actor rank 0 put them in the store."""
        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False,  # type: ignore[attr-defined]
                              timeout=datetime.timedelta(seconds=self.timeout))
        key, deadline = _names_key(name), time.monotonic() + self.timeout
        while not store.check([key]):  # set by actor rank 0 right after serve_weights, which the reader found
            if time.monotonic() >= deadline:
                raise StoreError(f"odc checkpoint engine: store key {key} (verl's names of what actor rank 0 "
                                 f"serves as {name!r}) not set after {self.timeout:g} s")
            time.sleep(0.01)
        info = json.loads(store.get(key))
        return [(str(a), str(b)) for a, b in info["names"]], info.get("model_type")
