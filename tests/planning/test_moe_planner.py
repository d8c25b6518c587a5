"""The planner's formula for a mixture-of-experts model (tiny Qwen3-MoE shapes): the expert weights
in the model states, split by expert parallelism as the engine's own shards are, and the routing
buffers in the activations, against a compiled step's memory analysis."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax import EngineOptions
from zerojax.config import load_config
from zerojax.engine.engine import abstract_engine
from zerojax.model import model_dims
from zerojax.models import Llama, LlamaConfig, MoEConfig, MoELlama, llama_loss, moe_loss
from zerojax.models.moe import active_params
from zerojax.planning import estimate as E
from zerojax.planning import mesh_search as MS
from zerojax.planning import planner as PL
from zerojax.sharding.partition import make_mesh

T, MICRO, K, EXPERTS, D, M = 64, 4, 2, 8, 64, 32
SHAPE = dict(vocab_size=128, hidden_size=D, head_dim=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MOE = MoEConfig.named("tiny-qwen3-moe", intermediate_size=M, num_experts=EXPERTS, num_experts_per_tok=K, **SHAPE)
# the dense twin: the same attention, embeddings and head, one MLP as wide as a token's K experts
DENSE = LlamaConfig.named("tiny", intermediate_size=K * M, **SHAPE)


def moe_model():
    return MoELlama(MOE, rngs=nnx.Rngs(0))


def dense_model():
    return Llama(DENSE, rngs=nnx.Rngs(0))


def test_shape_counts_the_experts_and_a_tokens_share_of_them():
    shape = PL.model_shape(moe_model, T)
    L = MOE.num_hidden_layers
    assert (shape.experts, shape.top_k) == (EXPERTS, K)
    assert shape.expert_params == L * EXPERTS * 3 * D * M  # gate, up, down of every expert
    assert shape.mlp_values == K * 3 * M  # gate, up and their product, for the K experts a token runs
    assert shape.routing_values == 2 * K * D + 2 * EXPERTS
    # 6N on the parameters a token runs (the model's own count, which matches transformers'; a
    # vocabulary of 128 that the model does not pad)
    attn = 12 * L * MOE.num_attention_heads * MOE.head_dim * T
    assert E.train_flops_per_token(shape) == pytest.approx(6 * active_params(MOE) + attn, rel=1e-12)


def test_grouped_kernels_drop_the_dense_products_transient_from_the_formula():
    # where grouped kernels run the experts' products (JAX's Mosaic GPU kernels on a Hopper card, bf16
    # or fp16 operands), the transient of XLA's dense expansion is not there to count: the activations
    # differ by exactly it; fp32 operands take XLA's product under either choice, and count it
    from zerojax.models import grouped_matmul

    shapes = {}
    for choice in ("xla", "mosaic"):
        with grouped_matmul.use(choice):
            shapes[choice] = PL.model_shape(moe_model, T)
    assert shapes["xla"].grouped_kernel_precisions == () and shapes["mosaic"].grouped_kernel_precisions == (
        "bf16", "fp16")
    transient = shapes["xla"].grouped_transient_values
    assert transient > 0 and shapes["mosaic"].grouped_transient_values == transient
    dims = model_dims(nnx.eval_shape(moe_model))
    for precision in ("bf16", "fp16", "fp32"):
        acts = {c: E.mesh_peak_bytes(s, heads=dims.heads, vocab=dims.vocab, micro_batch=MICRO, precision=precision)
                for c, s in shapes.items()}
        assert acts["xla"]["states"] == acts["mosaic"]["states"]
        scale = E.PRECISION_BYTES[precision] / 2
        dropped = 0 if precision == "fp32" else scale * 2 * MICRO * T * transient
        assert acts["xla"]["activations"] - acts["mosaic"]["activations"] == pytest.approx(dropped, abs=2)


@pytest.mark.slow  # compiles two training steps
def test_formula_counts_experts_and_routing_as_the_compiled_step_does():
    # the MoE's compiled peak less its dense twin's isolates what the experts add (their weights and
    # optimizer state, the routing buffers, the grouped products' transients): the formula's
    # difference is within the mesh search's margin of it (COMPILE_MARGIN, the formula's stated error)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    compiled, formula = {}, {}
    for name, make, loss in (("moe", moe_model, moe_loss), ("dense", dense_model, llama_loss)):
        compiled[name] = PL.step_memory(make, cfg, T, MICRO, loss_fn=loss, mesh=mesh).peak
        dims = model_dims(nnx.eval_shape(make))
        formula[name] = E.mesh_peak_bytes(PL.model_shape(make, T), heads=dims.heads, vocab=dims.vocab,
                                          micro_batch=MICRO, precision="fp32", stage=0)["total"]
    got, want = formula["moe"] - formula["dense"], compiled["moe"] - compiled["dense"]
    assert want > 0 and abs(got / want - 1) < MS.COMPILE_MARGIN, (got, want)


def _shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("stage", [1, 3])
def test_expert_parallel_states_match_the_engines_shards(stage):
    # ep 4 inside data 8: the expert weights' states split 4 ways at every stage, ZeRO over the 2
    # groups on top; the rest over all 8. The formula against the per-device shards of the engine's
    # own (abstract) state: bf16 params, fp32 gradients, fp32 master and AdamW's two moments, plus
    # optax's int32 step count
    cfg = load_config({"train_batch_size": 8, "bf16": {"enabled": True},
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}, world_size=8)
    eng = abstract_engine(lambda: MoELlama(MOE, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), cfg, loss_fn=moe_loss,
                          options=EngineOptions(ep_size=4))
    st = eng.state
    grads = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, eng.accum_dtype, sharding=s), st.params,
                         eng.shardings.grads)
    shards = _shard_bytes((st.params, grads, st.master, st.opt_state))
    dims = model_dims(nnx.eval_shape(moe_model))
    states = E.mesh_peak_bytes(PL.model_shape(moe_model, T), heads=dims.heads, vocab=dims.vocab, micro_batch=1,
                               n_data=8, stage=stage, n_expert=4)["states"]
    assert shards == states + 4
