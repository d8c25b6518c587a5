"""The benchmark suite: `python -m benchmarks` lists the named cases; `python -m benchmarks CASE [CASE ...]`
runs each case's zerojax programs and their anchors back to back and prints one table
(benchmarks/README.md). Run from the repository root."""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks.cases import CASES
from benchmarks.runner import Settings, run_case
from benchmarks.table import format_table


def case_list() -> str:
    """One line a case: name, GPUs and minutes on one H100, what it measures, its anchor."""
    width = max(len(name) for name in CASES)
    lines = [f"{'case':<{width}}  GPUs  ~min  measures (anchor)"]
    for case in CASES.values():
        lines.append(f"{case.name:<{width}}  {case.gpus:>4}  {case.minutes:>4g}  {case.measures} "
                     f"(anchor: {case.anchor})")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", metavar="CASE", help="cases to run, in order (none: list them)")
    p.add_argument("--smoke", action="store_true", help="each program's tiny CPU mode: does it run?")
    p.add_argument("--out", default="benchmarks/results",
                   help="logs, JSON files and every record (default benchmarks/results/, not tracked)")
    p.add_argument("--before", metavar="DIR", help="an earlier tree: each run for it, then for this one")
    p.add_argument("--nvme", default="/tmp", help="the nvme case's swap directory (default /tmp)")
    p.add_argument("--hf-checkpoint", default="", metavar="DIR",
                   help="a pretrained model's Hugging Face folder, for the cases that train one (rl-curve)")
    p.add_argument("--only", nargs="+", default=(), metavar="RUN",
                   help="only these runs of the cases (their labels: `python -m benchmarks --runs CASE`)")
    p.add_argument("--runs", action="store_true", help="list each named case's runs and their commands")
    p.add_argument("--quiet", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        p.error(f"unknown case {', '.join(unknown)}: `python -m benchmarks` lists {', '.join(CASES)}")
    labels = {run.label for name in args.cases for run in CASES[name].runs}
    bad = [label for label in args.only if label not in labels]
    if bad:
        p.error(f"--only {' '.join(bad)}: no such run in {', '.join(args.cases) or 'no case'} "
                f"(`python -m benchmarks --runs CASE` lists its runs)")
    return args


def run_list(names) -> str:
    """Each run of the cases named: its label, timeout and command (placeholders unfilled)."""
    lines = []
    for name in names:
        for run in CASES[name].runs:
            role = "anchor" if run.anchor else "zerojax"
            lines.append(f"{name} {run.label} ({role}, {run.timeout_s} s): {' '.join(run.argv)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cases:
        print(case_list())
        return 0
    if args.runs:
        print(run_list(args.cases))
        return 0
    settings = Settings(out=os.path.abspath(args.out), smoke=args.smoke, before=args.before, nvme=args.nvme,
                        hf_checkpoint=os.path.abspath(args.hf_checkpoint) if args.hf_checkpoint else "",
                        quiet=args.quiet, only=tuple(args.only))
    results = [(CASES[name], run_case(CASES[name], settings)) for name in args.cases]
    print(format_table(results))
    failed = sum("error" in r for _, records in results for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
