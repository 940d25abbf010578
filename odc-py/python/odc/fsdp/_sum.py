"""``odc.fsdp.global_sum``: a few numbers summed over every rank a minibatch's gradients count (a token count
for the loss's normaliser), riding that minibatch's own gradient sum in a small ODC bucket.

Every rank writes its numbers into a block of its own in every owner's shard of :data:`_SUM_BUCKET`, so each
accumulator slot receives one rank's word and sums nothing: the words arrive exactly. The minibatch's finish
adds them across nodes with the gradients (under elastic hybrid sharding over the nodes the minibatch's round
counts: a node dropped in it is out of both, a node that rejoined is in both), and every rank then adds up the
same words itself, correctly rounded (``math.fsum``), so every rank reads the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError, ProtocolError
from ._binding import _bound, solo

_SUM_BUCKET = "odc-fsdp/sum"
#: Numbers one call sums at most.
SUM_VALUES = 7
#: float32 words per rank in every owner's shard: each number's high and low words, the call count, one spare
#: (16 words: 64 bytes, the engine's alignment, whatever the world size).
_SUM_BLOCK = 16
_CALLS = 2 * SUM_VALUES
_F32_MAX = float(torch.finfo(torch.float32).max)


def sum_bucket_numel(shards: int, world: int) -> int:
    """Elements of the sum bucket: every owner's shard (or hybrid-zero piece) holds a block for every rank."""
    return shards * world * _SUM_BLOCK


def _values(values: Any) -> torch.Tensor:
    try:
        # Python numbers as float64 (torch would make a list of floats float32); a tensor as it is, then float64.
        v = (values.detach() if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=torch.float64))
        v = v.to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"odc.fsdp.global_sum: values must be numbers or a tensor of them ({e})") from None
    if v.dim() > 1 or v.numel() > SUM_VALUES:
        raise ConfigError(f"odc.fsdp.global_sum: values of shape {tuple(v.shape)}; pass a number or a 1-D tensor "
                          f"of at most {SUM_VALUES} numbers")
    big = v[torch.isfinite(v) & (v.abs() > _F32_MAX)]
    if big.numel():
        raise ConfigError(f"odc.fsdp.global_sum: {big[0].item()!r} is beyond float32's range, which its words "
                          "carry")
    return v


def global_sum(model: Any, values: Any) -> torch.Tensor:
    """The sum of ``values`` over every rank whose gradients the running minibatch's sum counts; finishes the
    minibatch.

    Call it on every rank once per minibatch, after the minibatch's last
    backward and before anything reads the gradients (it finishes the
    minibatch itself, as a gradient read does): the sum rides the
    minibatch's own gradient sum, so it counts exactly the ranks whose
    microbatches the gradients hold. Under ``elastic=True`` a node dropped in
    this minibatch is out of both, and a node that rejoined is in both (a
    torch process group, which cannot grow, leaves it out). The loss's
    normaliser is then the tokens that trained::

        for mb in my_microbatches:
            (loss_sum(model, mb) * world).backward()         # FSDP averages over the world's ranks
        tokens = odc.fsdp.global_sum(model, my_tokens)     # finishes the minibatch
        for p in model.parameters():
            p.grad.div_(tokens)
        optimizer.step(); optimizer.zero_grad()

    Each rank's numbers arrive exactly (float64 as two float32 words: about
    48 bits, integers up to ``2**48`` exactly) and every rank adds the same words,
    correctly rounded, so every rank returns the same bits. A minibatch that
    continues the last one's sums (a rerun) continues this sum too: it is
    then the total since the step. A minibatch skipped on every rank
    (:func:`odc.fsdp.skipped`) drops this sum with its gradients: zeros.
    Under ``deterministic=True`` each number must be below ``2**39`` in magnitude.

    Args:
        model: the enabled model.
        values: this rank's numbers: a number, a list of them or a 1-D tensor, at most 7 (Python numbers
            are read as float64; a tensor keeps its dtype's precision).

    Returns:
        A float64 tensor shaped as ``values``: their sum over the ranks.

    Raises:
        ConfigError: more than 7 numbers, or one beyond float32's range.
        ProtocolError: the minibatch has finished already (a gradient read, a clip, a second call), or a
            rank whose gradients the sum counts did not call it as often as the others since the step.
    """
    v = _values(values)
    if solo(model) is not None:
        return v.clone()
    b = _bound(model)
    s = b.state
    s.check_not_broken("odc.fsdp.global_sum")
    if not s.open and not s.cleared:
        raise ProtocolError(
            f"odc.fsdp.global_sum: minibatch {s.version} has finished already ({s.finished_by}); call it once "
            "per minibatch on every rank, after its last backward and before anything reads the gradients (a "
            "clip, a GradScaler's unscale_, the step): it finishes the minibatch itself"
        )
    s.begin("odc.fsdp.global_sum")  # the minibatch's first operation where this rank ran nothing: its publish
    flat = v.reshape(-1)
    hi = flat.to(torch.float32)
    lo = torch.where(torch.isfinite(hi), flat - hi.double(), torch.zeros_like(flat)).to(torch.float32)
    block = torch.zeros(_SUM_BLOCK, dtype=torch.float32)
    block[: flat.numel()] = hi
    block[SUM_VALUES : SUM_VALUES + flat.numel()] = lo
    block[_CALLS] = 1.0
    block = block.to(s.device)
    eng = b.engine
    info = eng.bucket(_SUM_BUCKET)
    piece, world, rank = info["piece_len"], s.layout.world, s.layout.rank
    for owner in range(info["padded_len"] // piece):
        eng.scatter_accumulate(_SUM_BUCKET, block, scale=1.0, offset=owner * piece + rank * _SUM_BLOCK)
    s.pushed = True
    b.finish("odc.fsdp.global_sum")
    if getattr(s, "skipped", 0):
        return torch.zeros_like(v)
    words = eng.grad_shard(_SUM_BUCKET)[: world * _SUM_BLOCK].to("cpu", torch.float64).view(world, _SUM_BLOCK)
    counted = _counted(b, world)
    calls = {r: words[r, _CALLS].item() for r in counted}
    most = max(calls.values())
    short = [r for r, c in calls.items() if c != most]
    if short or most < 1:
        raise ProtocolError(
            f"odc.fsdp.global_sum: rank(s) {short} called it {sorted({calls[r] for r in short})} time(s) since the "
            f"step where the other ranks the minibatch's sum counts called it {most:g} time(s): call it once per "
            "minibatch on every rank"
        )
    out = [_fsum([words[r, j].item() for r in counted for j in (i, SUM_VALUES + i)]) for i in range(flat.numel())]
    return torch.tensor(out, dtype=torch.float64).reshape(v.shape)


def _fsum(words: list[float]) -> float:
    """The correctly rounded sum of ``words`` (the same whatever their order); NaN where ``inf`` meets
    ``-inf``, as a float sum gives."""
    try:
        return math.fsum(words)
    except ValueError:  # inf + -inf
        return math.nan


def _counted(b: Any, world: int) -> list[int]:
    """The ranks whose gradients the finished minibatch's sum counts: those of the member nodes under elastic
    hybrid sharding, every rank otherwise."""
    members = b.engine.members
    if members is None:
        return list(range(world))
    per = b.state.layout.shards  # hybrid: a node's ranks
    return [r for r in range(world) if r // per in members]
