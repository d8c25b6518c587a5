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


def renamed(old_module: str, names: dict):
    """The `__getattr__` of module `old_module` for names that moved out of it: `names` maps each to
    its new "module.name"; reading one warns (DeprecationWarning naming the new path) and returns it."""
    def __getattr__(name):
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(f"{old_module}.{name} moved to {new}; import it from there ({old_module}.{name} goes in the "
                      "next release)", DeprecationWarning, stacklevel=2)
        module, _, attr = new.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    return __getattr__
