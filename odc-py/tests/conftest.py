"""The suite's time per test file (setup, call and teardown of its tests) and the CPU its processes used,
printed at the end of every run, so that where make test spends its minutes and its cores stays visible; and
the fork server's preload of what the selected test modules' ranks import (their ``RANK_PRELOAD``, see
``_dist.preload_for``)."""

from __future__ import annotations

import os
import resource
from collections import defaultdict

import pytest

_seconds: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this pytest process, of the children it reaped (subprocesses, examples,
    ranks forked into network namespaces) and of the tests' fork server with the ranks it reaped (each rank is
    reaped when it exits, before run_ranks returns)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
        except (OSError, ValueError):
            pass
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    before = _cpu_seconds()
    yield
    _cpu[item.nodeid.split("::", 1)[0]] += _cpu_seconds() - before


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what does not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import _dist

    _dist.preload_for({item.module for item in items if getattr(item, "module", None) is not None})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _seconds[path] += report.duration
    _tests[path].add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("time per test file (wall; cpu: the core-seconds of its processes)")
    for path, s in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{s:8.1f} s  cpu {_cpu[path]:6.1f} s  {len(_tests[path]):4d} tests  {path}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} s  cpu {sum(_cpu.values()):6.1f} s  "
                                f"{sum(map(len, _tests.values())):4d} tests  total")
