"""The shapes of the benchmark suite's registry (benchmarks/cases.py): a `Case` is one study, a list
of `Run`s (one program each, zerojax's or its anchor's) that `python -m benchmarks` runs back to back.

Placeholders in a run's argv and env, filled in by the runner (benchmarks/runner.py):
  {py}           this Python
  {out}          the --out directory
  {tree}         the tree under test ("." or, with --before DIR, DIR for the earlier tree's runs)
  {cap24}        XLA_PYTHON_CLIENT_MEM_FRACTION that leaves 23.77 GiB of this GPU to JAX (0.30 of an
                 H100's 80 GB, 0.17 of an H200's 141 GB: a fixed 0.17 would give an H100 only 13.5 GiB)
  {peak_tflops}  the bf16 matmul ceiling measured on this GPU (1 under --smoke)
  {nvme}         the --nvme swap directory
  {hf_checkpoint} the --hf-checkpoint folder (a pretrained model; a case that names it refuses without it)
  {XLA_FLAGS}    the caller's XLA_FLAGS (a run that adds flags keeps the caller's)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

# how a run's records are read: JSON lines on stdout (also `NAME {...}` lines such as the trainer's
# SUMMARY), bench.py's --out report, moe_bench.py's --out list, or the trainer's --summary-json file
READERS = ("stdout", "bench", "moe", "summary")

# pieces of commands several cases share
BENCH = "benchmarks/bench.py"
EXAMPLE = "examples/gpt2_large.py"
CAP24 = (("XLA_PYTHON_CLIENT_MEM_FRACTION", "{cap24}"),)   # a 24 GB card
# the example's fastest flags on GPT-2 Large (benchmarks/RESULTS.md)
BEST_FLAGS = ("--micro-batch", "8", "--remat", "dots", "--loss-chunk", "256", "--adam-mu-dtype", "bfloat16",
              "--master-split")


@dataclasses.dataclass(frozen=True)
class Run:
    """One program of a case. `argv` starts with a script under the tree (e.g.
    `benchmarks/bench.py`, `examples/gpt2_large.py`, run by {py}) or `-m MODULE`; `smoke` is its tiny
    CPU variant (None: not run under --smoke). `anchor`: its records are the yardstick the case's
    other rows are divided by."""
    label: str
    argv: tuple[str, ...]
    timeout_s: int
    smoke: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] = ()
    anchor: bool = False
    reader: str = "stdout"
    records_file: str = ""          # the file the "bench" / "moe" / "summary" reader reads
    stdout_to: str = ""             # write stdout to this file (a later run reads it)
    tag: tuple[tuple[str, str], ...] = ()   # fields added to each of its records
    host_rss: bool = False          # run under GNU time -v: the host's peak RSS joins its records

    def __post_init__(self):
        if self.reader not in READERS:
            raise ValueError(f"Run {self.label!r}: reader {self.reader!r} is not one of {READERS}")
        if self.reader != "stdout" and not self.records_file:
            raise ValueError(f"Run {self.label!r}: reader {self.reader!r} needs records_file")


@dataclasses.dataclass(frozen=True)
class Case:
    """One study: its name on the command line, what it measures, its anchor, about how long it runs
    on one H100 (minutes), the GPUs it needs and its runs. `headline`: the figures the table shows
    (the first a record has) and divides by the anchor's; `match`: the record fields that pair a
    row with its anchor row.
    `prepare(out, smoke)` writes input files before the runs; `post(out)` returns extra records
    (comparisons made from the runs' files). `needs_before`: only with --before DIR (two trees)."""
    name: str
    measures: str
    anchor: str
    minutes: float
    runs: tuple[Run, ...]
    headline: tuple[str, ...] | str = ("tokens_per_s",)
    match: tuple[str, ...] = ("model",)
    gpus: int = 1
    prepare: Callable[[str, bool], None] | None = None
    post: Callable[[str], list[dict]] | None = None
    needs_before: bool = False

    def __post_init__(self):
        if isinstance(self.headline, str):
            object.__setattr__(self, "headline", (self.headline,))
