"""The DeepSpeed config schema: one frozen dataclass per section, fields named as DeepSpeed's keys, each with
its documentation string (DeepSpeed's meaning, then "zerojax:" and what zerojax does with the key), and the
keys DeepSpeed 0.19.8 removed."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the sections of their own modules, re-exported: the schema is read from here (zerojax.config, docs.py)
from zerojax.config._schema_monitors import (  # noqa: F401
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    ThroughputTimerConfig,
    TimersConfig,
    TrackioConfig,
    WandbConfig,
)
from zerojax.config._schema_zero import (  # noqa: F401
    ZERO_ALIASES,
    ZERO_DEPRECATED_NOOP,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from zerojax.config._values import config_field as _f
from zerojax.config._values import empty, is_auto, to_json  # _f: the fields below
from zerojax.remat_segments import SEGMENT_POLICIES

DEEPSPEED_VERSION = "0.19.8"
# activation_checkpointing.remat_policy's values (None written "none"): zerojax.models.gpt2.REMAT_POLICIES,
# the generic ones any layer stack takes (zerojax.models.layer_stack.GENERIC_REMAT_POLICIES) and the ones
# GPT-2's and Llama's activation tags add; the config imports nothing of the models, so
# tests/engine/test_speed_options.py checks the two agree
class _RematPolicyNames(tuple):
    """The fixed names, and also (membership only) "<name>_<k>", k an int >= 1, for "dots" ("dots"
    on the first k layers, "full" on the rest), "segments" and "offload_segments" (two-level: k
    layers a segment); the model checks k against its layer count."""

    def __contains__(self, value):
        if tuple.__contains__(self, value):
            return True
        name, _, k = value.rpartition("_") if isinstance(value, str) else ("", "", "")
        return name in _WITH_K and k.isdigit() and int(k) >= 1


# the names a "_<k>" may follow (see _RematPolicyNames); the two-level ones keep each k-th layer input
_WITH_K = ("dots",) + SEGMENT_POLICIES


REMAT_POLICY_NAMES = _RematPolicyNames(
    ("none", "full", "dots", "save_qkv", "save_attention", "save_qkv_attention", "save_attention_block",
     "offload") + SEGMENT_POLICIES)


# Features DeepSpeed removed (github.com/deepspeedai/DeepSpeed/issues/8489): any presence of the key, even null, {} or
# false, is a DeepSpeedConfigError. Reasons transcribed from DeepSpeed 0.19.8
# `deepspeed/runtime/config.py` (`_REMOVED_TOP_LEVEL_CONFIG_KEYS`, `_REMOVED_ZERO_CONFIG_KEYS`,
# checked by `_reject_removed_config_keys` before anything else is read).
REMOVED_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"
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
    """Check bf16 gradients for inf/nan and skip the step when found (default true since DeepSpeed 0.19.5,
    github.com/deepspeedai/DeepSpeed/pull/8035).
    zerojax: **differs from DeepSpeed**: the check is always on and cannot be turned off: a bf16 / fp32 step with
      a non-finite loss or gradient is skipped, and the engine then raises FloatingPointError naming the likely
      causes, where DeepSpeed skips and continues"""
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
    params: Mapping = _f(kind="mapping", factory=empty)
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
    params: Mapping = _f(kind="mapping", factory=empty)
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
    zerojax: **acted on**: the remat policy "offload": each layer's input kept in pinned host memory for the
      backward pass, the rest recomputed
    Model needs: as `activation_checkpointing`"""
    # DeepSpeed reads it with get_scalar_param (any value); configs in the wild write false for "unset".
    number_checkpoints: int | None = _f(None, "int", optional=True, ge=0, false_is_none=True)
    """Number of checkpoints (`false` reads as unset).
    zerojax: **acted on**: the layer inputs the forward pass keeps. N >= the model's layers (or 0, unset): one a
      layer, as before; N < layers: two-level checkpointing, segments of ceil(layers / N) layers, each keeping its
      input (in host memory with `cpu_checkpointing`), its layers' inputs kept only while the backward pass
      rebuilds it (remat_policy "segments_<k>" / "offload_segments_<k>")
    Model needs: a layer stack zerojax scans (GPT-2, the Llama family, a list of blocks it stacks); with
      remat_policy unset, "full" or "offload" only (a ConfigError otherwise)"""
    synchronize_checkpoint_boundary: bool = _f(False, "bool")
    """cuda.synchronize at checkpoint boundaries.
    zerojax: **accepted, no effect**: —"""
    profile: bool = _f(False, "bool")
    """Time checkpointed forwards.
    zerojax: **accepted, no effect**: —"""
    remat_policy: str | None = _f(None, "str", optional=True, lower=True, choices=REMAT_POLICY_NAMES,
                                  extension=True)
    """**Not a DeepSpeed key** (a zerojax extension; DeepSpeed 0.19.8 validates this section with a pydantic
    model that forbids unknown keys, so remove it before giving the config to DeepSpeed). What each layer keeps
    for the backward pass, the rest being recomputed. Any model: "full" (the layer input only), "dots" (every
    matmul output without batch dimensions), "offload" (the layer input, in host memory; the same as
    `cpu_checkpointing: true`), "none" (no recompute, as if the section were absent). A model whose blocks tag
    their activations takes more through its own `remat_policy` attribute; zerojax's GPT-2 and Llama:
    "save_qkv" (the qkv projection), "save_attention" (the attention output), "save_qkv_attention" (both),
    "save_attention_block" (both and the residual stream after the attention half: only the MLP half is
    recomputed), "dots_<k>" (e.g. "dots_24": "dots" on the first k layers, "full" on the rest: memory between
    the two). Two-level, for rows too long for one kept input a layer: "segments_<k>" (segments of k layers, each
    keeping only its input; the backward pass rebuilds one segment at a time, keeping its k layer inputs, then
    each layer from its input: about layers / k + k inputs live, for a second forward recompute),
    "offload_segments_<k>" (the segment inputs in host memory), bare "segments" / "offload_segments": k near
    sqrt(layers). Unset: "offload" with `cpu_checkpointing`, else "full" (segments with `number_checkpoints`).
    zerojax: **acted on**: set on the model's layer stack by the engine (`zerojax.model.remat_modules`: the
      `remat_policy` attribute of the module that scans the layers, else each found block's call run under
      `jax.checkpoint` with the policy); a policy other than "offload" with `cpu_checkpointing: true` is an
      error
    Model needs: as `activation_checkpointing`; the "save_*" and "dots_<k>" names also the model's own tags
      (zerojax.models' GPT-2 and Llama), else a ConfigError naming the policies its layers take"""


def remat_policy_for(cfg, layers: int | None = None) -> str | None:
    """The remat policy a model of `layers` layers should be built with for `cfg`'s
    activation_checkpointing section: None (no section, or remat_policy "none"), "offload"
    (cpu_checkpointing), else remat_policy or "full" (DeepSpeed's activation checkpointing
    recomputes each checkpointed layer's forward); "full" / "offload" as two-level segments where
    number_checkpoints is fewer than `layers` (`checkpoints_policy`; `layers` None: not applied)."""
    ac = cfg.activation_checkpointing
    if ac is None or ac.remat_policy == "none":
        return None
    policy = ac.remat_policy or ("offload" if ac.cpu_checkpointing else "full")
    return checkpoints_policy(policy, ac.number_checkpoints, layers)


def checkpoints_policy(policy: str, number: int | None, layers: int | None) -> str:
    """DeepSpeed's number_checkpoints N (the activation checkpoints a forward pass stores) on
    `layers` layers: for N < layers, "full" -> "segments_<k>" and "offload" -> "offload_segments_<k>"
    with k = ceil(layers / N) (at most N segment inputs kept); else `policy` as it is."""
    if not number or layers is None or number >= layers or policy not in ("full", "offload"):
        return policy
    k = -(-layers // number)
    return f"segments_{k}" if policy == "full" else f"offload_segments_{k}"




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
    parallel_write: Mapping = _f(kind="mapping", factory=empty)
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
    zerojax: **acted on**: size of the mesh's `pipe` axis ("auto" = 1, no pipeline); the stacked layers are
      split into this many stages, micro-batches = gradient_accumulation_steps, data-parallel size =
      devices / (stages x autotp_size); ZeRO stage <= 1 and no offload (DeepSpeed's rule)
    Model needs: a layer stack zerojax can run in stages: the `layer_scan` hook (GPT-2, Llama), a list of
      same-structure blocks, or an `nnx.vmap` stack whose own `nnx.scan` body only calls the block on its
      carry (docs/CONTRACTS.md, "The model contract"); else a ConfigError naming the `layer_scan` hook"""
    partition: str = _f("best", "str")
    """Layer partition method.
    zerojax: **accepted, no effect**: a stacked layer scan is split evenly (its layers are identical, so
      "uniform", "parameters" and "best" give the same split)"""
    seed_layers: bool = _f(False, "bool")
    """Seed each layer differently.
    zerojax: **accepted, no effect**: the model's own init seeds its layers"""
    activation_checkpoint_interval: int = _f(0, "int", ge=0)
    """Checkpoint every N layers in the pipeline.
    zerojax: **acted on**: 0 = no pipeline checkpoints (the model's remat_policy applies, as unpipelined);
      N > 0 = each stage's layers run in `jax.checkpoint` groups of N (N >= a stage's layers: one per
      pipeline iteration), recomputed in the backward pass; N must divide a stage's layer count"""
    pipe_partitioned: bool = _f(True, "bool")
    """Partition activations between stages.
    zerojax: **accepted, no effect**: activations move between stages as XLA collective-permutes"""
    grad_partitioned: bool = _f(True, "bool")
    """Partition gradients between stages.
    zerojax: **accepted, no effect**: activation gradients move between stages as XLA collective-permutes"""


def pipeline_stages(pipeline: PipelineConfig) -> int:
    """The pipe axis size of a pipeline section: its stages, "auto" read as 1 (no pipeline)."""
    return 1 if is_auto(pipeline.stages) else int(pipeline.stages)


@dataclass(frozen=True)
class TensorParallelConfig:
    # DeepSpeed's default is 0 ("disabled"); zerojax reads 0 as 1 (no tensor axis).
    autotp_size: int = _f(1, "int", ge=0)
    """Tensor-parallel degree (0 = off).
    DeepSpeed default: 0
    zerojax: **acted on**, stored as 1 for 0 (no tensor axis): size of the mesh's `tensor` axis (data-parallel
      size = devices / autotp_size); the batch rule's world size counts tensor ranks, as DeepSpeed's does
    Model needs: something to split: logical axis names on its parameters, or projection names AutoTP knows
      (q_proj / wq, up_proj / w1, ...: `zerojax.sharding.autotp`), or `partition_config`; else a ConfigError
      listing the parameters"""
    tp_overlap_comm: bool = _f(False, "bool")
    """Overlap TP all-reduce with compute.
    zerojax: **accepted, no effect**: XLA's latency-hiding scheduler"""
    tp: Mapping = _f(kind="mapping", factory=empty)
    """TP group settings (alias `tensor_parallel`).
    zerojax: **accepted, no effect**: kept as a mapping"""
    dtype: str | None = _f(None, "dtype", optional=True)
    """Model dtype for AutoTP.
    DeepSpeed default: "fp16" (torch.float16)
    zerojax: **accepted, no effect**: stored as given (none when absent); the dtype comes from fp16 / bf16"""
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


TP_ALIASES = {"tensor_parallel": "tp", "kernel_inject": "replace_with_kernel_inject"}


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
class AioConfig:
    """DeepSpeed's `aio` section (runtime/swap_tensor/aio_config.py, constants.py)."""

    block_size: int = _f(1_048_576, "int", ge=1)
    """Bytes per I/O request.
    zerojax: **acted on**: the swap files' alignment and each read / write's request size
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    queue_depth: int = _f(8, "int", ge=1)
    """Requests in flight.
    zerojax: **acted on**: requests in flight per group read / write (thread pool size with
      `intra_op_parallelism`)
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    intra_op_parallelism: int = _f(1, "int", ge=1)
    """Threads per I/O operation (old name `thread_count`).
    zerojax: **acted on**: I/O threads = queue_depth × intra_op_parallelism, capped at 64
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    single_submit: bool = _f(False, "bool")
    """Submit requests one at a time.
    zerojax: **accepted, no effect**: requests go through a thread pool of pread / pwrite"""
    overlap_events: bool = _f(True, "bool")
    """Overlap submission and completion.
    zerojax: **accepted, no effect**: requests go through a thread pool of pread / pwrite"""
    use_gds: bool = _f(False, "bool")
    """GPUDirect Storage (CUDA only).
    zerojax: **accepted, no effect**: transfers go through host buffers; true gives a note"""


AIO_ALIASES = {"thread_count": "intra_op_parallelism"}


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
    """Print progress every N steps.
    zerojax: **acted on**: engine logging interval
    Model needs: nothing (the engine's log lines, outside the compiled step)"""
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
    zerojax: **acted on**: "mean" is what zerojax does; "sum" is a ConfigError (not supported yet)
    Model needs: nothing ("mean", the default, is the one value that runs)"""
    communication_data_type: str | None = _f(None, "str", optional=True, lower=True,
                                             choices=("fp16", "bf16", "fp32"))
    """Dtype of gradient collectives (fp16 / bf16 / fp32).
    zerojax: **XLA**: the element width `xla_flags_for` uses for its combine thresholds; the gradient reduce
      itself runs in the gradients' own dtype (this key does not change it)"""
    seq_parallel_comm_data_type: str = _f("fp32", "str", lower=True, choices=("fp16", "bf16", "fp32"))
    """Dtype of sequence-parallel gradient collectives.
    zerojax: **accepted, no effect**: the "seq" ranks' gradient sums run in the gradients' own dtype"""
    sequence_parallel_size: int = _f(1, "int", ge=1)
    """Ulysses sequence-parallel group size; DeepSpeed divides the world size by it.
    zerojax: **acted on**: the mesh's "seq" axis (data = devices / sequence_parallel_size, the batch rule's
      world size): activations split on the sequence between attentions, on the heads inside them (GSPMD's
      all-to-alls, docs/long-context.md); must divide the devices and the model's heads and kv heads; beside
      "data" only (autotp_size and pipeline.stages 1)
    Model needs: a config naming its heads (`num_attention_heads` / `n_head`, `kv_heads`) and the
      `activation_sharding` hook (GPT-2 and the Llama family have both)"""
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
    zerojax: **acted on**: present, it sets the remat policy of the model's layer stack ("full" unless its
      keys say otherwise); absent, the model's own remat stays
    Model needs: a layer stack zerojax finds or a `remat_policy` attribute (docs/CONTRACTS.md, "The model
      contract"); else a ConfigError naming that attribute"""
    tensorboard: TensorBoardConfig = _f(kind="section", factory=TensorBoardConfig, cls=TensorBoardConfig)
    """Section: tensorboard logging.
    zerojax: **acted on**: metrics writer (monitor.py)
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    csv_monitor: CSVConfig = _f(kind="section", factory=CSVConfig, cls=CSVConfig)
    """Section: csv_monitor logging.
    zerojax: **acted on**: metrics writer (monitor.py)
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    wandb: WandbConfig = _f(kind="section", factory=WandbConfig, cls=WandbConfig)
    """Section: Weights & Biases logging.
    zerojax: **acted on**: metrics writer (monitor.py)
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
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
    zerojax: **accepted, no effect**: see its keys"""
    pipeline: PipelineConfig = _f(kind="section", factory=PipelineConfig, cls=PipelineConfig)
    """Section: pipeline parallelism.
    zerojax: **acted on**: `stages` > 1 splits the stacked layers over the mesh's `pipe` axis
    (zerojax.sharding.pipeline)
    Model needs: see `pipeline.stages`"""
    tensor_parallel: TensorParallelConfig = _f(kind="special", factory=TensorParallelConfig, cls=TensorParallelConfig)
    """Section: AutoTP tensor parallelism.
    zerojax: **acted on**: see its keys"""
    torch_autocast: Mapping | None = _f(None, "special")
    """torch.autocast mixed precision; `enabled: true` is a ConfigError (use bf16 or fp16).
    zerojax: **accepted, no effect**: kept as a mapping when disabled"""
    aio: AioConfig = _f(kind="section", factory=AioConfig, cls=AioConfig)
    """Section: async I/O settings for NVMe offload (DeepSpeed reads its keys one by one and ignores others).
    zerojax: **acted on**: see its keys"""
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
    lora: Mapping | None = _f(None, "mapping", optional=True, extension=True)
    """**Not a DeepSpeed key** (a zerojax extension; DeepSpeed 0.19.8 ignores unknown top-level keys, so the
    config loads there too, and trains the whole model). LoRA / QLoRA adapters for GPT-2 or a Llama-family model:
    PEFT's `LoraConfig` keys (`r`, `lora_alpha`, `target_modules`, `lora_dropout`, `modules_to_save`,
    `use_rslora`, ...; `peft.LoraConfig(...).to_dict()` is a valid section) plus zerojax's `quantize`
    (null, "int8", "nf4", "int4": the frozen base's storage), `base_dtype` and `seed` (docs/lora.md).
    zerojax: **acted on**: kept as a read-only mapping here; checked by `zerojax.lora.from_config_dict`
      (an error naming `lora.<key>` and the fix) and applied with `zerojax.lora.apply` by
      examples/gpt2_large.py (its `--lora R`, `--lora-alpha`, `--lora-targets`, `--quantize` flags override
      the section's keys): the base frozen, the adapters trained
    Model needs: a `zerojax.models.GPT2` or `zerojax.models.Llama` (the Llama family) with the adapters
      `zerojax.lora.apply` puts in; a model without adapters gets a ConfigError"""

    def to_dict(self) -> dict:
        """The resolved config as DeepSpeed JSON; `load_config(d, world_size=cfg.world_size) == cfg`."""
        return to_json(self)
