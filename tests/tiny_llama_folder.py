"""A tiny Llama Hugging Face folder as transformers writes one, for tests that take a model folder
the way a user gives one (`--hf-checkpoint DIR`): fp32 weights (`save_pretrained`), a byte-level
BPE tokenizer (`tokenizers`: every UTF-8 text encodes, as GPT-2's and Llama 3's do), begin / end /
pad tokens and a chat template in tokenizer_config.json.

`tests/conftest.py` writes it once a session (fixture `tiny_llama_dir`)."""
from __future__ import annotations

import json
import pathlib

SPECIAL = ("<|begin|>", "<|end|>", "<|pad|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|begin|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}")


def write_tiny_llama(path) -> pathlib.Path:
    """The folder at `path` (created): config.json + model.safetensors (2 layers, hidden 32, GQA
    4 / 2 heads, seeded), tokenizer.json, tokenizer_config.json, generation_config.json."""
    import tokenizers
    import torch
    import transformers

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({tok: len(alphabet) + i for i, tok in enumerate(SPECIAL)})
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL[0], "eos_token": SPECIAL[1], "pad_token": SPECIAL[2], "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=vocab[SPECIAL[0]], eos_token_id=vocab[SPECIAL[1]],
                                   pad_token_id=vocab[SPECIAL[2]], tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)  # fp32: the dtype it was built in, and config.json's "dtype"
    return path
