"""A Hugging Face tokenizer folder (tokenizer.json through the `tokenizers` library, special tokens
and chat template from tokenizer_config.json). Imports nothing of zerojax."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` library.

    Given a folder, its `tokenizer_config.json` (when there is one) names the special tokens
    (`special_tokens`: bos_token, eos_token, pad_token, ... as strings; the end-of-text id is its
    eos_token's) and the chat template (`chat_template`, or the folder's `chat_template.jinja`)."""

    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
    SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        path = os.fspath(path)
        folder = path if os.path.isdir(path) else None
        if folder is not None:
            path = os.path.join(path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"tokenizer file not found: {path!r}")
        self.path = path
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.config, self.chat_template = _tokenizer_config(folder)
        self.special_tokens = {k: t for k in self.SPECIAL_KEYS if (t := _token_text(self.config.get(k)))}
        named = self.special_tokens.get("eos_token")
        named_id = self._tok.token_to_id(named) if named else None
        self.eos_id = named_id if named_id is not None else next(
            (i for t in self.EOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None)

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids; add_special_tokens: the tokenizer's own post-processor (e.g. Llama 3's BOS)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False):
        """(ids int32 [n], character offsets int [n, 2]) of `text`."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return np.asarray(enc.ids, dtype=np.int32), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tokenizer_config(folder: str | None) -> tuple[dict, str | None]:
    """(tokenizer_config.json as a dict or {}, the chat template or None) of a tokenizer folder."""
    if folder is None:
        return {}, None
    config, template = {}, None
    cfg_file = os.path.join(folder, "tokenizer_config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
    jinja_file = os.path.join(folder, "chat_template.jinja")  # transformers 5 saves it apart
    if template is None and os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    return config, template
