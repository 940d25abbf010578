"""scripts/gpu-run.sh's steps (scripts/gpu-steps.sh), without a GPU: every test that skipped in a step gets a
summary line of its own, so the verdict never reads "every GPU test passed" over a skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_skipped_gpu_test_gets_a_summary_line_and_a_count(tmp_path):
    rust = ("running 2 tests\\n---- gpu_engine_nvshmem_two_processes_exact stdout ----\\n"
            "SKIPPED gpu_engine_nvshmem_two_processes_exact: 1 GPU(s), needs 2\\ntest result: ok. 2 passed\\n")
    pytest_rs = "SKIPPED [1] odc-py/tests/test_device.py:40: needs two GPUs\\n1 passed, 1 skipped\\n"
    script = f"""
        SUMMARY={tmp_path}/summary.txt LOG={tmp_path}/tests.log WORK={tmp_path} STEP_TIMEOUT=30
        start=$(date +%s) failed=0 skipped=0
        . scripts/gpu-steps.sh
        step "engines (gpu_engine)" printf '{rust}'
        step "Python GPU tests" printf '{pytest_rs}'
        step "nothing skipped" true
        step "a failure" false
        echo "skipped=$skipped failed=$failed"
    """
    p = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "skipped=2 failed=1", p.stdout
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert "[gpu-run] skipped engines (gpu_engine): SKIPPED gpu_engine_nvshmem_two_processes_exact: 1 GPU(s), " \
           "needs 2" in summary, summary
    assert any(line.startswith("[gpu-run] skipped Python GPU tests: SKIPPED [1]") and "needs two GPUs" in line
               for line in summary), summary
    assert sum(line.startswith("[gpu-run] ok      ") for line in summary) == 3, summary
    assert any(line.startswith("[gpu-run] FAILED  a failure") for line in summary), summary
    assert "SKIPPED gpu_engine_nvshmem" in (tmp_path / "tests.log").read_text()


def test_the_gpu_runs_verdict_says_every_gpu_test_passed_only_when_none_skipped():
    run = (ROOT / "scripts" / "gpu-run.sh").read_text()
    assert 'if [ "$skipped" -ne 0 ]; then' in run
    assert "every GPU test passed, none skipped" in run
    assert run.count('finish 0 "every GPU test passed') == 1


def test_native_libraries_are_looked_for_in_the_users_site_packages_too(tmp_path, monkeypatch):
    """A GPU machine's torch and NVRTC / NVSHMEM wheels installed with ``pip install --user`` live in the user's
    site-packages: odc's list of folders (which scripts/gpu-run.sh hands the Rust test executables) has it."""
    import os
    import site

    import odc

    user = tmp_path / "user-site"
    user.mkdir()
    monkeypatch.delenv("ODC_SITE_PACKAGES", raising=False)
    monkeypatch.setattr(site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(user))
    odc._site_packages_for_native_libraries()
    assert str(user) in os.environ["ODC_SITE_PACKAGES"].split(os.pathsep)
    monkeypatch.delenv("ODC_SITE_PACKAGES")
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)  # python -s: not looked at
    odc._site_packages_for_native_libraries()
    assert str(user) not in os.environ.get("ODC_SITE_PACKAGES", "").split(os.pathsep)
