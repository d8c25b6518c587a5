"""One owner per checkpoint folder: a lock file naming the run that holds it.

Two trainers on one `--save` folder both ran to the end and both said "checkpoint saved" (every tag
then held the second run's weights), and a trainer started during another's save deleted that save
as "interrupted". The owner holds an exclusive `fcntl.flock` on `<folder>/.zerojax.lock` for as long
as it runs; the file's text (pid, host, start time, command) is only for the message a second run
gets. The kernel drops the flock when its process dies, however it dies (kill -9 too), so a lock
left by a dead run is stale by construction: the next run takes it over and says so. (flock needs
a file system that supports it: local disks do, and NFS v4 does.)

Re-entrant within a process: the trainer holds its folder for the whole run and the engine's
save takes the same folder again around each write. Only process 0 of a multi-process run locks:
the other processes write their shards under its ownership.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time

from zerojax.checkpoint.errors import CheckpointError

LOCK_FILE = ".zerojax.lock"

_held: dict[str, list] = {}  # real folder path -> [fd, holds]
_guard = threading.Lock()


class FolderInUse(CheckpointError):
    """Another live run holds the checkpoint folder."""


def _owner_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]})


def _describe(text: str) -> str:
    try:
        o = json.loads(text)
        return f"pid {o['pid']} on {o['host']}, since {o['started']}: {o['command']}"
    except (ValueError, KeyError, TypeError):
        return "a run whose lock file is unreadable"


def _open_locked(path: str) -> tuple[int, str | None]:
    """(fd holding the flock on `path`, the previous owner's text if the file was left by a dead
    run). Retries where the file was removed between open and flock (its owner released it)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise FolderInUse(
                    f"{os.path.dirname(path)} is in use by another run ({_describe(text)}); wait for it to end, "
                    f"or give this run another checkpoint folder") from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            stale = os.pread(fd, 4096, 0).decode(errors="replace") or None
            return fd, stale
        os.close(fd)  # the owner removed the file as we opened it: lock the new one


def acquire(folder) -> str | None:
    """Take (or take again, in this process) the lock of `folder`, creating the folder. Returns a
    note where a dead run's lock was taken over, else None. FolderInUse if a live run holds it."""
    import jax

    if jax.process_index() != 0:
        return None
    os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return None
        fd, stale = _open_locked(os.path.join(key, LOCK_FILE))
        os.ftruncate(fd, 0)
        os.pwrite(fd, _owner_text().encode(), 0)
        _held[key] = [fd, 1]
    return None if stale is None else f"took over the lock of {folder} left by a run that ended ({_describe(stale)})"


def release(folder) -> None:
    """Give back one hold of `folder`'s lock; the last removes the lock file."""
    key = os.path.realpath(folder)
    with _guard:
        if key not in _held:
            return
        _held[key][1] -= 1
        if _held[key][1]:
            return
        fd, _ = _held.pop(key)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(key, LOCK_FILE))  # before the unlock: a waiter then locks a new file
        os.close(fd)


@contextlib.contextmanager
def holding(folder):
    """`with holding(folder):` the folder's lock for the block."""
    acquire(folder)
    try:
        yield
    finally:
        release(folder)


__all__ = ["LOCK_FILE", "FolderInUse", "acquire", "release", "holding"]
