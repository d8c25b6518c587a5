"""The tiny GPT-2 that the planner and memory tests compile (imports jax: import it only after
XLA_FLAGS is set, as conftest does)."""
import jax.numpy as jnp
from flax import nnx

from zerojax.models.gpt2 import GPT2, GPT2Config

TINY = GPT2Config.named("tiny")


def tiny_gpt2(remat_policy=None, dtype=jnp.bfloat16):
    """bf16 compute over fp32 params. Its `remat_policy=` / `dtype=` keywords let the planner build
    remat / precision variants."""
    return GPT2(TINY, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32, remat_policy=remat_policy)


def tiny_gpt2_as_built():
    """The same model behind a factory without keywords: the planner keeps it as built (no remat,
    bf16), so a test sees the compiled peak of one variant only."""
    return tiny_gpt2()
