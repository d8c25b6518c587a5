"""Text -> token blocks -> batches, with no download needed.

A block is `seq_len` consecutive tokens of the packed stream (documents joined by the
tokenizer's end-of-text token when it has one, else by a blank line). The next-token shift is
done inside the loss (`gpt2_loss`), as Hugging Face does: a block of T tokens gives T-1
predictions, and a batch is just int32 `input_ids` [rows, seq_len].

Order: blocks are shuffled once per epoch by a permutation drawn from (seed, epoch); global
batch k of an epoch is rows [k*B, (k+1)*B) of that permutation, and process p of P gets its
contiguous 1/P of those rows. Every process tokenizes the same text and draws the same
permutation, so the shares are disjoint and together are exactly the global batch.

Validation is the last `val_fraction` of the blocks, in stream order (not shuffled in), so it is
text the training split never sees pieces of.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from zerojax.models.tokenizer import HFTokenizer

TEXT_SUFFIXES = (".txt", ".jsonl")


# --------------------------------------------------------------------------- text


class DataError(ValueError):
    """Training text that cannot be used; the message names the file, the line or byte offset,
    and the fix."""


def read_texts(path: str | os.PathLike) -> list[str]:
    """Documents from a .txt file (one document), a .jsonl file (the "text" field of each line),
    or a folder of them (recursively, sorted by path; empty files in a folder are skipped).

    Raises DataError naming the file and the line (.jsonl) or byte offset (.txt) for text that
    is not UTF-8 (e.g. a binary file), a .jsonl line that is not a JSON object with a string
    "text", and a file (or a whole folder) with no text.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"text data not found: {path!r}")
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(path) for name in names if name.endswith(TEXT_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"no {'/'.join(TEXT_SUFFIXES)} files under {path!r}")
        docs = [doc for f in files for doc in _read_file(f)]
        if not docs:
            raise DataError(f"{path}: its {len(files)} {'/'.join(TEXT_SUFFIXES)} file(s) hold no "
                            f"text; add text to them or point --data at another folder")
        return docs
    docs = _read_file(path)
    if not docs:
        what = "no records" if path.endswith(".jsonl") else "no text (empty or only whitespace)"
        raise DataError(f"{path}: {what}; give a file with text to train on")
    return docs


def _read_file(path: str) -> list[str]:
    """One file's documents ([] when it holds no text)."""
    with open(path, "rb") as f:
        raw = f.read()
    nul = raw.find(b"\x00")
    if nul >= 0:  # valid UTF-8 may still be binary (e.g. UTF-16 text or an archive)
        raise DataError(f"{path}: byte offset {nul}: a NUL byte, so this is a binary file (or not "
                        f"UTF-8, e.g. UTF-16); give UTF-8 text: a .txt file, or a .jsonl file of "
                        f"{{\"text\": ...}} lines (convert with `iconv -t UTF-8`)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: byte offset {e.start} (line {line}): not UTF-8 text "
                        f"({e.reason}); give UTF-8 text (convert with `iconv -f <encoding> "
                        f"-t UTF-8`)") from None
    if not path.endswith(".jsonl"):
        return [text] if text.strip() else []
    docs = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: column {e.colno}: not JSON ({e.msg}); each line of "
                            f"a .jsonl file is one JSON object such as {{\"text\": \"...\"}}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            found = (f"keys {sorted(record)[:5]}" if isinstance(record, dict)
                     else f"a JSON {type(record).__name__}")
            raise DataError(f"{path}:{lineno}: no string \"text\" field ({found}); each line of a "
                            f"JSONL file is one object such as {{\"text\": \"...\"}}")
        docs.append(record["text"])
    return docs


# The embedded corpus is a snapshot file, not rebuilt at run time: built from live module objects
# it followed whatever the process had imported (transformers adds documented methods to
# logging.Logger, torch wraps inspect.getfile), so a test process and the children it launched
# trained on different text. corpus/build.py writes the snapshot from a clean interpreter.
_CORPUS_SNAPSHOT = "corpus/stdlib_docstrings.txt.gz"   # beside this module


@functools.lru_cache(maxsize=1)
def default_corpus() -> str:
    """About 0.8 MB of English technical prose that needs no download: the docstrings of a fixed
    list of Python standard-library modules, their classes, functions and methods (see
    zerojax/data/corpus/build.py). A fixed snapshot shipped with zerojax: the same text whatever
    Python version runs and whatever the process has imported."""
    import gzip
    from importlib import resources

    return gzip.decompress(resources.files("zerojax.data").joinpath(_CORPUS_SNAPSHOT).read_bytes()).decode("utf-8")


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no unknowns, no special tokens."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


# HFTokenizer lives beside the models that read its folders (zerojax.models.tokenizer); the
# name stays importable from here


def load_tokenizer(path: str | os.PathLike | None = None):
    """HFTokenizer for a tokenizer.json (or a folder holding one); None -> ByteTokenizer."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def tokenize(texts: Sequence[str], tokenizer) -> np.ndarray:
    """Documents -> one int32 token stream, documents separated by the tokenizer's end-of-text
    token, or by a blank line when it has none (the byte tokenizer)."""
    if tokenizer.eos_id is None:
        return tokenizer.encode("\n\n".join(texts))
    encode_batch = getattr(tokenizer, "encode_batch", None)
    pieces = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
    eos = np.asarray([tokenizer.eos_id], np.int32)
    out = [p for piece in pieces for p in (piece, eos)]
    return np.concatenate(out[:-1]) if out else np.zeros((0,), np.int32)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Token stream -> [n_blocks, seq_len] int32; the tail shorter than seq_len is dropped."""
    n = len(tokens) // seq_len
    return np.asarray(tokens[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


# --------------------------------------------------------------------------- batches


def process_slot(process_index, process_count):
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"{process_index=} must be in [0, {process_count=})")
    return process_index, process_count


def epoch_order(n_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of block indices for one epoch (same on every process)."""
    return np.random.default_rng([seed, epoch]).permutation(n_blocks)


@dataclasses.dataclass
class Batches:
    """Global batches of `batch_size` rows, this process's share of each.

    `batches[step]` is the local [batch_size // process_count, seq_len] int32 array of global
    step `step` (random access, so a resumed run continues exactly); iterating yields steps
    start_step, start_step + 1, ... forever (num_steps=None) or num_steps of them. An epoch is
    len(blocks) // batch_size steps; the blocks a partial batch would take are skipped that epoch.
    """

    blocks: np.ndarray
    batch_size: int
    seed: int = 0
    process_index: int | None = None
    process_count: int | None = None
    start_step: int = 0
    num_steps: int | None = None

    def __post_init__(self):
        self.process_index, self.process_count = process_slot(self.process_index, self.process_count)
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by "
                             f"process_count={self.process_count}")
        if len(self.blocks) < self.batch_size:
            raise ValueError(f"only {len(self.blocks)} blocks of {self.blocks.shape[1]} tokens, "
                             f"fewer than one batch of {self.batch_size} rows: use more text, a "
                             f"smaller batch or a shorter seq_len")
        self.local_batch_size = self.batch_size // self.process_count

    @property
    def steps_per_epoch(self) -> int:
        return len(self.blocks) // self.batch_size

    def global_rows(self, step: int) -> np.ndarray:
        """Block indices of global batch `step`, all processes' rows."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return epoch_order(len(self.blocks), self.seed, epoch)[k * self.batch_size:(k + 1) * self.batch_size]

    def __getitem__(self, step: int) -> np.ndarray:
        rows = self.global_rows(step)
        lo = self.process_index * self.local_batch_size
        return self.blocks[rows[lo:lo + self.local_batch_size]]

    def __iter__(self) -> Iterator[np.ndarray]:
        step = self.start_step
        while self.num_steps is None or step < self.start_step + self.num_steps:
            yield self[step]
            step += 1


@dataclasses.dataclass
class TokenData:
    train: np.ndarray  # [n_train, seq_len] int32 blocks
    val: np.ndarray  # [n_val, seq_len] int32 blocks
    tokenizer: object
    seq_len: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def train_batches(self, batch_size: int, *, seed: int = 0, **kwargs) -> Batches:
        return Batches(self.train, batch_size, seed=seed, **kwargs)

    def val_batches(self, batch_size: int, *, process_index=None, process_count=None) -> Iterator[np.ndarray]:
        """One pass over the validation blocks in order, this process's rows of each full batch."""
        b = Batches(self.val, batch_size, seed=0, process_index=process_index,
                    process_count=process_count)
        for k in range(len(self.val) // batch_size):
            rows = np.arange(k * batch_size, (k + 1) * batch_size)
            lo = b.process_index * b.local_batch_size
            yield self.val[rows[lo:lo + b.local_batch_size]]


def load_text_data(source: str | os.PathLike | None = None, *, seq_len: int,
                   tokenizer: str | os.PathLike | None = None, val_fraction: float = 0.05,
                   min_train_rows: int = 1) -> TokenData:
    """Read, tokenize and pack text into train / validation blocks.

    source: a .txt / .jsonl file or a folder of them; None -> `default_corpus()`.
    tokenizer: path of a tokenizer.json (or its folder); None -> bytes (vocab 256).
    val_fraction: share of the blocks held out at the end of the stream (at least one block
    when > 0 and there are two or more blocks).
    min_train_rows: fewest training blocks the caller needs (one global batch); fewer raise a
    DataError here, while reading, rather than when the first batch is drawn.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"{val_fraction=} must be in [0, 1)")
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1")
    tok = load_tokenizer(tokenizer)
    texts = [default_corpus()] if source is None else read_texts(source)
    tokens = tokenize(texts, tok)
    blocks = pack(tokens, seq_len)
    n_val = 0
    if val_fraction > 0 and len(blocks) >= 2:
        n_val = max(1, int(round(len(blocks) * val_fraction)))
    n_train = len(blocks) - n_val
    if n_train < min_train_rows:
        where = "the default corpus" if source is None else os.fspath(source)
        raise DataError(
            f"{where}: too short: {len(tokens)} tokens make {len(blocks)} blocks of {seq_len} "
            f"({n_train} for training after {n_val} held out for validation), fewer than one batch "
            f"of {min_train_rows} rows; give more text, a shorter --seq-len or a smaller batch")
    return TokenData(train=blocks[:n_train], val=blocks[n_train:], tokenizer=tok, seq_len=seq_len)
