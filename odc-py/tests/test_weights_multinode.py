"""Rollout weights across nodes: readers on another (emulated) host read the trainer's versions over libfabric.

2 network namespaces x 2 ranks (``_netns.cluster``); every trainer rank serves its slots with shared memory and
libfabric (``serve_weights(transport="auto")`` with ``ODC_FABRIC_ADDR`` set), and a reader reaches each trainer rank in
its own namespace by shared memory and the others by ``fi_read``. Two shapes share one start of the ranks: the trainer
on the first host and both readers on the second (every byte crosses), then one trainer rank per host and one reader
per host (each read takes one rank's pieces from its own node and the other's across). Every read must equal exactly
one version the trainer recorded, element for element in bf16, never a mix. Then a trainer host goes away (its ranks
SIGKILLed, or its link taken down): a reader's read fails naming a trainer rank, within its timeout, never a hang.
"""

from __future__ import annotations

import pytest
import torch
from _netns import cluster, require_ok
from test_weights import _check_reads, _every_rank_changes, _versions

pytestmark = pytest.mark.multinode

HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
STEPS = 100
# (trainer ranks, reader ranks); ranks 0-1 are the first namespace, 2-3 the second.
SHAPES = {"trainer-host-readers-host": ([0, 1], [2, 3]), "trainers-and-readers-on-both": ([0, 2], [1, 3]),
          "readers-share-a-node-cache": ([0, 1], [2, 3]), "readers-copy-in-pieces": ([0, 1], [2, 3])}
# What each reader's route to each trainer rank must be, by shape.
ROUTES = {"trainer-host-readers-host": {2: ["fabric", "fabric"], 3: ["fabric", "fabric"]},
          "trainers-and-readers-on-both": {1: ["shm", "fabric"], 3: ["fabric", "shm"]},
          "readers-share-a-node-cache": {2: ["node-cache", "node-cache"], 3: ["node-cache", "node-cache"]},
          "readers-copy-in-pieces": {2: ["fabric", "fabric"], 3: ["fabric", "fabric"]}}
# "readers-copy-in-pieces": staging="pieces" with pieces of 1 KiB, so that each rank's slot is several pieces.
PIECES = {"readers-copy-in-pieces": 1024}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    steps = [("_weights_multinode:race", {"trainers": trainers, "steps": STEPS, "slots": 2,
                                           "out": str(folder / f"s{i}"), "node_cache": "cache" in shape,
                                           "pieces": PIECES.get(shape)})
             for i, (shape, (trainers, _)) in enumerate(SHAPES.items())]
    with cluster(folder, HOSTS, PER_HOST) as c:
        c.start(steps, timeout_s=30)
        c.wait(400)
        return folder, [c.outcomes(i) for i in range(len(steps))]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_remote_readers_read_whole_versions_while_training(healthy, shape):
    folder, outcomes = healthy
    i = list(SHAPES).index(shape)
    trainers, readers = SHAPES[shape]
    out = require_ok(outcomes[i])
    for r in trainers:
        assert out[r]["fabric"], (r, out[r]["fabric_error"])
    per_version = _versions(folder / f"s{i}", len(trainers))
    assert len(per_version) == STEPS + 1
    _every_rank_changes(folder / f"s{i}", len(trainers), torch.bfloat16)
    retried = 0
    for r in readers:
        assert out[r]["routes"] == ROUTES[shape][r], (r, out[r]["routes"])
        reads = torch.load(folder / f"s{i}" / f"reader{r}.pt")
        n, distinct = _check_reads(reads, per_version)
        retried += out[r]["retried"]
        print(f"{shape}: reader {r} ({out[r]['routes']}): {n} reads, {distinct} distinct versions, "
              f"{out[r]['retried']} retried, fastest read {out[r]['read_min_s'] * 1e3:.1f} ms")
        assert distinct >= 2, (r, distinct)
    for r in trainers:
        print(f"{shape}: trainer {r}: {out[r]['steps_per_s']:.0f} steps/s, publish median "
              f"{out[r]['publish_median_s'] * 1e6:.0f} us")
    assert retried >= 1, "no slot was overwritten under a read: the race this test guards never ran"
    fetches = [out[r]["cache_fetches"] for r in readers]
    if "cache" in shape:
        # One reader fetched for the node, each version across at most once; the other fetched nothing.
        fetcher = [f for f in fetches if f is not None]
        assert len(fetcher) == 1 and 2 <= fetcher[0] <= STEPS + 1, fetches
        print(f"{shape}: {fetcher[0]} versions fetched across for {sum(out[r]['reads'] for r in readers)} reads")
    else:
        assert fetches == [None] * len(readers), fetches


TIMEOUT_S = 5.0
MARGIN_S = 10.0  # process scheduling on a small, shared machine


@pytest.mark.parametrize("how", ["killed", "link-down", "killed-node-cache"])
def test_a_reader_whose_trainer_host_goes_away_names_a_trainer_rank(tmp_path, how):
    # The trainer's ranks on the first host; readers on the second, reading over libfabric (or through their
    # node's cache, which one of them fills over libfabric). The first host's ranks are SIGKILLed (their sockets
    # close) or its link goes down (nothing closes: reads go unanswered). Each reader's next read fails with
    # PeerDied / PeerTimeout naming trainer rank 0 or 1, within its timeout.
    trainers, readers = [0, 1], [2, 3]
    cached = how.endswith("node-cache")
    with cluster(tmp_path, HOSTS, PER_HOST) as c:
        c.start([("_weights_multinode:gone", {"trainers": trainers, "timeout": TIMEOUT_S, "node_cache": cached})],
                timeout_s=30)
        c.wait_ready(list(range(WORLD)))
        if how.startswith("killed"):
            for r in trainers:
                c.kill(r)
        else:
            c.ns.set_link(0, up=False)
        c.go()
        outs = c.wait(TIMEOUT_S + MARGIN_S + 30)
    for r in readers:
        o = outs[r]
        assert o.status == "ok", o.describe()
        err = o.value
        print(f"{how}: reader {r}: {err}")
        assert err["type"] in ("PeerDied", "PeerTimeout"), (r, err)
        assert err["peer"] in trainers and f"rank {err['peer']}" in err["message"], (r, err)
        assert err["routes"] == ["node-cache" if cached else "fabric"] * 2, (r, err)
        assert err["elapsed"] < TIMEOUT_S + MARGIN_S, (r, err)
