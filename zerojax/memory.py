"""How much device memory a ZeRO configuration needs, three ways, and a planner built on the last.

1. DeepSpeed's estimators, reproduced number for number (`estimate_zero2_model_states_mem_needs`,
   `estimate_zero3_model_states_mem_needs`, with `additional_buffer_factor=1.5` and the offload
   variants), and the ZeRO paper's per-device model-state table (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N).
   These count model states only: no activations, no temporaries.
2. The exact per-device peak of the real compiled step: `jit(...).lower(...).compile()` and
   `Compiled.memory_analysis()` (arguments + outputs + temporaries - aliased (donated) bytes +
   generated code). Compiling allocates nothing, so this runs before the first step (and on a
   CPU for a GPU-sized model's shapes, when the mesh has the GPU's device count).
3. A planner: under a memory budget, the (stage, offload, micro-batch, remat) choices whose compiled
   peak fits, fastest first, and `fit_micro_batch` for `"train_micro_batch_size_per_gpu": "auto"`.

`check_fits` is the guard the engine runs before its first step: `WillNotFitError` (a MemoryError)
with the predicted peak, the budget and the plans that fit, instead of an out-of-memory crash.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re
from typing import Callable, Iterable, Sequence

GiB = 2**30
GB = 10**9

# ---------------------------------------------------------------------------------------------
# 1. Formulas


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, additional_buffer_factor=1.5,
                                          *, legacy=False):
    """DeepSpeed's `stage_1_and_2.estimate_zero2_model_states_mem_needs` -> (cpu_bytes, gpu_bytes).

    Without offload DeepSpeed now counts 2Ψ + 18Ψ/N on the GPU (16-bit params; 16-bit grads, fp32
    grads, fp32 master and Adam moments partitioned). `legacy=True` gives the older 4Ψ + 16Ψ/N that
    DeepSpeed's "Memory Requirements" page still prints (15.93GB for 2851M params on 8 GPUs).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        if legacy:
            gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        else:
            gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1,
                                          num_nodes=1, cpu_offload=True, cpu_offload_params=True,
                                          zero_init=True, additional_buffer_factor=1.5):
    """DeepSpeed's `stage3.estimate_zero3_model_states_mem_needs`
    -> (cpu_bytes, gpu_bytes, largest_layer_memory)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params  # 16-bit params gathered + 16-bit grads
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu_mem = total_params * per_param * gpus_factor * additional_buffer_factor
        else:
            cpu_mem = (total_params * max(4 * num_gpus_per_node, per_param * gpus_factor)
                       * additional_buffer_factor)
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        init_params = largest_layer_params if zero_init else total_params
        cpu_mem = init_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def zero_paper_bytes(total_params, stage, n_devices, *, offload_optimizer=False,
                     offload_param=False):
    """Model-state bytes per device in the ZeRO paper's accounting (2-byte params and grads,
    K=12 bytes of fp32 master + Adam moments): {"device": ..., "host": ...}.

    stage 0: 16Ψ, 1: 4Ψ + 12Ψ/N, 2: 2Ψ + 14Ψ/N, 3: 16Ψ/N. `offload_optimizer` moves the 12Ψ/N
    optimizer share to host memory; `offload_param` (stage 3) moves the 2Ψ/N params too.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage!r}; accepted: 0, 1, 2, 3")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param needs zero_optimization.stage=3, got stage={stage}")
    psi, n = total_params, n_devices
    params = 2 * psi / n if stage >= 3 else 2 * psi
    grads = 2 * psi / n if stage >= 2 else 2 * psi
    optim = 12 * psi / n if stage >= 1 else 12 * psi
    host = 0.0
    if offload_optimizer:
        host, optim = host + optim, 0.0
    if offload_param:
        host, params = host + params, 0.0
    return {"device": int(params + grads + optim), "host": int(host)}


@dataclasses.dataclass(frozen=True)
class FormulaRow:
    source: str        # "deepspeed" | "zero-paper"
    stage: int
    options: str       # e.g. "offload_optimizer=cpu"
    cpu_bytes: int | None
    gpu_bytes: int


def formula_rows(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                 additional_buffer_factor=1.5, stages=(0, 1, 2, 3)):
    """Every formula's estimate for one model and cluster, as rows for `format_formula_table`."""
    rows, n = [], num_gpus_per_node * num_nodes
    for stage in stages:  # DeepSpeed offloads only under ZeRO: no offload rows for stage 0
        offloads = [(False, False)] + ([(True, False)] if stage else []) + ([(True, True)] if stage == 3 else [])
        for opt, par in offloads:
            b = zero_paper_bytes(total_params, stage, n, offload_optimizer=opt, offload_param=par)
            rows.append(FormulaRow("zero-paper", stage, _offload_str(opt, par, stage), b["host"],
                                   b["device"]))
    ds = dict(num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
              additional_buffer_factor=additional_buffer_factor)
    if any(s in (1, 2) for s in stages):  # DeepSpeed has one estimator for stages 1 and 2
        for off in (True, False):
            cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, cpu_offload=off, **ds)
            rows.append(FormulaRow("deepspeed", 2, _offload_str(off, False, 2), cpu, gpu))
    if 3 in stages:
        for off, par in ((True, True), (True, False), (False, False)):
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, cpu_offload=off, cpu_offload_params=par,
                    zero_init=zero_init, **ds)
                rows.append(FormulaRow("deepspeed", 3,
                                       f"{_offload_str(off, par, 3)}, zero_init={int(zero_init)}",
                                       cpu, gpu))
    return rows


def _offload_str(opt, par, stage):
    s = f"offload_optimizer={'cpu' if opt else 'none'}"
    return s + (f", offload_param={'cpu' if par else 'none'}" if stage == 3 else "")


def format_formula_table(rows, total_params, largest_layer_params, num_gpus_per_node=1,
                         num_nodes=1):
    lines = [f"Model states for {total_params / 1e6:.2f}M params "
             f"({largest_layer_params / 1e6:.2f}M largest layer), {num_nodes} node(s) x "
             f"{num_gpus_per_node} GPU(s); no activations. GB here = 2**30 bytes, as DeepSpeed prints.",
             f"{'source':<11}{'stage':>6} | {'per CPU':>9} | {'per GPU':>9} | options"]
    for r in rows:
        cpu = "" if r.cpu_bytes is None else f"{r.cpu_bytes / GiB:7.2f}GB"
        lines.append(f"{r.source:<11}{r.stage:>6} | {cpu:>9} | {r.gpu_bytes / GiB:7.2f}GB | {r.options}")
    return "\n".join(lines)


def count_params(state) -> tuple[int, int]:
    """(total parameters, largest "layer") of an `nnx.State` / Module, as DeepSpeed counts them.

    DeepSpeed's layer is a torch module's own parameters. Here a layer is the parameters sharing
    a parent path; a leaf whose logical axes start with "layers" (a scanned stack) counts one slice.
    Leaves directly on the root count one by one (GPT-2's wte is its own nn.Embedding in torch).
    """
    from flax import nnx

    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    total, groups = 0, {}
    for path, var in nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state():
        shape = tuple(getattr(var, "shape", None) or getattr(var, "value", var).shape)
        n = math.prod(shape)
        total += n
        names = _logical_names(var)
        if names and names[0] == "layers" and shape:
            n //= shape[0]
        key = path[:-1] if len(path) > 1 else path
        groups[key] = groups.get(key, 0) + n
    return total, max(groups.values(), default=0)


def _logical_names(var):
    get = getattr(var, "get_metadata", None)
    meta = get() if get is not None else getattr(var, "metadata", {}) or {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key):
            return tuple(meta[key])
    return ()


# ---------------------------------------------------------------------------------------------
# 2. Ahead-of-time compiled memory


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
    def of(cls, compiled) -> "CompiledMemory":
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


def compiled_memory(compiled) -> CompiledMemory:
    return CompiledMemory.of(compiled)


def device_budget(device=None) -> int | None:
    """The allocator's limit for `device` (default: the first local device), or None (CPU)."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": GB, "gb": GB,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text) -> int:
    """"24GB" -> 24e9, "24GiB" -> 24 * 2**30, "1.5e9" -> 1500000000, 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 24GB, 22.5GiB or 2.4e10")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------------------------
# 3. Plans, the guard and the micro-batch search


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to run: ZeRO stage, offload, micro-batch per device, remat; with its compiled peak."""

    stage: int
    micro_batch: int
    offload_optimizer: bool = False
    offload_param: bool = False
    remat: bool | None = None  # None: as the model factory builds it
    peak_bytes: int | None = None
    host_bytes: int | None = None
    offload_ratio: float = 1.0  # offload_optimizer.ratio: the fraction offloaded (stage 3)

    def speed_key(self):
        """Smaller is faster, by a simple cost model: moving parameters to and from the host costs
        most, then moving the optimizer (in proportion to the offloaded fraction: on one H200,
        GPT-2 Large ran 37k tokens/s at ratio 0.25, 26k at 0.5, 18k fully offloaded), then
        recomputing activations (remat); within those a larger micro-batch keeps the GPU busier;
        lower stages issue fewer collectives."""
        return (self.offload_param, self.offload_ratio if self.offload_optimizer else 0.0,
                bool(self.remat), -self.micro_batch, self.stage)

    def config_patch(self) -> dict:
        """The DeepSpeed config keys this plan sets."""
        opt = {"device": "cpu" if self.offload_optimizer else "none"}
        if self.offload_optimizer and self.offload_ratio < 1.0:
            opt["ratio"] = self.offload_ratio
        zero = {"stage": self.stage, "offload_optimizer": opt}
        if self.stage == 3:
            zero["offload_param"] = {"device": "cpu" if self.offload_param else "none"}
        return {"train_micro_batch_size_per_gpu": self.micro_batch, "zero_optimization": zero}

    def describe(self) -> str:
        off = ("param+optimizer" if self.offload_param else
               "optimizer" if self.offload_optimizer else "none")
        if self.offload_optimizer and self.offload_ratio < 1.0:
            off += f" (ratio {self.offload_ratio:g})"
        remat = {None: "", True: ", remat", False: ", no remat"}[self.remat]
        peak = "" if self.peak_bytes is None else f": peak {fmt_bytes(self.peak_bytes)}"
        return f"stage {self.stage}, offload {off}, micro-batch {self.micro_batch}{remat}{peak}"

    __str__ = describe


def rank_plans(plans: Iterable[Plan]) -> list[Plan]:
    return sorted(plans, key=Plan.speed_key)


class WillNotFitError(MemoryError):
    """The compiled step needs more device memory than the budget; `plans` lists ones that fit."""

    def __init__(self, predicted_bytes: int, budget_bytes: int, plans: Sequence[Plan] = (),
                 what: str = "the training step"):
        self.predicted_bytes, self.budget_bytes = int(predicted_bytes), int(budget_bytes)
        self.plans = list(plans)
        lines = [f"{what} needs {fmt_bytes(predicted_bytes)} per device "
                 f"({predicted_bytes:,} bytes, from XLA's ahead-of-time memory analysis) but the "
                 f"budget is {fmt_bytes(budget_bytes)} ({budget_bytes:,} bytes)."]
        if self.plans:
            lines.append("These fit, fastest first (set them in the DeepSpeed config; with a smaller "
                         "micro-batch, raise gradient_accumulation_steps to keep train_batch_size):")
            lines += [f"  {i + 1}. {p.describe()}  {p.config_patch()}" for i, p in enumerate(self.plans)]
        else:
            lines.append("No plan that was tried fits: use more devices (ZeRO stage 3 divides "
                         "model states by the device count), a shorter sequence, activation "
                         "checkpointing (remat), or offload_optimizer / offload_param to cpu.")
        super().__init__("\n".join(lines))


def check_fits(compiled, budget_bytes=None, *, plans=(), what="the training step") -> CompiledMemory:
    """Raise `WillNotFitError` if `compiled`'s predicted per-device peak exceeds the budget.

    compiled: a `jax.stages.Compiled` (or its memory_analysis(), or a CompiledMemory).
    budget_bytes: default `device_budget()`; with no budget known (CPU) nothing is checked.
    plans: plans that fit, or a zero-argument callable returning them (called only on failure,
    since planning compiles more programs).
    Returns the CompiledMemory so the caller can log it.
    """
    mem = CompiledMemory.of(compiled)
    if budget_bytes is None:
        budget_bytes = device_budget()
    if budget_bytes is not None and mem.peak > budget_bytes:
        if callable(plans):
            plans = plans()
        raise WillNotFitError(mem.peak, budget_bytes, rank_plans(p for p in plans
                                                                 if p.peak_bytes is None
                                                                 or p.peak_bytes <= budget_bytes),
                              what)
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
    step_one = lo > start + 1  # a guess that fits: try its successor first, then double
    while hi is None:
        nxt, step_one = min(lo + 1 if step_one else lo * 2, limit), False
        if nxt <= lo:
            return lo, peaks
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, peaks


# -- building the real step for a config, compiled, allocating nothing --------------------------


def _with(cfg_dict: dict, **updates) -> dict:
    out = copy.deepcopy(dict(cfg_dict))
    for key, value in updates.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _plain_batch_keys(cfg_dict):
    # the batch trio is recomputed from the micro-batch: drop a stale train_batch_size
    out = copy.deepcopy(dict(cfg_dict))
    out.pop("train_batch_size", None)
    if out.get("gradient_accumulation_steps") == "auto":
        out["gradient_accumulation_steps"] = 1
    return out


def _accepts_remat(factory) -> bool:
    try:
        return "remat" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _model_source(model_factory, remat):
    """What to hand the engine: a Module as is, else a zero-argument callable, which the engine
    traces under nnx.eval_shape (so nothing is allocated here)."""
    from flax import nnx

    if isinstance(model_factory, nnx.Module) or remat is None:
        return model_factory
    return lambda: model_factory(remat=remat)


def default_loss_fn():
    from zerojax.models.gpt2 import gpt2_loss

    return gpt2_loss


def abstract_engine(model, cfg, *, loss_fn, mesh=None):
    """An Engine whose state is ShapeDtypeStructs (with shardings): it can lower and compile the
    real train step, but holds no device memory. Prefers the engine's own abstract mode."""
    from zerojax import engine as E

    make = getattr(E, "abstract_engine", None)
    if make is not None:
        return make(model, cfg, loss_fn=loss_fn, mesh=mesh)
    return _AbstractEngine(model, cfg, loss_fn=loss_fn, mesh=mesh)


def _abstract_engine_class():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from zerojax import engine as E

    class AbstractEngine(E.Engine):
        # Fallback while the engine has no abstract mode: run its own state init under
        # jax.eval_shape (shapes and dtypes, no buffers) and attach the engine's shardings.
        def _init_state(self, init_fn, pure_params, pure_rest):
            shapes = jax.eval_shape(lambda: E.Engine._init_state(self, init_fn, pure_params, pure_rest))
            if hasattr(type(self), "state_shardings"):  # the engine's own map, memory kinds included
                return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                    shapes, self.state_shardings)
            rep = NamedSharding(self.mesh, P())
            shardings = shapes._replace(
                params=self.shardings.params,
                master=None if shapes.master is None else self.shardings.master,
                opt_state=self.opt_shardings, rest=self.rest_shardings,
                **{f: rep for f in shapes._fields
                   if f not in ("params", "master", "opt_state", "rest")})
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)

    return AbstractEngine


def _AbstractEngine(*args, **kwargs):  # noqa: N802 - built lazily: engine imports are heavy
    global _ABSTRACT
    if _ABSTRACT is None:
        _ABSTRACT = _abstract_engine_class()
    return _ABSTRACT(*args, **kwargs)


_ABSTRACT = None


def step_memory(model_factory, cfg_dict, seq_len, micro_batch, *, remat=None, loss_fn=None,
                mesh=None, batch_fn=None) -> CompiledMemory:
    """Compile the engine's real training step for `cfg_dict` at `micro_batch`; read its memory.

    model_factory: zero-argument callable returning an nnx.Module (traced, never run: nothing is
    allocated), one accepting `remat=bool` to vary activation checkpointing, or a built Module.
    batch_fn(global_batch, seq_len) -> a tree of ShapeDtypeStructs (default GPT-2's input_ids).
    Results are memoised per (factory, config, shapes, mesh) for the life of the process.
    """
    import json

    import jax
    import jax.numpy as jnp

    from zerojax.config import load_config

    n_data = _data_size(mesh, cfg_dict)
    cfg_dict = _with(_plain_batch_keys(cfg_dict), train_micro_batch_size_per_gpu=micro_batch)
    key = (model_factory, json.dumps(cfg_dict, sort_keys=True, default=str), seq_len, remat,
           loss_fn, batch_fn, None if mesh is None else (tuple(mesh.shape.items()),
                                                         tuple(d.id for d in mesh.devices.flat)),
           n_data)
    try:
        hit = _STEP_MEMORY.get(key)
    except TypeError:  # an unhashable factory: no memo
        key, hit = None, None
    if hit is not None:
        return hit
    cfg = load_config(cfg_dict, world_size=n_data)
    eng = abstract_engine(_model_source(model_factory, remat), cfg,
                          loss_fn=loss_fn or default_loss_fn(), mesh=mesh)
    if batch_fn is None:
        batch = {"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, seq_len), jnp.int32)}
    else:
        batch = batch_fn(cfg.train_batch_size, seq_len)
    mem = CompiledMemory.of(compile_engine_step(eng, batch, planning=True))
    if key is not None:
        _STEP_MEMORY[key] = mem
    return mem


_STEP_MEMORY: dict = {}

# Memory analysis comes from XLA's HLO passes and buffer assignment, before the CPU backend's
# LLVM code generation; skipping LLVM's optimisations leaves the numbers unchanged and compiles
# faster. Used only for planning compiles on CPU (virtual devices), never for a step that runs.
_FAST_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_engine_step(eng, batch, *, planning=False):
    """The engine's AOT-compiled train step (`jax.stages.Compiled`) for `batch` (arrays or
    ShapeDtypeStructs). For a real engine this is the engine's cached compile (the one its steps
    can reuse); `planning=True` compiles a throwaway copy, faster on CPU."""
    import jax

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    lower = getattr(eng, "lower_step", None)
    if planning and lower is not None:
        options = _FAST_CPU_OPTIONS if jax.default_backend() == "cpu" else None
        return lower(shapes).compile(compiler_options=options)
    for name in ("compiled_step", "compile_train_step"):
        fn = getattr(eng, name, None)
        if fn is not None:
            return fn(shapes)
    if lower is not None:
        return lower(shapes).compile()
    raise NotImplementedError(
        "zerojax.memory needs Engine.compiled_step(batch_shapes) -> jax.stages.Compiled; "
        f"{type(eng).__name__} has none")


def _data_size(mesh, cfg_dict):
    """The batch rule's world size: every device of the data x tensor mesh (DeepSpeed 0.19.8 counts
    tensor ranks too; zerojax.partition.batch_world_size)."""
    import jax

    if mesh is not None:
        shape = dict(mesh.shape)
        return int(shape.get("data", 1)) * int(shape.get("tensor", 1))
    return jax.device_count()


def fit_micro_batch(model_factory, cfg_dict, budget, seq_len, *, remat=None, loss_fn=None,
                    mesh=None, batch_fn=None, limit=1024) -> int:
    """The largest `train_micro_batch_size_per_gpu` whose compiled step fits `budget` bytes
    (`"auto"` in a config means this). Raises WillNotFitError if micro-batch 1 does not fit."""
    budget = parse_bytes(budget)
    m, peaks = largest_fitting(
        lambda mb: step_memory(model_factory, cfg_dict, seq_len, mb, remat=remat, loss_fn=loss_fn,
                               mesh=mesh, batch_fn=batch_fn).peak, budget, limit=limit)
    if m == 0:
        raise WillNotFitError(peaks[1], budget, (), what="micro-batch 1")
    return m


def _offload_choice(offload: str) -> tuple[str, float]:
    """"none" | "optimizer" | "optimizer:R" | "param" -> (kind, offload_optimizer.ratio)."""
    kind, _, ratio = offload.partition(":")
    if kind not in ("none", "optimizer", "param") or (ratio and kind != "optimizer"):
        raise ValueError(f"offload choice {offload!r}: use none, optimizer, optimizer:RATIO or param")
    return kind, float(ratio) if ratio else 1.0


def _zero_choice(cfg_dict, stage, offload):
    """cfg_dict with zero_optimization set to `stage` and offload "none" | "optimizer" |
    "optimizer:R" (offload_optimizer.ratio R) | "param" (other keys of the offload sections, e.g.
    pin_memory, kept)."""
    kind, ratio = _offload_choice(offload)
    cfg = copy.deepcopy(dict(cfg_dict))
    zero = cfg["zero_optimization"] = dict(cfg.get("zero_optimization") or {}, stage=stage)
    for section, on in (("offload_optimizer", kind in ("optimizer", "param")),
                        ("offload_param", kind == "param")):
        if on:
            zero[section] = dict(zero.get(section) or {}, device="cpu")
        elif section in zero:
            zero[section] = dict(zero[section] or {}, device="none")
    if "offload_optimizer" in zero:
        zero["offload_optimizer"]["ratio"] = ratio
    return cfg


# partial optimizer offload (DeepSpeed's offload_optimizer.ratio, stage 3) sits between none and full
DEFAULT_OFFLOADS = ("none", "optimizer:0.5", "optimizer", "param")


def plan(model_factory, cfg_dict, budget, seq_len, *, stages=(0, 1, 2, 3),
         offloads=DEFAULT_OFFLOADS, remat=(False, True), micro_batch=None,
         loss_fn=None, mesh=None, batch_fn=None, limit=64, on_result=None) -> list[Plan]:
    """Every (stage, offload, remat) whose compiled step fits `budget`, fastest first.

    micro_batch: an int checks that micro-batch only; None / "auto" finds the largest that fits
    (up to `limit`) for each choice. remat values are passed to the factory as `remat=`; a factory
    without that keyword is used as it is. offload "param" and "optimizer:R" (a ratio < 1) apply
    to stage 3 only, as in DeepSpeed.
    on_result(plan, fits): called for every choice tried (progress output).
    """
    budget = parse_bytes(budget)
    remats = tuple(remat) if _accepts_remat(model_factory) else (None,)
    fitting = []
    for stage in stages:
        for off in offloads:
            kind, ratio = _offload_choice(off)
            if (kind == "param" or ratio < 1.0) and stage != 3:
                continue
            if kind != "none" and stage == 0:
                continue  # DeepSpeed offloads the optimizer only under ZeRO (stage >= 1)
            cfg = _zero_choice(cfg_dict, stage, off)
            for r in remats:
                kw = dict(remat=r, loss_fn=loss_fn, mesh=mesh, batch_fn=batch_fn)
                mems: dict[int, CompiledMemory] = {}

                def peak_of(mb, cfg=cfg, kw=kw, mems=mems):
                    mems[mb] = step_memory(model_factory, cfg, seq_len, mb, **kw)
                    return mems[mb].peak

                try:
                    if micro_batch in (None, "auto"):
                        mb, _ = largest_fitting(peak_of, budget, limit=limit)
                    else:
                        mb = micro_batch if peak_of(micro_batch) <= budget else 0
                except NotImplementedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a choice the engine rejects is not a plan
                    if on_result:
                        on_result(Plan(stage, 0, kind != "none", kind == "param", r,
                                       offload_ratio=ratio), repr(e))
                    continue
                p = Plan(stage, mb or min(mems), kind != "none", kind == "param", r,
                         mems[mb or min(mems)].peak, mems[mb or min(mems)].host_peak, ratio)
                if on_result:
                    on_result(p, bool(mb))
                if mb:
                    fitting.append(p)
    return rank_plans(fitting)


def engine_model_factory(engine):
    """A zero-argument factory rebuilding `engine`'s model from its graph and shapes (zeros when
    traced): lets the planner compile variants of a built engine without its host copy."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    plan_ = engine.plan

    def fill(s):
        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
        return jnp.zeros(s.shape, s.dtype)

    def factory():
        return nnx.merge(plan_.graphdef, jax.tree.map(fill, plan_.param_template),
                         jax.tree.map(fill, plan_.rest_template))

    return factory


def _batch_fn_like(batch_shapes):
    import jax

    return lambda rows, seq_len: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch_shapes)


def engine_plans(engine, batch_shapes, budget=None, *, stages=(0, 1, 2, 3),
                 offloads=DEFAULT_OFFLOADS) -> list[Plan]:
    """Plans that fit `budget` for a built engine's model, loss, mesh and batch shapes: for each
    stage / offload the largest micro-batch up to the engine's own. Remat is the model's as built."""
    import jax

    budget = device_budget() if budget is None else parse_bytes(budget)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_shapes)
    return plan(engine_model_factory(engine), engine.cfg.to_dict(), budget, None, stages=stages,
                offloads=offloads, remat=(None,), micro_batch=None, loss_fn=engine.loss_fn,
                mesh=engine.mesh, batch_fn=_batch_fn_like(shapes),
                limit=int(engine.cfg.train_micro_batch_size_per_gpu))


def guard(engine, batch_shapes, budget=None, **plan_kw) -> CompiledMemory | None:
    """The check an Engine runs before its first step: compile the step for `batch_shapes`
    (the engine's cached AOT compile) and raise WillNotFitError, listing the plans that fit, if
    its predicted peak exceeds `budget` (default: the device's bytes_limit; none on CPU)."""
    import jax

    budget = device_budget() if budget is None else parse_bytes(budget)
    if budget is None:
        return None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_shapes)
    return check_fits(compile_engine_step(engine, shapes), budget,
                      plans=lambda: engine_plans(engine, shapes, budget, **plan_kw))


__all__ = [
    "estimate_zero2_model_states_mem_needs", "estimate_zero3_model_states_mem_needs",
    "zero_paper_bytes", "FormulaRow", "formula_rows", "format_formula_table", "count_params",
    "CompiledMemory", "compiled_memory", "device_budget", "parse_bytes", "fmt_bytes", "Plan",
    "rank_plans", "WillNotFitError", "check_fits", "largest_fitting", "step_memory",
    "compile_engine_step", "abstract_engine", "engine_model_factory", "engine_plans", "guard",
    "fit_micro_batch", "plan", "GiB", "GB",
]
