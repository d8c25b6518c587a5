"""Reading a `jax.profiler.trace` back: the device's kernels (their names, times, and the HLO
instruction each ran) from the .xplane.pb that JAX writes on every version (`jax.profiler.ProfileData`
reads it), and what XLA's HLO dump says of each instruction's code. Shared by
benchmarks/decode_profile.py (kernels summed by name) and benchmarks/step_profile.py (kernels by
category).

On a GPU the kernels are the events of the device plane's "Stream ..." lines (CUPTI's kernels and
copies); on CPU (--tiny) the host's XLA thread lines hold the compiled program's ops instead."""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_ns: float
    end_ns: float
    module: str = ""   # the HLO module it ran in ("hlo_module" stat), where the trace says
    hlo_op: str = ""   # its HLO instruction ("hlo_op" stat), where the trace says


def xplane_file(trace_dir: str) -> str:
    """The .xplane.pb a `jax.profiler.trace(trace_dir)` wrote."""
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}: did the profiler run?")
    return found[-1]


def device_lines(xplane: str, tiny: bool, first_device_only: bool = False):
    """(plane, line) of the device planes' "XLA Ops" and stream lines; on CPU (tiny) the host's XLA
    thread lines. first_device_only: the first GPU's plane alone (one card's step, not N cards' sum)."""
    from jax.profiler import ProfileData

    planes = [p for p in ProfileData.from_file(xplane).planes if tiny or "GPU" in p.name]
    if first_device_only and not tiny:
        planes = sorted(planes, key=lambda p: p.name)[:1]
    for plane in planes:
        if tiny and "GPU" not in plane.name and "CPU" not in plane.name:
            continue
        for line in plane.lines:
            if line.name.startswith(("XLA Ops", "Stream")) or (tiny and "XLA" in line.name):
                yield plane, line


def kernel_table(xplane: str, tiny: bool, top: int = 18) -> dict:
    """{line name: [(kernel name, count, total ms)]} of a trace's device planes (on CPU, --tiny:
    the host's XLA thread lines)."""
    lines = {}
    for _, line in device_lines(xplane, tiny):
        sums = collections.defaultdict(lambda: [0, 0.0])
        for event in line.events:
            sums[event.name][0] += 1
            sums[event.name][1] += event.duration_ns / 1e6
        lines[line.name] = sorted(((k, n, ms) for k, (n, ms) in sums.items()), key=lambda r: -r[2])[:top]
    return lines


def kernels(xplane: str, tiny: bool) -> list[Kernel]:
    """The first device's kernels and copies: its stream lines' events ("XLA Ops" spans the same
    time again, so it is left out); on CPU the XLA thread events that ran an HLO instruction."""
    found = []
    for _, line in device_lines(xplane, tiny, first_device_only=True):
        if line.name.startswith("XLA Ops"):
            continue
        for event in line.events:
            stats = {k: v for k, v in event.stats if isinstance(v, str)}
            if tiny and "hlo_op" not in stats:
                continue  # the host thread's own bookkeeping (thread pool regions, waits)
            start = float(event.start_ns)
            found.append(Kernel(event.name, start, start + float(event.duration_ns), stats.get("hlo_module", ""),
                                stats.get("hlo_op", "")))
    return found


# ------------------------------------------------------------------ XLA's HLO dump: each instruction's code

_MODULE = re.compile(r"^HloModule ([\w.\-]+)", re.M)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"(?: source_line=(\d+))?')


def dump_flags(dump_dir: str) -> str:
    """XLA_FLAGS that dump each compiled module's optimized HLO as text (with its metadata: the
    op_name and the stack frames of the code each instruction came from)."""
    return f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text"


def _section(text: str, title: str) -> dict[int, str]:
    """A dump's numbered table (FileNames, FunctionNames, FileLocations, StackFrames): {id: rest}."""
    match = re.search(rf"^{title}\n((?:\d+ .*\n?)*)", text, re.M)
    rows = (row.split(" ", 1) for row in (match.group(1).splitlines() if match else ()))
    return {int(k): v.strip().strip('"') for k, v in rows}


def _frame_code(text: str) -> dict[int, str]:
    """{stack frame id: "function file"} of the frame itself (the innermost: the code that wrote
    the op, not its callers, which every op of a loss's forward shares)."""
    files, functions = _section(text, "FileNames"), _section(text, "FunctionNames")
    locations = {}
    for k, v in _section(text, "FileLocations").items():
        ids = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = (f"{functions.get(int(ids.get('function_name_id', 0)), '')} "
                        f"{files.get(int(ids.get('file_name_id', 0)), '')}")
    frames = {}
    for k, v in _section(text, "StackFrames").items():
        location = re.search(r"file_location_id=(\d+)", v)
        frames[k] = locations.get(int(location.group(1)), "") if location else ""
    return frames


def instruction_code(text: str) -> dict[str, str]:
    """{instruction name: its code} of one optimized HLO dump: the op_name without its outermost jit
    (every op of the step shares that one) and the function and file its stack frame names."""
    frames = _frame_code(text)
    code = {}
    for name, metadata in _INSTRUCTION.findall(text):
        op_name = _OP_NAME.search(metadata)
        parts = [op_name.group(1).split("/", 1)[-1]] if op_name else []
        frame = _FRAME_ID.search(metadata)
        if frame:
            parts.append(frames.get(int(frame.group(1)), ""))
        source = _SOURCE.search(metadata)  # older dumps name the file inline
        if source:
            parts.append(source.group(1))
        code[name] = " ".join(p for p in parts if p)
    return code


def hlo_code(dump_dir: str) -> dict[tuple[str, str], str]:
    """{(module, instruction): code} over every optimized module XLA dumped in dump_dir, also keyed
    by the instruction's kernel name (dots as underscores) with module "" for traces whose kernels
    carry no hlo_op stat. A module compiled twice (the planner's candidates, then the step): the
    later dump wins."""
    table: dict[tuple[str, str], str] = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))):
        with open(path, errors="replace") as f:
            text = f.read()
        module = _MODULE.search(text)
        for name, code in instruction_code(text).items():
            table[(module.group(1) if module else "", name)] = code
            table[("", name.replace(".", "_").replace("-", "_"))] = code
    return table


def code_of(kernel: Kernel, table: dict[tuple[str, str], str]) -> str:
    """What the dump says of the instruction a kernel ran ("" where it says nothing)."""
    return (table.get((kernel.module, kernel.hlo_op)) or table.get(("", kernel.hlo_op.replace(".", "_")))
            or table.get(("", kernel.name)) or "")
