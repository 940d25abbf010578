"""A rank never dies of an abort without a word: a panic in ODC's native code (here injected into a shard server
daemon with ``ODC_FAULT_SERVER_PANIC``) is an ``odc.InternalError`` naming the rank and what it was doing, the
peers name that rank, and the harness reports a rank that does die of a signal as such, with its stacks."""

from __future__ import annotations

import os
import signal
import time

import _accumulation as A
import pytest
import torch
from _dist import run_ranks

import odc

FAULT = "ODC_FAULT_SERVER_PANIC"
DAEMON = "rank 1: internal error in ODC while its shard server thread was adding rank "


def _abort_here(rank, world, store):
    if rank == 1:
        os.abort()  # what a C++ std::terminate or a Rust abort does to the process
    return rank


def test_a_rank_that_aborts_is_reported_as_died_with_its_stack(capfd):
    res = run_ranks(_abort_here, 2, timeout=120)
    assert res[0] == ("ok", 0), res
    assert res[1] == ("died", (-signal.SIGABRT, "SIGABRT", None)), res
    err = capfd.readouterr().err
    assert "rank 1" in err and "died of SIGABRT" in err and "before reporting" in err, err
    assert "Fatal Python error: Aborted" in err and "_abort_here" in err, err  # faulthandler's stack


def _engine_minibatch(rank, world, store):
    """One minibatch on a bare engine: publish, gather, push, finish; what it raised and after how long."""
    eng = odc.Engine(store, rank, world, timeout=30, job_key=f"pytest-panic-{os.getppid()}")
    start = time.monotonic()
    try:
        eng.register([odc.Bucket("w", 4096, torch.float32)])
        shard_len = eng.bucket("w")["shard_len"]
        eng.publish("w", torch.full((shard_len,), float(rank)), version=0)
        eng.gather("w", 0, torch.empty(4096))
        eng.scatter_accumulate("w", torch.ones(4096), scale=1.0)
        eng.finish_minibatch(0)
        # A rank whose daemon died may get this far (its own pushes went out); its next call fails.
        eng.zero_grad()
        return ("ok", None, None, time.monotonic() - start)
    except odc.OdcError as e:
        return (type(e).__name__, str(e), getattr(e, "peer", None), time.monotonic() - start)


def test_a_panic_in_a_daemon_is_an_internal_error_naming_the_rank_and_its_peers_name_it(monkeypatch):
    monkeypatch.setenv(FAULT, "1:1")  # rank 1's daemon panics at the first chunk a peer pushes to it
    res = run_ranks(_engine_minibatch, 3, timeout=120)
    assert all(s == "ok" for s, _ in res.values()), res  # every rank returned: none died, none hung
    out = {r: v for r, (_, v) in res.items()}
    cls, msg, _, _ = out[1]
    assert cls == "InternalError" and msg.startswith(DAEMON), out[1]
    assert 'of bucket "w" (minibatch 0' in msg and f"injected by {FAULT}" in msg, msg
    for r in (0, 2):
        cls, msg, peer, took = out[r]
        assert cls in ("PeerDied", "PeerTimeout") and peer == 1, out[r]
        assert took < 20, out[r]  # told at once (rank 1 retires), not at the 30 s deadline


def _accumulation_with_fault(rank, world, store):
    try:
        return ("ok", A.accumulation_worker(rank, world, store, [(2, 1, 3), (1, 3, 0)], ref=False))
    except odc.OdcError as e:
        return (type(e).__name__, str(e), getattr(e, "peer", None))


def test_a_panic_in_a_daemon_under_fsdp2_accumulation_is_an_internal_error(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv(FAULT, "1:2")
    res = run_ranks(_accumulation_with_fault, 3, timeout=300)
    assert all(s == "ok" for s, _ in res.values()), res
    out = {r: v for r, (_, v) in res.items()}
    assert out[1][0] == "InternalError" and out[1][1].startswith(DAEMON), out[1]
    for r in (0, 2):
        assert out[r][0] in ("PeerDied", "PeerTimeout") and out[r][2] == 1, out[r]


def test_a_malformed_fault_variable_is_a_config_error(monkeypatch):
    monkeypatch.setenv(FAULT, "one:1")
    eng = odc.Engine(torch.distributed.HashStore(), 0, 1, timeout=5, job_key=f"pytest-badfault-{os.getpid()}")
    with pytest.raises(odc.ConfigError, match=f"{FAULT}=\"one:1\": expected RANK:N"):
        eng.register([odc.Bucket("w", 16, torch.float32)])
