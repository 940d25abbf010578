"""The minibatch state machine of one enabled model (:class:`Minibatch`): its engine, its groups, and the
protocol's steps in the order a loop drives them.

``begin`` (every gather and push: the first one of a minibatch publishes this rank's parameters) →
``end`` (the engine's finish: this rank's gradient shards are final) → ``hold`` (the accumulators keep
their sums until the step or zero_grad clears them, which opens them for the next minibatch's pushes, or
the next minibatch continues them) → ``advance`` (the next minibatch). It knows nothing of
``.grad`` (the gradient contract, :mod:`._grads`, drives ``end`` and ``hold`` around its install), of the
optimizer hooks or of FSDP2's seams (:mod:`._binding`, :mod:`._seams`): those call into it, never the other
way round. It reads FSDP2 only through :mod:`._private`'s groups.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine import Engine
from ..errors import ConfigError, ProtocolError
from ._private import _Group, _Layout

_NORM_BUCKET = "odc-fsdp/grad-norm"
#: A rank that abandons a minibatch (an exception out of ``odc.fsdp.minibatch``, ``odc.fsdp.skip``, a loop that
#: left ``odc.fsdp.microbatches`` early) pushes ones into every element of this bucket before its finish; every
#: owner's accumulator then counts the ranks that abandoned it, so every rank learns it at its own finish.
_SKIP_BUCKET = "odc-fsdp/skip"


class Minibatch:
    """The protocol state of one enabled model (one engine, one bucket per group).

    The parameter contract: a minibatch's parameters are published by this
    rank's first operation in it (:meth:`begin`, or :meth:`end` on a rank
    that ran nothing), not by the step that made them, so whatever changed
    them in between (a state-dict load, a second optimizer, an in-place edit)
    is what every peer gathers. A change after that, within the minibatch, is
    refused at this rank's next gather (:meth:`check_unchanged`).
    """

    def __init__(self, model: Any, groups: list[_Group], engine: Engine, layout: _Layout) -> None:
        self.model = model
        self.groups = groups
        self.engine = engine
        self.layout = layout
        self.shards = layout.shards
        self.index = layout.index
        self.hybrid = layout.sharding == "hybrid"
        self.device = engine.device  # where the engine's tensors live (the parameters' device)
        self.version = 0  # the running (or last finished) minibatch; its gathers read this version
        self.open = True  # minibatch `version` is running (not finished)
        self.published = False  # this rank published minibatch `version`'s parameters (its first operation does)
        self.seen: list[list[tuple[Any, int]]] = []  # per group: (parameter, its version counter) when published
        self.pushed = False  # this rank pushed gradients in the running minibatch
        self.regathers = 0  # backward re-gathers under reshard_after_forward=int (hybrid-zero), for the tests
        self.finished_by = ""  # what finished the last minibatch (for errors)
        self.cleared = False  # gradients cleared after a finish without a step hook (a skipped or hand-made step)
        self.clipped = -1  # last minibatch whose gradients were clipped
        self.broken = ""  # why a minibatch was left without its finish (an exception it could not finish after)
        self.iterated: dict[int, int] = {}  # minibatch -> length of this rank's own list in odc.fsdp.microbatches
        # minibatch -> microbatches odc.fsdp.microbatches handed to the loop (or owes it: a rerun share) that the
        # loop has not finished (it did not ask for the next one); the finish counts them.
        self.owed: dict[int, int] = {}
        self.unfinished = 0  # what the finished minibatch's loop left so (it left the iteration early)
        # Why this rank abandons the running minibatch (every rank then skips it), and how many ranks
        # abandoned the last finished one (0: it was not skipped), as its finish counted them.
        self.abandoned = ""
        self.skipped = 0
        self.on_advance: Any = None  # called once the next minibatch started (elastic: admits restarted nodes)
        # A finish holds the sums in the accumulators instead of clearing them; the step or zero_grad clears
        # them, and a minibatch run onto the gradients the loop left as installed (no step, no zero_grad, no
        # change: a rerun) continues them (``may_continue`` says): under deterministic=True exactly.
        self.held = False
        self.continuing = False  # the running minibatch continues the last one's sums
        self.since = 0  # the first minibatch whose sums the running one continues (itself, unless continuing)
        self.may_continue: Any = None
        #: The parameters that trained at enable (ODC laid out gradients for them).
        self.trained = {id(fp) for g in groups for fp in g.pg.fsdp_params if fp.sharded_param.requires_grad}

    # -- the steps -----------------------------------------------------------
    def begin(self, what: str) -> None:
        """A gather, a push or a gradient read of the running minibatch.

        After a finished minibatch whose gradients were then cleared without
        an optimizer step hook (a skipped step, or a step the loop made by
        hand), starts the next minibatch: the current parameters are its
        version.
        """
        self.check_not_broken(what)
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

    def check_not_broken(self, what: str) -> None:
        """Refuses to go on after a minibatch an exception left unfinished (see :meth:`break_off`)."""
        if self.broken:
            raise ProtocolError(
                f"odc.fsdp: {what}, but {self.broken}; this rank's peers are still in that minibatch or past it, "
                "so the next one cannot start here. Let the error end the job (a restart resumes from the last "
                "checkpoint), or fix what raised it"
            )

    def break_off(self, why: str) -> None:
        """Marks the running minibatch as left by an exception it could not be finished after: every later
        operation is refused, naming it (the peers would otherwise pair this rank's next minibatch with it)."""
        self.broken = f"minibatch {self.version} was left by an exception and could not be finished ({why})"

    def publish_all(self, check: bool = True) -> None:
        """Publishes this rank's shards, as they are now, as minibatch ``version``'s parameters (``check``:
        refuse parameters frozen since ``enable`` first)."""
        if check:
            self.check_frozen()
        for g in self.groups:
            shard = g.staging()
            torch.cat(g.gather_inputs(), out=shard[: g.n])
            self.engine.publish(g.name, shard, self.version)
        self.seen = [[(fp.sharded_param, fp.sharded_param._version) for fp in g.pg.fsdp_params] for g in self.groups]
        self.published = True

    def check_frozen(self) -> None:
        """Refuses parameters frozen or unfrozen since ``enable`` (ODC lays out and installs gradients for
        the parameters that required one then)."""
        changed = [(fp._param_fqn or "<root>", fp.sharded_param.requires_grad)
                   for g in self.groups for fp in g.pg.fsdp_params
                   if fp.sharded_param.requires_grad != (id(fp) in self.trained)]
        if changed:
            what = ", ".join(f"{n} ({'unfrozen' if rg else 'frozen'})" for n, rg in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise ConfigError(
                f"odc.fsdp: {what}{more} changed requires_grad after odc.fsdp.enable, which laid out gradients "
                "for the parameters that required one then (a frozen one would still get a gradient, and weight "
                "decay would move it); change requires_grad between odc.fsdp.disable(model) and "
                "odc.fsdp.enable(model, optimizer), on every rank"
            )

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
            names = {id(q): n.replace("_fsdp_wrapped_module.", "") for n, q in self.model.named_parameters()}
            name = names.get(id(now), f"{g.name}'s parameter {g.pg.fsdp_params.index(fp)}")
            raise ProtocolError(
                f"odc.fsdp: parameter {name} changed in place during minibatch {self.version}, after this rank "
                "published it to its peers (at its first gather, push or gradient read of the minibatch): the "
                "peers would compute with the old values, this rank with the new ones. Change parameters only "
                "between minibatches (after optimizer.step() and before the next minibatch's first forward); "
                "to evaluate other weights (an EMA swap), swap them in, evaluate inside "
                "`with odc.fsdp.evaluation(model):` on every rank, and swap them back after it"
            )

    def iterating(self, own: int) -> None:
        """``odc.fsdp.microbatches`` hands out this rank's own list of ``own`` microbatches in this minibatch;
        :meth:`end` checks from the claim counts that every one of them was claimed (run here or stolen)."""
        self.iterated[self.version] = own

    def unclaimed(self) -> list[int]:
        """Claims what is left unclaimed of this rank's own list of the running minibatch (none, unless the loop
        left ``odc.fsdp.microbatches`` early, whatever became of the iterator): those ran nowhere, and once
        claimed here no thief runs one of them after the finish either."""
        own = self.iterated.pop(self.version, 0)
        left: list[int] = []
        if own:
            while (j := self.engine.claim_own(self.version, own)) is not None:
                left.append(j)
        return left

    def end(self, reason: str, check: bool = True) -> list[int]:
        """Ends the running minibatch in the engine: this rank's own gradient shards are final in its
        accumulators (the gradient contract reads them next, then :meth:`clear`). Returns the indices of this
        rank's own microbatches that ran nowhere (see :meth:`unclaimed`; :meth:`left_early` words the error).

        Where this rank abandons the minibatch (:attr:`abandoned`, or microbatches of its list or of its rerun
        share left unrun), it marks the skip bucket first, so that every rank skips the minibatch:
        :attr:`skipped` counts, after the finish, the ranks that abandoned it (``check=False``, a teardown or an
        evaluation block, marks nothing)."""
        left = self.unclaimed()
        self.unfinished = self.owed.pop(self.version, 0)
        if not self.published:  # a rank that ran nothing in this minibatch publishes for its peers here
            self.publish_all(check=check)  # disable (check=False) tears down whatever was frozen
        if check and (left or self.unfinished or self.abandoned):
            self.mark_skip()
        self.engine.finish_minibatch(self.version)
        self.open = False
        self.finished_by = reason
        self.abandoned = ""
        self.skipped = self.count_skips()
        if self.hybrid:
            # FSDP parked its reduce-scatter outputs (zeros) as HSDP partials
            # awaiting an all-reduce that never comes; they would stay
            # allocated, a gradient's worth per group.
            for g in self.groups:
                g.drop_parked()
        return left

    def mark_skip(self) -> None:
        """Pushes this rank's mark into every owner's skip accumulator (see :data:`_SKIP_BUCKET`)."""
        n = self.engine.bucket(_SKIP_BUCKET)["padded_len"]
        self.engine.scatter_accumulate(_SKIP_BUCKET, torch.ones(n, dtype=torch.float32, device=self.device))
        self.pushed = True

    def count_skips(self) -> int:
        """The ranks that abandoned the minibatch just finished, read from this rank's skip accumulator: the
        same count on every rank (every rank pushes to every owner; across nodes the cross-node sum adds
        them, over the member nodes)."""
        return round(float(self.engine.grad_shard(_SKIP_BUCKET)[0]))

    def left_early(self, left: list[int]) -> ProtocolError:
        """The error for a minibatch finished with ``left`` of this rank's own microbatches unrun (or microbatches
        handed to the loop, or owed to it by a rerun, that it did not finish)."""
        what = []
        if left:
            what.append(f"{len(left)} of this rank's own microbatches unclaimed (indices {left} of its list)")
        if self.unfinished:
            what.append(f"{self.unfinished} microbatch(es) handed to it (or owed to it by a rerun under "
                        "elastic='rerun') unfinished")
        return ProtocolError(
            f"odc.fsdp.microbatches: the loop left minibatch {self.version}'s iteration early (a break, an "
            f"exception, an iterator no longer iterated) with {' and '.join(what)}; they ran nowhere, so minibatch "
            f"{self.version} was skipped on every rank (no rank's gradients hold any of it, and no step trains on "
            "it). Iterate odc.fsdp.microbatches to the end on every rank (to skip a microbatch, continue inside "
            "the loop)"
        )

    def clear(self) -> None:
        """Zeroes the accumulators once their sums were read; the peers' pushes of the next minibatch, held
        in their landing slots until now, are added from here on."""
        self.engine.zero_grad()
        self.pushed = False
        self.held = False

    def hold(self) -> None:
        """After a finish: the accumulators keep the minibatch's sums (not zeroed yet; they open at the next
        minibatch's publish), so that a minibatch run onto its gradients adds into them (:meth:`advance`):
        under ``deterministic=True`` exactly, so the result is the bits of one minibatch of both; and a node
        dropped during that minibatch takes its microbatches of both out. The step or a zero_grad clears
        them first. Waits, as a clear would, until the other nodes read this rank's partial sums: the loop may
        end here (and the process exit) while a peer still reads them."""
        self.engine._wait_partials_read()
        self.pushed = False
        self.held = True

    def release_held(self) -> None:
        """The held sums are spent (a step used the gradients, or zero_grad dropped them): cleared."""
        if self.held:
            self.clear()

    def advance(self) -> None:
        """Starts the next minibatch (after :meth:`end`); its first operation publishes its parameters."""
        if self.open:
            return
        if self.held:
            # Held, with no step and no zero_grad since: continue the sums if the gradients are as installed
            # (else clear them: the next install adds onto the gradients as the loop left them).
            self.continuing = self.may_continue is not None and bool(self.may_continue())
            if not self.continuing:
                self.clear()
            self.held = False
        if not self.continuing:
            self.since = self.version + 1
        self.version += 1
        self.published = False
        self.open = True
        self.cleared = False
        if self.on_advance is not None:
            self.on_advance()

    def check_between(self, what: str) -> None:
        """Refuses ``what`` (an evaluation block) unless it comes between minibatches: nothing of the next one
        ran yet."""
        if not self.open and self.cleared:
            self.advance()
        if not self.open or self.published or self.pushed:
            raise ProtocolError(
                f"{what} entered during minibatch {self.version}"
                + (" after its gradients were finished and before the optimizer step" if not self.open
                   else ", after this rank's first forward or backward of it")
                + ": enter it between minibatches, after optimizer.step() (or after optimizer.zero_grad() where "
                "the step is skipped) and before the next minibatch's first forward, on every rank"
            )
