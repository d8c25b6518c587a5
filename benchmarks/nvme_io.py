"""Disk bandwidth of the NVMe tier's I/O path: `os.pwritev` / `os.preadv` on a thread pool (what
zerojax.offload.nvme.swapper uses) against tensorstore (what orbax uses), for 64-256 MiB blocks.

    python benchmarks/nvme_io.py --path /local_nvme --mib 64 256 --total-mib 2048 --json out.json

Each case writes `total` bytes in blocks of the given size to one file, fsyncs, drops the file's pages
from the page cache (posix_fadvise DONTNEED, so reads come from the disk where the kernel honours
it), then reads them back, then runs the update's pattern (read g with g + 1 ahead, write g back,
pipelined); bandwidth = bytes / wall time. The swapper's path both with O_DIRECT (its default where the
filesystem allows) and buffered (page cache), at each --buffer-count. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from zerojax.offload.nvme.swapper import NvmeSwapper, SwapLeaf, _filesystem_type


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_pread(path: str, block: int, total: int, threads: int, direct: bool = True,
                buffer_count: int = 4) -> dict:
    """The swapper's own path: one leaf of `block` bytes per group, groups = total / block. Write all,
    read all, then the update's pattern: read group g (g + 1 read ahead) and write it back (pipelined),
    read + write bytes over the pass's wall time ("rw_GBps")."""
    groups = max(1, total // block)
    leaf = SwapLeaf("bench", (block // 4,), np.dtype(np.float32))
    sw = NvmeSwapper(path, [leaf], groups, buffer_count=buffer_count, threads=threads, pipeline_read=False,
                     pipeline_write=True, run=f"bench-{os.getpid()}", allow_ram_disk=True, direct=direct)
    try:
        data = np.random.default_rng(0).standard_normal(block // 4).astype(np.float32)
        t = time.perf_counter()
        for g in range(groups):
            sw.write(g, data)
        sw.flush()
        os.fsync(sw._fds[0])
        w = time.perf_counter() - t
        _drop_cache(os.path.join(sw.dir, "leaf0.swap"))
        t = time.perf_counter()
        for g in range(groups):
            got = sw.read(g)[0]
        r = time.perf_counter() - t
        assert np.array_equal(got, data)
        sw.pipeline_read = True
        _drop_cache(os.path.join(sw.dir, "leaf0.swap"))
        t = time.perf_counter()
        for g in range(groups):
            sw.write(g, sw.read(g)[0])
        sw.flush()
        os.fsync(sw._fds[0])
        rw = time.perf_counter() - t
        return {"direct": sw.direct, "write_GBps": groups * block / w / 1e9, "read_GBps": groups * block / r / 1e9,
                "rw_GBps": 2 * groups * block / rw / 1e9}
    finally:
        sw.close()


def bench_tensorstore(path: str, block: int, total: int) -> dict:
    import tensorstore as ts

    groups = max(1, total // block)
    n = block // 4
    d = tempfile.mkdtemp(dir=path)
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": d},
                     "metadata": {"shape": [groups, n], "chunks": [1, n], "dtype": "<f4",
                                  "compressor": None}}, create=True).result()
    data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    t = time.perf_counter()
    futs = [store[g].write(data) for g in range(groups)]
    for f in futs:
        f.result()
    os.sync()
    w = time.perf_counter() - t
    for root, _, files in os.walk(d):
        for f in files:
            _drop_cache(os.path.join(root, f))
    t = time.perf_counter()
    for g in range(groups):
        got = store[g].read().result()
    r = time.perf_counter() - t
    assert np.array_equal(got, data)
    import shutil
    shutil.rmtree(d, ignore_errors=True)
    return {"write_GBps": groups * block / w / 1e9, "read_GBps": groups * block / r / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--buffer-count", type=int, nargs="+", default=[4])
    ap.add_argument("--no-tensorstore", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for mib in args.mib:
        block, total = mib << 20, max(args.total_mib, mib) << 20
        cases = [(f"pread {'O_DIRECT' if d else 'buffered'} b{bc}",
                  lambda d=d, bc=bc: bench_pread(args.path, block, total, args.threads, direct=d, buffer_count=bc))  # noqa: B023 - called within this iteration
                 for d in (True, False) for bc in args.buffer_count]
        if not args.no_tensorstore:
            cases.append(("tensorstore zarr", lambda: bench_tensorstore(args.path, block, total)))  # noqa: B023 - called within this iteration
        for name, fn in cases:
            rows.append({"path": name, "block_MiB": mib, "total_MiB": total >> 20, **fn()})
    print(f"disk: {args.path} ({_filesystem_type(args.path) or '?'}), threads {args.threads}")
    print(f"{'I/O path':<22} {'block MiB':>9} {'write GB/s':>10} {'read GB/s':>10} {'r+w GB/s':>9}")
    for r in rows:
        print(f"{r['path']:<22} {r['block_MiB']:>9} {r['write_GBps']:>10.2f} {r['read_GBps']:>10.2f} "
              f"{r.get('rw_GBps', float('nan')):>9.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"path": args.path, "fs": _filesystem_type(args.path), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
