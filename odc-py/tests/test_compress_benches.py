"""The compressed modes of scripts/cross-node-bench.py and scripts/hybrid-bench.py: their names, their byte formulas,
and a run of each between two network namespaces that moves fewer bytes than the uncompressed mode of the same run.

The runs are skipped where namespaces cannot be made (not root, no iproute2; failed instead under
``ODC_REQUIRE_NETNS=1``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _netns import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["cross-node-bench", "hybrid-bench"])
def test_compressed_mode_names(name):
    mod = _script(name)
    kind = "node" if name == "cross-node-bench" else "full"
    assert mod.compress_of(f"odc-{kind}", 32) is None
    assert mod.compress_of(f"odc-{kind}-int8", 32) == {"push": "int8", "gather": None, "block": 32, "feedback": True}
    assert mod.compress_of(f"odc-{kind}-fp8g", 64) == {"push": None, "gather": "fp8", "block": 64, "feedback": True}
    assert mod.compress_of(f"odc-{kind}-fp8g-int8", 32) == {"push": "int8", "gather": "fp8", "block": 32,
                                                           "feedback": True}
    for bad in (f"odc-{kind}-int4", f"odc-{kind}-int4g", f"odc-{kind}-int8-fp8", f"odc-{kind}-fp8g-int8-x",
                "odc-x-int8", "gloo-int8"):
        with pytest.raises(ValueError, match=bad):
            mod.compress_of(bad, 32)


def test_hybrid_modes_compress_what_crosses_nodes():
    mod = _script("hybrid-bench")
    int8 = {"push": "int8", "gather": None, "block": 32, "feedback": True}
    assert mod.split_mode("odc-hybrid-int8", 32) == ("odc-hybrid", int8)
    assert mod.split_mode("odc-hybrid-zero-int8", 32) == ("odc-hybrid-zero", int8)
    assert mod.split_mode("odc-hybrid-zero", 32) == ("odc-hybrid-zero", None)
    assert mod.split_mode("odc-hybrid-zero-fp8g-int8", 32) == ("odc-hybrid-zero", {**int8, "gather": "fp8"})
    # No gather crosses nodes under hybrid sharding: a gather format there names no mode.
    for bad in ("odc-hybrid-fp8g", "odc-hybrid-fp8g-int8", "odc-hybrid-elastic-int8", "odc-hybrid-zero-int4"):
        with pytest.raises(ValueError, match=bad):
            mod.split_mode(bad, 32)
    res = {"params": 1 << 20, "n": 2, "g": 4, "buckets": 5, "micros": 1}
    f32, zero = mod.formula("odc-hybrid", res, 1), mod.formula("odc-hybrid-zero", res, 1)
    assert mod.formula("odc-hybrid-int8", res, 1) == pytest.approx(f32 * 36 / 128, rel=1e-12)
    # hybrid-zero: its piece's sums at int8, the updated parameter pieces f32 or fp8.
    assert mod.formula("odc-hybrid-zero-int8", res, 1) == pytest.approx(zero / 2 * (1 + 36 / 128), rel=1e-12)
    assert mod.formula("odc-hybrid-zero-fp8g-int8", res, 1) == pytest.approx(zero * 36 / 128, rel=1e-12)


def test_cross_node_formula_counts_scales_and_headers():
    mod = _script("cross-node-bench")
    args = argparse.Namespace(buckets=8, numel=1 << 20, world=8, micros=2)
    n, g = 2, 4
    f32 = mod.formulas(args, n, g)["node"]
    slot = 2 << 20
    # int8 or fp8 with blocks of 32: 1 byte an element and a 4-byte scale per 32 elements, 36/128 of f32.
    both = mod.compressed_formula(args, n, g, mod.compress_of("odc-node-fp8g-int8", 32), slot)
    # Pushes into a node: (N - 1) G owners' shards per bucket, each one chunk (a 2 MiB slot holds a shard's 36 KiB
    # blocks): a 64-byte header each.
    headers = (n - 1) * g * args.buckets * 64
    assert both == pytest.approx(f32 * 36 / 128 + headers, rel=1e-12)
    assert both / f32 < 0.30
    push = mod.compressed_formula(args, n, g, mod.compress_of("odc-node-int8", 32), slot)
    assert push == pytest.approx(f32 / 2 + f32 / 2 * 36 / 128 + headers, rel=1e-12)
    bf16 = mod.compressed_formula(args, n, g, mod.compress_of("odc-node-bf16g-bf16", 32), slot)
    assert bf16 == pytest.approx(f32 / 2 + headers, rel=1e-12)
    # One rank per node resolves the node rules to direct pushes: every rank's own, every microbatch.
    one = mod.compressed_formula(args, 2, 1, mod.compress_of("odc-node-int8", 32), slot, "direct")
    node = mod.compressed_formula(args, 2, 1, mod.compress_of("odc-node-int8", 32), slot, "node")
    gathers = mod.formulas(args, 2, 1)["node"] / 2  # f32 gathers, once per node
    assert one - gathers == pytest.approx(args.micros * (node - gathers), rel=1e-12)
    # A small slot splits a shard's push into chunks of whole blocks, a header each.
    small = mod.compressed_formula(args, n, g, mod.compress_of("odc-node-int8", 32), 36 * 1024)
    shard = args.numel // args.world
    assert small - push == pytest.approx((n - 1) * g * args.buckets * 64 * (-(-shard // (32 * 1024)) - 1))


def _netns_or_skip() -> None:
    from odc.bench.netns import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        skip_or_fail(f"the cross-node benchmarks need network namespaces: {why}")


def _run(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False)


@pytest.mark.multinode
def test_cross_node_bench_compressed_modes_move_fewer_bytes(tmp_path):
    _netns_or_skip()
    out = tmp_path / "c.json"
    p = _run("cross-node-bench.py", "--netns", "2", "--world", "4", "--rate", "", "--buckets", "2", "--bucket-mb", "1",
             "--minibatches", "2", "--rounds", "1", "--modes", "odc-node,odc-node-int8,odc-node-fp8g-int8",
             "-J", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    rows = {r["mode"]: r for r in doc["rows"]}
    assert all(r["wrong"] == 0 for r in rows.values())
    plain, packed = (sum(rows[m]["rx_per_node"]) for m in ("odc-node", "odc-node-int8"))
    # Half the bytes (the pushes) at 36/128: 0.64 of the uncompressed bytes, TCP's own on top.
    assert packed < 0.75 * plain, (packed, plain)
    assert rows["odc-node-int8"]["compress"]["push"] == "int8"
    ratio = packed / len(rows["odc-node-int8"]["rx_per_node"]) / rows["odc-node-int8"]["formula"]
    assert 0.85 < ratio < 1.15, ratio
    # fp8 gathers and int8 pushes: both halves at 36/128 (0.28). At these sizes (2 MiB, 2 minibatches) the
    # counters read at barriers may miss or add some of a minibatch's bytes: the bounds leave room for that.
    both = sum(rows["odc-node-fp8g-int8"]["rx_per_node"])
    assert both < 0.35 * plain, (both, plain)
    ratio = both / len(rows["odc-node-fp8g-int8"]["rx_per_node"]) / rows["odc-node-fp8g-int8"]["formula"]
    assert 0.85 < ratio < 1.15, ratio
    assert "odc-node-int8" in p.stdout and "/ its own formula" in p.stdout
    # A name no mode has is refused by name.
    bad = _run("cross-node-bench.py", "--modes", "odc-node-int4", timeout=60)
    assert bad.returncode == 2 and "unknown mode 'odc-node-int4'" in bad.stderr, bad.stderr


@pytest.mark.multinode
def test_hybrid_bench_int8_pushes_move_fewer_bytes(tmp_path):
    pytest.importorskip("transformers")
    _netns_or_skip()
    out = tmp_path / "h.json"
    p = _run("hybrid-bench.py", "--netns", "2", "-g", "4", "--minibatches", "1", "--micros", "1", "--seq", "64",
             "--hidden", "64", "--layers", "2", "--modes", "odc-full,odc-full-int8,odc-hybrid,odc-hybrid-int8",
             "--json", str(out), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    rows = {r[0]: r for r in doc["rows"]}
    plain, packed = rows["odc-full"][2], rows["odc-full-int8"][2]
    assert packed < 0.8 * plain, (packed, plain)
    assert rows["odc-full-int8"][3] < rows["odc-full"][3]  # the formula counts the narrower pushes
    # Hybrid: the cross-node sum, all that crosses, at int8 (36/128 of f32 with its scales), TCP's own on top.
    plain, packed = rows["odc-hybrid"][2], rows["odc-hybrid-int8"][2]
    assert packed < 0.4 * plain, (packed, plain)
    assert 0.85 < packed / rows["odc-hybrid-int8"][3] < 1.3, (packed, rows["odc-hybrid-int8"][3])
    assert [m for m, _, _ in doc["loads"]] == ["odc-full", "odc-full-int8", "odc-hybrid", "odc-hybrid-int8"]
