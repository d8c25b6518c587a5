"""`--model module:factory` targets for the CLI tests: tests/foreign_models.py's models (written
without zerojax in mind) at small sizes, built the way a user's factory would build them. Loaded
as `tests.planning.model_factories` from the repository root."""
import jax.numpy as jnp
from flax import nnx

from tests.foreign_models import ListQwen, QwenShape, ScanLM, ScanShape

# Qwen3-like: the attention is wider than the residual stream (4 heads x 32 on d = 64)
QWEN = QwenShape(vocab=128, d=64, heads=4, kv_heads=2, head_dim=32, mlp=96, layers=4)
SCAN = ScanShape(vocab=128, d=64, heads=4, mlp=96, layers=4)


def qwen_like(dtype=jnp.float32):
    """A list-of-blocks Qwen3-style model (takes dtype=, no remat_policy=)."""
    return ListQwen(QWEN, rngs=nnx.Rngs(0), dtype=dtype)


def scan_lm():
    """An nnx.vmap-stacked model run by its own nnx.scan (no arguments)."""
    return ScanLM(SCAN, rngs=nnx.Rngs(0))
