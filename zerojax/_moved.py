"""Modules that moved keep working for one release: `zerojax.planner` -> `zerojax.planning.planner`, ...

A shim module calls `forward(__name__, new)` for its module `__getattr__`: importing it warns once
(DeprecationWarning naming the new path), and every name is read from the new module.
"""
from __future__ import annotations

import importlib
import warnings


def forward(old: str, new: str):
    """The `__getattr__` of the shim module `old`, reading names from `new`; warns now."""
    warnings.warn(f"{old} moved to {new}; import it from there ({old} goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)

    def __getattr__(name):
        return getattr(module, name)

    return __getattr__
