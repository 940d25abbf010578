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


def test_weights_served_in_bf16_moves_half_the_bytes_on_both_arms(tmp_path, capsys):
    """--served-dtype bf16: the trainers serve bf16 and the baseline broadcasts bf16; every read is still checked
    against the broadcast model (rank_fn raises otherwise), the slots hold half the bytes, the limit counts bf16."""
    out = tmp_path / "weights.json"
    code = main(["weights", "--sizes", "4M", "--dim", "256", "--trainers", "2", "--readers", "1", "--repeats", "1",
                 "--steps", "1", "--served-dtype", "bf16", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["where"] == "host, bf16 served" and row["served"] == "bf16", row
    reader = next(r for r in doc["runs"]["host"]["ranks"] if r["role"] == "reader")
    assert row["limit_s"] == pytest.approx(row["bytes"] / 2 / reader["copy_Bps"]), row
    # 2 slots of each rank's half of the model in bf16: half the f32 server's.
    assert 2 * row["bytes"] // 2 // 2 <= row["serve_memory_bytes_per_rank"] < 2 * row["bytes"] // 2, row


def test_weights_refuses_an_unknown_setup(capsys):
    assert main(["weights", "--where", "moon"]) == 2
    assert "--where 'moon': expected host, netns or netns:RATE" in capsys.readouterr().err


@pytest.mark.multinode
def test_weights_over_two_trainer_hosts_reads_both_links(tmp_path, capsys):
    """--trainer-hosts 2: the trainer ranks in two namespaces, each link shaped, the readers in a third (unshaped);
    every reader reaches both trainer ranks over libfabric, and the limit counts both trainer links."""
    from odc.bench.netns import unavailable_reason

    why = unavailable_reason()
    if why is not None:
        import os

        if os.environ.get("ODC_REQUIRE_NETNS") == "1":
            pytest.fail(f"ODC_REQUIRE_NETNS=1, but network namespaces are unavailable: {why}")
        pytest.skip(why)
    out = tmp_path / "weights.json"
    code = main(["weights", "--sizes", "4M", "--dim", "256", "--trainers", "2", "--readers", "1", "--repeats", "1",
                 "--steps", "1", "--where", "netns:1gbit", "--trainer-hosts", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    (row,) = json.loads(out.read_text())["rows"]
    assert row["where"] == "netns:1gbit x2" and row["trainer_hosts"] == 2, row
    assert row["routes"] == ["fabric"], row  # every trainer rank over libfabric
    assert row["limit_s"] == pytest.approx(row["bytes"] * 8 / (2 * 1e9)), row
    assert "over 2 trainer links of 1 Gbit/s each" in row["limit"], row


def test_weights_refuses_trainer_hosts_that_do_not_divide_the_trainers(capsys):
    assert main(["weights", "--trainers", "4", "--trainer-hosts", "3"]) == 2
    assert "--trainer-hosts 3: must divide --trainers 4" in capsys.readouterr().err
