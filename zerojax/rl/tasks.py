"""Built-in verifiable tasks: prompts made from a seed (no download) and their reward, so an RL
run shows its reward rising on a fresh machine (byte-level tokenizer: no tokenizer files either).

- "arithmetic": "a+b=" with two-digit a, b (every prompt 6 bytes); reward 1.0 where the
  completion's first line is the sum (`exact_match` on the record's "answer"), else 0.0.
- "digit": "n:" with a two-digit n; reward the mean over the completion's characters of 1.0 for
  "7", 0.25 for another digit, 0.0 otherwise (dense: a random byte-level model starts near 0.05),
  for tests and smoke runs of a tiny model.
- "word-problems": short English word problems (buying, sharing, ages, distances, remainders; one
  or two operations on small integers) after one worked example; reward 1.0 for the exact integer
  after the completion's first "#### " (GSM8K's format), else 0.0 (`zerojax.rl.word_problems`).
  For a pretrained 0.5B-1B model from a Hugging Face folder: a reward curve in a few hundred steps.

`records(name, n, seed)` -> n dicts {"prompt", ...}; `TASKS[name].reward(prompts, completions, **fields)`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from zerojax.rl import word_problems
from zerojax.rl.text_rewards import exact_match


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    what: str
    make: Callable[[np.random.Generator, int], list]  # (rng, n) -> records
    reward: Callable[..., list]


def _arithmetic(rng, n):
    a, b = rng.integers(10, 100, n), rng.integers(10, 100, n)
    return [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in zip(a.tolist(), b.tolist())]


def _digit(rng, n):
    return [{"prompt": f"{x}:"} for x in rng.integers(10, 100, n).tolist()]


def digit_reward(prompts, completions, **fields):
    """Mean over each completion's characters: 1.0 for "7", 0.25 for another digit, else 0."""
    return [float(np.mean([1.0 if ch == "7" else 0.25 if ch.isdigit() else 0.0 for ch in c])) if c else 0.0
            for c in completions]


TASKS = {
    "arithmetic": Task("arithmetic", "two-digit sums, exact answer", _arithmetic, exact_match("answer")),
    "digit": Task("digit", "emit the digit 7", _digit, digit_reward),
    "word-problems": Task("word-problems", "English word problems, answer after ####", word_problems.make,
                          word_problems.reward),
}


def records(name: str, n: int = 4096, seed: int = 0) -> list[dict]:
    """n prompt records of the built-in task `name`, the same for the same seed."""
    if name not in TASKS:
        raise ValueError(f"no built-in RL task {name!r}; built in: {', '.join(TASKS)}")
    return TASKS[name].make(np.random.default_rng(seed), n)


__all__ = ["Task", "TASKS", "records", "digit_reward"]
