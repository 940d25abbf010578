"""The gradient contract of ``odc.fsdp``: a sharded ``.grad`` holds what FSDP2 would hold whenever a loop reads it.

Under ODC a rank's gradient shards are final only once every rank has
finished the minibatch, and no rank knows when its own loop has run its last
microbatch: counts differ per rank, and the loop does not say. The first
read of a gradient's values tells it. While a minibatch runs, every sharded
parameter's ``.grad`` is a DTensor whose local tensor is a
:class:`PendingGrad`: it carries the gradient's shape, dtype, device and
placement, so metadata reads (``p.grad is None``, ``.shape``, grouping by
device and dtype) cost nothing, and the first operation that reads values
(torch's ``clip_grad_norm_`` / ``get_total_norm``, ``GradScaler.unscale_``,
a norm for the logs, an optimizer) finishes the minibatch: this rank waits
for its own shards only, the final gradients are installed as ordinary
DTensors, and every pending tensor of the minibatch resolves to them (an
in-place op through an old reference lands in the installed gradient). The
optimizer's step pre-hook finishes the minibatch too, so a loop that reads
nothing pays nothing.

A parameter's ``.grad`` through minibatch ``k``:

- from ``odc.fsdp.enable`` and from ``optimizer.zero_grad()`` /
  ``model.zero_grad()`` (which ``enable`` wraps): pending for ``k``, so a
  rank that runs no microbatch still reads final gradients (and makes the
  same norm all-reduce as its peers);
- in each reduce-scatter (full sharding) the pending gradient is taken out
  first (``.grad`` goes back to what it accumulates onto, usually None), so
  FSDP2 assigns or adds its reduce-scatter output as it always does; the
  parameter's post-accumulate-grad hook then makes ``.grad`` pending again.
  Under hybrid sharding FSDP2 parks its outputs and leaves ``.grad`` alone;
- a read, ``optimizer.step()``, ``odc.fsdp.finish`` or leaving
  ``odc.fsdp.minibatch``: final (:meth:`GradContract.finish`: the engine's
  finish, the install, then the accumulators cleared).

Gradients a loop did not clear before the minibatch are accumulated onto,
as FSDP2 does. ``zero_()`` on a pending gradient before this rank pushed
anything in the minibatch drops what it would accumulate onto, without
finishing anything; after a push, clearing a gradient is a
:class:`odc.ProtocolError` (ODC cannot take pushed gradients back).

It sits on the minibatch state machine (:mod:`._state`), which it drives
through a finish; the optimizer hooks and FSDP's seams sit on it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ConfigError, ProtocolError
from ._state import Minibatch

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)


class _Cell:
    """One parameter's gradient in one minibatch: what it accumulates onto, and its final value once known."""

    __slots__ = ("base", "grads", "real", "rec", "version")

    def __init__(self, grads: GradContract, rec: _Param, version: int, base: torch.Tensor | None) -> None:
        self.grads = grads
        self.rec = rec
        self.version = version
        self.base = base  # local tensor the minibatch's gradient is added onto (None: zeros)
        self.real: torch.Tensor | None = None  # the installed final local gradient

    def resolve(self, reason: str) -> torch.Tensor:
        if self.real is None:
            self.grads.finish_for(self, reason)
        if self.real is None:  # pragma: no cover - finish resolves every current cell
            raise ProtocolError(
                f"odc.fsdp: the pending gradient of {self.rec.fqn} (minibatch {self.version}) was not "
                "resolved by finishing its minibatch"
            )
        return self.real


class PendingGrad(torch.Tensor):
    """The local tensor of a sharded ``.grad`` whose minibatch has not finished.

    Any operation that reads its values finishes the minibatch first (see the
    module doc) and then runs on the final gradient. Views that keep the
    shape (``detach``, ``view_as``, ``to_local``) stay pending.
    """

    _cell: _Cell
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, cell: _Cell) -> PendingGrad:
        rec = cell.rec
        shape = tuple(rec.fp.sharded_size)
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=rec.dtype, device=rec.device, requires_grad=False
        )
        t._cell = cell
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        # No side effect here: a repr (a debugger, a log line) must not finish a minibatch.
        c = self._cell
        state = "final" if c.real is not None else "final once read"
        shape = tuple(self.shape)
        return f"PendingGrad({c.rec.fqn}, minibatch {c.version}, {state}, shape={shape}, dtype={self.dtype})"

    # Reads that torch does not route through __torch_dispatch__: the final gradient answers them.
    def _final(self, what: str) -> torch.Tensor:
        return self._cell.resolve(f"{what} on the gradient of {self._cell.rec.fqn}")

    def tolist(self) -> Any:
        return self._final("tolist()").tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self._final("numpy()").numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self._final("numpy conversion").numpy().__array__(dtype)

    def data_ptr(self) -> int:
        return self._final("data_ptr()").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._final("untyped_storage()").untyped_storage()

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch types it as an untyped classmethod
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASES or (func is aten.view.default and list(args[1]) == list(args[0].shape)):
            cell = args[0]._cell
            return PendingGrad(cell) if cell.real is None else func(cell.real, *args[1:], **kwargs)
        if func is aten.zero_.default and args[0]._cell.real is None:
            args[0]._cell.grads.drop_base(args[0]._cell)
            return args[0]
        if func is aten._foreach_zero_.default:
            rest = []
            for t in args[0]:
                if isinstance(t, PendingGrad) and t._cell.real is None:
                    t._cell.grads.drop_base(t._cell)
                else:
                    rest.append(t._cell.real if isinstance(t, PendingGrad) else t)
            if rest:
                func(rest)
            return None
        first = next(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, PendingGrad))
        reason = f"{func} on the gradient of {first._cell.rec.fqn}"

        def real(x: Any) -> Any:
            return x._cell.resolve(reason) if isinstance(x, PendingGrad) else x

        return func(*tree_map(real, args), **tree_map(real, kwargs))


def _pending_cell(g: Any) -> _Cell | None:
    """The cell of a pending ``.grad``: a DTensor around a PendingGrad (FSDP2), or a PendingGrad (FSDP1)."""
    if isinstance(g, PendingGrad):
        return g._cell
    if isinstance(g, DTensor) and isinstance(g._local_tensor, PendingGrad):
        return g._local_tensor._cell
    return None


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """``a`` is ``b`` or a view of all of it (FSDP1 accumulates onto ``.grad.data``: another object, the same
    memory)."""
    if a is None or b is None:
        return False
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)


def _local(g: Any) -> torch.Tensor | None:
    """The local tensor of a real (not pending) ``.grad``, or None."""
    if g is None:
        return None
    cell = _pending_cell(g)
    if cell is not None:
        return cell.real if cell.real is not None else cell.base
    return g._local_tensor if isinstance(g, DTensor) else g


@dataclass(eq=False)
class _Param:
    """A sharded parameter of one FSDP group, where its gradient sits in the group's accumulator."""

    fp: Any  # FSDPParam
    group: int  # index of its group (bucket)
    offset: int  # into the group's accumulator
    dtype: torch.dtype  # the gradient's dtype (FSDP's sharded grad dtype)
    device: torch.device
    fqn: str
    cell: _Cell | None = None  # this minibatch's cell, once one was made
    pending: DTensor | None = None  # the pending ``.grad`` of ``cell`` (made once per cell)
    restored: torch.Tensor | None = None  # what the reduce-scatter handed back to FSDP to add onto
    installed: torch.Tensor | None = None  # the local gradient the last finish installed
    installed_version: int = -1  # its version counter then (an in-place change since moves it)
    # What the first minibatch of the held sums added onto (a continuing minibatch installs that plus the sums):
    held_base: torch.Tensor | None = None  # a copy of it, where it held anything but zeros
    held_zeros: bool = False  # zeros (``zero_grad(set_to_none=False)``); neither: None
    hooked: Any = None  # the parameter object our post-accumulate-grad hook is on
    hook: Any = None  # its handle

    @property
    def param(self) -> Any:
        return self.fp.sharded_param

    @property
    def numel(self) -> int:
        return math.prod(self.fp.sharded_size)


class GradContract:
    """Keeps every sharded ``.grad`` of an enabled model final-on-read (see the module doc)."""

    def __init__(self, state: Minibatch, groups: list[Any]) -> None:
        self.state = state
        self.params: list[_Param] = []
        self.by_group: list[list[_Param]] = []
        for gi, g in enumerate(groups):
            recs = []
            for fp, off in zip(g.pg.fsdp_params, g.offsets, strict=True):
                p = fp.sharded_param
                if not p.requires_grad:
                    continue
                dtype = getattr(fp, "sharded_grad_dtype", None) or p.dtype
                recs.append(_Param(fp, gi, off, dtype, p.device, fp._param_fqn or "<root>"))
            self.by_group.append(recs)
            self.params.extend(recs)
        self.by_id: dict[int, _Param] = {}
        #: A skipped minibatch leaves zeros where ``.grad`` held nothing (optimizers hooked), not None.
        self.zeros_for_none = False

    # -- hooks -------------------------------------------------------------------
    def refuse_foreign_hooks(self) -> None:
        """Optimizer-in-backward hooks would read gradients before they are final: refused."""
        for rec in self.params:
            if getattr(rec.param, "_post_accumulate_grad_hooks", None):
                raise ConfigError(
                    f"odc.fsdp.enable: {rec.fqn} has a post-accumulate-grad hook (an optimizer in backward?); "
                    "FSDP2 runs it after every microbatch's reduce-scatter, but under ODC a gradient is final "
                    "only when the minibatch ends; step the optimizer after the last microbatch instead"
                )

    def ensure_hooked(self, recs: list[_Param]) -> None:
        """Our post-accumulate-grad hook is on each parameter object FSDP holds now."""
        for rec in recs:
            p = rec.param
            if rec.hooked is p:
                continue
            if rec.hook is not None:
                rec.hook.remove()
            self.by_id.pop(id(rec.hooked), None)
            rec.hook = p.register_post_accumulate_grad_hook(self._after_fsdp)
            rec.hooked = p
            self.by_id[id(p)] = rec

    def remove_hooks(self) -> None:
        for rec in self.params:
            if rec.hook is not None:
                rec.hook.remove()
            rec.hook = rec.hooked = None
        self.by_id.clear()

    def _after_fsdp(self, p: Any) -> None:
        """FSDP2 assigned (or added) its reduce-scatter output: ``.grad`` becomes pending again."""
        rec = self.by_id.get(id(p))
        if rec is None:
            return
        base = rec.restored if rec.restored is not None and _local(p.grad) is rec.restored else None
        rec.restored = None
        self._pend(rec, self.state.version, base)

    # -- states ------------------------------------------------------------------
    def _pend(self, rec: _Param, version: int, base: torch.Tensor | None) -> None:
        cell = rec.cell
        if cell is None or cell.version != version or cell.real is not None:
            cell = rec.cell = _Cell(self, rec, version, base)
            rec.pending = None
        cell.base = base
        if rec.pending is None:
            rec.pending = rec.fp.to_sharded_dtensor(PendingGrad(cell))
        rec.param.grad = rec.pending

    def pend(self, version: int, recs: list[_Param] | None = None) -> None:
        """Makes each ``.grad`` pending for ``version``, accumulating onto what it holds."""
        for rec in self.params if recs is None else recs:
            g = rec.param.grad
            cell = _pending_cell(g)
            if cell is not None and cell.version == version and cell.real is None:
                continue
            self._pend(rec, version, _local(g))

    def hand_to_fsdp(self, group: int, pushed_before: bool, what: str) -> None:
        """Before FSDP2 assigns or adds a reduce-scatter output: ``.grad`` back to what it adds onto."""
        recs = self.by_group[group]
        self.ensure_hooked(recs)
        for rec in recs:
            g = rec.param.grad
            self._check_not_cleared(rec, g, pushed_before, what)
            base = _local(g)
            if _pending_cell(g) is not None:
                rec.param.grad = None if base is None else rec.fp.to_sharded_dtensor(base)
            rec.restored = base

    def pend_group(self, group: int, pushed_before: bool, what: str) -> None:
        """Hybrid sharding: FSDP2 leaves ``.grad`` alone, so it is made pending here."""
        recs = self.by_group[group]
        for rec in recs:
            self._check_not_cleared(rec, rec.param.grad, pushed_before, what)
        self.pend(self.state.version, recs)

    def _check_not_cleared(self, rec: _Param, g: Any, pushed_before: bool, what: str) -> None:
        if g is None and pushed_before:
            raise ProtocolError(
                f"odc.fsdp: {what}: the gradient of {rec.fqn} was set to None in the middle of minibatch "
                f"{self.state.version}, after this rank had pushed earlier microbatches' gradients of "
                f"{self.state.groups[rec.group].name} to their owners, which ODC cannot take back; clear gradients "
                "only between minibatches (optimizer.zero_grad() after optimizer.step())"
            )

    def drop_base(self, cell: _Cell) -> None:
        """``zero_()`` on a pending gradient: forget what it accumulates onto (before any push)."""
        s = self.state
        if s.continuing:
            raise ProtocolError(
                f"odc.fsdp: the gradient of {cell.rec.fqn} was zeroed in minibatch {cell.version}, which continues "
                f"the sums of minibatch {cell.version - 1} (a minibatch run onto the gradients a finish installed, "
                "with no step and no zero_grad between, continues them); to start from zero, call "
                "optimizer.zero_grad() between the minibatches"
            )
        if cell.version == s.version and s.open and s.pushed:
            raise ProtocolError(
                f"odc.fsdp: the gradient of {cell.rec.fqn} was zeroed in the middle of minibatch {cell.version}, "
                "after this rank had pushed gradients to their owners, which ODC cannot take back; zero "
                "gradients only between minibatches (optimizer.zero_grad() after optimizer.step())"
            )
        cell.base = None

    def finish_for(self, cell: _Cell, reason: str) -> None:
        """A read of a pending gradient: finishes its minibatch if it is the running one (or the next one,
        once the previous minibatch's gradients were cleared without a step hook)."""
        s = self.state
        if cell.version == s.version + 1 and not s.open and s.cleared:
            s.begin(reason)
        if cell.version == s.version and s.open:
            self.finish(reason)
            return
        raise ProtocolError(
            f"odc.fsdp: {reason} read a gradient of minibatch {cell.version}, which is not the running one (this "
            f"rank's minibatch {s.version} {'runs' if s.open else 'finished'}); read gradients after the "
            "minibatch's last backward"
        )

    def finish(self, reason: str, install: bool = True) -> None:
        """Ends the running minibatch: the engine's finish (this rank's gradient shards final), the shards
        installed as ``.grad`` (``install``; not when :func:`odc.fsdp.disable` tears down or an evaluation
        block ends), then the accumulators held (:meth:`Minibatch.hold`: the step or ``zero_grad`` clears
        them, which opens them for the next minibatch's pushes, or the next minibatch continues their sums).

        A minibatch some rank abandoned (:attr:`Minibatch.skipped`) is skipped here, on every rank alike: its
        sums are cleared and each ``.grad`` goes back to what it held before the minibatch (:meth:`drop`).

        Raises:
            ProtocolError: the loop left ``odc.fsdp.microbatches`` with microbatches of this rank's own list
                unclaimed (the minibatch was skipped on every rank).
        """
        s = self.state
        if not s.open:
            return
        abandoning = bool(s.abandoned)  # this rank's own skip (it says so itself)
        left = s.end(reason, check=install)
        skipped = install and s.skipped > 0
        try:
            if skipped:
                self.drop()
            elif install:
                self.install([s.engine.grad_shard(g.name) for g in s.groups])
        finally:
            if install and not skipped:
                s.hold()  # the next minibatch may continue the sums (a rerun); a step or zero_grad clears them
            else:
                s.clear()
            if skipped:
                s.cleared = True  # the next minibatch starts on the unchanged parameters, with or without a step
            s.continuing = False
        if left or s.unfinished:
            raise s.left_early(left)
        if skipped and not abandoning:
            warnings.warn(
                f"odc.fsdp: minibatch {s.version} was skipped on every rank: {s.skipped} rank(s) abandoned it (an "
                "exception out of odc.fsdp.minibatch, odc.fsdp.skip, or odc.fsdp.microbatches left early; their "
                "own warnings and errors say why). No rank's gradients hold any of it: .grad is as before the "
                "minibatch" + ("; the next optimizer.step() trains on nothing" if self.zeros_for_none else ""),
                RuntimeWarning, stacklevel=2,
            )

    def drop(self) -> None:
        """The minibatch was skipped (some rank abandoned it): each ``.grad`` goes back to what it held before
        the minibatch (before the first minibatch of the held sums, where it continued them). Where that was
        nothing, ``.grad`` is zeros when optimizers are hooked (:attr:`zeros_for_none`: their step is then
        made a no-op, and a ``GradScaler`` still finds gradients to check), else ``None`` (the loop steps by
        hand, and torch's optimizers skip a parameter without a gradient)."""
        s = self.state
        for rec in self.params:
            cell = _pending_cell(rec.param.grad)
            base = cell.base if cell is not None and cell.real is None else _local(rec.param.grad)
            if s.continuing and base is not None:
                if rec.held_base is not None:
                    base = base.copy_(rec.held_base)
                elif rec.held_zeros:
                    base = base.zero_()
                else:
                    base = None
            final = base
            if final is None and self.zeros_for_none:
                final = torch.zeros(rec.fp.sharded_size, dtype=rec.dtype, device=rec.device)
            rec.param.grad = None if final is None else rec.fp.to_sharded_dtensor(final)
            rec.installed = final
            rec.installed_version = -1 if final is None else final._version
            rec.held_base, rec.held_zeros = None, False
            real = final if final is not None else torch.zeros(rec.fp.sharded_size, dtype=rec.dtype,
                                                               device=rec.device)
            for c in (cell, rec.cell):
                if c is not None and c.real is None and c.version == s.version:
                    c.real = real
            rec.pending = None

    def install(self, accums: list[torch.Tensor]) -> None:
        """The minibatch finished: each ``.grad`` becomes the final gradient (accumulator slice + base).

        A minibatch that continues the held sums of the last one (:meth:`unchanged_since_install`) has the
        sum of both in its accumulators: ``.grad`` becomes what the first one added onto plus that sum (in
        place, by the same operations), not the first one's gradient plus it again.
        """
        s = self.state
        version = s.version
        bases = []
        for rec in self.params:
            cell = _pending_cell(rec.param.grad)
            base = cell.base if cell is not None and cell.real is None else _local(rec.param.grad)
            if s.continuing and not _same_tensor(base, rec.installed):
                raise ProtocolError(
                    f"odc.fsdp: the gradient of {rec.fqn} was replaced or cleared during minibatch {version}, which "
                    f"continues the sums of minibatch {version - 1}: its gradient cannot be taken out of them. Clear "
                    "gradients with optimizer.zero_grad() between minibatches"
                )
            bases.append((rec, cell, base))
        # Which bases hold only zeros (zero_grad(set_to_none=False)): those need no copy to be added onto
        # again. One reduction over all of them and one host read, not a host sync per parameter.
        given = [base for _, _, base in bases if base is not None and not s.continuing]
        zeros = iter(_all_zero(given))
        for rec, cell, base in bases:
            shape = rec.fp.sharded_size
            src = accums[rec.group][rec.offset : rec.offset + rec.numel].view(shape)
            if s.continuing:
                # What the first of the continued minibatches would have installed, had it run them all.
                assert base is not None
                if rec.held_base is not None:
                    final = base.copy_(rec.held_base.clone().add_(src))
                elif rec.held_zeros:
                    final = base.zero_().add_(src)
                else:
                    final = base.copy_(src)
            elif base is not None:
                # Zeros (zero_grad(set_to_none=False)) need no copy to be added onto again.
                rec.held_zeros = next(zeros)
                rec.held_base = None if rec.held_zeros else base.clone()
                final = base.add_(src)
            else:
                rec.held_base, rec.held_zeros = None, False
                # A copy: the accumulator is zeroed next and refilled by the next minibatch.
                final = src.to(device=rec.device, dtype=rec.dtype, copy=True)
            rec.param.grad = rec.fp.to_sharded_dtensor(final)
            rec.installed = final
            rec.installed_version = final._version
            for c in (cell, rec.cell):
                if c is not None and c.real is None and c.version == version:
                    c.real = final
            rec.pending = None

    def unchanged_since_install(self) -> bool:
        """Every ``.grad`` is still what the last finish installed, unchanged in place (no clip, no unscale,
        not replaced): a minibatch run onto them continues the held sums."""
        return bool(self.params) and all(
            rec.installed is not None
            and _pending_cell(rec.param.grad) is None
            and _local(rec.param.grad) is rec.installed
            and rec.installed._version == rec.installed_version
            for rec in self.params
        )

    def stepped_twice(self) -> bool:
        """Every ``.grad`` is still what the last finish installed (no backward, no zero_grad since)."""
        return bool(self.params) and all(
            rec.installed is not None
            and _pending_cell(rec.param.grad) is None
            and _local(rec.param.grad) is rec.installed
            for rec in self.params
        )

    def release(self) -> None:
        """``odc.fsdp.disable``: pending gradients go back to what they held; the hooks are removed."""
        for rec in self.params:
            g = rec.param.grad
            cell = _pending_cell(g)
            if cell is not None:
                real = _local(g)
                rec.param.grad = None if real is None else rec.fp.to_sharded_dtensor(real)
        self.remove_hooks()


def _all_zero(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only zeros (NaN is not zero), with one host read for all of them: one
    ``_foreach_norm`` per device and dtype (as torch's clip groups them)."""
    if not tensors:
        return []
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    peaks: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for idx in groups.values():
        for i, p in zip(idx, torch._foreach_norm([tensors[i] for i in idx], float("inf")), strict=True):
            peaks[i] = p.float()
    nonzero = torch.stack([p.to(peaks[0].device) for p in peaks]).ne(0).tolist()
    return [not v for v in nonzero]


def wrap_zero_grad(owner: Any, on_zero_grad: Callable[[], None], check: Callable[[], None]) -> Callable[[], None]:
    """Wraps ``owner.zero_grad`` (an optimizer or the root module) on the instance; returns the undo."""
    orig = owner.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        check()
        out = orig(*args, **kwargs)
        on_zero_grad()
        return out

    zero_grad.__wrapped__ = orig  # type: ignore[attr-defined]
    zero_grad.__doc__ = orig.__doc__
    owner.__dict__["zero_grad"] = zero_grad

    def undo() -> None:
        if owner.__dict__.get("zero_grad") is zero_grad:
            del owner.__dict__["zero_grad"]

    return undo
