"""The docs' provenance check (scripts/docs_provenance.py, run by make docs through scripts/docs_hooks.py): a
benchmark JSON without command and commit, from a "+dirty" tree, or with a provenance added after its run is
refused by name with the command that rewrites it; a file shown first must have run below the core count's load
average, and its figure must be the one its run drew; and what odc.bench.report writes passes it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


prov = _script("docs_provenance")

CLEAN = {"command": "odc-bench train --json /tmp/b/x.json --plot out/train-2ranks.png", "commit": "99873d41b018",
         "version": "0.1.0", "date": "2026-12-05T10:00:00+00:00"}


@pytest.fixture(autouse=True)
def _nothing_pending(monkeypatch):
    """The synthetic docs folders announce no file of their own (the real list names the repository's)."""
    monkeypatch.setattr(prov, "PENDING", {})


def _load(values: list[float], cpus: int = 2) -> dict:
    return {"cpus": cpus, "period_s": 5.0, "samples": [[5.0 * i, v] for i, v in enumerate(values)]}


def _docs(tmp_path: Path, files: dict[str, dict]) -> Path:
    docs = tmp_path / "docs"
    for rel, doc in files.items():
        (docs / rel).parent.mkdir(parents=True, exist_ok=True)
        (docs / rel).write_text(json.dumps(doc))
    (docs / "scale").mkdir(parents=True, exist_ok=True)
    for page in prov.FRONT_PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("no figure\n")
    return docs


def test_a_dirty_missing_or_added_afterwards_provenance_is_refused_by_name_with_the_command_that_rewrites_it(
        tmp_path):
    files = {
        "bench/clean.json": {"rows": [], "provenance": CLEAN},
        "bench/dirty.json": {"rows": [], "provenance": {**CLEAN, "commit": "99873d41b018+dirty",
                                                        "command": "scripts/rejoin-bench.py --json /tmp/r.json"}},
        "bench/no-commit.json": {"rows": [], "provenance": {**CLEAN, "commit": None}},
        "bench/none.json": {"rows": []},
        "scale/backfilled.json": {"points": [], "provenance": {
            "command": "FI_X=1 target/release/scale_perf --ranks 256 -J x.json", "commit": "50382c0",
            "date": "2026-11-28", "note": "added with the file"}},
    }
    docs = _docs(tmp_path, files)
    got = {s.rel: s for s in prov.stale({}, docs=docs, root=tmp_path)}
    assert sorted(got) == ["bench/dirty.json", "bench/no-commit.json", "bench/none.json", "scale/backfilled.json"]
    assert got["bench/dirty.json"].reasons == (
        "written from a tree with uncommitted changes (commit 99873d41b018+dirty)",)
    assert got["bench/dirty.json"].rerun == "scripts/rejoin-bench.py --json docs/bench/dirty.json"
    assert got["bench/no-commit.json"].reasons == ("no commit in its provenance",)
    assert got["bench/none.json"].reasons == ("no command and commit in its provenance",)
    assert got["bench/none.json"].rerun is None
    assert "added after the run" in got["scale/backfilled.json"].reasons[0]
    assert got["scale/backfilled.json"].rerun == (
        "FI_X=1 target/release/scale_perf --ranks 256 -J docs/scale/backfilled.json")
    text = prov.report(list(got.values()))
    for rel in got:
        assert f"docs/{rel}:" in text
    assert "rerun (" in text and "scripts/rejoin-bench.py --json docs/bench/dirty.json" in text
    lines = prov.tsv(list(got.values())).splitlines()
    assert [line.split("\t")[0] for line in lines] == sorted(got)


def test_a_file_shown_first_must_have_run_below_the_core_count_and_its_figure_be_its_runs(tmp_path):
    quiet = {**CLEAN, "load": _load([0.4, 1.2, 1.9])}
    files = {
        "bench/train.json": {"rows": [], "provenance": quiet},
        "bench/loaded.json": {"rows": [], "provenance": {**CLEAN, "load": _load([0.5, 2.0, 1.0])}},
        "bench/once.json": {"rows": [], "provenance": {**CLEAN, "load": {"cpus": 2, "period_s": None,
                                                                         "samples": [[0.0, 0.1]]}}},
        "bench/legacy.json": {"rows": [], "load_samples": [[0.0, 1.0], [5.0, 1.5]], "cpus": 2, "provenance": CLEAN},
        "bench/not-shown.json": {"rows": [], "provenance": {**CLEAN, "load": _load([9.0, 9.0])}},
    }
    docs = _docs(tmp_path, files)
    front = {rel: "a row of README.md's measured results" for rel in files if rel != "bench/not-shown.json"}
    got = {s.rel: s.reasons for s in prov.stale(front, docs=docs, root=tmp_path)}
    assert sorted(got) == ["bench/loaded.json", "bench/once.json"]
    assert got["bench/loaded.json"][0].startswith("the load average reached 2.0 on 2 cores during the run")
    assert got["bench/once.json"][0].startswith("no load average sampled during the run")
    # The README's figure: the PNG must name its JSON's run.
    (tmp_path / "README.md").write_text("![train](docs/train-2ranks.png)\n")
    assert prov.front_figures(tmp_path) == {"train-2ranks.png": "README.md"}
    _png(docs / "train-2ranks.png", None)
    got = {s.rel: s.reasons for s in prov.stale(front, docs=docs, root=tmp_path)}
    assert got["bench/train.json"] == ("its figure docs/train-2ranks.png names no run (a plot drawn before plots "
                                       "carried their provenance) — it is shown first (a row of README.md's "
                                       "measured results)",)
    _png(docs / "train-2ranks.png", {**quiet, "date": "2026-12-04T10:00:00+00:00"})
    got = {s.rel: s.reasons for s in prov.stale(front, docs=docs, root=tmp_path)}
    assert "drawn by another run" in got["bench/train.json"][0]
    _png(docs / "train-2ranks.png", quiet)
    assert "bench/train.json" not in {s.rel for s in prov.stale(front, docs=docs, root=tmp_path)}


def _png(path: Path, identity: dict | None) -> None:
    matplotlib = pytest.importorskip("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1])
    meta = {"Software": "test"}
    if identity is not None:
        meta["odc-provenance"] = json.dumps({k: identity[k] for k in ("command", "commit", "version", "date")})
    fig.savefig(path, dpi=20, metadata=meta)
    plt.close(fig)


def test_a_file_a_page_renders_before_any_run_wrote_it_is_listed_with_its_command_and_shown_as_pending(
        tmp_path, monkeypatch):
    docs = _docs(tmp_path, {"bench/clean.json": {"rows": [], "provenance": CLEAN}})
    monkeypatch.setitem(prov.PENDING, "bench/new.json", ("scripts/new-bench.py --json docs/bench/new.json", 60.0))
    got = prov.stale({}, docs=docs, root=tmp_path)
    assert [(s.rel, s.rerun, s.estimate_s) for s in got] == [
        ("bench/new.json", "scripts/new-bench.py --json docs/bench/new.json", 60.0)]
    hooks = _script("docs_hooks")
    monkeypatch.setitem(hooks.prov.PENDING, "bench/new.json", prov.PENDING["bench/new.json"])
    assert "Not measured yet: `scripts/new-bench.py --json docs/bench/new.json`" in hooks.bench(
        "elastic", "bench/new.json", ".", docs)
    with pytest.raises(hooks.DocsError, match="no such file"):  # a file nothing announces is still an error
        hooks.bench("elastic", "bench/other.json", ".", docs)
    (docs / "bench" / "new.json").write_text(json.dumps({"rows": [], "provenance": CLEAN}))
    assert prov.stale({}, docs=docs, root=tmp_path) == []  # written by a clean run: no longer listed


@pytest.mark.parametrize(("command", "want"), [
    ("odc-bench train --json /tmp/b/t.json --plot /tmp/b/train-2ranks.png",
     "odc-bench train --json docs/bench/train.json --plot docs/train-2ranks.png"),
    ("odc-bench train --json=/tmp/t.json --plot=/tmp/p.png",
     "odc-bench train --json=docs/bench/train.json --plot=docs/train-2ranks.png"),
    ("target/release/gather_perf -g 2 -J out.json", "target/release/gather_perf -g 2 -J docs/bench/train.json"),
    ("scripts/x.py --modes 'a b'", None),  # no output flag: nothing to point at the file
])
def test_the_rerun_command_is_the_jsons_own_pointed_at_the_file_and_the_figure_the_docs_show(command, want):
    assert prov.rerun_command("bench/train.json", {"provenance": {**CLEAN, "command": command}}) == want


def test_a_plot_the_docs_do_not_show_goes_to_out():
    doc = {"provenance": {**CLEAN, "command": "odc-bench train --json /tmp/g.json --plot /tmp/b/train-baselines.png"}}
    assert prov.rerun_command("bench/train-baselines-grad.json", doc) == (
        "odc-bench train --json docs/bench/train-baselines-grad.json --plot out/train-baselines.png")


def test_every_figure_in_docs_is_tied_to_its_data_and_the_front_figures_to_one_run():
    assert prov.figure_problems() == []
    hooks = _script("docs_hooks")
    front = hooks.front_files()
    # The README's first row and its figure, and the front page's figure: the first run a newcomer sees. The
    # other rows are refused for dirty or missing provenance like every file, not for load.
    assert set(front) == {"bench/imbalance-8ranks-peak.json", "bench/imbalance-4ranks.json"}
    assert "bench/train.json" not in front and "scale/shm-full.json" not in front
    assert set(prov.front_figures()) == {"imbalance-4ranks.png"}


def test_what_odc_bench_writes_passes_the_check_and_its_plot_names_its_run(tmp_path):
    from odc.bench import report

    report.sample_load(0.05)
    time.sleep(0.2)
    doc = {"bench": "x", "rows": []}
    report.write_json(str(tmp_path / "x.json"), doc)
    written = json.loads((tmp_path / "x.json").read_text())
    p = written["provenance"]
    assert p["command"] and p["commit"] and "T" in p["date"]
    values, cpus = prov.load_samples(written)
    assert cpus is not None and len(values) >= 3, p["load"]  # sampled while it ran, the last as it was written
    times = [t for t, _ in p["load"]["samples"]]
    assert times == sorted(times) and times[-1] >= 0.15
    # Its plot carries the same run: the check ties them.
    matplotlib = pytest.importorskip("matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots(figsize=(1, 1))
    fig.savefig(tmp_path / "x.png", dpi=20, metadata=report.png_metadata())
    plt.close(fig)
    assert prov.figure_reasons(tmp_path / "x.png", written) == []
    dirty = p["commit"].endswith("+dirty")
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", ":/",
                             *report.OUTPUTS], capture_output=True, text=True, timeout=30, check=True).stdout
    assert dirty == bool(status.strip()), (p["commit"], status)


def test_each_odc_bench_run_in_one_process_names_its_own_command():
    from odc.bench import report

    report.set_command(["odc-bench", "primitives", "-g", "2"])
    first = report.provenance()["command"]
    assert report.png_metadata()["odc-provenance"] == json.dumps(report._identity(), sort_keys=True)
    report.set_command(["odc-bench", "imbalance", "--world", "2"])
    assert (first, report.provenance()["command"]) == ("odc-bench primitives -g 2", "odc-bench imbalance --world 2")
