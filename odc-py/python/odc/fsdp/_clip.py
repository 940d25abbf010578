"""``odc.fsdp.clip_grad_norm_``: clipping by the global norm without a torch collective (the norm
words travel through a small ODC bucket)."""

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


def clip_grad_norm_(model_or_params: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clips gradients by their global norm, like ``torch.nn.utils.clip_grad_norm_``, without a collective.

    Finishes the running minibatch first (so call it where you would call
    torch's, before ``optimizer.step()``). Each rank reduces its own gradient
    shards to one number (sum of ``|g|^p``, or the max for ``inf``) and
    publishes it, split into two float32 words for double precision, in a
    small registered bucket; every rank gathers the D numbers (under hybrid
    sharding the G numbers of its node, whose shards make up the whole,
    identical on every node; under hybrid-zero the D pieces its node's
    shards hold) and combines them in rank order, so all ranks
    compute the identical norm. The bucket's
    version is the minibatch number + 1, so it may be called once per
    minibatch, on every rank.

    Returns:
        The total norm (a float64 scalar tensor), as torch's does.
    """
    b, params = _binding_of(model_or_params)
    if b is None:  # one rank: torch's clip, nothing to exchange
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    b.finish("odc.fsdp.clip_grad_norm_")
    if b.state.clipped == b.state.version:
        raise ProtocolError(f"odc.fsdp.clip_grad_norm_: already called in minibatch {b.state.version}")
    b.state.clipped = b.state.version
    norm_type = float(norm_type)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    local = 0.0
    for grad in grads:
        g = grad.detach().double()
        if g.numel() == 0:
            continue
        if math.isinf(norm_type):
            local = max(local, g.abs().max().item())
        else:
            local += g.abs().pow(norm_type).sum().item()
    info = b.engine.bucket(_NORM_BUCKET)
    sl = info["piece_len"]
    hi = torch.tensor(local, dtype=torch.float32)
    words = torch.zeros(sl, dtype=torch.float32)
    words[0], words[1] = hi, torch.tensor(local - hi.double().item(), dtype=torch.float32)
    shard = words.to(b.state.device)  # the engine's device (cuda-ipc: the parameters' GPU)
    version = b.state.version + 1  # above every version the done words of minibatches <= k imply
    b.engine.publish(_NORM_BUCKET, shard, version)
    everyone = torch.empty(info["padded_len"], dtype=torch.float32, device=b.state.device)
    b.engine.gather(_NORM_BUCKET, version, everyone)
    b.engine.release(_NORM_BUCKET, version)
    parts = everyone.view(b.state.shards, sl)[:, :2].double().sum(dim=1).tolist()
    total = max(parts) if math.isinf(norm_type) else sum(parts) ** (1.0 / norm_type)
    coef = float(max_norm) / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return torch.tensor(total, dtype=torch.float64)

