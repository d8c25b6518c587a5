"""DeepSpeed JSON configs -> frozen dataclasses, with DeepSpeed's defaults, aliases and batch rule.

Follows DeepSpeed 0.19.8 (`deepspeed/runtime/config.py`, `constants.py`, `precision_config.py`,
`zero/config.py`, `zero/offload_config.py`, `monitor/config.py`, `compile/config.py`,
`lr_schedules.py`, and the optimizer construction in `runtime/engine.py`). Configs are parsed with
hjson as DeepSpeed does, so `#` and `//` comments load; duplicate keys are an error.

Each schema field carries its documentation as the string under it (DeepSpeed's meaning, then
"zerojax:" and what zerojax does with it); `docs/config-keys.md` is generated from them
(`python -m zerojax.config_docs --write docs/config-keys.md`).

`"auto"` (the Hugging Face convention DeepSpeed tolerates):
- inside a section (`zero_optimization`, `fp16`, ...) it means DeepSpeed's default, as DeepSpeed's
  pydantic models drop `"auto"` values;
- at top level and in `optimizer.params` / `scheduler.params` it must be resolved: from `fill`
  (dotted keys, e.g. `{"optimizer.params.lr": 3e-4}`) or, for the batch trio, by DeepSpeed's
  batch-size rule. A `fill` value replaces an `"auto"` at any dotted key (`"fp16.enabled"` too); a
  `fill` entry whose key does not hold `"auto"` is not used. Autos left unresolved are reported
  together in one ConfigError.

Unknown keys, as DeepSpeed treats them: at top level DeepSpeed reads the keys it knows and never
looks at the others, so zerojax loads them too, with one warning per key ("did you mean" when one
is close to a known key). Sections DeepSpeed validates with pydantic models (extra="forbid":
`zero_optimization` and its offload sections, `fp16`, `bf16`, monitors, `compile`, ...) are
strict here as well, with a "did you mean". Features DeepSpeed 0.19.8 removed are refused with
DeepSpeed's reason.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, NamedTuple

import hjson

DEEPSPEED_VERSION = "0.19.8"
AUTO = "auto"


class ConfigError(ValueError):
    """Every problem found in a config; `.problems` holds one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the DeepSpeed config:\n{lines}")


# Features DeepSpeed removed (DeepSpeed issue #8489): any presence of the key, even null, {} or
# false, is a DeepSpeedConfigError. Reasons transcribed from DeepSpeed 0.19.8
# `deepspeed/runtime/config.py` (`_REMOVED_TOP_LEVEL_CONFIG_KEYS`, `_REMOVED_ZERO_CONFIG_KEYS`,
# checked by `_reject_removed_config_keys` before anything else is read).
_REMOVED_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"
REMOVED_TOP_LEVEL_KEYS = {
    "nebula": "Nebula checkpointing has been removed. A leftover 'nebula' block would be ignored and "
              "checkpoints would silently fall back to local torch.save.",
    "compression_training": "The DeepSpeed compression library has been removed. A leftover "
                            "'compression_training' block would be ignored and the model would train unquantized.",
    "amp": "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' "
           "instead.",
    "quantize_training": "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed.",
    "sparse_gradients": "Sparse compression of dense torch.nn.Embedding gradients has been removed. A leftover "
                        "'sparse_gradients' flag would be ignored and those gradients would be reduced dense.",
    "eigenvalue": "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed; the standalone 'eigenvalue' "
                  "configuration block is no longer supported.",
    "sparse_attention": "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' configuration block "
                        "is no longer supported.",
    "elasticity": "Elastic training has been removed; the 'elasticity' configuration block is no longer "
                  "supported. Set train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps "
                  "directly.",
    "graph_harvesting": "Graph harvesting has been removed; the 'graph_harvesting' configuration option is no "
                        "longer supported.",
    "curriculum_learning": "Legacy top-level 'curriculum_learning' has been removed. Use "
                           "'data_efficiency.data_sampling.curriculum_learning' instead.",
    "progressive_layer_drop": "Progressive Layer Dropping has been removed; the 'progressive_layer_drop' "
                              "configuration block is no longer supported.",
}
REMOVED_ZERO_KEYS = {
    "mics_shard_size": "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_shard_size' is no longer "
                       "supported.",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding has been removed; "
                                       "'zero_optimization.mics_hierarchical_params_gather' is no longer supported.",
    "zeropp_loco_param": "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' is no longer "
                         "supported. Remove this key to use standard ZeRO++ quantized gradients without LoCo error "
                         "feedback.",
}


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
    """none / cpu / nvme.
    zerojax: **acted on**: cpu → parameters in `pinned_host` memory, streamed per layer; nvme → ConfigError (not
      supported yet)"""
    nvme_path: str | None = _f(None, "str", optional=True)
    """NVMe swap directory.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    buffer_count: int = _f(5, "int", ge=0)
    """NVMe swap buffers.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    buffer_size: int = _f(100_000_000, "int", ge=0)
    """NVMe swap buffer size.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    max_in_cpu: int = _f(1_000_000_000, "int", ge=0)
    """Parameter elements kept in CPU memory with NVMe.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    pin_memory: bool = _f(True, "bool")
    """Use page-locked host memory (DeepSpeed's default true since 0.19.5, PR #8207).
    zerojax: **accepted, no effect**: host offload always uses `pinned_host` memory"""


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    device: str = _f("none", "str", choices=_DEVICES, lower=True)
    """none / cpu / nvme.
    zerojax: **acted on**: cpu → fp32 master + moments in `pinned_host` memory; nvme → ConfigError (not
      supported yet)"""
    nvme_path: str | None = _f(None, "str", optional=True)
    """NVMe swap directory.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    buffer_count: int = _f(4, "int", ge=0)
    """NVMe swap buffers.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    pin_memory: bool = _f(True, "bool")
    """Use page-locked host memory (DeepSpeed's default true since 0.19.5, PR #8207).
    zerojax: **accepted, no effect**: host offload always uses `pinned_host` memory"""
    pipeline_read: bool = _f(False, "bool")
    """Overlap NVMe reads with the optimizer step.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    pipeline_write: bool = _f(False, "bool")
    """Overlap NVMe writes with the optimizer step.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    fast_init: bool = _f(False, "bool")
    """Fast optimizer init with NVMe.
    zerojax: **accepted, no effect**: NVMe not supported yet"""
    ratio: float = _f(1.0, "float", ge=0.0, le=1.0)
    """Fraction of optimizer state offloaded (< 1 only at stage 3).
    zerojax: **acted on**: the first ceil(ratio × pieces) pieces of the optimizer state (embeddings, then layer
      groups) live in host memory, the rest on the device; `zerojax estimate` / the memory guard offer ratio 0.5
      at stage 3 as a plan between no and full offload"""
    super_offload: bool = _f(False, "bool")
    """Superchip (Grace-Hopper) CPU offload path.
    zerojax: **accepted, no effect**: —"""
    convert_grad_on_cpu: bool = _f(True, "bool")
    """Convert gradients to fp32 on the CPU.
    zerojax: **accepted, no effect**: XLA places the conversion"""
    cpuadam_cores_perc: float = _f(0.8, "float", ge=0.0, le=1.0)
    """Share of CPU cores for CPU Adam.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _f(0, "int", ge=0, le=3)
    """0 off, 1 optimizer states, 2 + gradients, 3 + parameters partitioned.
    zerojax: **acted on**: choice of `PartitionSpec`s over the `data` mesh axis (partition.py)"""
    contiguous_gradients: bool = _f(True, "bool")
    """Copy gradients into a contiguous buffer.
    zerojax: **accepted, no effect**: XLA plans buffers itself"""
    reduce_scatter: bool = _f(True, "bool")
    """Use reduce-scatter rather than all-reduce for gradients.
    zerojax: **accepted, no effect**: XLA emits reduce-scatter whenever gradients are sharded (stage ≥ 2)"""
    reduce_bucket_size: int = _f(500_000_000, "int", ge=0)
    """Elements reduced per bucket (default 5e8).
    zerojax: **XLA**: `--xla_gpu_all_reduce_combine_threshold_bytes` and
      `--xla_gpu_reduce_scatter_combine_threshold_bytes` (× bytes per element) via `xla_flags_for`"""
    use_multi_rank_bucket_allreduce: bool = _f(True, "bool")
    """Merge reduce buckets of several ranks into one all-reduce.
    zerojax: **accepted, no effect**: XLA combines collectives (see the thresholds above)"""
    allgather_partitions: bool = _f(True, "bool")
    """All-gather vs broadcasts for updated parameters.
    zerojax: **accepted, no effect**: XLA emits all-gather"""
    allgather_bucket_size: int = _f(500_000_000, "int", ge=0)
    """Elements all-gathered per bucket, stages 1-2 (default 5e8).
    zerojax: **XLA**: `--xla_gpu_all_gather_combine_threshold_bytes` via `xla_flags_for` (stages 1-2)"""
    # DeepSpeed's default is None, resolved to (stage == 3); stored resolved.
    overlap_comm: bool | None = _f(None, "bool", optional=True)
    """Overlap gradient reduction with backward (default: true only at stage 3).
    zerojax: **XLA**: `--xla_gpu_enable_latency_hiding_scheduler=true` via `xla_flags_for` when true (already
      XLA's default on GPU)"""
    load_from_fp32_weights: bool = _f(True, "bool")
    """Restore fp32 master weights from the checkpoint's fp32 copy.
    zerojax: **accepted, no effect**: zerojax checkpoints always hold the fp32 master weights, so restores are
      always from fp32"""
    elastic_checkpoint: bool = _f(False, "bool")
    """Legacy elastic ZeRO checkpoints.
    zerojax: **accepted, no effect**: orbax checkpoints restore to any sharding"""
    offload_param: OffloadParamConfig = _f(kind="section", factory=OffloadParamConfig, cls=OffloadParamConfig)
    """Section: parameter offload (stage 3 only; warns below).
    zerojax: **acted on**: see its keys"""
    offload_optimizer: OffloadOptimizerConfig = _f(kind="section", factory=OffloadOptimizerConfig,
                                                   cls=OffloadOptimizerConfig)
    """Section: optimizer-state offload (stages 1-3).
    zerojax: **acted on**: see its keys"""
    zenflow: Mapping | None = _f(None, "mapping", optional=True)
    """ZenFlow asynchronous offload settings.
    zerojax: **accepted, no effect**: kept as a mapping"""
    sub_group_size: int = _f(1_000_000_000, "int", ge=0)
    """Tile size for the offloaded optimizer step (default 1e9).
    zerojax: **accepted, no effect**: XLA schedules the update"""
    stage3_prefetch_bucket_size: int = _f(50_000_000, "int", ge=0)
    """Elements prefetched ahead of use at stage 3 (default 5e7; alias `prefetch_bucket_size`).
    zerojax: **XLA**: `--xla_gpu_all_gather_combine_threshold_bytes` via `xla_flags_for` at stage 3"""
    stage3_param_persistence_threshold: int = _f(100_000, "int", ge=0)
    """Parameters smaller than this stay unpartitioned (default 1e5; alias `param_persistence_threshold`).
    zerojax: **acted on**: leaves with fewer elements stay replicated at stage 3 (partition.py)"""
    stage3_model_persistence_threshold: int = _f(9223372036854775807, "int", ge=0)  # sys.maxsize
    """Cap on total unpartitioned elements (alias `model_persistence_threshold`).
    zerojax: **accepted, no effect**: —"""
    stage3_max_live_parameters: int = _f(1_000_000_000, "int", ge=0)
    """Gathered parameters kept live (default 1e9; alias `max_live_parameters`).
    zerojax: **accepted, no effect**: XLA frees gathered layers inside the layer scan"""
    stage3_max_reuse_distance: int = _f(1_000_000_000, "int", ge=0)
    """Keep a gathered parameter if reused soon (default 1e9; alias `max_reuse_distance`).
    zerojax: **accepted, no effect**: XLA decides rematerialisation"""
    stage3_gather_16bit_weights_on_model_save: bool = _f(False, "bool")
    """Gather full 16-bit weights when saving (aliases `gather_16bit_weights_on_model_save`, deprecated
    `stage3_gather_fp16_weights_on_model_save`).
    zerojax: **acted on**: checkpoint export writes gathered 16-bit weights"""
    stage3_module_granularity_threshold: int = _f(0, "int")
    """Fetch fine-grained modules as a unit.
    zerojax: **accepted, no effect**: —"""
    stage3_use_all_reduce_for_fetch_params: bool = _f(False, "bool")
    """Fetch parameters with all-reduce.
    zerojax: **accepted, no effect**: XLA emits all-gather"""
    stage3_allgather_sequential: bool = _f(False, "bool")
    """Gather parameters one at a time, unbucketed.
    zerojax: **accepted, no effect**: —"""
    stage3_partition_stream_chunk_size: int = _f(0, "int", ge=0)
    """Stream huge parameters through chunks during zero.Init.
    zerojax: **accepted, no effect**: parameters are created already sharded (`jax.jit(init,
      out_shardings=...)`)"""
    ignore_unused_parameters: bool = _f(True, "bool")
    """Tolerate parameters without gradients (stage 2).
    zerojax: **accepted, no effect**: unused parameters get zero gradients in JAX"""
    legacy_stage1: bool = _f(False, "bool")
    """Old stage-1 implementation.
    zerojax: **accepted, no effect**: —"""
    round_robin_gradients: bool = _f(False, "bool")
    """Round-robin gradient copies to CPU (stages 1-2 offload).
    zerojax: **accepted, no effect**: —"""
    zero_hpz_partition_size: int = _f(1, "int", ge=0)
    """ZeRO++ hierarchical secondary partition size.
    zerojax: **accepted, no effect**: —"""
    zero_quantized_weights: bool = _f(False, "bool")
    """ZeRO++ int8-quantised weight all-gather.
    zerojax: **accepted, no effect**: would change numerics; not implemented"""
    zero_quantized_nontrainable_weights: bool = _f(False, "bool")
    """Store frozen weights quantised.
    zerojax: **accepted, no effect**: —"""
    zero_quantized_gradients: bool = _f(False, "bool")
    """ZeRO++ quantised gradient reduce.
    zerojax: **accepted, no effect**: would change numerics; not implemented"""
    memory_efficient_linear: bool = _f(True, "bool")
    """Stage-3 linear that frees inputs early.
    zerojax: **accepted, no effect**: XLA plans activation memory"""
    pipeline_loading_checkpoint: bool = _f(False, "bool")
    """Load checkpoints in pipeline mode (stage 3).
    zerojax: **accepted, no effect**: —"""
    override_module_apply: bool = _f(True, "bool")
    """Patch nn.Module.apply for stage 3.
    zerojax: **accepted, no effect**: PyTorch-specific"""
    log_trace_cache_warnings: bool = _f(False, "bool")
    """Log stage-3 trace-cache invalidations.
    zerojax: **accepted, no effect**: PyTorch-specific"""
    enable_sanity_checks: bool = _f(False, "bool")
    """Internal stage-3 checks.
    zerojax: **accepted, no effect**: —"""
    save_muon_momentum_buffer_in_memory: bool = _f(False, "bool")
    """Keep Muon momentum off NVMe.
    zerojax: **accepted, no effect**: Muon not supported"""
    leaf_module: Mapping = _f(kind="mapping", factory=lambda: _freeze(_LEAF_MODULE_DEFAULT))
    """Modules treated as ZeRO-3 leaves (`classes`, `names`, `name_suffixes`).
    DeepSpeed default: the Mixtral, Qwen2-MoE and Qwen3-MoE sparse MoE block classes
    zerojax: **accepted, no effect**: kept as a mapping"""


# DeepSpeedZeroLeafModuleConfig's defaults (runtime/zero/leaf_module_config.py).
_LEAF_MODULE_DEFAULT = {
    "classes": ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
    "names": [], "name_suffixes": []}

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
    """Train in fp16 with fp32 master weights. "auto" → `fill["fp16.enabled"]`, else false.
    zerojax: **acted on**: compute dtype fp16 + loss scaling (precision.py)"""
    auto_cast: bool = _f(False, "bool")
    """Cast module inputs to fp16.
    zerojax: **accepted, no effect**: the compute dtype is set on the model (`precision.compute_dtype`), not by
      casting inputs"""
    loss_scale: float = _f(0.0, "float", ge=0.0)
    """Static loss scale; 0 = dynamic.
    zerojax: **acted on**: `static_loss_scale` when > 0, else `dynamic_loss_scale`"""
    initial_scale_power: int = _f(16, "int", ge=0)
    """Dynamic scale starts at 2**power.
    zerojax: **acted on**: `dynamic_loss_scale(initial_scale_power=...)`"""
    loss_scale_window: int = _f(1000, "int", ge=1)
    """Steps without overflow before the scale doubles.
    zerojax: **acted on**: `dynamic_loss_scale(loss_scale_window=...)`"""
    hysteresis: int = _f(2, "int", ge=1)
    """Overflows tolerated before the scale is lowered.
    zerojax: **acted on**: `dynamic_loss_scale(hysteresis=...)`"""
    consecutive_hysteresis: bool = _f(False, "bool")
    """Refill hysteresis after a step without overflow.
    zerojax: **acted on**: `dynamic_loss_scale(consecutive_hysteresis=...)`"""
    min_loss_scale: float = _f(1.0, "float", gt=0.0)
    """Lower bound of the dynamic scale.
    zerojax: **acted on**: `dynamic_loss_scale(min_loss_scale=...)`"""
    fp16_master_weights_and_grads: bool = _f(False, "bool")
    """Keep master weights in fp16 (CPU Adam only; ZeRO 1-3).
    zerojax: **accepted, no effect**: master weights stay fp32; validated as DeepSpeed does"""


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = _f(False, "bool")
    """Train in bf16 with fp32 master weights.
    zerojax: **acted on**: compute dtype bf16, no loss scaling"""
    immediate_grad_update: bool = _f(False, "bool")
    """BF16 optimizer: apply gradients to fp32 accumulators immediately.
    zerojax: **accepted, no effect**: gradients accumulate in the scan accumulator
      (`data_types.grad_accum_dtype`)"""
    check_grad_overflow: bool = _f(True, "bool")
    """Check bf16 gradients for inf/nan and skip the step when found (default true since DeepSpeed 0.19.5, PR
    #8035).
    zerojax: **differs from DeepSpeed**: accepted, no effect; a bf16 step is never skipped (fp16 steps are, by
      the loss scaler)"""
    bf16_master_weights_and_grads: bool = _f(False, "bool")
    """Keep master weights in bf16 (ZeRO 1-3).
    zerojax: **accepted, no effect**: master weights stay fp32; validated as DeepSpeed does"""
    bf16_optimizer_states: bool = _f(False, "bool")
    """Keep optimizer states in bf16 (needs bf16 master weights).
    zerojax: **accepted, no effect**: validated as DeepSpeed does"""


@dataclass(frozen=True)
class DataTypesConfig:
    grad_accum_dtype: str | None = _f(None, "dtype", optional=True)
    """Dtype of the gradient accumulator (fp32 / bf16 / fp16).
    zerojax: **acted on**: dtype of the scan accumulator (default: fp32)"""
    param_dtype: str | None = _f(None, "dtype", optional=True)
    """Dtype to load parameters in.
    zerojax: **accepted, no effect**: dtype comes from `precision.compute_dtype(cfg)`"""
    buffer_dtype: str | None = _f(None, "dtype", optional=True)
    """Dtype of module buffers.
    zerojax: **accepted, no effect**: Flax models have no buffers"""


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = _f(None, "str")
    """Optimizer name. OneBitAdam/ZeroOneAdam/OneBitLamb/MuAdam/MuAdamW/MuSGD/Muon are refused with the closest
    supported choice.
    zerojax: **acted on**: selects the optax optimizer"""
    params: Mapping = _f(kind="mapping", factory=_empty)
    """Constructor arguments (lr, betas, eps, weight_decay, ...; checked per type). `max_grad_norm` is refused
    with DeepSpeed's message.
    zerojax: **acted on**: optimizer hyper-parameters; "auto" needs `fill`"""
    legacy_fusion: bool = _f(False, "bool")
    """Legacy fused-Adam code path.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = _f(None, "str")
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest.
    zerojax: **acted on**: selects the schedule"""
    params: Mapping = _f(kind="mapping", factory=_empty)
    """Schedule arguments (lr_schedules.py names; required ones checked).
    zerojax: **acted on**: schedule parameters; "auto" needs `fill`"""


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = _f(False, "bool")
    """Shard checkpointed activations over model-parallel ranks.
    zerojax: **accepted, no effect**: —"""
    contiguous_memory_optimization: bool = _f(False, "bool")
    """Copy checkpoints into one buffer.
    zerojax: **accepted, no effect**: XLA plans buffers itself"""
    cpu_checkpointing: bool = _f(False, "bool")
    """Keep checkpointed activations in CPU memory.
    zerojax: **acted on**: remat policy that offloads saved activations to host (offload.py)"""
    # DeepSpeed reads it with get_scalar_param (any value); configs in the wild write false for "unset".
    number_checkpoints: int | None = _f(None, "int", optional=True, ge=0, false_is_none=True)
    """Number of checkpoints (`false` reads as unset).
    zerojax: **accepted, no effect**: every layer of the scanned stack is a checkpoint"""
    synchronize_checkpoint_boundary: bool = _f(False, "bool")
    """cuda.synchronize at checkpoint boundaries.
    zerojax: **accepted, no effect**: —"""
    profile: bool = _f(False, "bool")
    """Time checkpointed forwards.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = _f(False, "bool")
    """Turn this monitor on.
    zerojax: **acted on**: metrics writer on"""
    output_path: str = _f("", "str")
    """Directory for the logs.
    zerojax: **acted on**: writer output directory"""
    job_name: str = _f("DeepSpeedJobName", "str")
    """Sub-directory / run name.
    zerojax: **acted on**: writer run name"""


@dataclass(frozen=True)
class CSVConfig:
    enabled: bool = _f(False, "bool")
    """Turn this monitor on.
    zerojax: **acted on**: metrics writer on"""
    output_path: str = _f("", "str")
    """Directory for the logs.
    zerojax: **acted on**: writer output directory"""
    job_name: str = _f("DeepSpeedJobName", "str")
    """Sub-directory / run name.
    zerojax: **acted on**: writer run name"""


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = _f(False, "bool")
    """Turn wandb on.
    zerojax: **acted on**: metrics writer on"""
    group: str | None = _f(None, "str", optional=True)
    """wandb group.
    zerojax: **acted on**: passed to wandb.init"""
    team: str | None = _f(None, "str", optional=True)
    """wandb team (entity).
    zerojax: **acted on**: passed to wandb.init"""
    project: str = _f("deepspeed", "str")
    """wandb project.
    zerojax: **acted on**: passed to wandb.init"""


@dataclass(frozen=True)
class CometConfig:
    enabled: bool = _f(False, "bool")
    """Turn Comet on.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    samples_log_interval: int = _f(100, "int", ge=1)
    """Log every N samples.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    project: str | None = _f(None, "str", optional=True)
    """Comet project.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    workspace: str | None = _f(None, "str", optional=True)
    """Comet workspace.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    api_key: str | None = _f(None, "str", optional=True)
    """Comet API key.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    experiment_name: str | None = _f(None, "str", optional=True)
    """Experiment name.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    experiment_key: str | None = _f(None, "str", optional=True)
    """Experiment key.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    online: bool | None = _f(None, "bool", optional=True)
    """Log online vs offline.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    mode: str | None = _f(None, "str", optional=True, choices=("get", "create", "get_or_create"))
    """get / create / get_or_create.
    zerojax: **accepted, no effect**: no Comet writer yet"""


@dataclass(frozen=True)
class TrackioConfig:
    enabled: bool = _f(False, "bool")
    """Turn Trackio on.
    zerojax: **accepted, no effect**: no Trackio writer yet"""
    project: str = _f("deepspeed", "str")
    """Trackio project.
    zerojax: **accepted, no effect**: no Trackio writer yet"""


@dataclass(frozen=True)
class FlopsProfilerConfig:
    enabled: bool = _f(False, "bool")
    """Profile one step.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    recompute_fwd_factor: float = _f(0.0, "float", ge=0.0)
    """Extra forward FLOPs from recomputation.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    profile_step: int = _f(1, "int", ge=1)
    """Step to profile.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    module_depth: int = _f(-1, "int")
    """Depth of the module table.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    top_modules: int = _f(1, "int", ge=1)
    """Modules listed.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    detailed: bool = _f(True, "bool")
    """Per-module detail.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    output_file: str | None = _f(None, "str", optional=True)
    """Where to write the profile.
    zerojax: **accepted, no effect**: no FLOPs profiler"""


@dataclass(frozen=True)
class CheckpointConfig:
    tag_validation: str = _f("WARN", "str", upper=True, choices=("WARN", "IGNORE", "FAIL"))
    """Check that all ranks save the same tag (Warn / Ignore / Fail).
    zerojax: **accepted, no effect**: one process writes the tag through orbax"""
    load_universal: bool = _f(False, "bool")
    """Load a universal (reshardable) checkpoint.
    zerojax: **accepted, no effect**: orbax checkpoints always reshard on load"""
    use_node_local_storage: bool = _f(False, "bool")
    """Each node writes to local storage.
    zerojax: **accepted, no effect**: —"""
    parallel_write: Mapping = _f(kind="mapping", factory=_empty)
    """Parallel write options (`pipeline_stage`).
    zerojax: **accepted, no effect**: orbax writes shards in parallel"""
    serialization: bool = _f(True, "bool")
    """Use torch serialization.
    zerojax: **accepted, no effect**: PyTorch-specific"""
    writer: Mapping | None = _f(None, "mapping", optional=True)
    """Fast/decoupled checkpoint writer options.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class PipelineConfig:
    stages: Any = _f("auto", "int_or_auto")
    """Number of pipeline stages ("auto" is DeepSpeed's default and is kept).
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""
    partition: str = _f("best", "str")
    """Layer partition method.
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""
    seed_layers: bool = _f(False, "bool")
    """Seed each layer differently.
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""
    activation_checkpoint_interval: int = _f(0, "int", ge=0)
    """Checkpoint every N layers in the pipeline.
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""
    pipe_partitioned: bool = _f(True, "bool")
    """Partition activations between stages.
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""
    grad_partitioned: bool = _f(True, "bool")
    """Partition gradients between stages.
    zerojax: **accepted, no effect**: pipeline parallelism comes later"""


@dataclass(frozen=True)
class TensorParallelConfig:
    # DeepSpeed's default is 0 ("disabled"); zerojax reads 0 as 1 (no tensor axis).
    autotp_size: int = _f(1, "int", ge=0)
    """Tensor-parallel degree (0 = off).
    DeepSpeed default: 0
    zerojax: **acted on**, stored as 1 for 0 (no tensor axis): size of the mesh's `tensor` axis (data-parallel
      size = devices / autotp_size); the batch rule's world size counts tensor ranks, as DeepSpeed's does"""
    tp_overlap_comm: bool = _f(False, "bool")
    """Overlap TP all-reduce with compute.
    zerojax: **accepted, no effect**: XLA's latency-hiding scheduler"""
    tp: Mapping = _f(kind="mapping", factory=_empty)
    """TP group settings (alias `tensor_parallel`).
    zerojax: **accepted, no effect**: kept as a mapping"""
    dtype: str | None = _f(None, "dtype", optional=True)
    """Model dtype for AutoTP.
    zerojax: **accepted, no effect**: dtype comes from fp16 / bf16"""
    partition_config: Mapping | None = _f(None, "mapping", optional=True)
    """Custom layer partition rules: `layer_specs` [{patterns, partition_type: row | column | skip,
    partition_dim, model_types}], `use_default_specs`.
    zerojax: **acted on**: patterns match dotted parameter paths (`h.mlp.c_fc.kernel`) before the
      logical-axis rules (heads / mlp over "tensor"); use_default_specs false keeps only the patterns"""
    preset_model: str | None = _f(None, "str", optional=True)
    """Built-in AutoTP preset.
    zerojax: **accepted, no effect**: —"""
    keep_module_on_host: bool = _f(False, "bool")
    """Keep checkpoint weights on host while loading.
    zerojax: **accepted, no effect**: —"""
    replace_with_kernel_inject: bool = _f(False, "bool")
    """Inject inference kernels (alias `kernel_inject`).
    zerojax: **accepted, no effect**: PyTorch-specific"""


_TP_ALIASES = {"tensor_parallel": "tp", "kernel_inject": "replace_with_kernel_inject"}
# tensor_parallel.partition_config, as DeepSpeed's AutoTPConfig.from_dict reads it
# (deepspeed/module_inject/autotp_config.py): its keys, and each layer_specs entry's.
_AUTOTP_KEYS = ("layer_specs", "use_default_specs", "tp_size", "embedding_partition_dim", "lm_head_patterns",
                "strict_mode")
_LAYER_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output")


def _check_partition_config(pc, problems):
    """DeepSpeed's AutoTP `partition_config`: layer_specs [{patterns: [regex], partition_type:
    row | column | skip, ...}], use_default_specs (default true). zerojax matches the patterns
    against dotted parameter paths (`h.attn.c_attn.kernel`); `shape` (a sub-parameter view) is
    refused rather than ignored."""
    if pc is None:
        return
    where = "tensor_parallel.partition_config"
    for key in pc:
        if key not in _AUTOTP_KEYS:
            problems.append(f"{where}.{key}: not a partition_config key; known: {', '.join(_AUTOTP_KEYS)}")
    if not isinstance(pc.get("use_default_specs", True), bool):
        problems.append(f"{where}.use_default_specs = {pc['use_default_specs']!r}: expected true or false")
    specs = pc.get("layer_specs", [])
    if not isinstance(specs, (list, tuple)):
        problems.append(f"{where}.layer_specs: expected a list of {{patterns, partition_type}} entries")
        return
    for i, spec in enumerate(specs):
        at = f"{where}.layer_specs[{i}]"
        if not isinstance(spec, Mapping):
            problems.append(f"{at}: expected an object with patterns and partition_type")
            continue
        for key in spec:
            if key not in _LAYER_SPEC_KEYS:
                problems.append(f"{at}.{key}: not a layer_specs key; known: {', '.join(_LAYER_SPEC_KEYS)}")
        patterns = spec.get("patterns")
        if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
            problems.append(f"{at}.patterns: expected a non-empty list of regular expressions (strings)")
        else:
            for p in patterns:
                try:
                    re.compile(p)
                except re.error as e:
                    problems.append(f"{at}.patterns: {p!r} is not a regular expression ({e})")
        kind = spec.get("partition_type", "column")
        if not isinstance(kind, str) or kind.lower() not in ("row", "column", "skip"):
            problems.append(f"{at}.partition_type = {kind!r}: choose row, column or skip")
        dim = spec.get("partition_dim")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            problems.append(f"{at}.partition_dim = {dim!r}: expected an integer axis of the parameter")
        if spec.get("shape") is not None:
            problems.append(f"{at}.shape: sub-parameter views are not supported; zerojax splits a parameter's "
                            "own axes, so give a fused axis (e.g. q/k/v) its own dimension in the model and "
                            "name it with partition_dim")


# Sections DeepSpeed validates with pydantic models (DeepSpeedConfigModel: extra="forbid"), so a
# misspelt key is an error there too. Transcribed from DeepSpeed 0.19.x `compile/config.py`,
# `runtime/config.py` (HybridEngineConfig), `comm/config.py`, `utils/config.py`.

@dataclass(frozen=True)
class CompileConfig:
    deepcompile: bool = _f(False, "bool")
    """DeepCompile: compiler passes for ZeRO (gather / release / offload scheduling).
    zerojax: **accepted, no effect**: the whole step is one XLA program already"""
    free_activation: bool = _f(False, "bool")
    """DeepCompile: free activations eagerly.
    zerojax: **accepted, no effect**: XLA plans activation lifetimes"""
    free_activation_threshold: int = _f(10 * 1024 * 1024, "int", ge=0)
    """DeepCompile: activations at least this many bytes are freed eagerly.
    zerojax: **accepted, no effect**: —"""
    offload_activation: bool = _f(False, "bool")
    """DeepCompile: move saved activations to pinned host memory.
    zerojax: **accepted, no effect**: use `activation_checkpointing.cpu_checkpointing`"""
    offload_activation_pin_memory: bool = _f(True, "bool")
    """DeepCompile: pin the host buffers of activation offload.
    zerojax: **accepted, no effect**: —"""
    offload_opt_states: bool = _f(False, "bool")
    """DeepCompile: offload optimizer states between steps.
    zerojax: **accepted, no effect**: use `zero_optimization.offload_optimizer`"""
    double_buffer: bool = _f(True, "bool")
    """DeepCompile: double buffering.
    zerojax: **accepted, no effect**: —"""
    symmetric_memory: bool = _f(False, "bool")
    """DeepCompile: symmetric memory.
    zerojax: **accepted, no effect**: —"""
    debug_log: bool = _f(False, "bool")
    """DeepCompile: dump graphs.
    zerojax: **accepted, no effect**: use `XLA_FLAGS=--xla_dump_to=...`"""
    offload_parameters: bool = _f(False, "bool")
    """DeepCompile: offload parameters.
    zerojax: **accepted, no effect**: use `zero_optimization.offload_param`"""
    sync_before_reduce: bool = _f(False, "bool")
    """DeepCompile: synchronise before reduce.
    zerojax: **accepted, no effect**: —"""
    sync_after_reduce: bool = _f(False, "bool")
    """DeepCompile: synchronise after reduce.
    zerojax: **accepted, no effect**: —"""
    sync_before_allgather: bool = _f(False, "bool")
    """DeepCompile: synchronise before all-gather.
    zerojax: **accepted, no effect**: —"""
    sync_after_allgather: bool = _f(False, "bool")
    """DeepCompile: synchronise after all-gather.
    zerojax: **accepted, no effect**: —"""
    keep_int_input_tensors: bool = _f(True, "bool")
    """DeepCompile: keep real values of int inputs while profiling.
    zerojax: **accepted, no effect**: —"""
    keep_all_input_tensors: bool = _f(False, "bool")
    """DeepCompile: keep real values of all inputs while profiling.
    zerojax: **accepted, no effect**: —"""
    passes: Any = _f(None, "any", optional=True)
    """DeepCompile: list of passes ("z1", "z3", "autosp", "autotp").
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class HybridEngineConfig:
    enabled: bool = _f(False, "bool")
    """Turn the RLHF hybrid train / inference engine on.
    zerojax: **accepted, no effect**: no hybrid engine"""
    max_out_tokens: int = _f(512, "int", gt=0)
    """Longest generation.
    zerojax: **accepted, no effect**: no hybrid engine"""
    inference_tp_size: int = _f(1, "int")
    """Tensor-parallel size for generation.
    zerojax: **accepted, no effect**: no hybrid engine"""
    release_inference_cache: bool = _f(False, "bool")
    """Free the KV cache after generation.
    zerojax: **accepted, no effect**: no hybrid engine"""
    pin_parameters: bool = _f(True, "bool")
    """Pin parameters for generation.
    zerojax: **accepted, no effect**: no hybrid engine"""
    tp_gather_partition_size: int = _f(8, "int")
    """Gather partition size for generation.
    zerojax: **accepted, no effect**: no hybrid engine"""
    enable_cuda_graph: bool = _f(False, "bool")
    """CUDA graphs for generation.
    zerojax: **accepted, no effect**: no hybrid engine"""


@dataclass(frozen=True)
class CommsLoggerConfig:
    enabled: bool = _f(False, "bool")
    """Log collective calls.
    zerojax: **accepted, no effect**: read the collectives in the compiled HLO or the JAX profiler"""
    prof_all: bool = _f(True, "bool")
    """Profile every collective.
    zerojax: **accepted, no effect**: —"""
    prof_ops: Any = _f(kind="any", factory=tuple)
    """Collectives to profile when prof_all is false.
    zerojax: **accepted, no effect**: —"""
    verbose: bool = _f(False, "bool")
    """Print every logged call.
    zerojax: **accepted, no effect**: —"""
    debug: bool = _f(False, "bool")
    """Add the caller to each log line.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class ThroughputTimerConfig:
    enabled: bool = _f(True, "bool")
    """Throughput timer on.
    zerojax: **accepted, no effect**: the engine reports its own step times"""
    synchronized: bool = _f(True, "bool")
    """Synchronise the device when timing.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class TimersConfig:
    throughput: ThroughputTimerConfig = _f(kind="section", factory=ThroughputTimerConfig, cls=ThroughputTimerConfig)
    """Section: the throughput timer.
    zerojax: **accepted, no effect**: see its keys"""


@dataclass(frozen=True)
class Config:
    """A resolved DeepSpeed config. Field names are DeepSpeed's keys."""

    train_batch_size: int = _f(None, "int", optional=True)
    """Global batch per optimizer step (micro × accumulation × data-parallel size).
    zerojax: **acted on**: resolved by DeepSpeed's batch rule; the engine's step consumes this many rows"""
    train_micro_batch_size_per_gpu: int = _f(None, "int", optional=True)
    """Batch per device per forward/backward.
    zerojax: **acted on**: size of each micro-batch in the accumulation scan"""
    gradient_accumulation_steps: int = _f(None, "int", optional=True)
    """Micro-batches accumulated before one optimizer step.
    zerojax: **acted on**: length of the `lax.scan` over micro-batches inside one jitted step"""
    world_size: int = 1  # not a DeepSpeed key: the data-parallel size the trio was resolved with
    managed_gradient_accumulation: bool = _f(True, "bool")
    """True: DeepSpeed counts micro-steps and steps the optimizer on the boundary; false: every `step()` applies an
    update and the client owns the boundary.
    zerojax: **accepted, no effect**: one engine step always runs the whole accumulation and one update"""
    steps_per_print: int | None = _f(None, "int", optional=True, ge=1)
    """Print progress every N steps (DeepSpeed default: none).
    zerojax: **acted on**: engine logging interval"""
    wall_clock_breakdown: bool = _f(False, "bool")
    """Time forward/backward/step separately.
    zerojax: **accepted, no effect**: one jitted step has no host-visible phases; use the JAX profiler"""
    memory_breakdown: bool = _f(False, "bool")
    """Print memory usage at stages of the step.
    zerojax: **accepted, no effect**: use `engine.memory_report()` (XLA memory analysis)"""
    dump_state: bool = _f(False, "bool")
    """Print DeepSpeed state after initialisation.
    zerojax: **accepted, no effect**: `print(cfg)` shows the resolved config"""
    gradient_clipping: float = _f(1.0, "float", ge=0.0)
    """Clip gradients by global norm (0 = off). DeepSpeed's GRADIENT_CLIPPING_DEFAULT is 1.0: a config without
    the key clips at 1.0.
    zerojax: **acted on**: optax global-norm clipping before the optimizer (optim.py)"""
    prescale_gradients: bool = _f(False, "bool")
    """Divide gradients by world size before the all-reduce instead of after.
    zerojax: **accepted, no effect**: XLA reduces in one collective; the mean is computed identically either way"""
    gradient_predivide_factor: float = _f(1.0, "float", gt=0.0)
    """Divide gradients by this before the all-reduce and by world/this after.
    zerojax: **accepted, no effect**: numerics guard for fp16 all-reduce in PyTorch; XLA's reduce keeps the
      compute dtype"""
    gradient_allreduce_op: str = _f("mean", "str", lower=True, choices=("mean", "sum"))
    """How data-parallel gradients are combined: "mean" or "sum" ("sum" refused at ZeRO stage 3).
    zerojax: **acted on**: "mean" is what zerojax does; "sum" is a ConfigError (not supported yet)"""
    communication_data_type: str | None = _f(None, "str", optional=True, lower=True,
                                             choices=("fp16", "bf16", "fp32"))
    """Dtype of gradient collectives (fp16 / bf16 / fp32).
    zerojax: **acted on**: picks the element width used by `xla_flags_for` and the gradient dtype for the reduce"""
    seq_parallel_comm_data_type: str = _f("fp32", "str", lower=True, choices=("fp16", "bf16", "fp32"))
    """Dtype of sequence-parallel gradient collectives.
    zerojax: **accepted, no effect**: no sequence parallelism yet"""
    sequence_parallel_size: int = _f(1, "int", ge=1)
    """Ulysses sequence-parallel group size; DeepSpeed divides the world size by it.
    zerojax: **acted on**: divides the default batch world size (`jax.device_count() // sequence_parallel_size`)"""
    disable_allgather: bool = _f(False, "bool")
    """Legacy: skip the parameter all-gather.
    zerojax: **accepted, no effect**: XLA inserts the collectives the shardings need"""
    log_level: str | None = _f(None, "str", optional=True)
    """DeepSpeed's logger level.
    zerojax: **accepted, no effect**: zerojax logs through Python's `logging` (configure the "zerojax" logger)"""
    dataloader_drop_last: bool = _f(False, "bool")
    """Drop the last incomplete batch in DeepSpeed's data loader.
    zerojax: **accepted, no effect**: zerojax has no data loader; you pass batches"""
    use_data_before_expert_parallelism: bool = _f(False, "bool")
    """Rank ordering for expert + data parallelism.
    zerojax: **accepted, no effect**: no expert parallelism"""
    vocabulary_size: int | None = _f(None, "int", optional=True, ge=1)
    """Only used for a tensor-core alignment warning.
    zerojax: **accepted, no effect**: —"""
    zero_allow_untested_optimizer: bool = _f(False, "bool")
    """Allow ZeRO with an optimizer DeepSpeed has not tested.
    zerojax: **accepted, no effect**: every supported optimizer runs under every stage"""
    zero_force_ds_cpu_optimizer: bool = _f(True, "bool")
    """Require DeepSpeed's CPU optimizer when offloading.
    zerojax: **accepted, no effect**: offloaded optimizer state is updated by the same optax code"""
    data_types: DataTypesConfig = _f(kind="section", factory=DataTypesConfig, cls=DataTypesConfig)
    """Section: dtypes for accumulation / params / buffers.
    zerojax: **acted on**: see its keys"""
    fp16: FP16Config = _f(kind="section", factory=FP16Config, cls=FP16Config)
    """Section: fp16 mixed precision with loss scaling.
    zerojax: **acted on**: see its keys"""
    bf16: BF16Config = _f(kind="section", factory=BF16Config, cls=BF16Config)
    """Section: bf16 mixed precision (old name `bfloat16` loads too).
    zerojax: **acted on**: see its keys"""
    optimizer: OptimizerConfig | None = _f(None, "special", cls=OptimizerConfig)
    """Section: optimizer `type` and `params`.
    zerojax: **acted on**: optax optimizer (optim.py); types Adam, AdamW, Lamb, Lion, SGD, Adagrad,
      case-insensitive"""
    scheduler: SchedulerConfig | None = _f(None, "special", cls=SchedulerConfig)
    """Section: LR schedule `type` and `params`.
    zerojax: **acted on**: optax schedule with DeepSpeed's formulas (optim.py)"""
    zero_optimization: ZeroConfig = _f(kind="special", factory=ZeroConfig, cls=ZeroConfig)
    """Section: ZeRO (or legacy `true`/`false` → stage 1/0).
    zerojax: **acted on**: see its keys"""
    activation_checkpointing: ActivationCheckpointingConfig | None = _f(
        None, "section", optional=True, cls=ActivationCheckpointingConfig)
    """Section: activation checkpointing (`None` when absent).
    zerojax: **acted on**: see its keys"""
    tensorboard: TensorBoardConfig = _f(kind="section", factory=TensorBoardConfig, cls=TensorBoardConfig)
    """Section: tensorboard logging.
    zerojax: **acted on**: metrics writer (monitor.py)"""
    csv_monitor: CSVConfig = _f(kind="section", factory=CSVConfig, cls=CSVConfig)
    """Section: csv_monitor logging.
    zerojax: **acted on**: metrics writer (monitor.py)"""
    wandb: WandbConfig = _f(kind="section", factory=WandbConfig, cls=WandbConfig)
    """Section: Weights & Biases logging.
    zerojax: **acted on**: metrics writer (monitor.py)"""
    comet: CometConfig = _f(kind="section", factory=CometConfig, cls=CometConfig)
    """Section: Comet logging.
    zerojax: **accepted, no effect**: accepted; no Comet writer yet"""
    trackio: TrackioConfig = _f(kind="section", factory=TrackioConfig, cls=TrackioConfig)
    """Section: Trackio logging.
    zerojax: **accepted, no effect**: accepted; no Trackio writer yet"""
    flops_profiler: FlopsProfilerConfig = _f(kind="section", factory=FlopsProfilerConfig,
                                             cls=FlopsProfilerConfig)
    """Section: DeepSpeed's FLOPs profiler.
    zerojax: **accepted, no effect**: use XLA's cost analysis (`jax.jit(...).lower(...).cost_analysis()`)"""
    checkpoint: CheckpointConfig = _f(kind="section", factory=CheckpointConfig, cls=CheckpointConfig)
    """Section: checkpoint options.
    zerojax: **acted on**: see its keys"""
    pipeline: PipelineConfig = _f(kind="section", factory=PipelineConfig, cls=PipelineConfig)
    """Section: pipeline parallelism.
    zerojax: **accepted, no effect**: accepted now; the `pipe` mesh axis comes later"""
    tensor_parallel: TensorParallelConfig = _f(kind="special", factory=TensorParallelConfig, cls=TensorParallelConfig)
    """Section: AutoTP tensor parallelism.
    zerojax: **acted on**: see its keys"""
    torch_autocast: Mapping | None = _f(None, "special")
    """torch.autocast mixed precision; `enabled: true` is a ConfigError (use bf16 or fp16).
    zerojax: **accepted, no effect**: kept as a mapping when disabled"""
    aio: Mapping | None = _f(None, "mapping", optional=True)
    """Async I/O settings for NVMe.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""
    autotuning: Mapping | None = _f(None, "mapping", optional=True)
    """DeepSpeed autotuner.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""
    data_efficiency: Mapping | None = _f(None, "mapping", optional=True)
    """Data sampling / routing.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""
    hybrid_engine: HybridEngineConfig = _f(kind="section", factory=HybridEngineConfig, cls=HybridEngineConfig)
    """Section: RLHF hybrid train / inference engine (validated strictly, as DeepSpeed does).
    zerojax: **accepted, no effect**: see its keys"""
    datastates: Mapping | None = _f(None, "mapping", optional=True)
    """DataStates async checkpointing.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""
    weight_quantization: Mapping | None = _f(None, "mapping", optional=True)
    """Post-training weight quantisation.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""
    compile: CompileConfig = _f(kind="section", factory=CompileConfig, cls=CompileConfig)
    """Section: torch.compile / DeepCompile (validated strictly, as DeepSpeed does).
    zerojax: **accepted, no effect**: see its keys"""
    comms_logger: CommsLoggerConfig = _f(kind="section", factory=CommsLoggerConfig, cls=CommsLoggerConfig)
    """Section: log collective calls (validated strictly, as DeepSpeed does).
    zerojax: **accepted, no effect**: see its keys"""
    timers: TimersConfig = _f(kind="section", factory=TimersConfig, cls=TimersConfig)
    """Section: DeepSpeed timers (validated strictly, as DeepSpeed does).
    zerojax: **accepted, no effect**: see its keys"""
    expert_parallel: Mapping | None = _f(None, "mapping", optional=True)
    """MoE expert parallelism.
    zerojax: **accepted, no effect**: kept as a read-only mapping; nothing in zerojax reads it"""

    def to_dict(self) -> dict:
        """The resolved config as DeepSpeed JSON; `load_config(d, world_size=cfg.world_size) == cfg`."""
        return _to_json(self)


# ----------------------------------------------------------------------------------------------
# Optimizers and schedulers: DeepSpeed's names and each one's constructor parameters.

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad")
_NUM, _NONNEG, _BOOL, _BETAS, _POSINT, _INT = "num", "nonneg", "bool", "betas", "posint", "int"
_OPT_BOOL = "bool_or_null"  # torch.optim's foreach / fused: None means "let torch choose"


class Param(NamedTuple):
    """One constructor argument of a DeepSpeed optimizer / scheduler: the one table that both
    `load_config` (validation) and `zerojax.optim` (the builders, which read `default`) use."""

    check: str  # the value check: _NUM, _NONNEG, _BOOL, _OPT_BOOL, _BETAS, _POSINT, _INT or "warmup_type"
    default: Any = None  # the default of the class DeepSpeed builds; None: computed by the builder or required
    required: bool = False
    inert: str = ""  # non-empty: accepted, but changes nothing in zerojax, and why


_TORCH_SWITCH = Param(_OPT_BOOL, inert="a PyTorch kernel choice (foreach / fused / capturable / differentiable); "
                                   "the update is the same")
_SET_GRAD_NONE = Param(_BOOL, True, inert="frees PyTorch .grad tensors; JAX gradients are values")
_FP32_STATES = Param(_BOOL, True, inert="optimizer states are always fp32 in zerojax")
_MAXIMIZE = Param(_BOOL, False)  # torch.optim: only false is supported (the builder refuses true)
_BETAS_DEFAULT = (0.9, 0.999)
# deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam and, with torch_adam, torch.optim.Adam(W)
# (engine.py `_configure_basic_optimizer` pops torch_adam and adam_w_mode first).
_ADAM_PARAMS = {"lr": Param(_NONNEG, 1e-3), "betas": Param(_BETAS, _BETAS_DEFAULT), "eps": Param(_NONNEG, 1e-8),
                "weight_decay": Param(_NONNEG, 0.0), "adam_w_mode": Param(_BOOL, True),
                "bias_correction": Param(_BOOL, True), "amsgrad": Param(_BOOL, False),
                "torch_adam": Param(_BOOL, False), "set_grad_none": _SET_GRAD_NONE,
                "fp32_optimizer_states": _FP32_STATES, "maximize": _MAXIMIZE, "foreach": _TORCH_SWITCH,
                "fused": _TORCH_SWITCH, "capturable": _TORCH_SWITCH, "differentiable": _TORCH_SWITCH}
OPTIMIZER_PARAMS = {
    "Adam": _ADAM_PARAMS,
    "AdamW": _ADAM_PARAMS,
    # deepspeed.ops.lamb.FusedLamb (max_grad_norm is refused by the engine for every optimizer)
    "Lamb": {"lr": Param(_NONNEG, 1e-3), "bias_correction": Param(_BOOL, True), "betas": Param(_BETAS, _BETAS_DEFAULT),
             "eps": Param(_NONNEG, 1e-8), "eps_inside_sqrt": Param(_BOOL, False), "weight_decay": Param(_NONNEG, 0.0),
             "max_coeff": Param(_NONNEG, 10.0), "min_coeff": Param(_NONNEG, 0.01), "amsgrad": Param(_BOOL, False)},
    # deepspeed.ops.lion.FusedLion / DeepSpeedCPULion
    "Lion": {"lr": Param(_NONNEG, 1e-3), "betas": Param(_BETAS, _BETAS_DEFAULT), "weight_decay": Param(_NONNEG, 0.0),
             "set_grad_none": _SET_GRAD_NONE, "fp32_optimizer_states": _FP32_STATES},
    # torch.optim.SGD (DeepSpeed passes names it does not know to torch.optim)
    "SGD": {"lr": Param(_NONNEG, 1e-3), "momentum": Param(_NONNEG, 0.0), "dampening": Param(_NONNEG, 0.0),
            "weight_decay": Param(_NONNEG, 0.0), "nesterov": Param(_BOOL, False), "maximize": _MAXIMIZE,
            "foreach": _TORCH_SWITCH, "fused": _TORCH_SWITCH, "differentiable": _TORCH_SWITCH},
    # torch.optim.Adagrad / DeepSpeedCPUAdagrad
    "Adagrad": {"lr": Param(_NONNEG, 1e-2), "lr_decay": Param(_NONNEG, 0.0), "weight_decay": Param(_NONNEG, 0.0),
                "initial_accumulator_value": Param(_NONNEG, 0.0), "eps": Param(_NONNEG, 1e-10),
                "maximize": _MAXIMIZE, "foreach": _TORCH_SWITCH, "fused": _TORCH_SWITCH,
                "differentiable": _TORCH_SWITCH},
}
# DeepSpeed optimizers zerojax does not run: (closest supported, why results would differ).
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": ("Adam", "1-bit Adam compresses gradient communication with error feedback"),
    "zerooneadam": ("Adam", "0/1 Adam skips and compresses variance updates and communication"),
    "onebitlamb": ("Lamb", "1-bit LAMB compresses gradient communication with error feedback"),
    "muadam": ("Adam", "MuAdam (muP) rescales per-layer learning rates by width"),
    "muadamw": ("AdamW", "MuAdamW (muP) rescales per-layer learning rates by width"),
    "musgd": ("SGD", "MuSGD (muP) rescales per-layer learning rates by width"),
    "muon": ("AdamW", "Muon orthogonalises matrix updates (Newton-Schulz)"),
}
MAX_GRAD_NORM_MSG = (
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
    "parameter 'gradient_clipping' see: https://www.deepspeed.ai/docs/config-json/#gradient-clipping "
    "for more details")

SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# deepspeed/runtime/lr_schedules.py constructor defaults.
_LAST = Param(_INT, -1)
_WARMUP = {"warmup_min_lr": Param(_NUM, 0.0),
           # WarmupLR: the optimizer's lr when absent; WarmupDecayLR: 0.001 (computed by the builder)
           "warmup_max_lr": Param(_NUM),
           "warmup_num_steps": Param(_POSINT, 1000), "warmup_type": Param("warmup_type", "log"),
           "last_batch_iteration": _LAST}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": Param(_POSINT, required=True), **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": Param(_POSINT, required=True), "warmup_min_ratio": Param(_NONNEG, 0.0),
                       "warmup_num_steps": Param(_POSINT, 1000), "cos_min_ratio": Param(_NONNEG, 0.0001),
                       "warmup_type": Param("warmup_type", "log"), "last_batch_iteration": _LAST},
    "OneCycle": {"cycle_min_lr": Param(_NUM, required=True), "cycle_max_lr": Param(_NUM, required=True),
                 "decay_lr_rate": Param(_NUM, 0.0), "cycle_first_step_size": Param(_POSINT, 2000),
                 "cycle_second_step_size": Param(_POSINT),  # None: cycle_first_step_size
                 "cycle_first_stair_count": Param(_INT, 0),
                 "cycle_second_stair_count": Param(_INT),  # None: cycle_first_stair_count
                 "decay_step_size": Param(_INT, 0), "cycle_momentum": Param(_BOOL, True),
                 "cycle_min_mom": Param(_NUM, 0.8), "cycle_max_mom": Param(_NUM, 0.9),
                 "decay_mom_rate": Param(_NUM, 0.0), "last_batch_iteration": _LAST},
    "LRRangeTest": {"lr_range_test_min_lr": Param(_NUM, 1e-3), "lr_range_test_step_size": Param(_POSINT, 2000),
                    "lr_range_test_step_rate": Param(_NUM, 1.0), "lr_range_test_staircase": Param(_BOOL, False),
                    "last_batch_iteration": _LAST},
}


def canonical_optimizer(name):
    """DeepSpeed matches optimizer names case-insensitively; the table's spelling, or None."""
    return next((c for c in SUPPORTED_OPTIMIZERS if c.lower() == str(name).lower()), None)


def check_optimizer_params(type, params, problems, path="optimizer.params"):
    """Validate `params` of optimizer `type` (a supported name) against OPTIMIZER_PARAMS."""
    return _check_params(params, OPTIMIZER_PARAMS[canonical_optimizer(type)], path, problems)


def check_scheduler_params(type, params, problems, path="scheduler.params"):
    """Validate `params` of scheduler `type` (a name in SUPPORTED_SCHEDULERS) against SCHEDULER_PARAMS."""
    return _check_params(params, SCHEDULER_PARAMS[type], path, problems)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_CONFIG_KEYS = tuple(f.name for f in fields(Config) if f.name != "world_size")
_TOP_ALIASES = {"bfloat16": "bf16"}


# ----------------------------------------------------------------------------------------------
# Public entry point.

def load_config(source, *, world_size: int | None = None, fill: Mapping[str, Any] | None = None) -> Config:
    """Load a DeepSpeed config (path, JSON/hjson text, or dict) into a resolved, validated Config.

    world_size: the batch trio's world size; default `jax.device_count()` divided by
    sequence_parallel_size. Tensor-parallel ranks count, as in DeepSpeed 0.19.8's check.
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

    notes: list[str] = []
    kwargs = _build_top(raw, unresolved, problems, notes)
    zero = kwargs.get("zero_optimization", ZeroConfig())
    tp = kwargs.get("tensor_parallel", TensorParallelConfig())
    notes += _cross_checks(kwargs, zero, problems)

    if world_size is None:
        import jax  # lazily: config.py itself must not need jax

        # DeepSpeed 0.19.8's batch rule counts every rank, tensor-parallel ranks included
        world_size = max(1, jax.device_count() // kwargs.get("sequence_parallel_size", 1))
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


def _suggest(key, known, cutoff=0.6):
    match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=cutoff)
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
            tp = _build(TensorParallelConfig, value, "tensor_parallel", problems, aliases=_TP_ALIASES)
            _check_partition_config(tp.partition_config, problems)
            kwargs[name] = dataclasses.replace(tp, autotp_size=max(1, tp.autotp_size))
        elif name == "torch_autocast":
            kwargs[name] = _build_torch_autocast(value, problems)
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


def _removed(where, reason):
    return f"{where}: {reason} See {_REMOVED_ISSUE}. (DeepSpeed {DEEPSPEED_VERSION} refuses it too; remove the key)"


def _unknown_top_level(key):
    """DeepSpeed reads the top level key by key and never looks at the others: an unknown key loads."""
    # A stricter cutoff than for sections: free-form keys ("_comment", "comms_config") are common up here.
    hint = _suggest(key, _CONFIG_KEYS, cutoff=0.8)
    return (f"{key}: unknown top-level key, ignored (as DeepSpeed ignores it){hint} "
            "(docs/config-keys.md lists the keys zerojax reads)")


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
    for key in value:
        if key in REMOVED_ZERO_KEYS:
            problems.append(_removed(f"{path}.{key}", REMOVED_ZERO_KEYS[key]))
    value = {k: v for k, v in value.items() if k not in REMOVED_ZERO_KEYS}
    zero = _build(ZeroConfig, value, path, problems, aliases=_ZERO_ALIASES)
    overlap = zero.overlap_comm if zero.overlap_comm is not None else zero.stage == 3
    return dataclasses.replace(zero, overlap_comm=overlap)


def _check_params(params, schema, path, problems):
    out = {}
    for name, value in params.items():
        where = f"{path}.{name}"
        if name == "max_grad_norm":
            problems.append(f"{where}: {MAX_GRAD_NORM_MSG}")
            continue
        if name not in schema:
            _unknown(path, name, schema, problems)
            continue
        if _is_auto(value):
            out[name] = value  # reported as unresolved
            continue
        ok, conv = _check_param(value, schema[name].check, where, problems)
        if ok:
            out[name] = conv
    for name, spec in schema.items():
        if spec.required and name not in params:
            problems.append(f"{path}.{name}: required by this scheduler and missing")
    return _freeze(out)


def _check_param(value, kind, where, problems):
    if kind == _OPT_BOOL and value is None:
        return True, None
    if kind in (_BOOL, _OPT_BOOL):
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
            hint = _suggest(typ, SUPPORTED_OPTIMIZERS)
            problems.append(f"optimizer.type = {typ!r}: unknown optimizer{hint} "
                            f"(supported, case-insensitive: {', '.join(SUPPORTED_OPTIMIZERS)})")
        if "max_grad_norm" in params:
            problems.append(f"optimizer.params.max_grad_norm: {MAX_GRAD_NORM_MSG}")
        return None
    checked = check_optimizer_params(canon, params, problems)
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
    checked = check_scheduler_params(typ, params, problems)
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
    if kwargs.get("gradient_allreduce_op") == "sum":
        problems.append("gradient_allreduce_op = \"sum\": zerojax averages data-parallel gradients (DeepSpeed's "
                        "default \"mean\"); summing is not supported yet (DeepSpeed itself refuses it at ZeRO "
                        "stage 3); remove the key or scale the loss by the data-parallel size")
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
