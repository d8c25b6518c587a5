"""A full disk is one line naming the folder and the bytes, never a half-written tag.

A save that ran out of space printed three tracebacks (262 lines; 29 more on resume). Before a save
writes anything, `check_room` compares the bytes it will write (every leaf's, from its shape and
dtype) with the folder's free space; where the disk fills anyway (another writer), the error inside
orbax or tensorstore becomes one line and the temporary folder of the unfinished tag is removed.
The older tags and `latest` are never touched by a save that fails: orbax writes a tag into a
temporary folder and renames it only when complete.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil

import jax
import numpy as np

from zerojax.checkpoint.errors import CheckpointError

_MARGIN = 1.05          # orbax's metadata and OCDBT's index beside the arrays' bytes
_SLACK = 64 << 20


class DiskFull(CheckpointError):
    """A checkpoint folder without room for the save."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def tree_bytes(tree) -> int:
    """Bytes of every array-like leaf (shape and dtype), wherever it lies."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype"))


def check_room(save_dir: str, tag: str, items: dict, *, extra: int = 0) -> int:
    """DiskFull unless `save_dir`'s disk has room for the checkpoint of `items` plus `extra` bytes
    (the exported weights); returns the bytes needed."""
    need = tree_bytes(items) + extra
    need = int(need * _MARGIN) + _SLACK
    free = shutil.disk_usage(save_dir).free
    if need > free:
        raise DiskFull(f"{save_dir}: not enough disk space for checkpoint {tag!r}: it needs about {_gib(need)}, "
                       f"the disk has {_gib(free)} free; free some space (older tags, --keep N) or save to another "
                       f"folder (nothing was written; the older checkpoints are intact)")
    return need


def _is_full(e: BaseException) -> bool:
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def one_line_when_full(save_dir: str, tag: str):
    """Run a tag's write; where it fails, remove the tag's temporary folder (what it wrote so far), and
    where it failed for want of space, raise DiskFull in one line."""
    try:
        yield
    except Exception as e:
        from zerojax.checkpoint import files

        for path in files.interrupted_saves(save_dir):
            if os.path.basename(path).startswith(f"{tag}.") and jax.process_index() == 0:
                shutil.rmtree(path, ignore_errors=True)
        if not _is_full(e):
            raise
        raise DiskFull(f"{save_dir}: the disk filled while writing checkpoint {tag!r} ({type(e).__name__}: "
                       f"no space left on device); free some space or save to another folder (the unfinished "
                       f"tag was removed; the older checkpoints are intact)") from None


__all__ = ["DiskFull", "check_room", "one_line_when_full", "tree_bytes"]
