"""DeepSpeed JSON configs -> frozen dataclasses, with DeepSpeed's defaults, aliases and batch rule.

Follows DeepSpeed 0.19.x (`deepspeed/runtime/config.py`, `constants.py`, `precision_config.py`,
`zero/config.py`, `zero/offload_config.py`, `monitor/config.py`, `lr_schedules.py`, and the
optimizer construction in `runtime/engine.py`). Configs are parsed with hjson as DeepSpeed does,
so `#` and `//` comments load; duplicate keys are an error.

`"auto"` (the Hugging Face convention DeepSpeed tolerates):
- inside a section (`zero_optimization`, `fp16`, ...) it means DeepSpeed's default, as DeepSpeed's
  pydantic models drop `"auto"` values;
- at top level and in `optimizer.params` / `scheduler.params` it must be resolved: from `fill`
  (dotted keys, e.g. `{"optimizer.params.lr": 3e-4}`) or, for the batch trio, by DeepSpeed's
  batch-size rule. A `fill` value replaces an `"auto"` at any dotted key (`"fp16.enabled"` too); a
  `fill` entry whose key does not hold `"auto"` is not used. Autos left unresolved are reported
  together in one ConfigError.

Validation is stricter than DeepSpeed's in one way: unknown keys are errors everywhere (with a
"did you mean" suggestion), where DeepSpeed ignores unknown top-level keys silently.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import hjson

DEEPSPEED_VERSION = "0.19.x"
AUTO = "auto"


class ConfigError(ValueError):
    """Every problem found in a config; `.problems` holds one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the DeepSpeed config:\n{lines}")


# ----------------------------------------------------------------------------------------------
# Field specs: a dataclass field carries its JSON kind and range in metadata.

def _f(default=None, kind="any", *, factory=None, **checks):
    meta = {"kind": kind, **checks}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _empty():
    return types.MappingProxyType({})


_DEVICES = ("none", "cpu", "nvme")
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
           "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
           "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}


@dataclass(frozen=True)
class OffloadParamConfig:
    device: str = _f("none", "str", choices=_DEVICES, lower=True)
    nvme_path: str | None = _f(None, "str", optional=True)
    buffer_count: int = _f(5, "int", ge=0)
    buffer_size: int = _f(100_000_000, "int", ge=0)
    max_in_cpu: int = _f(1_000_000_000, "int", ge=0)
    pin_memory: bool = _f(False, "bool")


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    device: str = _f("none", "str", choices=_DEVICES, lower=True)
    nvme_path: str | None = _f(None, "str", optional=True)
    buffer_count: int = _f(4, "int", ge=0)
    pin_memory: bool = _f(False, "bool")
    pipeline_read: bool = _f(False, "bool")
    pipeline_write: bool = _f(False, "bool")
    fast_init: bool = _f(False, "bool")
    ratio: float = _f(1.0, "float", ge=0.0, le=1.0)
    super_offload: bool = _f(False, "bool")
    convert_grad_on_cpu: bool = _f(True, "bool")
    cpuadam_cores_perc: float = _f(0.8, "float", ge=0.0, le=1.0)


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _f(0, "int", ge=0, le=3)
    contiguous_gradients: bool = _f(True, "bool")
    reduce_scatter: bool = _f(True, "bool")
    reduce_bucket_size: int = _f(500_000_000, "int", ge=0)
    use_multi_rank_bucket_allreduce: bool = _f(True, "bool")
    allgather_partitions: bool = _f(True, "bool")
    allgather_bucket_size: int = _f(500_000_000, "int", ge=0)
    # DeepSpeed's default is None, resolved to (stage == 3); stored resolved.
    overlap_comm: bool | None = _f(None, "bool", optional=True)
    load_from_fp32_weights: bool = _f(True, "bool")
    elastic_checkpoint: bool = _f(False, "bool")
    offload_param: OffloadParamConfig = _f(kind="section", factory=OffloadParamConfig, cls=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = _f(kind="section", factory=OffloadOptimizerConfig,
                                                   cls=OffloadOptimizerConfig)
    zenflow: Mapping | None = _f(None, "mapping", optional=True)
    sub_group_size: int = _f(1_000_000_000, "int", ge=0)
    stage3_prefetch_bucket_size: int = _f(50_000_000, "int", ge=0)
    stage3_param_persistence_threshold: int = _f(100_000, "int", ge=0)
    stage3_model_persistence_threshold: int = _f(9223372036854775807, "int", ge=0)  # sys.maxsize
    stage3_max_live_parameters: int = _f(1_000_000_000, "int", ge=0)
    stage3_max_reuse_distance: int = _f(1_000_000_000, "int", ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = _f(False, "bool")
    stage3_module_granularity_threshold: int = _f(0, "int")
    stage3_use_all_reduce_for_fetch_params: bool = _f(False, "bool")
    stage3_allgather_sequential: bool = _f(False, "bool")
    stage3_partition_stream_chunk_size: int = _f(0, "int", ge=0)
    ignore_unused_parameters: bool = _f(True, "bool")
    legacy_stage1: bool = _f(False, "bool")
    round_robin_gradients: bool = _f(False, "bool")
    zero_hpz_partition_size: int = _f(1, "int", ge=0)
    zero_quantized_weights: bool = _f(False, "bool")
    zero_quantized_nontrainable_weights: bool = _f(False, "bool")
    zero_quantized_gradients: bool = _f(False, "bool")
    zeropp_loco_param: Mapping | None = _f(None, "mapping", optional=True)
    mics_shard_size: int = _f(-1, "int")
    mics_hierarchical_params_gather: bool = _f(False, "bool")
    memory_efficient_linear: bool = _f(True, "bool")
    pipeline_loading_checkpoint: bool = _f(False, "bool")
    override_module_apply: bool = _f(True, "bool")
    log_trace_cache_warnings: bool = _f(False, "bool")
    enable_sanity_checks: bool = _f(False, "bool")
    save_muon_momentum_buffer_in_memory: bool = _f(False, "bool")
    leaf_module: Mapping = _f(kind="mapping", factory=_empty)


# DeepSpeed's pydantic aliases (populate_by_name): both spellings load; we keep the stage3_ name.
_ZERO_ALIASES = {name[len("stage3_"):]: name for name in (
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "stage3_partition_stream_chunk_size")}
_ZERO_ALIASES["stage3_gather_fp16_weights_on_model_save"] = "stage3_gather_16bit_weights_on_model_save"
# Deprecated keys with no replacement value: accepted with a warning, as DeepSpeed does.
_ZERO_DEPRECATED_NOOP = ("cpu_offload_use_pin_memory",)


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = _f(False, "bool")
    auto_cast: bool = _f(False, "bool")
    loss_scale: float = _f(0.0, "float", ge=0.0)
    initial_scale_power: int = _f(16, "int", ge=0)
    loss_scale_window: int = _f(1000, "int", ge=1)
    hysteresis: int = _f(2, "int", ge=1)
    consecutive_hysteresis: bool = _f(False, "bool")
    min_loss_scale: float = _f(1.0, "float", gt=0.0)
    fp16_master_weights_and_grads: bool = _f(False, "bool")


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = _f(False, "bool")
    immediate_grad_update: bool = _f(False, "bool")
    check_grad_overflow: bool = _f(False, "bool")
    bf16_master_weights_and_grads: bool = _f(False, "bool")
    bf16_optimizer_states: bool = _f(False, "bool")


@dataclass(frozen=True)
class DataTypesConfig:
    grad_accum_dtype: str | None = _f(None, "dtype", optional=True)
    param_dtype: str | None = _f(None, "dtype", optional=True)
    buffer_dtype: str | None = _f(None, "dtype", optional=True)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = _f(None, "str")
    params: Mapping = _f(kind="mapping", factory=_empty)
    legacy_fusion: bool = _f(False, "bool")


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = _f(None, "str")
    params: Mapping = _f(kind="mapping", factory=_empty)


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = _f(False, "bool")
    contiguous_memory_optimization: bool = _f(False, "bool")
    cpu_checkpointing: bool = _f(False, "bool")
    # DeepSpeed reads it with get_scalar_param (any value); configs in the wild write false for "unset".
    number_checkpoints: int | None = _f(None, "int", optional=True, ge=0, false_is_none=True)
    synchronize_checkpoint_boundary: bool = _f(False, "bool")
    profile: bool = _f(False, "bool")


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = _f(False, "bool")
    output_path: str = _f("", "str")
    job_name: str = _f("DeepSpeedJobName", "str")


@dataclass(frozen=True)
class CSVConfig:
    enabled: bool = _f(False, "bool")
    output_path: str = _f("", "str")
    job_name: str = _f("DeepSpeedJobName", "str")


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = _f(False, "bool")
    group: str | None = _f(None, "str", optional=True)
    team: str | None = _f(None, "str", optional=True)
    project: str = _f("deepspeed", "str")


@dataclass(frozen=True)
class CometConfig:
    enabled: bool = _f(False, "bool")
    samples_log_interval: int = _f(100, "int", ge=1)
    project: str | None = _f(None, "str", optional=True)
    workspace: str | None = _f(None, "str", optional=True)
    api_key: str | None = _f(None, "str", optional=True)
    experiment_name: str | None = _f(None, "str", optional=True)
    experiment_key: str | None = _f(None, "str", optional=True)
    online: bool | None = _f(None, "bool", optional=True)
    mode: str | None = _f(None, "str", optional=True, choices=("get", "create", "get_or_create"))


@dataclass(frozen=True)
class TrackioConfig:
    enabled: bool = _f(False, "bool")
    project: str = _f("deepspeed", "str")


@dataclass(frozen=True)
class FlopsProfilerConfig:
    enabled: bool = _f(False, "bool")
    recompute_fwd_factor: float = _f(0.0, "float", ge=0.0)
    profile_step: int = _f(1, "int", ge=1)
    module_depth: int = _f(-1, "int")
    top_modules: int = _f(1, "int", ge=1)
    detailed: bool = _f(True, "bool")
    output_file: str | None = _f(None, "str", optional=True)


@dataclass(frozen=True)
class CheckpointConfig:
    tag_validation: str = _f("WARN", "str", upper=True, choices=("WARN", "IGNORE", "FAIL"))
    load_universal: bool = _f(False, "bool")
    use_node_local_storage: bool = _f(False, "bool")
    parallel_write: Mapping = _f(kind="mapping", factory=_empty)
    serialization: bool = _f(True, "bool")
    writer: Mapping | None = _f(None, "mapping", optional=True)


@dataclass(frozen=True)
class PipelineConfig:
    stages: Any = _f("auto", "int_or_auto")
    partition: str = _f("best", "str")
    seed_layers: bool = _f(False, "bool")
    activation_checkpoint_interval: int = _f(0, "int", ge=0)
    pipe_partitioned: bool = _f(True, "bool")
    grad_partitioned: bool = _f(True, "bool")


@dataclass(frozen=True)
class TensorParallelConfig:
    # DeepSpeed's default is 0 ("disabled"); zerojax reads 0 as 1 (no tensor axis).
    autotp_size: int = _f(1, "int", ge=0)
    tp_overlap_comm: bool = _f(False, "bool")
    tp: Mapping = _f(kind="mapping", factory=_empty)
    dtype: str | None = _f(None, "dtype", optional=True)
    partition_config: Mapping | None = _f(None, "mapping", optional=True)
    preset_model: str | None = _f(None, "str", optional=True)
    keep_module_on_host: bool = _f(False, "bool")
    replace_with_kernel_inject: bool = _f(False, "bool")


_TP_ALIASES = {"tensor_parallel": "tp", "kernel_inject": "replace_with_kernel_inject"}


@dataclass(frozen=True)
class Config:
    """A resolved DeepSpeed config. Field names are DeepSpeed's keys."""

    train_batch_size: int = _f(None, "int", optional=True)
    train_micro_batch_size_per_gpu: int = _f(None, "int", optional=True)
    gradient_accumulation_steps: int = _f(None, "int", optional=True)
    world_size: int = 1  # not a DeepSpeed key: the data-parallel size the trio was resolved with
    steps_per_print: int | None = _f(None, "int", optional=True, ge=1)
    wall_clock_breakdown: bool = _f(False, "bool")
    memory_breakdown: bool = _f(False, "bool")
    dump_state: bool = _f(False, "bool")
    gradient_clipping: float = _f(0.0, "float", ge=0.0)
    prescale_gradients: bool = _f(False, "bool")
    gradient_predivide_factor: float = _f(1.0, "float", gt=0.0)
    communication_data_type: str | None = _f(None, "str", optional=True, lower=True,
                                             choices=("fp16", "bf16", "fp32"))
    seq_parallel_comm_data_type: str = _f("fp32", "str", lower=True, choices=("fp16", "bf16", "fp32"))
    sequence_parallel_size: int = _f(1, "int", ge=1)
    disable_allgather: bool = _f(False, "bool")
    sparse_gradients: bool = _f(False, "bool")
    graph_harvesting: bool = _f(False, "bool")
    dataloader_drop_last: bool = _f(False, "bool")
    use_data_before_expert_parallelism: bool = _f(False, "bool")
    vocabulary_size: int | None = _f(None, "int", optional=True, ge=1)
    zero_allow_untested_optimizer: bool = _f(False, "bool")
    zero_force_ds_cpu_optimizer: bool = _f(True, "bool")
    data_types: DataTypesConfig = _f(kind="section", factory=DataTypesConfig, cls=DataTypesConfig)
    fp16: FP16Config = _f(kind="section", factory=FP16Config, cls=FP16Config)
    bf16: BF16Config = _f(kind="section", factory=BF16Config, cls=BF16Config)
    optimizer: OptimizerConfig | None = _f(None, "special")
    scheduler: SchedulerConfig | None = _f(None, "special")
    zero_optimization: ZeroConfig = _f(kind="special", factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = _f(
        None, "section", optional=True, cls=ActivationCheckpointingConfig)
    tensorboard: TensorBoardConfig = _f(kind="section", factory=TensorBoardConfig, cls=TensorBoardConfig)
    csv_monitor: CSVConfig = _f(kind="section", factory=CSVConfig, cls=CSVConfig)
    wandb: WandbConfig = _f(kind="section", factory=WandbConfig, cls=WandbConfig)
    comet: CometConfig = _f(kind="section", factory=CometConfig, cls=CometConfig)
    trackio: TrackioConfig = _f(kind="section", factory=TrackioConfig, cls=TrackioConfig)
    flops_profiler: FlopsProfilerConfig = _f(kind="section", factory=FlopsProfilerConfig,
                                             cls=FlopsProfilerConfig)
    checkpoint: CheckpointConfig = _f(kind="section", factory=CheckpointConfig, cls=CheckpointConfig)
    pipeline: PipelineConfig = _f(kind="section", factory=PipelineConfig, cls=PipelineConfig)
    tensor_parallel: TensorParallelConfig = _f(kind="special", factory=TensorParallelConfig)
    # Accepted, carried as read-only mappings, not acted on (see README.md, "Supported DeepSpeed config keys").
    amp: Mapping | None = _f(None, "special")
    torch_autocast: Mapping | None = _f(None, "special")
    sparse_attention: Mapping | None = _f(None, "mapping", optional=True)
    compression_training: Mapping | None = _f(None, "mapping", optional=True)
    elasticity: Mapping | None = _f(None, "mapping", optional=True)
    aio: Mapping | None = _f(None, "mapping", optional=True)
    autotuning: Mapping | None = _f(None, "mapping", optional=True)
    comms_logger: Mapping | None = _f(None, "mapping", optional=True)
    eigenvalue: Mapping | None = _f(None, "mapping", optional=True)
    quantize_training: Mapping | None = _f(None, "mapping", optional=True)
    progressive_layer_drop: Mapping | None = _f(None, "mapping", optional=True)
    curriculum_learning: Mapping | None = _f(None, "mapping", optional=True)
    data_efficiency: Mapping | None = _f(None, "mapping", optional=True)
    hybrid_engine: Mapping | None = _f(None, "mapping", optional=True)
    nebula: Mapping | None = _f(None, "mapping", optional=True)
    datastates: Mapping | None = _f(None, "mapping", optional=True)
    weight_quantization: Mapping | None = _f(None, "mapping", optional=True)
    compile: Mapping | None = _f(None, "mapping", optional=True)
    timers: Mapping | None = _f(None, "mapping", optional=True)
    expert_parallel: Mapping | None = _f(None, "mapping", optional=True)

    def to_dict(self) -> dict:
        """The resolved config as DeepSpeed JSON; `load_config(d, world_size=cfg.world_size) == cfg`."""
        return _to_json(self)


# ----------------------------------------------------------------------------------------------
# Optimizers and schedulers: DeepSpeed's names and each one's constructor parameters.

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad")
_NUM, _NONNEG, _BOOL, _BETAS, _POSINT, _INT = "num", "nonneg", "bool", "betas", "posint", "int"
_ADAM_PARAMS = {"lr": _NONNEG, "betas": _BETAS, "eps": _NONNEG, "weight_decay": _NONNEG,
                "adam_w_mode": _BOOL, "bias_correction": _BOOL, "amsgrad": _BOOL, "torch_adam": _BOOL,
                "fused": _BOOL}
OPTIMIZER_PARAMS = {
    "Adam": _ADAM_PARAMS,
    "AdamW": _ADAM_PARAMS,
    # deepspeed.ops.lamb.FusedLamb (max_grad_norm is refused by the engine for every optimizer)
    "Lamb": {"lr": _NONNEG, "bias_correction": _BOOL, "betas": _BETAS, "eps": _NONNEG,
             "eps_inside_sqrt": _BOOL, "weight_decay": _NONNEG, "max_coeff": _NONNEG,
             "min_coeff": _NONNEG, "amsgrad": _BOOL},
    "Lion": {"lr": _NONNEG, "betas": _BETAS, "weight_decay": _NONNEG},
    "SGD": {"lr": _NONNEG, "momentum": _NONNEG, "dampening": _NONNEG, "weight_decay": _NONNEG,
            "nesterov": _BOOL},
    "Adagrad": {"lr": _NONNEG, "lr_decay": _NONNEG, "weight_decay": _NONNEG,
                "initial_accumulator_value": _NONNEG, "eps": _NONNEG},
}
# DeepSpeed optimizers zerojax does not run: (closest supported, why results would differ).
_UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": ("Adam", "1-bit Adam compresses gradient communication with error feedback"),
    "zerooneadam": ("Adam", "0/1 Adam skips and compresses variance updates and communication"),
    "onebitlamb": ("Lamb", "1-bit LAMB compresses gradient communication with error feedback"),
    "muadam": ("Adam", "MuAdam (muP) rescales per-layer learning rates by width"),
    "muadamw": ("AdamW", "MuAdamW (muP) rescales per-layer learning rates by width"),
    "musgd": ("SGD", "MuSGD (muP) rescales per-layer learning rates by width"),
    "muon": ("AdamW", "Muon orthogonalises matrix updates (Newton-Schulz)"),
}
_MAX_GRAD_NORM_MSG = (
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
    "parameter 'gradient_clipping' see: https://www.deepspeed.ai/docs/config-json/#gradient-clipping "
    "for more details")

SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
_WARMUP = {"warmup_min_lr": _NUM, "warmup_max_lr": _NUM, "warmup_num_steps": _POSINT,
           "warmup_type": "warmup_type", "last_batch_iteration": _INT}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": _POSINT, **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": _POSINT, "warmup_min_ratio": _NONNEG, "warmup_num_steps": _POSINT,
                       "cos_min_ratio": _NONNEG, "warmup_type": "warmup_type", "last_batch_iteration": _INT},
    "OneCycle": {"cycle_min_lr": _NUM, "cycle_max_lr": _NUM, "decay_lr_rate": _NUM,
                 "cycle_first_step_size": _POSINT, "cycle_second_step_size": _POSINT,
                 "cycle_first_stair_count": _INT, "cycle_second_stair_count": _INT,
                 "decay_step_size": _INT, "cycle_momentum": _BOOL, "cycle_min_mom": _NUM,
                 "cycle_max_mom": _NUM, "decay_mom_rate": _NUM, "last_batch_iteration": _INT},
    "LRRangeTest": {"lr_range_test_min_lr": _NUM, "lr_range_test_step_size": _POSINT,
                    "lr_range_test_step_rate": _NUM, "lr_range_test_staircase": _BOOL,
                    "last_batch_iteration": _INT},
}
_SCHEDULER_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
                       "OneCycle": ("cycle_min_lr", "cycle_max_lr")}

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_CONFIG_KEYS = tuple(f.name for f in fields(Config) if f.name != "world_size")
_TOP_ALIASES = {"bfloat16": "bf16"}


# ----------------------------------------------------------------------------------------------
# Public entry point.

def load_config(source, *, world_size: int | None = None, fill: Mapping[str, Any] | None = None) -> Config:
    """Load a DeepSpeed config (path, JSON/hjson text, or dict) into a resolved, validated Config.

    world_size: the data-parallel size for the batch trio; default `jax.device_count()` divided by
    tensor_parallel.autotp_size and sequence_parallel_size.
    fill: values for `"auto"` entries, by dotted key (`{"optimizer.params.lr": 3e-4}`).
    """
    raw = _read(source)
    problems: list[str] = []
    fill = dict(fill or {})
    for key in fill:
        if not isinstance(key, str):
            problems.append(f"fill: keys are dotted config keys (str), got {key!r}")
    raw = _plain(raw)
    unresolved = _apply_fill(raw, fill)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        problems.append(f"world_size = {world_size!r}: expected a positive integer")
        world_size = None

    kwargs = _build_top(raw, unresolved, problems)
    zero = kwargs.get("zero_optimization", ZeroConfig())
    tp = kwargs.get("tensor_parallel", TensorParallelConfig())
    notes = _cross_checks(kwargs, zero, problems)

    if world_size is None:
        import jax  # lazily: config.py itself must not need jax

        world_size = max(1, jax.device_count() // (tp.autotp_size * kwargs.get("sequence_parallel_size", 1)))
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
        warnings.warn(note, UserWarning, stacklevel=2)
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


# ----------------------------------------------------------------------------------------------
# Reading and "auto".

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


def _read(source):
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


def _plain(x):
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _is_auto(v):
    return isinstance(v, str) and v == AUTO


def _apply_fill(raw, fill):
    """Replace "auto" values named in fill; return the dotted paths of the autos left."""
    left = []

    def walk(node, prefix):
        for k, v in list(node.items()):
            path = f"{prefix}.{k}" if prefix else str(k)
            if _is_auto(v):
                if path in fill:
                    node[k] = _plain(fill[path])
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


# ----------------------------------------------------------------------------------------------
# Generic field conversion.

def _freeze(x):
    if isinstance(x, Mapping):
        return types.MappingProxyType({k: _freeze(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _thaw(x):
    if isinstance(x, Mapping):
        return {k: _thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [_thaw(v) for v in x]
    return x


def _suggest(key, known):
    match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _unknown(path, key, known, problems, *, list_known=True):
    hint = _suggest(key, known)
    accepted = f" (accepted: {', '.join(sorted(known))})" if list_known and not hint else ""
    where = f"{path}.{key}" if path else str(key)
    problems.append(f"{where}: unknown key{hint}{accepted}")


def _convert(value, meta, path, problems):
    """Check one value against its field spec; returns (ok, converted)."""
    kind, given = meta["kind"], value
    if (value is None and meta.get("optional")) or (value is False and meta.get("false_is_none")):
        return True, None

    def bad(expected):
        problems.append(f"{path} = {json.dumps(given) if _jsonable(given) else repr(given)}: expected {expected}")
        return False, None

    if kind == "bool":
        if not isinstance(value, bool):
            return bad("true or false")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()):
            return bad("an integer")
        value = int(value)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return bad("a finite number")
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            return bad("a string" + (f", one of {list(meta['choices'])}" if "choices" in meta else ""))
        value = value.lower() if meta.get("lower") else value.upper() if meta.get("upper") else value
    elif kind == "dtype":
        if not isinstance(value, str) or value.lower() not in _DTYPES:
            return bad('one of "fp32", "bf16", "fp16"')
        value = _DTYPES[value.lower()]
    elif kind == "mapping":
        if not isinstance(value, Mapping):
            return bad("an object {...}")
        value = _freeze(value)
    elif kind == "int_or_auto":
        if _is_auto(value):
            return True, value
        return _convert(value, {"kind": "int", "ge": 1}, path, problems)
    else:
        value = _freeze(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return bad(f"one of {list(choices)}")
    for op, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                         ("le", lambda a, b: a <= b, "<=")):
        if op in meta and not ok(value, meta[op]):
            return bad(f"a value {word} {meta[op]}")
    return True, value


def _jsonable(v):
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


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
            _unknown(path, key, list(specs) + list(aliases), problems)
            continue
        if name in given_as:
            problems.append(f"{path}: {given_as[name]!r} and {key!r} are the same setting; give one")
            continue
        given_as[name] = key
        if _is_auto(value) and specs[name].metadata["kind"] != "int_or_auto":
            continue  # DeepSpeed drops "auto" inside sections: the default applies
        meta = specs[name].metadata
        if meta["kind"] == "section":
            kwargs[name] = _build(meta["cls"], value, f"{path}.{key}", problems) if value is not None else (
                None if meta.get("optional") else meta["cls"]())
            continue
        ok, conv = _convert(value, meta, f"{path}.{key}", problems)
        if ok:
            kwargs[name] = conv
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# Top level.

def _build_top(raw, unresolved, problems):
    specs = {f.name: f for f in fields(Config)}
    unresolved_top = {p for p in unresolved if "." not in p}
    if "bf16" in raw and "bfloat16" in raw:
        problems.append("bf16 and bfloat16 (its old name) are both given; keep \"bf16\"")
    kwargs = {}
    for key, value in raw.items():
        name = _TOP_ALIASES.get(key, key)
        if name == "zero_optimization":
            kwargs[name] = _build_zero(raw, value, problems)
            continue
        if key == "allgather_size" and isinstance(raw.get("zero_optimization"), bool):
            continue  # legacy partner of `"zero_optimization": true`
        if name not in specs or name == "world_size":
            _unknown("", key, _CONFIG_KEYS + tuple(_TOP_ALIASES), problems, list_known=False)
            if not _suggest(key, _CONFIG_KEYS):
                problems[-1] += " (README.md, 'Supported DeepSpeed config keys', lists the keys zerojax accepts)"
            continue
        if key in unresolved_top:
            continue  # reported as unresolved auto, or resolved by the batch rule
        meta = specs[name].metadata
        if name == "optimizer":
            kwargs[name] = _build_optimizer(value, problems)
        elif name == "scheduler":
            kwargs[name] = _build_scheduler(value, problems)
        elif name == "tensor_parallel":
            tp = _build(TensorParallelConfig, value, "tensor_parallel", problems, aliases=_TP_ALIASES)
            kwargs[name] = dataclasses.replace(tp, autotp_size=max(1, tp.autotp_size))
        elif name in ("amp", "torch_autocast"):
            kwargs[name] = _build_foreign_precision(name, value, problems)
        elif meta["kind"] == "section":
            if value is None:
                kwargs[name] = None if meta.get("optional") else meta["cls"]()
            else:
                kwargs[name] = _build(meta["cls"], value, key, problems)
        else:
            ok, conv = _convert(value, meta, key, problems)
            if ok:
                kwargs[name] = conv
    if "zero_optimization" not in kwargs:
        kwargs["zero_optimization"] = _build_zero(raw, {}, problems)
    return kwargs


def _build_foreign_precision(name, value, problems):
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"{name} = {value!r}: expected an object {{...}}")
        return None
    if value.get("enabled") is True:
        what = "Apex AMP" if name == "amp" else "torch.autocast"
        problems.append(
            f"{name}.enabled = true: {what} is a PyTorch mechanism with no JAX equivalent; "
            "use \"bf16\": {\"enabled\": true} (or \"fp16\": {\"enabled\": true}) instead")
    return _freeze(value)


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
    for old, new, cls in (("cpu_offload", "offload_optimizer", OffloadOptimizerConfig),
                          ("cpu_offload_param", "offload_param", OffloadParamConfig)):
        if old not in value:
            continue
        flag = value.pop(old)
        if _is_auto(flag):
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
    for old in _ZERO_DEPRECATED_NOOP:
        if old in value:
            value.pop(old)
            warnings.warn(f"Config parameter {old} is deprecated use offload_param or offload_optimizer "
                          "instead (it has no effect)", DeprecationWarning, stacklevel=4)
    zero = _build(ZeroConfig, value, path, problems, aliases=_ZERO_ALIASES)
    overlap = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    return dataclasses.replace(zero, overlap_comm=overlap)


def _check_params(params, schema, path, problems, *, required=()):
    out = {}
    for name, value in params.items():
        where = f"{path}.{name}"
        if name == "max_grad_norm":
            problems.append(f"{where}: {_MAX_GRAD_NORM_MSG}")
            continue
        if name not in schema:
            _unknown(path, name, schema, problems)
            continue
        if _is_auto(value):
            out[name] = value  # reported as unresolved
            continue
        kind = schema[name]
        ok, conv = _check_param(value, kind, where, problems)
        if ok:
            out[name] = conv
    for name in required:
        if name not in params:
            problems.append(f"{path}.{name}: required by this scheduler and missing")
    return _freeze(out)


def _check_param(value, kind, where, problems):
    if kind == _BOOL:
        return _convert(value, {"kind": "bool"}, where, problems)
    if kind in (_NUM, _NONNEG):
        if isinstance(value, (list, tuple)):  # DeepSpeed allows one value per param group
            results = [_check_param(v, kind, where, problems) for v in value]
            return all(r[0] for r in results), [r[1] for r in results]
        ok, conv = _convert(value, {"kind": "float", **({"ge": 0.0} if kind == _NONNEG else {})}, where, problems)
        return ok, (value if ok else None)  # keep the user's int/float as written
    if kind in (_INT, _POSINT):
        return _convert(value, {"kind": "int", **({"ge": 1} if kind == _POSINT else {})}, where, problems)
    if kind == _BETAS:
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
            problems.append(f"{where} = {value!r}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")
            return False, None
        return True, list(value)
    if kind == "warmup_type":
        if value not in ("log", "linear"):
            problems.append(f"{where} = {value!r}: expected one of ['log', 'linear']")
            return False, None
        return True, value
    return True, value


def _canonical_optimizer(name):
    lowered = name.lower()
    for canon in SUPPORTED_OPTIMIZERS:
        if canon.lower() == lowered:
            return canon
    return None


def _build_optimizer(value, problems):
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"optimizer = {value!r}: expected an object {{\"type\": ..., \"params\": {{...}}}}")
        return None
    for key in value:
        if key not in ("type", "params", "legacy_fusion"):
            _unknown("optimizer", key, ("type", "params", "legacy_fusion"), problems)
    typ, params = value.get("type"), value.get("params") or {}
    ok_fusion, fusion = _convert(value.get("legacy_fusion", False), {"kind": "bool"}, "optimizer.legacy_fusion",
                                 problems)
    if not isinstance(typ, str) or _is_auto(typ):
        if not _is_auto(typ):
            problems.append(f"optimizer.type = {typ!r}: expected one of {list(SUPPORTED_OPTIMIZERS)}")
        return None
    if not isinstance(params, Mapping):
        problems.append(f"optimizer.params = {params!r}: expected an object {{...}}")
        return None
    canon = _canonical_optimizer(typ)
    if canon is None:
        lowered = typ.lower()
        if lowered in _UNSUPPORTED_OPTIMIZERS:
            closest, why = _UNSUPPORTED_OPTIMIZERS[lowered]
            problems.append(
                f"optimizer.type = {typ!r} is not supported by zerojax: {why}, so substituting another "
                f"optimizer would change results; the closest supported choice is {closest!r} "
                f"(supported: {', '.join(SUPPORTED_OPTIMIZERS)})")
        else:
            hint = _suggest(typ, SUPPORTED_OPTIMIZERS)
            problems.append(f"optimizer.type = {typ!r}: unknown optimizer{hint} "
                            f"(supported, case-insensitive: {', '.join(SUPPORTED_OPTIMIZERS)})")
        if "max_grad_norm" in params:
            problems.append(f"optimizer.params.max_grad_norm: {_MAX_GRAD_NORM_MSG}")
        return None
    checked = _check_params(params, OPTIMIZER_PARAMS[canon], "optimizer.params", problems)
    return OptimizerConfig(type=typ, params=checked, legacy_fusion=fusion if ok_fusion else False)


def _build_scheduler(value, problems):
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.append(f"scheduler = {value!r}: expected an object {{\"type\": ..., \"params\": {{...}}}}")
        return None
    for key in value:
        if key not in ("type", "params"):
            _unknown("scheduler", key, ("type", "params"), problems)
    typ, params = value.get("type"), value.get("params") or {}
    if not isinstance(typ, str) or typ not in SUPPORTED_SCHEDULERS:
        if not _is_auto(typ):
            hint = _suggest(typ, SUPPORTED_SCHEDULERS) if isinstance(typ, str) else ""
            problems.append(f"scheduler.type = {typ!r}: unknown scheduler{hint} "
                            f"(supported: {', '.join(SUPPORTED_SCHEDULERS)})")
        return None
    if not isinstance(params, Mapping):
        problems.append(f"scheduler.params = {params!r}: expected an object {{...}}")
        return None
    checked = _check_params(params, SCHEDULER_PARAMS[typ], "scheduler.params", problems,
                            required=_SCHEDULER_REQUIRED.get(typ, ()))
    return SchedulerConfig(type=typ, params=checked)


# ----------------------------------------------------------------------------------------------
# Cross-field rules.

def _cross_checks(kwargs, zero, problems):
    """Problems go to `problems`; returns warnings, issued only if the config loads."""
    notes = []
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
    for name, off in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if off.device == "nvme":
            problems.append(f"zero_optimization.{name}.device = \"nvme\": NVMe offload is not supported yet by "
                            "zerojax; use \"device\": \"cpu\"")
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        problems.append(f"zero_optimization.offload_optimizer.ratio = {zero.offload_optimizer.ratio}: Partial "
                        f"offloading only supported for ZeRO Stage 3 (zero_optimization.stage is {zero.stage})")
    if zero.offload_param.device != "none" and zero.stage < 3:
        notes.append(f"zero_optimization.offload_param has no effect at ZeRO stage {zero.stage}: parameter "
                     "offload needs stage 3 (parameters are only partitioned there)")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append("zero_optimization.offload_optimizer has no effect at ZeRO stage 0: it needs stage 1, 2 or 3")
    return notes


# ----------------------------------------------------------------------------------------------
# The batch trio: DeepSpeed's _set_batch_related_parameters, then _batch_assertion.

def _resolve_batch(kwargs, raw, unresolved, world_size, problems):
    autos = [k for k in _BATCH_KEYS if k in unresolved]
    vals = {k: kwargs.get(k) for k in _BATCH_KEYS}
    if any(k in raw and k not in autos and k not in kwargs for k in _BATCH_KEYS):
        return  # a trio value had a type error, already reported
    tb, mb, ga = vals["train_batch_size"], vals["train_micro_batch_size_per_gpu"], vals["gradient_accumulation_steps"]
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // mb // world_size
    elif tb is not None and ga is not None:
        mb = tb // world_size // ga if ga else 0
    elif mb is not None and ga is not None:
        tb = mb * ga * world_size
    elif tb is not None:
        ga, mb = 1, tb // world_size
    elif mb is not None:
        tb, ga = mb * world_size, 1
    else:
        if not autos:
            problems.append("train_batch_size / train_micro_batch_size_per_gpu: Either train_batch_size or "
                            "train_micro_batch_size_per_gpu needs to be provided")
        return  # the autos are reported as unresolved
    for k in autos:
        unresolved.remove(k)
    kwargs.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    if tb <= 0:
        problems.append(f"train_batch_size: Train batch size: {tb} has to be greater than 0")
    elif mb <= 0:
        problems.append(f"train_micro_batch_size_per_gpu: Micro batch size per gpu: {mb} has to be greater than 0")
    elif ga <= 0:
        problems.append(f"gradient_accumulation_steps: Gradient accumulation steps: {ga} has to be greater than 0")
    elif tb != mb * ga * world_size:
        problems.append(
            "train_batch_size: Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {ga} * {world_size}")


# ----------------------------------------------------------------------------------------------
# Back to JSON.

def _to_json(obj):
    out = {}
    for f in fields(obj):
        if f.name == "world_size":
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = _to_json(v)
        elif v is None and f.metadata.get("kind") in ("section", "special", "mapping"):
            continue  # absent section
        else:
            out[f.name] = _thaw(v)
    return out
