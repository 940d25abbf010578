"""Which deadline ODC's waits get, and where it came from.

Under a process group (``init_process_group("odc", timeout=...)``, or
``odc.fsdp.enable`` inside an existing group) ODC's deadline follows the
group's timeout unless ``ODC_TIMEOUT_S`` is set; an explicit ``timeout=``
argument wins over both. :func:`deadline_for` returns the seconds and a
source string that errors quote.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

from .errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "deadline_for"]

DEFAULT_TIMEOUT_S = 300.0
"""ODC's own default deadline in seconds (the Rust engine's), used when nothing else applies."""


def _seconds(value: Any, what: str) -> float:
    try:
        seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be positive seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{what} must be positive seconds, got {value!r}")
    return seconds


def _group_timeout(pg: Any) -> Any:
    """A process group's timeout: a timedelta / number as such, else what the group's options hold."""
    if pg is None or isinstance(pg, (datetime.timedelta, int, float)):
        return pg
    seconds = getattr(pg, "_odc_timeout_s", None)  # ProcessGroupODC
    if seconds is not None:
        return seconds
    for owner in (pg, _cpu_backend(pg)):
        timeout = getattr(getattr(owner, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def _cpu_backend(pg: Any) -> Any:
    try:
        import torch

        return pg._get_backend(torch.device("cpu"))
    except Exception:
        return None


def deadline_for(pg: Any = None, explicit: Any = None) -> tuple[float, str]:
    """ODC's deadline in seconds and where it came from.

    Args:
        pg: the process group ODC runs under (a ``ProcessGroup``), or its timeout
            (``datetime.timedelta`` or seconds), or ``None`` outside any group.
        explicit: a ``timeout=`` the caller passed to ODC itself (seconds or timedelta), or ``None``.

    Returns:
        ``(seconds, source)``, the source one of ``"timeout= argument"``,
        ``"ODC_TIMEOUT_S"``, ``"the process group's timeout"``, ``"ODC's default"``.

    Raises:
        ConfigError: a timeout that is not positive seconds (``ODC_TIMEOUT_S`` included).
    """
    if explicit is not None:
        return _seconds(explicit, "timeout"), "timeout= argument"
    env = os.environ.get("ODC_TIMEOUT_S", "").strip()
    if env:
        return _seconds(env, "ODC_TIMEOUT_S"), "ODC_TIMEOUT_S"
    group = _group_timeout(pg)
    if group is not None:
        return _seconds(group, "the process group's timeout"), "the process group's timeout"
    return DEFAULT_TIMEOUT_S, "ODC's default"

