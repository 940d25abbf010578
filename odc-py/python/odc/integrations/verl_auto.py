"""Importing this module runs :func:`odc.integrations.verl.enable` (for verl's import hooks).

verl imports the modules named in a model config's ``external_lib`` (in
every worker that builds that model's engine) and in the environment
variable ``VERL_USE_EXTERNAL_MODULES`` (in every process that imports
verl), before it builds engines::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.model.external_lib=odc.integrations.verl_auto \\
        critic.model.external_lib=odc.integrations.verl_auto

``ODC_VERL_BALANCE`` picks ``balance`` (``lb-mini``, the default, or
``none``) and ``ODC_VERL_COST`` the cost model (default ``verl``).
"""

from __future__ import annotations

import os

from .verl import enable

_balance = os.environ.get("ODC_VERL_BALANCE", "lb-mini").strip().lower()
enable(balance=None if _balance in ("", "none") else _balance, cost=os.environ.get("ODC_VERL_COST", "verl"))
