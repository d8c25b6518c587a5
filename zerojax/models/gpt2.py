"""GPT-2 in Flax NNX, numerically Hugging Face's `GPT2LMHeadModel` (eval mode, no dropout).

Learned positions, pre-LayerNorm blocks, gelu_new (tanh approximation), input and output
embeddings tied, HF's init. The `n_layer` blocks are one module whose parameters carry a leading
"layers" axis; the forward pass runs them with `jax.lax.scan`, so compile time does not grow
with depth and a pipeline stage is later just a slice of that axis.

Logical axis names (the `out_sharding` metadata of every `nnx.Param`, read with
`nnx.get_partition_spec(nnx.state(model))`):

  "vocab"     token-embedding rows (wte: padded vocab x embed), also the logits' last dim
  "pos"       position-embedding rows (wpe: n_positions x embed)
  "embed"     the model width d
  "layers"    the stacked-block axis (leading axis of every per-block parameter)
  "qkv"       size 3: which of query / key / value (c_attn keeps HF's fused [q|k|v] order)
  "heads"     attention heads
  "head_dim"  per-head width d / heads
  "mlp"       the MLP's hidden width (4d)

Parameters carry names only (`eager_sharding=False`): building the model never places anything;
the engine maps names to mesh axes and places the state itself.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# the layer stack's runner and its generic remat policies, shared with the Llama family and the
# engine's stand-ins for other models' stacks (plain JAX, nothing of the runtime)
from zerojax._jax_compat import CUDNN_ATTENTION_FORWARD  # noqa: F401 (read here by the tests too)
from zerojax.models import layer_stack
from zerojax.models.attention import DEFAULT_BLOCK, causal_attention, check_block
from zerojax.models.flash_attention import flash_supported
from zerojax.models.layer_stack import LAYER_INPUT

# activation names tagged with `checkpoint_name` inside each block: LAYER_INPUT (the block's
# input, which the "offload" remat policy moves to host memory instead of keeping it on the
# device) and the qkv projection [B, T, 3, H, Dh] and the attention output [B, T, H, Dh],
# which the "save_*" policies keep so that the backward pass does not recompute them
QKV_PROJ, ATTENTION_OUT = "qkv_proj", "attention_out"
# and the residual stream after the attention half [B, T, d] (the MLP half's input, before ln_2)
ATTENTION_RESIDUAL = "attention_residual"
# what each policy keeps per block for the backward pass (everything else is recomputed):
#   "full": the block input only; "dots": every matmul without batch dims (qkv, both output
#   projections, the MLP's up projection: 9 x d per token, bf16); "save_qkv": the qkv projection
#   (3 x d); "save_attention": the attention output (1 x d; with cuDNN's attention also its softmax
#   statistics, so the attention is not run again); "save_qkv_attention": both (4 x d);
#   "save_attention_block": both and the residual after the attention half, so that only the MLP
#   half is recomputed (5 x d);
#   "offload": the block input, in pinned host memory. (GPT-2 Large at micro 8 x 1024: d values
#   per token per layer = 0.70 GiB over its 36 layers in bf16.)
#   "segments" / "offload_segments" (and "<name>_<k>"): two-level, every k-th block input kept (on the
#   device / in host memory), a segment's k block inputs while it is rebuilt (`layer_stack.run_segments`).
REMAT_POLICIES = (None, "full", "dots", "save_qkv", "save_attention", "save_qkv_attention",
                  "save_attention_block", "offload") + layer_stack.SEGMENT_POLICIES
# and "dots_<k>" (k an int, 2 <= k <= n_layer - 2): "dots" on the first k layers, "full" on the rest:
# between the two in memory (k x dots' extra per layer), so that the planner can pick the k that
# fits a budget. Two layer scans, one per policy (`split_remat_policy`).
PARTIAL_DOTS = "dots_"
_SAVED_NAMES = {"save_qkv": (QKV_PROJ,), "save_attention": (ATTENTION_OUT,),
                "save_qkv_attention": (QKV_PROJ, ATTENTION_OUT),
                "save_attention_block": (QKV_PROJ, ATTENTION_OUT, ATTENTION_RESIDUAL)}
# None: chosen per call (`resolve_attention`); "blockwise": `zerojax.models.attention`'s flash
# attention in plain JAX (no [T, T] scores, any backend); "flash": `zerojax.models.flash_attention`'s
# fused Pallas kernel (GPU; Pallas' interpreter elsewhere)
ATTENTION_IMPLS = (None, "xla", "cudnn", "blockwise", "flash")
# logical names of the residual stream [B, T, d] (activations' names, for `activation_sharding`)
RESIDUAL = ("batch", "seq", "embed")
# [B, T, d] with every position on every tensor rank: the LM head's input (sequence parallelism
# gathers it there) and the embedding's output (a vocab-split lookup's partial sums are added
# whole, Megatron's VocabParallelEmbedding; pinned split at once, GSPMD gathered the whole wte)
SEQ_WHOLE = ("batch", None, "embed")
# the logits, split on the vocabulary where the embedding is (vocab parallelism)
LOGITS = ("batch", None, "vocab")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None = 4 * n_embd (every released GPT-2)
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    # Megatron-LM's name and default: the embedding / LM head hold padded_vocab_size rows, a
    # multiple of this, so the logits gemm is aligned (vocab 50257 ran as an fp32 align-1 cuBLAS
    # kernel, 8 ms of GPT-2 Large's step on an H200) and the vocabulary splits over a tensor axis.
    # The extra rows start at zero, their logits are masked out of the softmax (they get no
    # gradient and stay zero), and vocab_size stays the real vocabulary: Hugging Face import /
    # export, num_params and FLOPs see 50257. 1 keeps the exact size.
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"{self.n_embd=} must be divisible by {self.n_head=}")
        m = self.make_vocab_size_divisible_by
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"GPT2Config.make_vocab_size_divisible_by={m!r}: an int >= 1 (1 = no padding)")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of wte: vocab_size rounded up to a multiple of make_vocab_size_divisible_by."""
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def named(cls, size: str, **overrides) -> GPT2Config:
        """"tiny" (tests; byte vocab 256), "small" 124M, "medium" 355M, "large" 774M, "xl" 1.5B."""
        sizes = {
            "tiny": dict(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4),
            "small": dict(n_embd=768, n_layer=12, n_head=12),
            "medium": dict(n_embd=1024, n_layer=24, n_head=16),
            "large": dict(n_embd=1280, n_layer=36, n_head=20),
            "xl": dict(n_embd=1600, n_layer=48, n_head=25),
        }
        key = size.lower().removeprefix("gpt2-").removeprefix("gpt2")
        key = key.lstrip("-_") or "small"  # "gpt2" is the 124M model
        if key not in sizes:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {sorted(sizes)}")
        return cls(**{**sizes[key], **overrides})


def num_params(config: GPT2Config) -> int:
    """All parameters, the tied wte counted once (HF's `num_parameters()`: 124,439,808 for small).

    The real vocabulary's rows only: the padding rows (`padded_vocab_size`) are zeros that never
    train, and counting them would move FLOPs / MFU with a layout choice."""
    d, m, L = config.n_embd, config.mlp_dim, config.n_layer
    per_block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
    return config.vocab_size * d + config.n_positions * d + L * per_block + 2 * d


def flops_per_token(config: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12*L*d*T (PaLM's appendix B; benchmarks/RESULTS.md).

    N is *all* parameters (embeddings included, wte once): that is the definition that gives
    the anchors' 5.21 GFLOP for GPT-2 Large at T=1024 (non-embedding N would give 4.82).
    """
    return 6.0 * num_params(config) + 12.0 * config.n_layer * config.n_embd * seq_len


# --------------------------------------------------------------------------- parameters


def _param(value, names):
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class Linear(nnx.Module):
    def __init__(self, key, kernel_shape, kernel_names, bias_shape, bias_names, std, dtype):
        self.kernel = _param(std * jax.random.normal(key, kernel_shape, dtype), kernel_names)
        self.bias = _param(jnp.zeros(bias_shape, dtype), bias_names)


class LayerNorm(nnx.Module):
    def __init__(self, prefix_shape, prefix_names, d, dtype):
        self.scale = _param(jnp.ones((*prefix_shape, d), dtype), (*prefix_names, "embed"))
        self.bias = _param(jnp.zeros((*prefix_shape, d), dtype), (*prefix_names, "embed"))


class Attention(nnx.Module):
    def __init__(self, config: GPT2Config, rngs: nnx.Rngs, dtype):
        L, d, H, Dh = config.n_layer, config.n_embd, config.n_head, config.head_dim
        std = config.initializer_range
        self.c_attn = Linear(rngs.params(), (L, d, 3, H, Dh), ("layers", "embed", "qkv", "heads", "head_dim"),
                             (L, 3, H, Dh), ("layers", "qkv", "heads", "head_dim"), std, dtype)
        self.c_proj = Linear(rngs.params(), (L, H, Dh, d), ("layers", "heads", "head_dim", "embed"),
                             (L, d), ("layers", "embed"), std / math.sqrt(2 * L), dtype)


class MLP(nnx.Module):
    def __init__(self, config: GPT2Config, rngs: nnx.Rngs, dtype):
        L, d, m = config.n_layer, config.n_embd, config.mlp_dim
        std = config.initializer_range
        self.c_fc = Linear(rngs.params(), (L, d, m), ("layers", "embed", "mlp"),
                           (L, m), ("layers", "mlp"), std, dtype)
        self.c_proj = Linear(rngs.params(), (L, m, d), ("layers", "mlp", "embed"),
                             (L, d), ("layers", "embed"), std / math.sqrt(2 * L), dtype)


class Blocks(nnx.Module):
    """All n_layer transformer blocks, each parameter stacked on a leading "layers" axis."""

    def __init__(self, config: GPT2Config, rngs: nnx.Rngs, dtype):
        L, d = config.n_layer, config.n_embd
        self.ln_1 = LayerNorm((L,), ("layers",), d, dtype)
        self.attn = Attention(config, rngs, dtype)
        self.ln_2 = LayerNorm((L,), ("layers",), d, dtype)
        self.mlp = MLP(config, rngs, dtype)


# --------------------------------------------------------------------------- forward


@jax.custom_vjp
def lm_head(x, w):
    """x [B, T, d] @ w [vocab, d].T -> fp32 logits (the operands' dtype in, fp32 accumulation out).

    The backward pass runs in the operands' dtype too. JAX's own transpose of this dot multiplies
    the fp32 cotangent by the bf16 operands, so XLA upcasts both: on an H200 the two backward
    gemms of GPT-2 Large's head (8 x 1024 x 50257 x 1280 each) ran as an fp32/TF32 cuBLAS kernel
    (8.0 ms) and a gemm fusion (7.1 ms) of a 134 ms step (an XLA profile of one step).
    Here the cotangent is rounded to the operands' dtype first, as every other activation
    gradient of a bf16 model already is; in fp32 nothing changes (the same three dots)."""
    return jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)


def _lm_head_fwd(x, w):
    return lm_head(x, w), (x, w)


def _lm_head_bwd(res, ct):
    x, w = res
    ct = ct.astype(x.dtype)
    dx = jnp.einsum("btv,vd->btd", ct, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("btv,btd->vd", ct, x, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


lm_head.defvjp(_lm_head_fwd, _lm_head_bwd)


def decode_head(x, w):
    """x [B, T, d] @ w [vocab, d].T in the operands' dtype, then fp32: the LM head as transformers'
    generate runs it (its lm_head in the model's dtype, the logits upcast for sampling). For the
    KV-cache decoder's one-row product: with `lm_head`'s fp32 product XLA converted the whole head
    to fp32 before each decode step's gemv (Llama-3.1-8B's compiled decode program on an H100: a
    2.1 GB fp32 copy written and read each token beside the 1.05 GB bf16 head)."""
    return jnp.einsum("btd,vd->btv", x, w).astype(jnp.float32)


def _layer_norm(x, scale, bias, eps, dtype):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)


def _gelu_new_value(x):
    return jax.nn.gelu(x, approximate=True)  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


@jax.custom_vjp
def gelu_new(x):
    """Hugging Face's gelu_new (the tanh approximation) whose backward keeps only its input.

    Why not plain `jax.nn.gelu`: XLA's cuBLASLt rewriter folds bias + exactly this tanh form into
    the epilogue of the gemm that produces x (BIAS_GELU; BIAS_GELU_AUX when x is also kept),
    which saves the separate element-wise passes over the [tokens, 4d] activation, but only
    where nothing else reads the tanh. Autodiff's derivative reads it, so under remat the
    recomputed forward never matched. Here the backward recomputes the tanh from x, spelled
    differently (x (c + c a x^2) for c (x + a x^3)) so that XLA's CSE does not merge it back
    into the forward's (in fp32 for 16-bit inputs)."""
    return _gelu_new_value(x)


def _gelu_new_fwd(x):
    return _gelu_new_value(x), x


def _gelu_new_bwd(x, g):
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    wide = jnp.promote_types(x.dtype, jnp.float32)  # bf16 / fp16 computed in fp32, fp64 kept
    xf = x.astype(wide)
    x2 = xf * xf
    t = jnp.tanh(xf * (c + (c * a) * x2))
    slope = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * (c + (3.0 * c * a) * x2)
    return ((g.astype(wide) * slope).astype(g.dtype),)


gelu_new.defvjp(_gelu_new_fwd, _gelu_new_bwd)


def unconstrained(x, names):
    return x


def plain_linear(eq, h, entry, dtype):
    """A projection: `h` contracted with `entry["kernel"]` by the einsum `eq`, in `dtype` (its bias
    is added by the block). An adapter (`GPT2.adapter`, e.g. `zerojax.lora`'s) replaces it to read
    a quantized kernel or add its terms."""
    return jnp.einsum(eq, h, entry["kernel"].astype(dtype))


def attention_inputs(x, p, *, eps, dtype, constrain=unconstrained, linear=plain_linear):
    """One block's q, k, v [B, T, H, Dh] from its input x [B, T, d] (ln_1, the fused projection +
    bias). Apart from the attention so that the KV-cache decoder (`zerojax.generation`) runs the
    same code as training."""
    attn = p["attn"]
    h = _layer_norm(x, p["ln_1"]["scale"], p["ln_1"]["bias"], eps, dtype)
    qkv = linear("btd,dcnh->btcnh", h, attn["c_attn"], dtype) + attn["c_attn"]["bias"].astype(dtype)
    qkv = checkpoint_name(constrain(qkv, ("batch", "seq", "qkv", "heads", "head_dim")), QKV_PROJ)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def attention_output_and_mlp(x, o, p, *, eps, dtype, constrain=unconstrained, linear=plain_linear):
    """The rest of a block after the attention: o [B, T, H, Dh] through c_proj into the residual
    x [B, T, d], then the MLP half (shared by training's `_block` and the KV-cache decoder)."""
    c = lambda a: a.astype(dtype)  # noqa: E731
    attn, mlp = p["attn"], p["mlp"]
    x = x + constrain(linear("btnh,nhd->btd", o, attn["c_proj"], dtype), RESIDUAL)
    x = checkpoint_name(x + c(attn["c_proj"]["bias"]), ATTENTION_RESIDUAL)

    h = _layer_norm(x, p["ln_2"]["scale"], p["ln_2"]["bias"], eps, dtype)
    h = linear("btd,dm->btm", h, mlp["c_fc"], dtype) + c(mlp["c_fc"]["bias"])
    h = constrain(gelu_new(h), ("batch", "seq", "mlp"))
    x = x + constrain(linear("btm,md->btd", h, mlp["c_proj"], dtype), RESIDUAL)
    return x + c(mlp["c_proj"]["bias"])


def _block(x, p, *, eps, dtype, attention_impl, constrain=unconstrained, linear=plain_linear,
           attention_block=DEFAULT_BLOCK):
    """One pre-LN block on [B, T, d] activations; p holds this layer's slice of `Blocks`.

    `constrain(x, logical names)` is the trainer's activation hook (tensor parallelism pins
    heads / mlp to the tensor axis and the residual stream whole; identity by default);
    `linear(eq, h, entry, dtype)` computes each of the four projections (default: the einsum)."""
    x = checkpoint_name(constrain(x, RESIDUAL), LAYER_INPUT)
    q, k, v = attention_inputs(x, p, eps=eps, dtype=dtype, constrain=constrain, linear=linear)
    # softmax is fp32 inside both implementations (XLA: fp32 logits; cuDNN: fp32 accumulators)
    o = causal_attention(q, k, v, impl=attention_impl, block=attention_block)
    o = constrain(o, ("batch", "seq", "heads", "head_dim"))
    if attention_impl != "cudnn":  # cuDNN's: the save_*attention policies keep its forward's outputs
        o = checkpoint_name(o, ATTENTION_OUT)  # (a name here too would keep the output twice)
    return attention_output_and_mlp(x, o, p, eps=eps, dtype=dtype, constrain=constrain, linear=linear)


def dots_layers(name) -> int | None:
    """k of a "dots_<k>" remat policy name, else None (any other name, or not a string)."""
    if isinstance(name, str) and name.startswith(PARTIAL_DOTS) and name[len(PARTIAL_DOTS):].isdigit():
        return int(name[len(PARTIAL_DOTS):])
    return None


def split_remat_policy(name, n_layer: int):
    """[(policy, layers), ...] in layer order: "dots_<k>" -> [("dots", k), ("full", n_layer - k)];
    any other policy -> [(name, n_layer)]. Raises ValueError for k outside 2 .. n_layer - 2.

    Each scan needs two layers or more: XLA inlines a one-iteration loop, and the recompute of
    a remat outside a loop is free to be scheduled early, i.e. not to save memory (on CPU, three
    one-layer "full" scans held 43 MB where one scan held 15 MB and no remat 51 MB)."""
    k = dots_layers(name)
    if k is None:
        return [(name, n_layer)]
    if not 2 <= k <= n_layer - 2:
        allowed = (f"k must be 2 .. {n_layer - 2}" if n_layer >= 4 else
                   f"a model of {n_layer} layers has no such split (it needs 4 layers or more)")
        raise ValueError(f"remat_policy={name!r}: k={k} layers of {n_layer} with \"dots\" (the rest \"full\", "
                         f"each part two layers or more); {allowed} (\"dots\" or \"full\": all layers one way)")
    return [("dots", k), ("full", n_layer - k)]




def check_remat_policy(name, n_layer: int) -> None:
    """Raises ValueError, when a model is built, for a remat option name its layer stack would
    refuse when traced: a two-level name whose k does not fit `n_layer`, an unknown name, a
    "dots_<k>" outside its range."""
    if layer_stack.segment_policy(name) is not None:
        layer_stack.segment_length(name, n_layer)
        return
    for piece, _ in split_remat_policy(name, n_layer):
        remat_policy_fn(piece)


def _saves_cudnn_attention_forward(prim, *_, **__) -> bool:
    return prim.name == CUDNN_ATTENTION_FORWARD


def remat_policy_fn(name):
    """The `jax.checkpoint` policy for a remat option name (None = no remat; "dots_<k>" is two
    policies, `split_remat_policy`): the generic ones (`layer_stack.remat_policy`: "full",
    "dots", "offload") and GPT-2's "save_*", which keep the activations its blocks tag."""
    cp = jax.checkpoint_policies
    if name in _SAVED_NAMES:
        names = cp.save_only_these_names(*_SAVED_NAMES[name])
        if ATTENTION_OUT not in _SAVED_NAMES[name]:
            return names
        # cuDNN's flash attention is a custom VJP whose backward needs the forward's output AND its
        # softmax statistics (fp32, [B, H, T]); a name on the output saves only the output, so the
        # backward would run the whole attention forward again for the statistics. Saving the
        # forward primitive's outputs keeps both (+4 bytes a head per token): measured on GPT-2 Large
        # (benchmarks/RESULTS.md). The XLA path has no such primitive; its output is saved by name.
        return cp.save_from_both_policies(names, _saves_cudnn_attention_forward)
    policy = layer_stack.remat_policy(name)
    if policy is None:
        raise ValueError(f"remat_policy={name!r}; choose one of {REMAT_POLICIES}, \"dots_<k>\" (k layers \"dots\", "
                         "the rest \"full\") or \"segments_<k>\" / \"offload_segments_<k>\" (k layers a segment)")
    return policy


def resolve_attention(impl, dtype, head_dim, *, packed: bool = False, heads: int = 1, kv_heads: int = 1):
    """None: cuDNN flash attention on GPU where it applies (bf16/fp16, head_dim <= 128 and a
    multiple of 8, rows not packed: its public call takes no segment ids); packed rows take the
    fused Pallas kernel ("flash") on one GPU where its shapes apply, else the blockwise attention
    (no [T, T] mask); else XLA. jax.nn.dot_product_attention's own None means XLA.

    "flash" only on one device: a Pallas call is opaque to GSPMD, which would gather its operands
    whole over a mesh (a shard_map over the batch and head axes is what several GPUs need)."""
    if impl is not None:
        return impl
    gpu_half = jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    if packed:
        if gpu_half and jax.device_count() == 1 and flash_supported(head_dim, heads, kv_heads):
            return "flash"
        return "blockwise"
    if gpu_half and head_dim % 8 == 0 and head_dim <= 128:
        return "cudnn"
    return "xla"


class GPT2(nnx.Module):
    """`GPT2(config, rngs=nnx.Rngs(0))(input_ids [B, T] int) -> logits [B, T, vocab] float32`.

    dtype: compute dtype (params are cast to it per use; layernorms, softmax, logits in fp32).
    param_dtype: storage dtype of the parameters.
    remat_policy: one of REMAT_POLICIES (None = no remat; what each keeps is listed there),
        applied per block inside the layer scan.
    scan_unroll: layers per iteration of the layer scan (`lax.scan`'s unroll; default 1). More
        gives XLA's scheduler a window across layers and fewer loop-carried copies, at the cost
        of compile time. The engine sets 1 under offload_param and ZeRO-3's per-layer gather.
    offload_activations: True is remat_policy="offload" (block inputs saved to pinned host memory).
    attention_impl: None (cuDNN on GPU when it applies, else XLA) | "xla" | "cudnn" | "blockwise"
        (flash attention in plain JAX, `zerojax.models.attention`: memory O(T x attention_block)) |
        "flash" (the fused Pallas kernel, `zerojax.models.flash_attention`).
    attention_block: keys per step of the blockwise attention (default 512).

    Parameter offload hook: `layer_fetch` (attribute, default None) is a function applied to each
    layer's parameter slice inside the layer scan, inside the block's remat, so the backward
    pass fetches each layer again instead of keeping a device copy of every layer for it. A
    trainer that keeps the stacked layer params in host memory sets it (e.g. to a `device_put`
    to device memory); with it, remat_policy None means "full" (a saved device copy of every
    layer is what the offload avoids). `scan_unroll` (default 1) unrolls the layer scan, giving
    the scheduler a window to overlap the next layer's fetch with this layer's compute. With
    `layer_scan` (default None; the engine sets it for offload_param to
    `zerojax.offload.prefetch_scan`) the layers run through
    `layer_scan(block, x, layers, layer_fetch, inputs_to_host=...)` instead: the next layer's copy
    is issued while this one computes, forward and backward, and every layer is recomputed in the
    backward pass. Without `layer_fetch`, a `layer_scan` set by the engine runs the (remat-wrapped)
    blocks as `layer_scan(block, x, layers, None)`: pipeline.stages > 1 hands it
    `zerojax.sharding.pipeline.pipeline_scan`. The model itself imports nothing of zerojax's runtime.

    Activation hook: `activation_sharding` (attribute, default None) is a function
    `(x, logical names) -> x` applied to the named activations inside each block (`RESIDUAL`,
    q/k/v ("batch", "seq", "qkv", "heads", "head_dim"), the attention output, the MLP hidden
    ("batch", "seq", "mlp")); a tensor-parallel trainer sets it to a sharding constraint.

    Adapter hook: `adapter` (set by `zerojax.lora.apply`, absent otherwise, as `Llama.adapter`):
    `adapter.linear(eq, h, entry, dtype)` computes each projection (a quantized kernel, LoRA terms)
    and `adapter.layer_inputs(model)` gives the untrained per-layer inputs (the frozen base)
    scanned beside the trained parameters (`adapted_layers`). Without it the blocks run the
    plain einsums.
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, remat_policy: str | None = None,
                 offload_activations: bool = False, attention_impl: str | None = None,
                 scan_unroll: int = 1, attention_block: int = DEFAULT_BLOCK):
        if offload_activations:
            if remat_policy not in (None, "offload"):
                raise ValueError(f"offload_activations=True conflicts with {remat_policy=}")
            remat_policy = "offload"
        self.attention_block = check_block(attention_block)
        if remat_policy is not None:  # validate early
            check_remat_policy(remat_policy, config.n_layer)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"{attention_impl=}; choose one of {ATTENTION_IMPLS}")
        if isinstance(scan_unroll, bool) or not isinstance(scan_unroll, int) or scan_unroll < 1:
            raise ValueError(f"{scan_unroll=}: an int >= 1 (layers run per iteration of the layer scan; "
                             f"a divisor of n_layer={config.n_layer} avoids a second, remainder loop)")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat_policy = remat_policy
        self.attention_impl = attention_impl
        self.layer_fetch = None  # see the class docstring: set by a trainer for param offload
        self.scan_unroll = scan_unroll
        self.layer_scan = None  # with layer_fetch: a prefetching layer scan (see above)
        self.activation_sharding = None  # see the class docstring: set by a trainer (tensor parallelism)
        d, std = config.n_embd, config.initializer_range
        wte = std * jax.random.normal(rngs.params(), (config.vocab_size, d), param_dtype)
        # padding rows are zeros (the real rows draw the same numbers as an unpadded model)
        self.wte = _param(jnp.pad(wte, ((0, config.padded_vocab_size - config.vocab_size), (0, 0))),
                          ("vocab", "embed"))
        self.wpe = _param(std * jax.random.normal(rngs.params(), (config.n_positions, d), param_dtype),
                          ("pos", "embed"))
        self.h = Blocks(config, rngs, param_dtype)
        self.ln_f = LayerNorm((), (), d, param_dtype)

    def checkpoint_record(self) -> dict:
        """What a checkpoint stores about this model (JSON), so that an export can write Hugging
        Face's layout from the weights alone (`zerojax.models.weights_writer`)."""
        return {"type": "gpt2", "config": dataclasses.asdict(self.config)}

    def __call__(self, input_ids):
        """Logits [B, T, vocab_size] (the real vocabulary; Hugging Face's logits)."""
        return self.padded_logits(self.hidden_states(input_ids))[..., :self.config.vocab_size]

    def padded_logits(self, x, head=lm_head):
        """The LM head on hidden states x [B, T, d] -> fp32 logits [B, T, padded_vocab_size], the
        padding columns -inf (no probability, no gradient). Under tensor parallelism x is gathered
        whole and the logits stay split on the vocabulary: the loss reduces over that split.
        head: the product (`lm_head` for training, `decode_head` for the KV-cache decoder)."""
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        logits = head(constrain(x, SEQ_WHOLE), self.wte[...].astype(self.dtype))
        logits = constrain(logits, LOGITS)
        cfg = self.config
        if cfg.padded_vocab_size == cfg.vocab_size:
            return logits
        return jnp.where(jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size, logits, -jnp.inf)

    def hidden_states(self, input_ids):
        """The final layer norm's output [B, T, n_embd] in the compute dtype (logits = it @ wte.T)."""
        cfg, dtype = self.config, self.dtype
        T = input_ids.shape[-1]
        if T > cfg.n_positions:
            raise ValueError(f"sequence length {T} exceeds n_positions={cfg.n_positions}")
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        x = self.embed(input_ids)

        adapter = getattr(self, "adapter", None)  # e.g. zerojax.lora's: frozen base, LoRA terms
        body = functools.partial(
            _block, eps=cfg.layer_norm_epsilon, dtype=dtype,
            attention_impl=resolve_attention(self.attention_impl, dtype, cfg.head_dim),
            attention_block=getattr(self, "attention_block", DEFAULT_BLOCK), constrain=constrain,
            linear=plain_linear if adapter is None else adapter.linear)
        fetch = getattr(self, "layer_fetch", None)
        layers = nnx.to_pure_dict(nnx.state(self.h, nnx.Param))
        layer_scan = getattr(self, "layer_scan", None)
        if adapter is not None:
            body, layers, fetch = adapted_layers(adapter, self, body, layers, fetch=fetch, layer_scan=layer_scan,
                                                 stack="h")
        x = run_layers(body, x, layers, policy=self.remat_policy, fetch=fetch, layer_scan=layer_scan,
                       n_layer=cfg.n_layer, unroll=getattr(self, "scan_unroll", 1) or 1)
        return self.final_norm(x)

    def embed(self, input_ids, positions=None):
        """Token + position embeddings of input_ids [B, T] -> [B, T, d] in the compute dtype;
        positions [B, T] (default 0 .. T-1; the KV-cache decoder gives each row its own)."""
        constrain = getattr(self, "activation_sharding", None) or unconstrained
        wpe = self.wpe[...]
        pos = wpe[:input_ids.shape[-1]] if positions is None else wpe[positions]
        # a vocab-split wte: each tensor rank looks up its own rows, the partial sums are added
        # (SEQ_WHOLE), then the residual stream takes its layout (split on the sequence under SP)
        return constrain(constrain(self.wte[...][input_ids].astype(self.dtype), SEQ_WHOLE) + pos.astype(self.dtype),
                         RESIDUAL)

    def final_norm(self, x):
        """The final layer norm of the residual stream x [B, T, d] (before the LM head)."""
        eps = self.config.layer_norm_epsilon
        return _layer_norm(x, self.ln_f.scale[...], self.ln_f.bias[...], eps, self.dtype)


def adapted_layers(adapter, model, body, layers, *, fetch, layer_scan, stack: str):
    """A model's layer stack as its `adapter` runs it -> (body, layers, fetch) for `run_layers`:
    the layers' untrained per-layer inputs (`adapter.layer_inputs(model)`: a frozen base, dropout
    keys), stacked as the trained `layers` and scanned beside them (`layer_stack.WithFrozen`, which
    the pipeline's stages carry too), merged into each layer's params (`adapter.merge`) before
    `body`; the engine's `fetch` sees the trained params alone (offload_param's scan brings a
    host-resident frozen slice to the device itself). `stack`: the model's attribute holding the
    layers."""
    frozen = adapter.layer_inputs(model)

    def adapted(x, p):
        return body(x, adapter.merge(p.params, p.frozen))

    if fetch is None:
        return adapted, layer_stack.WithFrozen(layers, frozen), None

    def fetch_params(p):
        try:
            params = fetch(p.params)
        except ValueError:
            # every trained leaf is a layer's (adapters only): the engine's hook then knows the
            # whole tree, {stack: ...}, as the one stacked group
            params = fetch({stack: p.params})[stack]
        return layer_stack.WithFrozen(params, p.frozen)

    return adapted, layer_stack.WithFrozen(layers, frozen), fetch_params


def run_layers(body, x, layers, *, policy, fetch, layer_scan, n_layer: int, unroll: int = 1):
    """`x` through `body(x, layer_params)` for each layer of the stacked `layers`, as an engine's
    hooks ask (GPT-2's and the Llama family's layer stack; `layer_stack.run_layers`), with GPT-2's
    remat vocabulary: its "save_*" policies and "dots_<k>" (one scan per piece,
    `split_remat_policy`)."""
    return layer_stack.run_layers(body, x, layers, policy=policy, fetch=fetch, layer_scan=layer_scan,
                                  policy_fn=remat_policy_fn, unroll=unroll,
                                  pieces=lambda name, n: split_remat_policy(name, n_layer))


def gpt2_loss(model: GPT2, batch):
    """Next-token cross entropy, mean over predicted tokens, in fp32 -> (loss, {"tokens": n}).

    batch["input_ids"]: int [B, T]; a block of T tokens yields T-1 predictions (the shift is done
    here, as HF does). Optional batch["labels"] [B, T] aligned with input_ids (HF convention,
    shifted here too); label -100 is ignored.
    """
    input_ids = batch["input_ids"]
    labels = _shifted_labels(batch)
    logits = model.padded_logits(model.hidden_states(input_ids))
    return mean_over_tokens(nll_sum(logits[:, :-1], labels), labels)


def _shifted_labels(batch):
    """The next-token targets [B, T-1] (batch["labels"] if given, else the input ids), HF's shift."""
    return batch.get("labels", batch["input_ids"])[:, 1:]


def nll_sum(logits, labels):
    """Sum of the fp32 cross entropy over positions whose label is not -100 (`token_nll`'s sum)."""
    return token_nll(logits, labels).sum()


def token_nll(logits, labels):
    """The fp32 cross entropy of each position [..., T], 0 where the label is -100.

    logsumexp minus the label's logit, the label picked by a masked sum over the vocabulary
    rather than a gather: with the logits split on the vocabulary (tensor parallelism) both are
    reductions over that axis, i.e. an all-reduce of [B, T] numbers (Megatron's vocab-parallel
    cross entropy), where a gather would make GSPMD collect the whole logits first. Padding
    columns hold -inf: no probability."""
    valid = labels != -100
    logits = logits.astype(jnp.float32)
    target = jnp.where(valid, labels, 0)[..., None]
    picked = jnp.where(jnp.arange(logits.shape[-1]) == target, logits, 0.0).sum(-1)
    losses = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.where(valid, losses, 0.0)


def mean_over_tokens(total, labels):
    """(total / counted tokens, {"tokens": n}): the mean over labels that are not -100."""
    n = (labels != -100).sum()
    return total / jnp.maximum(n, 1).astype(jnp.float32), {"tokens": n}


def chunked_gpt2_loss(chunk: int = 128):
    """`gpt2_loss` computed `chunk` positions at a time -> a loss_fn(model, batch).

    The full logits (B x T x padded vocab in fp32: 1.65 GB for GPT-2 at micro-batch 8 x 1024,
    and their gradient beside them) never exist: `fused_cross_entropy` runs the LM head, the
    cross entropy and the head's gradients chunk by chunk. Same value as `gpt2_loss` up to
    summation order; the batch axis stays whole, so data-parallel sharding is untouched.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: the positions per piece of the cross entropy, an int >= 1")

    def loss_fn(model: GPT2, batch):
        labels = _shifted_labels(batch)
        constrain = getattr(model, "activation_sharding", None) or unconstrained
        x = constrain(model.hidden_states(batch["input_ids"]), SEQ_WHOLE)
        # every position's target, the last one none (-100): x needs no [:, :-1] slice (a copy)
        targets = jnp.pad(labels, ((0, 0), (0, 1)), constant_values=-100)
        w = model.wte[...].astype(model.dtype)
        total = fused_cross_entropy(x, w, targets, model.config.vocab_size, chunk, constrain)
        return mean_over_tokens(total, labels)

    return loss_fn


def _ce_piece(x, w, targets, vocab_size, constrain, with_grad):
    """One chunk: x [B, c, d], w [V, d], targets [B, c] (-100: none) -> the summed cross entropy,
    and with_grad its gradients dx [B, c, d], dw [V, d] (fp32, for a loss cotangent of 1).

    The logits' gradient (softmax - one-hot) is formed here in fp32 and rounded to the operands'
    dtype for the two gemms, as `lm_head`'s backward rounds its cotangent."""
    logits = constrain(jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32), LOGITS)
    column = jnp.arange(w.shape[0])
    if w.shape[0] != vocab_size:  # padding rows of wte: no probability, no gradient
        logits = jnp.where(column < vocab_size, logits, -jnp.inf)
    valid = targets != -100
    onehot = column == jnp.where(valid, targets, 0)[..., None]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.where(onehot, logits, 0.0).sum(-1)
    total = jnp.where(valid, lse - picked, 0.0).sum()
    if not with_grad:
        return total
    g = jnp.where(valid[..., None], jnp.exp(logits - lse[..., None]) - onehot, 0.0).astype(x.dtype)
    dx = jnp.einsum("btv,vd->btd", g, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum("btv,btd->vd", g, x, preferred_element_type=jnp.float32)
    return total, dx, dw


def _ce_scan(x, w, targets, vocab_size, chunk, constrain, with_grad):
    """`_ce_piece` over the sequence, `chunk` positions at a time (a lax.scan; the last chunk
    padded with ignored positions) -> total, or (total, dx [B, T, d] fp32, dw [V, d] fp32)."""
    B, T, d = x.shape
    chunk = min(chunk, T)  # a short sequence is one piece, not padded up to `chunk`
    pad = -T % chunk
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, chunk, d).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-100).reshape(B, -1, chunk).swapaxes(0, 1)
    piece = lambda xc, tc: _ce_piece(xc, w, tc, vocab_size, constrain, with_grad)  # noqa: E731
    if not with_grad:
        total, _ = jax.lax.scan(lambda acc, xt: (acc + piece(*xt), None), jnp.float32(0), (x, targets))
        return total

    def body(carry, xt):
        total, dw = carry
        t, dx, dw_piece = piece(*xt)
        return (total + t, dw + dw_piece), dx

    (total, dw), dx = jax.lax.scan(body, (jnp.float32(0), jnp.zeros(w.shape, jnp.float32)), (x, targets))
    return total, dx.swapaxes(0, 1).reshape(B, T + pad, d)[:, :T], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fused_cross_entropy(x, w, targets, vocab_size, chunk, constrain=unconstrained):
    """Summed fp32 cross entropy of the logits x @ w.T against targets, `chunk` positions at a time.

    x [B, T, d] (the final hidden states), w [V, d] (wte, V >= vocab_size: the rows past
    vocab_size are padding, never predicted), targets [B, T] int (-100: not counted). The
    forward pass also forms the gradients of x and w chunk by chunk (the loss is a scalar at the
    end of the step, so its cotangent only scales them): neither the [B, T, V] fp32 logits nor
    their gradient ever exists whole, and nothing is recomputed in the backward pass (three head
    gemms, as unfused). The backward scales the kept fp32 gradients by the cotangent and rounds
    them to the operands' dtypes. constrain(x, names): the trainer's activation hook."""
    return _ce_scan(x, w, targets, vocab_size, chunk, constrain, with_grad=False)


def _fused_ce_fwd(x, w, targets, vocab_size, chunk, constrain):
    total, dx, dw = _ce_scan(x, w, targets, vocab_size, chunk, constrain, with_grad=True)
    # residuals are arrays: the operands' dtypes travel as empty arrays of them
    return total, (dx, dw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fused_ce_bwd(vocab_size, chunk, constrain, res, ct):
    dx, dw, x_like, w_like = res
    return (ct * dx).astype(x_like.dtype), (ct * dw).astype(w_like.dtype), None


fused_cross_entropy.defvjp(_fused_ce_fwd, _fused_ce_bwd)
