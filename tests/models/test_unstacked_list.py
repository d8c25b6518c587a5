"""A model whose loop the engine may not run as one scan trains under every engine feature exactly
as it does plainly, and the user's own parameter tree comes back (zerojax.block_loop, zerojax.user_tree).

`CacheListLM` (tests/foreign_models.py) is shaped like a decoder another project wrote: blocks in
an `nnx.List`, a loop `for layer, c in zip(self.layers, cache): x = layer(x, c, segment_ids)`,
where `cache` holds one `nnx.Variable` a layer that the layer writes, and packed rows with segment
ids. Stacking it into one scan raised flax's TraceContextError; the engine must now leave the loop
as written. Each run is compared with plain optax SGD through `nnx.Optimizer` (no zerojax): losses
and weights after 3 steps, fp32.

Tolerance (as tests/models/test_foreign_models.py): the runs differ only in the order XLA sums
partial gradients (~1e-6 relative), which SGD at lr 0.1 passes on as ~1e-7 a step on weights of
~0.1-1; 2e-5 absolute leaves a factor of ~50 and is far below one step's movement (~1e-2). bf16 /
fp16 compute against the fp32 reference: a rounding of 2^-8 (bf16) on every activation moves a
gradient by ~1%, a weight by ~1e-4 a step: 2e-3 absolute, a tenth of a step's movement.
"""
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from foreign_models import CacheListLM, ListQwen, QwenShape, cache_lm_loss, lm_loss  # noqa: E402

import zerojax
from zerojax import block_loop
from zerojax import model as contract
from zerojax.config import ConfigError

ROWS, SEQ, STEPS, LR = 16, 9, 3, 0.1
ATOL, LOW_ATOL = 2e-5, 2e-3
SHAPE = QwenShape()


def build():
    return CacheListLM(SHAPE, rngs=nnx.Rngs(0))


def batches(n=STEPS):
    """Packed rows: two documents a row, split at a different place in each row."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(0, SHAPE.vocab, (ROWS, SEQ)).astype(np.int32)
        cut = rng.integers(2, SEQ - 1, (ROWS, 1))
        seg = np.where(np.arange(SEQ)[None] < cut, 1, 2).astype(np.int32)
        out.append({"input_ids": ids, "segment_ids": seg})
    return out


def config(stage=0, **extra):
    return {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **extra.pop("zero", {})}, **extra}


@functools.cache
def reference():
    """Losses and weights after STEPS plain SGD steps: optax through nnx.Optimizer, no zerojax."""
    model = build()
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(cache_lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, b)) for b in batches()]
    return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_matches_reference(weights, losses, *, atol=ATOL, rtol=1e-5):
    want_losses, want = reference()
    np.testing.assert_allclose(losses, want_losses, rtol=rtol)
    # the model's own tree: the list's items by index, as nnx.state(model) has them
    assert jax.tree.structure(weights) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(weights), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=atol, err_msg=jax.tree_util.keystr(path))


def trained(cfg, steps=STEPS):
    eng = zerojax.shard(build, cfg, loss_fn=cache_lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    return eng, [float(eng.train_step(b)["loss"]) for b in batches(steps)]


# ---------------------------------------------------------------------------- what is stacked


def test_the_loop_check_names_the_line_that_prevents_stacking():
    refusal = block_loop.why_not(build(), ("layers",))
    assert refusal is not None and refusal.file.endswith("foreign_models.py")
    assert refusal.code == "for layer, c in zip(self.layers, cache):" and "zip" in refusal.reason
    # a pure loop (ListQwen: x = layer(x, positions)) is proven and stacked
    assert block_loop.why_not(ListQwen(SHAPE, rngs=nnx.Rngs(0)), ("layers",)) is None


class _IndexedQwen(ListQwen):
    """ListQwen with a per-layer argument that depends on the loop index (a common port style)."""

    def __call__(self, input_ids, caches=None):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, None if caches is None else caches[i])
        return self.embed_tokens.attend(self.norm(x)).astype(jnp.float32)


class _DropoutBlock(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.lin(x))


class _DropoutList(nnx.Module):
    def __init__(self):
        self.layers = nnx.List([_DropoutBlock(rngs=nnx.Rngs(i)) for i in range(3)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("model,what", [
    (lambda: _IndexedQwen(SHAPE, rngs=nnx.Rngs(0)), "argument `None if caches is None else caches[i]` may differ"),
    (_DropoutList, "hold state besides their parameters"),
], ids=["per-layer-argument", "rng-state"])
def test_unprovable_loops_are_left_as_written(model, what, caplog):
    module = model()
    with caplog.at_level(logging.WARNING, logger="zerojax"):
        assert contract.stack_blocks(module) is module
    assert what in str(block_loop.why_not(module, ("layers",)))


# ---------------------------------------------------------------------------- every feature, exact


CASES = {
    "zero0": config(0),
    "zero1": config(1),
    "zero2": config(2),
    "accumulation": {**config(2), "gradient_accumulation_steps": 2},
    "autotp_names": {**config(1), "tensor_parallel": {"autotp_size": 2}},
    "autotp_layer_specs": {**config(1), "tensor_parallel": {"autotp_size": 2, "partition_config": {
        "use_default_specs": False, "layer_specs": [
            {"patterns": [r".*\.(q_proj|k_proj|v_proj|up)\..*"], "partition_type": "column"},
            {"patterns": [r".*\.(o_proj|down)\..*"], "partition_type": "row"}]}}},
    "remat": {**config(0), "activation_checkpointing": {"remat_policy": "full"}},
    "offload_optimizer": config(2, zero={"offload_optimizer": {"device": "cpu"}}),
}
LOW = {"bf16": {**config(2), "bf16": {"enabled": True}},
       "fp16": {**config(3), "fp16": {"enabled": True, "initial_scale_power": 8}}}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_feature_trains_like_plain_optax(case):
    eng, losses = trained(CASES[case])
    assert_matches_reference(eng.master_params, losses)
    if case.startswith("autotp"):  # q split on its output features, the row-parallel down on its input
        layer = eng.params["layers"][0]
        assert tuple(layer["q_proj"]["kernel"].sharding.spec) == (None, "tensor")
        assert tuple(layer["down"]["kernel"].sharding.spec) == ("tensor", None)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LOW))
def test_low_precision_trains_like_plain_optax(case):
    eng, losses = trained(LOW[case])
    assert jax.tree.leaves(eng.state.params)[0].dtype == (jnp.bfloat16 if case == "bf16" else jnp.float16)
    assert int(eng.skipped_steps) == 0
    assert_matches_reference(eng.master_params, losses, atol=LOW_ATOL, rtol=1e-2)


@pytest.mark.slow
def test_zero3_checkpoint_resumes_into_zero1_in_the_models_tree(tmp_path):
    data = batches()
    three = zerojax.shard(build, config(3), loss_fn=cache_lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    losses = [float(three.train_step(b)["loss"]) for b in data[:2]]
    leaf = three.state.params["layers"][0]["up"]["kernel"]
    assert leaf.addressable_shards[0].data.size * 8 == leaf.size  # split over the 8 data devices
    three.save_checkpoint(tmp_path)
    from zerojax.checkpoint import state as stored

    saved = [m["path"] for m in stored.read_meta(tmp_path)["items"]["master"]]
    assert "['layers'][3]['up']['kernel']" in saved
    one = zerojax.shard(build, config(1), loss_fn=cache_lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    one.load_checkpoint(tmp_path)
    losses.append(float(one.train_step(data[2])["loss"]))
    assert_matches_reference(one.master_params, losses)
    # engine.model is the user's class and structure, holding the trained weights
    model = one.model
    assert type(model) is CacheListLM and type(model.layers[2]) is type(build().layers[2])
    np.testing.assert_allclose(float(cache_lm_loss(model, data[0])), float(cache_lm_loss(
        nnx.merge(nnx.graphdef(build()), nnx.state(model)), data[0])), rtol=1e-6)


@pytest.mark.slow
def test_the_planner_plans_it():
    plans = zerojax.plan(build, config(0), "1GB", SEQ - 1, stages=(0, 3), offloads=("none",), loss_fn=cache_lm_loss,
                         batch_fn=lambda rows, seq: {k: v[:rows, :seq + 1] for k, v in batches(1)[0].items()},
                         max_plans=2)
    assert plans and all(p.peak_bytes > 0 for p in plans)


@pytest.mark.parametrize("cfg,what", [
    ({**config(0), "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, "pipeline.stages = 2"),
    (config(3, zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
     "zero_optimization.offload_param"),
], ids=["pipeline", "offload_param"])
def test_features_that_need_the_stack_name_the_loop_line(cfg, what):
    with pytest.raises(ConfigError) as e:
        zerojax.shard(build, cfg, loss_fn=cache_lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    assert what in str(e.value) and "foreign_models.py:" in str(e.value)
    assert "for layer, c in zip(self.layers, cache):" in str(e.value)


# ---------------------------------------------------------------------------- a stacked list, the user's tree


@pytest.mark.slow
def test_a_stacked_list_comes_back_as_the_users_tree(tmp_path):
    """ListQwen is stacked (its loop is proven pure); master_params, params, engine.model and its
    checkpoint are in the model's own tree, and that checkpoint resumes into the same blocks run
    unstacked (_IndexedQwen: the loop the engine leaves as written)."""
    data = [{"input_ids": b["input_ids"]} for b in batches()]
    cfg = config(2, zero={"offload_optimizer": {"device": "cpu"}})
    eng = zerojax.shard(lambda: ListQwen(SHAPE, rngs=nnx.Rngs(0)), cfg, loss_fn=lm_loss,
                        options=zerojax.EngineOptions(memory_guard=False))
    assert "block" in eng.state.params["layers"]  # run as one scan inside
    losses = [float(eng.train_step(b)["loss"]) for b in data[:2]]
    eng.save_checkpoint(tmp_path)
    losses.append(float(eng.train_step(data[2])["loss"]))
    user = nnx.to_pure_dict(nnx.state(ListQwen(SHAPE, rngs=nnx.Rngs(0)), nnx.Param))
    for tree in (eng.master_params, eng.params, nnx.to_pure_dict(nnx.state(eng.model, nnx.Param))):
        assert jax.tree.structure(tree) == jax.tree.structure(user)
    np.testing.assert_array_equal(eng.master_params["layers"][2]["mlp"]["up_proj"]["kernel"],
                                  np.asarray(eng._stacked_master()["layers"]["block"]["mlp"]["up_proj"]["kernel"][2]))
    plain = zerojax.shard(lambda: _IndexedQwen(SHAPE, rngs=nnx.Rngs(1)), config(2), loss_fn=lm_loss,
                          options=zerojax.EngineOptions(memory_guard=False))
    assert "block" not in plain.state.params["layers"]
    plain.load_checkpoint(tmp_path)
    np.testing.assert_allclose(float(plain.train_step(data[2])["loss"]), losses[2], rtol=1e-6)
