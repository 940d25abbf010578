"""odc-bench weights at a tiny size on one host: every arm runs, every read is checked against the broadcast model,
and the table's figures come from the processes' own measurements."""

from __future__ import annotations

import json
import statistics

import pytest

from odc.bench import main


def test_weights_runs_every_arm_and_checks_each_read(tmp_path, capsys):
    out = tmp_path / "weights.json"
    code = main(["weights", "--sizes", "4M", "--dim", "256", "--trainers", "2", "--readers", "2", "--repeats", "2",
                 "--steps", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "baseline/odc" in captured.out and "odc/limit" in captured.out
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["where"] == "host" and row["bytes"] == 16 * 256 * 256 * 4 and row["routes"] == ["shm"]
    readers = [r for r in doc["runs"]["host"]["ranks"] if r["role"] == "reader"]
    trainers = [r for r in doc["runs"]["host"]["ranks"] if r["role"] == "trainer"]
    assert len(readers) == 2 and len(trainers) == 2
    for r in readers:
        got = r["sizes"]["4194304"]
        assert len(got["baseline_s"]) == 2 and len(got["odc_s"]) == 2 and r["copy_Bps"] > 0
    # The table's figures are the slowest reader's median and the trainers' medians.
    slowest = [max(r["sizes"]["4194304"]["odc_s"][i] for r in readers) for i in range(2)]
    assert row["odc_s"] == pytest.approx(statistics.median(slowest))
    assert row["speedup"] == pytest.approx(row["baseline_s"] / row["odc_s"])
    assert row["of_limit"] == pytest.approx(row["odc_s"] / row["limit_s"])
    for t in trainers:
        assert len(t["sizes"]["4194304"]["step_alone_s"]) == 2 and t["sizes"]["4194304"]["serve_memory_bytes"] > 0
    # 2 slots of each rank's half of the model, plus headers.
    assert row["serve_memory_bytes_per_rank"] >= 2 * row["bytes"] // 2


def test_weights_refuses_an_unknown_setup(capsys):
    assert main(["weights", "--where", "moon"]) == 2
    assert "--where 'moon': expected host, netns or netns:RATE" in capsys.readouterr().err
