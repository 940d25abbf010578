"""The rejoin layout a joining rank reads from the store (``odc._rejoin.compare_layouts``): malformed bytes are
``odc.MalformedError`` naming the source rank and the field, a well-formed but different layout is
``odc.ConfigError``; and the fuzz target's committed inputs (``fuzz/corpus/rejoin_layout``,
``fuzz/regressions/rejoin_layout``) replayed through its properties."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import odc
from odc import _rejoin

ROOT = Path(__file__).resolve().parents[2]
MINE = [["torch.float32", [2, 3]], ["torch.int64", []]]


def _malformed(raw: object, field: str, source: int = 5) -> None:
    with pytest.raises(odc.MalformedError) as e:
        _rejoin.compare_layouts(MINE, raw, source)  # type: ignore[arg-type]
    msg = str(e.value)
    assert msg.startswith(f"rank {source} wrote a malformed rejoin state layout: {field} is "), msg
    assert not isinstance(e.value, odc.ConfigError)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"\xff\xfe", "layout"),  # not UTF-8
        (b"", "layout"),
        (b"[", "layout"),  # not JSON
        (b'[["torch.float32", [2, 3]]', "layout"),
        (b"[" * 100_000 + b"]" * 100_000, "layout"),  # nested past the parser's recursion limit
        (b'[["torch.float32", [' + b"9" * 5000 + b"]]]", "layout"),  # past Python's integer digit limit
        (b'{"state": []}', "layout"),  # not a list
        (b'"torch.float32"', "layout"),
        (b"null", "layout"),
        (b'[["torch.float32", [2, 3]], 7]', "state[1]"),  # not a pair
        (b'[["torch.float32"]]', "state[0]"),
        (b'[["torch.float32", [2, 3], "extra"]]', "state[0]"),
        (b"[[1, [2, 3]]]", "state[0].dtype"),  # wrong types
        (b'[["float32", [2, 3]]]', "state[0].dtype"),
        (b'[["torch.", [2, 3]]]', "state[0].dtype"),
        (b'[["torch.float32; rm", [2, 3]]]', "state[0].dtype"),
        (b'[["torch.float32", "2x3"]]', "state[0].shape"),
        (b'[["torch.float32", {"0": 2}]]', "state[0].shape"),
        (b'[["torch.float32", [' + b"1," * 64 + b"1]]]", "state[0].shape"),  # 65 dimensions
        (b'[["torch.float32", [2, 3.0]]]', "state[0].shape[1]"),
        (b'[["torch.float32", [true, 3]]]', "state[0].shape[0]"),
        (b'[["torch.float32", [2, -3]]]', "state[0].shape[1]"),
        (b'[["torch.float32", [2, NaN]]]', "state[0].shape[1]"),
        (b'[["torch.float32", [Infinity]]]', "state[0].shape[0]"),
        (b'[["torch.float32", [2, 3]], ["torch.int64", [9223372036854775808]]]', "state[1].shape[0]"),  # huge
        (b'[["torch.float32", [2, 3]], ["torch.int64", [1e400]]]', "state[1].shape[0]"),
        (b'[["torch.float32", [2, 3]], ["torch.int64", [null]]]', "state[1].shape[0]"),
    ],
)
def test_malformed_layouts_are_refused_naming_the_field_and_the_rank(raw: bytes, field: str) -> None:
    _malformed(raw, field)


def test_a_missing_layout_is_refused_naming_the_rank() -> None:
    _malformed(None, "layout", source=3)
    _malformed("[]", "layout", source=3)  # text, not the store's bytes


def test_a_malformed_entry_past_a_differing_one_is_still_malformed() -> None:
    # The whole layout is read before it is compared: a peer's garbage is never reported as a layout mismatch.
    _malformed(b'[["torch.float16", [2, 3]], ["torch.int64", [-1]]]', "state[1].shape[0]")


@pytest.mark.parametrize(
    ("theirs", "names"),
    [
        ([["torch.float16", [2, 3]], ["torch.int64", []]], "state[0] is torch.float32 (2, 3) here but torch.float16"),
        (
            [["torch.float32", [3, 2]], ["torch.int64", []]],
            "state[0] is torch.float32 (2, 3) here but torch.float32 (3, 2)",
        ),
        ([["torch.float32", [2, 3]], ["torch.int64", [9223372036854775807]]], "state[1] is torch.int64 ()"),
        ([["torch.float32", [2, 3]]], "2 state tensors here, 1 on rank 5"),
        ([["torch.float32", [2, 3]], ["torch.int64", []], ["torch.int64", []]], "2 state tensors here, 3 on rank 5"),
    ],
)
def test_a_well_formed_different_layout_is_a_config_error(theirs: list, names: str) -> None:
    with pytest.raises(odc.ConfigError) as e:
        _rejoin.compare_layouts(MINE, json.dumps(theirs).encode(), 5)
    assert names in str(e.value) and "rank 5" in str(e.value), str(e.value)
    assert not isinstance(e.value, odc.MalformedError)


def test_an_equal_layout_passes() -> None:
    _rejoin.compare_layouts(MINE, json.dumps(MINE).encode(), 5)
    _rejoin.compare_layouts(MINE, bytearray(b'[["torch.float32",[2,3]],["torch.int64",[]]]'), 5)
    _rejoin.compare_layouts([], b"[]", 0)


def _committed() -> list[Path]:
    files = []
    for folder in ("corpus", "regressions"):
        d = ROOT / "fuzz" / folder / "rejoin_layout"
        if d.is_dir():
            files += sorted(p for p in d.iterdir() if p.is_file())
    return files


def test_the_fuzz_targets_committed_inputs_hold_its_properties() -> None:
    sys.path.insert(0, str(ROOT / "fuzz" / "python"))
    try:
        import rejoin_layout  # the fuzz target's body (fuzz/python/rejoin_layout.py)
    finally:
        sys.path.pop(0)
    files = _committed()
    assert len(files) >= 5, "the rejoin_layout seed corpus is missing"
    for f in files:
        rejoin_layout.check(f.read_bytes())
