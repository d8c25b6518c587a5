"""load_config: reading (hjson), "auto" and fill, validation, DeepSpeed's batch rule; xla_flags_for."""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import hjson

from zerojax.config._autotp import check_partition_config
from zerojax.config._params import (
    MAX_GRAD_NORM_MSG,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    UNSUPPORTED_OPTIMIZERS,
    canonical_optimizer,
    check_optimizer_params,
    check_scheduler_params,
)
from zerojax.config._schema import (
    AIO_ALIASES,
    DEEPSPEED_VERSION,
    REMOVED_ISSUE,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    TP_ALIASES,
    ZERO_ALIASES,
    ZERO_DEPRECATED_NOOP,
    AioConfig,
    BF16Config,
    Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
    pipeline_stages,
)
from zerojax.config._values import (
    ConfigError,
    ConfigWarning,
    convert,
    freeze,
    is_auto,
    one_edit_apart,
    plain,
    suggest,
    unknown,
)

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_CONFIG_KEYS = tuple(f.name for f in fields(Config) if f.name != "world_size")
_TOP_ALIASES = {"bfloat16": "bf16"}


def load_config(source, *, world_size: int | None = None, fill: Mapping[str, Any] | None = None,
                hidden_size: int | None = None, name: str | None = None) -> Config:
    """Load a DeepSpeed config (path, JSON/hjson text, or dict) into a resolved, validated Config.

    world_size: the batch trio's world size; default `jax.device_count()` divided by
    sequence_parallel_size and pipeline.stages. Tensor-parallel ranks count, as in DeepSpeed
    0.19.8's check (pipeline stages do not: DeepSpeed's data-parallel world excludes them).
    fill: values for `"auto"` entries, by dotted key (`{"optimizer.params.lr": 3e-4}`).
    hidden_size: the model's width; fills the ZeRO bucket / threshold "auto"s as the Hugging Face
        Trainer does (`hidden_size_fill`); a `fill` entry for the same key wins. Without it those
        "auto"s take DeepSpeed's defaults.
    name: how errors name the config (default: its path, where `source` is one), e.g. the file a
        dict was read from.
    """
    if name is None and isinstance(source, (str, os.PathLike)) and not (isinstance(source, str) and "{" in source):
        name = str(source)
    try:
        return _load(source, world_size, fill, hidden_size)
    except ConfigError as e:
        if name and e.source is None:
            raise ConfigError(e.problems, source=name) from None
        raise


def hidden_size_fill(hidden_size: int, stage3: bool = True) -> dict[str, int]:
    """The ZeRO "auto"s the Hugging Face Trainer fills from the model's hidden size
    (transformers' `HfTrainerDeepSpeedConfig.trainer_config_finalize`): reduce_bucket_size
    hidden^2, and at stage 3 stage3_prefetch_bucket_size int(0.9 hidden^2) and
    stage3_param_persistence_threshold 10 hidden (so a small model's tensors are partitioned, where
    DeepSpeed's default threshold of 100,000 elements would keep them whole on every device)."""
    h = int(hidden_size)
    out = {"zero_optimization.reduce_bucket_size": h * h}
    if stage3:
        out["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * h * h)
        out["zero_optimization.stage3_param_persistence_threshold"] = 10 * h
    return out


def auto_keys(source) -> list[str]:
    """The dotted keys of a config (path, text or dict) whose value is "auto", in file order."""
    left = []
    _apply_fill(plain(read_source(source)), {}, left)
    return left


def _load(source, world_size, fill, hidden_size) -> Config:
    raw = read_source(source)
    problems: list[str] = []
    fill = dict(fill or {})
    if hidden_size is not None:
        zero = raw.get("zero_optimization")
        stage3 = isinstance(zero, Mapping) and zero.get("stage") == 3
        fill = {**hidden_size_fill(hidden_size, stage3), **fill}
    for key in fill:
        if not isinstance(key, str):
            problems.append(f"fill: keys are dotted config keys (str), got {key!r}")
    raw = plain(raw)
    unresolved = _apply_fill(raw, fill)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        problems.append(f"world_size = {world_size!r}: expected a positive integer")
        world_size = None

    notes: list[str] = []
    kwargs = _build_top(raw, unresolved, problems, notes)
    zero = kwargs.get("zero_optimization", ZeroConfig())
    notes += _cross_checks(kwargs, zero, problems)
    notes += inert_switches(kwargs)

    if world_size is None:
        import jax  # lazily: zerojax.config itself must not need jax

        # DeepSpeed 0.19.8's batch rule counts every rank, tensor-parallel ranks included
        sp = kwargs.get("sequence_parallel_size", 1)
        n_dev = jax.device_count()
        if isinstance(sp, int) and sp > 1 and n_dev % sp:
            problems.append(f"sequence_parallel_size = {sp} must divide the {n_dev} devices; sizes that would "
                            f"work: {[s for s in range(1, n_dev + 1) if n_dev % s == 0]}")
        world_size = max(1, jax.device_count() // (kwargs.get("sequence_parallel_size", 1)
                                                   * pipeline_stages(kwargs.get("pipeline", PipelineConfig()))))
    kwargs["world_size"] = world_size
    _resolve_batch(kwargs, raw, unresolved, world_size, problems)

    known_heads = set(_CONFIG_KEYS) | set(_TOP_ALIASES)
    left = [p for p in unresolved if _needs_value(p) and p.split(".")[0] in known_heads]
    if left:
        example = "train_micro_batch_size_per_gpu" if left[0] in _BATCH_KEYS else left[0]
        problems.append(
            "unresolved \"auto\" values: " + ", ".join(left)
            + "; give them with fill={...} by dotted key, e.g. fill={" + repr(example) + ": ...}"
            + (" (the rest of the batch trio then follows DeepSpeed's batch-size rule)"
               if left[0] in _BATCH_KEYS else ""))
    if problems:
        raise ConfigError(problems)
    for note in notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    return Config(**kwargs)


def xla_flags_for(cfg: Config) -> list[str]:
    """XLA (GPU) flags that carry DeepSpeed's communication knobs over to XLA's collectives.

    Bucket sizes are DeepSpeed element counts; XLA's combine thresholds are bytes, so they are
    multiplied by the bytes per element of the communicated dtype (communication_data_type, else
    the 16-bit compute dtype, else fp32). Stage 3 gathers parameters in stage3_prefetch_bucket_size
    buckets; stages 1-2 gather updated parameters in allgather_bucket_size buckets.
    """
    z = cfg.zero_optimization
    comm = cfg.communication_data_type or ("bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32")
    width = 4 if comm == "fp32" else 2
    gather = z.stage3_prefetch_bucket_size if z.stage == 3 else z.allgather_bucket_size
    flags = [
        f"--xla_gpu_all_reduce_combine_threshold_bytes={z.reduce_bucket_size * width}",
        f"--xla_gpu_reduce_scatter_combine_threshold_bytes={z.reduce_bucket_size * width}",
        f"--xla_gpu_all_gather_combine_threshold_bytes={gather * width}",
    ]
    if z.overlap_comm:
        flags.append("--xla_gpu_enable_latency_hiding_scheduler=true")
    return flags


def _no_duplicates(pairs):
    seen, out = set(), {}
    dups = []
    for k, v in pairs:
        if k in seen:
            dups.append(k)
        seen.add(k)
        out[k] = v
    if dups:
        raise ConfigError([f"duplicate key(s) {sorted(set(dups))!r} in one object "
                           "(DeepSpeed: 'Duplicate keys in DeepSpeed config'); keep one of each"])
    return out


def read_source(source) -> Mapping:
    """The raw config dict of a path, JSON/hjson text or dict (comments allowed, duplicate keys an
    error), before any validation: what a caller inspects or edits before `load_config`."""
    if isinstance(source, Mapping):
        return source
    if isinstance(source, (str, os.PathLike)) and not (isinstance(source, str) and "{" in source):
        if not os.path.isfile(source):  # a string without "{" is a path
            raise ConfigError([f"no config file at {str(source)!r} (give a path, JSON/hjson text or a dict)"])
        with open(source, encoding="utf-8") as fh:
            text, where = fh.read(), str(source)
    elif isinstance(source, str):
        text, where = source, "<text>"
    else:
        raise ConfigError([f"config source must be a path, JSON/hjson text or a dict, got {type(source).__name__}"])
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError:
        raise
    except Exception as exc:  # hjson.HjsonDecodeError carries line and column
        raise ConfigError([f"{where}: not valid JSON/hjson: {exc}"]) from None
    if not isinstance(data, Mapping):
        raise ConfigError([f"{where}: the config must be a JSON object, got {type(data).__name__}"])
    return data


def _apply_fill(raw, fill, left=None):
    """Replace "auto" values named in fill; return the dotted paths of the autos left."""
    left = [] if left is None else left

    def walk(node, prefix):
        for k, v in list(node.items()):
            path = f"{prefix}.{k}" if prefix else str(k)
            if is_auto(v):
                if path in fill:
                    node[k] = plain(fill[path])
                else:
                    left.append(path)
            elif isinstance(v, dict):
                walk(v, path)

    walk(raw, "")
    return left


def _needs_value(path):
    """Autos that have no DeepSpeed default: top-level keys and optimizer / scheduler params."""
    head = path.split(".")
    if len(head) == 1:
        return True
    return head[0] in ("optimizer", "scheduler")


def _build(cls, raw, path, problems, *, aliases=None):
    """Build section dataclass `cls` from mapping `raw`. "auto" means the field's default."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        problems.append(f"{path} = {raw!r}: expected an object {{...}}")
        return cls()
    specs = {f.name: f for f in fields(cls)}
    aliases = aliases or {}
    kwargs, given_as = {}, {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in specs:
            unknown(path, key, list(specs) + list(aliases), problems)
            continue
        if name in given_as:
            problems.append(f"{path}: {given_as[name]!r} and {key!r} are the same setting; give one")
            continue
        given_as[name] = key
        if is_auto(value) and specs[name].metadata["kind"] != "int_or_auto":
            continue  # DeepSpeed drops "auto" inside sections: the default applies
        meta = specs[name].metadata
        if meta["kind"] == "section":
            kwargs[name] = _build(meta["cls"], value, f"{path}.{key}", problems) if value is not None else (
                None if meta.get("optional") else meta["cls"]())
            continue
        ok, conv = convert(value, meta, f"{path}.{key}", problems)
        if ok:
            kwargs[name] = conv
    return cls(**kwargs)


def _build_top(raw, unresolved, problems, notes):
    specs = {f.name: f for f in fields(Config)}
    unresolved_top = {p for p in unresolved if "." not in p}
    if "bf16" in raw and "bfloat16" in raw:
        problems.append("bf16 and bfloat16 (its old name) are both given; keep \"bf16\"")
    kwargs = {}
    for key, value in raw.items():
        name = _TOP_ALIASES.get(key, key)
        if key in REMOVED_TOP_LEVEL_KEYS:
            problems.append(_removed(key, REMOVED_TOP_LEVEL_KEYS[key]))
            continue
        if name == "zero_optimization":
            kwargs[name] = _build_zero(raw, value, problems)
            continue
        if key == "allgather_size" and isinstance(raw.get("zero_optimization"), bool):
            continue  # legacy partner of `"zero_optimization": true`
        if name not in specs or name == "world_size":
            slip = _slip_of(key)
            if slip:
                problems.append(f"{key}: unknown top-level key; did you mean {slip!r}? (as written, DeepSpeed ignores "
                                f"it and trains with {slip}'s defaults; rename it)")
            else:
                notes.append(_unknown_top_level(key))
            continue
        if key in unresolved_top:
            continue  # reported as unresolved auto, or resolved by the batch rule
        meta = specs[name].metadata
        if name == "optimizer":
            kwargs[name] = _build_optimizer(value, problems)
        elif name == "scheduler":
            kwargs[name] = _build_scheduler(value, problems)
        elif name == "tensor_parallel":
            tp = _build(TensorParallelConfig, value, "tensor_parallel", problems, aliases=TP_ALIASES)
            check_partition_config(tp.partition_config, problems)
            kwargs[name] = dataclasses.replace(tp, autotp_size=max(1, tp.autotp_size))
        elif name == "torch_autocast":
            kwargs[name] = _build_torch_autocast(value, problems)
        elif name == "aio":
            kwargs[name] = _build_aio(value, problems, notes)
        elif meta["kind"] == "section":
            if value is None:
                kwargs[name] = None if meta.get("optional") else meta["cls"]()
            else:
                kwargs[name] = _build(meta["cls"], value, key, problems)
        else:
            ok, conv = convert(value, meta, key, problems)
            if ok:
                kwargs[name] = conv
    if "zero_optimization" not in kwargs:
        kwargs["zero_optimization"] = _build_zero(raw, {}, problems)
    return kwargs


def _removed(where, reason):
    return f"{where}: {reason} See {REMOVED_ISSUE}. (DeepSpeed {DEEPSPEED_VERSION} refuses it too; remove the key)"


def _slip_of(key):
    """The key zerojax reads that an unknown top-level key is one slip from, else None: one letter
    added, dropped, changed or two swapped, case aside (a British spelling of these keys, e.g.
    "zero_optimisation", is one such). A typo'd section would load silently at its defaults, so it
    is an error; farther keys and keys under 4 letters ("fp8" is not "fp16") stay a warning."""
    if len(str(key)) < 4:
        return None
    return next((k for k in (*_CONFIG_KEYS, *_TOP_ALIASES) if one_edit_apart(str(key), k)), None)


def _unknown_top_level(key):
    """DeepSpeed reads the top level key by key and never looks at the others: an unknown key loads."""
    # A stricter cutoff than for sections: free-form keys ("_comment", "comms_config") are common up here.
    hint = suggest(key, _CONFIG_KEYS, cutoff=0.8)
    return (f"{key}: unknown top-level key, ignored (as DeepSpeed ignores it){hint} "
            "(docs/config-keys.md lists the keys zerojax reads)")


def _build_aio(value, problems, notes):
    """DeepSpeed reads `aio` key by key (`get_scalar_param`) and ignores the rest: unknown keys are a note;
    `thread_count` is the pre-0.15 name of `intra_op_parallelism`."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in {f.name for f in fields(AioConfig)} and k not in AIO_ALIASES]
        for key in unknown:
            hint = suggest(key, [f.name for f in fields(AioConfig)])
            notes.append(f"aio.{key}: unknown key, ignored (as DeepSpeed ignores it){hint}")
        value = {k: v for k, v in value.items() if k not in unknown}
    aio = _build(AioConfig, value, "aio", problems, aliases=AIO_ALIASES)
    if aio.use_gds:
        notes.append("aio.use_gds = true: GPUDirect Storage is not used by zerojax; NVMe transfers go through "
                     "host buffers (the result is the same)")
    return aio


def _build_torch_autocast(value, problems):
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"torch_autocast = {value!r}: expected an object {{...}}")
        return None
    if value.get("enabled") is True:
        problems.append(
            "torch_autocast.enabled = true: torch.autocast is a PyTorch mechanism with no JAX equivalent; "
            "use \"bf16\": {\"enabled\": true} (or \"fp16\": {\"enabled\": true}) instead")
    return freeze(value)


def _build_zero(raw, value, problems):
    if isinstance(value, bool):  # deprecated: "zero_optimization": true|false
        legacy = {"stage": 1 if value else 0}
        if value:
            legacy["allgather_bucket_size"] = raw.get("allgather_size", 500_000_000)
        warnings.warn("\"zero_optimization\": true/false is deprecated in DeepSpeed; "
                      "use \"zero_optimization\": {\"stage\": N}", DeprecationWarning, stacklevel=4)
        value = legacy
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        problems.append(f"zero_optimization = {value!r}: expected an object {{...}} (or true/false)")
        return ZeroConfig()
    value = dict(value)
    path = "zero_optimization"
    # DeepSpeed's deprecated booleans that create an offload section.
    for old, new, _cls in (("cpu_offload", "offload_optimizer", OffloadOptimizerConfig),
                           ("cpu_offload_param", "offload_param", OffloadParamConfig)):
        if old not in value:
            continue
        flag = value.pop(old)
        if is_auto(flag):
            continue
        if new in value:
            problems.append(f"{path}: Cannot provide deprecated parameter '{old}' and replacing "
                            f"parameter '{new}' together")
            continue
        if not isinstance(flag, bool):
            problems.append(f"{path}.{old} = {flag!r}: expected true or false")
            continue
        warnings.warn(f"Config parameter {old} is deprecated use {new} instead", DeprecationWarning,
                      stacklevel=4)
        if flag:
            value[new] = {"device": "cpu"}
    for old in ZERO_DEPRECATED_NOOP:
        if old in value:
            value.pop(old)
            warnings.warn(f"Config parameter {old} is deprecated use offload_param or offload_optimizer "
                          "instead (it has no effect)", DeprecationWarning, stacklevel=4)
    for key in value:
        if key in REMOVED_ZERO_KEYS:
            problems.append(_removed(f"{path}.{key}", REMOVED_ZERO_KEYS[key]))
    value = {k: v for k, v in value.items() if k not in REMOVED_ZERO_KEYS}
    zero = _build(ZeroConfig, value, path, problems, aliases=ZERO_ALIASES)
    overlap = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    return dataclasses.replace(zero, overlap_comm=overlap)


def _type_and_params(section, value, keys, problems):
    """The `{"type": ..., "params": {...}}` shape of `optimizer` / `scheduler`; None when absent or malformed."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"{section} = {value!r}: expected an object {{\"type\": ..., \"params\": {{...}}}}")
        return None
    for key in value:
        if key not in keys:
            unknown(section, key, keys, problems)
    return value


def _build_optimizer(value, problems):
    value = _type_and_params("optimizer", value, ("type", "params", "legacy_fusion"), problems)
    if value is None:
        return None
    typ, params = value.get("type"), value.get("params") or {}
    ok_fusion, fusion = convert(value.get("legacy_fusion", False), {"kind": "bool"}, "optimizer.legacy_fusion",
                                 problems)
    if not isinstance(typ, str) or is_auto(typ):
        if not is_auto(typ):
            problems.append(f"optimizer.type = {typ!r}: expected one of {list(SUPPORTED_OPTIMIZERS)}")
        return None
    if not isinstance(params, Mapping):
        problems.append(f"optimizer.params = {params!r}: expected an object {{...}}")
        return None
    canon = canonical_optimizer(typ)
    if canon is None:
        lowered = typ.lower()
        if lowered in UNSUPPORTED_OPTIMIZERS:
            closest, why = UNSUPPORTED_OPTIMIZERS[lowered]
            problems.append(
                f"optimizer.type = {typ!r} is not supported by zerojax: {why}, so substituting another "
                f"optimizer would change results; the closest supported choice is {closest!r} "
                f"(supported: {', '.join(SUPPORTED_OPTIMIZERS)})")
        else:
            hint = suggest(typ, SUPPORTED_OPTIMIZERS)
            problems.append(f"optimizer.type = {typ!r}: unknown optimizer{hint} "
                            f"(supported, case-insensitive: {', '.join(SUPPORTED_OPTIMIZERS)})")
        if "max_grad_norm" in params:
            problems.append(f"optimizer.params.max_grad_norm: {MAX_GRAD_NORM_MSG}")
        return None
    checked = check_optimizer_params(canon, params, problems)
    return OptimizerConfig(type=typ, params=checked, legacy_fusion=fusion if ok_fusion else False)


def _build_scheduler(value, problems):
    value = _type_and_params("scheduler", value, ("type", "params"), problems)
    if value is None:
        return None
    typ, params = value.get("type"), value.get("params") or {}
    if not isinstance(typ, str) or typ not in SUPPORTED_SCHEDULERS:
        if not is_auto(typ):
            hint = suggest(typ, SUPPORTED_SCHEDULERS) if isinstance(typ, str) else ""
            problems.append(f"scheduler.type = {typ!r}: unknown scheduler{hint} "
                            f"(supported: {', '.join(SUPPORTED_SCHEDULERS)})")
        return None
    if not isinstance(params, Mapping):
        problems.append(f"scheduler.params = {params!r}: expected an object {{...}}")
        return None
    checked = check_scheduler_params(typ, params, problems)
    return SchedulerConfig(type=typ, params=checked)


# Switches DeepSpeed acts on that zerojax loads without acting on: turned on, each warns with what
# happens instead (keys that would change the trained weights are refused, not listed here)
INERT_SWITCHES = {
    ("comet", "enabled"): "no Comet writer: nothing is sent to Comet (csv_monitor, tensorboard and wandb are written)",
    ("trackio", "enabled"): "no Trackio writer: nothing is sent to Trackio (csv_monitor, tensorboard and wandb are "
                            "written)",
    ("flops_profiler", "enabled"): "no FLOPs profiler: the trainer reports MFU, and `zerojax estimate` the FLOPs "
                                   "a token",
    ("hybrid_engine", "enabled"): "no hybrid engine: zerojax.generate decodes from the training engine's own arrays",
    ("comms_logger", "enabled"): "no collective logger: the collectives are in the compiled step's HLO "
                                 "(engine.lower_step) and the JAX profiler",
    ("zero_optimization", "zero_quantized_weights"): "ZeRO++'s int8 weight all-gather is not implemented: weights "
                                                     "are gathered in their own dtype",
    ("zero_optimization", "zero_quantized_gradients"): "ZeRO++'s quantized gradient reduction is not implemented: "
                                                       "gradients are reduced in their own dtype",
}


def inert_switches(kwargs) -> list[str]:
    """A warning for each `INERT_SWITCHES` key the config turns on."""
    notes = []
    for (section, key), instead in INERT_SWITCHES.items():
        if getattr(kwargs.get(section), key, False) is True:
            notes.append(f"{section}.{key} = true: zerojax does not act on it ({instead})")
    return notes


def _cross_checks(kwargs, zero, problems):
    """Problems go to `problems`; returns warnings, issued only if the config loads."""
    notes = []
    if pipeline_stages(kwargs.get("pipeline", PipelineConfig())) > 1:
        stages = kwargs["pipeline"].stages
        if zero.stage >= 2:  # DeepSpeed 0.19.8 PipelineEngine's assert
            problems.append(f"zero_optimization.stage = {zero.stage} with pipeline.stages = {stages}: ZeRO-2 and "
                            "ZeRO-3 are incompatible with pipeline parallelism; use stage 0 or 1, or pipeline.stages 1")
        if zero.stage == 1 and zero.offload_optimizer.device != "none":
            problems.append(f"zero_optimization.offload_optimizer.device = {zero.offload_optimizer.device!r} with "
                            f"pipeline.stages = {stages}: zerojax does not offload a pipelined model's optimizer; "
                            "set the device to \"none\" or pipeline.stages to 1")
    fp16, bf16 = kwargs.get("fp16", FP16Config()), kwargs.get("bf16", BF16Config())
    if fp16.enabled and bf16.enabled:
        problems.append("fp16.enabled and bf16.enabled are both true: bfloat16 and fp16 modes cannot be "
                        "simultaneously enabled; choose one")
    if fp16.fp16_master_weights_and_grads and zero.stage == 0:
        problems.append("fp16.fp16_master_weights_and_grads = true: Fp16_master_weights_and_grads is only "
                        f"supported with ZeRO Stage 1, 2, or 3 (zero_optimization.stage is {zero.stage})")
    if bf16.bf16_master_weights_and_grads and zero.stage == 0:
        problems.append("bf16.bf16_master_weights_and_grads = true: Bf16_master_weights_and_grads is only "
                        f"supported with ZeRO Stage 1, 2, or 3 (zero_optimization.stage is {zero.stage})")
    if bf16.bf16_optimizer_states and not (zero.stage > 0 and bf16.bf16_master_weights_and_grads):
        problems.append("bf16.bf16_optimizer_states = true: it is only supported with ZeRO Stage 1, 2, or 3 "
                        "and requires bf16.bf16_master_weights_and_grads to be enabled")
    ac = kwargs.get("activation_checkpointing")
    if ac is not None and ac.cpu_checkpointing and ac.remat_policy not in (None, "offload") and not (
            str(ac.remat_policy).startswith("offload_segments")):
        problems.append(f"activation_checkpointing.remat_policy = {ac.remat_policy!r} with cpu_checkpointing = "
                        "true: cpu_checkpointing keeps layer inputs in host memory (remat_policy \"offload\" or "
                        "\"offload_segments[_<k>]\"); remove one of the two keys")
    if ac is not None and ac.number_checkpoints and ac.remat_policy not in (None, "none", "full", "offload"):
        problems.append(f"activation_checkpointing.number_checkpoints = {ac.number_checkpoints} with remat_policy = "
                        f"{ac.remat_policy!r}: number_checkpoints makes two-level segments of \"full\" or "
                        "\"offload\" layers; remove one of the two keys (\"segments_<k>\" names k itself)")
    if kwargs.get("gradient_allreduce_op") == "sum":
        problems.append("gradient_allreduce_op = \"sum\": zerojax averages data-parallel gradients (DeepSpeed's "
                        "default \"mean\"); summing is not supported yet (DeepSpeed itself refuses it at ZeRO "
                        "stage 3); remove the key or scale the loss by the data-parallel size")
    for name, off in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if off.device != "nvme":
            continue
        if zero.stage != 3:  # DeepSpeed swaps to NVMe only in stage3.py; stage_1_and_2 offloads to CPU only
            problems.append(f"zero_optimization.{name}.device = \"nvme\": NVMe offload needs ZeRO stage 3 "
                            f"(zero_optimization.stage is {zero.stage}); DeepSpeed {DEEPSPEED_VERSION} swaps to NVMe "
                            "only in stage 3. Set \"stage\": 3, or use \"device\": \"cpu\"")
        if not off.nvme_path:
            problems.append(f"zero_optimization.{name}.device = \"nvme\" needs zero_optimization.{name}.nvme_path: "
                            "a directory on a local SSD for the swap files")
    if zero.offload_optimizer.host_layers and zero.offload_optimizer.device != "nvme":
        problems.append(f"zero_optimization.offload_optimizer.host_layers = {zero.offload_optimizer.host_layers} "
                        f"with device = \"{zero.offload_optimizer.device}\": host_layers splits the layers' state "
                        "between host memory and NVMe swap files; use \"device\": \"nvme\" or remove the key")
    if zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.buffer_count < 2:
        problems.append(f"zero_optimization.offload_optimizer.buffer_count = {zero.offload_optimizer.buffer_count}: "
                        "NVMe offload needs at least 2 buffers (one layer group read ahead, one written back)")
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        problems.append(f"zero_optimization.offload_optimizer.ratio = {zero.offload_optimizer.ratio}: Partial "
                        f"offloading only supported for ZeRO Stage 3 (zero_optimization.stage is {zero.stage})")
    if zero.offload_param.device != "none" and zero.stage < 3:
        notes.append(f"zero_optimization.offload_param has no effect at ZeRO stage {zero.stage}: parameter "
                     "offload needs stage 3 (parameters are only partitioned there)")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append("zero_optimization.offload_optimizer has no effect at ZeRO stage 0: it needs stage 1, 2 or 3")
    return notes


# DeepSpeed's _batch_assertion labels, kept in the messages so they read as DeepSpeed's own.
_BATCH_LABELS = {"train_batch_size": "Train batch size", "train_micro_batch_size_per_gpu": "Micro batch size per gpu",
                 "gradient_accumulation_steps": "Gradient accumulation steps"}


def _resolve_batch(kwargs, raw, unresolved, world_size, problems):
    """DeepSpeed's rule and checks; each message names the keys the user wrote (not DeepSpeed's derived ones)."""
    autos = [k for k in _BATCH_KEYS if k in unresolved]
    if any(k in raw and k not in autos and k not in kwargs for k in _BATCH_KEYS):
        return  # a trio value had a type error, already reported
    given = {k: kwargs[k] for k in _BATCH_KEYS if kwargs.get(k) is not None}
    bad = [k for k, v in given.items() if v <= 0]
    for k in bad:
        problems.append(f"{k} = {given[k]}: {_BATCH_LABELS[k]}: {given[k]} has to be greater than 0; "
                        "give a positive integer")
    tb, mb, ga = (given.get(k) for k in _BATCH_KEYS)
    if tb is None and mb is None:
        if not autos:
            problems.append("train_batch_size / train_micro_batch_size_per_gpu: Either train_batch_size or "
                            "train_micro_batch_size_per_gpu needs to be provided")
        return  # the autos are reported as unresolved
    if bad:
        return
    derived = None  # (key, formula) of a value DeepSpeed computes by floor division
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // world_size
        derived = ("gradient_accumulation_steps", f"train_batch_size // train_micro_batch_size_per_gpu // "
                   f"world_size = {tb} // {mb} // {world_size}", mb * world_size)
    elif tb is not None and mb is None:
        ga = 1 if ga is None else ga
        mb = tb // world_size // ga
        derived = ("train_micro_batch_size_per_gpu", f"train_batch_size // world_size // gradient_accumulation_steps"
                   f" = {tb} // {world_size} // {ga}", world_size * ga)
    elif tb is None:
        ga = 1 if ga is None else ga
        tb = mb * ga * world_size
    for k in autos:
        unresolved.remove(k)
    kwargs.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    if derived and (mb <= 0 or ga <= 0):
        key, formula, unit = derived
        problems.append(f"{key}: not given, and DeepSpeed derives it as {formula} = 0 ({_BATCH_LABELS[key]}: 0 has "
                        f"to be greater than 0); make train_batch_size a multiple of {unit}")
    elif tb != mb * ga * world_size:
        wrote = " / ".join(given)
        if derived:
            key, formula, unit = derived
            value = mb if key == "train_micro_batch_size_per_gpu" else ga
            how = f" ({key} derived as {formula} = {value}); make train_batch_size a multiple of {unit}"
        else:
            how = f"; set train_batch_size to {mb * ga * world_size} or leave one of the three keys out"
        problems.append(
            f"{wrote}: Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {ga} * {world_size}{how}")
