"""What ``odc.fsdp.enable`` leaves on a model (:class:`_Binding`, made by :func:`bind`, the pipeline's third
step): the minibatch state machine (:mod:`._state`) and the gradient contract (:mod:`._grads`) of one enabled
model, driven by the loop's optimizer and ``zero_grad`` hooks, ``odc.fsdp.minibatch`` and
``odc.fsdp.evaluation``.

FSDP2's seams (:mod:`._seams`), FSDP1's (:mod:`._fsdp1`), the clip (:mod:`._clip`) and the work-stealing
iterator (:mod:`._steal`) call into it; it calls into the contract and the state machine, never back up.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..engine import Engine
from ..errors import ConfigError, PeerError, ProtocolError
from ._grads import GradContract, wrap_zero_grad
from ._private import Replica, _Group, _Layout, _Model
from ._state import Minibatch
from ._transport import _param_device

SHARDINGS = ("full", "hybrid", "hybrid-zero")
_live: weakref.WeakSet[_Binding] = weakref.WeakSet()
_solos: weakref.WeakSet[_Solo] = weakref.WeakSet()  # models enabled on one rank


class _Binding:
    """The ODC state of one enabled model: its minibatch state machine (``state``), its gradient contract
    (``grads``) and the hooks that drive them.

    The minibatch protocol, in the order a loop drives it: ``state.begin``
    (every gather and push), :meth:`finish` (a gradient read, the optimizer's
    step pre-hook, :func:`odc.fsdp.finish`), ``state.advance`` (the step
    post-hook, or the first forward after a skipped step).
    """

    def __init__(self, model: Any, groups: list[_Group], engine: Engine, layout: _Layout,
                 reshard: Callable[[], None]) -> None:
        self.model = model
        self.state = Minibatch(model, groups, engine, layout)
        self.state.on_advance = self.admit  # every path into the next minibatch lets admitted nodes in
        self.grads = GradContract(self.state, groups)
        self.state.may_continue = self.grads.unchanged_since_install
        self.reshard = reshard  # reshards every FSDP module of the model (FSDP2's or FSDP1's way)
        self.hooks: list[Any] = []  # optimizer hook handles and zero_grad undos
        self.optimizers = 0  # optimizers hooked by enable
        self.optimizer_objs: list[Any] = []  # those optimizers
        self.replica: Replica | None = None  # elastic: what a rejoining node copies (set by enable and rejoin)
        self.stepped: set[int] = set()  # those that stepped since the minibatch finished
        self.stepped_in = -1  # the minibatch they stepped after (a start by another path resets the set)
        self.rerun = False  # elastic="rerun": dropped microbatches run again (odc.fsdp.microbatches reruns them)
        self.all_reduce_was: list[bool] = []  # FSDP's HSDP all-reduce flags, restored by disable
        # Every parameter the loop may hand to odc.fsdp.clip_grad_norm_, on every rank the same set: the
        # model's (FSDP1 with use_orig_params=True: also those wholly in another rank's shard) and FSDP's.
        self.param_ids = {id(p) for p in model.parameters()} | {
            id(fp.sharded_param) for g in groups for fp in g.pg.fsdp_params}

    # Read by the tests and the integrations.
    @property
    def engine(self) -> Engine:
        return self.state.engine

    @property
    def groups(self) -> list[_Group]:
        return self.state.groups

    def finish(self, reason: str, install: bool = True) -> None:
        """Ends the running minibatch: own gradient shards final, installed as ``.grad``."""
        self.grads.finish(reason, install)

    # -- odc.fsdp.minibatch ----------------------------------------------------
    def enter_minibatch(self) -> None:
        """Entering ``odc.fsdp.minibatch``: the next minibatch (or the first), never one left by an exception."""
        self.state.check_not_broken("odc.fsdp.minibatch entered")
        self.state.advance()

    def leave_minibatch(self, exc: BaseException | None) -> None:
        """Leaving ``odc.fsdp.minibatch``: finishes the minibatch, also after an exception out of the block.

        After an exception this rank abandons the minibatch: it finishes it (the peers are not left waiting
        for this rank, and its next block is the next minibatch, not this one again) with its skip mark, so
        that every rank skips it (:meth:`skip`), with a warning that says so. Where it cannot be finished (a
        peer died or stalled, a Ctrl-C, a second failure), every later operation is refused naming the
        minibatch instead.
        """
        if exc is None:
            self.finish("leaving odc.fsdp.minibatch")
            return
        s = self.state
        what = f"{type(exc).__name__}: {exc}"
        if not s.open:
            # Finished already (a gradient read, an explicit finish) before the exception: its gradients are
            # final on every rank, and a peer may step on them; nothing can be taken back here.
            warnings.warn(
                f"odc.fsdp.minibatch: {what} left the block after minibatch {s.version} had finished "
                f"({s.finished_by}): its gradients are final in .grad on every rank, and the peers step on them "
                "unless they skip it too; step on them here as well, or raise before reading gradients so "
                "that ODC skips the minibatch on every rank",
                RuntimeWarning, stacklevel=4,
            )
            return
        if isinstance(exc, PeerError) or not isinstance(exc, Exception):
            s.break_off(what)
            return
        try:
            self.skip(f"an exception out of odc.fsdp.minibatch ({type(exc).__name__})")
        except Exception as e:
            if s.open:
                s.break_off(f"{what}; then, finishing it: {type(e).__name__}: {e}")
                return
            # Finished and skipped; what else it says (microbatches left early) is part of the skip.
        warnings.warn(
            f"odc.fsdp.minibatch: {what} left minibatch {s.version} early; it was skipped on every rank: no "
            "rank's gradients hold any of it (.grad is as before the minibatch), no step trains on it, and the "
            "peers went on. The next block is the next minibatch",
            RuntimeWarning, stacklevel=4,
        )

    def skip(self, why: str) -> None:
        """This rank abandons the running minibatch (``why``): it finishes it with its skip mark, and every
        rank's finish of it then skips it alike (:meth:`GradContract.finish`: the sums cleared, ``.grad`` as
        before the minibatch, a hooked optimizer's step on it a no-op). Between minibatches (the gradients
        of the last one cleared without a step) it skips the next one."""
        s = self.state
        s.check_not_broken("odc.fsdp.skip")
        if not s.open and s.cleared:
            s.advance()
        if not s.open:
            raise ProtocolError(
                f"odc.fsdp.skip: minibatch {s.version} has finished already ({s.finished_by}): every rank holds "
                "the same final gradients, and the peers may have stepped on them. Skip before the gradients "
                "are read (a step, a clip, a norm), or skip the step on every rank alike (a non-finite norm, "
                "which every rank reads the same)"
            )
        s.abandoned = why
        self.finish(why)

    # -- evaluation on other weights (odc.fsdp.evaluation) -------------------------
    def begin_evaluation(self) -> None:
        """Enters :func:`odc.fsdp.evaluation`: only between minibatches (nothing of the next one ran yet)."""
        self.state.check_not_broken("odc.fsdp.evaluation entered")
        self.state.check_between("odc.fsdp.evaluation")

    def end_evaluation(self) -> None:
        """Leaves :func:`odc.fsdp.evaluation`: reshards every FSDP module (the evaluated weights are not the
        next minibatch's), finishes its minibatch (one synchronization, no gradients) and opens the next,
        whose first operation publishes the parameters as they are then."""
        s = self.state
        pushed = s.pushed
        self.reshard()
        self.finish("leaving odc.fsdp.evaluation", install=False)
        s.advance()
        self.grads.pend(s.version)
        if pushed:
            raise ProtocolError(
                f"odc.fsdp.evaluation: a backward inside the block pushed gradients (minibatch {s.version - 1}); "
                "they were dropped when it ended. Evaluate under torch.no_grad() and train outside the block"
            )

    # -- optimizer and zero_grad hooks -----------------------------------------
    def before_step(self, optimizer: Any) -> None:
        s = self.state
        if s.open and not s.pushed and self.grads.stepped_twice():
            raise ProtocolError(
                f"odc.fsdp: optimizer.step() again in minibatch {s.version}: every gradient is still the one "
                "the previous step used (no backward and no zero_grad since). Step once per minibatch; a rank "
                "that runs no microbatch in a minibatch must still call optimizer.zero_grad() after each step, "
                "so that ODC installs the new minibatch's gradients"
            )
        s.check_not_broken("optimizer.step()")
        self.finish("optimizer.step()")
        if s.skipped:
            # A skipped minibatch (some rank abandoned it): the step trains on nothing, on every rank alike.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        if self.rerun and (drops := self.drops()):
            nodes = sorted({d["node"] for d in drops})
            raise ProtocolError(
                f"odc.fsdp: optimizer.step() on the gradients of minibatch {s.version}, which dropped node(s) "
                f"{nodes} under elastic='rerun': their microbatches of it are not in the gradients. Iterate "
                "odc.fsdp.microbatches (it reruns them on the member nodes), or run them again in "
                "odc.fsdp.minibatch blocks while odc.fsdp.dropped(model) names drops (docs/elastic.md), then step"
            )
        s.release_held()  # the step uses the gradients: the next minibatch starts from zero

    def after_step(self, which: int) -> None:
        """Optimizer ``which`` stepped; the next minibatch starts once every hooked optimizer has."""
        if self.stepped_in != self.state.version:
            self.stepped.clear()
            self.stepped_in = self.state.version
        self.stepped.add(which)
        if len(self.stepped) == self.optimizers:
            self.stepped.clear()
            self.state.advance()

    def drops(self) -> list[dict[str, Any]]:
        """The node drops of the minibatch this rank finished last (empty while one runs)."""
        s = self.state
        if s.open:
            return []
        return [{**e, "since": s.since} for e in s.engine.elastic_events()
                if e["kind"] == "drop" and e["minibatch"] == s.version]

    def admit(self) -> None:
        """Elastic: where the last minibatch's round admitted a restarted node, begins the engine generation
        that counts it (every member rank, as the next minibatch starts: after the step, a skipped step's
        ``zero_grad`` or at ``odc.fsdp.minibatch``) and serves this rank's replica state to its joiner
        (:meth:`Replica.serve`: the tensors now, the rest at the next minibatch's first operation), or declines
        it where the replica cannot be copied; nothing otherwise."""
        s = self.state
        if s.engine.admitted is None:
            return
        if s.continuing:
            # No step since the last minibatch (a rerun, or several minibatches per step): a node let in here
            # would start in the middle of the step, without the gradients of its first part.
            s.engine._decline(f"minibatch {s.version} continues minibatch {s.version - 1}'s gradients, no step "
                              "between")
            return
        if s.finished_by == "leaving odc.fsdp.evaluation":
            # The block's exit: the weights it evaluated are still swapped in (the loop swaps them back after it).
            s.engine._decline(f"minibatch {s.version - 1} was an odc.fsdp.evaluation block, whose weights are "
                              "still swapped in as it ends")
            return
        s.engine = (self.replica or Replica(self.model, self.optimizer_objs)).serve(s.engine, s.groups)

    def check_zero_grad(self) -> None:
        s = self.state
        if s.open and s.pushed:
            raise ProtocolError(
                f"odc.fsdp: zero_grad() in the middle of minibatch {s.version}, after this rank had pushed "
                "gradients to their owners, which ODC cannot take back; clear gradients only between minibatches "
                "(after optimizer.step(), or before the minibatch's first backward)"
            )

    def after_zero_grad(self) -> None:
        s = self.state
        if not s.open:
            s.cleared = True
            s.release_held()
        # Pending again, so that a rank with no microbatch in the next minibatch reads final gradients.
        self.grads.pend(s.version if s.open else s.version + 1)


def bind(m: _Model, engine: Engine, *, first: int = 0, rerun: bool = False) -> _Binding:
    """Binds ``engine`` (its buckets registered) to the described model: staging buffers, the gradient contract
    and the optimizer and ``zero_grad`` hooks (the seams come next: ``m.install``); ``first`` is the minibatch the
    model runs first (a rejoined node's, else 0); ``rerun``: ``elastic="rerun"``."""
    model, groups = m.module, m.groups
    device = _param_device(groups)
    for g in groups:
        g.shard_len = engine.bucket(g.name)["piece_len"]  # the shard, or this rank's piece (hybrid-zero)
        g.shard = torch.zeros(g.shard_len, dtype=g.dtype, device=device)
    b = _Binding(model, groups, engine, m.layout, m.reshard)  # the first operation of minibatch `first` publishes
    b.state.version = b.state.since = first
    b.rerun = rerun
    b.replica = m.replica
    if b.state.hybrid and not m.fsdp1:
        b.all_reduce_was = [g.pg.all_reduce_grads for g in groups]
        model.set_requires_all_reduce(False)  # the engine reduces across nodes
    b.grads.refuse_foreign_hooks()
    if not m.fsdp1:
        b.grads.ensure_hooked(b.grads.params)
    b.grads.pend(first)  # a rank with no microbatch in its first minibatch reads final gradients too
    for i, opt in enumerate(m.optimizers):
        b.hooks.append(opt.register_step_pre_hook(lambda o, *_: b.before_step(o)))
        b.hooks.append(opt.register_step_post_hook(lambda *_, i=i: b.after_step(i)))
        b.hooks.append(_Undo(wrap_zero_grad(opt, b.after_zero_grad, b.check_zero_grad)))
    b.optimizers = len(m.optimizers)
    b.optimizer_objs = m.optimizers
    b.grads.zeros_for_none = bool(m.optimizers)  # a skipped minibatch: their hooked step is made a no-op
    b.hooks.append(_Undo(wrap_zero_grad(model, b.after_zero_grad, b.check_zero_grad)))
    model.__dict__["_odc_fsdp"] = b
    _live.add(b)
    return b


def bind_solo(model: Any) -> None:
    """World size 1: FSDP bypasses both seams, so there is nothing to replace; every call a no-op."""
    model.__dict__["_odc_fsdp"] = s = _Solo(model)
    _solos.add(s)


class _Undo:
    """A removable handle (like torch's hook handles) around an undo function."""

    def __init__(self, undo: Any) -> None:
        self.remove = undo


class _Solo:
    """An enabled model on one rank: FSDP2 bypasses both seams at world size 1, so there is nothing to
    replace, and every ``odc.fsdp`` call does what it does on many ranks with nothing to wait for."""

    def __init__(self, model: Any) -> None:
        self.param_ids = {id(p) for p in model.parameters()}


def solo(model: Any) -> _Solo | None:
    """The model's :class:`_Solo` where it was enabled on one rank."""
    s = getattr(model, "_odc_fsdp", None)
    return s if isinstance(s, _Solo) else None


def _bound(model: Any) -> _Binding:
    b = getattr(model, "_odc_fsdp", None)
    if not isinstance(b, _Binding):
        raise ConfigError("odc.fsdp: this model is not enabled; call odc.fsdp.enable(model, optimizer) first")
    return b
