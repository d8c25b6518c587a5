"""Device memory of the real compiled step, and the guard the engine runs before its first step.

`jit(...).lower(...).compile()` and `Compiled.memory_analysis()` give the exact per-device peak
(arguments + outputs + temporaries - aliased (donated) bytes + generated code). Compiling
allocates nothing, so this runs before the first step (and on a CPU for a GPU-sized model's
shapes, when the mesh has the GPU's device count).

`guard` is that check, the one the engine runs (`Engine.step_memory` is the one figure it, the
planner and the memory report read): `WillNotFitError` (a MemoryError) with the predicted peak,
the budget and the plans that fit, instead of an out-of-memory crash. Plans come from a callback
(the planner, `zerojax.planning.planner`, builds them); this module imports neither the engine nor
the planner.
DeepSpeed's formulas are in `zerojax.planning.estimate` (no jax).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

from zerojax._jax_compat import flat_state
from zerojax.byte_sizes import GB, GiB, fmt_bytes, parse_bytes

# ---------------------------------------------------------------------------------------------
# Compiled memory


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Per-device bytes of one compiled program (`Compiled.memory_analysis()`)."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int = 0
    host_argument: int = 0
    host_output: int = 0
    host_temp: int = 0
    host_alias: int = 0
    xla_peak: int | None = None  # XLA's own heap-simulated peak, where this jax reports it

    @property
    def peak(self) -> int:
        """Device bytes live at once, conservatively: everything passed in, everything returned
        (minus what reuses a donated input's buffer), all temporaries, and the code."""
        return self.argument + self.output + self.temp - self.alias + self.generated_code

    @property
    def host_peak(self) -> int:
        return self.host_argument + self.host_output + self.host_temp - self.host_alias

    @classmethod
    def of(cls, compiled) -> CompiledMemory:
        """From a `jax.stages.Compiled`, its `memory_analysis()` result, or a CompiledMemory."""
        if isinstance(compiled, cls):
            return compiled
        m = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else compiled
        if isinstance(m, (list, tuple)):  # some backends answer per device; take the worst
            return max((cls.of(x) for x in m), key=lambda c: c.peak)
        if m is None:
            raise RuntimeError("this backend's Compiled.memory_analysis() returned None")
        g = lambda name: int(getattr(m, name, 0) or 0)  # noqa: E731
        xla_peak = getattr(m, "peak_memory_in_bytes", None)
        return cls(g("argument_size_in_bytes"), g("output_size_in_bytes"),
                   g("temp_size_in_bytes"), g("alias_size_in_bytes"),
                   g("generated_code_size_in_bytes"), g("host_argument_size_in_bytes"),
                   g("host_output_size_in_bytes"), g("host_temp_size_in_bytes"),
                   g("host_alias_size_in_bytes"), None if xla_peak is None else int(xla_peak))

    def to_dict(self):
        return {**dataclasses.asdict(self), "peak": self.peak, "host_peak": self.host_peak}


def _allocator_stats(device=None) -> dict:
    """`device.memory_stats()` of `device` (default: the first local device), {} where there are
    none (CPU)."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return {}


def device_budget(device=None) -> int | None:
    """The allocator's limit for `device` (default: the first local device), or None (CPU)."""
    stats = _allocator_stats(device)
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def device_free_bytes(device=None) -> int | None:
    """The allocator's limit less what is in use on `device` (default: the first local device), or
    None where it reports neither (CPU)."""
    stats = _allocator_stats(device)
    if "bytes_limit" not in stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])


_HOST_KINDS = ("pinned_host", "unpinned_host")


def resident_bytes(tree, host: bool = False) -> int:
    """Bytes one device holds of a tree of arrays in device memory (host=True: in host memory,
    offload's pinned or unpinned host kinds)."""
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        kind = getattr(a.sharding, "memory_kind", None)
        if (kind in _HOST_KINDS) == host:
            total += a.addressable_shards[0].data.nbytes
    return total


class WillNotFitError(MemoryError):
    """The compiled step needs more device memory than the budget; `plans` lists ones that fit
    (`zerojax.planning.planner.Plan`s: anything with `describe()` and `config_patch()`)."""

    def __init__(self, predicted_bytes: int, budget_bytes: int, plans: Sequence = (),
                 what: str = "the training step", notes: Sequence[str] = ()):
        self.predicted_bytes, self.budget_bytes = int(predicted_bytes), int(budget_bytes)
        self.plans = list(plans)
        lines = [f"{what} needs {fmt_bytes(predicted_bytes)} per device "
                 f"({predicted_bytes:,} bytes, from XLA's ahead-of-time memory analysis) but the "
                 f"budget is {fmt_bytes(budget_bytes)} ({budget_bytes:,} bytes)."]
        lines += list(notes)  # what the caller knows of where the bytes go (e.g. the host loop's chunks)
        if self.plans:
            lines.append("These fit, fastest first (set them in the DeepSpeed config; with a smaller "
                         "micro-batch, raise gradient_accumulation_steps to keep train_batch_size):")
            lines += [f"  {i + 1}. {p.describe()}  {p.config_patch()}" for i, p in enumerate(self.plans)]
        else:
            lines.append("No plan that was tried fits: use more devices (ZeRO stage 3 divides "
                         "model states by the device count), a shorter sequence, activation "
                         "checkpointing (remat), or offload_optimizer / offload_param to cpu.")
        super().__init__("\n".join(lines))


def check_fits(compiled, budget_bytes=None, *, plans=(), what="the training step",
               notes: Sequence[str] = ()) -> CompiledMemory:
    """Raise `WillNotFitError` if `compiled`'s predicted per-device peak exceeds the budget.

    compiled: a `jax.stages.Compiled` (or its memory_analysis(), or a CompiledMemory).
    budget_bytes: default `device_budget()`; with no budget known (CPU) nothing is checked.
    plans: plans that fit, or a zero-argument callable returning them (called only on failure,
    since planning compiles more programs).
    notes: lines added to the error after the figures.
    Returns the CompiledMemory so the caller can log it.
    """
    mem = CompiledMemory.of(compiled)
    if budget_bytes is None:
        budget_bytes = device_budget()
    if budget_bytes is not None and mem.peak > budget_bytes:
        if callable(plans):
            plans = plans()
        # plans arrive ranked (fastest first); keep that order, drop any that would not fit
        raise WillNotFitError(mem.peak, budget_bytes,
                              [p for p in plans if getattr(p, "peak_bytes", None) is None
                               or p.peak_bytes <= budget_bytes], what, notes)
    return mem


def largest_fitting(peak_of: Callable[[int], int], budget_bytes: int, *, start=1,
                    limit=1024) -> tuple[int, dict]:
    """Largest m in [start, limit] with peak_of(m) <= budget, assuming peaks grow with m.

    Peaks are nearly affine in the micro-batch (activations scale with it), so: compile `start`
    and `start + 1`, extrapolate the line to the budget, then confirm the guess and its successor,
    falling back to doubling / bisection where the line was wrong. Typically 4 compiles.
    Returns (m, {m: peak}); m = 0 if even `start` does not fit.
    """
    peaks: dict[int, int] = {}

    def fits(m):
        if m not in peaks:
            peaks[m] = int(peak_of(m))
        return peaks[m] <= budget_bytes

    if not fits(start):
        return 0, peaks
    if start >= limit or not fits(start + 1):
        return start, peaks
    lo, hi = start + 1, None  # lo fits; hi (if known) does not
    slope = peaks[start + 1] - peaks[start]
    if slope > 0:
        guess = start + 1 + (budget_bytes - peaks[start + 1]) // slope
        guess = max(lo, min(int(guess), limit))
        if guess > lo:
            if fits(guess):
                lo = guess
            else:
                hi = guess
    if hi is None and lo > start + 1 and lo < limit:  # a guess that fits: its successor first, then double
        lo, hi = (lo + 1, None) if fits(lo + 1) else (lo, lo + 1)
    return double_then_bisect(fits, lo, limit, hi)[0], peaks


def double_then_bisect(fits: Callable[[int], bool], lo: int, limit: int | None = None,
                       hi: int | None = None) -> tuple[int, int | None]:
    """Largest n in [lo, limit] with fits(n), given that `lo` fits and `hi` (where known) does not,
    fits being monotone: doubling from `lo` until a length fails or `limit` (None: no limit) is
    reached, then bisection between the last that fit and the first that did not -> (n, the
    smallest n' > n tried that did not fit, or None where the search stopped at `limit`)."""
    while hi is None:
        nxt = lo * 2 if limit is None else min(lo * 2, limit)
        if nxt <= lo:
            return lo, None
        lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def longest_fitting(fits: Callable[[int], bool], start: int = 1,
                    limit: int | None = None) -> tuple[int, int | None]:
    """Largest n >= 1 (<= limit) with fits(n), fits monotone, starting from a guess: where `start`
    fits, `double_then_bisect` upward; where it does not, halving until a length fits, then
    bisection between it and the last that failed. A guess near the answer saves the compiles
    of every doubling below it. -> (n, the smallest failing n' > n tried, None where the search
    stopped at `limit`); n = 0 where even 1 does not fit."""
    start = max(1, start if limit is None else min(start, limit))
    if fits(start):
        return double_then_bisect(fits, start, limit)
    hi, n = start, start // 2
    while n >= 1 and not fits(n):
        hi, n = n, n // 2
    return (0, hi) if n < 1 else double_then_bisect(fits, n, limit, hi)


# Memory analysis comes from XLA's HLO passes and buffer assignment, before the CPU backend's
# LLVM code generation; skipping LLVM's optimisations leaves the numbers unchanged and compiles
# faster. Used only for planning compiles on CPU (virtual devices), never for a step that runs.
# XLA's newer CPU fusion emitters cost most of a CPU compile: without them a tiny GPT-2 step
# compiled in 3.2 s of CPU instead of 8.4 s, its peak 192 bytes apart in 13.5 MB of temporaries.
_FAST_CPU_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# On GPU, XLA's rematerialization and scheduler aim under (device memory x slop / 100); a planning
# compile of a program that does not fit would spend minutes trying (125 s for GPT-2 Large fp32 on
# a 24 GB cap) and then report a peak over the budget anyway. At 10000% the pass never
# triggers: planning reads the program's own peak, never one XLA squeezed, so a plan that fits
# here fits without XLA's remat when the engine compiles it for real.
_PLANNING_GPU_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 10000}


def compile_engine_step(eng, batch, *, planning=False):
    """The engine's AOT-compiled train step (`jax.stages.Compiled`) for `batch` (arrays or
    ShapeDtypeStructs). For a real engine this is the engine's cached compile (the one its steps
    can reuse); `planning=True` compiles a throwaway copy with planning's compiler options."""
    import jax

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    lower = getattr(eng, "lower_step", None)
    if planning and lower is not None:
        backend = jax.default_backend()
        options = {"cpu": _FAST_CPU_OPTIONS, "gpu": _PLANNING_GPU_OPTIONS}.get(backend)
        with quiet_xla():
            return lower(shapes).compile(compiler_options=options)
    fn = getattr(eng, "compiled_step", None)
    if fn is not None:
        return fn(shapes)
    if lower is not None:
        return lower(shapes).compile()
    raise NotImplementedError(
        "zerojax.engine.memory needs Engine.compiled_step(batch_shapes) -> jax.stages.Compiled; "
        f"{type(eng).__name__} has none")


def guard(engine, batch_shapes, budget=None, *, plans=(), notes: Sequence[str] = ()) -> CompiledMemory | None:
    """The memory guard: `engine.step_memory(batch_shapes)` (the engine's cached AOT compile, the
    host loop's chunks included) against `budget` (default: the device's bytes_limit; none on CPU:
    nothing is checked); WillNotFitError if it exceeds it.

    plans: the plans that fit, or a zero-argument callable returning them (called only on failure;
    `zerojax.planning.planner.engine_plans` builds them for an engine). notes: lines for the error.
    """
    import jax

    budget = device_budget() if budget is None else parse_bytes(budget)
    if budget is None:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_shapes)
    mem = check_fits(engine.step_memory(shapes), budget, plans=plans, notes=notes)
    check_free(mem)
    return mem


class HeldMemoryError(MemoryError):
    """The step fits the device's budget, but not beside what else the device holds now."""


def check_free(mem: CompiledMemory, free: int | None = None) -> None:
    """The step's new bytes (temporaries, outputs not written over a donated input, its code:
    the state it reads is already resident) against the device's free bytes now (default:
    `device_free_bytes()`; none known: nothing checked). HeldMemoryError, not an out-of-memory
    mid-step, when arrays outside the engine (a model copy, another engine, an earlier run's
    buffers) hold what the step needs."""
    free = device_free_bytes() if free is None else free
    need = mem.temp + mem.output - mem.alias + mem.generated_code
    if free is not None and need > free:
        raise HeldMemoryError(
            f"the training step needs {fmt_bytes(need)} more on the device (its temporaries and new outputs; "
            f"its peak {fmt_bytes(mem.peak)} fits the budget) but only {fmt_bytes(free)} is free now: other "
            "arrays hold the rest. Delete what the run no longer needs (the model passed to zerojax.shard, an "
            "earlier engine: `del` it and call gc.collect()) before the first step.")


# XLA's rematerialization pass prints a warning per attempt when a program exceeds the device's
# memory ("Can't reduce memory use below ... by rematerialization"); a planner compiles programs
# that do not fit on purpose, so their stderr is filtered while it does.
_XLA_NOISE = ("rematerialization", "Rematerialization")


@contextlib.contextmanager
def quiet_xla(noise: Sequence[str] = _XLA_NOISE):
    """Drop XLA's C++ log lines containing any of `noise` (written to file descriptor 2, below
    Python's sys.stderr) while the block runs; other lines are written back to stderr."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (e.g. some notebooks): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(n in line for n in noise)]
            if kept:
                sys.stderr.write("".join(kept))


def count_params(state) -> tuple[int, int]:
    """(total parameters, largest "layer") of an `nnx.State` / Module, as DeepSpeed counts them.

    DeepSpeed's layer is a torch module's own parameters. Here a layer is the parameters sharing
    a parent path; a leaf whose logical axes start with "layers" (a scanned stack), or, given a
    Module, a leaf of an `nnx.vmap`-stacked block (`zerojax.model.find_blocks`), counts one slice.
    Leaves directly on the root count one by one (GPT-2's wte is its own nn.Embedding in torch).
    """
    from flax import nnx

    stacked = ()
    if isinstance(state, nnx.Module):
        from zerojax.model import find_blocks

        stack = find_blocks(state)
        stacked = (stack.path,) if stack is not None and stack.kind == "stacked" else ()
        state = nnx.state(state, nnx.Param)
    total, groups = 0, {}
    for path, var in flat_state(state):
        shape = tuple(getattr(var, "shape", None) or getattr(var, "value", var).shape)
        n = math.prod(shape)
        total += n
        names = logical_names(var)
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        if shape and ((names and names[0] == "layers") or any(keys[:len(p)] == p for p in stacked)):
            n //= shape[0]
        key = path[:-1] if len(path) > 1 else path
        groups[key] = groups.get(key, 0) + n
    return total, max(groups.values(), default=0)


def logical_names(var) -> tuple:
    """A parameter's logical axis names (its sharding metadata), () where it has none."""
    get = getattr(var, "get_metadata", None)
    meta = get() if get is not None else getattr(var, "metadata", {}) or {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key):
            return tuple(meta[key])
    return ()


__all__ = ["CompiledMemory", "device_budget", "WillNotFitError", "HeldMemoryError", "check_fits", "check_free",
           "largest_fitting", "double_then_bisect", "longest_fitting", "compile_engine_step", "guard", "quiet_xla",
           "count_params", "parse_bytes", "resident_bytes", "fmt_bytes", "GiB", "GB", "logical_names"]
