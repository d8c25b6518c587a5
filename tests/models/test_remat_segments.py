"""Two-level activation checkpointing (remat "segments[_<k>]", "offload_segments[_<k>]", DeepSpeed's
number_checkpoints): the same losses, gradients and SGD step as no remat, fewer layer inputs kept,
and one-line refusals of what it cannot take."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.config import REMAT_POLICY_NAMES, ConfigError, remat_policy_for
from zerojax.engine.memory import CompiledMemory
from zerojax.models import GPT2, GPT2Config, Llama, LlamaConfig, gpt2_loss, layer_stack, llama_loss
from zerojax.models.layer_stack import LAYER_INPUT, remat_policy, run_layers
from zerojax.remat_segments import auto_segment, kept_inputs, segment_length

# 5 layers: k = 2 leaves a last segment of 1, k = 5 is one segment; auto picks 2
CFG = GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=5, n_head=4)


def _ids(cfg, rows=2, seq=16):
    return jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq), dtype=np.int32))


def _loss_and_grads(policy, cfg=CFG, **kw):
    gd, st = nnx.split(GPT2(cfg, rngs=nnx.Rngs(0), remat_policy=policy, **kw))
    ids = _ids(cfg)
    return jax.jit(jax.value_and_grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0]))(st)


@functools.cache
def _reference():
    return _loss_and_grads(None)


@pytest.mark.parametrize("policy", ["segments", "segments_2", "segments_5", "offload_segments_3"])
def test_gradients_equal_no_remat(policy):
    ref_loss, ref_g = _reference()
    loss, g = _loss_and_grads(policy)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, ref_g)


def _mlp_layer(x, p):
    x = jax.ad_checkpoint.checkpoint_name(x, LAYER_INPUT)
    return x + jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])


@pytest.mark.parametrize("policy", ["segments_3", "segments_4", "offload_segments"])
def test_float64_gradients_equal_no_remat(policy):
    """The layer stack alone in float64: the rebuilt forward is the same arithmetic, so the
    gradients agree to float64 rounding (7 layers: k = 3 and 4 leave a shorter last segment)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        layers = {"w1": jnp.asarray(rng.normal(size=(7, 8, 16)) / 4),
                  "w2": jnp.asarray(rng.normal(size=(7, 16, 8)) / 4)}
        x = jnp.asarray(rng.normal(size=(6, 8)))

        def loss(policy, x, layers):
            out = run_layers(_mlp_layer, x, layers, policy=policy, fetch=None, layer_scan=None, policy_fn=remat_policy)
            return jnp.sum(out ** 2)

        ref = jax.grad(functools.partial(loss, None), argnums=(0, 1))(x, layers)
        got = jax.jit(jax.grad(functools.partial(loss, policy), argnums=(0, 1)))(x, layers)
        assert got[0].dtype == jnp.float64
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), got, ref)


def test_offloaded_segment_inputs_are_the_only_saved_inputs():
    """"offload_segments_2" on 5 layers: the forward pass saves the 2 full segments' inputs, stacked, in
    host memory, and the last (1-layer) segment's; no [5, ...] stack of layer inputs as "full" and
    "offload" save."""
    gd, st = nnx.split(GPT2(CFG, rngs=nnx.Rngs(0), remat_policy="offload_segments_2"))
    ids = _ids(CFG)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0]))(st))
    assert f"f32<host>[2,2,16,{CFG.n_embd}]" in jaxpr
    assert f"f32<host>[2,16,{CFG.n_embd}]" in jaxpr
    assert f"[{CFG.n_layer},2,16,{CFG.n_embd}]" not in jaxpr


def test_compiled_peak_is_lower_than_full():
    """16 layers on a long row (blockwise attention: no [T, T] scores to drown the layer inputs):
    "full" keeps 16 layer inputs, segments of 4 keep 4 + 4. CPU's memory analysis counts the
    temporaries; measured 35.2 MiB "full", 32.8 MiB "segments_4" (2048 x 64 fp32 inputs of
    0.5 MiB: about 5 of the 8 inputs saved show, XLA's loop buffers keep the rest)."""
    cfg = GPT2Config(vocab_size=16, n_positions=2048, n_embd=64, n_layer=16, n_head=2)
    ids = _ids(cfg, rows=1, seq=2048)

    def temp(policy):
        model = GPT2(cfg, rngs=nnx.Rngs(0), remat_policy=policy, attention_impl="blockwise", attention_block=256)
        gd, st = nnx.split(model)
        grad = jax.jit(jax.grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0]))
        return CompiledMemory.of(grad.lower(st).compile()).temp

    layer_input = 2048 * 64 * 4
    assert temp("full") - temp("segments") > 3 * layer_input  # auto: k = 4


def test_segment_length_and_kept_inputs():
    assert [auto_segment(n) for n in (1, 4, 7, 16, 28, 32, 80)] == [1, 2, 3, 4, 4, 4, 8]
    assert segment_length("segments_5", 32) == 5 and segment_length("offload_segments", 32) == 4
    assert kept_inputs("segments", 32) == (12, 0) and kept_inputs("offload_segments_8", 32) == (8, 4)
    assert kept_inputs("segments_5", 32) == (12, 0)  # 7 segments (the last of 2 layers) + 5


@pytest.mark.parametrize("policy,error", [
    ("segments_0", "segments_<k> takes k, the layers a segment, an int >= 1"),
    ("offload_segments_x", "offload_segments_<k> takes k"),
    ("segments_6", "segments of 6 layers, but the stack has 5; k must be 1 .. 5"),
])
def test_bad_segment_lengths_are_refused_when_built(policy, error):
    with pytest.raises(ValueError, match=error):
        GPT2(CFG, rngs=nnx.Rngs(0), remat_policy=policy)


def _config(section):
    return zerojax.load_config({"train_batch_size": 8, "activation_checkpointing": section}, world_size=1)


def test_config_names_and_number_checkpoints():
    assert "segments_4" in REMAT_POLICY_NAMES and "offload_segments" in REMAT_POLICY_NAMES
    assert "segments_x" not in REMAT_POLICY_NAMES
    assert remat_policy_for(_config({"remat_policy": "segments_4"})) == "segments_4"
    # DeepSpeed's number_checkpoints: at most N inputs kept; N >= layers (or unknown layers) changes nothing
    assert remat_policy_for(_config({"number_checkpoints": 8}), 32) == "segments_4"
    assert remat_policy_for(_config({"number_checkpoints": 6}), 32) == "segments_6"
    assert remat_policy_for(_config({"number_checkpoints": 6, "cpu_checkpointing": True}), 32) == "offload_segments_6"
    assert remat_policy_for(_config({"number_checkpoints": 32}), 32) == "full"
    assert remat_policy_for(_config({"number_checkpoints": 8})) == "full"
    assert remat_policy_for(_config({"remat_policy": "offload_segments", "cpu_checkpointing": True})) == \
        "offload_segments"


@pytest.mark.parametrize("section,error", [
    ({"remat_policy": "segments_x"}, "activation_checkpointing.remat_policy"),
    ({"number_checkpoints": 4, "remat_policy": "dots"}, "number_checkpoints = 4 with remat_policy = 'dots'"),
    ({"remat_policy": "segments", "cpu_checkpointing": True}, "offload_segments"),
])
def test_config_refusals(section, error):
    with pytest.raises(ConfigError, match=error):
        _config(section)


def test_the_flag_takes_a_segment_length():
    from zerojax.trainer.flags import parse_args

    assert parse_args(["--model", "tiny", "--remat", "segments_4"]).remat == "segments_4"
    assert parse_args(["--model", "tiny", "--remat", "offload_segments"]).remat == "offload_segments"
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny", "--remat", "segments_x"])


def test_a_model_that_runs_its_own_layer_loop_is_refused():
    class Scanned(nnx.Module):  # an nnx.vmap-built stack run by the model's own scan: one layer a call
        def __init__(self):
            keys = jax.random.split(jax.random.key(0), 3)
            self.blocks = nnx.vmap(lambda k: nnx.Linear(4, 4, rngs=nnx.Rngs(k)), in_axes=0)(keys)

        def __call__(self, x):
            return nnx.scan(lambda x, b: (b(x), None), in_axes=(nnx.Carry, 0))(x, self.blocks)[0]

    with pytest.raises(ValueError, match="needs the layer scan zerojax runs"):
        zerojax.model.remat_modules(Scanned(), "segments")


def test_one_sgd_step_equals_stage0_without_remat(monkeypatch):
    """A 3-layer Llama through the engine, number_checkpoints 2 (-> segments of 2, the last of 1):
    the weights after one SGD step equal the run without activation checkpointing."""
    model_cfg = LlamaConfig.named("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2)
    base = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 0}}
    batch = {"input_ids": np.random.default_rng(0).integers(0, 64, (8, 8)).astype(np.int32)}

    def trained(cfg):
        eng = zerojax.shard(lambda: Llama(model_cfg, rngs=nnx.Rngs(0)), cfg, loss_fn=llama_loss)
        loss = float(eng.train_step(batch)["loss"])
        eng.synchronize()
        return loss, jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), eng.master_params)

    ref_loss, ref = trained(base)
    policies = []  # what the engine's step ran the layers with
    run = layer_stack.run_segments
    monkeypatch.setattr(layer_stack, "run_segments", lambda *a, **k: policies.append(k["policy"]) or run(*a, **k))
    loss, got = trained({**base, "activation_checkpointing": {"number_checkpoints": 2}})
    assert set(policies) == {"segments_2"}
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), got, ref)
