"""``odc.fsdp.clip_grad_norm_``: clipping by the global norm without a torch collective (the norm
words travel through a small ODC bucket).

What it must equal is ``torch.nn.utils.clip_grad_norm_`` over the whole
gradients in one process (checked against torch 2.11's and 2.15's
``torch/nn/utils/clip_grad.py``), non-finite entries included: a NaN
anywhere makes the norm NaN (every norm type: a max or a sum that met a
NaN is NaN), else an infinity makes it ``inf`` (a ``-inf`` entry too: the
norm reads ``|g|``); a norm that is not finite still scales the gradients
(by ``max_norm / (norm + 1e-6)``: 0 for ``inf``, NaN for NaN), or with
``error_if_nonfinite=True`` raises torch's ``RuntimeError`` before touching
them. Where torch's float32 sums overflow (a finite ``|g|`` of 1e30 under
``p = 2``) its norm is ``inf``, and so is this one. Each rank's part
crosses as the bits of a float64 (two float32 words, copied as integers),
so NaN, ``inf`` and every finite part arrive exactly as they left, and
every rank combines the same parts in rank order: the result, and so the
error, is the same on every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, ProtocolError
from ._binding import _Binding, _bound, _live, _solos, solo
from ._state import _NORM_BUCKET


def _binding_of(model_or_params: Any) -> tuple[_Binding | None, list[Any]]:
    """The binding the parameters belong to (None where their model was enabled on one rank), and them."""
    if isinstance(model_or_params, torch.nn.Module):
        if solo(model_or_params) is not None:
            return None, list(model_or_params.parameters())
        b = _bound(model_or_params)
        return b, [p for p in model_or_params.parameters() if id(p) in b.param_ids]
    params: list[Any] = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
    for b in list(_live):
        if params and all(id(p) in b.param_ids for p in params):
            return b, params
    for s in list(_solos):
        if params and all(id(p) in s.param_ids for p in params):
            return None, params
    raise ConfigError("odc.fsdp.clip_grad_norm_: these parameters do not belong to one odc.fsdp-enabled model")


def _norm_type(norm_type: Any) -> float:
    """``norm_type`` as a float; refused where the norm cannot be made of one number per rank."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ConfigError(f"odc.fsdp.clip_grad_norm_: norm_type={norm_type!r} is not a number; use 2.0, 1.0, "
                          "float('inf') or another p") from None
    if p == 0.0 or math.isnan(p):
        # torch's 0-"norm" counts the tensors with a nonzero entry: whether a parameter's gradient is zero is
        # known only from every rank's shard of it, which one number per rank cannot carry.
        raise ConfigError(f"odc.fsdp.clip_grad_norm_: norm_type={norm_type!r} is not supported (torch's "
                          "0-norm counts the parameters with a nonzero gradient, a per-parameter exchange); "
                          "use a p other than 0, or inf / -inf")
    return p


def _local_part(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the norm, a float64 scalar on ``device``: the max (``inf``) or min (``-inf``) of
    its shards' ``|g|``, else the sum of their ``|g|^p``. NaN propagates (torch's reductions keep it); shards
    without elements add nothing (``-inf``: they leave the min alone)."""
    nonempty = [g.detach() for g in grads if g.numel() > 0]
    if not nonempty:
        return torch.full((), math.inf if p == -math.inf else 0.0, dtype=torch.float64, device=device)
    # float64 inside the reduction: no float32 rounding, and |g|^p of a finite g stays finite.
    norms = torch.stack([torch.linalg.vector_norm(g, p, dtype=torch.float64) for g in nonempty])
    if p == math.inf:
        return norms.amax()
    if p == -math.inf:
        return norms.amin()
    return norms.pow(p).sum()


def _ranges(params: list[Any]) -> tuple[float, float]:
    """The largest sum of ``|g|^p`` and the largest norm torch's own arithmetic holds for these parameters'
    gradients (beyond them torch's norm is ``inf``): its norms of 16- and 32-bit floats accumulate in float32
    and come out in the gradients' dtype. The same on every rank (the parameters' dtypes, not the gradients')."""
    dtypes = [p.dtype for p in params if p.is_floating_point()]
    if not dtypes or torch.float64 in dtypes:
        return math.inf, math.inf
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return torch.finfo(torch.float32).max, torch.finfo(out).max


def _combine(parts: list[float], p: float, ranges: tuple[float, float]) -> float:
    """The norm from every rank's part, in rank order (the same float on every rank); ``ranges``: where
    torch's arithmetic overflows (:func:`_ranges`)."""
    if any(math.isnan(x) for x in parts):
        return math.nan  # Python's max/min would drop a NaN; torch's norm keeps it
    if p == math.inf:
        return max(parts)
    if p == -math.inf:
        return min(parts)
    total = 0.0
    for x in parts:  # rank order: the same float on every rank
        total += x
    if total > ranges[0]:
        total = math.inf  # where torch's float32 sum overflows (a finite |g| of 1e30 under p=2: inf)
    # torch.pow, not **: a 0 raised to 1/p < 0 is inf (torch's), where Python raises ZeroDivisionError.
    norm = float(torch.tensor(total, dtype=torch.float64).pow(1.0 / p))
    return math.inf if norm > ranges[1] else norm


def _nonfinite(p: float) -> RuntimeError:
    """torch's error for ``error_if_nonfinite=True`` (its words: loops match on them)."""
    return RuntimeError(
        f"The total norm of order {p} for gradients from "
        "`parameters` is non-finite, so it cannot be clipped. To disable "
        "this error and scale the gradients by the non-finite norm anyway, "
        "set `error_if_nonfinite=False`"
    )


def clip_grad_norm_(model_or_params: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clips gradients by their global norm, like ``torch.nn.utils.clip_grad_norm_``, without a collective.

    Finishes the running minibatch first (so call it where you would call
    torch's, before ``optimizer.step()``). Each rank reduces its own gradient
    shards to one number (sum of ``|g|^p``, or the max of ``|g|`` for
    ``inf``, the min for ``-inf``) and publishes its float64 bits as two
    float32 words in a small registered bucket; every rank gathers the D
    numbers (under hybrid sharding the G numbers of its node, whose shards
    make up the whole, identical on every node; under hybrid-zero the D
    pieces its node's shards hold) and combines them in rank order, so all
    ranks compute the identical norm. The bucket's version is the minibatch
    number + 1, so it may be called once per minibatch, on every rank.

    Non-finite gradients give torch's norm: NaN if any rank's shard holds a
    NaN, else ``inf`` if one holds an infinity (``-inf`` included), for
    every norm type, and ``inf`` where torch's float32 arithmetic overflows
    on finite gradients (the sum of ``|g|^p`` above float32's largest). The
    gradients are then scaled by ``min(max_norm / (norm + 1e-6), 1)`` as
    torch scales them: by 0 for an ``inf`` norm, by NaN for a NaN one.

    Args:
        model_or_params: the enabled model, or parameters of it (every rank
            passes the same set).
        max_norm: the largest norm the gradients keep.
        norm_type: p of the p-norm, ``float('inf')`` for the largest
            ``|g|``; 0 is refused (:class:`odc.ConfigError`).
        error_if_nonfinite: raise torch's ``RuntimeError`` (on every rank,
            the gradients untouched) where the norm is NaN or infinite.
        foreach: as torch's: the gradients are scaled with torch's
            ``_foreach_mul_`` unless it is ``False`` (the devices ODC runs
            on, CPU and CUDA, both have it).

    Returns:
        The total norm, as torch's returns it, here a float64 scalar tensor
        on the CPU (torch's is in the gradients' dtype).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite.
        odc.ProtocolError: called twice in one minibatch.
    """
    b, params = _binding_of(model_or_params)
    if b is None:  # one rank: torch's clip, nothing to exchange
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    order = _norm_type(norm_type)
    b.finish("odc.fsdp.clip_grad_norm_")
    if b.state.clipped == b.state.version:
        raise ProtocolError(f"odc.fsdp.clip_grad_norm_: already called in minibatch {b.state.version}")
    b.state.clipped = b.state.version
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    info = b.engine.bucket(_NORM_BUCKET)
    sl = info["piece_len"]
    # The part's bits as two words, moved as integers: no float copy can touch a NaN's bits.
    words = torch.zeros(sl, dtype=torch.int32, device=b.state.device)  # the engine's device (cuda-ipc: the GPU's)
    words[:2] = _local_part(grads, order, b.state.device).reshape(1).view(torch.int32)
    version = b.state.version + 1  # above every version the done words of minibatches <= k imply
    b.engine.publish(_NORM_BUCKET, words.view(torch.float32), version)
    everyone = torch.empty(info["padded_len"], dtype=torch.float32, device=b.state.device)
    b.engine.gather(_NORM_BUCKET, version, everyone)
    b.engine.release(_NORM_BUCKET, version)
    bits = everyone.view(torch.int32).view(b.state.shards, sl)[:, :2].contiguous()
    total = _combine(bits.view(torch.float64).view(-1).tolist(), order, _ranges(params))
    if error_if_nonfinite and not math.isfinite(total):
        raise _nonfinite(order)
    coef = float(max_norm) / (total + 1e-6)
    scale = 1.0 if coef >= 1.0 else coef  # torch's clamp(max=1): NaN stays NaN (it scales every gradient)
    if scale != 1.0 and grads:
        if foreach is False:
            for g in grads:
                g.mul_(scale)
        else:
            torch._foreach_mul_(grads, scale)
    return torch.tensor(total, dtype=torch.float64)
