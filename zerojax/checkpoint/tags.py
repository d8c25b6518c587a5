"""A checkpoint tag is a name, never a path: one rule for save, load and export.

A tag names one folder directly inside the checkpoint folder. Used as a path, it destroyed data:
orbax's save overwrites its target with force, so `tag="."` or `tag=""` (the folder itself)
wiped every older checkpoint, and `tag="../victim"` deleted a folder outside it. Names that
collide with the folder's own files (`latest`, the lock, orbax's temporary folders, hidden files)
are refused too.
"""
from __future__ import annotations

import re

from zerojax.checkpoint.errors import CheckpointError
from zerojax.checkpoint.lock import LOCK_FILE

LATEST = "latest"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,199}")
_RESERVED = {LATEST, LOCK_FILE, "critic"}  # critic: PPO's critic checkpoints beside the actor's tags
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax writes a tag into <tag><TMP_MARK>..., then renames it
RULE = ("a tag is a name of letters, digits and _ . + = - (up to 200, not starting with '.' or '-', "
        "not 'latest' or 'critic'), e.g. global_step10 or epoch-2")


class TagError(CheckpointError, ValueError):
    """A checkpoint tag that is not a plain name (a ValueError too: it is the caller's argument)."""


def check_tag(tag) -> str:
    """`tag` as the folder name it will be, or TagError naming it and the rule."""
    if not isinstance(tag, str) or isinstance(tag, bool):
        if isinstance(tag, int):  # DeepSpeed's examples pass step numbers
            tag = str(tag)
        else:
            raise TagError(f"checkpoint tag {tag!r}: {RULE}")
    if not _NAME.fullmatch(tag) or tag in _RESERVED or TMP_MARK in tag:
        raise TagError(f"checkpoint tag {tag!r} is not a plain name: {RULE}")
    return tag


__all__ = ["TagError", "check_tag", "RULE", "LATEST", "TMP_MARK"]
