"""Greedy generation equals transformers' `generate(do_sample=False)` for every family (tiny random
models from tests/models' helpers, through `from_hf`), and a left-padded batch of prompts of
different lengths equals each prompt generated alone."""
import numpy as np
import pytest

import zerojax
from zerojax.models import from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.test_gpt2 import CFG as GPT2_CFG  # noqa: E402 (tests/ on sys.path)
from models.test_gpt2 import _hf_model as _hf_gpt2  # noqa: E402
from models.test_llama import FAMILIES, _hf_model  # noqa: E402

NEW = 12  # Mistral's window (6) is shorter than prompt + new tokens
FAMILY_NAMES = ["llama3", "mistral", "qwen2", "qwen3", "gpt2"]


def _prompts(vocab, lengths=(7, 3), seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def _hf_greedy(hf, prompt, new=NEW):
    """transformers' greedy tokens for one prompt, ending at its eos (as ours)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def pair(request, tmp_path_factory):
    """(HF model, ours read from its folder)."""
    name = request.param
    hf = _hf_gpt2(GPT2_CFG) if name == "gpt2" else _hf_model(name)
    assert name == "gpt2" or name in FAMILIES
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return hf, from_hf(path)


def test_greedy_equals_transformers(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size)
    got = zerojax.generate(ours, prompts, max_new_tokens=NEW)  # one left-padded batch
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        assert tokens == _hf_greedy(hf, prompt)


def test_padded_batch_equals_each_prompt_alone(pair):
    _, ours = pair
    prompts = _prompts(ours.config.vocab_size, lengths=(5, 9, 2), seed=2)
    batched = zerojax.generate(ours, prompts, max_new_tokens=6, ignore_eos=True)
    for prompt, tokens in zip(prompts, batched.tokens, strict=True):
        assert zerojax.generate(ours, prompt, max_new_tokens=6, ignore_eos=True).tokens == [tokens]


@pytest.fixture(scope="module")
def mistral_16(tmp_path_factory):
    """A Mistral of head_dim 16 (the fused decode kernel's smallest) with a window of 6, GQA 4:2."""
    from models.test_llama import _common

    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**_common(sliding_window=6, head_dim=16))).eval()
    path = tmp_path_factory.mktemp("mistral16")
    hf.save_pretrained(path)
    return hf, from_hf(path)


def test_decode_kernel_greedy_equals_transformers(mistral_16):
    """decode_attention="kernel" (the decode step's fused attention; Pallas' interpreter here):
    greedy tokens of a left-padded batch equal transformers', the window and the padding included."""
    hf, ours = mistral_16
    prompts = _prompts(hf.config.vocab_size, lengths=(7, 3, 11))
    got = zerojax.generate(ours, prompts, max_new_tokens=NEW, decode_attention="kernel")
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        assert tokens == _hf_greedy(hf, prompt)


def test_repeated_prompts_prefill_once(mistral_16, monkeypatch):
    """A prompt asked for several times goes through the prefill once (its cache copied to its
    rows): greedy tokens still equal transformers' for every row; sampled, each copy draws its own
    tokens from the first one on."""
    from zerojax.generation import decoder

    hf, ours = mistral_16
    prefilled, real = [], decoder.prefill
    monkeypatch.setattr(decoder, "prefill",
                        lambda w, ids, *a, **k: prefilled.append(ids.shape[0]) or real(w, ids, *a, **k))
    a, b = _prompts(hf.config.vocab_size, lengths=(7, 3))
    prompts = [a, b, a, a, b]
    got = zerojax.generate(ours, prompts, max_new_tokens=NEW)
    assert prefilled == [2]  # the batch bucket of the 2 distinct prompts, not of 5 rows
    want = {len(p): _hf_greedy(hf, p) for p in (a, b)}
    assert got.tokens == [want[len(p)] for p in prompts]
    sampled = zerojax.generate(ours, [a] * 16, max_new_tokens=3, temperature=1.0, ignore_eos=True, seed=4)
    assert prefilled[-1] == 1 and len({t[0] for t in sampled.tokens}) > 1


def test_prefill_in_pieces_greedy_equals_transformers(mistral_16, monkeypatch):
    """A prompt bucket whose attention scores pass `PREFILL_SCORES_BYTES` goes through the layers a
    piece at a time (here pieces of 16 slots of a 64-slot bucket, the window crossing them): the
    greedy tokens still equal transformers'."""
    from zerojax.generation import decoder

    hf, ours = mistral_16
    monkeypatch.setattr(decoder, "PREFILL_SCORES_BYTES", 1)
    assert (decoder.prefill_piece(4, 4, 64), decoder.prefill_piece(4, 4, 48)) == (16, 48)
    prompts = _prompts(hf.config.vocab_size, lengths=(20, 7, 33))
    got = zerojax.generate(ours, prompts, max_new_tokens=NEW)
    for prompt, tokens in zip(prompts, got.tokens, strict=True):
        assert tokens == _hf_greedy(hf, prompt)


def test_decode_attention_choice_is_checked(mistral_16, monkeypatch):
    """A bad choice, or the kernel on a head_dim it does not take, is one line before anything runs;
    "auto" is the kernel on one GPU where the kernel takes the shape, else XLA."""
    import jax
    from flax import nnx

    from zerojax.generation import decoder
    from zerojax.generation.families import geometry_of_config
    from zerojax.models import Llama, LlamaConfig

    with pytest.raises(ValueError, match=r"decode_attention='flash': choose one of \('auto', 'xla', 'kernel'\)"):
        zerojax.generate(mistral_16[1], [3, 4], max_new_tokens=2, decode_attention="flash")
    head_dim_8 = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_dim in 16..256 \\(this model's is 8\\).*decode_attention='xla'"):
        zerojax.generate(head_dim_8, [3, 4], max_new_tokens=2, decode_attention="kernel")
    # "auto" on this CPU: XLA's products, head_dim 8 or not (no error)
    assert zerojax.generate(head_dim_8, [3, 4], max_new_tokens=2, decode_attention="auto").tokens
    g16, g8 = geometry_of_config(mistral_16[1].config), geometry_of_config(head_dim_8.config)
    assert not decoder.check_decode_attention("auto", g16, 64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decoder.check_decode_attention("auto", g16, 64)
    assert not decoder.check_decode_attention("auto", g16, 64, devices=2)  # a mesh would gather the cache whole
    assert not decoder.check_decode_attention("auto", g8, 64) and not decoder.check_decode_attention("auto", g16, 40)
