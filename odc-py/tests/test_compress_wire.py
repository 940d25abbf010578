"""Compressed pushes and gathers through odc.fsdp.enable(..., compress=...): 4 ranks on one host as 2 nodes x 2.

Shared memory between the emulated nodes (``shm``; the engine's rules are the same across a network) and
``cross_node="node"``: node-mates' gradients for an owner on the other node are summed on the node and that
sum crosses as int8 chunks with one f32 scale per 32 elements. Node-local pushes stay full precision. With
``"gather": "fp8"`` the parameters of shards owned on the other node are read from their owners' fp8 copies
(one f32 scale per 32 elements; through the node cache under ``auto``, directly under ``shm``); a rank's own
shard and its node-mate's stay f32.

- Training runs and its losses follow the uncompressed run's closely.
- Error feedback: with the parameters held still (lr = 0) every step pushes the same gradient, so its
  quantisation error is the same every step. Without feedback the sum of S steps' gradient shards is off
  by S times that error; with it, by at most one step's residual (what the pusher still holds).
"""

from __future__ import annotations

import math

import _fsdp_helpers as H
import pytest
import torch
from _dist import run_ranks

import odc

WORLD, PER_NODE = 4, 2
INT8 = {"push": "int8", "block": 32, "feedback": True}
FP8_INT8 = {"gather": "fp8", "push": "int8", "block": 32, "feedback": True}
# Microbatches per rank at each step (ranks 0-1 are node 0, 2-3 node 1): uneven, the same every step.
TABLE = ((2, 1, 1, 2),) * 8


def compress_worker(rank, world, store, per_node, modes, table, lr, transport="shm", sharding="full"):
    """Per mode (a name and its ``compress=`` setting), the same SGD loop over ``table`` on one fixed batch
    (microbatch m of rank r is the same at every step): this rank's summed loss per step and, per parameter,
    the sum over steps of its gradient shard as FSDP2 holds it. Full sharding with node sums, or ``sharding``
    ("hybrid": FSDP2's HSDP mesh; "hybrid-zero": a 1-D mesh)."""
    H.as_nodes(per_node, transport)
    H.init_pg(rank, world, store)
    out = {}
    for name, compress in modes:
        model = H.build(world, mesh=H.hsdp_mesh(world, per_node) if sharding == "hybrid" else None)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        kw = {"cross_node": "node"} if sharding == "full" else {"sharding": sharding}
        odc.fsdp.enable(model, opt, timeout=60, compress=compress, **kw)
        engine = model._odc_fsdp.engine
        losses, grads = [], {}
        for plan in table:
            norm = 27 * sum(plan)
            total = 0.0
            for m in range(plan[rank]):
                loss = H.sample_loss(model, H.data(0, m, rank))
                (loss / norm * world).backward()
                total += float(loss.detach())
            losses.append(total)
            for k, p in model.named_parameters():
                g = p.grad.to_local().detach().clone()
                grads[k] = grads[k] + g if k in grads else g
            opt.step()
            opt.zero_grad()
        out[name] = {"losses": losses, "grads": {k: v.tolist() for k, v in grads.items()},
                     "cross_node": engine.cross_node, "transport": engine.transport,
                     "across": odc.fsdp.bytes_across_nodes(model)}
        odc.fsdp.disable(model)
    return out


def _gap(out, name, base="plain"):
    """Largest |grad-sum difference| over every rank's shards, relative to the largest |grad sum|."""
    diff = scale = 0.0
    for r in out:
        for k, ref in out[r][base]["grads"].items():
            ref_t, got = torch.tensor(ref), torch.tensor(out[r][name]["grads"][k])
            diff = max(diff, (got - ref_t).abs().max().item())
            scale = max(scale, ref_t.abs().max().item())
    return diff / scale


@pytest.mark.parametrize("transport", ["shm", "auto", "emu-shmem"])
def test_compressed_training_follows_the_uncompressed_run(transport):
    # "auto": libfabric between the emulated nodes (shm+fabric), so the compressed chunks cross a socket.
    # "emu-shmem": nvshmem's device data path emulated in host memory, where the node sums are packed into int8
    # chunks and added by the daemons' streams (the GPU's kernels there).
    modes = (("plain", None), ("int8", INT8))
    out = H.all_ok(run_ranks(compress_worker, WORLD, timeout=240, per_node=PER_NODE, modes=modes, table=TABLE,
                             lr=0.5, transport=transport))
    assert out[0]["int8"]["cross_node"] == "node"
    assert out[0]["int8"]["transport"] == {"auto": "shm+fabric"}.get(transport, transport)
    plain = [sum(out[r]["plain"]["losses"][s] for r in out) for s in range(len(TABLE))]
    packed = [sum(out[r]["int8"]["losses"][s] for r in out) for s in range(len(TABLE))]
    # Training moves: the loss on the batch falls over the run.
    assert plain[-1] < 0.9 * plain[0], plain
    # Compression really happened: the gradients differ from the uncompressed run's by far more than the
    # summation order's noise (a few 1e-7 relative).
    grads = _gap(out, "int8")
    assert grads > 2e-5, f"compress= had no effect: gradient sums differ by {grads:.2e}"
    # An int8 push errs by at most half a step, amax/254 (0.4 %) of its block's largest gradient, and only on
    # the other node's half of each sum; error feedback keeps the applied updates within one step's residual
    # of the exact ones: the parameters differ by lr times one residual, and the loss, smooth in them, by far
    # less than 0.4 %. 2e-4 relative is about 80 times what we measured over 8 steps (2.4e-6) and still 170
    # times below one step's loss decrease (3.5e-2 relative), so a run that stopped learning would fail it.
    worst = max(abs(a - b) / abs(b) for a, b in zip(packed, plain, strict=True))
    print(f"losses: uncompressed {plain}, int8 {packed}, largest relative gap {worst:.2e}; grads {grads:.2e}")
    assert worst < 2e-4, (worst, plain, packed)


@pytest.mark.parametrize("transport", ["shm", "auto", "emu-shmem"])
def test_compressed_gathers_and_pushes_follow_the_uncompressed_run(transport):
    # "auto": the fp8 pieces cross a socket into the node cache and are dequantised out of it; "shm": no node
    # cache (its default is on only where nodes are joined by a network), each rank reads the other node's
    # copies itself; "emu-shmem": nvshmem's device path emulated, the copies quantised and the pieces
    # dequantised out of the device node cache by the daemons' streams.
    modes = (("plain", None), ("fp8", FP8_INT8))
    out = H.all_ok(run_ranks(compress_worker, WORLD, timeout=240, per_node=PER_NODE, modes=modes, table=TABLE,
                             lr=0.5, transport=transport))
    assert out[0]["fp8"]["cross_node"] == "node"
    plain = [sum(out[r]["plain"]["losses"][s] for r in out) for s in range(len(TABLE))]
    packed = [sum(out[r]["fp8"]["losses"][s] for r in out) for s in range(len(TABLE))]
    assert plain[-1] < 0.9 * plain[0], plain
    gaps = [abs(a - b) / abs(b) for a, b in zip(packed, plain, strict=True)]
    print(f"losses: uncompressed {plain}, fp8 gathers + int8 pushes {packed}; relative gaps {gaps}")
    # Really on: at step 0 both runs hold the same parameters, and only the fp8 gathers differ; the loss
    # already moves by far more than f32 summation order would (a few 1e-7).
    assert gaps[0] > 1e-5, gaps
    # The bound. An fp8 e4m3 code errs by at most half its step, 2^-4 (6 %) of the value, and half the
    # parameters (the other node's shards) carry such errors; of different signs, they mostly cancel in the
    # loss: 1.0e-4 at step 0 (measured, both transports). The master weights stay f32 and each version is
    # quantised afresh, so the error does not add up over steps; what grows is only the drift of the master
    # weights, steered by gradients taken at the fp8 weights (and int8 pushes, within one residual): 8.9e-4
    # at most over the 8 steps (measured). 2e-3 leaves twice that, is 1/30 of fp8's own worst relative error
    # and under a tenth of one step's loss decrease (2.3e-2 relative), so a run whose gathers returned wrong
    # values, or that stopped learning, fails it.
    assert max(gaps) < 2e-3, (gaps, plain, packed)
    assert max(gaps) < 0.1 * (plain[0] - plain[-1]) / plain[0] / len(TABLE), gaps
    # What crossed, by the engine's own counters (odc.fsdp.bytes_across_nodes): the same reads and pushes in
    # both runs, in fp8 (1 byte + a 4-byte scale per 32 elements: 0.28x of f32) and int8 with chunk headers.
    # A device engine keeps no such counters (odc-core's device_bytes counts emu-shmem's bytes instead).
    if transport == "emu-shmem":
        assert out[0]["fp8"]["across"] is None
        return
    across = {name: [sum(out[r][name]["across"][k] for r in out) for k in ("gathered", "pushed")]
              for name in ("plain", "fp8")}
    ratios = [c / p for c, p in zip(across["fp8"], across["plain"], strict=True)]
    print(f"bytes across nodes (gathered, pushed): uncompressed {across['plain']}, compressed {across['fp8']}, "
          f"ratios {ratios}")
    assert min(across["plain"]) > 0, across
    assert 0.27 < ratios[0] < 0.30 and 0.27 < ratios[1] < 0.34, ratios


@pytest.mark.parametrize("sharding", ["hybrid", "hybrid-zero"])
def test_compressed_hybrid_sums_follow_the_uncompressed_run_and_keep_the_replicas_equal(sharding):
    # Under hybrid sharding only the end-of-minibatch sum of the gradient shards crosses nodes: with a push
    # format each rank quantises its node's partial sums once (int8, error feedback) and every node adds every
    # node's dequantised copy in node order, its own too. Under hybrid-zero the updated parameter pieces cross
    # too, at each publish: with "gather": "fp8" each node reads the other's fp8 copies of their pieces.
    modes = (("plain", None), ("int8", INT8)) + ((("fp8", FP8_INT8),) if sharding == "hybrid-zero" else ())
    out = H.all_ok(run_ranks(compress_worker, WORLD, timeout=240, per_node=PER_NODE, modes=modes, table=TABLE,
                             lr=0.5, sharding=sharding))
    plain = [sum(out[r]["plain"]["losses"][s] for r in out) for s in range(len(TABLE))]
    packed = [sum(out[r]["int8"]["losses"][s] for r in out) for s in range(len(TABLE))]
    assert plain[-1] < 0.9 * plain[0], plain
    grads = _gap(out, "int8")
    worst = max(abs(a - b) / abs(b) for a, b in zip(packed, plain, strict=True))
    print(f"{sharding}: losses uncompressed {plain}, int8 sums {packed}, largest relative gap {worst:.2e}; "
          f"grads {grads:.2e}")
    # On: the gradient sums differ by far more than summation order would (a few 1e-7 relative).
    assert grads > 2e-5, f"compress= had no effect: gradient sums differ by {grads:.2e}"
    # The bound of the full-sharding test above, for the same reason: one int8 rounding (amax/254 of a block)
    # of each node's partial sums, kept within one residual of the exact updates by error feedback.
    assert worst < 2e-4, (worst, plain, packed)
    if sharding == "hybrid":
        # Every node added the same dequantised copies in the same order: the replicas' gradient shards (and
        # so their parameters) are the same bits.
        for r in range(PER_NODE):
            assert out[r]["int8"]["grads"] == out[r + PER_NODE]["int8"]["grads"], r
    # What crossed, by the engine's counters: only the sums' reads (hybrid-zero's piece copies of parameters
    # too, uncompressed and alike in both runs), int8 copies with a 4-byte scale per 32 elements: 0.28x.
    across = {name: {k: sum(out[r][name]["across"][k] for r in out) for k in ("gathered", "pushed", "summed")}
              for name in ("plain", "int8")}
    print(f"{sharding}: bytes across nodes {across}")
    assert across["plain"]["pushed"] == across["int8"]["pushed"] == 0, across
    assert across["plain"]["gathered"] == across["int8"]["gathered"], across
    assert (across["plain"]["gathered"] > 0) == (sharding == "hybrid-zero"), across
    ratio = across["int8"]["summed"] / across["plain"]["summed"]
    assert 0.27 < ratio < 0.30, (ratio, across)
    if sharding == "hybrid-zero":
        fp8 = [sum(out[r]["fp8"]["losses"][s] for r in out) for s in range(len(TABLE))]
        gaps = [abs(a - b) / abs(b) for a, b in zip(fp8, plain, strict=True)]
        fp8_across = {k: sum(out[r]["fp8"]["across"][k] for r in out) for k in ("gathered", "summed")}
        print(f"hybrid-zero, fp8 pieces + int8 sums: losses {fp8}, relative gaps {gaps}; bytes {fp8_across}")
        # On from the first step (same parameters, only the other node's pieces differ), within the fp8 bound of
        # the full-sharding test above (half the parameters carry an e4m3 rounding; the master pieces stay f32).
        assert gaps[0] > 1e-5 and max(gaps) < 2e-3, gaps
        # The pieces cross as fp8 with a 4-byte scale per 32 elements, the sums as int8: 0.28x each.
        ratio = fp8_across["gathered"] / across["plain"]["gathered"]
        assert 0.27 < ratio < 0.30 and fp8_across["summed"] == across["int8"]["summed"], (ratio, fp8_across)


def test_error_feedback_keeps_the_sum_of_pushes_exact():
    steps = ((1, 1, 1, 1),) * 6
    modes = (("plain", None), ("feedback", INT8), ("no_feedback", {**INT8, "feedback": False}))
    out = H.all_ok(run_ranks(compress_worker, WORLD, timeout=240, per_node=PER_NODE, modes=modes, table=steps,
                             lr=0.0))
    with_fb, without = _gap(out, "feedback"), _gap(out, "no_feedback")
    print(f"sum of 6 steps' gradient shards, gap to uncompressed: feedback {with_fb:.2e}, none {without:.2e}")
    # The same gradient every step: without feedback its error adds up S = 6 times; with it, what the owner
    # got plus the residual still held is exact, so the gap is one residual, at most one step's error.
    assert without > 1e-4, f"no quantisation error ({without:.2e}): nothing was compressed"
    assert with_fb * 3 < without, (with_fb, without)


def test_a_wrong_setting_is_refused_by_name():
    with pytest.raises(odc.ConfigError, match="unknown key"):
        odc.engine.compress_args({"push": "int8", "blocks": 32})
    with pytest.raises(odc.ConfigError, match="block"):
        odc.engine.compress_args({"push": "int8", "block": "32"})
    assert odc.engine.compress_args({"push": "fp8"}) == ("fp8", None, 32, True, "cross-node")
    assert odc.engine.compress_args(None) is None


def test_what_deterministic_mode_cannot_keep_is_refused_before_an_engine_is_made():
    check = odc.engine.check_engine_options
    with pytest.raises(odc.ConfigError, match=r"^compress with deterministic=True: .*drop one$"):
        check(compress={"push": "int8"}, cross_node="node", deterministic=True)
    with pytest.raises(odc.ConfigError, match=r"^cross_node='node' with deterministic=True: .*'direct' or 'auto'$"):
        check(compress=None, cross_node="node", deterministic=True)
    for cross_node in (None, "auto", "direct"):
        check(compress=None, cross_node=cross_node, deterministic=True)
    check(compress={"push": "int8"}, cross_node="node", deterministic=False)


@pytest.mark.parametrize(("kw", "words"), [
    ({"deterministic": True}, ("compress", "deterministic")),
    ({"sharding": "hybrid", "compress": {"gather": "fp8"}},
     ("gather=fp8/32 with scope \"cross-node\" under sharding \"hybrid\"", "nothing would be")),
])
def test_compression_is_refused_where_it_cannot_keep_its_promise(kw, words):
    with pytest.raises(odc.ConfigError) as e:
        odc.Engine(torch.distributed.HashStore(), 0, 1, **{"compress": {"push": "int8"}, **kw})
    assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(odc.ConfigError, match="hybrid-zero"):
        odc.Engine(torch.distributed.HashStore(), 0, 1, sharding="hybrid-zero",
                   compress={"gather": "fp8", "scope": "all"})
    with pytest.raises(odc.ConfigError, match="block size 24"):
        odc.Engine(torch.distributed.HashStore(), 0, 1, compress={"push": "int8", "block": 24})


def test_gradscaler_under_compression_skips_the_same_overflowed_steps():
    """fp16 compute with torch's GradScaler (a torchtitan-shaped loop, FSDP2's fp16 MixedPrecisionPolicy) whose
    first scale overflows: the compressed run (fp8 gathers, int8 pushes with feedback, scope "all" on one host)
    skips the same step as the uncompressed run, lowers its scale alike, and trains close to it afterwards. (The
    overflow here lands in rank 0's own part of its shard, which is never pushed; an overflow pushed compressed, and
    the zero residual it must leave, is odc-core's engine_tests::compress::an_overflowed_push_*.)"""
    import _loops as L

    L.quiet()
    plan = [(2, 1), (1, 2), (2, 2), (1, 1), (2, 1), (1, 2), (2, 2)]
    base = {"loop": "titan", "model": "llama", "precision": "fp16", "init_scale": 2.0**20}
    variants = [base, {**base, "compress": {"gather": "fp8", "push": "int8", "scope": "all"}}]
    out = H.all_ok(run_ranks(L.loops_worker, 2, timeout=600, variants=variants, plan=plan, ref=False))
    for rank in out:
        plain, packed = out[rank][0]["odc"], out[rank][1]["odc"]
        print(f"rank {rank}: norms uncompressed {plain['norms']}, compressed {packed['norms']}; scales "
              f"{plain['scale']}, {packed['scale']}")
        skipped = [not math.isfinite(n) for n in plain["norms"]]
        assert [not math.isfinite(n) for n in packed["norms"]] == skipped, (plain["norms"], packed["norms"])
        assert any(skipped) and not all(skipped), skipped  # the loop overflowed, then trained
        assert packed["scale"] == plain["scale"], (packed["scale"], plain["scale"])
        gaps = [abs(a - b) / abs(b) for a, b, s in zip(packed["norms"], plain["norms"], skipped, strict=True)
                if not s]
        assert max(gaps) > 1e-6, gaps  # compressed
        assert max(gaps) < 5e-2, gaps
        assert all(math.isfinite(x) for v in packed["params"].values() for x in torch.tensor(v).flatten().tolist())
