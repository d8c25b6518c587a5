"""Every engine feature for models written without zerojax in mind (tests/foreign_models.py): a
Qwen3-style model holding a Python list of blocks, and one whose layers are `nnx.vmap`-built and
run by its own `nnx.scan`. Each run is compared with the same model trained plainly (stage 0,
one device's worth of math on 8 devices): weights after SGD steps, fp32.

Tolerance: the runs differ only in the order XLA sums partial gradients (per device, per
micro-batch, across devices) and, for the list model, in running the blocks as one scan instead of
unrolled: ~1e-6 relative on a gradient component, which SGD at lr 0.1 passes on as ~1e-7 per step
on weights of size ~0.1-1; 3 steps. 2e-5 absolute leaves a factor of ~50 over that and is far
below a step's own movement (lr x |g| ~ 1e-2), which a dropped micro-batch or a wrong shard
changes by a sizeable part.
"""
import functools

import jax
import numpy as np
import pytest
from flax import nnx
from foreign_models import ListQwen, QwenShape, ScanLM, ScanShape, lm_loss  # noqa: E402 (tests/ on sys.path)

import zerojax
from zerojax import model as contract
from zerojax.config import ConfigError

ROWS, SEQ, STEPS, LR = 16, 9, 3, 0.1
ATOL = 2e-5
MODELS = {"list": lambda: ListQwen(QwenShape(), rngs=nnx.Rngs(0)),
          "scan": lambda: ScanLM(ScanShape(), rngs=nnx.Rngs(0))}


def batches(n=STEPS, vocab=64):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, vocab, (ROWS, SEQ)).astype(np.int32)} for _ in range(n)]


def config(stage=0, **extra):
    return {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **extra.pop("zero", {})}, **extra}


def trained(kind, cfg, steps=STEPS):
    eng = zerojax.shard(MODELS[kind], cfg, loss_fn=lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    losses = [float(eng.train_step(b)["loss"]) for b in batches(steps)]
    return eng, losses


@functools.cache
def reference(kind):
    """Weights after STEPS plain SGD steps of the unwrapped model (optax, one jit, no engine)."""
    import optax

    model = MODELS[kind]()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(LR)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        loss, g = jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for b in batches():
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return nnx.to_pure_dict(params), losses


def weights(eng):
    """The engine's fp32 weights, in the model's own tree (a stacked list comes back as the list)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float32), eng.master_params)


def assert_matches_reference(eng, kind, losses, got=None):
    want, want_losses = reference(kind)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = weights(eng) if got is None else got
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL, err_msg=f"{kind}: {jax.tree_util.keystr(path)}")


# ---------------------------------------------------------------------------- the contract itself


def test_blocks_are_found_in_a_list_and_in_a_vmapped_stack():
    assert contract.find_blocks(MODELS["list"]()) == contract.BlockStack(("layers",), "list", 4)
    assert contract.find_blocks(MODELS["scan"]()) == contract.BlockStack(("blocks",), "stacked", 4)


@pytest.mark.parametrize("kind", ["list", "scan"])
def test_dims_and_flops_per_token_against_the_formula(kind):
    model = MODELS[kind]()
    s = QwenShape() if kind == "list" else ScanShape()
    dims = contract.model_dims(model)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if kind == "list":  # per block: 2 norms, q/k norms, q (d x H x Dh), k, v (d x KV x Dh), o, 3 MLP kernels
        block = 2 * s.d + 2 * s.head_dim + s.d * s.head_dim * (2 * s.heads + 2 * s.kv_heads) + 3 * s.d * s.mlp
        assert (dims.heads, dims.kv_heads, dims.head_dim) == (s.heads, s.kv_heads, s.head_dim)
    else:  # 2 layer norms (scale + bias), 4 d x d projections with bias, 3 MLP kernels with bias
        block = 4 * s.d + 4 * (s.d * s.d + s.d) + 2 * (s.d * s.mlp + s.mlp) + s.mlp * s.d + s.d
        assert (dims.heads, dims.kv_heads, dims.head_dim) == (s.heads, s.heads, s.d // s.heads)
    assert (dims.layers, dims.d_model, dims.vocab, dims.params, dims.layer_params) == (s.layers, s.d, s.vocab, n, block)
    width = dims.heads * dims.head_dim
    assert dims.flops_per_token(128) == 6 * n + 12 * s.layers * width * 128


# ---------------------------------------------------------------------------- every feature, exact


CASES = {
    "zero1": config(1),
    "zero2": config(2),
    "zero3": config(3),
    "accumulation": {**config(2), "gradient_accumulation_steps": 2},
    "autotp": {**config(1), "tensor_parallel": {"autotp_size": 2}},
    "offload_optimizer": config(2, zero={"offload_optimizer": {"device": "cpu"}}),
    "offload_param": config(3, zero={"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
    "remat": {**config(0), "activation_checkpointing": {"remat_policy": "full"}},
}


# The scan model repeats only the cases where its code path differs from the list model's (its own
# stack instead of a stacked list: zero3's gather, autotp's names, offload_param's fetch, remat); the
# other cases (zero1, zero2, accumulation, offload_optimizer) are the engine's, the same for both.
SCAN_CASES = ("autotp", "offload_param", "remat", "zero3")
FEATURES = [("list", case) for case in sorted(CASES)] + [("scan", case) for case in SCAN_CASES]


@functools.cache
def feature_run(kind, case):
    """(engine, losses) after STEPS steps; one engine for every test that reads it (none trains it further)."""
    return trained(kind, CASES[case])


@pytest.fixture(scope="module")
def list_stage_runs(tmp_path_factory):
    """The list model at ZeRO-3 saved after 2 steps, then its third step; and at ZeRO-1 its 3 steps,
    then that checkpoint loaded into it and the third step taken again from there:
    (zero3 losses, zero3 weights, zero1 losses, zero1 weights, zero1 losses and weights after resuming)."""
    ck = str(tmp_path_factory.mktemp("reshard"))
    data = batches()
    three = zerojax.shard(MODELS["list"], CASES["zero3"], loss_fn=lm_loss,
                          options=zerojax.EngineOptions(memory_guard=False))
    losses3 = [float(three.train_step(b)["loss"]) for b in data[:2]]
    three.save_checkpoint(ck)
    losses3.append(float(three.train_step(data[2])["loss"]))
    one, losses1 = trained("list", CASES["zero1"])
    got1 = weights(one)
    one.load_checkpoint(ck)
    resumed = [float(one.train_step(data[2])["loss"])]
    return three, losses3, got1, losses1, weights(one), resumed


@pytest.mark.slow
@pytest.mark.parametrize("kind,case", FEATURES)
def test_each_feature_trains_like_the_plain_model(kind, case, request):
    if kind == "list" and case in ("zero1", "zero3"):  # the engines test_checkpoint_reshards_across_stages uses too
        three, losses3, got1, losses1, _, _ = request.getfixturevalue("list_stage_runs")
        eng, losses, got = (three, losses3, None) if case == "zero3" else (None, losses1, got1)
    else:
        eng, losses = feature_run(kind, case)
        got = None
    assert_matches_reference(eng, kind, losses, got)
    if case == "zero3":  # every sizeable leaf split over the 8 data devices
        leaf = jax.tree.leaves(eng.state.params)[1]
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size
    if case == "autotp":  # the q projection split on its heads (list) / output features (scan)
        q = (eng.state.params["layers"]["block"]["self_attn"]["q_proj"]["kernel"] if kind == "list"
             else eng.state.params["blocks"]["wq"]["kernel"])
        assert "tensor" in tuple(q.sharding.spec), q.sharding.spec


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "scan"])
def test_pipeline_runs_the_blocks_in_stages(kind):
    # the list stacked by the engine; the nnx.vmap stack run by the model's own nnx.scan, handed the
    # whole stack as its one item
    eng, losses = trained(kind, {**config(0), "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2})
    assert_matches_reference(eng, kind, losses)
    assert eng.pipeline_bubble > 0
    stack = eng.layout.shardings.params["layers" if kind == "list" else "blocks"]
    assert all(s.spec[0] == "pipe" for s in jax.tree.leaves(stack))  # each stage stores its own layers


class _DropoutBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)  # an RNG stream: state besides parameters, per layer

    def __call__(self, x):
        return x + self.drop(self.lin(x), deterministic=True)


class _ScanWith(nnx.Module):
    """A model scanning its own nnx.vmap stack in a way that cannot be handed the whole stack at
    once: "rng": its blocks keep an RNG stream each; "scanned": a per-layer scale is scanned beside
    the blocks; "around": its scan body does more than call the block."""

    def __init__(self, style, layers=4, d=8):
        rngs = nnx.Rngs(0)
        self.style = style
        self.embed = nnx.Embed(64, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _DropoutBlock(d, rngs=rngs) if style == "rng" else nnx.Linear(d, d, rngs=rngs)

        self.blocks = make(rngs)
        self.scales = nnx.Param(np.ones((layers,), np.float32))

    def __call__(self, ids):
        x = self.embed(ids)
        if self.style == "scanned":
            x = nnx.scan(lambda block, scale, x: block(x) * scale, in_axes=(0, 0, nnx.Carry), out_axes=nnx.Carry)(
                self.blocks, self.scales[...], x)
        else:
            body = (lambda block, x: 2 * block(x)) if self.style == "around" else (lambda block, x: block(x))
            x = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
        return self.embed.attend(x)


@pytest.mark.parametrize("style,why", [("rng", "hold state besides their parameters"),
                                       ("scanned", "tracing the model that way failed"),
                                       ("around", "its scan does more than that")], ids=["rng", "scanned", "around"])
def test_pipeline_on_a_scan_it_cannot_take_over_names_the_hook(style, why):
    cfg = {**config(0), "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}
    shapes = {"input_ids": jax.ShapeDtypeStruct((ROWS, SEQ), np.int32)}
    # at shard() (rng) or when the step is traced (the others)
    with pytest.raises(ConfigError, match=f"pipeline.stages = 2: .*{why}.*the `layer_scan` hook"):
        zerojax.shard(lambda: _ScanWith(style), cfg, loss_fn=lm_loss,
                      options=zerojax.EngineOptions(memory_guard=False)).lower_step(shapes)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "scan"])
def test_remat_lowers_the_compiled_temporaries(kind):
    shapes = {"input_ids": jax.ShapeDtypeStruct((ROWS, SEQ), np.int32)}
    plain = zerojax.shard(MODELS[kind], config(0), loss_fn=lm_loss, options=zerojax.EngineOptions(memory_guard=False))
    none = plain.compiled_step(shapes).memory_analysis().temp_size_in_bytes
    # the "remat" case's engine (stage 0, remat_policy "full"): its step is compiled once, cached
    full = feature_run(kind, "remat")[0].compiled_step(shapes).memory_analysis().temp_size_in_bytes
    assert full < none, (none, full)


def test_remat_on_a_model_without_blocks_is_an_error():
    class Flat(nnx.Module):
        def __init__(self):
            self.embed = nnx.Embed(64, 8, rngs=nnx.Rngs(0))

        def __call__(self, ids):
            return self.embed.attend(self.embed(ids))

    with pytest.raises(ValueError, match="remat_policy 'full' needs the model's repeated blocks"):
        zerojax.shard(Flat, config(0, activation_checkpointing={"remat_policy": "full"}), loss_fn=lm_loss)


def test_autotp_with_nothing_to_split_lists_the_parameters():
    class Anonymous(nnx.Module):
        def __init__(self):
            self.table = nnx.Param(np.zeros((64, 8), np.float32))

        def __call__(self, ids):
            return self.table[...][ids] @ self.table[...].T

    with pytest.raises(ConfigError, match="no parameter of this model is split over the tensor axis.*table"):
        zerojax.shard(Anonymous, {**config(0), "tensor_parallel": {"autotp_size": 2}}, loss_fn=lm_loss)


@pytest.mark.slow
def test_checkpoint_reshards_across_stages(list_stage_runs):
    # saved at ZeRO-3 after 2 steps, loaded at ZeRO-1: the third step lands where the plain run's does
    *_, got, resumed = list_stage_runs
    assert_matches_reference(None, "list", reference("list")[1][:2] + resumed, got)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "scan"])
def test_nvme_offload_trains_like_the_plain_model(kind, tmp_path):
    eng, losses = trained(kind, config(3, zero={"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}))
    assert_matches_reference(eng, kind, losses)


@pytest.mark.slow
def test_bf16_stages_agree():
    """bf16 compute, fp32 master: ZeRO-3 against stage 0 of the same bf16 run (the stages change
    only where the fp32 gradient is reduced and how weights are gathered, not the bf16 math)."""
    runs = [trained("scan", {**config(stage), "bf16": {"enabled": True}})[0] for stage in (0, 3)]
    a, b = (jax.tree.map(lambda x: np.asarray(x, np.float32), e.master_params) for e in runs)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-3, err_msg=jax.tree_util.keystr(path))
