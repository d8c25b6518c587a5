"""A checksum of every file of a checkpoint, written when it is saved and verified when it is loaded.

Orbax's reads catch a file that is cut short or unparsable, not a flipped bit: a bit flipped in the
optimizer state loaded silently. `write` records a SHA-256 of each file of a finalized tag in
`<tag>/checksums.json`, before `latest` names the tag; `verify` recomputes them before a restore
reads anything. Files are hashed on a pool of threads (hashlib releases the GIL on large buffers),
so the cost is about one read of the checkpoint at the disk's rate. A tag saved before checksums
existed has no such file and loads as before.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

from zerojax.checkpoint.errors import CheckpointError

FILE = "checksums.json"
_BLOCK = 1 << 20


def _digest(path: str) -> str:
    h, buf = hashlib.sha256(), bytearray(_BLOCK)  # one reused buffer a thread: a few MiB of host memory in all
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(tag_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(tag_dir):
        out += [os.path.relpath(os.path.join(root, n), tag_dir) for n in names]
    return sorted(f for f in out if f != FILE)


def _digests(tag_dir: str, names) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda n: _digest(os.path.join(tag_dir, n)), names), strict=True))


def write(tag_dir: str) -> None:
    """Record the SHA-256 of every file under `tag_dir` (a finalized tag) in its checksums.json."""
    sums = _digests(tag_dir, _files(tag_dir))
    tmp = os.path.join(tag_dir, f".{FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "sha256", "files": sums}, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(tag_dir, FILE))


def verify(tag_dir: str, others: list[str]) -> bool:
    """Check `tag_dir`'s files against its checksums.json; CheckpointError naming the first file that
    differs or is missing (and `others`, the folder's other tags, to load instead). False where the
    tag has no checksums (saved before they were written), True where all matched."""
    path = os.path.join(tag_dir, FILE)
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            want = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable checksum record ({e}); load another tag "
                              f"({others or 'none other found'})") from None
    missing = [n for n in want if not os.path.isfile(os.path.join(tag_dir, n))]
    got = _digests(tag_dir, [n for n in want if n not in missing])
    bad = missing + [n for n, h in got.items() if h != want[n]]
    if bad:
        what = "is missing" if bad[0] in missing else "differs from its checksum (corrupt on disk)"
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{os.path.join(tag_dir, bad[0])} {what}{more}; load another tag "
                              f"({others or 'none other found'}) with load_checkpoint(dir, tag=...) or --tag")
    return True


__all__ = ["FILE", "write", "verify"]
