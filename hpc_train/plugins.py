"""User plug-ins named by import path: ``package.module:function``.

Models, datasets and whole training functions can come from the user's own code. A path that
does not resolve is a usage error naming the config field, raised before any worker starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from hpc_train.errors import UsageError


def _split(path: str, field: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"config: {field} must be an import path 'package.module:function', got {path!r}")
    return module, attr


def resolve(path: str, field: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the callable."""
    module, attr = _split(path, field)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the working directory's packages are importable
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UsageError(f"config: {field}={path!r}: module '{e.name}' not found "
                         f"(is it installed, or on PYTHONPATH?)") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise UsageError(f"config: {field}={path!r}: module '{module}' has no callable '{attr}'")
    return fn


def check_findable(path: str, field: str) -> None:
    """Check the module exists without importing it (for commands that must stay light)."""
    module, _ = _split(path, field)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        found = False
    if not found:
        raise UsageError(f"config: {field}={path!r}: module '{module}' not found (is it installed, or on PYTHONPATH?)")
