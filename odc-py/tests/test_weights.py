"""Rollout weights: readers outside the training group read whole parameter versions one-sidedly
(``odc.fsdp.serve_weights``, ``odc.WeightReader``).

The multi-process cases launch trainer ranks (a gloo group of their own, FSDP2, SGD) and reader processes that never
join it, in one ``run_ranks`` (``_weights.ranks`` dispatches each rank to its role). Every trainer rank records each
version's local shards; every read must equal exactly one version, element for element in the reader's dtype.
"""

from __future__ import annotations

import datetime
import time

import _weights as W
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import odc
from odc.weights import VersionRefused, serve_weights


def _ok(res: dict, ranks) -> None:
    for r in ranks:
        assert res[r][0] == "ok", (r, res[r])


def _versions(out, trainers: int) -> list[dict[str, torch.Tensor]]:
    """Every version's full parameters: the trainers' local Shard(0) shards, concatenated in rank order."""
    per_rank = [torch.load(f"{out}/trainer{r}.pt") for r in range(trainers)]
    n = len(per_rank[0])
    assert all(len(p) == n for p in per_rank)
    names = list(per_rank[0][0])
    return [{k: torch.cat([per_rank[r][v][k] for r in range(trainers)]) for k in names} for v in range(n)]


def _every_rank_changes(out, trainers: int, dtype: torch.dtype) -> None:
    """Each step changes, in ``dtype``, both halves of every rank's slot (its shards in parameter order): so a read
    mixing two versions across ranks, or torn within one rank's slot, cannot equal either."""
    for r in range(trainers):
        flat = [torch.cat([t.reshape(-1) for t in v.values()]).to(dtype) for v in torch.load(f"{out}/trainer{r}.pt")]
        half = flat[0].numel() // 2
        for v in range(1, len(flat)):
            a, b = flat[v], flat[v - 1]
            assert not torch.equal(a[:half], b[:half]) and not torch.equal(a[half:], b[half:]), (r, v)


def _check_reads(reads, per_version) -> tuple[int, int]:
    """Every read equals exactly its version (bf16); versions never go backwards. Returns (reads, distinct)."""
    last = -1
    for version, age, attempts, tensors in reads:
        assert 0 <= version < len(per_version) and age >= 0 and attempts >= 1
        assert version >= last, (version, last)
        last = version
        want = per_version[version]
        assert tensors.keys() == want.keys()
        for k, t in tensors.items():
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, want[k].to(torch.bfloat16)), f"read of version {version}: {k} differs"
    return len(reads), len({r[0] for r in reads})


WHOLE = {"two-readers": {}, "one-reader-sigkilled": {"kill": True}, "fsdp2-on-odc": {"odc_on": True},
         "overlapped-copies": {"overlap": True}, "bf16-served": {"served_dtype": torch.bfloat16}}


@pytest.mark.parametrize("case", list(WHOLE))
def test_whole_versions_while_training(tmp_path, case):
    """2 trainer ranks step 100 times as fast as they can while 2 readers loop: every read is exactly one
    version. With ``kill``, one reader is SIGKILLed in the middle of a copy: the trainers finish, the other reader
    still reads whole versions. ``odc_on``: the trainer's FSDP2 runs on ODC (``odc.fsdp.enable``). ``overlap``:
    each version is copied on the server's thread while the next step computes (``serve_weights(overlap=True)``).
    ``served_dtype``: the versions are served in bf16 (``serve_weights(dtype=...)``), each read equal to one
    version cast by the reader itself."""
    kill = WHOLE[case].get("kill", False)
    trainers, steps = 2, 100
    roles = ["trainer", "trainer", "reader", "reader"]
    kw = {"trainer": {"trainers": trainers, "steps": steps, "slots": 2, "out": str(tmp_path),
                      "readers_first": 2, "odc_on": WHOLE[case].get("odc_on", False),
                      "overlap": WHOLE[case].get("overlap", False),
                      "served_dtype": WHOLE[case].get("served_dtype")},
          "reader": {"out": str(tmp_path), "fault_every": 3}}
    if kill:
        roles[3] = "killed"
        kw["killed"] = {"out": str(tmp_path), "kill_after": 0.2}
    res = run_ranks(W.ranks, 4, timeout=180, roles=roles, **kw)
    _ok(res, [0, 1, 2] if kill else [0, 1, 2, 3])
    if kill:
        assert res[3][0] == "hung", res[3]  # how run_ranks reports a rank ended by SIGKILL
    per_version = _versions(tmp_path, trainers)
    assert len(per_version) == steps + 1
    _every_rank_changes(tmp_path, trainers, torch.bfloat16)
    retried = 0
    for r in [2] if kill else [2, 3]:
        reads = torch.load(f"{tmp_path}/reader{r}.pt")
        n, distinct = _check_reads(reads, per_version)
        retried += res[r][1]["retried"]
        print(f"reader {r}: {n} reads, {distinct} distinct versions, {res[r][1]['retried']} retried")
        assert distinct >= 2
    assert retried >= 1, "no slot was overwritten under a read: the race this test guards never ran"


@pytest.mark.parametrize("orig", [False, True], ids=["flat-parameters", "use-orig-params"])
def test_fsdp1_shards_are_served_by_name_and_read_whole(tmp_path, orig):
    """FSDP1 (each block its own unit): every rank serves the runs of its FlatParameters' shards by the model's own
    names; a reader looping while the trainers step reads exactly one version each time, by those names."""
    steps = 30
    res = run_ranks(W.ranks, 3, timeout=180, roles=["fsdp1_trainer", "fsdp1_trainer", "reader"],
                    fsdp1_trainer={"trainers": 2, "steps": steps, "out": str(tmp_path), "orig": orig},
                    reader={"out": str(tmp_path), "fault_every": 3})
    _ok(res, [0, 1, 2])
    per_version = torch.load(f"{tmp_path}/full.pt")
    assert len(per_version) == steps + 1 and "blocks.0.norm.weight" in per_version[0]
    n, distinct = _check_reads(torch.load(f"{tmp_path}/reader2.pt"), per_version)
    print(f"FSDP1 (use_orig_params={orig}): {n} reads, {distinct} distinct versions, {res[2][1]['retried']} retried")
    assert distinct >= 2


def test_slow_reader_gets_newest_or_refusal(tmp_path):
    """A reader slower than K versions (it sleeps 0.3 s inside its copy): retried, it gets a newer version whole;
    with too few retries it is refused naming the owner and the versions; an overwritten old version is refused."""
    trainers = 2
    res = run_ranks(W.ranks, 3, timeout=180, roles=["slow_trainer", "slow_trainer", "slow_reader"],
                    slow_trainer={"trainers": trainers, "slots": 2, "out": str(tmp_path)}, slow_reader={})
    _ok(res, [0, 1, 2])
    per_version = _versions(tmp_path, trainers)
    out = res[2][1]
    version, attempts, tensors = out["retry"]
    assert attempts >= 2, "the trainer did not overwrite the slow read's version (did it step?)"
    for k, t in tensors.items():
        assert torch.equal(torch.tensor(t), per_version[version][k]), k
    message, owner, v, by, attempts = out["refused"]
    assert attempts == 3 and by >= v + 2 and owner in (0, 1)
    assert f"version {v} of owner rank {owner} was overwritten by version {by}" in message
    assert "version 0 of owner rank" in out["old"]


def test_late_reader_reads_latest(tmp_path):
    """A reader that attaches after the trainers stepped reads the last version into a model."""
    trainers, steps = 2, 7
    res = run_ranks(W.ranks, 3, timeout=180, roles=["trainer", "trainer", "late_reader"],
                    trainer={"trainers": trainers, "steps": steps, "slots": 3, "out": str(tmp_path),
                             "hold_until": "t/late_done"},
                    late_reader={"steps": steps})
    _ok(res, [0, 1, 2])
    per_version = _versions(tmp_path, trainers)
    got = res[2][1]
    assert got["version"] == steps and got["age"] == 0
    for k, p in got["params"].items():
        assert torch.equal(torch.tensor(p), per_version[steps][k]), k


# In one process (no FSDP): a plain module's parameters are served whole by rank 0.

@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))


def _step(model, opt):
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_read_by_address_into_model_and_versions(store):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    server = serve_weights(m, opt, store=store, name="plain", slots=2)
    r = odc.WeightReader(f"127.0.0.1:{store.port}", name="plain", timeout=5)
    got = r.read()
    assert (got.version, got.age) == (0, 0)
    assert all(torch.equal(got.tensors[k], v.detach().bfloat16()) for k, v in m.named_parameters())
    for _ in range(3):
        _step(m, opt)
    assert server.version == 3 and r.latest() == 3
    into = _model(seed=1)
    got = r.read(into=into, version=3)
    assert got.version == 3 and got.tensors is None
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), into.parameters(), strict=True))
    assert len(server.publish_seconds) == 4 and server.memory_bytes >= 2 * server.slot_bytes
    before = [p.clone() for p in into.parameters()]
    with pytest.raises(VersionRefused, match="version 1 of owner rank 0 was overwritten by version 3") as e:
        r.read(version=1, into=into)
    assert (e.value.owner, e.value.version, e.value.by) == (0, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, into.parameters(), strict=True))
    with pytest.raises(odc.PeerTimeout, match="weight version 9"):
        r.read(version=9, timeout=0.2)


def test_an_overlapped_copy_is_of_its_step_and_the_next_step_waits_for_it(store):
    """serve_weights(overlap=True): each copy starts after a 0.3 s sleep (on the server's thread), so the optimizer
    step that published it returns first; the next step waits for it (its pre-hook) before it writes the
    parameters the copy reads, so every version is exactly its step's parameters. Without that wait the copy of
    version 2 would read step 3's."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    server = serve_weights(m, opt, store=store, name="overlap", slots=2, overlap=True)
    server._copy_delay = 0.3
    r = odc.WeightReader(store, name="overlap", timeout=5)
    seen = {}
    for v in (1, 2, 3):
        t0 = time.perf_counter()
        _step(m, opt)
        took = time.perf_counter() - t0
        seen[v] = {k: p.detach().clone() for k, p in m.named_parameters()}
        print(f"step {v}: {took * 1e3:.0f} ms (the copy of version {v - 1} waited for first)")
        if v > 1:
            assert took >= 0.25, took  # waited for the copy of the version before
    assert server.publish_seconds[-1] < 0.1, server.publish_seconds  # the publish itself returned at once
    server.wait()
    assert server.version == r.latest() == 3
    for v in (2, 3):
        got = r.read(version=v, dtype=torch.float32)
        for k, want in seen[v].items():
            assert torch.equal(got.tensors[k], want), (v, k)
    server._copy_delay = 0.0
    server.close()
    _step(m, opt)
    assert server.version == 3  # closed: no hook publishes


@pytest.mark.parametrize("overlap", [False, True], ids=["copy-in-the-hook", "overlap"])
def test_bf16_served_versions_hold_half_the_bytes_and_read_exactly_as_the_trainers_cast(store, overlap):
    """serve_weights(dtype=torch.bfloat16): the slots hold bf16 (half the bytes of the f32 server's), the manifest
    says bf16, a bf16 read of each version is bit-identical to casting that step's f32 parameters, an f32 read gets
    those bf16 values widened; with overlap the cast runs on the server's thread, still before the next step."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    full = serve_weights(_model(), store=store, name=f"f32{overlap}", slots=2)
    server = serve_weights(m, opt, store=store, name=f"bf16{overlap}", slots=2, overlap=overlap,
                           dtype=torch.bfloat16)
    assert server.slot_bytes < full.slot_bytes and server.dtype == torch.bfloat16
    assert server._cast_stage is None  # f32 -> bf16: the native publish casts into the slot, no staging
    r = odc.WeightReader(store, name=f"bf16{overlap}", timeout=5)
    assert {dt for _, dt in r.params.values()} == {torch.bfloat16}
    for v in (1, 2, 3):
        _step(m, opt)
        want = {k: p.detach().clone() for k, p in m.named_parameters()}
        server.wait()
        got = r.read(version=v, dtype=torch.bfloat16)
        wide = r.read(version=v, dtype=torch.float32)
        for k, w in want.items():
            assert torch.equal(got.tensors[k], w.to(torch.bfloat16)), (v, k)
            assert torch.equal(wide.tensors[k], w.to(torch.bfloat16).float()), (v, k)
        assert not all(torch.equal(wide.tensors[k], w) for k, w in want.items())  # rounded: not the f32 values


def test_a_cast_the_native_publish_does_not_make_goes_through_a_staging_copy(store):
    """f64 parameters served in bf16 (the native cast takes f32, bf16 and f16 only): cast by torch into a staging
    slot, then copied; every read still equals torch's cast of that step's parameters, and the f32 second layer of
    the same model is cast natively beside it."""
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    m[0].double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    server = serve_weights(m, opt, store=store, name="f64", slots=2, dtype=torch.bfloat16)
    assert server._cast_stage is not None
    r = odc.WeightReader(store, name="f64", timeout=5)
    for v in (1, 2):
        m[0].weight.grad = torch.randn_like(m[0].weight)
        for p in (m[0].bias, *m[1].parameters()):
            p.grad = torch.randn_like(p)
        opt.step()
        got = r.read(version=v, dtype=torch.bfloat16)
        for k, w in m.named_parameters():
            assert torch.equal(got.tensors[k], w.detach().to(torch.bfloat16)), (v, k)


def test_bad_input_names_the_first_mismatch_and_leaves_into_unchanged(store):
    m = _model()
    server = serve_weights(m, store=store, name="bad", slots=2)  # kept: dropping it withdraws the slots
    r = odc.WeightReader(store, name="bad", timeout=5)
    with pytest.raises(odc.StoreError, match="odc/weights/nope/meta"):
        odc.WeightReader(store, name="nope", timeout=0.2)
    with pytest.raises(odc.ConfigError, match="slots"):
        serve_weights(m, store=store, name="k1", slots=1)
    with pytest.raises(odc.ConfigError, match=r"shards are on \['meta'\]; they must all be on the CPU or all on "):
        serve_weights(torch.nn.Linear(2, 2, device="meta"), store=store, name="m1")
    with pytest.raises(odc.ConfigError, match=r"dtype=torch\.int8; a floating-point torch\.dtype"):
        serve_weights(m, store=store, name="d1", dtype=torch.int8)
    with pytest.raises(odc.ConfigError, match="overlap='yes'; True or False"):
        serve_weights(m, store=store, name="o1", overlap="yes")
    with pytest.raises(odc.ConfigError, match="staging='shard'; expected one of whole, pieces"):
        odc.WeightReader(store, name="bad", timeout=5, staging="shard")
    cases = {
        "missing": ({"0.weight": torch.zeros(7, 5)}, "'0.bias' is served but not in `into`"),
        "shape": ({"0.weight": torch.zeros(7, 5), "0.bias": torch.zeros(8), "1.weight": torch.zeros(3, 7),
                   "1.bias": torch.zeros(3)}, r"'0.bias' has shape \(8,\) in `into`, the trainer's is \(7,\)"),
        "extra": ({**{k: torch.zeros_like(v) for k, v in m.state_dict().items()}, "2.weight": torch.zeros(1)},
                  "`into` has '2.weight', which is not served"),
    }
    for into, match in cases.values():
        before = {k: v.clone() for k, v in into.items()}
        with pytest.raises(odc.LayoutError, match=match):
            r.read(into=into)
        assert all(torch.equal(before[k], into[k]) for k in into)
    other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(odc.LayoutError, match=r"'1.weight' has shape \(4, 7\)"):
        r.read(into=other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    extra = cases["extra"][0]
    got = r.read(into=extra, strict=False)  # names not served are ignored when asked
    assert got.version == 0 and torch.equal(extra["1.bias"], m[1].bias.detach())
    with pytest.raises(odc.ConfigError, match="version="):
        r.read(version=-1)
    del server  # the slots are withdrawn: a new reader is refused by name
    with pytest.raises(odc.TransportError, match=r"'bad'.*trainer still running"):
        odc.WeightReader(store, name="bad", timeout=5)
    again = _model(seed=2)
    server = serve_weights(again, store=store, name="bad", slots=3)  # served again: a new generation
    got = odc.WeightReader(store, name="bad", timeout=5).read(dtype=torch.float32)
    assert server.slots == 3
    assert all(torch.equal(got.tensors[k], v) for k, v in again.named_parameters())
