"""Fine-tuning data as people keep it: `.jsonl` files of `{"text"}`, `{"prompt", "completion"}`
or `{"messages"}` records -> token rows with a loss mask, packed or padded.

- text: every token is a target (the tokenizer's own special tokens added, then end-of-text);
- prompt / completion: only the completion's tokens (and the end-of-text after it) are targets;
- messages: the conversation rendered with the checkpoint's chat template (tokenizer_config.json's
  `chat_template`, or `chat_template.jinja`), exactly as transformers' `apply_chat_template`
  renders it (jinja2, the same sandboxed environment and globals); only the assistant turns'
  tokens are targets. A turn's span is what rendering the conversation up to it adds after the
  generation prompt (the conversation before it rendered with add_generation_prompt=True).

A batch is a dict of int32 [rows, seq_len] arrays: "input_ids", "labels" (the input ids, -100
where no loss, Hugging Face's convention; the shift is done in the loss), and when packed
"segment_ids" (1, 2, ... per example in a row, 0 for padding) and "positions" (restarting at 0
per example). `zerojax.models.llama.llama_loss` honours all of them: attention does not cross
examples and each example's rotary positions start at 0. An example's first token is never a
target (nothing of its own comes before it), so no example learns from the one packed before it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Iterator, Sequence

import numpy as np

from zerojax.data.text import DataError, HFTokenizer, epoch_order, process_slot

FORMATS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",)}
ROLES = ("system", "user", "assistant", "tool")
_EXAMPLE = {"text": '{"text": "..."}', "prompt_completion": '{"prompt": "...", "completion": "..."}',
            "messages": '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'}


# --------------------------------------------------------------------------- reading


def jsonl_records(path: str | os.PathLike, *, what: str = "fine-tuning data",
                  example: str = _EXAMPLE["prompt_completion"]):
    """(file, line, JSON value) of each non-blank line of a .jsonl file or a folder of them (sorted
    by path). Raises DataError naming the file, the line and the fix (not UTF-8, not JSON);
    `what` / `example` name the data in those messages."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path!r}")
    files = ([os.path.join(root, n) for root, _, names in os.walk(path) for n in names if n.endswith(".jsonl")]
             if os.path.isdir(path) else [path])
    if not files:
        raise FileNotFoundError(f"no .jsonl files under {path!r}")
    for file in sorted(files):
        if not file.endswith(".jsonl"):
            raise DataError(f"{file}: {what} is a .jsonl file (one JSON object a line, e.g. {example}); for "
                            "plain text use zerojax.data.text")
        with open(file, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise DataError(f"{file}:{line}: not UTF-8 text ({e.reason}); convert it with "
                            "`iconv -f <encoding> -t UTF-8`") from None
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{lineno}: column {e.colno}: not JSON ({e.msg}); each line is one JSON "
                                f"object such as {example}") from None
            yield file, lineno, record


def read_records(path: str | os.PathLike) -> tuple[str, list[tuple[str, int, dict]]]:
    """(format, [(file, line, record)]) of a .jsonl file or a folder of them (sorted by path).

    The format is the first record's ("text", "prompt_completion" or "messages"); every record
    must have it. Raises DataError naming the file, the line and the fix."""
    fmt, records = None, []
    for file, lineno, record in jsonl_records(path):
        got = record_format(record)
        if got is None:
            found = f"keys {sorted(record)[:6]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise DataError(f"{file}:{lineno}: not a fine-tuning record ({found}); each line is one of "
                            + "; ".join(_EXAMPLE.values()))
        if got == "prompt_completion" and "completion" not in record and "prompt" in record:
            raise DataError(f"{file}:{lineno}: a prompt without a completion: an RL prompt record (its other keys go "
                            "to the reward): train it with an RL method (GRPO or PPO: zerojax.rl.prompts), not as "
                            "fine-tuning data, whose records are " + _EXAMPLE["prompt_completion"])
        if got == "preference":
            raise DataError(f"{file}:{lineno}: a preference pair (\"chosen\" / \"rejected\"): train it with a "
                            "preference method (DPO or a reward model: zerojax.data.preference), not as "
                            "fine-tuning data")
        if fmt is None:
            fmt, first = got, (file, lineno)
        elif got != fmt:
            raise DataError(f"{file}:{lineno}: a {got!r} record, but {first[0]}:{first[1]} started the data as "
                            f"{fmt!r}; keep one format per data set (e.g. {_EXAMPLE[fmt]})")
        _check(record, fmt, f"{file}:{lineno}")
        records.append((file, lineno, record))
    if not records:
        raise DataError(f"{path}: no records; add lines such as {_EXAMPLE['prompt_completion']}")
    return fmt, records


def record_format(record) -> str | None:
    """The fine-tuning format one record is in ("messages", "prompt_completion", "text"), "preference"
    for a {"prompt", "chosen", "rejected"} pair (`zerojax.data.preference` reads those), else None."""
    if not isinstance(record, dict):
        return None
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "messages" in record:
        return "messages"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _check(record, fmt, where):
    if fmt == "messages":
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise DataError(f"{where}: messages[{i}] must be an object with a string \"role\" and a "
                                f"\"content\", e.g. {{\"role\": \"user\", \"content\": \"...\"}}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no \"assistant\" message, so nothing to learn; add the assistant's reply")
        return
    for key in FORMATS[fmt]:
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: {key!r} must be a string (got {type(record.get(key)).__name__}); "
                            f"each line is {_EXAMPLE[fmt]}")
    if fmt == "prompt_completion" and not record["completion"]:
        raise DataError(f"{where}: empty \"completion\", so nothing to learn; give the text the model should write")


# --------------------------------------------------------------------------- chat templates


@functools.lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """A chat template compiled as transformers compiles it (`utils/chat_template_utils.py`):
    jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
    extension, its `tojson` (no HTML escaping), `raise_exception` and `strftime_now`. (Templates
    with `{% generation %}` blocks: the block renders its body, as transformers' does.)"""
    import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' AssistantTracker, without the tracking
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                template: str | None = None) -> str:
    """`messages` rendered with the tokenizer folder's chat template (or `template`), with its
    special tokens (bos_token, eos_token, ...) as the template's variables: the text transformers'
    `tokenizer.apply_chat_template(messages, tokenize=False)` gives."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{getattr(tokenizer, 'path', 'the tokenizer')}: no chat template (tokenizer_config.json's "
                        "\"chat_template\" or chat_template.jinja) for {\"messages\"} records; use the tokenizer "
                        "folder of a chat (instruct) checkpoint, or give {\"prompt\", \"completion\"} records")
    special = dict(getattr(tokenizer, "special_tokens", {}) or {})
    return compile_chat_template(template).render(messages=list(messages), tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt, **special)


def assistant_spans(tokenizer, messages, template=None, where="", from_message: int = 0
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [(start, end)] character spans of its assistant turns; those
    of messages[from_message:] only: a preference pair's completion after its prompt)."""
    full = render_chat(tokenizer, messages, template=template)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < from_message:
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True, template=template) if i else ""
        upto = render_chat(tokenizer, messages[:i + 1], template=template)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template renders messages[{i}] differently once later turns "
                            "follow (e.g. it drops earlier reasoning), so the assistant turns cannot be located "
                            "in the rendered text; give one assistant turn per record (the last message), or "
                            "{\"prompt\", \"completion\"} records")
        spans.append((len(before), len(upto)))
    return full, spans


# --------------------------------------------------------------------------- tokens


def _eos(tokenizer):
    return [] if getattr(tokenizer, "eos_id", None) is None else [int(tokenizer.eos_id)]


def encode_record(record: dict, fmt: str, tokenizer, *, where: str = "", template=None, from_message: int = 0):
    """(ids int32 [n], loss mask bool [n]) of one record; mask True = a token to learn (messages:
    the assistant turns of messages[from_message:])."""
    if fmt == "text":
        ids = np.concatenate([tokenizer.encode(record["text"], add_special_tokens=True), _eos(tokenizer)])
        return ids.astype(np.int32), np.ones(len(ids), bool)
    if fmt == "prompt_completion":
        prompt = tokenizer.encode(record["prompt"], add_special_tokens=True)
        completion = np.concatenate([tokenizer.encode(record["completion"]), _eos(tokenizer)])
        ids = np.concatenate([prompt, completion]).astype(np.int32)
        return ids, np.concatenate([np.zeros(len(prompt), bool), np.ones(len(completion), bool)])
    text, spans = assistant_spans(tokenizer, record["messages"], template, where, from_message)
    ids, offsets = tokenizer.encode_with_offsets(text)
    starts = offsets[:, 0]
    mask = np.zeros(len(ids), bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return ids.astype(np.int32), mask


def named_pad_id(tokenizer) -> int | None:
    """The tokenizer's pad token's id, else its eos token's, else None (it names neither)."""
    special = getattr(tokenizer, "special_tokens", None) or {}
    return next((i for t in ("pad_token", "eos_token") if (tok := special.get(t))
                 and (i := tokenizer.token_id(tok)) is not None), None)


def pad_id_of(tokenizer) -> int:
    """The id rows are padded with: the tokenizer's pad token, else its eos token, else 0."""
    named = named_pad_id(tokenizer)
    return 0 if named is None else named


def pack_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, *, packed: bool = True,
                  pad_id: int = 0) -> dict[str, np.ndarray]:
    """Examples (ids, loss mask) -> rows of seq_len tokens: packed (examples placed in order, a row
    closed when the next does not fit; "segment_ids" and "positions" keep them apart) or padded
    (one example a row). An example longer than seq_len is cut to it. Padding: pad_id, label -100,
    segment 0."""
    if seq_len < 2:
        raise ValueError(f"{seq_len=} must be >= 2 (one token and one target)")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len  # forces a first row
    for ids, mask in examples:
        ids, mask = ids[:seq_len], mask[:seq_len]
        if not packed or used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    n = len(rows)
    input_ids = np.full((n, seq_len), pad_id, np.int32)
    labels = np.full((n, seq_len), -100, np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    positions = np.zeros((n, seq_len), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for k, (ids, mask) in enumerate(row, 1):
            span = slice(at, at + len(ids))
            input_ids[r, span] = ids
            labels[r, span] = np.where(mask, ids, -100)
            labels[r, at] = -100  # an example's first token: predicted from the example before it
            segment_ids[r, span] = k
            positions[r, span] = np.arange(len(ids))
            at += len(ids)
    out = {"input_ids": input_ids, "labels": labels}
    if packed:
        out.update(segment_ids=segment_ids, positions=positions)
    return out


@dataclasses.dataclass
class FinetuneData:
    """Rows of a fine-tuning data set: `arrays` ("input_ids", "labels" and, packed, "segment_ids",
    "positions"; each [rows, seq_len] int32). `batches(batch_size)` draws them as
    `zerojax.data.text.Batches` draws blocks: shuffled per epoch from (seed, epoch), process p of P
    taking its contiguous share of each global batch."""

    arrays: dict
    tokenizer: object
    seq_len: int
    format: str
    truncated: int = 0

    def __len__(self):  # rows: every array's leading axis (preference rows have no "input_ids")
        return len(next(iter(self.arrays.values())))

    @property
    def target_tokens(self) -> int:
        return int((self.arrays["labels"][:, 1:] != -100).sum())

    def batch(self, rows) -> dict:
        return {k: v[rows] for k, v in self.arrays.items()}

    def batches(self, batch_size: int, *, seed: int = 0, process_index=None, process_count=None,
                start_step: int = 0, num_steps: int | None = None) -> Iterator[dict]:
        process_index, process_count = process_slot(process_index, process_count)
        if batch_size % process_count:
            raise ValueError(f"batch_size={batch_size} must be divisible by process_count={process_count}")
        if len(self) < batch_size:
            raise DataError(f"only {len(self)} rows of {self.seq_len} tokens, fewer than one batch of "
                            f"{batch_size}: use more data, a smaller batch or a shorter seq_len")
        local, per_epoch = batch_size // process_count, len(self) // batch_size
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            epoch, k = divmod(step, per_epoch)
            rows = epoch_order(len(self), seed, epoch)[k * batch_size:(k + 1) * batch_size]
            yield self.batch(rows[process_index * local:(process_index + 1) * local])
            step += 1


class HeldOutRows:
    """A `FinetuneData` as the trainer reads it: the last ~5% of the rows held out for validation
    (whole batches, at least one batch left to train on), `train_batches(batch_size, *, seed,
    start_step, num_steps)` (shuffled per epoch, resumable), `val_batches(batch_size)` (this
    process's share of each), `n_train`, `n_val`, `vocab_size`, `steps_per_epoch` and `what` (a
    phrase for the run header: `describe()`, which a subclass words for its rows)."""

    def __init__(self, data: FinetuneData, batch_size: int):
        self.data, self.batch_size = data, batch_size
        n = len(data)
        n_val = min(max(1, round(0.05 * n)) if n >= 2 else 0, n - batch_size)
        n_val = max(0, n_val) // batch_size * batch_size  # validation draws whole batches
        split = lambda lo, hi: dataclasses.replace(data, arrays={k: v[lo:hi] for k, v in data.arrays.items()})  # noqa: E731
        self.train, self.val = split(0, n - n_val), split(n - n_val, n)
        self.vocab_size = data.tokenizer.vocab_size
        self.n_train, self.n_val = n - n_val, n_val
        self.steps_per_epoch = max(1, self.n_train // batch_size)
        self.what = self.describe()

    def describe(self) -> str:
        packed = "segment_ids" in self.data.arrays
        return (f"{'packed' if packed else 'padded'} rows of {self.data.format.replace('_', ' / ')} examples, "
                f"{self.train.target_tokens:,} target tokens")

    def train_batches(self, batch_size, *, seed, start_step, num_steps):
        return self.train.batches(batch_size, seed=seed, start_step=start_step, num_steps=num_steps)

    def val_batches(self, batch_size):
        import jax

        local = batch_size // jax.process_count()
        for k in range(self.n_val // batch_size):
            lo = k * batch_size + jax.process_index() * local
            yield self.val.batch(slice(lo, lo + local))


def load_finetune_data(source: str | os.PathLike, tokenizer, *, seq_len: int, packed: bool = True,
                       chat_template: str | None = None) -> FinetuneData:
    """Read, render, tokenize and pack a .jsonl file (or a folder of them) for fine-tuning.

    tokenizer: a tokenizer folder / tokenizer.json path, or a loaded `HFTokenizer`.
    packed: several examples a row, kept apart by segment ids (default), else one a row, padded.
    chat_template: overrides the tokenizer folder's, for {"messages"} records."""
    if isinstance(tokenizer, (str, os.PathLike)):  # a str has .encode too: test for a path first
        tokenizer = HFTokenizer(tokenizer)
    fmt, records = read_records(source)
    examples, truncated = [], 0
    for file, lineno, record in records:
        where = f"{file}:{lineno}"
        try:
            ids, mask = encode_record(record, fmt, tokenizer, where=where, template=chat_template)
        except DataError:
            raise
        except Exception as e:  # a template's raise_exception, a jinja2 error
            raise DataError(f"{where}: the chat template failed on this record ({type(e).__name__}: {e}); "
                            "check the roles and their order against the checkpoint's template") from None
        if not mask[1:].any():
            raise DataError(f"{where}: no token to learn (empty completion or assistant turn after tokenizing)")
        truncated += len(ids) > seq_len
        if len(ids) > seq_len and not mask[1:seq_len].any():
            raise DataError(f"{where}: {len(ids)} tokens, and the first {seq_len} (--seq-len) hold none of the "
                            "completion / assistant tokens; raise seq_len or shorten the prompt")
        examples.append((ids, mask))
    if truncated:
        warnings.warn(f"{os.fspath(source)}: {truncated} of {len(examples)} examples are longer than "
                      f"seq_len={seq_len} tokens and were cut to it", UserWarning, stacklevel=2)
    arrays = pack_examples(examples, seq_len, packed=packed, pad_id=pad_id_of(tokenizer))
    return FinetuneData(arrays=arrays, tokenizer=tokenizer, seq_len=seq_len, format=fmt, truncated=truncated)


__all__ = ["FORMATS", "FinetuneData", "HeldOutRows", "load_finetune_data", "read_records", "jsonl_records", "pad_id_of",
           "record_format", "encode_record", "pack_examples",
           "render_chat", "assistant_spans", "compile_chat_template"]
