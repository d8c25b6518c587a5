"""The memory guard's second check: the step's new bytes (temporaries, outputs not written over a
donated input, code) against what the device has free when it first runs. A step that fits the
budget but not beside arrays held outside the engine (the model passed in, an earlier engine) is
refused before it runs, nothing trained; with the room it needs it trains."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from tiny_gpt2 import TINY, tiny_gpt2
from zerojax.models.gpt2 import gpt2_loss
from zerojax.planning import memory as M

pytestmark = pytest.mark.slow  # builds and trains engines beside held arrays

SEQ = 16
CFG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}}


def test_a_step_that_fits_the_budget_but_not_the_free_memory_is_refused(monkeypatch):
    engine = zerojax.shard(tiny_gpt2, CFG, loss_fn=gpt2_loss)
    rows = np.random.default_rng(0).integers(0, TINY.vocab_size, (engine.cfg.train_batch_size, SEQ)).astype(np.int32)
    mem = engine.step_memory({"input_ids": jax.ShapeDtypeStruct(rows.shape, jnp.int32)})
    need = mem.temp + mem.output - mem.alias + mem.generated_code
    assert 0 < need < mem.peak  # the resident state is not counted again
    before = jax.tree.map(np.asarray, engine.master_params)
    monkeypatch.setattr(M, "device_budget", lambda device=None: mem.peak)  # the budget holds the step
    monkeypatch.setattr(M, "device_free_bytes", lambda device=None: need - 1)
    with pytest.raises(M.HeldMemoryError, match="needs .* more on the device .* only .* is free now"):
        engine.train_step({"input_ids": rows})
    assert engine.global_steps == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, engine.master_params), before)
    monkeypatch.setattr(M, "device_free_bytes", lambda device=None: need)
    engine.train_step({"input_ids": rows})
    assert engine.global_steps == 1
