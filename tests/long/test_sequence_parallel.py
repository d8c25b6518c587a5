"""Ulysses sequence parallelism (`sequence_parallel_size`, a "seq" mesh axis): a tiny Llama's
losses and SGD-updated weights with the sequence split over 2 and 4 devices equal the unsplit
run's on the same 8 CPU devices (packed rows, GQA, ZeRO stages 1 and 3 beside the "data" axis),
the compiled step holds the all-to-alls, and bad sizes are refused in one line each."""
import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.config import ConfigError
from zerojax.models import Llama, LlamaConfig, llama_loss
from zerojax.sharding import partition

MODEL = LlamaConfig.named("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4)
ROWS, SEQ, STEPS, LR = 8, 16, 2, 0.1
EPS32 = float(np.finfo(np.float32).eps)
# as tests/models/test_llama_engine.py derives it: the runs compute the same per-row functions in
# fp32, only the order of sums differs (data-parallel reduce over 8 / 4 / 2 devices, the "seq"
# ranks' partial gradient sums); clipping at 1.0 bounds each step's gradient move by REL
REL = ROWS * (SEQ - 1) * EPS32
WEIGHT_ATOL = 4 * LR * REL * STEPS


def config(stage, sp):
    return {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 1.0, "sequence_parallel_size": sp,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def batches():
    rng = np.random.default_rng(0)
    seg = np.repeat([1, 2, 3], [5, 8, 3])[None].repeat(ROWS, 0).astype(np.int32)  # 3 documents a row
    return [{"input_ids": rng.integers(0, MODEL.vocab_size, (ROWS, SEQ)).astype(np.int32), "segment_ids": seg}
            for _ in range(STEPS)]


def train(stage, sp):
    make = lambda: Llama(MODEL, rngs=nnx.Rngs(0), attention_impl="blockwise", attention_block=4)  # noqa: E731
    eng = zerojax.shard(make, config(stage, sp), loss_fn=llama_loss)
    losses = [float(eng.train_step(b)["loss"]) for b in batches()]
    eng.synchronize()
    return eng, np.asarray(losses), jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32),
                                                 eng.master_params)


@pytest.fixture(scope="module")
def reference():
    return train(1, 1)[1:]


@pytest.mark.parametrize("stage,sp", [(1, 2), (3, 4)])
def test_sequence_parallel_equals_unsplit(reference, stage, sp):
    eng, losses, master = train(stage, sp)
    assert partition.seq_size(eng.mesh) == sp and partition.data_size(eng.mesh) == 8 // sp
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(reference[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=WEIGHT_ATOL, err_msg=jax.tree_util.keystr(path))
    if sp == 2:  # Ulysses' exchange: sequence-split activations <-> head-split q / k / v
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches()[0])
        assert "all-to-all" in eng.compiled_step(shapes).as_text()


def test_bad_sizes_refused():
    with pytest.raises(ConfigError, match="sequence_parallel_size = 3 must divide the 8 devices"):
        zerojax.load_config(config(1, 3))
    odd = LlamaConfig.named("tiny", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="must divide the model's num_key_value_heads = 2"):
        zerojax.shard(lambda: Llama(odd, rngs=nnx.Rngs(0)), config(1, 4), loss_fn=llama_loss)
