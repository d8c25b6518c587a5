"""Speed options: the remat policies that keep named activations, partial unrolling of
the layer scan, activation_checkpointing.remat_policy, and putting XLA flags into effect.

That a policy or an unroll leaves the loss and gradients as without remat is checked with the
other policies in test_gpt2.py (test_remat_matches_no_remat); here, *what* each policy keeps, from
JAX's own list of saved residuals.
"""
import collections
import contextlib
import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.config import REMAT_POLICY_NAMES, remat_policy_for
from zerojax.models.gpt2 import GPT2, REMAT_POLICIES, GPT2Config, gpt2_loss
from zerojax.xla_flags import apply_xla_flags, merged_xla_flags

CFG = GPT2Config.named("tiny")  # 2 layers, d 64, 4 heads of 16, vocab 256
B, T = 2, 16


def _saved_residual_shapes(policy, config=CFG, counted=False):
    """The shapes JAX saves for the backward pass, as it prints them (f32[2,2,16,3,4,16] ...):
    a set, or with `counted` how many residuals have each shape."""
    model = GPT2(config, rngs=nnx.Rngs(0), remat_policy=policy)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((B, T), jnp.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            lambda s: gpt2_loss(nnx.merge(graphdef, s), {"input_ids": ids})[0], state)
    shapes = [line.split()[0].split("[", 1)[1].rstrip("]") for line in out.getvalue().splitlines() if "[" in line]
    return collections.Counter(shapes) if counted else set(shapes)


def test_policies_keep_what_they_name():
    L, H, Dh = CFG.n_layer, CFG.n_head, CFG.head_dim
    # stacked over the layer scan: [layers, batch, seq, ...]
    qkv, attn = f"{L},{B},{T},3,{H},{Dh}", f"{L},{B},{T},{H},{Dh}"
    kept = {p: _saved_residual_shapes(p) for p in ("full", "save_qkv", "save_attention", "save_qkv_attention",
                                                   "save_attention_block")}
    assert qkv not in kept["full"] and attn not in kept["full"]
    assert qkv in kept["save_qkv"] and attn not in kept["save_qkv"]
    assert attn in kept["save_attention"] and qkv not in kept["save_attention"]
    assert {qkv, attn} <= kept["save_qkv_attention"]
    # and the residual stream after the attention half, [layers, batch, seq, d] (as is the layer
    # input every policy keeps: hence counted, not looked up)
    resid = f"{L},{B},{T},{CFG.n_embd}"
    count = {p: _saved_residual_shapes(p, counted=True)[resid] for p in ("save_qkv_attention", "save_attention_block")}
    assert {qkv, attn} <= kept["save_attention_block"]
    assert count["save_attention_block"] == count["save_qkv_attention"] + 1


def test_gelu_new_is_jaxs_gelu_with_a_backward_that_keeps_only_its_input():
    """The model's gelu_new (a custom VJP, so that XLA can fold it into the c_fc gemm's epilogue):
    the same values as jax.nn.gelu's tanh form, the same gradient in float64 (JAX's own autodiff
    of jax.nn.gelu as the reference), and for the backward it keeps its input alone where
    autodiff keeps intermediates of the tanh as well."""
    from zerojax.models.gpt2 import gelu_new

    with jax.enable_x64(True):
        x = jnp.linspace(-9.0, 9.0, 4001, dtype=jnp.float64)
        np.testing.assert_array_equal(gelu_new(x), jax.nn.gelu(x, approximate=True))
        grad = jax.grad(lambda x: gelu_new(x).sum())(x)
        want = jax.grad(lambda x: jax.nn.gelu(x, approximate=True).sum())(x)
        np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-13)
    # bf16: the backward's fp32 slope is closer to float64's than autodiff's bf16 chain
    xb = jnp.linspace(-6.0, 6.0, 2001, dtype=jnp.float32).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        exact = np.asarray(jax.grad(lambda x: jax.nn.gelu(x, approximate=True).sum())(
            xb.astype(jnp.float64)))
    ours = np.asarray(jax.grad(lambda x: gelu_new(x).astype(jnp.float32).sum())(xb), np.float64)
    assert np.abs(ours - exact).max() <= 2 ** -8 * np.abs(exact).max()

    def saved(fn):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(lambda x: fn(x).sum(), jnp.ones((3, 5)))
        return [line for line in out.getvalue().splitlines() if "[" in line]

    assert len(saved(gelu_new)) == 1 and "f32[3,5]" in saved(gelu_new)[0]
    assert len(saved(lambda x: jax.nn.gelu(x, approximate=True))) > 1


def test_jax_names_its_cudnn_attention_forward_as_the_policies_expect():
    """The save_*attention policies find cuDNN's attention forward by its primitive's name."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    from zerojax.models.gpt2 import CUDNN_ATTENTION_FORWARD

    assert cudnn_attention._dot_product_attention_fwd_p_wrapper.name == CUDNN_ATTENTION_FORWARD


@pytest.fixture
def cudnn_attention_stand_in(monkeypatch):
    """cuDNN's attention cannot run here: a stand-in of the same shape takes its place -- a custom
    VJP whose forward is a primitive of cuDNN's name returning the output and fp32 softmax
    statistics [B, H, T], whose backward needs q, k, v, both. Only traced, never run."""
    from jax.extend.core import Primitive

    from zerojax.models.gpt2 import CUDNN_ATTENTION_FORWARD

    fwd_p = Primitive(CUDNN_ATTENTION_FORWARD)
    fwd_p.multiple_results = True
    fwd_p.def_abstract_eval(lambda q, k, v: (jax.core.ShapedArray(q.shape, q.dtype),
                                             jax.core.ShapedArray((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))

    @jax.custom_vjp
    def attention(q, k, v):
        return fwd_p.bind(q, k, v)[0]

    def attention_fwd(q, k, v):
        out, stats = fwd_p.bind(q, k, v)
        return out, (q, k, v, out, stats)

    def attention_bwd(res, g):
        q, k, v, out, stats = res
        return g + out + stats.sum(), k, v

    attention.defvjp(attention_fwd, attention_bwd)
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **_: attention(q, k, v))
    return CUDNN_ATTENTION_FORWARD


@pytest.mark.parametrize("policy, forward_runs, outputs_kept", [
    ("full", 2, 0), ("save_qkv", 2, 0), ("save_attention", 1, 1), ("save_qkv_attention", 1, 1)])
def test_attention_policies_keep_cudnn_attention_from_running_again(cudnn_attention_stand_in, policy,
                                                                    forward_runs, outputs_kept):
    """Read from JAX's own gradient program and saved-residual list: under "full" and "save_qkv"
    the attention forward appears twice in the layer scans' bodies (forward, then again in the
    backward), under the policies that save the attention once; and those keep the attention
    output exactly once (not also under its name) plus the statistics [L, B, H, T]."""
    model = GPT2(CFG, rngs=nnx.Rngs(0), remat_policy=policy, attention_impl="cudnn")
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((B, T), jnp.int32)
    loss = lambda s: gpt2_loss(nnx.merge(graphdef, s), {"input_ids": ids})[0]  # noqa: E731
    grad_program = str(jax.make_jaxpr(jax.grad(loss))(state))
    assert grad_program.count(f"= {cudnn_attention_stand_in} ") == forward_runs, grad_program[:2000]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, state)
    shapes = [line.split()[0].split("[", 1)[1].rstrip("]") for line in out.getvalue().splitlines() if "[" in line]
    L, H, Dh = CFG.n_layer, CFG.n_head, CFG.head_dim
    assert shapes.count(f"{L},{B},{T},{H},{Dh}") == outputs_kept, shapes
    assert shapes.count(f"{L},{B},{H},{T}") == outputs_kept, shapes


@pytest.mark.slow
def test_partial_dots_matches_no_remat_and_keeps_dots_on_its_layers_only():
    """"dots_2" on a 4-layer model: loss and gradients as without remat (the fp32 reference; only
    the recompute order differs, so fp32 rounding: rtol 1e-5 as test_gpt2's remat checks), and
    JAX's saved residuals: the MLP's up projection [B, T, 4d] is kept for two layers (the dots
    scan: stacked [2, ...]), not for all four (plain "dots": [4, ...]) nor none ("full")."""
    cfg4 = GPT2Config.named("tiny", n_layer=4)
    ids = jnp.zeros((B, T), jnp.int32).at[:, ::3].set(7)

    def loss_and_grads(policy):
        graphdef, state = nnx.split(GPT2(cfg4, rngs=nnx.Rngs(0), remat_policy=policy))
        f = lambda s: gpt2_loss(nnx.merge(graphdef, s), {"input_ids": ids})[0]  # noqa: E731
        return jax.jit(jax.value_and_grad(f))(state)  # one program (op by op: 2 CPU s more a policy)

    (ref, ref_g), (got, got_g) = loss_and_grads(None), loss_and_grads("dots_2")
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got_g, ref_g)
    mlp_up = lambda layers: f"{layers},{B},{T},{cfg4.mlp_dim}"  # noqa: E731
    kept = {p: _saved_residual_shapes(p, cfg4) for p in ("full", "dots", "dots_2")}
    assert mlp_up(2) in kept["dots_2"] and mlp_up(4) not in kept["dots_2"]
    assert mlp_up(4) in kept["dots"] and not {mlp_up(2), mlp_up(4)} & kept["full"]
    for bad in ("dots_1", "dots_3"):  # each of the two scans needs two layers or more
        with pytest.raises(ValueError, match="k must be 2 .. 2"):
            GPT2(cfg4, rngs=nnx.Rngs(0), remat_policy=bad)


def test_scan_unroll_is_checked():
    with pytest.raises(ValueError, match="scan_unroll=0"):
        GPT2(CFG, rngs=nnx.Rngs(0), scan_unroll=0)


# ------------------------------------------------------------------ activation_checkpointing.remat_policy


def test_config_names_are_the_models_policies():
    assert [p or "none" for p in REMAT_POLICIES] == list(REMAT_POLICY_NAMES)


def _load(section):
    cfg = {"train_batch_size": 8}
    if section is not None:
        cfg["activation_checkpointing"] = section
    return zerojax.load_config(cfg, world_size=1)


@pytest.mark.parametrize("section,policy", [
    (None, None), ({}, "full"), ({"cpu_checkpointing": True}, "offload"),
    ({"remat_policy": "save_qkv"}, "save_qkv"), ({"remat_policy": "DOTS"}, "dots"),
    ({"remat_policy": "dots_24"}, "dots_24"),
    ({"remat_policy": "none"}, None), ({"remat_policy": "offload", "cpu_checkpointing": True}, "offload")])
def test_remat_policy_for(section, policy):
    cfg = _load(section)
    assert remat_policy_for(cfg) == policy
    assert zerojax.load_config(cfg.to_dict(), world_size=1) == cfg


def test_unset_extension_key_stays_out_of_to_dict():
    # DeepSpeed 0.19.8's activation_checkpointing model forbids unknown keys: a dict written for it
    # must not carry the zerojax-only key unless the user set it
    assert "remat_policy" not in _load({}).to_dict()["activation_checkpointing"]
    assert _load({"remat_policy": "dots"}).to_dict()["activation_checkpointing"]["remat_policy"] == "dots"


@pytest.mark.parametrize("section,words", [
    ({"remat_policy": "dot"}, ["activation_checkpointing.remat_policy", "save_qkv"]),
    ({"remat_policy": "dots_0"}, ["activation_checkpointing.remat_policy", "save_qkv"]),
    ({"remat_policy": "dots", "cpu_checkpointing": True}, ["remat_policy", "cpu_checkpointing", "remove one"])])
def test_remat_policy_errors(section, words):
    with pytest.raises(zerojax.ConfigError) as e:
        _load(section)
    for w in words:
        assert w in str(e.value)


# ------------------------------------------------------------------ XLA flags


def test_merged_xla_flags_keeps_the_users_value():
    assert (merged_xla_flags("--xla_a=1 --xla_force_host_platform_device_count=8", ["--xla_a=2", "--xla_b=true"])
            == "--xla_a=1 --xla_force_host_platform_device_count=8 --xla_b=true")
    env = {}
    assert apply_xla_flags(["--xla_b=true"], environ=env) == "--xla_b=true" == env["XLA_FLAGS"]
    with pytest.raises(ValueError, match="xla_b"):
        merged_xla_flags("", ["xla_b=true"])


def test_apply_xla_flags_after_the_backend_started_is_an_error():
    jax.devices()  # started (conftest's 8 CPU devices)
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="already started"):
        apply_xla_flags(["--xla_gpu_enable_latency_hiding_scheduler=true"])
    assert os.environ.get("XLA_FLAGS") == before
    # flags already in effect: nothing to apply, no error
    assert apply_xla_flags([]) == (before or "")


def test_the_step_time_model_knows_every_remat_policy_of_the_model():
    """zerojax.planning.estimate's training FLOPs cover every policy models.gpt2 offers (the planner predicts
    a step for the policy a config names), ordered by what each keeps: a policy that saves a
    superset recomputes no more. Reference: PaLM's 6N + 12 L d T for no remat, plus one forward of
    the blocks (2 x layer params + 4 L d T) for "full"."""
    from zerojax.models.gpt2 import REMAT_POLICIES
    from zerojax.planning import estimate as est

    shape = est.ModelShape(params=774_030_080, layer_params=36 * 12 * 1280**2, n_layer=36, d_model=1280,
                           seq_len=1024)
    flops = {p: est.train_flops_per_token(shape, p) for p in REMAT_POLICIES}
    attn = 36 * 1280 * 1024
    assert flops[None] == 6 * shape.params + 12 * attn
    assert flops["full"] == flops[None] + 2 * shape.layer_params + 4 * attn
    assert flops[None] < flops["save_qkv_attention"] < flops["save_qkv"] < flops["full"]
    assert flops["save_qkv_attention"] < flops["save_attention"] < flops["full"]
    # only the MLP half rerun: one d^2 matmul per layer (the attention output projection) less
    assert flops["save_attention_block"] == flops["save_qkv_attention"] - 2 * 36 * 1280**2
    assert set(est.REMAT_RECOMPUTE) >= set(REMAT_POLICIES)
    # "dots_<k>": k layers "dots", the rest "full": the two ends' difference, in steps of 1 / 36
    for k in (2, 18, 34):
        assert est.train_flops_per_token(shape, f"dots_{k}") == pytest.approx(
            flops["full"] + k / 36 * (flops["dots"] - flops["full"]), rel=1e-12)


# ------------------------------------------------------------------ fused cross entropy


def _ce_reference(x, w, targets, vocab_size):
    """float64 NumPy: summed cross entropy of x @ w[:vocab_size].T and its gradients (softmax minus
    one-hot, rows with target -100 left out; wte's padding rows get none)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    logits = x @ w[:vocab_size].T
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    valid = np.asarray(targets) != -100
    t = np.where(valid, targets, 0)
    onehot = np.eye(vocab_size)[t]
    g = np.where(valid[..., None], np.exp(logits - lse[..., None]) - onehot, 0.0)
    total = np.where(valid, lse - np.take_along_axis(logits, t[..., None], -1)[..., 0], 0.0).sum()
    dw = np.zeros_like(w)
    dw[:vocab_size] = np.einsum("btv,btd->vd", g, x)
    return total, g @ w[:vocab_size], dw


@pytest.mark.slow
def test_fused_cross_entropy_against_float64():
    """fused_cross_entropy (value, and gradients through its custom VJP with a cotangent of 3)
    against float64 NumPy: padded vocabulary (40 rows, 37 real), ignored targets, 11 positions in
    chunks of 4 (a padded last chunk). fp32: each logit and sum is within a few ulp (2^-23 relative)
    of float64 over at most 37 + 11 terms, so 1e-5 of the largest entry. bf16 operands (the
    reference taken on the same rounded operands): the logits' gradient is rounded to bf16 once
    before each gemm and the results once after (2 x 2^-8 relative), so 2^-6 of the largest
    entry, the bound test_gpt2's lm_head check derives. The jitted gradient never holds the
    [B, T, V] fp32 logits (the point of fusing), which the plain head's gradient does."""
    from zerojax.models.gpt2 import fused_cross_entropy

    rng = np.random.default_rng(0)
    V, vocab, Bx, Tx, d = 40, 37, 2, 11, 16
    x = jnp.asarray(rng.normal(size=(Bx, Tx, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, d)) * 0.3, jnp.float32).at[vocab:].set(0.0)
    targets = jnp.asarray(rng.integers(0, vocab, (Bx, Tx)), jnp.int32).at[0, 3:6].set(-100)

    def loss(x, w):
        return 3.0 * fused_cross_entropy(x, w, targets, vocab, 4)

    ref_total, ref_dx, ref_dw = _ce_reference(x, w, targets, vocab)
    total, (dx, dw) = jax.value_and_grad(loss, (0, 1))(x, w)
    assert abs(float(total) - 3 * ref_total) <= 1e-5 * abs(3 * ref_total)
    assert abs(float(fused_cross_entropy(x, w, targets, vocab, 4)) - ref_total) <= 1e-5 * abs(ref_total)
    for got, ref in ((dx, 3 * ref_dx), (dw, 3 * ref_dw)):
        assert np.abs(np.asarray(got) - ref).max() <= 1e-5 * np.abs(ref).max()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    _, ref_dx16, ref_dw16 = _ce_reference(xb.astype(jnp.float32), wb.astype(jnp.float32), targets, vocab)
    for got, ref in zip(jax.grad(loss, (0, 1))(xb, wb), (3 * ref_dx16, 3 * ref_dw16), strict=True):
        assert got.dtype == jnp.bfloat16
        assert np.abs(np.asarray(got, np.float32) - ref).max() <= 2.0**-6 * np.abs(ref).max()
    whole = f"f32[{Bx},{Tx},{V}]"
    fused_hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
    plain = lambda x, w: 3.0 * jax.nn.logsumexp(jnp.einsum("btd,vd->btv", x, w), -1).sum()  # noqa: E731
    assert whole not in fused_hlo and whole in jax.jit(jax.grad(plain, (0, 1))).lower(x, w).compile().as_text()


@pytest.mark.slow
def test_planner_fits_the_fastest_remat_policy_to_a_budget():
    """planner.fit_remat_policy on a 5-layer GPT-2: each budget gets the first policy of the
    ladder (fastest first: dots, save_attention_block, save_qkv_attention, save_attention, full) whose compiled step
    fits, checked against step_memory of each policy (an independent compile each); with the
    partial-dots family on the ladder, the "dots_<k>" of the largest k that fits (k and k + 1
    compiled on their own); a plan naming it writes the policy into activation_checkpointing."""
    from zerojax.planning import planner

    cfg3 = GPT2Config.named("tiny", n_layer=5)
    factory = lambda remat_policy=None: GPT2(cfg3, rngs=nnx.Rngs(0), remat_policy=remat_policy)  # noqa: E731
    ds = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    names = ("full", "save_attention", "save_qkv_attention", "save_attention_block", "dots_2", "dots_3", "dots")
    peak = {p: planner.step_memory(factory, ds, 128, 8, remat=p).peak for p in names}
    assert (max(peak["full"], peak["save_attention"]) < peak["save_qkv_attention"] < peak["save_attention_block"]
            < peak["dots"]), peak
    assert peak["full"] < peak["dots_2"] < peak["dots_3"] < peak["dots"], peak
    fit = lambda budget, **kw: planner.fit_remat_policy(factory, ds, budget, 128, cfg3.n_layer, **kw)  # noqa: E731
    ladder = ("dots", "save_attention_block", "save_qkv_attention", "save_attention", "full")
    assert planner.REMAT_LADDER == ladder
    # (on CPU "full" may peak above "save_attention": XLA's schedule, not what each keeps)
    budgets = sorted({peak[p] - d for p in ladder for d in (0, 1)})
    picked = [fit(b) for b in budgets]
    assert picked == [next((p for p in ladder if peak[p] <= b), "full") for b in budgets], (budgets, picked)
    assert {"dots", "save_attention_block", "save_qkv_attention", "save_attention"} <= set(picked)
    dots_k = ("dots", "dots_*", "full")
    assert fit(peak["dots_3"], ladder=dots_k) == "dots_3" and fit(peak["dots_3"] - 1, ladder=dots_k) == "dots_2"
    assert fit(peak["dots_2"] - 1, ladder=dots_k) == "full"
    plan = planner.Plan(stage=0, micro_batch=8, remat="dots_2")
    assert plan.config_patch()["activation_checkpointing"]["remat_policy"] == "dots_2"
    assert remat_policy_for(zerojax.load_config(plan.apply({"train_batch_size": 8}), world_size=1)) == "dots_2"
