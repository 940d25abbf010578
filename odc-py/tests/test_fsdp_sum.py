"""``odc.fsdp.global_sum``: every rank's numbers summed over the ranks a minibatch's gradients count, on 4 ranks
(2 emulated nodes x 2) under each sharding, with uneven microbatch counts (zero included); the expected sums are
computed from each rank's numbers, which every rank knows, apart from any exchange."""

from __future__ import annotations

import math

import _fsdp_helpers as H
import pytest
import torch
from _dist import run_ranks

import odc

pytestmark = pytest.mark.torch_versions  # FSDP2 under each sharding

WORLD, LOCAL = 4, 2


def _mine(rank: int, step: int) -> list[float]:
    """Rank ``rank``'s numbers at ``step``: a token count, a dyadic fraction (exact in two float32 words), a
    negative one, and a count beyond float32's 24 bits."""
    return [27.0 * ((rank + step) % 3), (rank + 1) / 1024 + step, -(rank * 3.5), 2.0**40 + rank]


def _sum_worker(rank, world, store):
    H.init_pg(rank, world, store)
    H.as_nodes(LOCAL, "shm")
    out = {}
    for sharding in ("full", "hybrid", "hybrid-zero"):
        mesh = H.hsdp_mesh(world, LOCAL) if sharding == "hybrid" else None
        model = H.build(world, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        odc.fsdp.enable(model, opt, sharding=sharding, timeout=60)
        got = {}
        for s in range(3):
            for m in range((rank + s) % 3):  # 0, 1 or 2 microbatches
                H.sample_loss(model, H.data(s, m, rank)).backward()
            mine = _mine(rank, s)  # a list of Python floats; the first step's also as a float64 tensor
            got[s] = odc.fsdp.global_sum(model, torch.tensor(mine, dtype=torch.float64) if s == 0 else mine).tolist()
            opt.step()
            opt.zero_grad()
        errors = {}
        H.sample_loss(model, H.data(9, 0, rank)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a gradient read finishes the minibatch
        try:
            odc.fsdp.global_sum(model, 1.0)
        except odc.ProtocolError as e:
            errors["after_read"] = str(e)
        opt.step()
        opt.zero_grad()
        try:
            odc.fsdp.global_sum(model, list(range(8)))
        except odc.ConfigError as e:
            errors["too_many"] = str(e)
        # Rank 3 leaves it out of a minibatch (its step finishes it): the others' sum would miss its numbers.
        if rank != 3:
            try:
                odc.fsdp.global_sum(model, 1.0)
            except odc.ProtocolError as e:
                errors["left_out"] = str(e)
        opt.step()
        opt.zero_grad()
        odc.fsdp.disable(model)
        out[sharding] = (got, errors)
    return out


def test_global_sum_is_every_ranks_numbers_exactly_the_same_bits_everywhere_under_each_sharding():
    res = run_ranks(_sum_worker, WORLD, timeout=300)
    assert all(status == "ok" for status, _ in res.values()), res
    for sharding in ("full", "hybrid", "hybrid-zero"):
        for s in range(3):
            want = [math.fsum(_mine(r, s)[i] for r in range(WORLD)) for i in range(4)]
            for r in range(WORLD):
                got, _ = res[r][1][sharding]
                assert got[s] == want, (sharding, s, r, got[s], want)
        for r in range(WORLD):
            _, errors = res[r][1][sharding]
            assert "has finished already" in errors["after_read"], (sharding, r, errors)
            assert "at most 7 numbers" in errors["too_many"], (sharding, r, errors)
            if r != 3:
                assert "rank(s) [3] called it [0.0] time(s)" in errors["left_out"], (sharding, r, errors)
            else:
                assert "left_out" not in errors
