"""Importing the trainer an integration needs: what to install if it is missing, a warning off the checked versions."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

from ..errors import ConfigError


def import_trainer(
    package: str, checked: tuple[str, ...], advice: str, min_torch: str | None = None, extra: str | None = None,
    integration: str | None = None,
) -> tuple[ModuleType, str]:
    """Imports ``package`` (``verl``, ``torchtitan``) for ``odc.integrations.<package>``.

    Returns the module and a phrase naming its version and the checked ones,
    for error messages. Warns (``advice`` says what to compare) when the
    version is not in ``checked``.

    ``extra`` names the ``fsdp-odc`` extra that installs it (default: ``package``), ``integration`` the module
    the messages name (default: ``odc.integrations.<package>``).

    Raises:
        ConfigError: the package is not installed, saying which extra installs it;
            or the running torch is older than ``min_torch`` (major.minor), the
            oldest the checked version of the package imports on.
    """
    integration = integration or f"odc.integrations.{package}"
    if min_torch is not None:
        import torch

        running = str(torch.__version__).split("+", 1)[0]
        if tuple(int(x) for x in running.split(".")[:2]) < tuple(int(x) for x in min_torch.split(".")[:2]):
            raise ConfigError(
                f"{integration}: {package} {', '.join(checked)} needs torch {min_torch} or newer (it imports "
                f"FSDP2 names that torch {min_torch} added); this is torch {running}"
            )
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(
            f"{integration} needs {package} ({e}); install it with `pip install 'fsdp-odc[{extra or package}]'`"
        ) from None
    version = str(getattr(module, "__version__", "unknown"))
    where = f"{package} {version} ({integration} was checked on {', '.join(checked)})"
    if version not in checked:
        warnings.warn(f"{integration}: {where}; {advice}", UserWarning, stacklevel=4)
    return module, where
