"""Workers for test_weights.py: FSDP2 trainer ranks that serve their weights, and readers outside the group.

One ``run_ranks`` launch holds both: ranks ``< trainers`` form a gloo group of their own (under a store prefix) and
train the tiny model of ``_fsdp_helpers`` with SGD; the others never join it and only read. Ranks meet through the
shared store's keys under ``t/`` (test control). Big results go to files (tensors do not survive a worker's
``os._exit`` in transit).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import torch
import torch.distributed as dist
from _fsdp_helpers import build, data, sample_loss

import odc
import odc.fsdp

NAME = "policy"


def _wait(store, key: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"test key {key} not set in {timeout} s")
        time.sleep(0.002)


def _local_shards(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def trainer(rank, world, store, *, trainers, steps, slots, out, readers_first=0, hold_until=None, stall=None,
            lr=0.05, odc_on=False, overlap=False, served_dtype=None):
    """Trains ``steps`` SGD steps as fast as it can (after ``readers_first`` readers attached), recording every
    version's local shards into ``out`` (a torch.save file per rank). ``stall``: (phases, steps per phase) of
    alternating step-time phases without and with readers reading; returns the phases' step times. ``overlap``:
    each version is copied on the server's thread while the next step computes. ``served_dtype``: served in it."""
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=trainers)
    model = build(trainers, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if odc_on:  # FSDP2 on ODC: the weights are served the same way
        odc.fsdp.enable(model, opt, timeout=60)
    server = odc.fsdp.serve_weights(model, opt, name=NAME, slots=slots, store=store, overlap=overlap,
                                    dtype=served_dtype)
    versions = [_local_shards(model)]
    if readers_first:
        _wait(store, f"t/attached{readers_first}")
    times: list[tuple[int, float]] = []
    phase = -1
    for s in range(steps):
        if stall is not None and s % stall[1] == 0:
            phase = s // stall[1]
            dist.barrier()
            if rank == 0:
                store.set("t/reading", str(phase % 2))
            time.sleep(0.05)  # the readers see the switch
            dist.barrier()
        t0 = time.perf_counter()
        loss = sample_loss(model, data(s, 0, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append((phase, time.perf_counter() - t0))
        if out is not None:
            versions.append(_local_shards(model))
    assert server.version == steps, (server.version, steps)
    store.set(f"t/trained{rank}", "1")
    if rank == 0:
        store.set("t/trained", "1")
    if hold_until is not None:
        _wait(store, hold_until, 120)
    if out is not None:
        torch.save(versions, f"{out}/trainer{rank}.pt")
    dist.destroy_process_group()
    return {"times": times, "publish": server.publish_seconds, "memory": server.memory_bytes,
            "slot_bytes": server.slot_bytes}


def fsdp1_trainer(rank, world, store, *, trainers, steps, out, orig):
    """An FSDP1 trainer rank (``_fsdp1.build``: each block its own unit, ``use_orig_params=orig``) that serves its
    FlatParameters' shards and steps ``steps`` SGD steps once a reader attached; rank 0 records every version's full
    parameters by name (``summon_full_params``)."""
    from _fsdp1 import build as build_fsdp1
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817 - FSDP1's own docs' name

    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=trainers)
    model = build_fsdp1(seed=0, orig=orig)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    server = odc.fsdp.serve_weights(model, opt, name=NAME, slots=2, store=store)

    def full():
        with FSDP.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                    for k, v in model.module.named_parameters()}

    versions = [full()]
    _wait(store, "t/attached1")
    for s in range(steps):
        sample_loss(model, data(s, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
        versions.append(full())
    assert server.version == steps, (server.version, steps)
    if rank == 0:
        torch.save(versions, f"{out}/full.pt")
    store.set(f"t/trained{rank}", "1")
    if rank == 0:
        store.set("t/trained", "1")
    dist.destroy_process_group()
    return {"slot_bytes": server.slot_bytes}


def reader(rank, world, store, *, out, fault_every=0, kill_after=None, min_reads=5):
    """Reads the latest version in a loop until the trainers are done; every ``fault_every``-th read sleeps in the
    middle of its last copy (1-400 ms: longer than two steps of the trainer, so some slots are overwritten under
    it), widening the window a torn copy needs. ``kill_after``: SIGKILL itself that many seconds into a read that
    sleeps 1 s inside its copy."""
    r = odc.WeightReader(store, name=NAME, timeout=60)
    n = store.add("t/attached", 1)
    store.set(f"t/attached{n}", "1")
    if kill_after is not None:
        r._set_fault(1.0, 1)
        threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
        r.read()
        raise AssertionError("the reader outlived its SIGKILL")
    rng = random.Random(rank)
    reads = []
    while not store.check(["t/trained"]) or len(reads) < min_reads:
        if fault_every and len(reads) % fault_every == 0:
            r._set_fault(rng.uniform(0.001, 0.4), 1)
        got = r.read(dtype=torch.bfloat16, retries=1000)
        reads.append((got.version, got.age, got.attempts, got.tensors))
    torch.save(reads, f"{out}/reader{rank}.pt")
    return {"reads": len(reads), "retried": sum(a > 1 for _, _, a, _ in reads)}


killed = reader  # the reader that SIGKILLs itself, under its own role name


def stall_reader(rank, world, store, *, pace=0.0):
    """Reads continuously (or every ``pace`` seconds) while ``t/reading`` is 1, until the trainers are done."""
    r = odc.WeightReader(store, name=NAME, timeout=60)
    n = store.add("t/attached", 1)
    store.set(f"t/attached{n}", "1")
    reads, last_check, on = 0, 0.0, False
    while not store.check(["t/trained"]):
        now = time.monotonic()
        if now - last_check > 0.01:
            on = store.check(["t/reading"]) and store.get("t/reading") == b"1"
            last_check = now
        if on:
            r.read(retries=1000)
            reads += 1
            if pace:
                time.sleep(pace)
        else:
            time.sleep(0.002)
    return {"reads": reads}


def slow_reader(rank, world, store):
    """A reader slower than K versions: one read that sleeps 0.3 s in its copy (retried: the newest version), then
    reads that sleep in every copy (refused by name), then an old version by number (refused)."""
    r = odc.WeightReader(store, name=NAME, timeout=60)
    n = store.add("t/attached", 1)
    store.set(f"t/attached{n}", "1")
    _wait(store, "t/stepping")
    out = {}
    r._set_fault(0.3, 1)
    got = r.read(dtype=torch.float32, retries=1000)
    out["retry"] = (got.version, got.attempts, {k: v.tolist() for k, v in got.tensors.items()})
    r._set_fault(0.3, 100)
    try:
        r.read(retries=2)
        out["refused"] = None
    except odc.weights.VersionRefused as e:
        out["refused"] = (str(e), e.owner, e.version, e.by, e.attempts)
    r._set_fault(0.0, 0)
    try:
        r.read(version=0)
        out["old"] = None
    except odc.weights.VersionRefused as e:
        out["old"] = str(e)
    store.set("t/slow_done", "1")
    return out


def slow_trainer(rank, world, store, *, trainers, slots, out):
    """Steps until the slow reader is done (at most 3000 steps), recording every version."""
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=trainers)
    model = build(trainers, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    odc.fsdp.serve_weights(model, opt, name=NAME, slots=slots, store=store)
    versions = [_local_shards(model)]
    _wait(store, "t/attached1")
    if rank == 0:
        store.set("t/stepping", "1")
    s = 0
    while s < 3000:
        if s % 10 == 0:  # every rank stops at the same step
            done = torch.tensor([int(store.check(["t/slow_done"]))])
            dist.all_reduce(done)
            if done.item():
                break
        sample_loss(model, data(s, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
        versions.append(_local_shards(model))
        s += 1
    torch.save(versions, f"{out}/trainer{rank}.pt")
    dist.destroy_process_group()
    return s


def late_reader(rank, world, store, *, steps):
    """Attaches after the trainers stepped ``steps`` times; reads the latest into a model; then bad input."""
    _wait(store, "t/trained")
    r = odc.WeightReader(store, name=NAME, timeout=30)
    torch.manual_seed(123)
    from _fsdp_helpers import Tiny

    model = Tiny()
    got = r.read(into=model)
    res = {"version": got.version, "age": got.age,
           "params": {n: p.detach().clone().tolist() for n, p in model.named_parameters()}}
    store.set("t/late_done", "1")
    return res


def ranks(rank, world, store, *, roles, **kw):
    """Dispatches rank ``rank`` to ``roles[rank]`` (a function name here) with ``kw[name]`` as its arguments."""
    fn = roles[rank]
    return globals()[fn](rank, world, store, **kw.get(fn, {}))
