"""The mixture-of-experts family (Qwen3-MoE, Mixtral) against transformers: logits, the training
loss with its load-balancing term (`aux_loss`, attention mask included), greedy tokens, `to_hf`
folders transformers loads; a padded batch equals its rows one by one; the grouped expert
product equals a float64 loop over experts. Tiny random folders written by transformers, the
router weights scaled up (init's 0.02 makes every expert nearly equally likely) so that routing
decides the outputs."""
import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax.models import MoELlama, from_hf, moe_loss, to_hf
from zerojax.models.moe import grouped_experts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# fp32 parity as tests/models/test_llama.py's: the same products summed in another order
RTOL = ATOL = 2e-5
SEQ, NEW = 12, 8
_COMMON = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, num_experts_per_tok=2, router_aux_loss_coef=0.02)
FAMILIES = {
    # tied head, top-k weights not renormalised (Qwen3-MoE's default), 4 experts
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(_COMMON, head_dim=16, moe_intermediate_size=16,
                                                    intermediate_size=24, num_experts=4, tie_word_embeddings=True)),
    # untied head, always renormalised, 5 experts (an odd count)
    "mixtral": (transformers.MixtralConfig, dict(_COMMON, intermediate_size=16, num_local_experts=5)),
}


def _hf_model(name, seed=0):
    cfg_cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("gate.weight"):  # the router: decisive routing
                p.copy_(torch.randn_like(p))
            elif "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    """(HF model, its folder, ours read from it)."""
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path, from_hf(path)


def _batch(vocab, lengths=(SEQ, 7), seed=0):
    """Right-padded rows of `lengths` real tokens: ids, attention mask, labels (-100 on padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (len(lengths), SEQ)).astype(np.int64)
    mask = (np.arange(SEQ)[None] < np.asarray(lengths)[:, None]).astype(np.int64)
    return ids, mask, np.where(mask == 1, ids, -100)


def test_logits_loss_and_aux_loss_equal_transformers(pair):
    hf, _, ours = pair
    assert isinstance(ours, MoELlama)
    ids, mask, labels = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 labels=torch.from_numpy(labels), output_router_logits=True)
    got = np.asarray(ours(jnp.asarray(ids)))
    valid = mask.astype(bool)  # right padding: the real positions never see the padding
    np.testing.assert_allclose(got[valid], ref.logits.numpy()[valid], rtol=RTOL, atol=ATOL)
    loss, metrics = moe_loss(ours, {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels),
                                    "attention_mask": jnp.asarray(mask)})
    np.testing.assert_allclose(float(metrics["router/aux_loss"]), float(ref.aux_loss), rtol=1e-5)
    # transformers' loss: cross entropy + router_aux_loss_coef x aux_loss (z-loss off by default)
    np.testing.assert_allclose(float(loss), float(ref.loss), rtol=1e-5)
    assert float(metrics["router/z_loss"]) > 0


def test_padded_batch_equals_rows_one_by_one(pair):
    hf, _, ours = pair
    lengths = (SEQ, 5, 9)
    ids, mask, _ = _batch(hf.config.vocab_size, lengths, seed=3)
    logits = jax.jit(lambda ids: ours(ids))  # one program per shape: the batch, then a row
    batched = np.asarray(logits(jnp.asarray(ids)))
    for row, n in enumerate(lengths):
        # the row alone, its padding other tokens (the experts' groups change, its tokens' outputs must not)
        alone = np.asarray(logits(jnp.asarray(np.where(mask[row:row + 1] == 1, ids[row:row + 1], 1))))[0]
        np.testing.assert_allclose(batched[row, :n], alone[:n], rtol=RTOL, atol=ATOL)


def test_greedy_tokens_equal_transformers(pair):
    hf, _, ours = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, hf.config.vocab_size, n).tolist() for n in (7, 3)]
    got = zerojax.generate(ours, prompts, max_new_tokens=NEW, ignore_eos=True)  # one left-padded batch
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert tokens == out[0, len(prompt):].tolist()


def test_to_hf_loads_in_transformers(pair, tmp_path):
    hf, _, ours = pair
    # a small shard size: several files and an index, as save_pretrained writes large models
    to_hf(ours, tmp_path, max_shard_size=20_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids, _, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = back(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), ref, rtol=RTOL, atol=ATOL)


def test_grouped_experts_equal_a_dense_loop_over_experts():
    # the sorted, ragged_dot path against every expert run on every token in float64, each token's
    # output the weighted sum of its chosen experts'
    rng = np.random.default_rng(0)
    N, d, m, E, k = 24, 8, 6, 5, 2
    h = rng.normal(size=(N, d))
    p = {name: {"kernel": rng.normal(size=shape)} for name, shape in
         (("gate_up_proj", (E, d, 2, m)), ("down_proj", (E, m, d)))}
    gate, up = p["gate_up_proj"]["kernel"][:, :, 0], p["gate_up_proj"]["kernel"][:, :, 1]
    # expert 3 chosen by no token (an empty group), expert 0 by many
    experts = np.stack([rng.permutation([0, 1, 2, 4])[:k] for _ in range(N)])
    experts[:6] = [0, 1]
    weights = rng.uniform(size=(N, k))
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    every = np.stack([(silu(h @ gate[e]) * (h @ up[e]))
                      @ p["down_proj"]["kernel"][e] for e in range(E)], 1)  # [N, E, d]
    ref = np.einsum("nkd,nk->nd", np.take_along_axis(every, experts[..., None], 1), weights)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    p["router"] = {"kernel": np.zeros((d, E))}  # (its shape tells the expert count)
    p = jax.tree.map(f32, p)
    got = grouped_experts(f32(h), f32(weights), jnp.asarray(experts), p, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
    # a decode step's few pairs (1 token x top 2 of 5 experts): the chosen experts' kernels gathered,
    # no grouped product over every expert; the same outputs
    one = lambda: grouped_experts(f32(h[6:7]), f32(weights[6:7]), jnp.asarray(experts[6:7]), p, jnp.float32)  # noqa: E731
    assert "ragged_dot" not in str(jax.make_jaxpr(one)())
    np.testing.assert_allclose(np.asarray(one()), ref[6:7], rtol=1e-4, atol=1e-4)


def test_mosaic_grouped_product_vjp_equals_xla_with_reference_kernels(monkeypatch):
    # JAX's Mosaic GPU kernels run on Hopper only; here their two products are stood in for by
    # float64 NumPy loops (each group's rows times its kernel, and each group's rows contracted) that
    # insist on whole tiles (4 wide here), so that what zerojax builds around them is checked: the
    # VJP's formulas, widths padded to tiles, rows past the groups' sum zeroed, dtypes the kernels
    # do not take going to XLA's product
    from zerojax.models import grouped_matmul

    def product(x, w, group_sizes, transpose_rhs=False):
        assert x.shape[1] % 4 == 0 and w.shape[1] % 4 == 0 and w.shape[2] % 4 == 0
        x, w, ends = np.asarray(x, np.float64), np.asarray(w, np.float64), np.cumsum(group_sizes)
        y = np.full((x.shape[0], w.shape[1] if transpose_rhs else w.shape[2]), np.nan)  # unwritten rows
        for e, (start, end) in enumerate(zip(ends - group_sizes, ends)):
            y[start:end] = x[start:end] @ (w[e].T if transpose_rhs else w[e])
        return y

    def contract_groups(x, dy, group_sizes):
        assert x.shape[1] % 4 == 0 and dy.shape[1] % 4 == 0
        x, dy, ends = np.asarray(x, np.float64), np.asarray(dy, np.float64), np.cumsum(group_sizes)
        return np.stack([x[s:e].T @ dy[s:e] for s, e in zip(ends - group_sizes, ends)])

    def on_host(fn, shape_of):
        return lambda *a, **kw: jax.pure_callback(lambda *b: fn(*b, **kw).astype(np.float32), shape_of(*a, **kw), *a)

    monkeypatch.setattr(grouped_matmul, "_mosaic_kernels", lambda: (
        on_host(product, lambda x, w, g, transpose_rhs=False: jax.ShapeDtypeStruct(
            (x.shape[0], w.shape[1] if transpose_rhs else w.shape[2]), x.dtype)),
        on_host(contract_groups,
                lambda x, dy, g: jax.ShapeDtypeStruct((g.shape[0], x.shape[1], dy.shape[1]), x.dtype))))
    # the kernels' own signatures take what zerojax passes (their module moves with jax's versions)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    for kernel, more in ((ragged_dot_mgpu.ragged_dot, {"group_sizes", "transpose_rhs"}),
                         (transposed_ragged_dot_mgpu.transposed_ragged_dot, {"group_sizes"})):
        assert {*grouped_matmul._MOSAIC_TILES, *more} <= set(inspect.signature(kernel).parameters)
    monkeypatch.setattr(grouped_matmul, "_MOSAIC_WIDTH", 4)
    monkeypatch.setattr(grouped_matmul, "_MOSAIC_DTYPES", (jnp.float32,))
    rng = np.random.default_rng(3)
    M, E = 12, 3
    sizes = jnp.asarray([5, 0, 4], jnp.int32)  # an empty group; the last 3 rows in none
    for n_in, n_out, dtype in ((4, 8, jnp.float32), (3, 6, jnp.float32), (4, 8, jnp.float16)):  # fp16: XLA's
        x = jnp.asarray(rng.normal(size=(M, n_in)), dtype)
        w = jnp.asarray(rng.normal(size=(E, n_in, n_out)), dtype)
        cot = jnp.asarray(rng.normal(size=(M, n_out)), dtype)

        def loss_fn(cot=cot):  # a new function each time: the choice is read when a function is traced
            return lambda rows, kernels: (grouped_matmul.grouped_product(rows, kernels, sizes) * cot).sum()

        runs = {}
        for choice in ("xla", "mosaic"):
            with grouped_matmul.use(choice):
                jaxpr = str(jax.make_jaxpr(loss_fn())(x, w))
                assert ("pure_callback" in jaxpr) == (choice == "mosaic" and dtype == jnp.float32)
                y = grouped_matmul.grouped_product(x, w, sizes)
                runs[choice] = (y, *jax.grad(loss_fn(), argnums=(0, 1))(x, w))
        assert not np.isnan(np.asarray(runs["mosaic"][0])).any() and not np.asarray(runs["mosaic"][0][9:]).any()
        for a, b in zip(runs["mosaic"], runs["xla"], strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    # "auto": XLA's here, on other GPUs and over several devices, the Mosaic kernels on one Hopper
    # card; a misspelt choice names the choices
    assert grouped_matmul.resolved() == "xla"
    for capability, cards, expected in (("8.0", 1, "xla"), ("9.0", 1, "mosaic"), ("9.0", 2, "xla")):
        card = types.SimpleNamespace(platform="gpu", compute_capability=capability)
        monkeypatch.setattr(jax, "devices", lambda card=card, cards=cards: [card] * cards)
        assert grouped_matmul.resolved() == expected
    with pytest.raises(ValueError, match="'auto', 'xla', 'mosaic'"), grouped_matmul.use("cutlass"):
        pass


LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "init_lora_weights": False}  # random lora_B: the adapters change the outputs


def test_lora_on_experts_loads_in_peft_with_equal_logits_and_tokens(pair, tmp_path):
    peft = pytest.importorskip("peft")
    from zerojax import lora

    hf, path, plain = pair
    ours = lora.apply(from_hf(path), LORA)
    lora.save_peft(ours, tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    ids, _, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(ours(jnp.asarray(ids)))
    np.testing.assert_allclose(got, ref_logits, rtol=RTOL, atol=ATOL)
    assert np.abs(got - np.asarray(plain(jnp.asarray(ids)))).max() > 1e-2  # the adapters matter
    prompt = ids[0, :5].tolist()
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                            eos_token_id=None, attention_mask=torch.ones(1, 5, dtype=torch.long))
    assert zerojax.generate(ours, prompt, max_new_tokens=NEW, ignore_eos=True).tokens[0] == \
        want[0, 5:].tolist()
    # and PEFT's file read back into a fresh model gives the same adapters
    back = lora.load_peft(from_hf(path), tmp_path)
    np.testing.assert_array_equal(np.asarray(back(jnp.asarray(ids))), got)


def test_quantized_experts_run_as_their_dequantized_merge():
    # QLoRA's nf4 base experts ([L, E, d, 2, m] quantized in 64-element blocks per layer), dequantized
    # on use inside the grouped products, equal the plain model `merge` builds from the same codes
    # (the kernels dequantized, scale x B A folded in), and stay within nf4's bound of the weights
    from flax import nnx

    from zerojax import lora
    from zerojax.models import MoEConfig

    cfg = MoEConfig.named("tiny-mixtral", num_hidden_layers=1, initializer_range=0.5)
    model = MoELlama(cfg, rngs=nnx.Rngs(0))
    w = np.asarray(model.layers.mlp.gate_up_proj.kernel[...])
    lora.apply(model, dict(LORA, quantize="nf4"))
    merged = lora.merge(model)
    deq = np.asarray(merged.layers.mlp.gate_up_proj.kernel[...])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, SEQ)))
    got, want = np.asarray(model(ids)), np.asarray(merged(ids))
    # x W + s (x A) B against x (W + s A B): the same terms rounded apart, fp32 sums of `hidden_size`
    # products in each of the few products between them and the logits
    tol = 4 * cfg.hidden_size * np.finfo(np.float32).eps * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    blocks = np.abs(w).reshape(-1, lora.BLOCK).max(-1)  # each block's absmax, row-major per layer
    bound = np.repeat(np.asarray(lora.quantization_bound("nf4", blocks)), lora.BLOCK).reshape(w.shape)
    entry = model.layers.mlp.gate_up_proj  # per expert: scale x A_e [d, r] B_e [r, 2, m]
    delta = model.adapter.scale * np.einsum("ledr,lerkm->ledkm", np.asarray(entry.lora_A[...], np.float64),
                                            np.asarray(entry.lora_B[...], np.float64))
    assert np.all(np.abs(deq - delta - w) <= bound * (1 + 1e-5) + 1e-6)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_named_shapes_count_as_transformers(name):
    # every expert counted (the planner's parameter count), against the model transformers builds
    # from the config.json we write (on the meta device: no memory)
    from zerojax.models import registry
    from zerojax.models.hf_moe import config_to_hf

    fam = registry.for_shape(name)
    cfg = fam.config(name)
    hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type")}
    cls = transformers.Qwen3MoeConfig if cfg.model_type == "qwen3_moe" else transformers.MixtralConfig
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(cls(**hf))
    assert fam.counts(cfg, 2048)[1] == ref.num_parameters()
