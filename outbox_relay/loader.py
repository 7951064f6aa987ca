"""The one loader of users' code named on the command line: ``--projections``, ``--sink``, ``--handler``,
``--upcasters``.

It imports from the working directory as uvicorn, gunicorn, celery and ``python -m`` do: a console
script's ``sys.path`` starts with its ``bin/`` directory, not the project's, so ``--sink myapp:sink``
would otherwise fail with "No module named 'myapp'" from the project's own directory.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from .dsn import describe_error
from .errors import ConfigurationError


def working_directory_on_path() -> None:
    """Put the working directory first on ``sys.path`` unless it is there already (as ``""`` or itself)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def import_module(module_name: str, where: str) -> ModuleType:
    """The module a user named (``where`` says where, e.g. ``--sink myapp:sink``), imported from the
    working directory too; ConfigurationError says whether it is missing or failed while importing."""
    if not module_name:
        raise ConfigurationError(f"{where}: no module named (expected MODULE:ATTR)")
    working_directory_on_path()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):  # not one it imports
            raise ConfigurationError(f"{where}: no module named {missing!r} in {os.getcwd()} or on sys.path (is "
                                     "it installed, or run from the project's directory?)") from None
        raise ConfigurationError(f"{where}: importing module {module_name!r} failed: {exc}") from None
    except SystemExit as exc:  # e.g. a module that parses sys.argv when imported: not the relay's exit
        raise ConfigurationError(f"{where}: importing module {module_name!r} failed: it called "
                                 f"sys.exit({exc.code!r})") from None
    except Exception as exc:  # the module itself raised while it was imported
        raise ConfigurationError(f"{where}: importing module {module_name!r} failed: "
                                 f"{describe_error(exc)}") from None
