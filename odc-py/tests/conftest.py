"""The suite's time per test file (setup, call and teardown of its tests), printed at the end of every run, so
that where make test spends its minutes stays visible; and the fork server's preload of what the selected test
modules' ranks import (their ``RANK_PRELOAD``, see ``_dist.preload_for``)."""

from __future__ import annotations

from collections import defaultdict

import pytest

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)


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
    terminalreporter.section("time per test file")
    for path, s in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{s:8.1f} s  {len(_tests[path]):4d} tests  {path}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} s  {sum(map(len, _tests.values())):4d} tests  total")
