"""Prompts for RL fine-tuning: records {"prompt": text or chat messages, ...other fields} (the
other fields go to the reward functions, e.g. "answer"), tokenized once, in a deterministic
order per step.

Shapes are fixed by the data and the run's seq_len alone: every training row is seq_len tokens,
the prompt region is the longest prompt (`prompt_len`), the completion region the rest
(`completion_len` = seq_len - prompt_len; generation's max_new_tokens is at most that), so one
program trains every step whatever was generated.

    data = load_prompts("arithmetic", ByteTokens(), seq_len=16)     # a built-in task, or a .jsonl
    data.indices(8, seed=0, step=3)                                 # the prompts of step 3
"""
from __future__ import annotations

import os

import numpy as np

from zerojax.data.text import DataError
from zerojax.rl import tasks

EXAMPLE = '{"prompt": "What is 2+3?", "answer": "5"}'
BATCH_KEYS = ("input_ids", "prompt_lengths", "completion_mask", "advantages", "old_logps", "ref_logps",
              "token_weights", "rollout_logps")
_REPLACEMENT = "\ufffd".encode()  # U+FFFD in UTF-8


def decode(tokenizer, ids) -> str:
    """Token ids -> text (the byte-level tokenizer's bytes where it has no decode; an id past the
    bytes, which a model of a larger vocabulary can sample, reads as U+FFFD as a bad byte does)."""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode([int(i) for i in ids])
    raw = b"".join(bytes([i]) if 0 <= i < 256 else _REPLACEMENT for i in map(int, ids))
    return raw.decode("utf-8", errors="replace")


class PromptData:
    """The trainer's reader for RL methods (`zerojax.methods.Method.data`). The batches trained on
    come from the rollouts (`zerojax.rl.RolloutBatches`); `train_batches` yields zero batches of
    their shapes (what the planner compiles), `val_batches` none."""

    def __init__(self, records: list[dict], tokenizer, seq_len: int, *, what: str = "prompts", task: str | None = None):
        # what: how messages name the records' source; task: the built-in task they come from (its reward the
        # default); .what is the run header's noun for the rows ("50 prompts"), as the other readers' is
        if not records:
            raise DataError(f"{what}: no prompt records; each line is one JSON object such as {EXAMPLE}")
        self.records, self.tokenizer, self.seq_len = records, tokenizer, int(seq_len)
        self.source, self.task = what, task
        self.what = "prompts" + (f" of the built-in task {task!r}" if task else "")
        self.texts, self.ids = [], []
        for i, record in enumerate(records):
            text, add_special = _prompt_text(record, tokenizer, f"{what}: record {i + 1}")
            self.texts.append(text)
            self.ids.append([int(t) for t in np.ravel(tokenizer.encode(text, add_special_tokens=add_special))])
        self.prompt_len = max(len(r) for r in self.ids)
        self.completion_len = self.seq_len - self.prompt_len
        if self.completion_len < 1:
            raise DataError(f"{what}: the longest prompt has {self.prompt_len} tokens, seq_len is {seq_len}: raise "
                            "seq_len to prompt + the completion's tokens (e.g. --seq-len "
                            f"{self.prompt_len + 256})")
        self.fields = sorted({k for r in records for k in r if k != "prompt"})
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 0) or 0)
        self.n_train, self.n_val = len(records), 0

    # ------------------------------------------------------------------ which prompts, when

    def indices(self, n: int, *, seed: int, step: int, refill: int = 0) -> np.ndarray:
        """The n prompts of optimizer step `step` (refill k > 0: the k-th extra draw of that step,
        DAPO's dynamic sampling): epochs of a permutation by (seed, epoch), a function of its
        arguments only (a resumed run draws what the uninterrupted one drew)."""
        if refill:
            return np.random.default_rng([seed, step, refill]).choice(len(self.ids), n, replace=n > len(self.ids))
        out, pos = [], step * n
        while len(out) < n:
            epoch, k = divmod(pos, len(self.ids))
            perm = np.random.default_rng([seed, epoch]).permutation(len(self.ids))
            take = perm[k:k + n - len(out)]
            out.extend(take.tolist())
            pos += len(take)
        return np.asarray(out, np.int64)

    def fields_of(self, rows) -> dict[str, list]:
        """{field: [value per row]} of the records' other keys (None where a record lacks one)."""
        return {k: [self.records[i].get(k) for i in rows] for k in self.fields}

    # ------------------------------------------------------------------ the trainer's reader

    def steps_per_epoch_for(self, prompts_per_step: int) -> int:
        return max(1, len(self.ids) // max(1, prompts_per_step))

    @property
    def steps_per_epoch(self) -> int:
        return len(self.ids)  # (prompts per step unknown here: an upper bound)

    def example_batch(self, rows: int) -> dict:
        """A batch of the rollouts' keys, dtypes and shapes, all zeros."""
        T, C = self.seq_len, self.completion_len
        return {"input_ids": np.zeros((rows, T), np.int32), "prompt_lengths": np.ones((rows,), np.int32),
                "completion_mask": np.zeros((rows, C), np.float32), "advantages": np.zeros((rows,), np.float32),
                "old_logps": np.zeros((rows, C), np.float32), "ref_logps": np.zeros((rows, C), np.float32),
                "token_weights": np.zeros((rows,), np.float32),
                # the generating weights' log-probs (off_policy); zeros, unread, on-policy: one batch shape for both
                "rollout_logps": np.zeros((rows, C), np.float32)}

    def train_batches(self, batch_size: int, *, seed: int = 0, start_step: int = 0, num_steps: int | None = None):
        for _ in range(1 if num_steps is None else num_steps):
            yield self.example_batch(batch_size)

    def val_batches(self, batch_size: int):
        return iter(())


def _prompt_text(record, tokenizer, where) -> tuple[str, bool]:
    """(the prompt's text, whether the tokenizer adds its special tokens): chat messages rendered
    with the checkpoint's template and a generation prompt (the template writes BOS itself)."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise DataError(f"{where}: no \"prompt\"; each line is one JSON object such as {EXAMPLE}")
    prompt = record["prompt"]
    if isinstance(prompt, str) and prompt:
        return prompt, True
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        from zerojax.data.finetune import render_chat

        return render_chat(tokenizer, prompt, add_generation_prompt=True), False
    raise DataError(f"{where}: \"prompt\" is {type(prompt).__name__}; give text or a list of chat messages "
                    "[{\"role\": \"user\", \"content\": ...}]")


def load_prompts(source, tokenizer, seq_len: int, batch_size: int | None = None, *, n: int = 4096,
                 seed: int = 0) -> PromptData:
    """A built-in task's name (`zerojax.rl.tasks`: n records from seed) or a .jsonl file / folder of
    prompt records -> PromptData."""
    source = os.fspath(source)
    if source in tasks.TASKS and not os.path.exists(source):
        return PromptData(tasks.records(source, n, seed), tokenizer, seq_len, what=f"the built-in task {source!r}",
                          task=source)
    if not os.path.exists(source):
        import difflib

        near = difflib.get_close_matches(source, list(tasks.TASKS), n=1)
        raise DataError(f"{source}: no such file or folder of RL prompts ({os.path.abspath(source)}), nor a built-in "
                        f"task ({', '.join(tasks.TASKS)})" + (f"; did you mean {near[0]}?" if near else ""))
    from zerojax.data.finetune import jsonl_records

    records = []
    for file, lineno, record in jsonl_records(source, what="RL prompts", example=EXAMPLE):
        if isinstance(record, dict) and "chosen" in record and "rejected" in record:
            raise DataError(f"{file}:{lineno}: a preference pair (\"chosen\" / \"rejected\"), not an RL prompt: train "
                            "pairs with a preference method (DPO or a reward model: zerojax.data.preference); RL "
                            f"prompts are {EXAMPLE}")
        records.append(record)
    return PromptData(records, tokenizer, seq_len, what=source)


__all__ = ["PromptData", "load_prompts", "decode", "BATCH_KEYS"]
