"""Engine on 8 virtual CPU devices: ZeRO stages x precisions x accumulation against references,
model-state bytes against the ZeRO paper's table, collectives in the compiled HLO, bad input."""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_mlp import MLP, loss_fn  # noqa: E402 (tests/ is on sys.path under pytest)

from zerojax.api import shard

N = 8          # data-parallel devices (conftest)
ROWS = 32      # global batch: 8 devices x micro 4 x GA 1, or x micro 1 x GA 4
STEPS = 5
LR, WD, CLIP, BETAS = 1e-2, 0.01, 0.1, (0.9, 0.999)


def batches(n=STEPS, rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(rows, 16)).astype(np.float32),
             "y": rng.normal(size=(rows, 16)).astype(np.float32)} for _ in range(n)]


def config(stage, prec, ga, **extra):
    return {
        "train_micro_batch_size_per_gpu": ROWS // N // ga,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8,
                                                  "weight_decay": WD}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": prec == "bf16"},
        "fp16": {"enabled": prec == "fp16"},
        **extra,
    }


@functools.cache
def run(stage, prec, ga):
    """Engine after STEPS steps, its fp32 master weights and metrics (shared by several tests)."""
    eng = shard(MLP(nnx.Rngs(0)), config(stage, prec, ga), loss_fn=loss_fn)
    metrics = [eng.train_step(b) for b in batches()]
    eng.synchronize()
    master = jax.tree.map(lambda a: np.asarray(a, np.float32), eng.master_params)
    stack = {k: np.asarray([m[k] for m in metrics]) for k in ("loss", "grad_norm", "lr", "rows")}
    return eng, master, stack


def padded(a):
    spec = tuple(a.sharding.spec)
    return spec + (None,) * (a.ndim - len(spec))


def assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


# Tolerances. fp32: the runs differ only in the order XLA sums partial gradients (per device,
# per micro-batch, across devices): ~1e-7 relative, which Adam passes on at ~lr x 1e-7 per step.
# bf16 / fp16 (fp32 master weights compared): stages 1-2 change only where the fp32 gradient
# is reduced, so 1e-6 holds too. Accumulating 4 micro-batches instead of one big batch changes
# the compute-dtype gradients themselves: per-micro-batch partial sums are rounded to bf16
# (eps 2^-8) / fp16 (eps 2^-11) at other points. The relative error of a gradient component is
# eps x kappa, kappa = sum|terms| / |sum| (cancellation over rows; bias gradients cancel most);
# Adam's update lr x m/sqrt(v) moves by about that relative amount, so after STEPS steps
# |dw| <= STEPS x lr x eps x kappa. Stage 3 on this tiny batch is partitioned differently by
# GSPMD (with 1 row per device per micro-batch it gathers activations rather than weights),
# which moves bf16 roundings the same way: same bound. kappa is a property of the data, and
# its largest element decides: measured max |dw| / (STEPS x lr x eps) = 4.0 (fp16, GA 4 vs 1)
# and 3.1 (fp16, stage 3 vs 0), 1.1 for bf16, the same under XLA_FLAGS
# --xla_backend_optimization_level=0 and --xla_cpu_max_isa=AVX --xla_cpu_prefer_vector_width=128
# (the summation order is machine-dependent: kappa = 4 failed on a 2-core AMD EPYC).
# We allow kappa = 16: 0.8% / 6% of the total movement STEPS x lr for fp16 / bf16, while a
# dropped micro-batch or a wrong shard moves weights by a sizeable part of it.
KAPPA = 16
TOL = {"fp32": 1e-6, "bf16": STEPS * LR * 2.0**-8 * KAPPA, "fp16": STEPS * LR * 2.0**-11 * KAPPA}
# Loss and gradient norm are scalars: their relative error is the norm-wise one,
# ||dg|| / ||g|| <= eps x kappa_norm, kappa_norm = || |terms| || / ||sum|| (<= the elementwise
# kappa above), plus what the weights moved in earlier steps. fp32: the partial sums over 8
# devices are added in another order, at most 8 roundings of 2^-24. Measured relative errors:
# fp32 5.7e-7 (stage 2 vs 0 at -O0), bf16 7.6e-4 (GA 4 vs 1), fp16 1.2e-4 (stage 3 vs 0, GA 4;
# failed the weights' tolerance 9.8e-5 on the EPYC). kappa_norm = 4 leaves >= 3x
# margin, and stays far below what the features guard: the loss scale (2^16 in fp16), the
# 1 / GA scaling (4x), a dropped micro-batch (measured: 25% of the norm, 4% of the loss in bf16).
KAPPA_NORM = 4
NORM_RTOL = {"fp32": 8 * 2.0**-24 * KAPPA_NORM, "bf16": 2.0**-8 * KAPPA_NORM, "fp16": 2.0**-11 * KAPPA_NORM}


@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_stage0(stage, prec, ga):
    eng, master, m = run(stage, prec, ga)
    _, ref, ref_m = run(0, prec, ga)
    tol = 1e-6 if prec == "fp32" or stage < 3 else TOL[prec]
    assert_trees_close(master, ref, rtol=tol, atol=1e-7 if tol == 1e-6 else tol)
    rtol = NORM_RTOL["fp32" if tol == 1e-6 else prec]  # stages 1-2: only fp32 sums reordered
    np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=rtol)
    np.testing.assert_allclose(m["grad_norm"], ref_m["grad_norm"], rtol=rtol)
    assert eng.global_steps == STEPS and eng.skipped_steps == run(0, prec, ga)[0].skipped_steps
    # the state really is laid out as the stage says
    spec = lambda t: padded(t["l1"]["kernel"])  # noqa: E731
    assert spec(eng.state.params) == ((None, "data") if stage == 3 else (None, None))
    opt = eng.state.opt_state.inner_state if prec == "fp16" else eng.state.opt_state
    assert spec(opt[1].mu) == (None, "data")  # (clip, adam) states
    if prec != "fp32":
        assert spec(eng.state.master) == (None, "data")
        assert eng.state.params["l1"]["kernel"].dtype == (jnp.bfloat16 if prec == "bf16" else jnp.float16)
    else:
        assert eng.state.master is None  # fp32: one copy only


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_matches_one_big_batch(stage, prec):
    _, master, m = run(stage, prec, 4)
    _, ref, ref_m = run(stage, prec, 1)
    tol = TOL[prec]
    assert_trees_close(master, ref, rtol=tol, atol=tol)
    # reported loss = mean of micro-batch losses = the big batch's loss (equal-size micro-batches);
    # grad_norm checks the 1/GA scaling, to which Adam's update itself is nearly blind.
    np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=NORM_RTOL[prec])
    np.testing.assert_allclose(m["grad_norm"], ref_m["grad_norm"], rtol=NORM_RTOL[prec])
    np.testing.assert_array_equal(m["rows"], ROWS)  # integer aux metrics are summed over micro-batches


def test_stage0_fp32_matches_plain_optax():
    _, master, m = run(0, "fp32", 1)
    init = nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))
    dev = jax.devices()[0]
    params = jax.device_put(init, dev)

    def f(p, b):
        h = jax.nn.gelu(b["x"] @ p["l1"]["kernel"] + p["l1"]["bias"])
        return jnp.mean((h @ p["l2"]["kernel"] + p["l2"]["bias"] - b["y"]) ** 2)

    # DeepSpeed clips with max / (norm + 1e-6), optax with max / norm: a uniform gradient scale
    # that differs by ~1e-6 relative, to which Adam's update is invariant up to eps / |g|.
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=1e-8, weight_decay=WD))
    state = tx.init(params)

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(f)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    ref_losses = []
    for b in batches():
        params, state, loss = step(params, state, jax.device_put(b, dev))
        ref_losses.append(loss)
    assert_trees_close(master, params, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m["loss"], ref_losses, rtol=1e-6)
    np.testing.assert_allclose(m["lr"], LR)


@pytest.mark.parametrize("accum, grad_bytes", [("bf16", 2), ("fp32", 4)])
def test_model_state_bytes_follow_zero_table(accum, grad_bytes):
    psi = sum(x.size for x in jax.tree.leaves(nnx.state(MLP(nnx.Rngs(0)), nnx.Param)))
    # The ZeRO paper's table (2-byte weights and gradients, K = 12 bytes of fp32 master + Adam):
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N, 3: 16 * psi / N}
    # Our gradients are the accumulator, in data_types.grad_accum_dtype (fp32 by default): the
    # table with 2 gradient bytes replaced by `grad_bytes`.
    extra = (grad_bytes - 2) * psi
    expected = {0: paper[0] + extra, 1: paper[1] + extra, 2: paper[2] + extra / N, 3: paper[3] + extra / N}
    for stage in range(4):
        eng = shard(MLP(nnx.Rngs(0)), config(stage, "bf16", 1, data_types={"grad_accum_dtype": accum}),
                    loss_fn=loss_fn)
        report = eng.memory_report()
        assert report["model_states"] == pytest.approx(expected[stage], rel=0.05), (stage, str(report))
        assert report["params"] == pytest.approx(2 * psi / (N if stage == 3 else 1), rel=0.01)
        assert report["master"] == pytest.approx(4 * psi / (N if stage >= 1 else 1), rel=0.01)
        assert "fp32 master" in str(report)


def _collectives(hlo: str):
    """[(op, result shape text)] for every all-reduce / reduce-scatter / all-gather."""
    pat = r"= (\(?[^=]*?\)?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\("
    return [(m.group(2), m.group(1)) for m in re.finditer(pat, hlo)]


def test_compiled_collectives_per_stage():
    """What XLA's CPU backend emits for the GA=1 fp32 step (8 devices, data-sharded batch):

    - stage 0: one all-reduce of the full gradients (a tuple of every leaf); no all-gather.
    - stage 1: the same all-reduce, then all-gathers of the updated (sharded) master into the
      replicated params.
    - stage 2: the gradients are all-reduced then sliced (all-reduce + dynamic-slice): the CPU
      backend has no reduce-scatter pass, so there is no `reduce-scatter` op; on GPU XLA's
      ReduceScatterCreator fuses the pair. The updated shards are all-gathered into the params.
    - stage 3: the sharded weights are all-gathered for the forward pass.
    With GA > 1, XLA (WhileLoopAllReduceCodeMotion) hoists the gradient reduction out of the
    scan: a full-size partial sum per device and one all-reduce after the loop.
    """
    shapes = {"x": jax.ShapeDtypeStruct((ROWS, 16), jnp.float32),
              "y": jax.ShapeDtypeStruct((ROWS, 16), jnp.float32)}
    ops = {s: _collectives(run(s, "fp32", 1)[0].compiled_step(shapes).as_text()) for s in range(4)}
    weight = ("[16,32]", "[32,16]")
    full_grads = lambda o: any(op == "all-reduce" and all(w in shp for w in weight) for op, shp in o)  # noqa: E731
    gathers = lambda o: {shp.split("{")[0] for op, shp in o if op == "all-gather"}  # noqa: E731

    assert full_grads(ops[0]) and not gathers(ops[0])
    assert full_grads(ops[1]) and gathers(ops[1]) >= {"f32[16,32]", "f32[32,16]"}
    # stage 2: gradients reduced (one collective per weight or a tuple), then sliced to shards
    hlo2 = run(2, "fp32", 1)[0].compiled_step(shapes).as_text()
    assert any(op in ("all-reduce", "reduce-scatter") and "[16,32]" in shp for op, shp in ops[2])
    assert "dynamic-slice" in hlo2 or any(op == "reduce-scatter" for op, _ in ops[2])
    assert gathers(ops[2]) >= {"f32[16,32]", "f32[32,16]"}
    # stage 3: weights gathered on use
    assert gathers(ops[3]) >= {"f32[16,32]", "f32[32,16]"}


def test_memory_report_has_compiled_peak():
    eng = run(2, "bf16", 4)[0]
    report = eng.memory_report()
    assert report["compiled_peak"] and report["compiled_peak"] > 0
    assert report["host"] == 0


def test_eval_step_and_model_view():
    eng = run(1, "bf16", 1)[0]
    b = batches(1, seed=7)[0]
    loss = eng.eval_step(b)
    assert loss.dtype == jnp.float32
    model = eng.model  # fp32 master weights
    assert model.l1.kernel[...].dtype == jnp.float32
    np.testing.assert_allclose(model.l1.kernel[...], run(1, "bf16", 1)[1]["l1"]["kernel"])
    # eval runs the bf16 compute params: close to the fp32 model's loss at bf16 precision
    np.testing.assert_allclose(loss, loss_fn(model, b)[0], rtol=2e-2)


def test_wrong_batch_size_is_a_clear_error():
    eng = run(0, "fp32", 4)[0]
    with pytest.raises(ValueError, match=r"leading dim 31.*train_batch_size=32.*"
                                         r"train_micro_batch_size_per_gpu=1 x gradient_accumulation_steps=4 "
                                         r"x world size=8"):
        eng.train_step({"x": np.zeros((31, 16), np.float32), "y": np.zeros((31, 16), np.float32)})


def test_nan_loss_under_bf16_skips_and_raises_naming_the_step():
    eng, master, _ = run(0, "bf16", 1)
    bad = batches(1, seed=3)[0]
    bad["x"][0, 0] = np.nan
    eng.train_step(bad)  # step 6: dispatched; checked lazily
    with pytest.raises(FloatingPointError, match=r"step 6: the loss .* not finite.*learning rate"):
        eng.synchronize()
    # the NaN was not trained on
    assert_trees_close(jax.tree.map(np.asarray, eng.master_params), master, rtol=0, atol=0)
    assert eng.skipped_steps == 1 and eng.global_steps == 6
    eng.train_step(batches(1, seed=4)[0])
    eng.synchronize()
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.tree.map(np.asarray, eng.master_params)))


def test_callable_model_is_initialised_sharded():
    """A zero-argument callable: traced abstractly, then jitted with out_shardings."""
    eng = shard(lambda: MLP(nnx.Rngs(0)), config(3, "bf16", 1), loss_fn=loss_fn)
    ref = nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(0)), nnx.Param))
    assert_trees_close(jax.tree.map(np.asarray, eng.master_params), ref, rtol=0, atol=0)
    assert padded(eng.state.master["l1"]["kernel"]) == (None, "data")
    assert padded(eng.state.params["l2"]["bias"]) == ("data",)


def test_fp16_overflow_at_minimum_scale_raises_deepspeeds_error():
    from zerojax.precision import MIN_SCALE_ERROR

    fp16 = {"enabled": True, "initial_scale_power": 0, "min_loss_scale": 1, "hysteresis": 1}
    eng = shard(MLP(nnx.Rngs(0)), {**config(0, "fp16", 1), "fp16": fp16}, loss_fn=loss_fn)
    bad = batches(1)[0]
    bad["x"] *= 1e5  # fp16 activations overflow to inf at loss scale 1 = the minimum
    m = eng.train_step(bad)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 1.0
    with pytest.raises(FloatingPointError, match="step 1: " + re.escape(MIN_SCALE_ERROR)):
        eng.synchronize()


def test_linen_module_through_nnx_bridge():
    import flax.linen as nn
    from flax.nnx import bridge

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(x)))

    model = bridge.ToNNX(LinenMLP(), rngs=nnx.Rngs(0))
    bridge.lazy_init(model, jnp.ones((1, 16)))

    def linen_loss(m, b):
        return jnp.mean((m(b["x"]).astype(jnp.float32) - b["y"]) ** 2)

    eng = shard(model, config(2, "fp32", 1), loss_fn=linen_loss)
    losses = [float(eng.train_step(b)["loss"]) for b in batches(3, seed=1) * 2]
    assert losses[-1] < losses[2]  # same three batches again: lower loss after training
    assert all(padded(x) == (None, None) for x in jax.tree.leaves(eng.state.params) if x.ndim == 2)


def test_fp32_compute_under_bf16_config_is_named_in_a_warning():
    """DeepSpeed's bf16 computes in bf16; a zerojax model computes in its own dtype, so a model
    left at dtype=float32 under a bf16 config is told once (and one built in bf16 is not)."""
    import warnings

    from zerojax.engine.engine import Engine
    from zerojax.models import GPT2, GPT2Config

    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    tiny = GPT2Config.named("tiny")
    with pytest.warns(UserWarning, match=r"computes in float32 \(its dtype\): build it with dtype=jnp.bfloat16"):
        Engine(lambda: GPT2(tiny, rngs=nnx.Rngs(0)), cfg, loss_fn=lambda m, b: m(b["input_ids"]).mean(), abstract=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Engine(lambda: GPT2(tiny, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), cfg,
              loss_fn=lambda m, b: m(b["input_ids"]).mean(), abstract=True)


def test_a_callable_returning_a_built_model_is_placed_not_traced_into_constants():
    # `shard(lambda: model, ...)` where model exists already (the docs' LoRA / PPO critic pattern):
    # its weights must reach the devices as a built model's do; traced into the init program they
    # became constants of it (14 GB for a MoE's layers: a compile that did not end in minutes)
    model = MLP(nnx.Rngs(3))
    weights = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    previous = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 64)  # any weight matrix of MLP is larger
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*constants were captured.*")
            eng = shard(lambda: model, config(2, "fp32", 1), loss_fn=loss_fn)
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", previous)
    placed = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(eng.model, nnx.Param))}
    assert placed.keys() == weights.keys()
    for k, w in weights.items():
        np.testing.assert_array_equal(placed[k], w, err_msg=str(k))
    # a callable that initialises its model still does so in one sharded program: a fresh model
    fresh = shard(lambda: MLP(nnx.Rngs(4)), config(2, "fp32", 1), loss_fn=loss_fn)
    expected = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(MLP(nnx.Rngs(4)), nnx.Param))}
    for k, v in nnx.to_flat_state(nnx.state(fresh.model, nnx.Param)):
        np.testing.assert_allclose(np.asarray(v), expected[k], rtol=1e-6, err_msg=str(k))
