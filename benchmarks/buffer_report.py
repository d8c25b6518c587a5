"""The largest buffers of a compiled XLA program, from its dumped buffer assignment.

Run the program with `XLA_FLAGS="--xla_dump_to=DIR"` (the buffer assignment is dumped with the
optimized HLO), then

    python benchmarks/buffer_report.py DIR [--module train_step] [--top 15]

prints the allocations by size and, inside the temporary allocation (where XLA packs every
intermediate of the step), the largest values with the instruction that defines each: the place
to look when a step needs more device memory than expected.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys


def parse(text: str):
    """-> [(size, header, [(value_size, value_text)])] for each allocation."""
    allocs, cur = [], None
    for line in text.splitlines():
        m = re.match(r"allocation (\d+): size (\d+)(.*)", line)
        if m:
            cur = (int(m.group(2)), line.strip()[:160], [])
            allocs.append(cur)
            continue
        v = re.match(r"\s*value: <\d+ (\S+) [^>]*> \(size=(\d+),offset=(\d+)\): (.*)", line)
        if v and cur is not None:
            cur[2].append((int(v.group(2)), f"{v.group(1)}: {v.group(4)[:120]}"))
    return allocs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump_dir")
    ap.add_argument("--module", default="train_step", help="substring of the module's file name")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    files = [f for f in glob.glob(os.path.join(args.dump_dir, "*buffer-assignment.txt")) if args.module in f]
    if not files:
        print(f"no *buffer-assignment.txt for {args.module!r} in {args.dump_dir}", file=sys.stderr)
        return 1
    path = max(files, key=os.path.getsize)
    allocs = sorted(parse(open(path).read()), key=lambda a: -a[0])
    gib = lambda b: f"{b / 2**30:8.3f} GiB"  # noqa: E731
    print(os.path.basename(path))
    for size, head, values in allocs[: args.top]:
        print(f"{gib(size)}  {head}")
        if len(values) > 1:
            for vs, vt in sorted(values, key=lambda v: -v[0])[: args.top]:
                print(f"      {gib(vs)}  {vt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
