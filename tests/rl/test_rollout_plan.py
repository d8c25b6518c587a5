"""The rollout's memory checked before the first rollout, and the rows generated at once
(`zerojax.rl.rollout_plan`), on a tiny Llama over 8 virtual CPU devices with a fake device limit
(CPU reports none; the planner tests fake it the same way).

References, independent of the planner: the prefill and decode programs compiled here by hand at
the row counts in question (their memory analysis read raw); the weights' per-device bytes from
each array's shard shape; the rows of an unchunked greedy rollout of the same seed.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.data.rows import ByteTokens
from zerojax.engine import memory
from zerojax.generation import decoder, sampling
from zerojax.generation.families import geometry_of_config
from zerojax.methods.grpo import make_grpo_loss
from zerojax.models import Llama, LlamaConfig
from zerojax.rl import RolloutBatches, load_prompts
from zerojax.rl import rollout_plan as plan_mod
from zerojax.rl.rollouts import GRPOOptions

G, ROWS, NEW, SEED = 4, 16, 8, 3


def _engine(off_policy=0):
    cfg = {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}
    loss = make_grpo_loss(kl_coef=0.0, group=G, off_policy=off_policy)
    return zerojax.shard(lambda: Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)), cfg, loss_fn=loss)


def _rollouts(engine, data, **options):
    o = GRPOOptions(group=G, kl_coef=0.0, max_new_tokens=NEW, temperature=0.0, **options)
    return RolloutBatches(engine, data, "digit", o, seed=SEED, num_steps=1)


@pytest.fixture(scope="module")
def digits():
    return load_prompts("digit", ByteTokens(), seq_len=11)  # "nn:" + 8 new bytes


@pytest.fixture(scope="module")
def engine():
    return _engine()


def _weight_bytes(engine) -> int:
    """The live weights' bytes on one device, from each array's shard shape."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves((engine.state.params, engine.state.rest)))


def _reference_need(engine, rows: int) -> int:
    """What a generate call of `rows` rollout rows (rows // G prompts, each run once) adds beside the
    weights: its prefill and decode compiled here from hand-written shapes, the larger peak."""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    weights, source = (engine.state.params, engine.state.rest), decoder.EngineSource(engine.step_settings)
    g = geometry_of_config(LlamaConfig.named("tiny"))
    prompts, length = max(1, -(-rows // G)), 16 + 16  # the length buckets of 3 prompt and 8 new tokens
    values, stop, key = sampling.settings()[1], S((8,), i32), jax.random.key(0)
    pre = decoder.prefill.lower(weights, S((prompts, 16), i32), S((prompts,), i32), S((rows,), bool), values, stop,
                                key, S((rows,), i32) if prompts < rows else None, source=source,
                                sampler=sampling.Sampler(), length=length, out_len=16).compile()
    dtype = jax.tree.leaves(engine.state.params)[0].dtype  # the compute dtype the cache is kept in
    kv = S((g.layers, rows, g.kv_heads, length, g.head_dim), dtype)
    state = decoder.DecodeState(kv, kv, S((rows, 16), i32), S((rows,), i32), S((), i32), S((rows,), bool),
                                S((rows, 1), bool))
    dec = decoder.decode.lower(weights, state, S((rows,), i32), S((), i32), S((), i32), values, stop, key,
                               source=source, sampler=sampling.Sampler()).compile()

    def peak(c):
        m = c.memory_analysis()
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes

    return max(peak(pre), peak(dec)) - _weight_bytes(engine)


def test_no_device_limit_generates_every_row_at_once_and_compiles_nothing(engine, digits):
    plan = _rollouts(engine, digits).plan
    assert (plan.chunk, plan.tried, plan.budget) == (ROWS, {}, None)
    assert "16 rows (4 prompts x group 4, prompt 3 + 8 new tokens)" in plan.describe()


def test_auto_chunk_is_the_largest_whose_programs_fit(engine, digits, monkeypatch):
    held = memory.resident_bytes(engine.state)
    assert held >= _weight_bytes(engine)
    fits, over = _reference_need(engine, 8), _reference_need(engine, 16)
    assert fits < over
    budget = held + (fits + over) // 2
    monkeypatch.setattr(memory, "device_budget", lambda device=None: budget)
    plan = _rollouts(engine, digits).plan
    assert plan.chunk == 8 and plan.held == held and plan.budget == budget
    assert plan.tried[8] <= budget - held < plan.tried[16]  # the next size up was compiled and does not fit
    assert "8 rows at a time" in plan.describe() and "16 rows at once do not" in plan.describe()


def test_a_rollout_that_cannot_fit_is_refused_in_one_line(engine, digits, monkeypatch):
    held = memory.resident_bytes(engine.state)
    one = plan_mod.generate_need(_rollouts(engine, digits), 1)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: held + one - 1)
    with pytest.raises(plan_mod.RolloutWillNotFitError) as e:
        _rollouts(engine, digits)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("4 prompts x group 4, prompt 3 + 8 new tokens", "(16 rows)", "even 1 row at a time",
                 f"({one:,} bytes)", "rollout_chunk", "max_new_tokens", 'generator "serving"'):
        assert part in msg, part
    assert "off_policy=0" not in msg  # on-policy: no copy to drop


def test_an_asked_chunk_that_does_not_fit_is_refused(engine, digits, monkeypatch):
    held = memory.resident_bytes(engine.state)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: held + _reference_need(engine, 8))
    with pytest.raises(plan_mod.RolloutWillNotFitError, match=r"16 rows at once \(rollout_chunk=16\)"):
        _rollouts(engine, digits, rollout_chunk=16)


def test_chunked_rollouts_give_the_rows_of_an_unchunked_one(engine, digits, monkeypatch):
    whole = _rollouts(engine, digits)
    chunked = _rollouts(engine, digits, rollout_chunk=3)  # chunks across groups, the last one row
    assert (whole.plan.chunk, chunked.plan.chunk) == (ROWS, 3)
    a = whole.rollout(0)[0]
    calls, generate = [], zerojax.generate
    monkeypatch.setattr(zerojax, "generate", lambda eng, prompts, **kw: calls.append(len(prompts))
                        or generate(eng, prompts, **kw))
    b = chunked.rollout(0)[0]
    assert calls == [3, 3, 3, 3, 3, 1]
    for k in ("input_ids", "completion_mask", "advantages"):
        np.testing.assert_array_equal(a[k], b[k])
    assert a["completion_mask"].sum() > 0


def test_off_policy_counts_the_weight_copy_beside_the_step(digits, monkeypatch):
    engine = _engine(off_policy=1)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 1 << 40)
    rollouts = _rollouts(engine, digits, off_policy=1)
    plan = rollouts.plan
    step = engine.step_memory(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                           digits.example_batch(ROWS))).peak
    assert plan.held == step + _weight_bytes(engine)
    one = plan_mod.generate_need(rollouts, 1)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: plan.held + one - 1)
    with pytest.raises(plan_mod.RolloutWillNotFitError, match="off_policy's weight copy.*off_policy=0"):
        _rollouts(engine, digits, off_policy=1)


def test_the_serving_generator_counts_its_page_pool(engine, digits, monkeypatch):
    held = memory.resident_bytes(engine.state)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: held + (1 << 20))
    logps = plan_mod.logps_need(_rollouts(engine, digits))
    assert logps < 1 << 20
    monkeypatch.setattr(memory, "device_budget", lambda device=None: held + logps)
    with pytest.raises(plan_mod.RolloutWillNotFitError, match="the serving engine's page pool"):
        _rollouts(engine, digits, generator="serving")


def test_rollout_chunk_values_are_checked():
    for bad in (0, -2, "some", 1.5, True):
        with pytest.raises(ValueError, match="rollout_chunk"):
            GRPOOptions(rollout_chunk=bad).check(ROWS, 8)
    with pytest.raises(ValueError, match="generate's"):
        GRPOOptions(rollout_chunk=4, generator="serving").check(ROWS, 8)
    assert plan_mod.chunk_candidates(48) == [48, 32, 16, 8, 4, 2, 1]
    assert plan_mod.chunk_candidates(16) == [16, 8, 4, 2, 1]
    assert plan_mod.distinct_prompts(16, 3, 4) == 2 and plan_mod.distinct_prompts(16, 8, 4) == 2
