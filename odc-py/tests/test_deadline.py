"""ODC's deadline under a process group: the group's timeout unless ODC_TIMEOUT_S is set (odc.deadline)."""

from __future__ import annotations

import datetime
import types

import pytest
import torch.distributed as dist

import odc
import odc.backend
from odc.deadline import DEFAULT_TIMEOUT_S, deadline_for


def test_the_group_timeout_applies_unless_odc_timeout_s_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ODC_TIMEOUT_S", raising=False)
    assert deadline_for(datetime.timedelta(seconds=42)) == (42.0, "the process group's timeout")
    assert deadline_for(None) == (DEFAULT_TIMEOUT_S, "ODC's default")
    # A group object: its options' timeout (what torch's gloo groups carry).
    group = types.SimpleNamespace(options=types.SimpleNamespace(_timeout=datetime.timedelta(minutes=2)))
    assert deadline_for(group) == (120.0, "the process group's timeout")
    monkeypatch.setenv("ODC_TIMEOUT_S", "9.5")
    assert deadline_for(datetime.timedelta(seconds=42)) == (9.5, "ODC_TIMEOUT_S")
    assert deadline_for(group) == (9.5, "ODC_TIMEOUT_S")
    # An explicit timeout= wins over both.
    assert deadline_for(group, explicit=3) == (3.0, "timeout= argument")


def test_bad_timeouts_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ODC_TIMEOUT_S", "soon")
    with pytest.raises(odc.ConfigError, match="ODC_TIMEOUT_S"):
        deadline_for(datetime.timedelta(seconds=1))
    monkeypatch.delenv("ODC_TIMEOUT_S")
    with pytest.raises(odc.ConfigError, match="positive"):
        deadline_for(datetime.timedelta(seconds=-1))


@pytest.mark.parametrize("env", [None, "11"])
def test_init_process_group_odc_follows_its_timeout(monkeypatch: pytest.MonkeyPatch, env: str | None) -> None:
    if env is None:
        monkeypatch.delenv("ODC_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("ODC_TIMEOUT_S", env)
    monkeypatch.setenv("ODC_JOB_KEY", f"deadline{env}")
    odc.register()
    dist.init_process_group("odc", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=7))
    try:
        pg = odc.backend.get_process_group(dist.group.WORLD)
        want = (7.0, "the process group's timeout") if env is None else (11.0, "ODC_TIMEOUT_S")
        assert (pg._seconds, pg.deadline_source) == want
        # The engines it makes wait that long.
        assert pg._make("deadline-check").timeout == want[0]
        # And a group made later from it reads the same rule, from the backend or from the group.
        assert deadline_for(pg) == want
        assert deadline_for(dist.group.WORLD) == want
        assert pg.options._timeout == datetime.timedelta(seconds=7) and pg.options.backend == "odc"
    finally:
        dist.destroy_process_group()
