"""DeepSpeed's memory estimators, the ZeRO paper's table, and a step-time model: formulas only.

Nothing here imports jax, so `zerojax estimate --params ...` and the planner's pruning run before
(or without) any compile.

1. DeepSpeed's estimators, reproduced number for number (`estimate_zero2_model_states_mem_needs`,
   `estimate_zero3_model_states_mem_needs`, with `additional_buffer_factor=1.5` and the offload
   variants), and the ZeRO paper's per-device model-state table (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N).
   These count model states only: no activations, no temporaries.
2. A predicted step time for one training choice (precision, activation checkpointing,
   micro-batch / accumulation, ZeRO stage, offload): FLOPs including recompute at a matmul
   ceiling, collective bytes at an interconnect bandwidth, host<->device bytes at a PCIe
   bandwidth. The planner ranks plans by it ("fastest first").
"""
from __future__ import annotations

import dataclasses
import math

from zerojax.byte_sizes import GB, GiB, fmt_bytes, host_free_bytes, parse_bytes  # noqa: F401 (public here too)
from zerojax.remat_segments import kept_inputs, segment_policy

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


def tier_bytes(total_params, stage, n_devices, *, offload_optimizer=False, offload_param=False,
               nvme=False, layer_fraction=1.0, buffer_count=4, n_layers=1, host_layers=0):
    """Model-state bytes per device, per host and on disk for one plan: `zero_paper_bytes` plus the
    NVMe tier (ZeRO-Infinity): with `nvme` the layers' share (`layer_fraction` of the parameters:
    the stacked layers, not the embeddings) of the 12Ψ/N master + moments moves from host memory to
    the swap files, but for the first `host_layers` of the `n_layers` layers
    (offload_optimizer.host_layers, the host / disk split), and host memory keeps `buffer_count`
    layer groups of the swapped part in flight (one group = one layer). {"device", "host", "disk"}."""
    b = zero_paper_bytes(total_params, stage, n_devices, offload_optimizer=offload_optimizer or nvme,
                         offload_param=offload_param)
    disk = 0
    if nvme:
        if stage != 3:
            raise ValueError(f"NVMe offload needs zero_optimization.stage=3, got stage={stage}")
        if not 0 <= host_layers < max(n_layers, 1):
            raise ValueError(f"host_layers={host_layers} must be in [0, n_layers={n_layers})")
        per_layer = 12 * total_params / n_devices * layer_fraction / max(n_layers, 1)
        swapped_layers = max(n_layers, 1) - host_layers
        disk = int(per_layer * swapped_layers)
        b["host"] = int(b["host"] - per_layer * swapped_layers + min(buffer_count, swapped_layers) * per_layer)
    return {**b, "disk": disk}


def nvme_suggestion(host_needed, host_free, *, disk_bytes, disk_free=None, n_layers=None,
                    buffer_count=4) -> str | None:
    """A line offering NVMe offload when host memory is what a CPU-offload plan runs out of (None when
    it fits). When the disk cannot hold every layer's swap files (`disk_bytes` of them for `n_layers`
    layers, given) but host memory and disk together can, it offers the host / disk split: the fewest
    layers on disk whose state (less the swapper's `buffer_count` layers in flight) brings host memory
    under `host_free`, as `offload_optimizer.host_layers`."""
    if host_needed <= host_free:
        return None
    if disk_free is not None and disk_bytes > disk_free:
        layer = disk_bytes / n_layers if n_layers else 0
        for disk_layers in range(1, (n_layers or 0)):
            host = host_needed - (disk_layers - min(buffer_count, disk_layers)) * layer
            if disk_layers * layer > disk_free:
                break
            if host <= host_free:
                return (f"host memory is the limit ({fmt_bytes(host_needed)} needed, {fmt_bytes(host_free)} free) and "
                        f"the disk cannot hold every layer ({fmt_bytes(disk_bytes)} of swap files, "
                        f"{fmt_bytes(disk_free)} free): \"offload_optimizer\": {{\"device\": \"nvme\", \"nvme_path\": "
                        f"..., \"host_layers\": {n_layers - disk_layers}}} (ZeRO-3) keeps {n_layers - disk_layers} "
                        f"layers' state in host memory and swaps {disk_layers} ({fmt_bytes(disk_layers * layer)})")
        return (f"host memory is the limit ({fmt_bytes(host_needed)} needed, {fmt_bytes(host_free)} free) and the "
                f"disk too ({fmt_bytes(disk_bytes)} of swap files, {fmt_bytes(disk_free)} free)")
    return (f"host memory is the limit ({fmt_bytes(host_needed)} needed, {fmt_bytes(host_free)} free): "
            f"\"offload_optimizer\": {{\"device\": \"nvme\", \"nvme_path\": ...}} (ZeRO-3) moves the layers' "
            f"master + moments to {fmt_bytes(disk_bytes)} of swap files")


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


# ---------------------------------------------------------------------------------------------
# 2. Predicted step time

# the width (d_model) of the model Hardware's efficiency was fitted to: GPT-2 Large
FIT_D_MODEL = 1280


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Throughputs the step-time model divides by (per device).

    matmul_flops: 16-bit (bf16 / fp16) matmul ceiling. 791e12 was measured on one H200 (a large
        bf16 matmul; the datasheet's dense peak is 989e12).
    fp32_matmul_flops: fp32 ceiling; default half of `matmul_flops` (XLA runs fp32 matmuls as
        TF32 on tensor cores, at half the 16-bit rate on the datasheet). An assumption, not measured.
    interconnect_bytes_per_s: per-device collective bandwidth (one direction); 450e9 is NVLink 4's
        datasheet figure. An assumption, not measured.
    host_bytes_per_s: host<->device copies; 53e9 was measured (pinned memory, one H200, PCIe 5).
    peak_efficiency, half_efficiency_work: the share of the matmul ceiling a step's FLOPs reach,
        peak_efficiency x w / (w + half_efficiency_work) where w = micro-batch tokens x d_model
        (attention, element-wise work and the optimizer, which the FLOP count leaves out, lower it;
        their share of a micro-batch's time shrinks with both its tokens and the model's width).
    recompute_weight: what a FLOP that remat recomputes costs against one of the step proper; an
        empirical weight, well below 1 as measured (the recomputed forward is matmul-heavy, without
        the loss, the optimizer or the backward's reductions; not profiled apart).
    The three were fitted (least squares on log tokens/s) to eleven runs of GPT-2 Large, bf16,
    ZeRO-2, seq 1024 on one H200 (benchmarks/RESULTS.md), remat policy x
    micro-batch: "full" x 4 / 8 / 16, "dots" x 4 / 8 (twice), "save_attention" x 8 / 16,
    "save_qkv" x 8, "save_qkv_attention" x 8, "save_attention_block" x 12; 60,364 to 78,121
    tokens/s, each predicted within 4%. A first fit to seven of them (micro 8-16) predicted the
    other four before they ran within 2-10% (micro 4 high). The model before (one point:
    efficiency tokens / (tokens + 7000), recompute at full cost) predicted micro-batch 16 30%
    faster than 8 (measured: 6%), micro 4 29% slow and "save_attention" 64,357 for 72,815.
    Width: with the micro-batch's tokens alone (half efficiency at 1650 tokens) the
    fit to Large predicted GPT-2 Medium 4-7% fast and XL 8% slow (six runs, full / dots, micro
    4-16); scaled by d_model (1650 tokens x 1280, Large's width: Large's predictions unchanged)
    it predicts all six within 4.5%, each run measured after the prediction was written.
    """

    matmul_flops: float = 791e12
    fp32_matmul_flops: float | None = None
    interconnect_bytes_per_s: float = 450e9
    host_bytes_per_s: float = 53e9
    peak_efficiency: float = 0.613
    half_efficiency_work: float = 1650.0 * FIT_D_MODEL
    recompute_weight: float = 0.31

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"Hardware.{f.name}={v!r}: must be a positive number")
        if self.peak_efficiency > 1:
            raise ValueError(f"Hardware.peak_efficiency={self.peak_efficiency!r}: a share of the ceiling, at most 1")

    def ceiling(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_matmul_flops or self.matmul_flops / 2
        return self.matmul_flops


H200 = Hardware()

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# remat policies of zerojax's GPT-2 (`models.gpt2.REMAT_POLICIES`); None = no remat
REMAT_RECOMPUTE = {None: "nothing", "dots": "attention scores", "full": "every block's forward",
                   "offload": "every block's forward",
                   "save_qkv": "every block's forward but the q/k/v projection",
                   "save_attention": "every block's matmuls, not attention itself",
                   "save_qkv_attention": "the attention output projection and the MLP",
                   "save_attention_block": "the MLP",
                   "segments": "every block's forward, twice", "offload_segments": "every block's forward, twice"}
# (d^2 weights per layer whose matmul output is saved or not recomputed, attention's output saved):
# the save_* policies of models.gpt2 (checkpoint_name tags on the q/k/v projection, the attention
# output and the residual after the attention half, which spares the output projection's rerun)
_SAVED_BY_POLICY = {"save_qkv": (3, False), "save_attention": (0, True), "save_qkv_attention": (3, True),
                    "save_attention_block": (4, True)}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the step-time model needs to know of a model (`planner.model_shape` reads it from
    `zerojax.model.model_dims`).

    params: all parameters (tied embeddings once); layer_params: those of the repeated blocks
    (all layers together: what a per-layer remat recomputes); layers, d_model (the residual
    stream's width), seq_len: for attention's FLOPs, the activations and the per-layer
    collectives (0 when unknown: attention is then not counted); attn_width: the attention's
    width, heads x head_dim, where attention's FLOPs are counted (0: d_model, as for GPT-2; Qwen3
    0.6B has 16 x 128 = 2048 on d_model 1024); mlp_params: the blocks' MLP kernels (all layers),
    what a tiled MLP's backward reruns (0 when unknown). `n_layer=` is accepted for `layers` (its
    older, GPT-2 name). A mixture of experts: experts (a layer's), top_k (the experts a token
    runs), expert_params (all layers' expert weights, among params and mlp_params; what expert
    parallelism splits); 0 for a dense model. grouped_kernel_precisions: the compute precisions
    ("bf16", "fp16") at which grouped kernels run the experts' products
    (`zerojax.models.grouped_matmul.kernel_precisions`); at any other, XLA's dense expansion runs
    them (`jax.lax.ragged_dot` on CPU and NVIDIA GPUs) with its transient, `grouped_transient_values`.
    """

    params: int
    layer_params: int
    layers: int = 0
    d_model: int = 0
    seq_len: int = 0
    attn_width: int = 0
    mlp_params: int = 0
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    grouped_kernel_precisions: tuple[str, ...] = ()
    n_layer: dataclasses.InitVar[int | None] = None

    def __post_init__(self, n_layer):
        if n_layer is not None:
            object.__setattr__(self, "layers", int(n_layer))

    @property
    def attention_width(self) -> int:
        """heads x head_dim (d_model where the model did not say it)."""
        return self.attn_width or self.d_model

    @property
    def mlp_values(self) -> float:
        """The MLP's intermediate values a layer keeps per position for its backward, one per
        output of a kernel into or out of the intermediate width: mlp_params / (layers x d_model)
        (GPT-2: c_fc's output and GeLU's, 2 x 4d; a gated MLP: gate, up and their product, 3 x
        intermediate); 0 when unknown. A mixture of experts keeps those of the top_k experts a
        token runs, not of every expert."""
        if not (self.mlp_params and self.layers and self.d_model):
            return 0.0
        active = self.top_k / self.experts if self.experts else 1.0
        return active * self.mlp_params / (self.layers * self.d_model)

    @property
    def routing_values(self) -> float:
        """A mixture of experts' routing buffers a layer keeps per position beyond the experts' MLP
        values (`zerojax.models.moe.grouped_experts`): its top_k (token, expert) rows twice, sorted
        by expert (the grouped products' input) and the experts' outputs before they are weighted
        back (top_k x d_model each), and the router's logits and softmax (experts each); 0 for a
        dense model."""
        return 2.0 * self.top_k * self.d_model + 2.0 * self.experts if self.experts else 0.0

    @property
    def grouped_transient_values(self) -> float:
        """A mixture of experts' largest transient a position, once: XLA's rewrite of a grouped
        product (`jax.lax.ragged_dot`; its ragged-dot rewriter) into a dense one over every expert,
        experts x the gate-and-up width (2/3 of an expert's gated MLP values) for each of the
        top_k rows, three of them live in the backward (the product's, its gradient's and its
        input gradient's: fitted on CPU compiles of tiny shapes, the formula then 12% under to 18%
        over their peaks' difference from a dense twin; not checked on GPU); 0 for a dense model.
        Not there at the precisions grouped kernels run (`grouped_kernel_precisions`)."""
        if not (self.experts and self.mlp_params and self.layers and self.d_model):
            return 0.0
        gate_up = 2.0 / 3.0 * self.mlp_params / (self.layers * self.d_model * self.experts)
        return 3.0 * self.experts * self.top_k * gate_up

    @property
    def active_params(self) -> float:
        """The parameters one token runs through: params less the experts it does not choose."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (1.0 - self.top_k / self.experts)


ModelShape.n_layer = property(lambda self: self.layers, doc="`layers`, by its older (GPT-2) name")


def train_flops_per_token(shape: ModelShape, remat: str | None = None, tiled_mlp: bool = False) -> float:
    """Training FLOPs per token: 6N + 12·L·w·T (PaLM, appendix B; w the attention width, heads x
    head_dim, d for GPT-2), plus the recompute of `remat`: "full" / "offload" run every block's
    forward again (2·N_layers + 4·L·w·T), "dots" keeps the matmuls without batch dimensions and
    recomputes attention's two batched products (4·L·w·T); the save_* policies are models.gpt2's
    (and Llama's, which takes GPT-2's names), their saved q/k/v projection counted as GPT-2's 3·d².
    tiled_mlp (`Llama(mlp_tile=N)`): each MLP piece is checkpointed, so its backward reruns the
    MLP's forward once more, 2·N_mlp (`ModelShape.mlp_params`), on top of any remat's recompute
    (a remat that reruns the block runs the tiled forward, whose backward then reruns each piece)."""
    tile = 2.0 * shape.mlp_params if tiled_mlp else 0.0
    return tile + _remat_flops_per_token(shape, remat)


def _remat_flops_per_token(shape: ModelShape, remat) -> float:
    attn = shape.layers * shape.attention_width * shape.seq_len
    base = 6.0 * shape.active_params + 12.0 * attn  # a mixture of experts: the experts a token runs
    if remat in (None, "none"):
        return base
    if remat in ("full", "offload", True):
        return base + 2.0 * shape.layer_params + 4.0 * attn
    if segment_policy(remat) is not None:  # a segment rebuilt, then each of its layers again
        return base + 2.0 * (2.0 * shape.layer_params + 4.0 * attn)
    if remat == "dots":
        return base + 4.0 * attn
    if remat in _SAVED_BY_POLICY:
        # a full remat less what the policy keeps: the q/k/v projection's 2 x 3 d^2 per token and
        # layer (GPT-2's), and / or attention's own 4 T w (its inputs q, k, v are then recomputed or saved)
        qkv, attention_saved = _SAVED_BY_POLICY[remat]
        saved = 2.0 * qkv * shape.layers * shape.d_model ** 2
        return base + 2.0 * shape.layer_params - saved + (0.0 if attention_saved else 4.0 * attn)
    k = partial_dots_layers(remat)
    if k is not None and 2 <= k <= shape.layers - 2:
        # "dots_<k>": "dots" on k layers, "full" on the rest (each layer recomputes 1 / layers of it)
        return _remat_flops_per_token(shape, "dots") + (1 - k / shape.layers) * 2.0 * shape.layer_params
    raise ValueError(f"remat={remat!r}; choose one of {tuple(REMAT_RECOMPUTE)} or \"dots_<k>\" "
                     "(2 <= k <= layers - 2)")


def partial_dots_layers(remat) -> int | None:
    """k of models.gpt2's "dots_<k>" remat policy ("dots" on the first k layers), else None."""
    if isinstance(remat, str) and remat.startswith("dots_") and remat[5:].isdigit():
        return int(remat[5:])
    return None


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step per device, by what it waits on, added (no overlap:
    GPT-2 Large, bf16, remat, micro-batch 8, offload_optimizer ratio 0.25, 0.5 and 1 measured 37k,
    26k and 18k tokens/s on an H200; this sum predicts 37k, 27k and 17k)."""

    compute_s: float
    collective_s: float
    host_s: float
    tokens: int  # per device per optimizer step

    @property
    def step_s(self) -> float:
        return self.compute_s + self.collective_s + self.host_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else float("inf")


def tensor_parallel_bytes(shape: ModelShape, *, micro_batch: int, n_tensor: int, precision: str = "bf16",
                          remat: str | None = None) -> float:
    """Bytes one device sends per micro-batch for tensor parallelism with sequence parallelism
    (zerojax's Megatron layout, counted in tests/sharding/test_tensor_parallel.py's compiled step).

    Every collective moves the tensor group's residual stream, B = (micro_batch x n_tensor rows,
    DeepSpeed's batch rule) x T x d in the compute dtype, and a ring all-gather or reduce-scatter
    sends (t - 1) / t of it. Per layer: forward 2 all-gathers + 2 reduce-scatters; backward 4
    all-gathers (2 re-gathers for the weight gradients) + 2 reduce-scatters; a remat that reruns
    the forward adds its 4 again. Around the layers: the embedding's all-reduce (2 units), the LM
    head's gather and their transposes (3 units). The loss's reductions ([rows, T] numbers) are
    left out."""
    if n_tensor <= 1:
        return 0.0
    B = micro_batch * n_tensor * max(shape.seq_len, 1) * shape.d_model * PRECISION_BYTES[precision]
    reruns = 1 if remat in ("full", "offload", True) else 2 if segment_policy(remat) is not None else 0
    per_layer = 10 + 4 * reruns
    return (n_tensor - 1) / n_tensor * B * (per_layer * shape.layers + 5)


def _width(shape: ModelShape) -> float:
    """d_model for the efficiency term; where the model does not say it, read from a transformer
    block's ~12 d^2 parameters, else the width the fit was made at (FIT_D_MODEL)."""
    if shape.d_model:
        return shape.d_model
    if shape.layers and shape.layer_params:
        return math.sqrt(shape.layer_params / (12 * shape.layers))
    return float(FIT_D_MODEL)


def predict_step_time(shape: ModelShape, *, micro_batch: int, grad_accum: int = 1,
                      n_data: int = 1, stage: int = 0, precision: str = "bf16",
                      remat: str | None = None, offload_optimizer: bool = False,
                      offload_ratio: float = 1.0, offload_param: bool = False,
                      hardware: Hardware = H200, n_tensor: int = 1, tiled_mlp: bool = False) -> StepTime:
    """The step-time model (per device, one optimizer step of micro_batch x grad_accum rows).

    compute: tokens x (FLOPs a token without remat + recompute_weight x the recompute of remat
      and of a tiled MLP) / (ceiling x efficiency(micro-batch tokens x d_model)) (`Hardware`;
      FLOPs: train_flops_per_token).
    collectives (ring; each device sends (N-1)/N of the buffer): stage 0/1 all-reduce the fp32
      gradients once a step (stage 1 then all-gathers the new params); stage 2 reduce-scatters
      every micro-batch and all-gathers the new params; stage 3 gathers the params twice per
      micro-batch (forward, backward) and reduce-scatters the gradients.
    host: offload_optimizer streams the fp32 master + Adam moments (12 bytes a parameter) in
      and back out each step, for the offloaded `offload_ratio` of this device's shard;
      offload_param fetches the 16-bit params twice per micro-batch and sends their gradients
      back (with accumulation also reads them back and reads + writes the fp32 host accumulator,
      8 bytes a parameter, every micro-batch); remat "offload" writes each block's input to host and reads it back.
    n_tensor (tensor_parallel.autotp_size): each device holds 1 / n_tensor of the parameters (the
      replicated norms, biases and position embeddings, <1% of GPT-2, are not counted apart), so
      ZeRO's collectives and the offload move that share over the n_data data ranks; the
      activations' collectives are `tensor_parallel_bytes` per micro-batch. Compute per device
      is unchanged: a tensor group trains micro_batch x n_tensor rows on n_tensor devices.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; choose one of {tuple(PRECISION_BYTES)}")
    if micro_batch < 1 or grad_accum < 1 or n_data < 1 or n_tensor < 1:
        raise ValueError(f"{micro_batch=}, {grad_accum=}, {n_data=}, {n_tensor=}: each must be >= 1")
    T = max(shape.seq_len, 1)
    micro_tokens = micro_batch * T
    tokens = micro_tokens * grad_accum
    work = micro_tokens * _width(shape)
    eff = hardware.peak_efficiency * work / (work + hardware.half_efficiency_work)
    plain = train_flops_per_token(shape, None)
    flops = plain + hardware.recompute_weight * (train_flops_per_token(shape, remat, tiled_mlp) - plain)
    compute = tokens * flops / (hardware.ceiling(precision) * eff)

    P, pb, gb = shape.params / n_tensor, PRECISION_BYTES[precision], 4
    f = (n_data - 1) / n_data
    if stage in (0, 1):
        comm = 2 * f * P * gb + (f * P * pb if stage == 1 else 0)
    elif stage == 2:
        comm = grad_accum * f * P * gb + f * P * pb
    elif stage == 3:
        comm = grad_accum * (2 * f * P * pb + f * P * gb)
    else:
        raise ValueError(f"zero_optimization.stage={stage!r}; accepted: 0, 1, 2, 3")
    comm += grad_accum * tensor_parallel_bytes(shape, micro_batch=micro_batch, n_tensor=n_tensor,
                                               precision=precision, remat=remat)

    host = 0.0
    shard = P / n_data
    if offload_optimizer or offload_param:
        host += 2 * 12 * shard * (offload_ratio if offload_optimizer else 1.0)
    if offload_param:
        host += grad_accum * 3 * pb * shard
        if grad_accum > 1:  # each micro-batch's gradients read back and added into the host accumulator
            host += grad_accum * (pb + 2 * 4) * shard
    if remat == "offload" or (segment_policy(remat) or ("",))[0] == "offload_segments":
        inputs = shape.layers if remat == "offload" else kept_inputs(remat, shape.layers)[1]
        host += 2 * grad_accum * inputs * micro_tokens * shape.d_model * pb
    return StepTime(compute, comm / hardware.interconnect_bytes_per_s,
                    host / hardware.host_bytes_per_s, tokens)


# optimizer state bytes per parameter (fp32), by DeepSpeed's optimizer.type, for the floor below
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lion": 4, "adagrad": 4, "lamb": 8}


def model_state_floor(params: int, *, stage: int, n_data: int, precision: str,
                      optimizer: str | None = "adamw", offload_optimizer: bool = False,
                      offload_ratio: float = 1.0, offload_param: bool = False, n_tensor: int = 1,
                      master_split: bool = False, adam_mu_dtype: str | None = None) -> int:
    """Per-device bytes that the step's arguments hold at least: the compute params (fp32 runs
    keep none apart from the master unless it is offloaded), the fp32 master and the optimizer
    state, each divided by the data-parallel size where the stage partitions it and without what
    offload moves to the host. A lower bound of the compiled peak (gradients, activations and temporaries come on
    top), so a choice whose floor exceeds the budget is pruned without compiling it. Under tensor
    parallelism each device holds params / n_tensor before ZeRO divides by n_data (the few
    replicated leaves -- norms, biases, wpe -- are not counted apart: the floor stays a floor
    only up to them, <1% of GPT-2). EngineOptions that shrink the state: split_master="on" (the
    device master as an int16 remainder beside the bf16 params: 2 bytes, not 4; only where it
    applies, `planner.device_split`) and adam_mu_dtype="bfloat16" (Adam's first moment in 2 bytes)."""
    params = params / n_tensor
    kind = "".join(c for c in (optimizer or "").lower() if c.isalnum())
    opt = OPTIMIZER_STATE_BYTES.get(kind, 0)
    if adam_mu_dtype == "bfloat16" and kind in ("adam", "adamw"):
        opt -= 2
    master = ((2 if master_split else 4) + opt) * params / (n_data if stage >= 1 else 1)
    if offload_optimizer or offload_param:
        master *= 1.0 - (offload_ratio if offload_optimizer else 1.0)
    compute = 0.0  # fp32 without offload: the master is the compute copy
    if not offload_param and (precision != "fp32" or offload_optimizer):
        compute = PRECISION_BYTES[precision] * params / (n_data if stage == 3 else 1)
    return int(master + compute)


def model_state_bytes(params: int, *, stage: int, n_data: int, precision: str, n_tensor: int = 1,
                      **floor_kw) -> int:
    """`model_state_floor` plus the fp32 gradient accumulator (partitioned from stage 2; in host
    memory with offload_param): the planner's estimate of how a choice's model states differ from a
    compiled neighbour's."""
    grads = 0 if floor_kw.get("offload_param") else 4 * params / n_tensor / (n_data if stage >= 2 else 1)
    return model_state_floor(params, stage=stage, n_data=n_data, precision=precision,
                             n_tensor=n_tensor, **floor_kw) + int(grads)


def expert_split_states(states, shape: ModelShape, params: float, *, n_data: int, n_expert: int = 1, **kw) -> int:
    """states(params, n_data=..., **kw) (`model_state_bytes` or `model_state_floor`) with expert
    parallelism (EngineOptions.ep_size = n_expert > 1): a mixture of experts' expert weights
    (`ModelShape.expert_params`) split 1 / n_expert at every stage and ZeRO-partitioned over the
    n_data / n_expert groups only, the other parameters as before."""
    experts = shape.expert_params if n_expert > 1 else 0
    out = states(int(params - experts), n_data=n_data, **kw)
    if experts:
        out += states(int(experts / n_expert), n_data=max(n_data // n_expert, 1), **kw)
    return out


def activation_bytes_per_layer(*, seq_len: int, rows: int, d_model: int, heads: int | None = None, n_tensor: int = 1,
                               sequence_parallel: bool = True, flash_attention: bool = True,
                               remat: str | None = None, n_head: int | None = None, mlp_values: float = 0.0,
                               tiled_mlp: bool = False, routing_values: float = 0.0) -> int:
    """Activation bytes one transformer layer saves for its backward pass, per device, 16-bit,
    after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", table 2): s·b·h·(34 + 5·a·s/h) without parallelism; tensor parallelism divides the
    24 of it inside the sublayers by t, sequence parallelism the other 10 too. `rows` is the
    micro-batch a tensor group trains (DeepSpeed's batch rule: micro_batch x n_tensor). Flash
    attention (cuDNN) keeps no a·s² score matrices, so the 5·a·s/h term is dropped; a full remat
    keeps only the layer's input (2·s·b·h, split by t under sequence parallelism). Dropout's masks
    are in the paper's 34; zerojax trains without dropout, so this errs high by 5·s·b·h. `heads`
    (the paper's a; `n_head=` is its older, GPT-2 name) is needed without flash attention only.
    The paper's 34 holds its 4h MLP's two intermediate values a position, 16·s·b·h of the 24
    inside; mlp_values (`ModelShape.mlp_values`, 0: the paper's 8h) puts the model's own count
    there (2 bytes each; a gated MLP keeps 3 x intermediate). tiled_mlp (`Llama(mlp_tile=N)`):
    none of them is kept, each piece's being rebuilt in the backward (its input, the paper's
    2·s·b·h of the MLP's input, is kept either way); the piece being rebuilt is not counted here
    (`mesh_peak_bytes` adds it once). routing_values (`ModelShape.routing_values`): a mixture of
    experts' routing buffers a position, 2 bytes each, inside the sublayer (the experts are whole on
    each tensor rank, so t does not split them)."""
    heads = heads if heads is not None else n_head
    if not flash_attention and not heads:
        raise ValueError("activation_bytes_per_layer: without flash attention the score matrices need heads=")
    s, b, h, a, t = seq_len, rows, d_model, heads, n_tensor
    if remat in ("full", "offload", True) or segment_policy(remat) is not None:  # two-level: `mesh_peak_bytes`
        return int(2 * s * b * h / (t if sequence_parallel else 1))
    mlp = 0.0 if tiled_mlp else 2 * (mlp_values or 8 * h) / h
    inside = 24 - 16 + mlp + (0 if flash_attention else 5 * a * s / h)
    outside = 10
    return int(s * b * (h * (inside / t + outside / (t if sequence_parallel else 1)) + 2 * routing_values))


# ---------------------------------------------------------------------------------------------
# 3. Mesh shapes: data x tensor x pipe (the planner's mesh search, `zerojax.planning.mesh_search`)

# H200's HBM3e bandwidth (datasheet, 4.8 TB/s): what the pipeline's per-iteration weight-gradient sums
# stream. An assumption, not measured.
HBM_BYTES_PER_S = 4.8e12


def pipeline_bubble(stages: int, microbatches: int) -> float:
    """Share of a pipelined step's iterations a stage idles: (S - 1) / (M + S - 1) (GPipe's bubble,
    `zerojax.sharding.pipeline.PipelineSchedule.bubble_fraction` with one repeat)."""
    return (stages - 1) / (microbatches + stages - 1) if stages > 1 else 0.0


def _per_stage_params(shape: ModelShape, n_pipe: int) -> float:
    """Parameters a pipeline stage holds: its 1 / n_pipe of the stacked layers and the rest whole
    (embeddings, final norm: the head and loss run on every stage's devices, on its rows)."""
    return shape.params - shape.layer_params + shape.layer_params / n_pipe


@dataclasses.dataclass(frozen=True)
class MeshStepTime(StepTime):
    """`StepTime` for a data x tensor x pipe mesh: compute (useful FLOPs), collectives (ZeRO over
    "data", tensor parallelism's per-layer gathers / scatters) and host copies, plus the pipeline's
    bubble (stages idle (S - 1) of M + S - 1 iterations) and per-iteration costs (hidden states sent
    stage to stage, weight-gradient sums). Added: no overlap."""

    bubble_s: float = 0.0
    pipeline_s: float = 0.0

    @property
    def step_s(self) -> float:
        return super().step_s + self.bubble_s + self.pipeline_s


def predict_mesh_step_time(shape: ModelShape, *, micro_batch: int, grad_accum: int = 1, n_data: int = 1,
                           n_tensor: int = 1, n_pipe: int = 1, stage: int = 0, precision: str = "bf16",
                           remat: str | None = None, checkpoint_interval: int = 0,
                           hardware: Hardware = H200, hbm_bytes_per_s: float = HBM_BYTES_PER_S,
                           tiled_mlp: bool = False) -> MeshStepTime:
    """Seconds per optimizer step on a data x tensor x pipe mesh, per device.

    n_data: the "data" axis (ZeRO partitions over it); n_tensor: tensor_parallel.autotp_size;
    n_pipe: pipeline.stages, whose micro-batches are the grad_accum ones (DeepSpeed's meaning of
    gradient_accumulation_steps under a pipeline). Without a pipeline this is `predict_step_time`.
    With one, each device runs 1 / n_pipe of the FLOPs (its stage's layers; the head and loss are
    split over the stages' devices too) at the micro-batch's efficiency, idles the bubble
    (S - 1) / (M + S - 1) of the M + S - 1 iterations, runs ZeRO's and tensor parallelism's
    collectives for its stage's share, and pays per iteration: the hidden state sent forward and its
    gradient sent back (micro_batch x T x d in the compute dtype, each way, over the interconnect)
    and the stage's fp32 weight-gradient sum (read the sum, read the iteration's gradient, write the
    sum: 12 bytes a parameter of its tensor shard, at HBM bandwidth). checkpoint_interval > 0
    (pipeline.activation_checkpoint_interval) recomputes every layer's forward, as a full remat.
    tiled_mlp: the MLP's forward rerun once more (`train_flops_per_token`).
    """
    base_remat = "full" if n_pipe > 1 and checkpoint_interval > 0 else remat
    base = predict_step_time(shape, micro_batch=micro_batch, grad_accum=grad_accum, n_data=n_data,
                             stage=stage, precision=precision, remat=base_remat, hardware=hardware,
                             n_tensor=n_tensor, tiled_mlp=tiled_mlp)
    if n_pipe <= 1:
        return MeshStepTime(base.compute_s, base.collective_s, base.host_s, base.tokens)
    if shape.layers and shape.layers % n_pipe:
        raise ValueError(f"pipeline.stages={n_pipe} does not divide the model's {shape.layers} layers")
    compute = base.compute_s / n_pipe
    iterations = grad_accum + n_pipe - 1
    bubble = compute * (n_pipe - 1) / grad_accum
    stage_share = _per_stage_params(shape, n_pipe) / shape.params if shape.params else 1.0
    hidden = micro_batch * max(shape.seq_len, 1) * shape.d_model * PRECISION_BYTES[precision]
    grad_sum = 12 * shape.layer_params / (n_pipe * n_tensor)
    per_iteration = 2 * hidden / hardware.interconnect_bytes_per_s + grad_sum / hbm_bytes_per_s
    return MeshStepTime(compute, base.collective_s * stage_share, base.host_s * stage_share, base.tokens / n_pipe,
                        bubble_s=bubble, pipeline_s=iterations * per_iteration)


# What zerojax's compiled GPT-2 step keeps per layer over Korthikanti et al.'s 34·s·b·h bytes (and
# XLA's temporaries, which the formula does not count apart): 2.07, from one calibration point,
# GPT-2 Large, bf16, no remat, micro-batch 8, ZeRO-2 over 2 x H200, compiled and measured 35.07 GiB
# (states 7.21 + logits 3.07 + 11.95 x 2.07 of formula activations). Checked on the other rows of that
# run (compiled and measured per rank): ZeRO-3 5.5% low, ZeRO-1 8 x 2 and TP 2 within 1%, pipe 2 13-16% low
# (with and without per-iteration checkpoints). Not checked: remat, other models, other devices.
ACTIVATION_FACTOR = 2.07


def mesh_peak_bytes(shape: ModelShape, *, heads: int, vocab: int, micro_batch: int, grad_accum: int = 1,
                    n_data: int = 1, n_tensor: int = 1, n_pipe: int = 1, stage: int = 0,
                    precision: str = "bf16", remat: str | None = None, checkpoint_interval: int = 0,
                    optimizer: str | None = "adamw", flash_attention: bool = True,
                    activation_factor: float = ACTIVATION_FACTOR, master_split: bool = False,
                    adam_mu_dtype: str | None = None, mlp_tile: int | None = None, n_expert: int = 1) -> dict:
    """Per-device bytes of one step on a data x tensor x pipe mesh, by formula (what the planner's
    mesh search uses where it does not compile): {"states", "activations", "logits", "total"}.

    states: `model_state_bytes` for the stage's parameters (layers / n_pipe, the rest whole) split
      1 / n_tensor, ZeRO over n_data (master_split / adam_mu_dtype: the EngineOptions that shrink them);
      n_expert (EngineOptions.ep_size): a mixture of experts' expert weights split 1 / n_expert at
      every stage, ZeRO then over the n_data / n_expert groups.
    activations: `activation_bytes_per_layer` (Korthikanti et al.; 16-bit, scaled to the compute
      dtype) for the micro-batch a tensor group trains (micro_batch x n_tensor rows), times the
      device's layers. Unpipelined, one micro-batch is live at a time (the accumulation scan); a full
      remat keeps each layer's input and one layer's activations while it is recomputed; two-level
      segments of k keep ceil(layers / k) + k inputs (k under "offload_segments"). Pipelined,
      every iteration's activations are kept until the backward pass (M + S - 1 iterations), or
      with checkpoint_interval N only each group of N layers' input per iteration, plus one group's
      activations. The MLP's intermediate values are the model's (`ModelShape.mlp_values`); with
      mlp_tile (positions per piece of a tiled MLP) no layer keeps them, and one piece's (mlp_tile
      positions of the micro-batch) are live while the backward rebuilds it. Times
      `activation_factor` (ACTIVATION_FACTOR: calibrated on one compiled step; 1.0 gives the
      paper's count).
    logits: the fp32 logits and their gradient, vocab / n_tensor wide (vocab-parallel head), for one
      micro-batch's rows.
    The compiled step is the measure (`zerojax.planning.planner.step_memory`); this is its estimate.
    """
    p_stage = _per_stage_params(shape, n_pipe)
    kw = dict(stage=stage, precision=precision, n_tensor=n_tensor, optimizer=optimizer, master_split=master_split,
              adam_mu_dtype=adam_mu_dtype)
    states = expert_split_states(model_state_bytes, shape, p_stage, n_data=n_data, n_expert=n_expert, **kw)
    T, d = max(shape.seq_len, 1), shape.d_model
    scale = PRECISION_BYTES[precision] / 2
    layers = shape.layers // n_pipe if shape.layers else 0

    def layer(remat_):
        return scale * activation_bytes_per_layer(seq_len=T, rows=micro_batch * n_tensor, d_model=d,
                                                  heads=heads, n_tensor=n_tensor,
                                                  flash_attention=flash_attention, remat=remat_,
                                                  mlp_values=shape.mlp_values, tiled_mlp=mlp_tile is not None,
                                                  routing_values=shape.routing_values)

    full, kept = layer(None), layer(remat)
    if n_pipe <= 1 and segment_policy(remat) is not None and layers:
        # two-level: the segment inputs kept on the device and the rebuilt segment's layer inputs
        acts = kept_inputs(remat, layers)[0] * kept + full
    elif n_pipe <= 1:
        acts = layers * kept + (full if kept < full else 0)
    elif checkpoint_interval > 0:
        group = min(checkpoint_interval, layers)
        acts = (grad_accum + n_pipe - 1) * (layers // group) * layer("full") + group * full
    else:
        acts = (grad_accum + n_pipe - 1) * layers * kept
    if mlp_tile is not None:  # the piece the backward rebuilds (the tensor ranks split its width)
        acts += scale * 2 * micro_batch * min(mlp_tile, T) * (shape.mlp_values or 8 * d)
    acts *= activation_factor
    # a mixture of experts: one layer's grouped product as XLA runs it, dense over the experts (a
    # transient of its own, not the saved activations the factor was calibrated on); none where
    # grouped kernels take this precision's operands
    if precision not in shape.grouped_kernel_precisions:
        acts += scale * 2 * micro_batch * T * shape.grouped_transient_values
    logits = 2 * 4 * micro_batch * n_tensor * T * vocab / n_tensor
    total = states + acts + logits
    return {"states": int(states), "activations": int(acts), "logits": int(logits), "total": int(total)}
