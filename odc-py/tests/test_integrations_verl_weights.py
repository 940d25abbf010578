"""verl's ``odc`` checkpoint engine against verl's ``naive`` engine on CPU, in the same run.

2 ranks of verl's own FSDP2 actor engine (tiny random Qwen2, fp32) train a PPO step per round; a rollout process
outside their group holds a bf16 and an f32 Hugging Face model (transformers' ``generate`` standing in for the
inference engine). Each round both sides drive the ``odc`` engine as verl's ``CheckpointEngineManager`` does, and
the actor hands verl's ``naive`` engine verl's full-tensor generator. The rollout loads what each engine gave it
and decodes greedily. See _verl_weights_worker.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from _dist import run_ranks

pytestmark = pytest.mark.verl  # make test runs these in .venv-torch211, on verl's own pins

if importlib.util.find_spec("verl") is None:
    if os.environ.get("ODC_REQUIRE_VERL") == "1":
        raise ImportError("ODC_REQUIRE_VERL=1, but verl is not installed here (make setup-torch211 installs it)")
    pytest.skip("verl is not installed here: it pins torch 2.11.0, and make test runs these tests in .venv-torch211 "
                "(make setup-torch211); ODC_REQUIRE_VERL=1 makes this a failure", allow_module_level=True)


ACTOR_KINDS = {"actor-on-fsdp2": ("fsdp2", False), "actor-on-odc": ("fsdp2", True), "fsdp1-actor": ("fsdp", False)}


@pytest.fixture(scope="module", params=list(ACTOR_KINDS))
def runs(request, tmp_path_factory):
    """The actor trains on verl's FSDP2 collectives, on ODC (``external_lib=odc.integrations.verl_auto``), or as
    verl's FSDP1 actor (``strategy="fsdp"``)."""
    import _verl_weights_worker as W

    strategy, odc_training = ACTOR_KINDS[request.param]
    model_dir = str(tmp_path_factory.mktemp("qwen2"))
    W.V.write_model(model_dir, **W.MODEL)
    out_dir = str(tmp_path_factory.mktemp("naive"))
    out = run_ranks(W.worker, W.ACTORS + 1, timeout=600, model_dir=model_dir, out_dir=out_dir,
                    odc_training=odc_training, strategy=strategy)
    for rank, (status, value) in out.items():
        assert status == "ok", (rank, status, value if not isinstance(value, tuple) else value[3])
    assert out[0][1]["odc_training"] is odc_training
    return {"strategy": strategy, **{rank: value for rank, (_, value) in out.items()}}


def _rollout(runs):
    import _verl_weights_worker as W

    return runs[W.ACTORS]


def test_rollout_generates_the_same_tokens_as_with_verls_naive_engine(runs):
    """Same names in verl's order, every tensor equal to verl's full parameter cast to the rollout's dtype, and the
    same greedy tokens, after each of two training steps, for a bf16 and an f32 rollout."""
    import _verl_weights_worker as W

    ro = _rollout(runs)
    for g, rec in enumerate(ro["rounds"], start=1):
        for dt in ("torch.bfloat16", "torch.float32"):
            r = rec[dt]
            assert r["names"] and r["count"] == runs[0]["rounds"][g - 1]["params"], (g, dt, r["count"])
            assert r["mismatched"] == [], (g, dt, r["mismatched"][:5])
            assert r["odc_tokens"] == r["naive_tokens"], (g, dt)
            assert len(r["odc_tokens"]) == 3 and all(len(t) == W.NEW_TOKENS for t in r["odc_tokens"])
    # The weights moved between the versions (so an older one fails the equality above), and the generations with
    # them (the models compared are not the untrained checkpoint).
    assert ro["rounds"][1]["moved"] > 1e-3, ro["rounds"][1]["moved"]
    assert ro["rounds"][-1]["torch.bfloat16"]["odc_tokens"] != ro["initial"]["torch.bfloat16"]


def test_each_update_reads_the_version_the_actor_published_for_it(runs):
    for g, rec in enumerate(_rollout(runs)["rounds"], start=1):
        for dt, read in rec["read"].items():
            assert (read["asked"], read["version"], read["age"]) == (g, g, 0), (g, dt, read)
    for rank in (0, 1):
        assert [r["metrics"]["checkpoint_engine/odc_version"] for r in runs[rank]["rounds"]] == [1.0, 2.0]
        assert runs[rank]["version"] == 2


def test_send_weights_never_iterates_verls_generator(runs):
    """verl's FSDP2 generator is lazy: the odc engine closes it unstarted, so no parameter is gathered; the naive
    engine's consumer gathers every one. verl's FSDP1 path gathers every unit in get_per_tensor_param itself (its
    state_dict()); on an odc engine's actor that call waits for the generator's first item, which never comes."""
    for rank in (0, 1):
        for r in runs[rank]["rounds"]:
            assert r["odc_gathers"] == 0, r
            assert r["naive_gathers"] > 0, r
            if runs["strategy"] == "fsdp2":
                assert r["naive_gathers"] <= r["params"], r


def test_what_the_engine_cannot_do_is_refused_by_name(runs):
    a, ro = runs[0]["refused"], _rollout(runs)
    assert a["foreign"].startswith("ConfigError") and "get_per_tensor_param did not make" in a["foreign"], a
    moved = "FSDP1 unit '(root)'" if runs["strategy"] == "fsdp" else "parameter 'model.embed_tokens.weight'"
    assert f"{moved}'s local shard moved" in a["moved"], a
    r = ro["refused"]
    assert "127.0.0.1:1, a loopback address" in r["loopback"] and "rollout worker 0" in r["loopback"], r
    assert "actor rank 1, which serves its weights to its own node only: no address" in r["fabric"], r
    for what in ("neither FSDP2", "LoRA / peft", "QAT", "param_offload"):
        assert what in r["settings"], (what, r["settings"])
    assert "rollout_dtype='int8'" in r["dtype"], r


@pytest.mark.multinode
def test_rollout_workers_on_another_host_share_each_version_through_their_nodes_cache(tmp_path):
    """The actor's 2 ranks in one network namespace, 2 rollout worker processes (bf16, f32) in another: no refusal;
    each worker's every read is the version the actor published for that update, equal to verl's full parameters
    (naive engine, same run) in its dtype, generating the same tokens; both read through their node's cache (auto:
    two workers on the node), which one of them filled over libfabric."""
    import _verl_weights_worker as W
    from _netns import cluster, require_ok

    model_dir, out_dir, ranks = tmp_path / "qwen2", tmp_path / "naive", tmp_path / "ranks"
    out_dir.mkdir()
    ranks.mkdir()
    W.V.write_model(str(model_dir), **W.MODEL)
    with cluster(ranks, hosts=2, per_host=W.ACTORS) as c:
        c.start([("_verl_weights_worker:across", {"model_dir": str(model_dir), "out_dir": str(out_dir)})],
                timeout_s=60)
        out = require_ok(c.wait(600))
    workers = [out[W.ACTORS + i] for i in range(len(W.ROLLOUTS))]
    fetched = []
    for i, (name, ro) in enumerate(zip(W.ROLLOUTS, workers, strict=True)):
        dt = f"torch.{name}"
        for g, rec in enumerate(ro["rounds"], start=1):
            r, read = rec[dt], rec["read"][dt]
            assert r["names"] and r["mismatched"] == [], (i, g, r["mismatched"][:5])
            assert r["count"] == out[0]["rounds"][g - 1]["params"], (i, g)
            assert r["odc_tokens"] == r["naive_tokens"], (i, g)
            assert (read["asked"], read["version"]) == (g, g), (i, g, read)
            assert read["routes"] == ["node-cache"] * W.ACTORS, (i, g, read)
            print(f"rollout worker {i} ({dt}), update {g}: read in {read['seconds']:.3f} s, routes "
                  f"{read['routes']}, fetched for the node {read['cache_fetches']}")
        fetched.append(ro["rounds"][-1]["read"][dt]["cache_fetches"])
    # One worker fetched each version across for the node (at least one per update), the other none.
    assert fetched.count(None) == 1 and max(f or 0 for f in fetched) >= W.ROUNDS, fetched
    assert workers[0]["rounds"][-1][f"torch.{W.ROLLOUTS[0]}"]["odc_tokens"] != \
        workers[0]["initial"][f"torch.{W.ROLLOUTS[0]}"]


def test_transfer_times_side_by_side(runs):
    """Reported, not asserted: verl's naive engine (gather every full tensor on every actor rank, then the cast a bf16
    rollout needs) against the odc engine (publish on each actor rank; the rollout's whole read, cast included)."""
    ro = _rollout(runs)
    print(f"\nverl checkpoint engines, {runs[0]['rounds'][0]['params']} tensors, "
          f"odc slots {runs[0]['memory_bytes'] / 2**20:.1f} MiB per actor rank")
    print("round | naive: gather s (r0, r1), +bf16 cast s | odc: publish s (r0, r1), rollout receive s bf16 (read), "
          "f32 (read)")
    for g, rec in enumerate(ro["rounds"]):
        a0, a1 = runs[0]["rounds"][g], runs[1]["rounds"][g]
        pub = [x["metrics"]["checkpoint_engine/odc_publish_s"] for x in (a0, a1)]
        recv = [f"{rec['seconds'][dt]:.4f} ({rec['read'][dt]['seconds']:.4f})" for dt in ("torch.bfloat16",
                                                                                        "torch.float32")]
        print(f"{g + 1} | {a0['naive_s']:.4f}, {a1['naive_s']:.4f}, {a0['naive_s'] + a0['naive_cast_s']:.4f} | "
              f"{pub[0]:.4f}, {pub[1]:.4f}, {recv[0]}, {recv[1]}")


def test_the_engine_is_registered_whichever_is_imported_first():
    """verl's workers import ``custom_backend_module`` after ``verl.checkpoint_engine``; with
    ``VERL_USE_EXTERNAL_MODULES=odc.integrations.verl_auto`` (ODC training) verl imported odc.integrations.verl long
    before that, while verl itself was being imported: the engine is registered once verl's checkpoint engines load,
    and the finder that did it is gone."""
    from _dist import python_with_verl_auto

    code = ("import sys, verl.checkpoint_engine as ce; from verl.utils.import_utils import import_external_libs; "
            "import_external_libs('odc.integrations.verl'); "
            "print(ce.CheckpointEngineRegistry.get('odc').__name__, "
            "[type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith('odc')])")
    assert python_with_verl_auto(code) == "OdcCheckpointEngine []"
