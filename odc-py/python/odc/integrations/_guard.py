"""Importing the trainer an integration needs: what to install if it is missing, a warning off the checked versions."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from ..errors import ConfigError


def import_trainer(package: str, checked: tuple[str, ...], advice: str) -> tuple[ModuleType, str]:
    """Imports ``package`` (``verl``, ``torchtitan``) for ``odc.integrations.<package>``.

    Returns the module and a phrase naming its version and the checked ones,
    for error messages. Warns (``advice`` says what to compare) when the
    version is not in ``checked``.

    Raises:
        ConfigError: the package is not installed, saying which extra installs it.
    """
    integration = f"odc.integrations.{package}"
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(
            f"{integration} needs {package} ({e}); install it with `pip install 'odc[{package}]'`"
        ) from None
    version = str(getattr(module, "__version__", "unknown"))
    where = f"{package} {version} ({integration} was checked on {', '.join(checked)})"
    if version not in checked:
        warnings.warn(f"{integration}: {where}; {advice}", UserWarning, stacklevel=4)
    return module, where
