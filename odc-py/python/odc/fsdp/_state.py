"""The ODC state of one enabled model (:class:`_Binding`): its engine, its groups, the minibatch
protocol (begin, finish, advance) and the optimizer and zero_grad hooks that drive it.

It uses the gradient contract (:mod:`._grads`) and the groups :mod:`._private` describes; the FSDP2
seams (:mod:`._seams`) and the public API call into it, never the other way round.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from ..engine import Engine
from ..errors import ConfigError, ProtocolError
from ._grads import GradContract
from ._private import _Group, _Layout

_NORM_BUCKET = "odc-fsdp/grad-norm"
SHARDINGS = ("full", "hybrid", "hybrid-zero")
_enables = itertools.count()  # one per enable() in this process; equal on every rank
_live: weakref.WeakSet[_Binding] = weakref.WeakSet()
_solos: weakref.WeakSet[_Solo] = weakref.WeakSet()  # models enabled on one rank


class _Binding:
    """The ODC state of one enabled model (one engine, one bucket per group).

    The minibatch protocol, in the order a loop drives it: :meth:`begin`
    (every gather and push), :meth:`finish` (a gradient read, the
    optimizer's step pre-hook, :func:`finish`), :meth:`advance` (the step
    post-hook, or the first forward after a skipped step).

    The parameter contract: a minibatch's parameters are published by this
    rank's first operation in it (:meth:`begin` or :meth:`finish`), not by
    the step that made them, so whatever changed them in between (a
    state-dict load, a second optimizer, an in-place edit) is what every
    peer gathers. A change after that, within the minibatch, is refused at
    this rank's next gather (:meth:`check_unchanged`).
    """

    def __init__(self, model: FSDPModule, groups: list[_Group], engine: Engine, layout: _Layout) -> None:
        self.model = model
        self.groups = groups
        self.engine = engine
        self.layout = layout
        self.shards = layout.shards
        self.index = layout.index
        self.hybrid = layout.sharding == "hybrid"
        self.version = 0  # the running (or last finished) minibatch; its gathers read this version
        self.open = True  # minibatch `version` is running (not finished)
        self.published = False  # this rank published minibatch `version`'s parameters (its first operation does)
        self.seen: list[list[tuple[Any, int]]] = []  # per group: (parameter, its version counter) when published
        self.pushed = False  # this rank pushed gradients in the running minibatch
        self.regathers = 0  # backward re-gathers under reshard_after_forward=int (hybrid-zero), for the tests
        self.finished_by = ""  # what finished the last minibatch (for errors)
        self.cleared = False  # gradients cleared after a finish without a step hook (a skipped or hand-made step)
        self.clipped = -1  # last minibatch whose gradients were clipped
        self.hooks: list[Any] = []  # optimizer hook handles and zero_grad undos
        self.optimizers = 0  # optimizers hooked by enable
        self.stepped: set[int] = set()  # those that stepped since the minibatch finished
        self.abandoned: tuple[int, list[int]] | None = None  # (minibatch, own microbatches left unrun)
        self.all_reduce_was: list[bool] = []  # FSDP's HSDP all-reduce flags, restored by disable
        self.param_ids = {id(fp.sharded_param) for g in groups for fp in g.pg.fsdp_params}
        self.device = engine.device  # where the engine's tensors live (the parameters' device)
        self.grads = GradContract(self, groups)

    # -- protocol ------------------------------------------------------------
    def begin(self, what: str) -> None:
        """A gather, a push or a gradient read of the running minibatch.

        After a finished minibatch whose gradients were then cleared without
        an optimizer step hook (a skipped step, or a step the loop made by
        hand), starts the next minibatch: the current parameters are its
        version.
        """
        if not self.open:
            if not self.cleared:
                raise ProtocolError(
                    f"odc.fsdp: {what}, but minibatch {self.version}'s gradients are final already "
                    f"({self.finished_by} finished it); read gradients only after the minibatch's last backward, "
                    "step the optimizer before the next minibatch (to skip a step, call optimizer.zero_grad() "
                    "instead), or, without an optimizer hook, enter odc.fsdp.minibatch"
                )
            self.advance()
        if not self.published:
            self.publish_all()

    def publish_all(self, check: bool = True) -> None:
        """Publishes this rank's shards, as they are now, as minibatch ``version``'s parameters (``check``:
        refuse parameters frozen since ``enable`` first)."""
        if check:
            self.grads.check_frozen()
        for g in self.groups:
            shard = g.staging()
            torch.cat(g.gather_inputs(), out=shard[: g.n])
            self.engine.publish(g.name, shard, self.version)
        self.seen = [[(fp.sharded_param, fp.sharded_param._version) for fp in g.pg.fsdp_params] for g in self.groups]
        self.published = True

    def check_unchanged(self, g: _Group) -> None:
        """Refuses a gather of ``g`` after one of its parameters changed in place since this minibatch's publish.

        The peers gather the published copy, this rank its parameters as they
        are: they would compute with different weights. Sees what goes
        through the parameter (``p.mul_``, ``p.copy_``, ``load_state_dict``,
        an optimizer's per-parameter step); ``p.data`` edits and
        ``torch._foreach_*`` ops bypass its version counter.
        """
        for (p, seen), fp in zip(self.seen[g.index], g.pg.fsdp_params, strict=True):
            now = fp.sharded_param
            if now is p and now._version == seen:
                continue
            # FSDP1's wrapper prefix out: the names the user's model defines.
            names = {id(q): n.replace("_fsdp_wrapped_module.", "")
                     for n, q in self.model.named_parameters()}  # type: ignore[attr-defined]
            name = names.get(id(now), f"{g.name}'s parameter {g.pg.fsdp_params.index(fp)}")
            raise ProtocolError(
                f"odc.fsdp: parameter {name} changed in place during minibatch {self.version}, after this rank "
                "published it to its peers (at its first gather, push or gradient read of the minibatch): the "
                "peers would compute with the old values, this rank with the new ones. Change parameters only "
                "between minibatches (after optimizer.step() and before the next minibatch's first forward); "
                "to evaluate other weights (an EMA swap), swap them in, evaluate inside "
                "`with odc.fsdp.evaluation(model):` on every rank, and swap them back after it"
            )

    def finish(self, reason: str, install: bool = True) -> None:
        """Ends the running minibatch: own gradient shards final, installed as ``.grad``."""
        if not self.open:
            return
        if self.abandoned is not None and self.abandoned[0] == self.version:
            left, self.abandoned = self.abandoned[1], None
            raise ProtocolError(
                f"odc.fsdp.microbatches: the loop left minibatch {self.version}'s iteration early (a break or an "
                f"exception) with {len(left)} of this rank's own microbatches unclaimed (indices {left} of its "
                "list); they ran nowhere, so the minibatch's gradients would miss them. Iterate "
                "odc.fsdp.microbatches to the end on every rank (to skip a microbatch, continue inside the loop)"
            )
        if not self.published:  # a rank that ran nothing in this minibatch publishes for its peers here
            self.publish_all(check=install)  # disable (install=False) tears down whatever was frozen
        self.engine.finish_minibatch(self.version)
        self.open = False
        self.finished_by = reason
        if self.hybrid:
            # FSDP parked its reduce-scatter outputs (zeros) as HSDP partials
            # awaiting an all-reduce that never comes; they would stay
            # allocated, a gradient's worth per group.
            for g in self.groups:
                g.drop_parked()
        if install:
            self.grads.install([self.engine.grad_shard(g.name) for g in self.groups])
        self.engine.zero_grad()
        self.pushed = False

    def advance(self) -> None:
        """Starts the next minibatch (after :meth:`finish`); its first operation publishes its parameters."""
        if self.open:
            return
        self.version += 1
        self.published = False
        self.open = True
        self.cleared = False
        self.stepped.clear()

    # -- evaluation on other weights (odc.fsdp.evaluation) -------------------------
    def begin_evaluation(self) -> None:
        """Enters :func:`odc.fsdp.evaluation`: only between minibatches (nothing of the next one ran yet)."""
        if not self.open and self.cleared:
            self.advance()
        if not self.open or self.published or self.pushed:
            raise ProtocolError(
                f"odc.fsdp.evaluation entered during minibatch {self.version}"
                + (" after its gradients were finished and before the optimizer step" if not self.open
                   else ", after this rank's first forward or backward of it")
                + ": enter it between minibatches, after optimizer.step() (or after optimizer.zero_grad() where "
                "the step is skipped) and before the next minibatch's first forward, on every rank"
            )

    def end_evaluation(self) -> None:
        """Leaves :func:`odc.fsdp.evaluation`: finishes its minibatch (one synchronization, no gradients) and opens
        the next, whose first operation publishes the parameters as they are then."""
        pushed = self.pushed
        self.finish("leaving odc.fsdp.evaluation", install=False)
        self.advance()
        self.grads.pend(self.version)
        if pushed:
            raise ProtocolError(
                f"odc.fsdp.evaluation: a backward inside the block pushed gradients (minibatch {self.version - 1}); "
                "they were dropped when it ended. Evaluate under torch.no_grad() and train outside the block"
            )

    # -- optimizer and zero_grad hooks -----------------------------------------
    def before_step(self) -> None:
        if self.open and not self.pushed and self.grads.stepped_twice():
            raise ProtocolError(
                f"odc.fsdp: optimizer.step() again in minibatch {self.version}: every gradient is still the one "
                "the previous step used (no backward and no zero_grad since). Step once per minibatch; a rank "
                "that runs no microbatch in a minibatch must still call optimizer.zero_grad() after each step, "
                "so that ODC installs the new minibatch's gradients"
            )
        self.finish("optimizer.step()")

    def after_step(self, which: int) -> None:
        """Optimizer ``which`` stepped; the next minibatch starts once every hooked optimizer has."""
        self.stepped.add(which)
        if len(self.stepped) == self.optimizers:
            self.stepped.clear()
            self.advance()

    def check_zero_grad(self) -> None:
        if self.open and self.pushed:
            raise ProtocolError(
                f"odc.fsdp: zero_grad() in the middle of minibatch {self.version}, after this rank had pushed "
                "gradients to their owners, which ODC cannot take back; clear gradients only between minibatches "
                "(after optimizer.step(), or before the minibatch's first backward)"
            )

    def after_zero_grad(self) -> None:
        if not self.open:
            self.cleared = True
        # Pending again, so that a rank with no microbatch in the next minibatch reads final gradients.
        self.grads.pend(self.version if self.open else self.version + 1)


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


def _binding(model: Any) -> _Binding:
    b = getattr(model, "_odc_fsdp", None)
    if not isinstance(b, _Binding):
        raise ConfigError("odc.fsdp: this model is not enabled; call odc.fsdp.enable(model, optimizer) first")
    return b


