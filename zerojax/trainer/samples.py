"""`--sample-prompts FILE`: what the model answers to held-out prompts, printed at each evaluation
and at the run's end, generated greedily from the engine's live weights (`zerojax.generate`: no
copy, no export).

FILE: a .jsonl of {"prompt": text or chat messages} records (the RL prompt format: messages are
rendered with the checkpoint's chat template and a generation prompt), or a text file with one
prompt a line. Read and tokenized when the run starts, before anything compiles.
"""
from __future__ import annotations

import os

from zerojax.data.text import DataError

MAX_SAMPLES = 16  # more is a generation benchmark, not a look at the model


class SamplePrompts:
    """The prompts of --sample-prompts, tokenized; `print_samples(engine, label)` generates and prints."""

    def __init__(self, path, tokenizer, max_new_tokens: int):
        from zerojax.rl.prompts import PromptData

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise DataError(f"--sample-prompts {path}: no such file; give a .jsonl of {{\"prompt\": ...}} records "
                            "or a text file with one prompt a line")
        if path.endswith(".jsonl"):
            from zerojax.data.finetune import jsonl_records

            records = [r for _, _, r in jsonl_records(path, what="--sample-prompts", example='{"prompt": "Hi"}')]
        else:
            with open(path, encoding="utf-8") as f:
                records = [{"prompt": line.rstrip("\n")} for line in f if line.strip()]
        if len(records) > MAX_SAMPLES:
            raise DataError(f"--sample-prompts {path}: {len(records)} prompts; give at most {MAX_SAMPLES} (they are "
                            "generated at every evaluation)")
        # seq_len only bounds the prompts here: generation sizes its own cache
        data = PromptData(records, tokenizer, seq_len=1 << 30, what=f"--sample-prompts {path}")
        self.texts, self.ids, self.tokenizer = data.texts, data.ids, tokenizer
        self.max_new_tokens = int(max_new_tokens)

    def generate(self, engine) -> list[str]:
        """Each prompt's greedy completion (eos ends it) as text."""
        import zerojax
        from zerojax.rl.prompts import decode

        out = zerojax.generate(engine, self.ids, max_new_tokens=self.max_new_tokens, temperature=0.0)
        return [decode(self.tokenizer, row[:-1] if reason == "stop" else row)
                for row, reason in zip(out.tokens, out.finish_reasons)]

    def print_samples(self, engine, label: str) -> list[str]:
        completions = self.generate(engine)
        for i, (prompt, completion) in enumerate(zip(self.texts, completions), 1):
            print(f"{label}: sample {i}: {prompt!r} -> {completion!r}", flush=True)
        return completions


__all__ = ["SamplePrompts", "MAX_SAMPLES"]
