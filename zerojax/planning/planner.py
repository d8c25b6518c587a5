"""The planner: under a device-memory budget, the fastest way to train, found in seconds.

It explores what buys memory, cheapest loss of speed first: activation checkpointing (the remat
policies the model offers), a tiled MLP on long rows (where the model takes `mlp_tile`),
precision (when the config leaves it to "auto"), a smaller micro-batch with
gradient_accumulation_steps raised to keep the global batch, then the ZeRO stage, then offload.
Every candidate gets a predicted step time (`zerojax.planning.estimate`: FLOPs with
recompute at the matmul ceiling, collectives, host<->device copies); candidates are tried in that
order, pruned first by formula (model states alone over the budget) and by dominance (a choice
that holds at least as much as one that did not fit in every dimension is not compiled), then
compiled (the engine's real step, abstract: nothing allocated) until `max_plans` fit, at most one
per speed tier (precision, remat, micro-batch): the first that fits is its tier's fastest, so
slower stage / offload variants of it are not compiled. Compiles are memoised per process.

This module imports the engine; the engine never imports it. `zerojax.shard` hands an engine
`engine_plans`, through which its memory guard lists plans.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax import pinned_pool
from zerojax.config import REMAT_POLICY_NAMES, load_config
from zerojax.engine import engine as E
from zerojax.engine import offload_choice
from zerojax.model import LAYERS, model_dims
from zerojax.models import grouped_matmul
from zerojax.options import EngineOptions
from zerojax.planning import estimate as est
from zerojax.planning import memory as mem
from zerojax.planning.memory import CompiledMemory, WillNotFitError, fmt_bytes, parse_bytes
from zerojax.planning.plans import (
    AS_BUILT,
    DEFAULT_OFFLOADS,
    DTYPES,
    MLP_TILE,
    REMAT_CHOICES,
    Candidate,
    Plan,
    Search,
    is_tiled,
    merge_config,
    offload_kind,
    offload_rank,
    rank_plans,
    remat_keeps_at_least,
    tile_keeps_at_least,
    valid_stage,
    zero_choice,
)
from zerojax.sharding import partition

# partial optimizer offload (DeepSpeed's offload_optimizer.ratio, stage 3) sits between none and full
# positions per piece of the tiled MLP the planner tries on rows longer than this: a piece of 2048
# positions keeps each MLP matmul large enough to run near the matmul ceiling, while the [B, T,
# intermediate] activations shrink T / 2048 times (ALST tiles about one hidden size's worth)
# a candidate whose estimated peak (from a compiled neighbour) exceeds the budget by more than
# this is not compiled; estimates scaled down to a smaller micro-batch err low (see search)
ESTIMATE_MARGIN = 0.05


# ---------------------------------------------------------------------------------------------
# Plans


# ---------------------------------------------------------------------------------------------
# Compiling a candidate (abstract engine: shapes only, nothing allocated)


def _params_of(factory) -> set:
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return set()


def factory_kwargs(factory, remat=AS_BUILT, precision=None, mlp_tile=AS_BUILT) -> dict:
    """Keyword arguments for `factory` that build the `remat` / `precision` / `mlp_tile` variant;
    a factory without `remat_policy` (or the older `remat=bool`) / `dtype` / `mlp_tile` keywords
    is used as it is."""
    names, kw = _params_of(factory), {}
    if mlp_tile != AS_BUILT and "mlp_tile" in names:
        kw["mlp_tile"] = mlp_tile
    if remat != AS_BUILT:
        if "remat_policy" in names:
            kw["remat_policy"] = remat
        elif "remat" in names:
            kw["remat"] = remat is not None
    if precision is not None and "dtype" in names:
        kw["dtype"] = DTYPES[precision]
    return kw


def model_source(factory, **kw):
    """What to hand the engine: a Module as is, else a zero-argument callable, which the engine
    traces under nnx.eval_shape (so nothing is allocated here)."""
    if isinstance(factory, nnx.Module) or not kw:
        return factory
    return lambda: factory(**kw)


def default_loss_fn():
    """The loss the planner compiles where it is given none: `lm_loss`."""
    return lm_loss


def lm_loss(model, batch):
    """Next-token cross entropy, fp32, of a language model on batch["input_ids"] [B, T]: its
    registered family's loss (`zerojax.models.registry`: GPT-2's, the Llama family's, ...), else
    the mean over `model(input_ids)`'s logits [B, T, vocab] against the next tokens."""
    from zerojax.models import registry

    family = registry.for_model(model)
    if family is not None:
        return family.loss(model, batch)
    ids = batch["input_ids"]
    logp = jax.nn.log_softmax(jnp.asarray(model(ids[:, :-1]), jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def _plain_batch_keys(cfg_dict, micro_batch, grad_accum=None):
    # the batch trio is recomputed from micro-batch x accumulation: drop a stale train_batch_size
    out = copy.deepcopy(dict(cfg_dict))
    out.pop("train_batch_size", None)
    out["train_micro_batch_size_per_gpu"] = micro_batch
    if grad_accum is not None:
        out["gradient_accumulation_steps"] = grad_accum
    elif not isinstance(out.get("gradient_accumulation_steps"), int):
        out["gradient_accumulation_steps"] = 1
    return out


_STEP_MEMORY: dict = {}


def step_memory(model_factory, cfg_dict, seq_len, micro_batch, *, remat=AS_BUILT, precision=None,
                grad_accum=None, loss_fn=None, mesh=None, batch_fn=None,
                options: EngineOptions | None = None, mlp_tile=AS_BUILT) -> CompiledMemory:
    """Compile the engine's real training step for `cfg_dict` at `micro_batch` (x `grad_accum`);
    read its memory. Nothing is allocated: the engine is abstract and the model traced.

    model_factory: a callable returning an nnx.Module, taking `remat_policy=` / `dtype=` /
    `mlp_tile=` to build variants (or the older `remat=bool`), or a built Module.
    batch_fn(global_batch, seq_len) -> a tree of ShapeDtypeStructs (default GPT-2's input_ids).
    options: the EngineOptions the engine
    will run with (split_master, adam_mu_dtype, the offload loop ... change the peak), adapted to
    this config (`offload_choice.options_for_config`). Memoised per (factory, config, shapes, choices, options, mesh)
    for the life of the process.
    """
    n_data = _data_size(mesh, cfg_dict)
    cfg_dict = _plain_batch_keys(cfg_dict, micro_batch, grad_accum)
    if precision is not None:
        cfg_dict = merge_config(cfg_dict, {"bf16": {"enabled": precision == "bf16"},
                                     "fp16": {"enabled": precision == "fp16"}})
    kw = factory_kwargs(model_factory, remat, precision, mlp_tile)
    key = (model_factory, json.dumps(cfg_dict, sort_keys=True, default=str), seq_len,
           tuple(sorted((k, str(v)) for k, v in kw.items())), loss_fn, batch_fn,
           None if mesh is None else (tuple(mesh.shape.items()), tuple(d.id for d in mesh.devices.flat)),
           n_data, options)
    try:
        hit = _STEP_MEMORY.get(key)
    except TypeError:  # an unhashable factory: no memo
        key, hit = None, None
    if hit is not None:
        return hit
    cfg = load_config(cfg_dict, world_size=n_data)
    # the options adapted to this candidate (`offload_choice.options_for_config`: a split_master="on" or
    # offload_loop="host" its layout cannot take falls back to "auto", not an error)
    eng = E.abstract_engine(model_source(model_factory, **kw), cfg, loss_fn=loss_fn or default_loss_fn(),
                            mesh=mesh, options=offload_choice.options_for_config(options or EngineOptions(), cfg))
    if batch_fn is None:
        batch = {"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, seq_len), jnp.int32)}
    else:
        batch = batch_fn(cfg.train_batch_size, seq_len)
    # the guard's own figure (the host loop's chunks included), from a planning compile
    result = eng.step_memory(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch), planning=True)
    if key is not None:
        _STEP_MEMORY[key] = result
    return result


def _data_size(mesh, cfg_dict):
    """The batch rule's world size (`zerojax.sharding.partition.batch_world_size`): data x tensor ranks, as
    DeepSpeed 0.19.8 counts tensor ranks; pipeline stages are not data-parallel ranks."""
    if mesh is not None:
        return partition.batch_world_size(mesh)
    stages = (cfg_dict.get("pipeline") or {}).get("stages", 1)
    stages = stages if isinstance(stages, int) and stages > 0 else 1
    return max(1, jax.device_count() // stages)


def _tensor_size(mesh, cfg_dict):
    """The "tensor" axis: the mesh's, else the config's tensor_parallel.autotp_size (1 if unset)."""
    if mesh is not None:
        return partition.tensor_size(mesh)
    size = (cfg_dict.get("tensor_parallel") or {}).get("autotp_size", 1)
    return size if isinstance(size, int) and size > 0 else 1


# ---------------------------------------------------------------------------------------------
# The search


def model_shape(model_factory, seq_len) -> est.ModelShape:
    """Parameters (all, the repeated blocks' and their MLPs'), depth, width and attention width
    (heads x head_dim) of the model, from its dims (`zerojax.model.model_dims`: its own
    `model_dims()`, else read off the parameter tree), on the abstract model (nothing allocated)."""
    model = model_factory if isinstance(model_factory, nnx.Module) else nnx.eval_shape(model_factory)
    dims = model_dims(model)
    layers, layer_params = dims.layers, dims.layers * dims.layer_params
    if not layers:  # a stack the dims did not find: the leaves named with a leading "layers" axis
        stacked = [var for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
                   if mem.logical_names(var)[:1] == (LAYERS,) and var.shape]
        layers = int(stacked[0].shape[0]) if stacked else 0
        layer_params = sum(math.prod(var.shape) for var in stacked)
    return est.ModelShape(dims.params, layer_params, layers, dims.d_model, int(seq_len or 0),
                          attn_width=dims.heads * dims.head_dim, mlp_params=_mlp_params(model),
                          experts=dims.experts, top_k=dims.top_k, expert_params=_expert_params(model),
                          grouped_kernel_precisions=grouped_matmul.kernel_precisions())


def _mlp_params(model) -> int:
    """The MLP kernels' parameters: the leaves named with both the residual ("embed") and the
    MLP's width ("mlp") axes (Llama's gate / up / down, GPT-2's c_fc / c_proj; biases left out,
    they are no matmul). 0 for a model without logical names."""
    return sum(math.prod(var.shape) for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if {"embed", "mlp"} <= set(mem.logical_names(var)))


def _expert_params(model) -> int:
    """A mixture of experts' expert weights: the leaves with a logical "experts" axis (0 if none)."""
    return sum(math.prod(var.shape) for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if "experts" in mem.logical_names(var))


def precision_choices(cfg_dict, factory=None) -> tuple:
    """The precisions to plan over. A config that enables one keeps it; one that leaves fp16 /
    bf16 to "auto" gets Hugging Face's default: bf16 where the device computes it (GPU, TPU), and
    fp32 as a fallback (alone on CPU). A factory without `dtype=` keeps the config's choice."""
    fp16, bf16 = (cfg_dict.get(k) or {} for k in ("fp16", "bf16"))
    if "auto" not in (fp16.get("enabled"), bf16.get("enabled")):
        return (None,)  # as the config says
    if factory is not None and "dtype" not in _params_of(factory):
        return (None,)
    return ("bf16", "fp32") if jax.default_backend() in ("gpu", "tpu") else ("fp32",)


def rows_per_device(cfg_dict, n_data, default=8) -> int:
    """Rows a device trains on per optimizer step (micro-batch x accumulation) that the planner
    keeps: from train_batch_size, else micro-batch x accumulation, else `default`."""
    tbs, mb, ga = (cfg_dict.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                             "gradient_accumulation_steps"))
    if isinstance(tbs, int) and tbs % n_data == 0:
        return tbs // n_data
    if isinstance(mb, int):
        return mb * (ga if isinstance(ga, int) else 1)
    return default


def mlp_tile_choices(factory, mlp_tile, seq_len, cfg_dict=None) -> tuple:
    """The MLP tilings to plan over (positions per piece; None = untiled). A factory without
    `mlp_tile=` is used as built. mlp_tile None: untiled, plus `default_mlp_tile(seq_len)` where
    the row is longer than MLP_TILE and not split by sequence parallelism (the pieces would cut
    across the "seq" split); an int, or several (None among them = untiled): those."""
    if "mlp_tile" not in _params_of(factory):
        return (AS_BUILT,)
    if mlp_tile is None:
        split = ((cfg_dict or {}).get("sequence_parallel_size") or 1) > 1
        return (None,) if split or seq_len <= MLP_TILE else (None, default_mlp_tile(seq_len))
    from zerojax.models.tiling import check_tile

    given = mlp_tile if isinstance(mlp_tile, (tuple, list)) else (mlp_tile,)
    return tuple(dict.fromkeys(check_tile(t, "mlp_tile") for t in given))


def default_mlp_tile(seq_len: int) -> int:
    """The row in the fewest pieces of at most MLP_TILE positions, all of one size (a row of 3000
    in two of 1500, not 2048 + 952 padded to 2 x 2048)."""
    pieces = -(-seq_len // MLP_TILE)
    return -(-seq_len // pieces)


# what each remat policy keeps for the backward pass includes what these keep (models/gpt2.py):
# "offload" moves the block input to host memory; "full" keeps it; the save_* policies add the
# attention output and / or the q/k/v projection; "dots" every matmul output without batch dims
# (the q/k/v projection among them, not the attention output: a batched product)


def _host_budget(cfg_dict) -> tuple[int, str]:
    """(bytes, what limits them) an offloading plan may hold in host memory: what is available now;
    on GPU with CPU offload (always in pinned_host memory), no more than XLA's pinned pool allows
    (`zerojax.pinned_pool`)."""
    free = est.host_free_bytes()
    zero = cfg_dict.get("zero_optimization") or {}
    to_cpu = any(isinstance(zero.get(k), dict) and zero[k].get("device") == "cpu"
                 for k in ("offload_param", "offload_optimizer"))
    cap = pinned_pool.cap_bytes()
    if to_cpu and jax.default_backend() == "gpu" and cap < free:
        return cap, (f"allowed in XLA's pinned host pool ({pinned_pool.ENV}: set it to the GiB the "
                     f"offload needs before starting, or offload to nvme)")
    return free, "available"


@dataclasses.dataclass(frozen=True)
class _Estimates:
    """The formulas `search` orders and prunes candidates by, for one model shape and mesh."""

    shape: est.ModelShape
    cfg_dict: dict
    n_zero: int
    n_tensor: int
    hardware: est.Hardware
    optimizer: str
    options: EngineOptions

    def predicted(self, c: Candidate):
        return est.predict_step_time(
            self.shape, micro_batch=c.micro_batch, grad_accum=c.grad_accum, n_data=self.n_zero,
            stage=c.stage, precision=c.precision or configured_precision(self.cfg_dict),
            remat=None if c.remat == AS_BUILT else c.remat, offload_optimizer=c.kind != "none",
            offload_ratio=c.ratio, offload_param=c.kind == "param", hardware=self.hardware,
            n_tensor=self.n_tensor, tiled_mlp=is_tiled(c.mlp_tile))

    def states(self, c: Candidate, bound: bool) -> int:
        f = est.model_state_floor if bound else est.model_state_bytes
        prec = c.precision or configured_precision(self.cfg_dict)
        return est.expert_split_states(f, self.shape, self.shape.params, n_expert=self.options.ep_size,
                                       stage=c.stage, n_data=self.n_zero, precision=prec, optimizer=self.optimizer,
                                       offload_optimizer=c.kind != "none", offload_ratio=c.ratio,
                                       offload_param=c.kind == "param", n_tensor=self.n_tensor,
                                       master_split=device_split(self.options, prec, c.kind != "none"),
                                       adam_mu_dtype=self.options.adam_mu_dtype)

    def peak(self, c: Candidate, compiled: dict):
        """(estimated peak, the candidate it came from), or (None, None): from a compiled neighbour
        (same precision, remat and MLP tile, micro-batch no smaller), its peak plus the formula's
        difference in model states, with its activations scaled to this micro-batch. Scaling down
        also scales the fixed temporaries, so this errs low."""
        refs = [r for r in compiled if (r.precision, r.remat, r.mlp_tile) == (c.precision, c.remat, c.mlp_tile)
                and r.micro_batch >= c.micro_batch]
        if not refs:
            return None, None
        r = min(refs, key=lambda r: (r.micro_batch, abs(r.stage - c.stage), r.kind != c.kind))
        peak = compiled[r].peak
        act = max(peak - self.states(r, False), 0)
        scaled = act * (c.micro_batch / r.micro_batch - 1)
        return peak + self.states(c, False) - self.states(r, False) + scaled, r


def search(model_factory, cfg_dict, budget, seq_len, *, stages=(0, 1, 2, 3),
           offloads=DEFAULT_OFFLOADS, remat=None, precision=None, micro_batch=None,
           batch_rows=None, loss_fn=None, mesh=None, batch_fn=None, hardware=est.H200,
           max_plans=3, one_per_tier=True, on_result: Callable | None = None,
           options: EngineOptions | None = None, host_budget: int | None = None,
           mlp_tile=None) -> Search:
    """The planning run behind `plan`; returns what fits and what was tried (see `Search`).

    host_budget: the host memory an offloading plan may hold (default: what is available now); a
    plan whose compiled step holds more in host memory (offloaded states, an offload_param
    gradient accumulator) does not fit: it would die of host OOM minutes into building."""
    budget = parse_bytes(budget)
    host_budget, host_limit = ((parse_bytes(host_budget), "available") if host_budget is not None
                               else _host_budget(cfg_dict))
    n_data = _data_size(mesh, cfg_dict)
    # the batch rule counts tensor ranks (n_data above); ZeRO partitions over "data" only, and each
    # device holds 1 / n_tensor of the parameters and their states
    n_tensor = _tensor_size(mesh, cfg_dict)
    n_zero = max(n_data // n_tensor, 1)
    remats = _remat_choices(model_factory, remat)
    tiles = mlp_tile_choices(model_factory, mlp_tile, seq_len, cfg_dict)
    precisions = ((precision,) if isinstance(precision, str) else tuple(precision)
                  if precision is not None else precision_choices(cfg_dict, model_factory))
    rows = batch_rows or rows_per_device(cfg_dict, n_data)
    if micro_batch in (None, "auto"):
        micros = [m for m in range(rows, 0, -1) if rows % m == 0]
    else:
        micros = [int(micro_batch)]
    user_stage = int((cfg_dict.get("zero_optimization") or {}).get("stage", 0) or 0)
    shape = model_shape(model_source(model_factory, **factory_kwargs(model_factory)), seq_len)
    optimizer = ((cfg_dict.get("optimizer") or {}).get("type") or "adamw")

    auto_micro = micro_batch in (None, "auto")
    cands = []
    for off in offloads:
        kind, ratio = offload_kind(off)
        ok = [s for s in stages if valid_stage(kind, ratio, s)]
        if n_zero == 1 and ok:  # one data rank: no stage partitions anything; keep the user's
            ok = [user_stage if user_stage in ok else ok[0]]
        cands += [Candidate(prec, r, m, max(rows // m, 1) if auto_micro else _accum(cfg_dict), stage, kind, ratio, t)
                  for stage in ok for prec in precisions for r in remats for m in micros for t in tiles]

    formulas = _Estimates(shape, cfg_dict, n_zero, n_tensor, hardware, optimizer, options or EngineOptions())
    # candidates in predicted-speed order: a tile adds its MLP recompute to the step time, so
    # within a tier (precision, remat, micro-batch) the untiled step comes first, and a tiled one
    # comes before a heavier remat or a smaller micro-batch only where the estimate says it is faster
    timed = sorted(((formulas.predicted(c), c) for c in cands),
                   key=lambda tc: (tc[0].step_s, tc[1].stage, -offload_rank(tc[1])))
    fitting, tried, too_big, compiled, tiers_done = [], [], [], {}, set()

    for t, c in timed:
        if len(fitting) >= max_plans:
            break
        speed = dict(step_s=t.step_s, tokens_per_s=t.tokens_per_s)
        floor = formulas.states(c, True)
        estimate, ref = formulas.peak(c, compiled)
        if one_per_tier and (c.precision, c.remat, c.micro_batch) in tiers_done:
            # a faster stage / offload of this precision, remat and micro-batch already fits: the
            # rest of the tier only repeats it slower, so the next plan listed is another tier
            outcome = "skipped: a faster choice of its precision, remat and micro-batch fits"
        elif floor > budget:
            outcome = f"pruned: model states alone need {fmt_bytes(floor)}"
        elif any(c.holds_at_least(f) for f in too_big):
            outcome = "pruned: holds at least what a choice that does not fit holds"
        elif estimate is not None and estimate > budget * (1 + ESTIMATE_MARGIN):
            outcome = (f"pruned: estimated peak {fmt_bytes(estimate)} (from the compiled "
                       f"{ref.plan().describe()})")
            too_big.append(c)
        else:
            try:
                m = step_memory(model_factory, zero_choice(cfg_dict, c.stage, c.kind, c.ratio),
                                seq_len, c.micro_batch, remat=c.remat, precision=c.precision,
                                grad_accum=c.grad_accum, loss_fn=loss_fn, mesh=mesh,
                                batch_fn=batch_fn, options=options, mlp_tile=c.mlp_tile)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - a choice the engine rejects is not a plan
                tried.append((c.plan(**speed), f"failed: {type(e).__name__}: {e}"))
                if on_result:
                    on_result(*tried[-1])
                continue
            compiled[c] = m
            p = c.plan(peak_bytes=m.peak, host_bytes=m.host_peak, **speed)
            fits = fits_memory(m, budget, host_budget)
            if m.peak > budget:
                too_big.append(c)  # (host memory alone: a smaller choice of the same kind may fit)
            (fitting.append(p) if fits else None)
            if fits:
                tiers_done.add((c.precision, c.remat, c.micro_batch))
            tried.append((p, "fits" if fits else "does not fit" if m.peak > budget else
                          f"does not fit host memory: {fmt_bytes(m.host_peak)} of {fmt_bytes(host_budget)} "
                          f"{host_limit}"))
            if on_result:
                on_result(*tried[-1])
            continue
        tried.append((c.plan(**speed), outcome))
        if on_result:
            on_result(*tried[-1])
    return Search(rank_plans(fitting), tried, budget)


def fits_memory(m: CompiledMemory, budget: int, host_budget: int) -> bool:
    """Whether a compiled step fits both memories: its device peak the device budget, and what it
    holds in host memory (offloaded states, host temporaries) the host's."""
    return m.peak <= budget and (not m.host_peak or m.host_peak <= host_budget)


def device_split(options, precision: str, offloaded: bool) -> bool:
    """Whether `options` split the device-resident master for a candidate of this precision and
    offload (`offload_choice.split_master_applies`): only split_master="on" does."""
    return options.split_master == "on" and offload_choice.split_master_applies(precision, None, offloaded, False)[1]


def _remat_choices(factory, remat):
    names = _params_of(factory)
    if remat is None:
        if "remat_policy" in names or "remat" in names:
            return (None, "full")
        return (AS_BUILT,)
    out = []
    for r in (remat if isinstance(remat, (tuple, list)) else (remat,)):
        if r in (False, True, "none"):  # the older remat=bool, and the CLI's "none"
            r = "full" if r is True else None
        if r not in REMAT_CHOICES and r != AS_BUILT and r not in REMAT_POLICY_NAMES:  # + zerojax's remat_policy
            raise ValueError(f"remat choice {r!r}: use one of {REMAT_CHOICES} (what DeepSpeed's "
                             "activation_checkpointing section can say)")
        if r not in out:
            out.append(r)
    if not (names & {"remat_policy", "remat"}):
        return (AS_BUILT,)
    return tuple(out)


def _accum(cfg_dict):
    ga = cfg_dict.get("gradient_accumulation_steps")
    return ga if isinstance(ga, int) else 1


def configured_precision(cfg_dict):
    fp16, bf16 = (cfg_dict.get(k) or {} for k in ("fp16", "bf16"))
    return "fp16" if fp16.get("enabled") is True else "bf16" if bf16.get("enabled") is True else "fp32"


def plan(model_factory, cfg_dict, budget, seq_len, *, stages=(0, 1, 2, 3),
         offloads=DEFAULT_OFFLOADS, remat=None, precision=None, micro_batch=None,
         batch_rows=None, loss_fn=None, mesh=None, batch_fn=None, hardware=est.H200,
         max_plans=3, one_per_tier=True, on_result=None, options=None, mlp_tile=None) -> list[Plan]:
    """Up to `max_plans` choices whose compiled step fits `budget` bytes per device, fastest
    (predicted) first.

    remat: policies to try (default: none and "full" when the factory takes `remat_policy=`;
    "offload" on request). mlp_tile: MLP tilings to try where the factory takes `mlp_tile=`
    (default: untiled, and on rows longer than MLP_TILE also `default_mlp_tile`; see
    `mlp_tile_choices`). precision: "bf16" / "fp16" / "fp32" or several; default: the
    config's, or bf16 (+ fp32) when it says "auto". micro_batch: an int tries that micro-batch
    only; None / "auto" tries every divisor of the rows per device per step (`batch_rows`, default
    from the config's batch keys, else 8), raising gradient_accumulation_steps to keep them.
    offloads: "none", "optimizer", "optimizer:R" (ratio R < 1, stage 3), "param" (stage 3).
    hardware: the throughputs the step-time model uses (`zerojax.planning.estimate.Hardware`).
    one_per_tier: list one plan per (precision, remat, micro-batch), the fastest MLP tile / stage /
    offload that fits (False: every MLP tile / stage / offload that fits, up to max_plans).
    on_result(plan, outcome): called for every choice tried (progress output).
    options: the EngineOptions the run will use (split_master, adam_mu_dtype, offload_loop ...:
    each candidate compiles with them, adapted to its layout by `offload_choice.options_for_config`).
    """
    return search(model_factory, cfg_dict, budget, seq_len, stages=stages, offloads=offloads,
                  remat=remat, precision=precision, micro_batch=micro_batch,
                  batch_rows=batch_rows, loss_fn=loss_fn, mesh=mesh, batch_fn=batch_fn,
                  hardware=hardware, max_plans=max_plans, one_per_tier=one_per_tier,
                  on_result=on_result, options=options, mlp_tile=mlp_tile).plans


def fit_micro_batch(model_factory, cfg_dict, budget, seq_len, *, remat=AS_BUILT, loss_fn=None,
                    mesh=None, batch_fn=None, limit=1024, options=None) -> int:
    """The largest `train_micro_batch_size_per_gpu` whose compiled step fits `budget` bytes, all
    else as configured. Raises WillNotFitError if micro-batch 1 does not fit."""
    budget = parse_bytes(budget)
    m, peaks = mem.largest_fitting(
        lambda mb: step_memory(model_factory, cfg_dict, seq_len, mb, remat=remat, loss_fn=loss_fn,
                               mesh=mesh, batch_fn=batch_fn, options=options).peak, budget, limit=limit)
    if m == 0:
        raise WillNotFitError(peaks[1], budget, (), what="micro-batch 1")
    return m


# Lengths the longest-row search tries are multiples of this: the flash kernel's row multiple
# (zerojax.models.flash_attention.FlashBlocks().row_multiple), so the row found runs there unpadded,
# and a size the GPU's matmul tiles divide. The blockwise attention pads a row to its block (512):
# its compiled peak, which the search reads, holds that padding as the run will.
SEQ_GRANULE = 128


def seq_granule(cfg_dict, granule: int = SEQ_GRANULE) -> int:
    """The step of the longest-row search: `granule`, a multiple of sequence_parallel_size too (the
    "seq" axis splits every row evenly)."""
    sp = cfg_dict.get("sequence_parallel_size") or 1
    return math.lcm(int(granule), sp if isinstance(sp, int) and sp > 0 else 1)


@dataclasses.dataclass(frozen=True)
class LongestRow:
    """What `longest_row` found: the longest row `seq_len` (a multiple of `granule`) whose compiled
    step fits, its peaks, and why the next granule is not it: `beyond` (seq_len + granule, where
    the search compiled it) with its peaks, or None where the model's positions (`cap`) end it."""

    seq_len: int
    peak: int
    host_peak: int
    granule: int
    budget: int
    host_budget: int
    cap: int | None = None
    beyond: int | None = None
    beyond_peak: int | None = None
    beyond_host_peak: int | None = None
    compiles: int = 0

    def describe(self) -> str:
        host = f", host {fmt_bytes(self.host_peak)} of {fmt_bytes(self.host_budget)}" if self.host_peak else ""
        why = (f"the model has {self.cap:,} positions" if self.beyond is None else
               f"{self.beyond:,} needs {fmt_bytes(self.beyond_peak)}"
               + (f", host {fmt_bytes(self.beyond_host_peak)}" if self.beyond_host_peak else ""))
        return (f"{self.seq_len:,} tokens (a multiple of {self.granule}): predicted peak {fmt_bytes(self.peak)} "
                f"of {fmt_bytes(self.budget)}{host}; {why}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def longest_row(model_factory, cfg_dict, budget, *, micro_batch=1, grad_accum=None, cap: int | None = None,
                start: int | None = None, granule: int = SEQ_GRANULE, host_budget: int | None = None,
                remat=AS_BUILT, precision=None, loss_fn=None, mesh=None, batch_fn=None,
                options: EngineOptions | None = None, mlp_tile=AS_BUILT) -> LongestRow:
    """The longest row (tokens, a multiple of `seq_granule(cfg_dict, granule)`) whose compiled step
    (`step_memory`: nothing allocated) at `micro_batch` fits `budget` bytes per device and the host
    budget (default: what is available now), all else as configured: doubling from `start` (default
    one granule), then bisection, in granules; capped only by `cap` (the model's positions, where
    it has a table of them). Raises WillNotFitError where even one granule does not fit."""
    budget = parse_bytes(budget)
    host_budget = parse_bytes(host_budget) if host_budget is not None else _host_budget(cfg_dict)[0]
    g = seq_granule(cfg_dict, granule)
    peaks: dict[int, CompiledMemory] = {}

    def fits(n: int) -> bool:  # n granules
        if n not in peaks:
            peaks[n] = step_memory(model_factory, cfg_dict, n * g, micro_batch, remat=remat, precision=precision,
                                   grad_accum=grad_accum, loss_fn=loss_fn, mesh=mesh, batch_fn=batch_fn,
                                   options=options, mlp_tile=mlp_tile)
        return fits_memory(peaks[n], budget, host_budget)

    limit = None if not cap else cap // g
    if limit == 0:
        raise ValueError(f"the model's {cap} positions are fewer than one granule of {g} tokens")
    n, over = mem.longest_fitting(fits, max(1, (start or g) // g), limit)
    if n == 0:
        raise NoRowFits(peaks[over], g, micro_batch, budget, host_budget)
    m, o = peaks[n], peaks.get(over)
    return LongestRow(n * g, m.peak, m.host_peak, g, budget, host_budget, cap, over and over * g,
                      o and o.peak, o and o.host_peak, len(peaks))


class NoRowFits(WillNotFitError):
    """Even the shortest row the longest-row search tries does not fit: one line, naming the budget
    (the device's or the host's) and what holds less."""

    def __init__(self, m: CompiledMemory, g: int, micro_batch: int, budget: int, host_budget: int):
        device = m.peak > budget
        need, have = (m.peak, budget) if device else (m.host_peak, host_budget)
        MemoryError.__init__(self, (
            f"not even a row of {g} tokens (micro-batch {micro_batch}) fits: its step needs {fmt_bytes(need)} of "
            f"the {fmt_bytes(have)} {'device' if device else 'host'} budget; hold less with activation checkpointing "
            f"(remat full), ZeRO stage 3 over more devices or offload, or give a larger budget"))
        self.predicted_bytes, self.budget_bytes, self.plans = need, have, []


# The policies fit_remat_policy tries, fastest first. Measured on one H200 (GPT-2 Large, micro 8,
# bf16, ZeRO-2): dots 77.7k tokens/s at 18.9 GiB,
# save_qkv_attention 75.5k at 16.2, save_attention 73.8k at 13.9, full 72.4k at 13.1. "dots_<k>"
# is not on the ladder: at every k measured it was slower than the save_* policy of the same or a
# lower peak (dots_16 +1.8% over "full" for 3.2 GiB, save_attention +1.9% for 0.7 GiB).
# With the chunked loss and the bf16 first moment: dots 76.5k at 17.0 GiB, save_attention_block
# 75.7k at 14.9, save_qkv_attention 74.9k at 14.2.
REMAT_LADDER = ("dots", "save_attention_block", "save_qkv_attention", "save_attention", "full")


def fit_remat_policy(model_factory, cfg_dict, budget, seq_len, layers: int, *, loss_fn=None,
                     mesh=None, batch_fn=None, ladder=REMAT_LADDER, options=None) -> str:
    """The fastest remat policy of `ladder` (fastest first) whose compiled step fits `budget`
    bytes per device, all else as configured; the ladder's last entry if none fits. The factory
    must take `remat_policy=` (zerojax.models.GPT2 and Llama do). A ladder entry "dots_*" stands for the
    partial-dots family: the largest k whose "dots_<k>" fits (peaks grow by the same bytes per
    "dots" layer, so `memory.largest_fitting`'s line finds k in a few compiles)."""
    budget = parse_bytes(budget)
    micro = int(cfg_dict.get("train_micro_batch_size_per_gpu") or 1)
    peak = lambda remat: step_memory(model_factory, cfg_dict, seq_len, micro, remat=remat,  # noqa: E731
                                     loss_fn=loss_fn, mesh=mesh, batch_fn=batch_fn, options=options).peak
    for name in ladder[:-1]:
        if name == "dots_*":
            k, _ = mem.largest_fitting(lambda k: peak(f"dots_{k}"), budget, start=2, limit=layers - 2)
            if k:
                return f"dots_{k}"
        elif peak(name) <= budget:
            return name
    return ladder[-1]


# ---------------------------------------------------------------------------------------------
# A built engine: plans for its guard


def engine_model_factory(engine):
    """A factory rebuilding `engine`'s model from its graph and shapes (zeros when traced): lets the
    planner compile variants of a built engine without its host copy. Where the model has a
    `remat_policy` / `dtype` / `mlp_tile` attribute (zerojax.models.GPT2 has the first two, Llama
    all three), the factory takes it as a keyword, so the planner can try other activation
    checkpointing, precision and MLP tiling; a keyword left out keeps the model as built."""
    plan_ = engine.step_settings  # the step's static settings (graphdef, param / rest templates)

    def fill(s):
        if jnp.issubdtype(s.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
        return jnp.zeros(s.shape, s.dtype)

    def build(**attrs):
        model = nnx.merge(plan_.graphdef, jax.tree.map(fill, plan_.param_template),
                          jax.tree.map(fill, plan_.rest_template))
        given = _given(**attrs)
        for _, m in nnx.iter_graph(model):
            if isinstance(m, nnx.Module):
                for name, value in given.items():
                    if name in vars(m):
                        setattr(m, name, value)
        return model

    # the planner varies the keywords a factory's signature names: name the attributes found
    names = set(built_attributes(engine))
    if "remat_policy" not in names:
        # dtype only beside remat_policy (zerojax's GPT2 and Llama, whose `dtype` is the compute
        # dtype read at each call): another model's `dtype` attribute may mean something else
        names.discard("dtype")
    build.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None if name == "dtype" else AS_BUILT)
         for name in _REBUILT if name in names])
    return build


_REBUILT = ("remat_policy", "dtype", "mlp_tile")  # the model attributes engine_model_factory can set


def built_attributes(engine) -> dict:
    """{name: value} of the `remat_policy` / `dtype` / `mlp_tile` attributes `engine`'s model has
    (the first module of its graph that has each), as built."""
    plan_ = engine.step_settings
    root = nnx.merge(plan_.graphdef, plan_.param_template, plan_.rest_template)
    found = {}
    for _, m in nnx.iter_graph(root):
        if isinstance(m, nnx.Module):
            for name in _REBUILT:
                if name in vars(m) and name not in found:
                    found[name] = vars(m)[name]
    return {name: found[name] for name in _REBUILT if name in found}


def _given(**attrs):
    return {k: v for k, v in attrs.items() if v is not AS_BUILT and not (k == "dtype" and v is None)}


def built_mlp_tiles(current, factory, seq_len, cfg_dict=None) -> tuple:
    """The MLP tilings to plan a built model over: its own tile `current` first (the model as
    built stays a choice), then, on a row `mlp_tile_choices` tiles (longer than MLP_TILE, not split
    by sequence parallelism), the untiled MLP and `default_mlp_tile`. AS_BUILT for a factory
    without `mlp_tile`."""
    planned = mlp_tile_choices(factory, None, seq_len, cfg_dict)
    if planned == (AS_BUILT,):
        return planned
    return tuple(dict.fromkeys((current, *planned))) if len(planned) > 1 else (current,)


def _batch_fn_like(batch_shapes):
    return lambda rows, seq_len: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch_shapes)


def engine_plans(engine, batch_shapes, budget=None, *, stages=(0, 1, 2, 3),
                 offloads=DEFAULT_OFFLOADS, max_plans=3) -> list[Plan]:
    """Plans that fit `budget` for a built engine's model, loss, mesh, batch and EngineOptions:
    activation checkpointing (where the model takes `remat_policy`), precision (bf16 on GPU / TPU
    for an fp32 config, where the model takes `dtype`), MLP tiling (where the model takes
    `mlp_tile`: its own tile, and on long rows the untiled MLP and `default_mlp_tile`, see
    `built_mlp_tiles`), micro-batch / accumulation keeping its rows per step, stage, offload.
    Ranked fastest first; each was compiled and its peak (the guard's figure,
    `Engine.step_memory`) fits, and says its tile (`Plan.mlp_tile`)."""
    budget = device_budget_or(budget)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_shapes)
    cfg = engine.cfg
    first = jax.tree.leaves(shapes)[0]
    seq = first.shape[1] if first.ndim > 1 else 0  # tokens per row, for the step-time model
    factory = engine_model_factory(engine)
    names = _params_of(factory)
    tiles = built_mlp_tiles(built_attributes(engine).get("mlp_tile"), factory, seq, cfg.to_dict())
    remat = None if "remat_policy" in names else (AS_BUILT,)
    precision = (None,)
    if ("dtype" in names and configured_precision(cfg.to_dict()) == "fp32"
            and jax.default_backend() in ("gpu", "tpu")):
        precision = (None, "bf16")
    return plan(factory, cfg.to_dict(), budget, seq, stages=stages, offloads=offloads, remat=remat,
                precision=precision, micro_batch=None,
                batch_rows=int(cfg.train_micro_batch_size_per_gpu) * int(cfg.gradient_accumulation_steps),
                loss_fn=engine.loss_fn, mesh=engine.mesh, batch_fn=_batch_fn_like(shapes),
                max_plans=max_plans, options=engine.options, mlp_tile=tiles)


def device_budget_or(budget):
    return mem.device_budget() if budget is None else parse_bytes(budget)


__all__ = ["Plan", "rank_plans", "Search", "search", "plan", "fit_micro_batch", "longest_row", "LongestRow",
           "NoRowFits", "SEQ_GRANULE", "seq_granule", "fits_memory", "fit_remat_policy", "REMAT_LADDER",
           "remat_keeps_at_least", "step_memory", "model_shape", "precision_choices", "rows_per_device",
           "engine_model_factory", "engine_plans", "device_split", "AS_BUILT", "DEFAULT_OFFLOADS", "REMAT_CHOICES",
           "zero_choice", "model_source", "factory_kwargs", "merge_config", "configured_precision", "lm_loss",
           "MLP_TILE", "mlp_tile_choices", "default_mlp_tile", "tile_keeps_at_least", "built_attributes",
           "built_mlp_tiles", "is_tiled"]
