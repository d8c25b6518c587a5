"""The tiny model of the engine tests, shared with the multi-process worker (imports jax: import
it only after XLA_FLAGS is set)."""
import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """Every leaf divides by 8 (kernels 16x32 / 32x16, biases 32 / 16)."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def loss_fn(model, batch):
    y = model(batch["x"].astype(model.l1.kernel.dtype)).astype(jnp.float32)
    return jnp.mean((y - batch["y"]) ** 2), {"rows": jnp.int32(batch["x"].shape[0])}
