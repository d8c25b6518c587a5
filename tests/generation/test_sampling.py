"""Sampling against references (top-p against a numpy transcription of Hugging Face's warper, the
repetition penalty against transformers' own processor), top-k 1 = greedy, stop ids and stop
strings end rows, the chat helper, the cache guard's message."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.generation import CacheTooLargeError, api, chat, sampling
from zerojax.models import GPT2, GPT2Config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[72, 101, 108, 108, 111], [87, 111]]


class ByteTokenizer:
    """Bytes as tokens (GPT-2 "tiny" has a byte vocabulary of 256), with a chat template."""

    eos_id = None
    special_tokens = {}
    chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}")

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("latin-1"))

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("latin-1")


@pytest.fixture(scope="module")
def model():
    return GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0))


def test_top_k_1_equals_greedy(model):
    greedy = zerojax.generate(model, PROMPTS, max_new_tokens=8)
    assert zerojax.generate(model, PROMPTS, max_new_tokens=8, temperature=0.7, top_k=1, seed=3).tokens == greedy.tokens


def test_sampling_follows_the_seed(model):
    run = lambda seed: zerojax.generate(model, PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9,  # noqa: E731
                                        seed=seed).tokens
    assert run(1) == run(1)
    assert run(1) != run(2)


def _top_p_numpy(logits, top_p):
    """Hugging Face's TopPLogitsWarper, in numpy."""
    order = np.argsort(logits, axis=-1, kind="stable")
    ascending = np.take_along_axis(logits, order, -1)
    p = np.exp(ascending - ascending.max(-1, keepdims=True))
    cumulative = np.cumsum(p / p.sum(-1, keepdims=True), -1)
    remove_sorted = cumulative <= 1 - top_p
    remove_sorted[..., -1] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, -1)
    return np.where(remove, -np.inf, logits)


def test_top_p_keeps_the_nucleus():
    probs = np.array([[0.05, 0.4, 0.1, 0.3, 0.15], [0.9, 0.02, 0.03, 0.04, 0.01]], np.float32)
    logits = np.log(probs)
    for top_p in (0.5, 0.7, 0.8, 0.95):
        got = np.asarray(sampling.top_p_filter(jnp.asarray(logits), top_p))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(_top_p_numpy(logits, top_p)))
    kept = np.isfinite(np.asarray(sampling.top_p_filter(jnp.asarray(logits), 0.7)))
    assert kept.tolist() == [[False, True, False, True, False], [True, False, False, False, False]]


def test_per_row_top_k_then_top_p_equals_transformers_warpers():
    """The serving step's filter (each row's own top_k and top_p, one sort) keeps what Hugging
    Face's TopKLogitsWarper then TopPLogitsWarper keep, row by row."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(6, 50)) * 3).astype(np.float32)
    top_k = np.array([0, 1, 5, 0, 12, 50], np.int32)
    top_p = np.array([1.0, 0.9, 0.5, 0.3, 0.95, 0.8], np.float32)
    got = np.asarray(sampling.top_k_top_p_filter(jnp.asarray(logits), jnp.asarray(top_k)[:, None],
                                                 jnp.asarray(top_p)[:, None]))
    for r in range(len(logits)):
        ref = torch.from_numpy(logits[r:r + 1].copy())
        if top_k[r]:
            ref = transformers.TopKLogitsWarper(int(top_k[r]))(None, ref)
        if top_p[r] < 1:
            ref = transformers.TopPLogitsWarper(float(top_p[r]))(None, ref)
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(ref.numpy()[0]), err_msg=f"row {r}")
        np.testing.assert_array_equal(got[r][np.isfinite(got[r])], logits[r][np.isfinite(got[r])])


def test_repetition_penalty_equals_transformers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 11)).astype(np.float32)
    ids = np.array([[1, 4, 4, 7], [0, 2, 9, 10]])
    seen = np.zeros((2, 11), bool)
    np.put_along_axis(seen, ids, True, -1)
    ours = sampling.apply_repetition_penalty(jnp.asarray(logits), jnp.asarray(seen), 1.3)
    ref = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.from_numpy(ids), torch.from_numpy(logits.copy()))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)


def test_stop_ids_and_stop_strings_end_rows(model):
    tok = ByteTokenizer()
    free = zerojax.generate(model, PROMPTS, max_new_tokens=10, tokenizer=tok)
    assert free.finish_reasons == ["length", "length"]
    row = free.tokens[0]
    stop_id = row[3]
    by_id = zerojax.generate(model, PROMPTS, max_new_tokens=10, stop=[stop_id], tokenizer=tok)
    assert by_id.tokens[0] == row[:row.index(stop_id) + 1] and by_id.finish_reasons[0] == "stop"
    assert by_id.texts[0] == tok.decode(row[:row.index(stop_id)])
    text = tok.decode(row)
    stop = text[4:6]
    by_text = zerojax.generate(model, PROMPTS, max_new_tokens=10, stop=stop, tokenizer=tok)
    assert by_text.texts[0] == text[:text.index(stop)] and by_text.finish_reasons[0] == "stop"
    assert by_text.tokens[0] == row[:text.index(stop) + len(stop)]  # bytes: one token per character


def test_chat_applies_the_template(model):
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "hi"}]
    got = chat(model, messages, tokenizer=tok, max_new_tokens=4)
    prompt = tok.encode("<user>hi\n<assistant>")
    assert got.tokens == zerojax.generate(model, [prompt], max_new_tokens=4).tokens


def test_cache_guard_names_batch_length_and_bytes(model, monkeypatch):
    monkeypatch.setattr(api, "device_free_bytes", lambda device=None: 1000)
    # keys + values x 2 layers x 2 rows x (16 prompt + 32 new slots) x 4 heads x 16 x fp32
    nbytes = 2 * 2 * 2 * 48 * 4 * 16 * 4
    with pytest.raises(CacheTooLargeError,
                       match=rf"batch 2 x length 48 needs .* \({nbytes:,} bytes\) .* \(1,000 bytes\)"):
        zerojax.generate(model, PROMPTS, max_new_tokens=20)


def test_new_lengths_inside_a_bucket_reuse_the_compiled_programs(model):
    from zerojax.generation import decoder

    zerojax.generate(model, [[1, 2, 3]], max_new_tokens=9, temperature=0.5, seed=0)
    sizes = decoder.prefill._cache_size(), decoder.decode._cache_size()
    # another prompt length, max_new_tokens, temperature and seed in the same buckets: no compile
    zerojax.generate(model, [[4, 5, 6, 7, 8, 9, 10]], max_new_tokens=14, temperature=0.9, seed=5)
    assert (decoder.prefill._cache_size(), decoder.decode._cache_size()) == sizes
