"""The DeepSpeed config schema's `zero_optimization` section and its offload subsections
(`offload_param`, `offload_optimizer`), each field with its documentation string (DeepSpeed's
meaning, then "zerojax:" and what zerojax does with the key), and the section's aliases and
deprecated keys. `zerojax.config._schema` holds the other sections and re-exports these."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerojax.config._values import DEVICES, freeze  # _f: the fields below
from zerojax.config._values import config_field as _f


@dataclass(frozen=True)
class OffloadParamConfig:
    device: str = _f("none", "str", choices=DEVICES, lower=True)
    """none / cpu / nvme.
    zerojax: **acted on**: cpu → parameters in `pinned_host` memory, streamed per layer; nvme → the same host
      tier while the model has at most `max_in_cpu` parameter elements (DeepSpeed keeps that many in CPU memory
      with NVMe), a ConfigError above it (params streamed from files not supported yet); stage 3 only
    Model needs: a layer stack zerojax finds, streamed a layer at a time (docs/CONTRACTS.md, "The model
      contract"); a model without one gets a ConfigError naming the `layer_fetch` hook"""
    nvme_path: str | None = _f(None, "str", optional=True)
    """NVMe swap directory.
    zerojax: **acted on**: required with `device: "nvme"` (checked: exists, writable, not a RAM disk)
    Model needs: nothing (a directory checked when the engine is built)"""
    buffer_count: int = _f(5, "int", ge=0)
    """NVMe swap buffers.
    zerojax: **accepted, no effect**: the parameters stay in host memory (see `device`)"""
    buffer_size: int = _f(100_000_000, "int", ge=0)
    """NVMe swap buffer size.
    zerojax: **accepted, no effect**: the parameters stay in host memory (see `device`)"""
    max_in_cpu: int = _f(1_000_000_000, "int", ge=0)
    """Parameter elements kept in CPU memory with NVMe.
    zerojax: **acted on**: with `device: "nvme"`, the model's parameter elements must not exceed it
    Model needs: nothing (a bound on its parameter count, checked when the engine is built)"""
    pin_memory: bool = _f(True, "bool")
    """Use page-locked host memory (DeepSpeed's default true since 0.19.5, github.com/deepspeedai/DeepSpeed/pull/8207).
    zerojax: **accepted, no effect**: host offload always uses `pinned_host` memory (on GPU, XLA's pinned
    pool, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: `import zerojax` sets it to 90% of physical memory
    where unset)"""


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    device: str = _f("none", "str", choices=DEVICES, lower=True)
    """none / cpu / nvme.
    zerojax: **acted on**: cpu → fp32 master + moments in `pinned_host` memory; nvme → the layers' master +
      moments in swap files under `nvme_path`, streamed a layer group at a time through the update (stage 3)"""
    nvme_path: str | None = _f(None, "str", optional=True)
    """NVMe swap directory.
    zerojax: **acted on**: required with `device: "nvme"`; swap files live in `<nvme_path>/zerojax-<run>/rank<p>/`,
      removed at exit (checked before the first step: exists, writable, free bytes, not a RAM disk)
    Model needs: nothing (where the swap files live)"""
    buffer_count: int = _f(4, "int", ge=0)
    """NVMe swap buffers.
    zerojax: **acted on**: layer groups held in host memory at once by the swapper (at least 2: one read
      ahead, one being written back)
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    pin_memory: bool = _f(True, "bool")
    """Use page-locked host memory (DeepSpeed's default true since 0.19.5, github.com/deepspeedai/DeepSpeed/pull/8207).
    zerojax: **accepted, no effect**: host offload always uses `pinned_host` memory (on GPU, XLA's pinned
    pool, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: `import zerojax` sets it to 90% of physical memory
    where unset)"""
    pipeline_read: bool = _f(False, "bool")
    """Overlap NVMe reads with the optimizer step.
    zerojax: **acted on**: group g+1 is read while group g is updated (else each read waits)
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    pipeline_write: bool = _f(False, "bool")
    """Overlap NVMe writes with the optimizer step.
    zerojax: **acted on**: group g-1 is written while group g is updated (else each write waits)
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
    fast_init: bool = _f(False, "bool")
    """Fast optimizer init with NVMe.
    zerojax: **accepted, no effect**: the initial state is always written a layer group at a time"""
    host_layers: int = _f(0, "int", ge=0, extension=True)
    """**Not a DeepSpeed key** (a zerojax extension; DeepSpeed 0.19.8 validates this section with a pydantic
    model that forbids unknown keys, so remove it before giving the config to DeepSpeed). With `device: "nvme"`:
    the optimizer state (fp32 master + moments) of the first `host_layers` offloaded layers stays in host memory
    (the swapper's arrays, moved through the same callbacks as the disk layers), the remaining layers' state
    lives in the swap files. 0 (unset): every offloaded layer on NVMe, DeepSpeed's meaning of `device: "nvme"`.
    zerojax: **acted on**: a host / disk split for models whose state fits neither the disk nor host memory
      alone (one layer a group: any count), fewer than the
      offloaded layers; an error with another device
    Model needs: nothing (the NVMe swapper's host-side I/O, outside the compiled step)"""
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
    zerojax: **acted on**: checkpoint export writes gathered 16-bit weights
    Model needs: nothing (read when a checkpoint is saved, outside the compiled step)"""
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
    leaf_module: Mapping = _f(kind="mapping", factory=lambda: freeze(_LEAF_MODULE_DEFAULT))
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
ZERO_ALIASES = {name[len("stage3_"):]: name for name in (
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "stage3_partition_stream_chunk_size")}
ZERO_ALIASES["stage3_gather_fp16_weights_on_model_save"] = "stage3_gather_16bit_weights_on_model_save"
# Deprecated keys with no replacement value: accepted with a warning, as DeepSpeed does.
ZERO_DEPRECATED_NOOP = ("cpu_offload_use_pin_memory",)
