"""The Llama family: logits parity with Hugging Face's Llama / Mistral / Qwen2 / Qwen3 through
`from_hf` / `to_hf` (single and sharded safetensors), GPT-2 through the same functions, packed
documents, counts, the named shapes against transformers' own parameter counts."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import GPT2, GPT2Config, Llama, LlamaConfig, from_hf, to_hf, weights_writer
from zerojax.models.llama import chunked_llama_loss, flops_per_token, llama_loss, num_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# fp32 parity: the same products summed in another order; HF's attention and ours differ by a few
# ulps per logit (|logits| ~ 1): relative 1e-5 with an absolute floor of 1e-5 for logits near 0
RTOL = ATOL = 1e-5
SEQ = 20


def _common(vocab=101, **kw):
    # odd vocab (padded to 128 on our side), GQA 4:2, head_dim 8 (rope over 4 pairs)
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    # llama3 rope scaling with original_max_position_embeddings 16: positions < 20 cross every band
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               _common(rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)),
    "llama-bias-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        _common(attention_bias=True, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # a window shorter than the sequence, so that the window matters
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, _common(sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, _common(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, _common(head_dim=16)),
}


def _hf_model(family, seed=0):
    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():  # ones / zeros in norms and biases would hide a layout mistake
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return hf


def _ids(vocab, batch=2, seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int32)


def _hf_logits(hf, ids, **kw):
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids.astype(np.int64)), **kw).logits.numpy()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, HF model, its folder, our model read from it)."""
    name = request.param
    hf = _hf_model(name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path, from_hf(path)


def test_from_hf_logits_match(family):
    name, hf, _, model = family
    assert isinstance(model, Llama)
    vocab = hf.config.vocab_size
    ids = _ids(vocab)
    logits = np.asarray(model(jnp.asarray(ids)))
    assert logits.dtype == np.float32 and logits.shape == (2, SEQ, vocab)
    np.testing.assert_allclose(logits, _hf_logits(hf, ids), rtol=RTOL, atol=ATOL)
    # the loss: HF's own shifted cross entropy
    with torch.no_grad():
        t = torch.from_numpy(ids.astype(np.int64))
        ref = float(hf(input_ids=t, labels=t).loss)
    assert abs(float(llama_loss(model, {"input_ids": jnp.asarray(ids)})[0]) - ref) < 1e-5


def test_to_hf_loads_in_transformers(family, tmp_path):
    name, hf, _, model = family
    out = tmp_path / "out"
    to_hf(model, out)
    back = type(hf).from_pretrained(out).eval()
    ids = _ids(hf.config.vocab_size, seed=1)
    np.testing.assert_allclose(_hf_logits(back, ids), np.asarray(model(jnp.asarray(ids))), rtol=RTOL, atol=ATOL)
    # and every tensor bit-identical to the original checkpoint's (tied: no lm_head.weight written)
    ours, theirs = back.state_dict(), hf.state_dict()
    assert set(ours) == set(theirs)
    for k in theirs:
        np.testing.assert_array_equal(ours[k].numpy(), theirs[k].numpy(), err_msg=k)


def test_sharded_round_trip(tmp_path):
    hf = _hf_model("qwen3", seed=2)
    model = from_hf(_saved(hf, tmp_path / "hf"))
    written = to_hf(model, tmp_path / "sharded", max_shard_size=20_000)  # a few tensors a shard
    assert written.endswith("model.safetensors.index.json")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    again = from_hf(tmp_path / "sharded")  # our reader, through the index
    ids = _ids(hf.config.vocab_size, seed=3)
    ref = _hf_logits(hf, ids)
    np.testing.assert_allclose(_hf_logits(back, ids), ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(again(jnp.asarray(ids))), ref, rtol=RTOL, atol=ATOL)
    # HF's own sharded save is read too
    hf.save_pretrained(tmp_path / "hf_sharded", max_shard_size="20KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").exists()
    np.testing.assert_allclose(np.asarray(from_hf(tmp_path / "hf_sharded")(jnp.asarray(ids))), ref,
                               rtol=RTOL, atol=ATOL)


def _saved(hf, path):
    hf.save_pretrained(path)
    return path


def test_gpt2_through_from_hf_and_to_hf(tmp_path):
    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    assert isinstance(model, GPT2) and model.config == cfg
    ids = _ids(97, seq=16)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _hf_logits(hf, ids), rtol=RTOL, atol=ATOL)
    to_hf(model, tmp_path / "out", max_shard_size=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(_hf_logits(back, ids), _hf_logits(hf, ids), rtol=0, atol=0)


def test_bf16_from_hf_keeps_bf16_storage(tmp_path):
    hf = _hf_model("llama3").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf", dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    to_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    for k, v in hf.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_weights_writer_from_checkpoint_record(tmp_path):
    model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
    record = json.loads(json.dumps(model.checkpoint_record()))  # as a checkpoint stores it
    write = weights_writer(record)
    path = write(nnx.to_pure_dict(nnx.state(model, nnx.Param)), str(tmp_path))
    assert path.endswith("model.safetensors")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(256, seq=12)
    np.testing.assert_allclose(_hf_logits(back, ids), np.asarray(model(jnp.asarray(ids))), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_packed_documents_equal_separate_runs():
    # two documents packed in one row (segment ids 1, 2) give each document's logits as if alone;
    # positions restart per document (derived from the segment ids)
    model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(1))
    a, b = _ids(256, 1, 7, seed=4), _ids(256, 1, 9, seed=5)
    packed = jnp.asarray(np.concatenate([a, b], axis=1))
    seg = jnp.asarray([[1] * 7 + [2] * 9])
    logits = np.asarray(model(packed, segment_ids=seg))
    np.testing.assert_allclose(logits[:, :7], np.asarray(model(jnp.asarray(a))), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[:, 7:], np.asarray(model(jnp.asarray(b))), rtol=1e-5, atol=1e-5)
    # without the segment ids the second document would see the first
    assert not np.allclose(np.asarray(model(packed))[:, 7:], logits[:, 7:], atol=1e-3)


@pytest.mark.slow
def test_chunked_loss_equals_loss_with_labels_and_segments():
    model = Llama(LlamaConfig.named("tiny-qwen3"), rngs=nnx.Rngs(2))
    ids = _ids(256, 2, 16, seed=6)
    labels = ids.copy()
    labels[:, :5] = -100
    labels[0, 9] = -100
    batch = {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels),
             "segment_ids": jnp.asarray([[1] * 9 + [2] * 7, [1] * 16])}
    ref, m = llama_loss(model, batch)
    got, m2 = chunked_llama_loss(5)(model, batch)
    # targets 1..4 of each row and (0, 9) not counted
    assert int(m["tokens"]) == int(m2["tokens"]) == 2 * 15 - 2 * 4 - 1
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    g1, g2 = _grads(model, llama_loss, batch), _grads(model, chunked_llama_loss(5), batch)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def _grads(model, loss_fn, batch):
    graphdef, state = nnx.split(model)
    return jax.jit(jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), batch)[0]))(state)


@pytest.mark.parametrize("policy", ["full", "save_qkv_attention", "dots_2"])
@pytest.mark.slow
def test_remat_policies_same_gradients(policy):
    cfg = LlamaConfig.named("tiny", num_hidden_layers=4)
    batch = {"input_ids": jnp.asarray(_ids(256, 2, 12, seed=7))}
    ref = _grads(Llama(cfg, rngs=nnx.Rngs(0)), llama_loss, batch)
    got = _grads(Llama(cfg, rngs=nnx.Rngs(0), remat_policy=policy), llama_loss, batch)
    for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


NAMED_HF = {  # name -> transformers config of the published checkpoint (config.json values)
    "llama-3.2-1b": "LlamaConfig", "llama-3.2-3b": "LlamaConfig", "llama-3.1-8b": "LlamaConfig",
    "qwen2.5-0.5b": "Qwen2Config", "qwen3-0.6b": "Qwen3Config", "mistral-7b": "MistralConfig",
}
# the parameter counts the model cards state (HF `num_parameters()`)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "mistral-7b": 7_241_732_096}


@pytest.mark.parametrize("name", sorted(NAMED_HF))
def test_named_shapes_count_as_transformers(name):
    from zerojax.models.hf_llama import config_to_hf

    cfg = LlamaConfig.named(name)
    hf_cfg = getattr(transformers, NAMED_HF[name])(**{k: v for k, v in config_to_hf(cfg).items()
                                                      if k not in ("architectures", "model_type", "dtype")})
    with torch.device("meta"):
        hf = getattr(transformers, FAMILY_CLASS[cfg.model_type])(hf_cfg)
    assert num_params(cfg) == hf.num_parameters() == PUBLISHED[name]
    # our abstract model holds the same (plus zero padding rows: none, every vocabulary divides 128)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == num_params(cfg)


FAMILY_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


def test_flops_per_token():
    cfg = LlamaConfig.named("llama-3.1-8b")
    n = num_params(cfg) - cfg.vocab_size * cfg.hidden_size  # untied: the input lookup is no matmul
    assert flops_per_token(cfg, 4096) == 6 * n + 12 * 32 * 4096 * 4096
    tied = LlamaConfig.named("qwen3-0.6b")
    assert flops_per_token(tied, 1024) == 6 * num_params(tied) + 12 * 28 * (16 * 128) * 1024


def test_logical_axis_names():
    model = nnx.eval_shape(lambda: Llama(LlamaConfig.named("tiny-qwen3"), rngs=nnx.Rngs(0)))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    P = jax.sharding.PartitionSpec
    attn = specs["layers"]["self_attn"]
    assert specs["embed_tokens"] == P("vocab", "embed")
    assert attn["q_proj"]["kernel"] == P("layers", "embed", "heads", "head_dim")
    assert attn["k_proj"]["kernel"] == P("layers", "embed", "kv_heads", "head_dim")
    assert attn["o_proj"]["kernel"] == P("layers", "heads", "head_dim", "embed")
    assert specs["layers"]["mlp"]["down_proj"]["kernel"] == P("layers", "mlp", "embed")


def test_unsupported_configs_are_refused(tmp_path):
    from zerojax.models.hf_llama import config_from_hf

    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="model_type='phi3'"):
        config_from_hf({**base, "model_type": "phi3"})
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_hf(tmp_path)
