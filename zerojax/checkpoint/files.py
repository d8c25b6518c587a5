"""Housekeeping of a checkpoint folder: leftovers of an interrupted save, and pruning old tags.

The folder has DeepSpeed's layout (zerojax.checkpoint.state): one directory per tag, a `latest` file
naming the newest. Orbax writes each tag into `<tag>.orbax-checkpoint-tmp...` and renames it on
finalize, so a save killed mid-way leaves that temporary folder behind (the previous checkpoint
and `latest` stay intact). Which folders are temporary, and which finalized, is orbax's own
judgement (`orbax.checkpoint.utils.tmp_checkpoints` / `is_checkpoint_finalized`, what its
CheckpointManager uses for `cleanup_tmp_directories` and `max_to_keep`); we use those because
our tag/`latest` layout is not a CheckpointManager's step folders.

Only process 0 deletes (every process sees the same folder); callers on several processes
call these after the save's barrier.
"""
from __future__ import annotations

import os
import shutil

from zerojax.checkpoint.tags import LATEST

_LATEST_TMP_PREFIX = f".{LATEST}.tmp"  # zerojax.checkpoint.state writes `latest` through this, then renames


def _is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def interrupted_saves(save_dir) -> list[str]:
    """Paths that an interrupted save left in `save_dir`: orbax's temporary checkpoint folders
    and a half-written `latest`. Never a finalized checkpoint."""
    import orbax.checkpoint as ocp

    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        return []
    found = [os.fspath(t.get()) for t in ocp.utils.tmp_checkpoints(save_dir)]
    found += [os.path.join(save_dir, n) for n in os.listdir(save_dir) if n.startswith(_LATEST_TMP_PREFIX)]
    return sorted(found)


def remove_interrupted_saves(save_dir) -> list[str]:
    """Delete what `interrupted_saves` finds (process 0 only); returns the paths.

    Call at start-up, before this run saves: a temporary folder is never one being written then.
    """
    paths = interrupted_saves(save_dir)
    if _is_primary():
        for path in paths:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
    return paths


def latest_tag(save_dir) -> str | None:
    """The tag `latest` names, or None when there is no `latest`."""
    path = os.path.join(os.fspath(save_dir), LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def finalized_tags(save_dir) -> list[str]:
    """Finalized checkpoint folders in `save_dir`, oldest first (by modification time)."""
    import orbax.checkpoint as ocp

    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        return []
    tags = [n for n in os.listdir(save_dir)
            if os.path.isdir(os.path.join(save_dir, n, "meta"))
            and ocp.utils.is_checkpoint_finalized(os.path.join(save_dir, n))]
    return sorted(tags, key=lambda n: os.path.getmtime(os.path.join(save_dir, n)))


def check_keep(keep) -> None:
    """Refuse a keep= that prune would not honour (before anything is saved)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: the number of checkpoints to keep must be an int >= 1 "
                         f"(1 keeps only the newest); pass keep=None to keep every checkpoint")


def prune(save_dir, keep: int) -> list[str]:
    """Keep the `keep` newest finalized tags (Hugging Face's save_total_limit, orbax's
    max_to_keep), delete the older ones (process 0 only) and return their paths. The tag
    `latest` names is never deleted, whatever its age."""
    check_keep(keep)
    save_dir = os.fspath(save_dir)
    tags = finalized_tags(save_dir)
    latest = latest_tag(save_dir)
    newest = set(tags[-keep:])
    doomed = [t for t in tags if t not in newest and t != latest]
    if _is_primary():
        for tag in doomed:
            shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    return [os.path.join(save_dir, t) for t in doomed]
