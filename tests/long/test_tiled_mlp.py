"""The tiled MLP (`Llama(mlp_tile=...)`, ALST's TiledMLP: a remat'd scan over sequence pieces)
against the untiled one: logits and gradients of a tiny Llama on packed rows, a tile that does
not divide the row included; and the option refused in one line when it is not a positive int."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import Llama, LlamaConfig
from zerojax.models.llama import llama_loss


def test_tiled_mlp_equals_untiled():
    cfg = LlamaConfig.named("tiny")
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, 256, (2, 19)), jnp.int32),
             "segment_ids": jnp.asarray(np.repeat([1, 2], [10, 9])[None].repeat(2, 0), jnp.int32)}
    outs = []
    for tile in (None, 4):  # 19 positions: four pieces of 4 and a padded fifth
        model = Llama(cfg, rngs=nnx.Rngs(0), mlp_tile=tile)
        grads = jax.tree.leaves(nnx.to_pure_dict(nnx.grad(lambda m: llama_loss(m, batch)[0])(model)))
        outs.append((model(batch["input_ids"], segment_ids=batch["segment_ids"]), grads))
    (l1, g1), (l2, g2) = outs
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_bad_tile_refused():
    with pytest.raises(ValueError, match="mlp_tile=0"):
        Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0), mlp_tile=0)
