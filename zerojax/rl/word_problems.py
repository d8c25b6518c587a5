"""The "word-problems" task: short English word problems (buying, sharing, ages, distances, remainders;
one or two operations, small integers) generated from a seed, no download.

The answer format is GSM8K's "#### <number>": it is what GSM8K-trained and pretrained models have
seen most (GSM8K's solutions end with it, and verl's gsm8k scorer reads it), so a base model's
first completions already use it sometimes and GRPO has a reward to climb from; and "####" never
appears in a problem's text, so the parser cannot pick up a number quoted from the question.

The reward is binary (1.0 for the exact integer after the completion's first "####", else 0.0, as
verl's gsm8k default format_score=0): partial credit for a right number anywhere in the text pays
a completion that lists many numbers. The first "####" counts, not the last: rollouts run to
max_new_tokens, and a base model keeps writing past its answer (a made-up next question with its
own "####") that must not count.

Each problem is built with its answer's expression (`Problem.expr`: nested (op, left, right) over
ints), so a test can recompute every answer another way (tests/rl/test_word_problems.py).
"""
from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

# one worked example ahead of each question: a pretrained base model (no chat template) learns the
# "Q: / A: / ####" layout from it; it is the same for every prompt, so it adds no noise to the task
PREAMBLE = ('Solve the problem. Show the arithmetic, then end with the answer as "#### <number>".\n'
            "Q: Ann has 3 bags with 4 apples in each bag. How many apples does she have?\n"
            "A: 3 * 4 = 12\n#### 12\n")
# the longest prompt in bytes (tested over thousands of seeds): at most this many tokens with the
# byte-level tokenizer, about a quarter of it with a BPE tokenizer (Llama / Qwen: ~70 tokens)
MAX_PROMPT_BYTES = 320

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kim", "Lena", "Max", "Nia")
ITEMS = ("pens", "apples", "books", "stickers", "cards", "cups", "toys", "eggs", "shells", "coins")
OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "div": lambda a, b: a // b, "mod": lambda a, b: a % b}
_ANSWER = re.compile(r"####[ \t]*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


@dataclasses.dataclass(frozen=True)
class Problem:
    text: str      # the question alone, without the preamble
    answer: int
    expr: tuple    # (op, left, right), each side an int or another expr; op in OPS
    kind: str      # the template's name


def evaluate(expr) -> int:
    """The integer value of an (op, left, right) tree (div exact and mod on ints by construction)."""
    if isinstance(expr, int):
        return expr
    op, left, right = expr
    return OPS[op](evaluate(left), evaluate(right))


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _n(rng, lo, hi) -> int:
    """An int in [lo, hi] (both ends included)."""
    return int(rng.integers(lo, hi + 1))


def _buy(rng):
    name, item, n, price = _pick(rng, NAMES), _pick(rng, ITEMS), _n(rng, 2, 9), _n(rng, 2, 9)
    text = f"{name} buys {n} {item} at {price} dollars each. How many dollars does {name} spend?"
    return text, ("mul", n, price)


def _change(rng):
    name, item, n, price = _pick(rng, NAMES), _pick(rng, ITEMS), _n(rng, 2, 9), _n(rng, 2, 9)
    bill = 50 if n * price < 50 else 100  # a bill that always covers the cost: the change is never negative
    text = (f"{name} buys {n} {item} at {price} dollars each and pays with a {bill} dollar bill. "
            f"How many dollars of change does {name} get?")
    return text, ("sub", bill, ("mul", n, price))


def _share(rng):
    name, item, each, k = _pick(rng, NAMES), _pick(rng, ITEMS), _n(rng, 2, 12), _n(rng, 2, 9)
    text = (f"{name} shares {each * k} {item} equally among {k} friends. "
            f"How many {item} does each friend get?")
    return text, ("div", each * k, k)


def _gather_share(rng):
    name, item, each, k = _pick(rng, NAMES), _pick(rng, ITEMS), _n(rng, 2, 12), _n(rng, 2, 6)
    total = each * k
    have = _n(rng, 2, total - 2)  # have + found = total, so the share is exact; 2+ of each: plural nouns
    text = (f"{name} has {have} {item} and finds {total - have} more, then shares them equally among {k} "
            f"friends. How many {item} does each friend get?")
    return text, ("div", ("add", have, total - have), k)


def _age_later(rng):
    a, b = rng.choice(len(NAMES), 2, replace=False).tolist()
    age, older, years = _n(rng, 4, 30), _n(rng, 2, 20), _n(rng, 2, 15)
    text = (f"{NAMES[a]} is {age} years old. {NAMES[b]} is {older} years older than {NAMES[a]}. "
            f"How old will {NAMES[b]} be in {years} years?")
    return text, ("add", ("add", age, older), years)


def _age_times(rng):
    a, b = rng.choice(len(NAMES), 2, replace=False).tolist()
    age, times = _n(rng, 2, 12), _n(rng, 2, 5)
    text = f"{NAMES[a]} is {age} years old. {NAMES[b]} is {times} times as old as {NAMES[a]}. How old is {NAMES[b]}?"
    return text, ("mul", age, times)


def _distance(rng):
    speed, hours = _n(rng, 3, 60), _n(rng, 2, 9)
    text = f"A car drives at {speed} km per hour for {hours} hours. How many km does it drive?"
    return text, ("mul", speed, hours)


def _rate(rng):
    speed, hours, later = _n(rng, 2, 20), _n(rng, 2, 6), _n(rng, 2, 9)
    text = (f"A cyclist rides {speed * hours} km in {hours} hours. At the same speed, how many km does the "
            f"cyclist ride in {later} hours?")
    return text, ("mul", ("div", speed * hours, hours), later)


def _leftover(rng):
    name, k = _pick(rng, NAMES), _n(rng, 3, 12)
    n = _n(rng, k + 1, 10 * k)
    text = f"{name} packs {n} eggs into boxes of {k}. How many eggs are left over?"
    return text, ("mod", n, k)


def _leftover_sum(rng):
    name, item, k = _pick(rng, NAMES), _pick(rng, ITEMS), _n(rng, 3, 9)
    have, more = _n(rng, 5, 60), _n(rng, 2, 40)
    text = (f"{name} has {have} {item} and gets {more} more. {name} puts them in bags of {k}. "
            f"How many {item} are left over?")
    return text, ("mod", ("add", have, more), k)


TEMPLATES = {"buy": _buy, "change": _change, "share": _share, "gather-share": _gather_share,
             "age-later": _age_later, "age-times": _age_times, "distance": _distance, "rate": _rate,
             "leftover": _leftover, "leftover-sum": _leftover_sum}


def problem(rng) -> Problem:
    """One problem: a template drawn uniformly, its numbers from rng."""
    kind = _pick(rng, tuple(TEMPLATES))
    text, expr = TEMPLATES[kind](rng)
    return Problem(text, evaluate(expr), expr, kind)


def prompt(text: str) -> str:
    """The prompt the model sees: the preamble's worked example, then the question in its layout."""
    return f"{PREAMBLE}Q: {text}\nA:"


def problems(rng, n: int) -> list[Problem]:
    return [problem(rng) for _ in range(n)]


def make(rng, n: int) -> list[dict]:
    """The task's records: {"prompt", "answer"} (the answer an integer's decimal text)."""
    return [{"prompt": prompt(p.text), "answer": str(p.answer)} for p in problems(rng, n)]


def parse_answer(completion: str) -> Fraction | None:
    """The number after the completion's first "####" (thousands commas dropped), None where there is
    none or it is not a number."""
    found = _ANSWER.search(completion)
    if found is None or completion.find("####") != found.start():
        return None
    return Fraction(found.group(1).replace(",", ""))


def reward(prompts, completions, answer, **fields) -> list[float]:
    """1.0 where the number after the completion's first "####" equals the record's answer, else 0.0."""
    return [float(parse_answer(c) == int(a)) for c, a in zip(completions, answer)]


__all__ = ["Problem", "TEMPLATES", "PREAMBLE", "MAX_PROMPT_BYTES", "evaluate", "problem", "problems", "prompt",
           "make", "parse_answer", "reward"]
