"""GPT-2: parity with Hugging Face's GPT2LMHeadModel through safetensors, remat, dtypes, counts."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import GPT2, GPT2Config, chunked_gpt2_loss, flops_per_token, gpt2_loss, num_params
from zerojax.models.hf import gpt2_from_hf, load_hf, save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# a random tiny config, deliberately not the named one: odd vocab, MLP width != 4d is not GPT-2
CFG = GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=3, n_head=4)


def _hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(hf_cfg).eval()


def _ids(cfg, batch=2, seq=20, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32)


def _hf_logits_loss(hf, ids):
    with torch.no_grad():
        t = torch.from_numpy(ids.astype(np.int64))
        out = hf(input_ids=t, labels=t)
    return out.logits.numpy(), float(out.loss)


def _ours_logits_loss(model, ids):
    ids = jnp.asarray(ids)
    return np.asarray(model(ids)), float(gpt2_loss(model, {"input_ids": ids})[0])


def test_hf_to_zerojax_parity(tmp_path):
    hf = _hf_model(CFG, seed=1)
    # perturb LN params and biases so that HF's ones/zeros init does not hide a layout mistake
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, _ = load_hf(str(tmp_path))
    assert config == CFG
    model = gpt2_from_hf(str(tmp_path))
    ids = _ids(CFG)
    ref_logits, ref_loss = _hf_logits_loss(hf, ids)
    logits, loss = _ours_logits_loss(model, ids)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert abs(loss - ref_loss) < 1e-5


def test_zerojax_to_hf_parity(tmp_path):
    model = GPT2(CFG, rngs=nnx.Rngs(3))
    save_hf(nnx.state(model), CFG, str(tmp_path))
    from safetensors.numpy import load_file
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys  # tied, as HF saves it
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ids = _ids(CFG, seed=1)
    ref_logits, ref_loss = _hf_logits_loss(hf, ids)
    logits, loss = _ours_logits_loss(model, ids)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert abs(loss - ref_loss) < 1e-5
    # and back: our export re-imported is bit-identical
    _, params = load_hf(str(tmp_path))
    ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), ours, params)


def test_hf_init_statistics():
    # HF's init: normal(0.02), c_proj scaled by 1/sqrt(2 n_layer), biases 0, LN 1/0
    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=8, n_head=4)
    m = GPT2(cfg, rngs=nnx.Rngs(0))
    assert abs(float(jnp.std(m.wte[...])) - 0.02) < 1e-3
    assert abs(float(jnp.std(m.h.mlp.c_fc.kernel[...])) - 0.02) < 1e-3
    assert abs(float(jnp.std(m.h.attn.c_proj.kernel[...])) - 0.02 / np.sqrt(16)) < 2e-4
    assert abs(float(jnp.std(m.h.mlp.c_proj.kernel[...])) - 0.02 / np.sqrt(16)) < 2e-4
    assert not np.any(np.asarray(m.h.attn.c_attn.bias[...]))
    assert np.all(np.asarray(m.h.ln_1.scale[...]) == 1) and np.all(np.asarray(m.ln_f.scale[...]) == 1)


def test_param_count_matches_hf():
    for cfg in (CFG, GPT2Config.named("tiny")):
        model = GPT2(cfg, rngs=nnx.Rngs(0))
        ours = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        hf = _hf_model(cfg).num_parameters()
        # wte holds padded_vocab_size rows; the padding rows are not HF's (nor counted in num_params)
        padding = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd
        assert ours - padding == hf == num_params(cfg)
    # the released sizes, from HF's own model cards: gpt2 124,439,808
    assert num_params(GPT2Config.named("small")) == 124_439_808


def test_flops_per_token_large():
    cfg = GPT2Config.named("large")
    L, d, V, P, T = 36, 1280, 50257, 1024, 1024
    n = V * d + P * d + L * (12 * d * d + 13 * d) + 2 * d  # all params, wte counted once
    expected = 6 * n + 12 * L * d * T
    assert flops_per_token(cfg, T) == expected
    assert round(expected / 1e9, 2) == 5.21  # ANCHORS.md


def test_logical_axis_names():
    model = nnx.eval_shape(lambda: GPT2(CFG, rngs=nnx.Rngs(0)))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    P = jax.sharding.PartitionSpec
    assert specs["wte"] == P("vocab", "embed") and specs["wpe"] == P("pos", "embed")
    assert specs["h"]["attn"]["c_attn"]["kernel"] == P("layers", "embed", "qkv", "heads", "head_dim")
    assert specs["h"]["mlp"]["c_fc"]["kernel"] == P("layers", "embed", "mlp")
    assert specs["ln_f"]["scale"] == P("embed")
    shapes = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(shapes), strict=True):
        assert len(spec) == leaf.ndim
    for path, spec in jax.tree_util.tree_leaves_with_path(specs):
        if path[0].key == "h":
            assert spec[0] == "layers" and _leaf(shapes, path).shape[0] == CFG.n_layer


def _leaf(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


@functools.cache
def _reference_loss_and_grads():
    return _loss_and_grads(GPT2(CFG, rngs=nnx.Rngs(0)), jnp.asarray(_ids(CFG, seq=16)))


def _loss_and_grads(model, ids):
    gd, st = nnx.split(model)
    f = jax.jit(jax.value_and_grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0]))
    return f(st)


# the last case also unrolls the layer scan (scan_unroll): a loop layout, the same function
@pytest.mark.parametrize("policy,unroll", [("full", 1), ("dots", 1), ("offload", 1), ("save_qkv", 1),
                                           ("save_attention", 1), ("save_attention_block", 1),
                                           ("save_qkv_attention", 2)])
@pytest.mark.slow
def test_remat_matches_no_remat(policy, unroll):
    ids = jnp.asarray(_ids(CFG, seq=16))
    ref_loss, ref_g = _reference_loss_and_grads()
    loss, g = _loss_and_grads(GPT2(CFG, rngs=nnx.Rngs(0), remat_policy=policy, scan_unroll=unroll), ids)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, ref_g)


def test_offload_policy_moves_layer_inputs_to_host():
    model = GPT2(CFG, rngs=nnx.Rngs(0), offload_activations=True)
    assert model.remat_policy == "offload"
    gd, st = nnx.split(model)
    ids = jnp.asarray(_ids(CFG, seq=16))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0]))(st))
    # the scan's saved residual is the [layers, B, T, d] stack of block inputs, in host memory
    assert f"f32<host>[{CFG.n_layer},2,16,{CFG.n_embd}]" in jaxpr


@pytest.mark.slow
def test_bf16_compute_close_to_fp32():
    ids = jnp.asarray(_ids(CFG, batch=4, seq=32))
    models = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        m = GPT2(CFG, rngs=nnx.Rngs(0), dtype=dtype)
        m.wte[...] = 50.0 * m.wte[...]  # spread the logits: a random init is near-uniform
        models[dtype] = m
    logits32, logits16 = models[jnp.float32](ids), models[jnp.bfloat16](ids)
    assert logits16.dtype == jnp.float32
    l32 = float(gpt2_loss(models[jnp.float32], {"input_ids": ids})[0])
    l16 = float(gpt2_loss(models[jnp.bfloat16], {"input_ids": ids})[0])
    assert abs(l32 - np.log(CFG.vocab_size)) > 1.0  # far from the uniform loss
    assert l16 != l32 and abs(l16 - l32) < 1e-2 * l32  # bf16 really ran, and stayed close
    err = np.abs(np.asarray(logits16) - np.asarray(logits32)).max()
    assert 0 < err < 0.05 * np.abs(np.asarray(logits32)).max()


def test_loss_labels_and_token_count():
    model = GPT2(CFG, rngs=nnx.Rngs(0))
    ids = jnp.asarray(_ids(CFG, seq=8))
    loss, metrics = gpt2_loss(model, {"input_ids": ids})
    assert int(metrics["tokens"]) == 2 * 7
    labels = ids.at[:, 4:].set(-100)  # ignore the last 4 predictions (HF convention)
    loss_m, metrics_m = gpt2_loss(model, {"input_ids": ids, "labels": labels})
    assert int(metrics_m["tokens"]) == 2 * 3
    logits = np.asarray(model(ids), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp[:, :-1], np.asarray(ids)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss_m), nll[:, :3].mean(), rtol=1e-5)


def _value_and_grad_on_the_chunked_batch(loss_fn):
    """`loss_fn`'s value, aux and gradients (op by op, as a user's eager call) on one fixed model and a
    batch with ignored labels and a prediction count (11) that no chunk of 3 or 16 divides."""
    graphdef, params = nnx.split(GPT2(CFG, rngs=nnx.Rngs(0)))
    ids = jnp.asarray(_ids(CFG, seq=12))
    batch = {"input_ids": ids, "labels": ids.at[0, 5:9].set(-100)}
    f = lambda p: loss_fn(nnx.merge(graphdef, p), batch)  # noqa: E731
    return jax.value_and_grad(f, has_aux=True)(params)


# the reference (full logits) is the same for every chunk size: computed once for the module
_full_logits_value_and_grad = functools.cache(lambda: _value_and_grad_on_the_chunked_batch(gpt2_loss))


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.slow
def test_chunked_loss_matches_full_logits(chunk):
    """Value and gradients of the chunked cross entropy equal `gpt2_loss`'s (full logits), with
    ignored labels and a prediction count (11) that no chunk of 3 or 16 divides."""
    (ref, ref_aux), ref_g = _full_logits_value_and_grad()
    (got, got_aux), got_g = _value_and_grad_on_the_chunked_batch(chunked_gpt2_loss(chunk))
    assert int(got_aux["tokens"]) == int(ref_aux["tokens"]) == 2 * 11 - 4
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    with pytest.raises(ValueError, match="chunk"):
        chunked_gpt2_loss(0)


def test_named_sizes_and_errors():
    assert num_params(GPT2Config.named("medium")) == 354_823_168
    assert num_params(GPT2Config.named("large")) == 774_030_080
    assert num_params(GPT2Config.named("xl")) == 1_557_611_200
    assert GPT2Config.named("gpt2-large") == GPT2Config.named("large")
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        GPT2Config.named("huge")
    with pytest.raises(ValueError, match="remat_policy"):
        GPT2(CFG, rngs=nnx.Rngs(0), remat_policy="everything")
    model = GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_positions"):
        model(jnp.zeros((1, 129), jnp.int32))


def test_bf16_export_and_hub_layout(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = GPT2(CFG, rngs=nnx.Rngs(5))
    save_hf(model, CFG, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    config, params = load_hf(str(tmp_path / "bf16"))
    kernel = params["h"]["attn"]["c_attn"]["kernel"]
    assert config == CFG and kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kernel, np.asarray(model.h.attn.c_attn.kernel[...]).astype(jnp.bfloat16))
    # the hub's gpt2 files carry GPT2Model names ("h.0...", no "transformer.") and mask buffers
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    hub["h.0.attn.bias"] = np.tril(np.ones((1, 1, CFG.n_positions, CFG.n_positions), np.float32))
    (tmp_path / "hub").mkdir()
    save_file(hub, str(tmp_path / "hub" / "model.safetensors"))
    (tmp_path / "hub" / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    _, hub_params = load_hf(str(tmp_path / "hub"))
    jax.tree.map(np.testing.assert_array_equal, hub_params, params)


def test_vocab_padding_gives_the_exact_vocabularys_loss_and_gradients():
    """make_vocab_size_divisible_by: wte holds 128 rows for CFG's 97-token vocabulary; the extra
    logits are masked out of the softmax, so loss and gradients are those of the unpadded model
    (the reference, same seed: its wte is the padded one's first 97 rows) and the padding rows get
    exactly zero gradient (they stay zero under AdamW: no gradient, and decay of 0 is 0)."""
    exact = dataclasses.replace(CFG, make_vocab_size_divisible_by=1)
    assert (CFG.padded_vocab_size, exact.padded_vocab_size, num_params(CFG)) == (128, 97, num_params(exact))
    ids = jnp.asarray(_ids(CFG, batch=2, seq=12))
    grads = {}
    for cfg in (CFG, exact):
        gd, st = nnx.split(GPT2(cfg, rngs=nnx.Rngs(0)))
        grads[cfg] = jax.value_and_grad(lambda st: gpt2_loss(nnx.merge(gd, st), {"input_ids": ids})[0])(st)  # noqa: B023 - called within this iteration
        assert nnx.merge(gd, st)(ids).shape == (2, 12, CFG.vocab_size)  # HF's logits, padding dropped
    (loss_p, g_p), (loss_e, g_e) = grads[CFG], grads[exact]
    g_p, g_e = nnx.to_pure_dict(g_p), nnx.to_pure_dict(g_e)
    # fp32: the two softmaxes sum 128 vs 97 terms (the extra ones exactly 0), only the reduction's
    # blocking may differ: a few ulps of the loss, and gradients within ~10 eps of their scale
    np.testing.assert_allclose(float(loss_p), float(loss_e), rtol=1e-6)
    wte_p = np.asarray(g_p.pop("wte"))
    assert not wte_p[CFG.vocab_size:].any()
    np.testing.assert_allclose(wte_p[:CFG.vocab_size], np.asarray(g_e.pop("wte")),
                               rtol=1e-5, atol=1e-6 * np.abs(wte_p).max())
    for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_e), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_vocab_padding_round_trips_hugging_face_files(tmp_path):
    """Export drops the padding rows (HF's [vocab, d]), import appends zero rows again."""
    model = GPT2(CFG, rngs=nnx.Rngs(0))
    save_hf(model, CFG, str(tmp_path))
    config, params = load_hf(str(tmp_path))
    assert params["wte"].shape == (CFG.padded_vocab_size, CFG.n_embd) and config == CFG
    np.testing.assert_array_equal(params["wte"], np.asarray(model.wte[...]))
    _, exact = load_hf(str(tmp_path), make_vocab_size_divisible_by=1)
    assert exact["wte"].shape == (CFG.vocab_size, CFG.n_embd)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        GPT2Config(make_vocab_size_divisible_by=0)


def test_lm_head_backward_runs_in_the_compute_dtype():
    """models.gpt2.lm_head: fp32 logits forward; in fp32 its gradients are the plain einsum's bit
    for bit (the same three dots), in bf16 both backward dots take bf16 operands (JAX's own
    transpose would upcast them to fp32: the slow TF32 gemm in the H200 profile) and the gradients
    stay within bf16 rounding of the fp32 ones: the cotangent and operands are each rounded once
    (2 x 2^-8 relative), the dot's fp32 sum adds nothing comparable, so 2^-6 of the largest entry."""
    from zerojax.models.gpt2 import lm_head

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(40, 16)) * 0.1, jnp.float32)

    def loss(head):
        return lambda x, w: jax.nn.logsumexp(head(x, w), -1).sum()

    plain = lambda x, w: jnp.einsum("btd,vd->btv", x, w, preferred_element_type=jnp.float32)  # noqa: E731
    ref = jax.grad(loss(plain), (0, 1))(x, w)
    for a, b in zip(jax.grad(loss(lm_head), (0, 1))(x, w), ref, strict=True):
        np.testing.assert_array_equal(a, b)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    hlo = jax.jit(jax.grad(loss(lm_head), (0, 1))).lower(xb, wb).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all("xf32>," not in d.split(":")[-1].split("->")[0] for d in dots), dots
    for a, b in zip(jax.grad(loss(lm_head), (0, 1))(xb, wb), ref, strict=True):
        a = np.asarray(a, np.float32)
        assert np.abs(a - b).max() <= 2.0**-6 * np.abs(b).max()
