"""A training run's data as the trainer reads it: text cut into blocks, or fine-tuning records
(prompt / completion, chat messages) as rows with labels, each behind one small reader interface:
`train_batches(batch_size, *, seed, start_step, num_steps)`, `val_batches(batch_size)`, `n_train`,
`n_val`, `what`, `vocab_size`, `steps_per_epoch`."""
from __future__ import annotations

import dataclasses
import json
import os


class ByteTokens:
    """UTF-8 bytes as tokens (zerojax.data.text.ByteTokenizer: vocab 256, no special tokens) with
    what zerojax.data.finetune reads of a tokenizer (no chat template)."""

    vocab_size, eos_id, chat_template = 256, None, None
    special_tokens: dict = {}
    path = "the byte-level tokenizer (no --tokenizer, no --hf-checkpoint)"

    def encode(self, text: str, add_special_tokens: bool = False):
        import numpy as np

        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False):
        import numpy as np

        pieces = [(b, i) for i, ch in enumerate(text) for b in ch.encode("utf-8")]
        ids = np.asarray([b for b, _ in pieces], np.int32)
        return ids, np.asarray([(i, i + 1) for _, i in pieces], np.int64).reshape(-1, 2)

    def token_id(self, token):
        return None


def jsonl_format(path) -> str | None:
    """What a .jsonl file (or a folder whose first .jsonl file) holds, from its first record:
    "text", "prompt_completion", "messages", or "other" (a JSON object of other keys: the
    fine-tuning reader names the formats); None for other data, or a first line that is not JSON
    (the text reader then names the file and the line)."""
    from zerojax.data.finetune import record_format

    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(r, n) for r, _, names in os.walk(path) for n in names
                       if n.endswith((".jsonl", ".txt")))
    else:
        files = [path]
    if not files or not files[0].endswith(".jsonl") or not os.path.isfile(files[0]):
        return None
    with open(files[0], "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return None
            if not isinstance(record, dict):
                return None
            return record_format(record) or "other"
    return None


class TextRows:
    """Blocks of a token stream (zerojax.data.text): every token a target."""

    def __init__(self, data):
        self.data, self.vocab_size = data, data.vocab_size
        self.n_train, self.n_val = len(data.train), len(data.val)
        self.what = "training rows"

    def train_batches(self, batch_size, *, seed, start_step, num_steps):
        batches = self.data.train_batches(batch_size, seed=seed, start_step=start_step, num_steps=num_steps)
        self.steps_per_epoch = batches.steps_per_epoch
        return ({"input_ids": rows} for rows in batches)

    def val_batches(self, batch_size):
        return ({"input_ids": rows} for rows in self.data.val_batches(batch_size))


class FinetuneRows:
    """Fine-tuning rows (zerojax.data.finetune: input_ids, labels, and packed, segment_ids and
    positions); the last ~5% of the rows held out for validation, in whole batches."""

    def __init__(self, data, batch_size: int, packed: bool):
        n = len(data)
        n_val = min(max(1, round(0.05 * n)) if n >= 2 else 0, n - batch_size)
        n_val = n_val // batch_size * batch_size  # validation draws whole batches
        split = lambda lo, hi: dataclasses.replace(data, arrays={k: v[lo:hi] for k, v in data.arrays.items()})  # noqa: E731
        self.train, self.val = split(0, n - n_val), split(n - n_val, n)
        self.vocab_size = data.tokenizer.vocab_size
        self.n_train, self.n_val = n - n_val, n_val
        self.what = (f"{'packed' if packed else 'padded'} rows of {data.format.replace('_', ' / ')} examples, "
                     f"{self.train.target_tokens:,} target tokens")
        self.steps_per_epoch = max(1, self.n_train // batch_size)

    def train_batches(self, batch_size, *, seed, start_step, num_steps):
        return self.train.batches(batch_size, seed=seed, start_step=start_step, num_steps=num_steps)

    def val_batches(self, batch_size):
        import jax

        local = batch_size // jax.process_count()
        for k in range(self.n_val // batch_size):
            lo = k * batch_size + jax.process_index() * local
            yield self.val.batch(slice(lo, lo + local))


def load_method_data(args, method, choice, seq_len: int, batch_size: int):
    """--data read by a training method's own reader (`zerojax.methods.Method.data`: preference
    pairs for dpo / reward, ...), with the run's tokenizer, checked against the model."""
    from zerojax.data.text import DataError

    if not args.data:
        raise DataError(f"--method {method.name} trains on --data (a .jsonl of its records; docs/preference.md "
                        "for dpo and reward): give --data PATH")
    data = method.data(args.data, run_tokenizer(args), seq_len, batch_size)
    _check_vocab(data, choice)
    return data


def run_tokenizer(args):
    """The run's tokenizer: --tokenizer's folder (the --hf-checkpoint's by default), else UTF-8 bytes."""
    from zerojax.models import load_tokenizer

    return load_tokenizer(args.tokenizer) if args.tokenizer else ByteTokens()


def _check_vocab(data, choice):
    from zerojax.data.text import DataError

    if data.vocab_size > choice.config.vocab_size:
        raise DataError(f"the tokenizer has {data.vocab_size} tokens but the model's vocab is "
                        f"{choice.config.vocab_size}; give the model's own tokenizer (--tokenizer DIR)")


def load_data(args, choice, seq_len: int, batch_size: int, notes: list):
    """--data (or the embedded corpus) read, tokenized and checked against the model and one batch
    before anything is compiled -> TextRows or FinetuneRows."""
    from zerojax.data.finetune import load_finetune_data
    from zerojax.data.text import DataError, load_text_data

    fmt = jsonl_format(args.data) if args.data else None
    if fmt in (None, "text"):
        if args.pad:
            notes.append("--pad: no effect on this data (text is cut into --seq-len blocks; --pad is for "
                         "{\"prompt\", \"completion\"} / {\"messages\"} .jsonl records)")
        data = TextRows(load_text_data(args.data, seq_len=seq_len, tokenizer=args.tokenizer,
                                       min_train_rows=batch_size))
    else:
        packed = not args.pad
        if packed and not choice.family_spec.packs:
            packed = False
            notes.append(f"{choice.family_spec.label} has no segment ids to keep packed examples apart: one "
                         "example a row, padded")
        tokenizer = run_tokenizer(args)
        data = FinetuneRows(load_finetune_data(args.data, tokenizer, seq_len=seq_len, packed=packed),
                            batch_size, packed)
        if data.n_train < batch_size:
            raise DataError(f"{args.data}: {data.n_train} rows of {seq_len} tokens, fewer than one batch of "
                            f"{batch_size}: give more examples, a smaller batch or (packed) a longer --seq-len")
    _check_vocab(data, choice)
    return data
