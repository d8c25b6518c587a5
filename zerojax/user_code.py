"""A user's own code named on the command line as "module:name" (a reward function, a training
method): the module looked for in the working folder first -- as `python -m` would, and as a user of
the `zerojax` command, which does not, expects -- then on sys.path. Imports nothing of zerojax."""
from __future__ import annotations

import importlib
import os
import sys


def is_spec(text) -> bool:
    """Whether `text` reads as "module:name" (a module path, a colon, a name; no path separators, so
    that a folder or a Windows drive is not taken for one)."""
    if not isinstance(text, str) or text.count(":") != 1 or os.sep in text or "/" in text:
        return False
    module, name = text.split(":")
    return all(part.isidentifier() for part in module.split(".")) and name.isidentifier()


def import_object(spec: str, what: str, fix: str):
    """The object "module:name" names; else ValueError in one line: `what` (e.g. "reward 'x:y'"),
    the reason, and `fix` (what to give instead)."""
    module, _, name = spec.partition(":")
    here = os.getcwd()
    sys.path.insert(0, here)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {name!r} from module {module!r} ({e}); {fix}") from None
    finally:
        sys.path.remove(here)  # the first occurrence: the one put there


__all__ = ["is_spec", "import_object"]
