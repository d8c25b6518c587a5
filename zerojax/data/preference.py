"""Preference pairs (DPO / IPO, reward models) as people keep them: `.jsonl` files of
`{"prompt", "chosen", "rejected"}` records -> padded token rows of each pair.

A record is either plain text or a chat:

- `{"prompt": "...", "chosen": "...", "rejected": "..."}`: prompt tokens (the tokenizer's own
  special tokens added, e.g. Llama 3's BOS), then the completion and end-of-text;
- `{"prompt": [messages], "chosen": {"role": "assistant", ...} | [messages] | "text", "rejected": ...}`:
  prompt + completion rendered with the checkpoint's chat template (`zerojax.data.finetune`'s
  rendering, exactly transformers' `apply_chat_template`); a completion given as a string is one
  assistant message.

Only the completion's tokens are targets (labels -100 elsewhere; for chats, the assistant turns
after the prompt). A batch is a dict of int32 [rows, seq_len] arrays "chosen_ids",
"chosen_labels", "rejected_ids", "rejected_labels" (labels: Hugging Face's convention, aligned
with the ids, shifted in the loss), plus fp32 [rows] "ref_chosen_logps" / "ref_rejected_logps"
once a reference model's log-probs are precomputed (`zerojax.methods.dpo.precompute_reference`).

Padded, not packed: a pair's chosen and rejected rows share their prompt, so their lengths are
close and padding wastes little; the losses need one number per sequence (DPO's summed
log-probs, a reward model's score at the last non-pad token, Hugging Face's
`...ForSequenceClassification` rule), which a padded row gives with a plain reduction along the
row, and every model family runs it (GPT-2 has no segment ids).
"""
from __future__ import annotations

import dataclasses
import os
import warnings

from zerojax.data.finetune import (
    FinetuneData,
    HeldOutRows,
    encode_record,
    jsonl_records,
    named_pad_id,
    pack_examples,
    pad_id_of,
)
from zerojax.data.text import DataError, HFTokenizer

KEYS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")
EXAMPLE = '{"prompt": "...", "chosen": "...", "rejected": "..."}'
CHAT_EXAMPLE = ('{"prompt": [{"role": "user", "content": "..."}], "chosen": {"role": "assistant", "content": "..."}, '
                '"rejected": {"role": "assistant", "content": "..."}}')


# --------------------------------------------------------------------------- records


def _messages(value, key, where):
    """A completion or prompt as a list of {"role", "content"} messages (checked)."""
    msgs = [value] if isinstance(value, dict) else value
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{\"role\", \"content\"}} messages here "
                        f"(the prompt is a chat); e.g. {CHAT_EXAMPLE}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(f"{where}: {key}[{i}] must be an object with a string \"role\" and a \"content\", "
                            "e.g. {\"role\": \"assistant\", \"content\": \"...\"}")
    return msgs


def _is_empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    msgs = [value] if isinstance(value, dict) else value
    return all(not str(m.get("content") or "").strip() for m in msgs if isinstance(m, dict))


def check_record(record, where: str) -> str:
    """"text" or "chat" for a valid preference record; DataError naming `where` and the fix else."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not a preference record; each line is {EXAMPLE}")
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise DataError(f"{where}: no {' / '.join(repr(k) for k in missing)} (keys: {sorted(record)[:6]}); each "
                        f"line is {EXAMPLE}, or a chat: {CHAT_EXAMPLE}")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        for key in SIDES:
            if not isinstance(record[key], str):
                raise DataError(f"{where}: {key!r} is a {type(record[key]).__name__} but the prompt is a string; "
                                f"give strings throughout ({EXAMPLE}) or the prompt as chat messages ({CHAT_EXAMPLE})")
        kind = "text"
    elif isinstance(prompt, list):
        _messages(prompt, "prompt", where)
        for key in SIDES:
            if not isinstance(record[key], str):
                msgs = _messages(record[key], key, where)
                if not any(m["role"] == "assistant" for m in msgs):
                    raise DataError(f"{where}: {key!r} has no \"assistant\" message, so nothing to compare; give the "
                                    "assistant's reply, e.g. {\"role\": \"assistant\", \"content\": \"...\"}")
        kind = "chat"
    else:
        raise DataError(f"{where}: \"prompt\" must be a string or a list of chat messages (got "
                        f"{type(prompt).__name__}); each line is {EXAMPLE}")
    for key in SIDES:
        if _is_empty(record[key]):
            raise DataError(f"{where}: empty {key!r}, so nothing to compare; give the text of the {key} reply")
    return kind


def encode_pair(record, kind: str, tokenizer, *, where: str = "", template=None):
    """{side: (ids int32 [n], target mask bool [n])} for "chosen" and "rejected" of one record."""
    out = {}
    for side in SIDES:
        if kind == "text":
            out[side] = encode_record({"prompt": record["prompt"], "completion": record[side]}, "prompt_completion",
                                      tokenizer, where=where)
            continue
        completion = record[side]
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        completion = [completion] if isinstance(completion, dict) else completion
        prompt = record["prompt"]
        out[side] = encode_record({"messages": [*prompt, *completion]}, "messages", tokenizer, where=where,
                                  template=template, from_message=len(prompt))
    return out


# --------------------------------------------------------------------------- rows


class PreferenceRows(HeldOutRows):
    """The trainer's reader of preference pairs (`HeldOutRows`: `train_batches`, `val_batches`,
    `n_train`, `n_val`, `what`, `vocab_size`, `steps_per_epoch`; the last ~5% of the pairs held
    out for validation in whole batches, the training pairs shuffled per epoch from (seed, epoch),
    resumable at any step). `pad_id`: the id the rows are padded with; `named_pad_id`: the same where
    the tokenizer names a pad (or eos) token, else None (a reward model's `pad_token_id` then has to
    be given: 0 would be a guess)."""

    def __init__(self, data: FinetuneData, batch_size: int, pad_id: int):
        self.pad_id = int(pad_id)
        self.named_pad_id = named_pad_id(data.tokenizer)
        super().__init__(data, batch_size)

    def describe(self) -> str:
        targets = sum(int((self.train.arrays[f"{s}_labels"][:, 1:] != -100).sum()) for s in SIDES)
        ref = ", reference log-probs precomputed" if "ref_chosen_logps" in self.data.arrays else ""
        return f"padded preference pairs (chosen / rejected), {targets:,} target tokens{ref}"

    @property
    def arrays(self) -> dict:
        """Every pair's arrays (train rows, then validation rows)."""
        return self.data.arrays

    def with_arrays(self, **arrays) -> PreferenceRows:
        """The same pairs with more per-pair arrays ([rows, ...] in `arrays`' row order), e.g. a
        reference model's "ref_chosen_logps" / "ref_rejected_logps"."""
        for k, v in arrays.items():
            if len(v) != len(self.data):
                raise ValueError(f"{k}: {len(v)} rows for {len(self.data)} pairs")
        return PreferenceRows(dataclasses.replace(self.data, arrays={**self.data.arrays, **arrays}),
                              self.batch_size, self.pad_id)


def load_preference_data(source: str | os.PathLike, tokenizer, seq_len: int, batch_size: int, *,
                         chat_template: str | None = None) -> PreferenceRows:
    """Read, render, tokenize and pad a .jsonl file (or a folder of them) of preference pairs ->
    the trainer's reader (`PreferenceRows`).

    tokenizer: a tokenizer folder / tokenizer.json path, or a loaded tokenizer (`HFTokenizer`).
    seq_len: each sequence's row length (longer ones are cut to it, with a warning; one whose
    completion would be cut away entirely is an error naming its line). chat_template: overrides
    the tokenizer folder's, for chat records."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = HFTokenizer(tokenizer)
    if seq_len < 2:
        raise ValueError(f"{seq_len=} must be >= 2 (one token and one target)")
    examples = {side: [] for side in SIDES}
    truncated, kind, first = 0, None, None
    for file, lineno, record in jsonl_records(source, what="preference data", example=EXAMPLE):
        where = f"{file}:{lineno}"
        got = check_record(record, where)
        if kind is None:
            kind, first = got, where
        elif got != kind:
            raise DataError(f"{where}: a {got} record, but {first} started the data as {kind} records; keep one "
                            f"kind per data set ({EXAMPLE if kind == 'text' else CHAT_EXAMPLE})")
        try:
            pair = encode_pair(record, kind, tokenizer, where=where, template=chat_template)
        except DataError:
            raise
        except Exception as e:  # a template's raise_exception, a jinja2 error
            raise DataError(f"{where}: the chat template failed on this record ({type(e).__name__}: {e}); "
                            "check the roles and their order against the checkpoint's template") from None
        for side, (ids, mask) in pair.items():
            if not mask[1:].any():
                raise DataError(f"{where}: {side!r} has no token to learn after tokenizing (an empty completion)")
            if len(ids) > seq_len and not mask[1:seq_len].any():
                raise DataError(f"{where}: {side!r} is {len(ids)} tokens and the first {seq_len} (seq_len) hold "
                                "none of its completion; raise seq_len or shorten the prompt")
            truncated += len(ids) > seq_len
            examples[side].append((ids, mask))
    if kind is None:
        raise DataError(f"{os.fspath(source)}: no records; add lines such as {EXAMPLE}")
    if truncated:
        warnings.warn(f"{os.fspath(source)}: {truncated} of {2 * len(examples['chosen'])} sequences are longer "
                      f"than seq_len={seq_len} tokens and were cut to it", UserWarning, stacklevel=2)
    pad = pad_id_of(tokenizer)
    arrays = {}
    for side in SIDES:
        rows = pack_examples(examples[side], seq_len, packed=False, pad_id=pad)
        arrays[f"{side}_ids"], arrays[f"{side}_labels"] = rows["input_ids"], rows["labels"]
    n = len(examples["chosen"])
    if n < batch_size:
        raise DataError(f"{os.fspath(source)}: {n} preference pairs, fewer than one batch of {batch_size}; give "
                        "more pairs or a smaller batch")
    data = FinetuneData(arrays=arrays, tokenizer=tokenizer, seq_len=seq_len, format=f"preference {kind}",
                        truncated=truncated)
    return PreferenceRows(data, batch_size, pad)


__all__ = ["PreferenceRows", "load_preference_data", "check_record", "encode_pair", "KEYS", "SIDES"]
