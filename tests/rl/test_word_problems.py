"""The "word-problems" task (zerojax/rl/word_problems.py) against references that share none of its
code: every generated question is parsed back from its English with this file's own patterns and
solved with `fractions.Fraction` (so an inexact share or a negative change would show), and each
problem's expression tree is evaluated by this file's own evaluator, its operands the numbers the
text states. Then: the same records for the same seed, prompts within their byte budget, and the
reward on hand-written completions."""
import re
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from zerojax.data.rows import ByteTokens
from zerojax.rl import rewards, tasks, word_problems
from zerojax.rl.prompts import load_prompts

SEEDS, PER_SEED = range(2000), 4
Q = r"(\w+)"  # a name or an item
N = r"(\d+)"

# template kind -> (a pattern of its English, the answer from the numbers in the order the text gives them)
SOLVERS = {
    "buy": (rf"{Q} buys {N} {Q} at {N} dollars each\. How many dollars does \1 spend\?",
            lambda n, price: n * price),
    "change": (rf"{Q} buys {N} {Q} at {N} dollars each and pays with a {N} dollar bill\. "
               rf"How many dollars of change does \1 get\?", lambda n, price, bill: bill - n * price),
    "share": (rf"{Q} shares {N} {Q} equally among {N} friends\. How many \3 does each friend get\?",
              lambda total, k: Fraction(total, k)),
    "gather-share": (rf"{Q} has {N} {Q} and finds {N} more, then shares them equally among {N} friends\. "
                     rf"How many \3 does each friend get\?", lambda a, b, k: Fraction(a + b, k)),
    "age-later": (rf"{Q} is {N} years old\. {Q} is {N} years older than \1\. How old will \3 be in {N} years\?",
                  lambda age, older, years: age + older + years),
    "age-times": (rf"{Q} is {N} years old\. {Q} is {N} times as old as \1\. How old is \3\?",
                  lambda age, times: age * times),
    "distance": (rf"A car drives at {N} km per hour for {N} hours\. How many km does it drive\?",
                 lambda speed, hours: speed * hours),
    "rate": (rf"A cyclist rides {N} km in {N} hours\. At the same speed, how many km does the cyclist ride in "
             rf"{N} hours\?", lambda km, hours, later: Fraction(km, hours) * later),
    "leftover": (rf"{Q} packs {N} eggs into boxes of {N}\. How many eggs are left over\?", lambda n, k: n % k),
    "leftover-sum": (rf"{Q} has {N} {Q} and gets {N} more\. \1 puts them in bags of {N}\. How many \3 are left "
                     rf"over\?", lambda a, b, k: (a + b) % k),
}


def _question(prompt: str) -> str:
    """The question of a record's prompt: after the shared worked example, between "Q: " and "\\nA:"."""
    assert prompt.startswith(word_problems.PREAMBLE) and prompt.endswith("\nA:")
    rest = prompt[len(word_problems.PREAMBLE):-len("\nA:")]
    assert rest.startswith("Q: ") and "\n" not in rest
    return rest[len("Q: "):]


def _solve(question: str) -> tuple[str, Fraction]:
    """(the kind whose pattern matches the whole question, the answer it means); exactly one matches."""
    found = []
    for kind, (pattern, solve) in SOLVERS.items():
        m = re.fullmatch(pattern, question)
        if m:
            numbers = [int(g) for g in m.groups() if g.isdigit()]
            found.append((kind, Fraction(solve(*numbers))))
    assert len(found) == 1, (question, found)
    return found[0]


def _value(expr) -> Fraction:
    """This file's evaluator of an (op, left, right) tree, in exact fractions."""
    if isinstance(expr, int):
        return Fraction(expr)
    op, left, right = expr
    a, b = _value(left), _value(right)
    if op == "mod":
        assert a.denominator == b.denominator == 1 and b > 0
        return Fraction(int(a) % int(b))
    return {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[op]


def _leaves(expr) -> list[int]:
    return [expr] if isinstance(expr, int) else _leaves(expr[1]) + _leaves(expr[2])


@pytest.fixture(scope="module")
def generated():
    """Every seed's records and problems (the same draws: records are made from problems)."""
    return [(tasks.records("word-problems", PER_SEED, seed),
             word_problems.problems(np.random.default_rng(seed), PER_SEED)) for seed in SEEDS]


def test_every_answer_equals_the_text_solved_another_way(generated):
    kinds = Counter()
    for recs, _ in generated:
        for rec in recs:
            assert set(rec) == {"prompt", "answer"}
            kind, answer = _solve(_question(rec["prompt"]))
            kinds[kind] += 1
            # an integer (shares and rates divide exactly), never negative, small (a 0.5-1B model's range)
            assert answer.denominator == 1 and 0 <= answer < 1000, (rec, answer)
            assert rec["answer"] == str(int(answer)), rec
    assert set(kinds) == set(word_problems.TEMPLATES), kinds  # every template drawn
    assert len(SEEDS) * PER_SEED == sum(kinds.values()) >= 8000


def test_expression_trees_evaluate_to_the_answer_on_the_stated_numbers(generated):
    for recs, probs in generated:
        for rec, p in zip(recs, probs):
            assert rec["prompt"] == word_problems.prompt(p.text)
            assert _value(p.expr) == p.answer == int(rec["answer"])
            assert sorted(_leaves(p.expr)) == sorted(int(x) for x in re.findall(r"\d+", p.text)), p
            assert 1 <= str(p.expr).count("(") <= 2  # one or two operations
            assert _solve(p.text)[0] == p.kind


def test_same_records_for_the_same_seed_and_others_for_another():
    a = tasks.records("word-problems", 64, seed=7)
    assert a == tasks.records("word-problems", 64, seed=7)
    assert a != tasks.records("word-problems", 64, seed=8)


def test_prompts_fit_their_budget_in_bytes_and_byte_tokens(generated):
    longest = max(len(r["prompt"].encode()) for recs, _ in generated for r in recs)
    assert longest <= word_problems.MAX_PROMPT_BYTES
    data = load_prompts("word-problems", ByteTokens(), seq_len=word_problems.MAX_PROMPT_BYTES + 32, n=512)
    assert data.task == "word-problems" and data.prompt_len <= word_problems.MAX_PROMPT_BYTES


@pytest.mark.parametrize("completion, score", [
    (" 3 * 4 = 12\n#### 12", 1.0),                       # right, in the format
    ("####12", 1.0),                                      # no space needed
    (" 12 + 0 = 12\n#### 12 apples.\n\nQ: Ben has 5 cups.\nA: #### 5", 1.0),  # text after the answer
    ("#### 1,2", 1.0),                                    # thousands commas dropped (GSM8K writes 1,200)
    ("#### 12.0", 1.0),                                   # the same number
    ("#### 13", 0.0),                                     # wrong
    (" the answer is 12", 0.0),                           # right number, no format: binary, no partial credit
    ("#### 11\n#### 12", 0.0),                            # the first #### counts
    ("#### twelve\n#### 12", 0.0),                        # ... even where it holds no number
    ("##### 12", 0.0),                                    # not the format
    ("#### 12.5", 0.0),
    ("#### -12", 0.0),
    ("", 0.0),
])
def test_reward_on_hand_written_completions(completion, score):
    fn = rewards.resolve("word-problems")
    assert fn is tasks.TASKS["word-problems"].reward
    assert fn(["p"], [completion], answer=["12"]) == [score]


def test_reward_reads_each_row_against_its_own_answer():
    got = word_problems.reward(["a", "b", "c"], ["#### 7", "#### 7", "#### 0"], answer=["7", "8", "0"])
    assert got == [1.0, 0.0, 1.0]
