"""A mixture-of-experts model (tiny Qwen3-MoE shape) trained through `zerojax.shard`: ZeRO-3 equals
the stage-0 run after a few SGD steps (losses, router metrics, fp32 weights), and a ZeRO-3
checkpoint resumes into ZeRO-1 where the uninterrupted run lands. 8 virtual CPU devices, fp32."""
import functools

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.models import MoEConfig, MoELlama, moe_loss

pytestmark = pytest.mark.slow  # trains engines

# routing decided by a router far from init (std 1), a z-loss term on: every loss term trains
MODEL = MoEConfig.named("tiny-qwen3-moe", vocab_size=64, hidden_size=32, intermediate_size=16, head_dim=8,
                        num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, router_z_loss_coef=0.01,
                        initializer_range=0.3)
ROWS, SEQ, GA, STEPS, LR, MOMENTUM = 16, 8, 2, 3, 0.1, 0.9
EPS32 = float(np.finfo(np.float32).eps)
# tests/models/test_llama_engine.py's bound: only the order of fp32 sums differs between runs
REL = ROWS * (SEQ - 1) * EPS32
WEIGHT_ATOL = LR * REL * sum(sum(MOMENTUM ** j for j in range(k + 1)) for k in range(STEPS))


def config(stage, ga=GA):
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": ga,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def model(seed):
    return MoELlama(MODEL, rngs=nnx.Rngs(seed))


def batches():
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, MODEL.vocab_size, (ROWS, SEQ)).astype(np.int32)} for _ in range(STEPS)]


def host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), tree)


def train(stage, steps=STEPS, eng=None):
    """(engine, per-step metrics, fp32 master weights after `steps` steps)."""
    eng = eng or zerojax.shard(functools.partial(model, 0), config(stage), loss_fn=moe_loss)
    metrics = [{k: float(v) for k, v in eng.train_step(b).items()} for b in batches()[:steps]]
    eng.synchronize()
    return eng, metrics, host(eng.master_params)


def assert_same(a, b, atol=WEIGHT_ATOL):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_zero3_equals_stage0_and_resumes_into_zero1(tmp_path):
    _, ref_metrics, ref = train(0)
    for name in ("loss", "router/aux_loss", "router/z_loss", "ce_loss"):
        assert name in ref_metrics[0], name
    # the logged loss is the cross entropy plus the weighted router terms
    m = ref_metrics[0]
    np.testing.assert_allclose(m["loss"], m["ce_loss"] + MODEL.router_aux_loss_coef * m["router/aux_loss"]
                               + MODEL.router_z_loss_coef * m["router/z_loss"], rtol=1e-6)

    a, metrics3, saved = train(3, steps=2)
    a.save_checkpoint(tmp_path / "ck")
    k = a.state.params["layers"]["mlp"]["gate_up_proj"]["kernel"]  # [L, E, d, 2, m] over 8 devices
    assert k.addressable_shards[0].data.size == k.size // 8
    metrics3.append({k: float(v) for k, v in a.train_step(batches()[2]).items()})
    for got, want in zip(metrics3, ref_metrics, strict=True):
        for name in ("loss", "router/aux_loss", "router/z_loss"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    assert_same(host(a.master_params), ref)

    b = zerojax.shard(functools.partial(model, 1), config(1), loss_fn=moe_loss)
    b.load_checkpoint(tmp_path / "ck")
    assert_same(host(b.master_params), saved, atol=0)
    b.train_step(batches()[2])
    b.synchronize()
    assert_same(host(b.master_params), ref)


EP_MODEL = MoEConfig.named("tiny-mixtral", vocab_size=64, hidden_size=32, intermediate_size=16, num_experts=8,
                           num_experts_per_tok=2, router_aux_loss_coef=0.1, initializer_range=0.3)


def ep_model():
    return MoELlama(EP_MODEL, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def one_device_run():
    """(losses, fp32 weights) of the whole model on one device: the expert-parallel runs' reference."""
    from zerojax.sharding.partition import make_mesh

    # one micro-batch a step: the load-balancing loss is not a mean over rows (a product of
    # means), so accumulation steps that group the rows differently (per device here, in order on
    # one device) would change it, as they do in transformers and DeepSpeed
    one = zerojax.shard(ep_model, config(0, ga=1), loss_fn=moe_loss, mesh=make_mesh(devices=jax.devices()[:1]))
    losses = [float(one.train_step(b)["loss"]) for b in batches()]
    one.synchronize()
    return losses, host(one.master_params)


@pytest.mark.parametrize("ep,stage", [(8, 2), (4, 1), (2, 3)])
def test_expert_parallel_inside_8_data_devices_equals_one_device(one_device_run, ep, stage):
    # EngineOptions.ep_size = ep on 8 data-parallel devices: 8 / ep groups of ep devices, each
    # device holding 8 / ep of the 8 experts of every layer (ZeRO partitioning them further over
    # the groups at stage 3), tokens sent to their expert's device in the group by all-to-all; the
    # same losses and weights after SGD as the whole model on one device
    eng = zerojax.shard(ep_model, config(stage, ga=1), loss_fn=moe_loss, options=zerojax.EngineOptions(ep_size=ep))
    k = eng.state.params["layers"]["mlp"]["gate_up_proj"]["kernel"]  # [L, E, d, 2, m]
    spec = tuple(k.sharding.spec) + (None,) * 5
    assert spec[1] == "expert" and k.addressable_shards[0].data.shape[1] == EP_MODEL.num_experts // ep
    # ZeRO-3 splits each group's experts over the 8 / ep groups too
    assert k.addressable_shards[0].data.size == k.size // (8 if stage == 3 else ep), spec
    losses = [float(eng.train_step(b)["loss"]) for b in batches()]
    eng.synchronize()
    ref_losses, ref = one_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same(host(eng.master_params), ref)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches()[0])
    assert "all-to-all" in eng.compiled_step(shapes).as_text()


@pytest.mark.parametrize("ep,names", [(3, "data-parallel size 8"), (8, "num_experts = 4")])
def test_expert_parallel_size_that_does_not_divide_is_refused(ep, names):
    with pytest.raises(zerojax.ConfigError, match=f"ep_size = {ep} must divide the (model's )?{names}"):
        zerojax.shard(functools.partial(model, 0), config(0, ga=1), loss_fn=moe_loss,
                      options=zerojax.EngineOptions(ep_size=ep))
