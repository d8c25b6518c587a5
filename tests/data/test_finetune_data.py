"""Fine-tuning .jsonl data: prompt / completion and chat records, packed with segment ids or
padded, whose masked Llama loss equals the loss computed by hand one example at a time; the chat
template rendered as transformers renders it; errors that name the file and the line."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.data.finetune import load_finetune_data, render_chat
from zerojax.data.text import DataError, HFTokenizer
from zerojax.models import Llama, LlamaConfig, llama_loss, load_tokenizer

WORDS = ["[UNK]", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "there", "hi",
         "friend", "what", "is", "two", "plus", "four", "be", "brief", "yes", "no", "ok"]
SPECIAL = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' + eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
CHATS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "hi friend"}, {"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello friend"}],
]
PAIRS = [{"prompt": "what is two plus two", "completion": "four"}, {"prompt": "hello", "completion": "hi there"},
         {"prompt": "yes or no", "completion": "no"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "[UNK]",
        "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.named("tiny", vocab_size=len(WORDS)), rngs=nnx.Rngs(0))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ids_of(words):
    return np.asarray([WORDS.index(w) for w in words.split()], np.int32)


def hand_loss(model, examples):
    """Mean cross entropy of each example run alone: -log p(token t | tokens < t) for t >= 1 with
    mask[t] set, in float64 from the model's logits."""
    total, n = 0.0, 0
    for ids, mask in examples:
        logits = np.asarray(model(jnp.asarray(ids[None])), np.float64)[0]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for t in range(1, len(ids)):
            if mask[t]:
                total -= logp[t - 1, ids[t]]
                n += 1
    return total / n


def expected_chats():
    """Each conversation's tokens and loss mask, spelled out: the assistant words and their </s>."""
    first = ("<s> <|system|> be brief </s> <|user|> hello there </s> <|assistant|> hi friend </s> "
             "<|user|> what is two plus two </s> <|assistant|> four </s>")
    second = "<s> <|user|> hi </s> <|assistant|> hello friend </s>"
    learn = [{10, 11, 12, 21, 22}, {5, 6, 7}]  # token indices of "hi friend </s>", "four </s>", ...
    return [(ids_of(t), np.isin(np.arange(len(ids_of(t))), sorted(k))) for t,
            k in zip((first, second), learn, strict=True)]


def test_chat_template_renders_as_transformers(folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    ours = load_tokenizer(folder)
    assert isinstance(ours, HFTokenizer) and ours.eos_id == WORDS.index("</s>")
    for chat in CHATS:
        for gen in (False, True):
            text = render_chat(ours, chat, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.encode(text).tolist() == hf(text, add_special_tokens=False)["input_ids"]
    # the spelled-out expectation below is this rendering
    for chat, (ids, _) in zip(CHATS, expected_chats(), strict=True):
        assert ours.encode(render_chat(ours, chat)).tolist() == ids.tolist()


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.slow
def test_chat_loss_on_assistant_turns_only(folder, model, tmp_path, packed):
    data = load_finetune_data(_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS]), folder,
                              seq_len=32, packed=packed)
    assert data.format == "messages"
    b = data.arrays
    assert len(data) == (1 if packed else 2)
    if packed:  # both conversations in one row, apart
        assert b["segment_ids"][0].tolist() == [1] * 23 + [2] * 8 + [0]
        assert b["positions"][0, 23:31].tolist() == list(range(8))
    loss, metrics = llama_loss(model, {k: jnp.asarray(v) for k, v in b.items()})
    assert int(metrics["tokens"]) == 5 + 3
    np.testing.assert_allclose(float(loss), hand_loss(model, expected_chats()), rtol=1e-5)


@pytest.mark.slow
def test_prompt_completion_loss_on_completions_only(folder, model, tmp_path):
    data = load_finetune_data(_jsonl(tmp_path / "pc.jsonl", PAIRS), folder, seq_len=16)
    b = data.arrays
    # <s> + prompt, then completion + </s>: 8 + 5 tokens in row 0, 6 in row 1 (13 + 6 > 16)
    assert b["segment_ids"].tolist() == [[1] * 8 + [2] * 5 + [0] * 3, [1] * 6 + [0] * 10]
    assert b["labels"][0].tolist() == [-100] * 6 + ids_of("four </s>").tolist() + [-100] * 2 \
        + ids_of("hi there </s>").tolist() + [-100] * 3
    examples = [(np.concatenate([ids_of("<s> " + p["prompt"].replace(" or ", " [UNK] ")),
                                 ids_of(p["completion"] + " </s>")]),
                 np.concatenate([np.zeros(len(p["prompt"].split()) + 1, bool),
                                 np.ones(len(p["completion"].split()) + 1, bool)])) for p in PAIRS]
    assert [e[0].tolist() for e in examples] == [b["input_ids"][0, :8].tolist(), b["input_ids"][0, 8:13].tolist(),
                                                 b["input_ids"][1, :6].tolist()]
    loss, metrics = llama_loss(model, {k: jnp.asarray(v) for k, v in b.items()})
    assert int(metrics["tokens"]) == 2 + 3 + 2
    np.testing.assert_allclose(float(loss), hand_loss(model, examples), rtol=1e-5)
    # batches: shuffled rows, every array of a row together
    (batch,) = list(data.batches(2, process_index=0, process_count=1, num_steps=1))
    assert sorted(batch["segment_ids"][:, 0].tolist()) == [1, 1] and set(batch) == set(b)


def test_text_records_learn_every_token(folder, tmp_path):
    data = load_finetune_data(_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}, {"text": "ok"}]), folder,
                              seq_len=8, packed=False)
    assert data.arrays["input_ids"].tolist() == [ids_of("<s> hello there </s>").tolist() + [1] * 4,
                                                 ids_of("<s> ok </s>").tolist() + [1] * 5]  # <pad> is 1
    assert data.arrays["labels"][0].tolist() == [-100] + ids_of("hello there </s>").tolist() + [-100] * 4
    assert "segment_ids" not in data.arrays  # padded: one example a row, nothing to keep apart


def test_errors_name_the_file_line_and_fix(folder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: column 2: not JSON .*\"prompt\""):
        load_finetune_data(bad, folder, seq_len=16)
    _jsonl(bad, [PAIRS[0], {"messages": CHATS[1]}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: a 'messages' record, but .*bad.jsonl:1 started"):
        load_finetune_data(bad, folder, seq_len=16)
    _jsonl(bad, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: no \"assistant\" message"):
        load_finetune_data(bad, folder, seq_len=16)
    _jsonl(bad, [{"prompt": "hi", "completion": 3}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'completion' must be a string"):
        load_finetune_data(bad, folder, seq_len=16)
    _jsonl(bad, [{"question": "hi"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: not a fine-tuning record \(keys \['question'\]\)"):
        load_finetune_data(bad, folder, seq_len=16)
    # a tokenizer without a chat template, for chat records
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    _jsonl(bad, [{"messages": CHATS[1]}])
    with pytest.raises(DataError, match="no chat template"):
        load_finetune_data(bad, plain, seq_len=16)
    # a completion pushed out of the row by its prompt
    _jsonl(bad, [{"prompt": "hello " * 20, "completion": "hi"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 23 tokens, .* raise seq_len"):
        load_finetune_data(bad, folder, seq_len=16)
