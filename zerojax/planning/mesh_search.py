"""The planner's mesh search: which data x tensor x pipe split of N devices trains fastest in a budget.

For a device count it lists the mesh shapes the model allows (tensor sizes dividing the heads and
the MLP width; pipe sizes dividing the layers), and for each the ZeRO
stages (pipelines: 0 and 1, DeepSpeed's rule) and micro-batch x accumulation splits of the global
batch (DeepSpeed's batch rule: train_batch_size = micro x accumulation x data x tensor), for
pipelines with and without per-iteration checkpoints, and for a model taking `mlp_tile` on rows
longer than `planner.MLP_TILE` with and without a tiled MLP. Each candidate gets

- a per-device peak: the compiled step's (`planner.step_memory`, nothing allocated) when
  `compile=True`, else the formula `estimate.mesh_peak_bytes` (states + activations + logits,
  activations calibrated on one compiled GPU step, see COMPILE_MARGIN); `MeshPlan.peak_source`
  says which;
- a step time and tokens/s per device (`estimate.predict_mesh_step_time`: FLOPs at the matmul
  ceiling and micro-batch efficiency, ZeRO and tensor-parallel collectives, the pipeline's bubble
  (S - 1) / (M + S - 1) and per-iteration costs).

The fitting candidates are ranked fastest first, one per (mesh shape, ZeRO stage): the fastest
micro-batch of each. `MeshPlan.config_patch()` is the DeepSpeed keys to set.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from flax import nnx

from zerojax.model import model_dims
from zerojax.options import EngineOptions
from zerojax.planning import estimate as est
from zerojax.planning import planner
from zerojax.planning.memory import fmt_bytes, parse_bytes
from zerojax.sharding.partition import make_mesh

# a candidate whose formula peak exceeds the budget by more than this is not compiled. On the
# measured 2 x H200 rows the formula (estimate.mesh_peak_bytes, calibrated on one of them) erred low
# by up to 16% (pipelines) and high by at most 0.4% (TP 2); the margin leaves room for what was not
# measured (remat, other models).
COMPILE_MARGIN = 0.2


@dataclasses.dataclass(frozen=True)
class MeshModel:
    """What the mesh search needs to know of a model: its shape for the step-time model and the
    sizes the tensor / pipe axes must divide (`mesh_model_of` reads them from the model's dims)."""

    shape: est.ModelShape
    heads: int     # attention (query) heads
    vocab: int     # rows of the embedding / LM head (padded)
    mlp: int       # the MLP's hidden width

    def tensor_problem(self, t: int) -> str | None:
        # heads and MLP width must split (`partition.tensor_specs` refuses otherwise); a vocabulary
        # the size does not divide stays whole with a warning, GQA's kv heads stay whole by design
        # (partition.SPLIT_IF_DIVISIBLE); a size the model does not say (0) is not checked
        for name, n in (("attention heads", self.heads), ("MLP width", self.mlp)):
            if n and n % t:
                return f"tensor {t} does not divide the {n} {name}"
        return None

    def pipe_problem(self, p: int) -> str | None:
        if self.shape.layers % p:
            return f"pipe {p} does not divide the {self.shape.layers} layers"
        return None


def gpt2_mesh_model(config, seq_len: int) -> MeshModel:
    """MeshModel of a zerojax GPT-2 from its config alone (`models.gpt2.GPT2Config`: GPT-2's closed
    form, with padded vocabulary rows and tied embeddings); `mesh_model_of` reads the same numbers
    off any model."""
    d, L, V = config.n_embd, config.n_layer, config.padded_vocab_size
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    total = V * d + config.n_positions * d + L * block + 2 * d
    mlp_kernels = L * 2 * d * 4 * d  # c_fc [d, 4d] and c_proj [4d, d] a layer
    return MeshModel(est.ModelShape(total, L * block, L, d, seq_len, attn_width=d, mlp_params=mlp_kernels),
                     config.n_head, V, 4 * d)


def mesh_model_of(model_factory, seq_len: int) -> MeshModel:
    """MeshModel of a factory's (or a Module's) model, abstract (nothing allocated): its shape
    (`planner.model_shape`) and heads, vocabulary and MLP width from its dims
    (`zerojax.model.model_dims`). A model whose layers cannot be found is an error: the pipe
    sizes must divide them."""
    source = planner.model_source(model_factory, **planner.factory_kwargs(model_factory))
    model = source if isinstance(source, nnx.Module) else nnx.eval_shape(source)
    shape = planner.model_shape(model, seq_len)
    if not shape.layers:
        raise ValueError(f"the mesh search needs the layers of {type(model).__name__}, and it shows none (no "
                         "list of same-structure blocks, no stacked layer axis): give it a `model_dims()` "
                         "(zerojax.model.ModelDims) or pass model=MeshModel(...)")
    dims = model_dims(model)
    return MeshModel(shape, dims.heads, dims.vocab, dims.mlp)


def mesh_shapes(devices: int, model: MeshModel, *, tensor_sizes=None, pipe_sizes=None) -> tuple[list, list]:
    """([(data, tensor, pipe)] the model allows on `devices`, [((data, tensor, pipe), why not)])."""
    ok, refused = [], []
    for t in (tensor_sizes or _divisors(devices)):
        for p in (pipe_sizes or _divisors(devices)):
            if devices % (t * p):
                continue
            why = model.tensor_problem(t) if t > 1 else None
            why = why or (model.pipe_problem(p) if p > 1 else None)
            shape = (devices // (t * p), t, p)
            (refused.append((shape, why)) if why else ok.append(shape))
    return ok, refused


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """One mesh shape with its ZeRO stage and micro-batch, its peak per device and predicted speed.

    checkpoint_interval: pipeline.activation_checkpoint_interval (pipelines only; 0 = none).
    peak_source: "compiled" (the real step, compiled abstractly) or "estimated" (the formula).
    mlp_tile: positions per piece of the tiled MLP, None (untiled) or AS_BUILT (a model without
    `mlp_tile`); as `planner.Plan`'s, a model-build keyword, not in `config_patch`.
    """

    data: int
    tensor: int
    pipe: int
    stage: int
    micro_batch: int
    grad_accum: int
    checkpoint_interval: int = 0
    peak_bytes: int | None = None
    peak_source: str | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None   # per device
    bubble: float = 0.0
    mlp_tile: int | str | None = planner.AS_BUILT

    @property
    def devices(self) -> int:
        return self.data * self.tensor * self.pipe

    def config_patch(self) -> dict:
        """The DeepSpeed keys this plan sets (merge with `apply`)."""
        pipeline = {"stages": self.pipe}
        if self.pipe > 1:
            pipeline["activation_checkpoint_interval"] = self.checkpoint_interval
        return {"train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.grad_accum,
                "zero_optimization": {"stage": self.stage},
                "tensor_parallel": {"autotp_size": self.tensor},
                "pipeline": pipeline}

    def apply(self, cfg_dict: dict) -> dict:
        """`cfg_dict` with this plan's keys merged (other keys of each section kept; a stale
        train_batch_size dropped: DeepSpeed recomputes it from micro x accumulation x ranks)."""
        out = planner.merge_config(cfg_dict, self.config_patch())
        out.pop("train_batch_size", None)
        return out

    def layout(self) -> str:
        parts = [f"data {self.data}"] + [f"{k} {v}" for k, v in (("tensor", self.tensor), ("pipe", self.pipe)) if v > 1]
        return " x ".join(parts)

    def describe(self) -> str:
        text = (f"{self.layout()}, ZeRO-{self.stage}, micro-batch {self.micro_batch} x {self.grad_accum}"
                + (f", checkpoint every {self.checkpoint_interval} layers" if self.checkpoint_interval else "")
                + (f", MLP tile {self.mlp_tile}" if planner.is_tiled(self.mlp_tile) else ""))
        if self.peak_bytes is not None:
            text += f": peak {fmt_bytes(self.peak_bytes)} ({self.peak_source})"
        if self.tokens_per_s is not None:
            text += f", predicted {self.tokens_per_s:,.0f} tokens/s per device"
        if self.bubble:
            text += f" (bubble {self.bubble:.1%})"
        return text

    __str__ = describe

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layout": self.layout(), "config_patch": self.config_patch(),
                "describe": self.describe()}


def predict(model: MeshModel, plan: MeshPlan, *, precision: str = "bf16", remat: str | None = None,
            optimizer: str | None = "adamw", hardware: est.Hardware = est.H200, options=None) -> MeshPlan:
    """`plan` with the step-time model's prediction and (if it has none) the formula's peak
    (with the state EngineOptions `options` shrinks: master_split, adam_mu_dtype) for its MLP tile."""
    kw = dict(micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, n_data=plan.data,
              n_tensor=plan.tensor, n_pipe=plan.pipe, stage=plan.stage, precision=precision, remat=remat,
              checkpoint_interval=plan.checkpoint_interval)
    tiled = planner.is_tiled(plan.mlp_tile)
    t = est.predict_mesh_step_time(model.shape, hardware=hardware, tiled_mlp=tiled, **kw)
    out = dataclasses.replace(plan, step_s=t.step_s, tokens_per_s=t.tokens_per_s,
                              bubble=est.pipeline_bubble(plan.pipe, plan.grad_accum))
    if plan.peak_bytes is None:
        opts = options or EngineOptions()
        peak = est.mesh_peak_bytes(model.shape, heads=model.heads, vocab=model.vocab, optimizer=optimizer,
                                   master_split=planner.device_split(opts, precision, False),
                                   adam_mu_dtype=opts.adam_mu_dtype, mlp_tile=plan.mlp_tile if tiled else None, **kw)
        out = dataclasses.replace(out, peak_bytes=peak["total"], peak_source="estimated")
    return out


def candidates(model: MeshModel, devices: int, global_batch: int, *, stages=(0, 1, 2, 3), micro_batch=None,
               tensor_sizes=None, pipe_sizes=None, tiles=(planner.AS_BUILT,)) -> tuple[list[MeshPlan], list]:
    """Every (mesh shape, ZeRO stage, micro-batch x accumulation, pipeline checkpoints, MLP tile of
    `tiles`) choice for `devices` keeping `global_batch` rows a step, and [(what, why not)] for the
    shapes refused."""
    shapes, refused = mesh_shapes(devices, model, tensor_sizes=tensor_sizes, pipe_sizes=pipe_sizes)
    out = []
    for data, t, p in shapes:
        ranks = data * t  # DeepSpeed's batch rule counts tensor ranks; pipeline stages are not ranks
        if global_batch % ranks:
            refused.append(((data, t, p), f"{global_batch} rows do not split over data {data} x tensor {t}"))
            continue
        rows = global_batch // ranks
        micros = [m for m in _divisors(rows) if micro_batch in (None, "auto") or m == int(micro_batch)]
        ok_stages = [s for s in stages if p == 1 or s <= 1]  # ZeRO-2/3 refuse pipelines (DeepSpeed)
        if not ok_stages:
            refused.append(((data, t, p), f"ZeRO stages {list(stages)} refuse pipeline.stages > 1 (use 0 or 1)"))
            continue
        if data == 1:  # one data rank: no stage partitions anything
            ok_stages = ok_stages[:1]
        per_stage_layers = model.shape.layers // p
        intervals = (0, per_stage_layers) if p > 1 else (0,)
        for s in ok_stages:
            for m in micros:
                for c in intervals:
                    out += [MeshPlan(data, t, p, s, m, rows // m, c, mlp_tile=tile) for tile in tiles]
    return out, refused


@dataclasses.dataclass
class MeshSearch:
    """`plans`: the fitting choices, fastest predicted first, one per (mesh shape, ZeRO stage);
    `tried`: (plan, outcome) for every candidate; `refused`: ((data, tensor, pipe), why)."""

    plans: list
    tried: list
    refused: list
    budget: int


def search_mesh(model_factory, cfg_dict, budget, seq_len, *, devices: int, global_batch: int | None = None,
                stages=(0, 1, 2, 3), micro_batch=None, tensor_sizes=None, pipe_sizes=None, compile: bool = False,
                remat=None, precision: str | None = None, hardware: est.Hardware = est.H200, loss_fn=None,
                batch_fn=None, max_compiles: int = 12, model: MeshModel | None = None,
                on_result: Callable | None = None, options=None, mlp_tile=None) -> MeshSearch:
    """Rank the data x tensor x pipe shapes of `devices` devices (see the module's docstring).

    global_batch: rows per optimizer step (default: the config's train_batch_size, else micro x
    accumulation x devices). compile: read each candidate's peak from its compiled step (needs
    `devices` jax devices: GPUs, or virtual CPU devices) for the fastest candidates first until
    every (shape, stage) has one that fits or `max_compiles` compiles were spent; otherwise the
    formula. remat: the model's remat_policy (as the factory builds it by default when None).
    precision: "bf16" | "fp16" | "fp32" for the step-time model (default: the config's).
    options: the EngineOptions the run will use (`planner.search`'s): in the formula's states and
    in every compile. mlp_tile: the MLP tilings to try where the factory takes `mlp_tile=`
    (`planner.mlp_tile_choices`; default: untiled, and on rows longer than MLP_TILE also
    `default_mlp_tile`): a tiled candidate comes after the untiled one of its mesh shape, stage and
    micro-batch (its MLP reruns), so it is chosen where it is the fastest that fits.
    """
    budget = parse_bytes(budget)
    if compile:
        _check_devices(devices)
    model = model or mesh_model_of(model_factory, seq_len)
    global_batch = global_batch or _global_batch(cfg_dict, devices)
    precision = precision or planner.configured_precision(cfg_dict)
    optimizer = (cfg_dict.get("optimizer") or {}).get("type") or "adamw"
    cands, refused = candidates(model, devices, global_batch, stages=stages, micro_batch=micro_batch,
                                tensor_sizes=tensor_sizes, pipe_sizes=pipe_sizes,
                                tiles=planner.mlp_tile_choices(model_factory, mlp_tile, seq_len, cfg_dict))
    predicted = sorted((predict(model, c, precision=precision, remat=remat, optimizer=optimizer, hardware=hardware,
                                options=options)
                        for c in cands), key=lambda p: (p.step_s, p.stage, -p.grad_accum))
    tried, fitting, done, compiles = [], [], set(), 0
    for p in predicted:
        key = (p.data, p.tensor, p.pipe, p.stage)
        if key in done:
            outcome = "skipped: a faster choice of its mesh shape and stage fits"
        elif p.peak_bytes > budget * (1 + (COMPILE_MARGIN if compile else 0)):
            outcome = f"does not fit (estimated {fmt_bytes(p.peak_bytes)})"
        elif compile and compiles >= max_compiles:
            outcome = "not compiled: max_compiles spent"
        else:
            if compile:
                compiles += 1
                try:
                    m = compiled_peak(model_factory, cfg_dict, p, seq_len, remat=remat, loss_fn=loss_fn,
                                      batch_fn=batch_fn, options=options)
                except Exception as e:  # noqa: BLE001 - a choice the engine rejects is not a plan
                    tried.append((p, f"failed: {type(e).__name__}: {e}"))
                    if on_result:
                        on_result(*tried[-1])
                    continue
                p = dataclasses.replace(p, peak_bytes=m.peak, peak_source="compiled")
            fits = p.peak_bytes <= budget
            outcome = "fits" if fits else "does not fit"
            if fits:
                fitting.append(p)
                done.add(key)
        tried.append((p, outcome))
        if on_result:
            on_result(*tried[-1])
    return MeshSearch(sorted(fitting, key=lambda p: p.step_s), tried, refused, budget)


def compiled_peak(model_factory, cfg_dict, plan: MeshPlan, seq_len, *, remat=None, loss_fn=None, batch_fn=None,
                  options=None):
    """The compiled step's memory (`planner.step_memory`) for `plan` on the first plan.devices
    devices, with the config's keys set as `plan.apply` writes them."""
    _check_devices(plan.devices)
    mesh = make_mesh(data=plan.data, tensor=plan.tensor, pipe=plan.pipe, devices=jax.devices()[:plan.devices])
    return planner.step_memory(model_factory, plan.apply(cfg_dict), seq_len, plan.micro_batch,
                               remat=planner.AS_BUILT if remat is None else remat, grad_accum=plan.grad_accum,
                               loss_fn=loss_fn, mesh=mesh, batch_fn=batch_fn, options=options,
                               mlp_tile=plan.mlp_tile)


def _check_devices(n: int) -> None:
    if jax.device_count() < n:
        raise ValueError(f"compiling a {n}-device mesh needs {n} jax devices, this process sees "
                         f"{jax.device_count()} ({jax.default_backend()}): run on the GPUs, or on CPU with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (`zerojax plan --aot --cpu`)")


def _global_batch(cfg_dict, devices) -> int:
    tbs, mb, ga = (cfg_dict.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                             "gradient_accumulation_steps"))
    if isinstance(tbs, int):
        return tbs
    mb = mb if isinstance(mb, int) else 8
    return mb * (ga if isinstance(ga, int) else 1) * devices


def rank_table(rows: list[tuple[str, float, float]]) -> list[tuple[str, int, int]]:
    """[(name, predicted tokens/s, measured tokens/s)] -> [(name, predicted rank, measured rank)]
    (1 = fastest), and nothing else: the two orders side by side."""
    pred = {n: i for i, (n, _, _) in enumerate(sorted(rows, key=lambda r: -r[1]), 1)}
    meas = {n: i for i, (n, _, _) in enumerate(sorted(rows, key=lambda r: -r[2]), 1)}
    return [(n, pred[n], meas[n]) for n, _, _ in rows]


def kendall_tau(a: list, b: list) -> float:
    """Kendall's rank correlation of two rankings of the same items (1: same order, -1: reversed)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += math.copysign(1, (a[i] - a[j]) * (b[i] - b[j])) if (a[i] - a[j]) * (b[i] - b[j]) else 0
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


__all__ = ["MeshModel", "MeshPlan", "MeshSearch", "gpt2_mesh_model", "mesh_model_of", "mesh_shapes",
           "candidates", "predict", "search_mesh", "compiled_peak", "rank_table", "kendall_tau"]
