"""Rewards that read the completion's text only: exact match on a record's field, a regular
expression. A leaf of `zerojax.rl`: `rewards` (which resolves specs) and `tasks` (whose built-in
tasks use them) both read it, so neither imports the other in a circle."""
from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[..., list]


def exact_match(field: str = "answer") -> RewardFn:
    """1.0 where the completion's first line (stripped) equals the record's `field`, else 0.0."""

    def reward(prompts, completions, **fields):
        if field not in fields:
            raise KeyError(f"reward exact_match:{field}: the prompt records have no {field!r} "
                           f"(they have {sorted(fields) or 'only the prompt'})")
        return [float(c.strip().split("\n", 1)[0].strip() == str(a).strip())
                for c, a in zip(completions, fields[field])]

    reward.__name__ = f"exact_match:{field}"
    return reward


def regex_match(pattern: str) -> RewardFn:
    """1.0 where `re.search(pattern, completion)` matches, else 0.0."""
    compiled = re.compile(pattern)

    def reward(prompts, completions, **fields):
        return [float(compiled.search(c) is not None) for c in completions]

    reward.__name__ = f"regex:{pattern}"
    return reward
