"""The NVMe tier (DeepSpeed's ZeRO-Infinity `device: "nvme"`): the layers' fp32 master and optimizer
moments in swap files, streamed a layer group at a time through the update.

Where it sits. With host offload the layers' state is one [L, ...] chunk in pinned host memory,
updated in place by a `fori_loop` over K layer groups (`offload.update.streamed_update`). With NVMe that chunk's
stacked leaves live in files instead (the engine's state keeps `None` there, and the chunk's scalar
counters); each loop iteration calls `io_callback(read, g)` for group g's leaves, updates them on the
device and calls `io_callback(write, g, ...)`. The step stays one jitted program: file I/O cannot
run inside XLA, but a host callback can, at the point of the loop where the data is needed, and
host memory then holds only the groups in flight, never the whole state (a "spill and stream
around jit" design would split the step into K + 1 programs and hold the gradients in between).

Pipelining (DeepSpeed's `PipelinedOptimizerSwapper`): `read(g)` returns group g (already read if
`pipeline_read`) and starts reading g + 1 on the I/O threads, so that read overlaps g's update on
the device; `write(g)` copies g's new values into its own buffer, starts writing them and returns
(`pipeline_write`), so the write overlaps g + 1's update. A read of a group waits for that group's
pending write. `buffer_count` bounds the groups held: one read ahead, the rest written back.

I/O path: `os.preadv` / `os.pwritev` on a thread pool of `aio.queue_depth × aio.intra_op_parallelism`
threads (capped), each request at most `aio.block_size`-aligned pieces of a group's leaf. Both
release the GIL. benchmarks/nvme_io.py measures it against tensorstore (README text in the report).
The files are opened with O_DIRECT where the filesystem allows it (DeepSpeed's aio does the same):
the state moves between the swapper's buffers and the disk without the page cache, which would
otherwise compete with the training process for the host memory the tier exists to spare and
throttle its writes once dirty pages pile up. O_DIRECT needs 4 KiB-aligned buffers, offsets and
lengths: the swapper's own buffers are allocated aligned (`aligned_empty`); any other piece (a
short tail, a caller's array) goes through an aligned bounce buffer. Where O_DIRECT is refused
(tmpfs, some network filesystems) the files are opened buffered.

Files: `<nvme_path>/zerojax-<run>/rank<p>/leaf<i>.swap`, one per stacked leaf (master, then each
optimizer moment), group g at byte offset g × (the group's bytes rounded up to block_size). They are
scratch: created at start, removed by `close()` (engine close / atexit), never a checkpoint (a
checkpoint stores the layout-free state, streamed out of and back into them a group of one leaf at a
time: `read_leaf` / `write_leaf_groups`, zerojax/checkpoint/stream.py).
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import dataclasses
import math
import os
import shutil
import threading
import time
import uuid
import warnings
import weakref

import numpy as np

# filesystems whose "disk" is host memory: swapping there moves the state back into RAM
RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
MAX_THREADS = 64
SWAP_PREFIX = "zerojax-"
DIRECT_ALIGN = 4096   # O_DIRECT: buffer address, file offset and length multiples of the logical block size


def aligned_empty(shape, dtype, align: int = DIRECT_ALIGN) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary and whose buffer runs on to
    the next boundary (so an O_DIRECT request may cover its last, partial block)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(_round_up(max(nbytes, 1), align) + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class SwapLeaf:
    """One stacked leaf kept in a swap file: its group's shape (per / L layers, rest dims) and dtype."""

    name: str
    group_shape: tuple
    dtype: np.dtype

    @property
    def group_bytes(self) -> int:
        return int(np.prod(self.group_shape)) * np.dtype(self.dtype).itemsize


def _filesystem_type(path: str) -> str:
    """The mount type of the filesystem holding `path` (Linux /proc/mounts; "" where unknown)."""
    try:
        real = os.path.realpath(path)
        best, kind = "", ""
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
        return kind
    except OSError:
        return ""


def check_swap_path(nvme_path: str, needed: int, *, key: str = "zero_optimization.offload_optimizer.nvme_path",
                    allow_ram_disk: bool = False) -> None:
    """Refuse, before the first step, a swap directory that is missing, not a directory, read-only, on a
    RAM disk, or with fewer free bytes than `needed`. The message names the key, the cause and the fix."""
    if not nvme_path:
        raise ValueError(f"{key} is not set: NVMe offload needs a directory on a local SSD for its swap files")
    if not os.path.exists(nvme_path):
        raise ValueError(f"{key} = {nvme_path!r} does not exist; create it (a directory on a local SSD) or "
                         "point nvme_path at one")
    if not os.path.isdir(nvme_path):
        raise ValueError(f"{key} = {nvme_path!r} is not a directory; point nvme_path at a directory on a local SSD")
    if not os.access(nvme_path, os.W_OK | os.X_OK):
        raise ValueError(f"{key} = {nvme_path!r} is not writable by this process; choose a writable directory "
                         "or fix its permissions")
    fs = _filesystem_type(nvme_path)
    if fs in RAM_FILESYSTEMS and not allow_ram_disk:
        # refused, not warned: swap files on a RAM disk hold the state in host memory after all, plus
        # the buffers, so the run would need more host RAM than CPU offload
        raise ValueError(f"{key} = {nvme_path!r} is on a RAM disk ({fs}): its swap files would sit in host "
                         "memory, which NVMe offload exists to spare; use a directory on an SSD, or "
                         "\"device\": \"cpu\" to keep the state in host memory")
    free = shutil.disk_usage(nvme_path).free
    if free < needed:
        raise ValueError(f"{key} = {nvme_path!r}: the swap files need {needed:,} bytes ({needed / 2**30:.2f} GiB) "
                         f"but the filesystem has {free:,} bytes ({free / 2**30:.2f} GiB) free; free space, "
                         "point nvme_path at a larger disk, or offload fewer layers (offload_optimizer.ratio)")


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


class NvmeSwapper:
    """Swap files for `leaves` (each L / per groups of `per` layers) and the pipelined group read / write
    the update's host callbacks call. Thread-safe for one reader and one writer at a time."""

    def __init__(self, nvme_path: str, leaves: list[SwapLeaf], groups: int, *, buffer_count: int = 4,
                 block_size: int = 1 << 20, threads: int = 8, pipeline_read: bool = True,
                 pipeline_write: bool = True, rank: int = 0, run: str | None = None,
                 key: str = "zero_optimization.offload_optimizer.nvme_path", allow_ram_disk: bool = False,
                 host_groups: int = 0, direct: bool = True):
        if buffer_count < 2:
            raise ValueError(f"zero_optimization.offload_optimizer.buffer_count = {buffer_count}: NVMe offload "
                             "needs at least 2 buffers")
        self.leaves, self.groups = list(leaves), int(groups)
        # the host / disk split (offload_optimizer.host_layers): groups [0, host_groups) stay in host memory
        # (numpy arrays here, moved by the same callbacks), the rest live in the files
        self.host_groups = int(host_groups)
        if not 0 <= self.host_groups < self.groups:
            raise ValueError(f"NVMe swapper: host_groups = {host_groups} must leave at least one of the {groups} "
                             "groups on disk")
        self.block_size = int(block_size)
        # group strides stay whole blocks of both the request size and O_DIRECT's alignment
        unit = self.block_size * DIRECT_ALIGN // math.gcd(self.block_size, DIRECT_ALIGN)
        self.strides = [_round_up(max(leaf.group_bytes, 1), unit) for leaf in self.leaves]
        check_swap_path(nvme_path, self.disk_bytes, key=key, allow_ram_disk=allow_ram_disk)
        self.root = os.path.join(nvme_path, f"{SWAP_PREFIX}{run or uuid.uuid4().hex[:12]}")
        self.dir = os.path.join(self.root, f"rank{rank}")
        os.makedirs(self.dir, exist_ok=False)
        self.buffer_count, self.pipeline_read, self.pipeline_write = buffer_count, pipeline_read, pipeline_write
        self._pool = cf.ThreadPoolExecutor(max(1, min(int(threads), MAX_THREADS)), thread_name_prefix="zerojax-nvme")
        self._fds = []
        # O_DIRECT where the filesystem takes it (and the request pieces stay aligned): see the module doc
        self.direct = (bool(direct) and hasattr(os, "O_DIRECT") and self.block_size % DIRECT_ALIGN == 0
                       and _accepts_direct(self.dir))
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        for i, (leaf, stride) in enumerate(zip(self.leaves, self.strides)):
            fd = os.open(os.path.join(self.dir, f"leaf{i}.swap"), flags, 0o600)
            self._fds.append(fd)
            try:  # reserve the space now: a full disk fails here, not in the middle of a step
                os.posix_fallocate(fd, 0, stride * self.disk_groups)
            except (AttributeError, OSError) as e:
                self.close()
                raise ValueError(f"{key}: could not reserve {stride * self.disk_groups:,} bytes for {leaf.name} in "
                                 f"{self.dir}: {e}; free space or choose another nvme_path") from e
        # zeros until written, as the reserved files read (np.zeros maps untouched pages: no memory yet)
        self._ram = [[np.zeros(leaf.group_shape, leaf.dtype) for leaf in self.leaves] for _ in range(self.host_groups)]
        self._lock = threading.Lock()
        self._writes: dict[int, list] = {}    # group -> pending write futures
        self._ahead: tuple[int, cf.Future] | None = None   # the group read ahead
        self.bytes_read = self.bytes_written = 0
        self.stall_s = 0.0   # wall time the update's callbacks waited on the disk (read / write)
        # per pass over the groups (an update): seconds from the read of group 0 to the last group's
        # write on disk, the window its bytes moved in (the achieved bandwidth's denominator)
        self.pass_s: list[float] = []
        self._pass_start = None
        self._closed = False
        _OPEN.add(self)

    # ------------------------------------------------------------------ sizes

    @property
    def disk_groups(self) -> int:
        return self.groups - self.host_groups

    @property
    def disk_bytes(self) -> int:
        """Bytes the swap files take (each group padded to block_size)."""
        return sum(self.strides) * self.disk_groups

    @property
    def group_bytes(self) -> int:
        return sum(leaf.group_bytes for leaf in self.leaves)

    @property
    def host_bytes(self) -> int:
        """Host memory the swapper's buffers hold at most: `buffer_count` groups."""
        return self.buffer_count * self.group_bytes

    # ------------------------------------------------------------------ raw I/O

    def _pieces(self, nbytes: int):
        """(start, stop) byte ranges of one leaf's group, block-aligned, for parallel requests."""
        step = max(self.block_size, _round_up(-(-nbytes // self._pool._max_workers), self.block_size))
        return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)] or [(0, 0)]

    def _io(self, write: bool, g: int, arrays: list[np.ndarray], leaves=None) -> list[cf.Future]:
        futs = []
        for k, a in zip(range(len(arrays)) if leaves is None else leaves, arrays):
            if g < self.host_groups:   # a host group: a copy in memory, no I/O
                if write:
                    self._ram[g][k][...] = a
                else:
                    a[...] = self._ram[g][k]
                continue
            fd, stride = self._fds[k], self.strides[k]
            view = memoryview(a.reshape(-1).view(np.uint8))
            base = (g - self.host_groups) * stride
            for lo, hi in self._pieces(a.nbytes):
                if hi <= lo:
                    continue
                futs.append(self._pool.submit(_pwrite if write else _pread, fd, view[lo:hi], base + lo,
                                              self.direct))
        return futs

    def _read_now(self, g: int) -> list[np.ndarray]:
        self._wait_writes(g)
        out = [aligned_empty(leaf.group_shape, leaf.dtype) for leaf in self.leaves]
        for f in self._io(False, g, out):
            f.result()
        if g >= self.host_groups:
            self.bytes_read += sum(a.nbytes for a in out)
        return out

    def _wait_writes(self, g: int | None = None):
        with self._lock:
            groups = list(self._writes) if g is None else [g]
            futs = [f for k in groups for f in self._writes.pop(k, [])]
        for f in futs:
            f.result()

    # ------------------------------------------------------------------ the update's callbacks

    def read(self, g) -> list[np.ndarray]:
        """Group g's leaves (fresh arrays: the caller may keep them), reading g + 1 ahead if pipelined."""
        g, t0 = int(g), time.perf_counter()
        if g == 0:
            self._pass_start = t0
        ahead, self._ahead = self._ahead, None
        out = ahead[1].result() if ahead is not None and ahead[0] == g else self._read_now(g)
        if self.pipeline_read and self.groups > 1:
            nxt = (g + 1) % self.groups
            self._ahead = (nxt, self._pool.submit(self._read_now, nxt))
        self.stall_s += time.perf_counter() - t0
        return out

    def write(self, g, *arrays) -> None:
        """Write group g's new leaves; returns once they are copied (pipelined) or written."""
        if len(arrays) != len(self.leaves):
            raise ValueError(f"NVMe swap write of group {int(g)}: {len(arrays)} arrays for {len(self.leaves)} leaves")
        self.write_leaves(g, range(len(self.leaves)), arrays)

    def write_leaves(self, g, leaves, arrays) -> None:
        """Write group g of the swap leaves numbered `leaves` (all of them: `write`; some: the init,
        a leaf at a time); returns once they are copied (pipelined) or written."""
        g, t0, leaves = int(g), time.perf_counter(), list(leaves)
        # at most buffer_count - 1 groups being written (one more is the read ahead)
        while True:
            with self._lock:
                pending = sorted(self._writes)
            if len(pending) < self.buffer_count - 1:
                break
            self._wait_writes(pending[0])
        if g < self.host_groups:   # copied into the host group's arrays: nothing pending
            self._io(True, g, [np.asarray(a).reshape(self.leaves[k].group_shape) for k, a in zip(leaves, arrays)],
                     leaves)
            self.stall_s += time.perf_counter() - t0
            return
        # the callback's arrays may alias buffers the runtime reuses once it returns: copy them
        own = [aligned_empty(self.leaves[k].group_shape, self.leaves[k].dtype) for k in leaves]
        for o, a in zip(own, arrays):
            o[...] = np.asarray(a).reshape(o.shape)
        futs = self._io(True, g, own, leaves)
        self.bytes_written += sum(a.nbytes for a in own)
        if g == self.groups - 1 and self._pass_start is not None and futs:
            start, self._pass_start = self._pass_start, None
            left = [len(futs)]

            def done(_, start=start, left=left):   # on the I/O threads, once the last piece is written
                with self._lock:
                    left[0] -= 1
                    if left[0] == 0:
                        self.pass_s.append(time.perf_counter() - start)
            for f in futs:
                f.add_done_callback(done)
        with self._lock:
            self._writes.setdefault(g, []).extend(futs)
        if not self.pipeline_write:
            self._wait_writes(g)
        self.stall_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait for every pending write (before reading the files whole, and at close)."""
        self._wait_writes()

    # ------------------------------------------------------------------ whole state

    def write_all(self, stacked: list[np.ndarray]) -> None:
        """Fill the files from whole [L, ...] leaves (init, resume), a group at a time."""
        per = self.leaves[0].group_shape[0] if self.leaves and self.leaves[0].group_shape else 1
        self._ahead = None
        for g in range(self.groups):
            self.write(g, *[np.asarray(x[g * per:(g + 1) * per]) for x in stacked])
        self.flush()

    def read_all(self) -> list[np.ndarray]:
        """The whole [L, ...] leaves read back (checkpoints, tests): host memory holds the whole state,
        once (each group is read straight into its rows)."""
        self.flush()
        self._ahead = None
        out = [aligned_empty((self.groups * leaf.group_shape[0],) + tuple(leaf.group_shape[1:]), leaf.dtype)
               for leaf in self.leaves]
        for g in range(self.groups):
            rows = [a[g * leaf.group_shape[0]:(g + 1) * leaf.group_shape[0]] for a, leaf in zip(out, self.leaves)]
            for f in self._io(False, g, rows):
                f.result()
        self.bytes_read += sum(a.nbytes for a in out) * self.disk_groups // self.groups
        return out

    # ------------------------------------------------------------------ one leaf a group at a time (checkpoints)

    def read_leaf(self, g, k: int) -> np.ndarray:
        """Group g of swap leaf k, read now into a fresh array (a checkpoint's save: host memory holds the
        groups the caller keeps, never the leaf)."""
        g = int(g)
        self._wait_writes(g)
        out = aligned_empty(self.leaves[k].group_shape, self.leaves[k].dtype)
        for f in self._io(False, g, [out], [k]):
            f.result()
        if g >= self.host_groups:
            self.bytes_read += out.nbytes
        return out

    def write_leaf_groups(self, k: int, read_group) -> None:
        """Every group g of swap leaf k from `read_group(g)` (a checkpoint's restore), written as the update
        writes (at most buffer_count - 1 groups in flight); a step's read ahead is dropped (stale after)."""
        self.flush()
        self._ahead = None
        for g in range(self.groups):
            self.write_leaves(g, [k], [read_group(g)])
        self.flush()

    def close(self) -> None:
        """Wait for the I/O, close the files and remove the swap directory (scratch, never a checkpoint)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._pool.shutdown(wait=True)
        finally:
            for fd in self._fds:
                os.close(fd)
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                os.rmdir(self.root)  # other ranks may still have theirs
            except OSError:
                pass
            _OPEN.discard(self)

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            warnings.warn("zerojax NVMe swapper: could not remove its swap files", RuntimeWarning, stacklevel=2)


def _accepts_direct(directory: str) -> bool:
    """Whether a file in `directory` opens with O_DIRECT (tmpfs and some network filesystems refuse: EINVAL)."""
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass


def _direct_ready(view: memoryview) -> bool:
    """Whether an O_DIRECT request can use `view` as it is: aligned start and whole blocks."""
    addr = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
    return addr % DIRECT_ALIGN == 0 and len(view) % DIRECT_ALIGN == 0


def _pread(fd, view, offset, direct: bool = False):
    if direct and not _direct_ready(view):   # through an aligned bounce buffer, whole blocks
        bounce = aligned_empty((_round_up(len(view), DIRECT_ALIGN),), np.uint8)
        _pread(fd, memoryview(bounce), offset, True)
        view[:] = bounce[:len(view)]
        return
    n = 0
    while n < len(view):
        got = os.preadv(fd, [view[n:]], offset + n)
        if got <= 0:
            raise OSError(f"short read at offset {offset + n} of a swap file")
        n += got


def _pwrite(fd, view, offset, direct: bool = False):
    if direct and not _direct_ready(view):   # the tail block's padding lands inside the group's stride
        bounce = aligned_empty((_round_up(len(view), DIRECT_ALIGN),), np.uint8)
        bounce[:len(view)] = np.frombuffer(view, np.uint8)
        bounce[len(view):] = 0
        view = memoryview(bounce)
    n = 0
    while n < len(view):
        n += os.pwritev(fd, [view[n:]], offset + n)


_OPEN: weakref.WeakSet[NvmeSwapper] = weakref.WeakSet()


@atexit.register
def _close_all():
    for s in list(_OPEN):
        s.close()


__all__ = ["NvmeSwapper", "SwapLeaf", "check_swap_path", "aligned_empty", "RAM_FILESYSTEMS"]
