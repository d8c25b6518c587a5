"""The compiled decode step does no work beyond reading the weights and the cache: no weight
converted to another dtype, no sort or full-vocabulary pass in greedy decoding beyond the LM head,
the embedding read by a gather, and no layer's keys / values transposed or the whole cache copied
(the shapes compared are the model's own arrays). Built from shapes alone (nnx.eval_shape)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.generation.families import geometry_of_config
from zerojax.generation.program_cost import decode_program
from zerojax.models import Llama, LlamaConfig

CONFIG = LlamaConfig.named("tiny", hidden_size=128, intermediate_size=384)  # no dimension equal to the vocab (256)
BATCH, LENGTH = 2, 32


def _program(dtype):
    model = nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype))
    lowered, compiled = decode_program(model, batch=BATCH, length=LENGTH)
    # one layer's slice of each stacked kernel (norm scales aside), and the embedding / head tables
    matrices = [x.size // x.shape[0] for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param)) if x.ndim >= 3]
    matrices.append(model.embed_tokens.get_value().size)
    return model, lowered.as_text(), compiled.as_text(), matrices


@pytest.fixture(scope="module")
def bf16():
    return _program(jnp.bfloat16)


@pytest.fixture(scope="module")
def f32():
    # the optimized HLO is read on an fp32 model: XLA:CPU computes bf16 dots in fp32 and converts
    # weights and cache to fp32 itself, converts a GPU program does not have
    return _program(jnp.float32)


def _size(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1


def test_no_weight_is_converted_and_greedy_runs_no_sort(bf16):
    model, text, _, matrices = bf16
    smallest = min(matrices)  # a layer's k_proj
    converted = [_size(m.group(1).replace("x", ",")) for m in
                 re.finditer(r"stablehlo\.convert %\S+ : \(tensor<((?:\d+x)*)\w+>\)", text)]
    assert converted and max(converted) < smallest
    assert "stablehlo.sort" not in text and "top_k" not in text
    table = model.embed_tokens.get_value().shape
    assert re.search(rf"stablehlo\.gather.*tensor<{table[0]}x{table[1]}xbf16>", text)  # a row read, no one-hot matmul
    vocab_dots = re.findall(rf"stablehlo\.dot_general[^\n]*-> tensor<[\dx]*x{table[0]}x(\w+)>", text)
    # the LM head, nothing else over the vocabulary; its product in the compute dtype, as
    # transformers' generate (an fp32 product had XLA convert the whole head to fp32 a token)
    assert vocab_dots == ["bf16"]


def test_cache_is_read_in_place_not_transposed_or_copied(f32):
    model, _, hlo, _ = f32
    g = geometry_of_config(model.config)
    whole = (g.layers, BATCH, g.kv_heads, LENGTH, g.head_dim)
    layer = BATCH * g.kv_heads * LENGTH * g.head_dim
    ops = re.findall(r"= f32\[([\d,]*)\]\S* (transpose|copy)\(", hlo)
    assert not [d for d, op in ops if op == "transpose" and _size(d) == layer]  # a layer's keys re-laid out
    assert not [d for d, op in ops if op == "copy" and tuple(map(int, d.split(","))) == whole]  # the whole cache
