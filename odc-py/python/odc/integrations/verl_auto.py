"""Importing this module runs :func:`odc.integrations.verl.enable` (for verl's import hooks).

verl imports the modules named in a model config's ``external_lib`` (in
every worker that builds that model's engine) and in the environment
variable ``VERL_USE_EXTERNAL_MODULES`` (in every process that imports
verl), before it builds engines::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.model.external_lib=odc.integrations.verl_auto \\
        critic.model.external_lib=odc.integrations.verl_auto

``ODC_VERL_BALANCE`` picks ``balance`` (``lb-mini``, the default, or
``none``), ``ODC_VERL_COST`` the cost model (default ``verl``) and
``ODC_VERL_COMPRESS`` the ``compress=`` setting as JSON (e.g.
``{"gather": "fp8", "push": "int8"}``; default: nothing compressed).
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError
from .verl import enable

_balance = os.environ.get("ODC_VERL_BALANCE", "lb-mini").strip().lower()
_compress = os.environ.get("ODC_VERL_COMPRESS", "").strip()
try:
    _compress_setting = json.loads(_compress) if _compress else None
except ValueError as e:
    raise ConfigError(f"ODC_VERL_COMPRESS={_compress!r}: not JSON ({e}); expected e.g. "
                      '{"gather": "fp8", "push": "int8"}') from None
enable(balance=None if _balance in ("", "none") else _balance, cost=os.environ.get("ODC_VERL_COST", "verl"),
       compress=_compress_setting)
