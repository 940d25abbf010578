"""A skip under ``elastic="rerun"``: a rank that leaves ``odc.fsdp.microbatches`` while the iterator hands it its
share of a dropped node's microbatches (the rerun) is named by a ``ProtocolError``, and the minibatch is skipped
on every member rank alike: no replica steps on it. 3 emulated nodes x 2 ranks, one rank SIGKILLed."""

from __future__ import annotations

import os
import signal

import _fsdp_helpers as H
from _dist import run_ranks

import odc
import odc.fsdp

WORLD, LOCAL = 6, 2
# Microbatches per rank at each step (nodes are ranks (0, 1), (2, 3), (4, 5)); rank 3 dies at step AT, after its
# first backward: the 3 microbatches of node 1 at AT are spread over the member ranks 0, 1, 4 (one each).
TABLE = ((1, 2, 0, 1, 2, 1), (2, 1, 1, 2, 0, 1), (1, 0, 2, 1, 1, 2))
VICTIM, AT = 3, 1


def _rerun_left_early(rank, world, store):
    """The plain ``odc.fsdp.microbatches`` loop under ``elastic="rerun"``; at step AT rank 0 breaks out of it as
    soon as it is handed a microbatch of the rerun. Returns per step what the finish raised, the skipped count and
    whether this rank's shards moved, and the final shards."""
    import torch

    H.as_nodes(LOCAL, "shm")
    H.init_pg(rank, world, store)
    model = H.build(world, mesh=H.hsdp_mesh(world, LOCAL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    odc.fsdp.enable(model, opt, sharding="hybrid", elastic="rerun", timeout=60)
    errors, skipped, moved = [], [], []
    try:
        for s, plan in enumerate(TABLE):
            norm = 27 * sum(plan)
            lists = [[(r, m) for m in range(plan[r])] for r in range(world)]
            before = H.local_shards(model)
            for r, m in odc.fsdp.microbatches(model, lists):
                if rank == 0 and s == AT and odc.fsdp.elastic_events(model):
                    break  # handed its share of the rerun: leaves with it
                (H.sample_loss(model, H.data(s, m, r)) / norm * world).backward()
                if rank == VICTIM and s == AT:
                    os.kill(os.getpid(), signal.SIGKILL)
            try:
                odc.fsdp.finish(model)  # what the step does first
                errors.append("")
            except odc.ProtocolError as e:
                errors.append(str(e))
            skipped.append(odc.fsdp.skipped(model))
            opt.step()
            opt.zero_grad()
            moved.append(H.local_shards(model) != before)
    except (odc.NodeDropped, odc.PeerDied) as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"errors": errors, "skipped": skipped, "moved": moved, "shards": H.local_shards(model)}


def test_leaving_the_rerun_early_is_named_and_skips_the_minibatch_on_every_member():
    res = run_ranks(_rerun_left_early, WORLD, timeout=240)
    members = [0, 1, 4, 5]
    for r in members:
        assert res[r][0] == "ok" and "errors" in res[r][1], (r, res[r])
        out = res[r][1]
        assert out["skipped"] == [int(s == AT) for s in range(len(TABLE))], (r, out["skipped"])
        assert out["moved"] == [s != AT for s in range(len(TABLE))], (r, out["moved"])
        if r == 0:
            err = out["errors"][AT]
            assert "elastic='rerun'" in err and "skipped on every rank" in err, err
        assert [e for s, e in enumerate(out["errors"]) if r != 0 or s != AT] == [""] * (len(TABLE) - (r == 0)), out
    for r in (0, 1):  # the replicas on the two member nodes stay bitwise the same
        assert res[r][1]["shards"] == res[r + 4][1]["shards"], r
    assert res[VICTIM] == ("hung", -signal.SIGKILL), res[VICTIM]
