"""FSDP2's comm seams as ODC operations: the all-gather reads the other owners' published shards,
the reduce-scatter pushes each owner's rows and does not wait. Installed with FSDP2's public
``set_custom_all_gather`` / ``set_custom_reduce_scatter``; both call into the binding only.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .._c10d import premul_factor
from ..errors import ConfigError, LayoutError
from ._binding import _Binding
from ._private import AllGather, ReduceScatter, _get_gradient_divide_factors, _Group, unused_params_advice


def gather_rows(b: _Binding, g: _Group, own: torch.Tensor) -> torch.Tensor:
    """Every owner's shard of ``g``, row r owner r's (``(ws, n)``, a view of an ODC-aligned buffer: ODC aligns
    shards to 64 bytes, FSDP packs them densely); ``own`` is this rank's."""
    tmp = torch.empty(b.state.shards, g.shard_len, dtype=g.dtype, device=own.device)
    tmp[b.state.index, : g.n].copy_(own)
    b.engine.gather(g.name, b.state.version, tmp.view(-1), skip_own=True)
    return tmp[:, : g.n]


def push_rows(b: _Binding, g: _Group, grads: torch.Tensor, scale: float) -> None:
    """Pushes ``grads`` (``ws · n``, owner-major as FSDP packs it) to the owners, each row into an ODC-aligned
    row of ``shard_len``; marks the group and the binding as pushed in the running minibatch."""
    ws, n, sl = b.state.shards, g.n, g.shard_len
    if sl == n:
        b.engine.scatter_accumulate(g.name, grads.contiguous(), scale=scale)
    else:
        tmp = torch.zeros(ws, sl, dtype=grads.dtype, device=grads.device)
        tmp[:, :n].copy_(grads.view(ws, n))
        b.engine.scatter_accumulate(g.name, tmp.view(-1), scale=scale)
    g.pushed_in = b.state.version
    b.state.pushed = True


class _OdcAllGather(AllGather):
    """FSDP2 all-gather seam: reads the other owners' published shards."""

    def __init__(self, binding: _Binding, group: _Group) -> None:
        self._b = binding
        self._g = group

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> None:
        b, g = self._b, self._g
        b.state.begin(f"all-gather of {g.name}")
        b.state.check_unchanged(g)
        if b.state.hybrid:
            # Re-asserted before every backward: set_requires_gradient_sync(True)
            # turns HSDP's all-reduce back on.
            g.pg.all_reduce_grads = False
        ws, n, sl = b.state.shards, g.n, g.shard_len
        if output_tensor.numel() != ws * n or output_tensor.dtype != g.dtype:
            raise LayoutError(
                f"odc.fsdp: all-gather of {g.name} got {output_tensor.numel()} {output_tensor.dtype} elements; "
                f"registered {ws}·{n} {g.dtype} (did the parameters change after odc.fsdp.enable?)"
            )
        post = g.pg.post_forward_mesh_info
        if post is not None and post is not g.pg.mesh_info and g.pg.is_sharded_post_forward:
            self._regather(output_tensor, input_tensor, post.shard_mesh_size)
            return
        if sl == n:
            b.engine.gather(g.name, b.state.version, output_tensor, skip_own=True)
        else:
            output_tensor.view(ws, n).copy_(self._gather_rows(input_tensor))
        return

    def _gather_rows(self, own: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._b, self._g, own)

    def _regather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, k: int) -> None:
        """The backward's re-gather under ``reshard_after_forward=k`` (sharding="hybrid-zero" only).

        FSDP2 kept, after the forward, 1/k of each parameter's gathered rows (groups of k consecutive
        ranks) and re-gathers over that group with its own layout: row j of the output holds chunk j of
        every parameter in turn, chunk j being the shards of owners j·D/k … (j+1)·D/k − 1. The values are
        the minibatch's published parameters, which hybrid-zero's gather reads within the node: the same
        gather as the forward's, then the parameters' columns regrouped into those rows.
        """
        b, g = self._b, self._g
        ws, n = b.state.shards, g.n
        if input_tensor.numel() * k != ws * n:
            raise LayoutError(
                f"odc.fsdp: the backward re-gather of {g.name} (reshard_after_forward={k}) got an input of "
                f"{input_tensor.numel()} elements, not {ws}·{n}/{k}"
            )
        rows = self._gather_rows(g.staging()[:n])  # this rank's shard as published (check_unchanged held)
        ends = [*g.offsets[1:], n]
        columns = [rows[:, start:end].reshape(k, -1) for start, end in zip(g.offsets, ends, strict=True)]
        torch.cat(columns, dim=1, out=output_tensor.view(k, -1))
        b.state.regathers += 1


class _OdcReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter seam: pushes the rows to their owners, does not wait."""

    def __init__(self, binding: _Binding, group: _Group) -> None:
        self._b = binding
        self._g = group

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def _scale(self, op: Any, dtype: torch.dtype) -> float:
        # The pushes are summed over every rank (every node too, under hybrid
        # sharding), so a scale divides by FSDP's whole data-parallel size.
        pg = self._g.pg
        factor = premul_factor(op)
        if factor is not None:  # PREMUL_SUM(1 / gradient_divide_factor)
            return float(factor)
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            # AVG: no divide factor (mean over all D ranks; under HSDP FSDP
            # averages over the shard group, then over the replicas), or one
            # equal to the shard group's size.
            f = pg.gradient_divide_factor
            return 1.0 / (f if f is not None else self._b.state.layout.world)
        if kind == dist.ReduceOp.SUM:
            # FSDP divides the *output* after a SUM (forced sum, or fp16 with a
            # pre-divide already applied to the input); our output is zeros, so
            # the post-divide moves into the push.
            replicas = pg._all_reduce_process_group if self._b.state.hybrid else None
            _, post, _, _ = _get_gradient_divide_factors(
                cast(Any, pg.mesh_info).shard_process_group, replicas, dtype, pg.device.type,
                pg.gradient_divide_factor, pg.force_sum_reduction_for_comms,
            )
            return 1.0 / post if post else 1.0
        raise ConfigError(f"odc.fsdp: reduce-scatter op {op} is not supported (AVG, SUM, PREMUL_SUM are)")

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any = None,
        op: Any = None,
        async_op: bool = False,
    ) -> None:
        b, g = self._b, self._g
        b.state.begin(f"reduce-scatter of {g.name}")
        if b.state.hybrid and g.pg.all_reduce_grads:
            # FSDP's replicate all-reduce follows this call, with this flag
            # already read: it would pair up with peers' minibatch ends.
            raise ConfigError(
                f"odc.fsdp: FSDP's HSDP all-reduce was turned back on for {g.name} after its forward "
                "(set_requires_all_reduce(True) or set_requires_gradient_sync(True)); under sharding='hybrid' "
                "ODC reduces across nodes once per minibatch and keeps it off: make those calls before "
                "the forward, or after odc.fsdp.disable"
            )
        ws, n = b.state.shards, g.n
        if input_tensor.numel() != ws * n:
            frozen = [fp._param_fqn or "<root>" for fp in g.pg.fsdp_params if not fp.sharded_param.requires_grad]
            advice = (
                f"{', '.join(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen while other parameters of "
                "the group train: ODC lays out a group's gradients whole, so freeze whole fully_shard units "
                "(every parameter of the group) or none"
                if frozen else unused_params_advice()
            )
            raise LayoutError(
                f"odc.fsdp: reduce-scatter input of {g.name} holds {input_tensor.numel()} elements, not "
                f"{ws}·{n}: a parameter got no gradient and FSDP dropped it; {advice}"
            )
        scale = self._scale(op, input_tensor.dtype)
        # .grad back to what FSDP adds onto (full sharding; it then calls our post-accumulate-grad
        # hook), or pending now (hybrid: FSDP parks its output and leaves .grad alone).
        pushed_before = g.pushed_in == b.state.version
        if b.state.hybrid:
            b.grads.pend_group(g.index, pushed_before, f"reduce-scatter of {g.name}")
        else:
            b.grads.hand_to_fsdp(g.index, pushed_before, f"reduce-scatter of {g.name}")
        push_rows(b, g, input_tensor, scale)
        output_tensor.zero_()
        return


def _install_comms(groups: list[_Group], comms: list[tuple[AllGather, ReduceScatter]]) -> None:
    """Installs each group's all-gather and reduce-scatter through FSDP2's public seams.

    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` set one comm on
    every group of the module they are called on; :func:`_describe` made sure
    each module owns exactly one group, so each group gets its own objects.
    """
    for g, (all_gather, reduce_scatter) in zip(groups, comms, strict=True):
        g.module.set_custom_all_gather(all_gather)
        g.module.set_custom_reduce_scatter(reduce_scatter)


def install(b: _Binding, groups: list[_Group]) -> None:
    """The pipeline's last step for an FSDP2 model: every group's all-gather and reduce-scatter become ODC's."""
    _install_comms(groups, [(_OdcAllGather(b, g), _OdcReduceScatter(b, g)) for g in groups])


def reshard(model: Any) -> None:
    """Reshards every FSDP2 module of ``model`` (public ``FSDPModule.reshard``): its next forward gathers."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
