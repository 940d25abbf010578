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
from ._private import _get_param_all_gather_inputs, _Group, _Layout, drop_partial_reduce

_NORM_BUCKET = "odc-fsdp/grad-norm"
SHARDINGS = ("full", "hybrid", "hybrid-zero")
_enables = itertools.count()  # one per enable() in this process; equal on every rank
_live: weakref.WeakSet[_Binding] = weakref.WeakSet()


class _Binding:
    """The ODC state of one enabled model (one engine, one bucket per group).

    The minibatch protocol, in the order a loop drives it: :meth:`begin`
    (every gather and push), :meth:`finish` (a gradient read, the
    optimizer's step pre-hook, :func:`finish`), :meth:`advance` (the step
    post-hook, or the first forward after a skipped step).
    """

    def __init__(self, model: FSDPModule, groups: list[_Group], engine: Engine, layout: _Layout) -> None:
        self.model = model
        self.groups = groups
        self.engine = engine
        self.layout = layout
        self.shards = layout.shards
        self.index = layout.index
        self.hybrid = layout.sharding == "hybrid"
        self.version = 0  # parameters published; gathers of this minibatch read them
        self.open = True  # minibatch `version` is running (not finished)
        self.pushed = False  # this rank pushed gradients in the running minibatch
        self.finished_by = ""  # what finished the last minibatch (for errors)
        self.cleared = False  # gradients cleared after a finish without a step hook (a skipped or hand-made step)
        self.clipped = -1  # last minibatch whose gradients were clipped
        self.hooks: list[Any] = []  # optimizer hook handles and zero_grad undos
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
        if self.open:
            return
        if self.cleared:
            self.advance()
            return
        raise ProtocolError(
            f"odc.fsdp: {what}, but minibatch {self.version}'s gradients are final already ({self.finished_by} "
            "finished it); read gradients only after the minibatch's last backward, step the optimizer before "
            "the next minibatch (to skip a step, call optimizer.zero_grad() instead), or, without an optimizer "
            "hook, enter odc.fsdp.minibatch"
        )

    def publish_all(self) -> None:
        for g in self.groups:
            inputs = _get_param_all_gather_inputs(g.pg.fsdp_params)
            flat = [t.reshape(-1) for ts in inputs for t in ts]
            shard = g.staging()
            torch.cat(flat, out=shard[: g.n])
            self.engine.publish(g.name, shard, self.version)

    def finish(self, reason: str, install: bool = True) -> None:
        """Ends the running minibatch: own gradient shards final, installed as ``.grad``."""
        if not self.open:
            return
        self.engine.finish_minibatch(self.version)
        self.open = False
        self.finished_by = reason
        if self.hybrid:
            # FSDP parked its reduce-scatter outputs (zeros) as HSDP partials
            # awaiting an all-reduce that never comes; they would stay
            # allocated, a gradient's worth per group.
            for g in self.groups:
                drop_partial_reduce(g.pg)
        if install:
            self.grads.install([self.engine.grad_shard(g.name) for g in self.groups])
        self.engine.zero_grad()
        self.pushed = False

    def advance(self) -> None:
        """Publishes the stepped parameters as the next version (after :meth:`finish`)."""
        if self.open:
            return
        self.version += 1
        self.publish_all()
        self.open = True
        self.cleared = False

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

    def after_step(self) -> None:
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


def _binding(model: Any) -> _Binding:
    b = getattr(model, "_odc_fsdp", None)
    if not isinstance(b, _Binding):
        raise ConfigError("odc.fsdp: this model is not enabled; call odc.fsdp.enable(model, optimizer) first")
    return b


