"""Rewards for RL fine-tuning: each a function `fn(prompts, completions, **fields) -> list[float]`
(TRL's reward-function form: `fields` are the prompt records' other keys, one list entry per row,
and "completion_ids", each completion's token ids: a function takes **kwargs for those it does
not read).

`resolve(spec)` turns a spec into one:

- a callable: itself;
- "exact_match" / "exact_match:FIELD": 1.0 where the completion's first line, stripped, equals
  the record's FIELD (default "answer"), else 0.0;
- "regex:PATTERN": 1.0 where `re.search(PATTERN, completion)` finds it, else 0.0;
- a built-in task's name ("arithmetic", "digit", "word-problems"; `zerojax.rl.tasks`);
- a folder: a reward model (`zerojax.methods.reward.reward_from_hf`, its tokenizer from the same
  folder) scored on prompt + completion;
- "module:function": imported (`importlib`; the working folder first); the function is called as above.

`combined(specs, weights=None)`: several, summed with weights (TRL's `reward_weights`).
"""
from __future__ import annotations

import difflib
import os
from collections.abc import Sequence

import numpy as np

from zerojax.rl import tasks
from zerojax.rl.text_rewards import RewardFn, exact_match, regex_match
from zerojax.user_code import import_object


def reward_model(path, *, max_length: int = 1024, batch_size: int = 16, dtype=None) -> RewardFn:
    """A reward model folder (`reward_from_hf`) as a reward: the score of prompt + completion
    (tokenized with the folder's tokenizer, right-padded with its pad id, cut to max_length),
    `batch_size` rows a time in one jitted program per padded length (a multiple of 64)."""
    import jax
    from flax import nnx

    from zerojax.models import load_tokenizer
    from zerojax.scoring.reward_model import reward_from_hf

    tok = load_tokenizer(path)
    model = reward_from_hf(path, dtype=dtype)
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))

    def reward(prompts, completions, **fields):
        rows = [list(tok.encode(p + c))[:max_length] for p, c in zip(prompts, completions)]
        out = []
        for lo in range(0, len(rows), batch_size):
            part = rows[lo:lo + batch_size]
            width = -(-max(len(r) for r in part) // 64) * 64
            ids = np.full((batch_size, width), pad, np.int32)
            for i, r in enumerate(part):
                ids[i, :len(r)] = r
            out.extend(np.asarray(run(state, ids), np.float32)[:len(part)].tolist())
        return out

    reward.__name__ = f"reward_model:{os.fspath(path)}"
    return reward


def _import(spec: str) -> RewardFn:
    """module:function, the module looked for in the working folder first (`zerojax.user_code`)."""
    fn = import_object(spec, f"reward {spec!r}", "give module:function (in the working folder or on PYTHONPATH), "
                       f"exact_match[:FIELD], regex:PATTERN, a built-in task ({', '.join(tasks.TASKS)}) or a "
                       "reward model folder")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {spec.replace(':', '.')} is not callable")
    return fn


def resolve(spec) -> RewardFn:
    """A reward spec (see the module docstring) -> `fn(prompts, completions, **fields) -> list[float]`."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward {spec!r}: a callable or a string (module:function, exact_match[:FIELD], "
                         f"regex:PATTERN, {', '.join(tasks.TASKS)}, or a reward model folder)")
    if spec in tasks.TASKS:
        return tasks.TASKS[spec].reward
    if spec == "exact_match" or spec.startswith("exact_match:"):
        return exact_match(spec.partition(":")[2] or "answer")
    if spec.startswith("regex:"):
        return regex_match(spec[len("regex:"):])
    if os.path.isdir(spec):
        return reward_model(spec)
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: not a folder, a built-in ({', '.join(tasks.TASKS)}, exact_match, "
                         "regex:PATTERN) nor module:function")
    return _import(spec)


def _specs(specs) -> list:
    return [specs] if isinstance(specs, str) or callable(specs) else list(specs or [])


def check_specs(specs, fields: Sequence[str] | None = None) -> None:
    """Reward specs checked before anything is built (ValueError, one line): each resolvable (a
    module:function imported, a pattern compiled; a reward model folder is only looked for: it is
    read when the rollouts start), an exact_match's FIELD among the prompt records' `fields`
    (None: not known)."""
    for spec in _specs(specs):
        if isinstance(spec, str) and (spec == "exact_match" or spec.startswith("exact_match:")):
            field = spec.partition(":")[2] or "answer"
            if fields is not None and field not in fields:
                near = difflib.get_close_matches(field, list(fields), n=1)
                hint = f"; did you mean exact_match:{near[0]}?" if near else ""
                raise ValueError(f"reward {spec!r}: the prompt records have no {field!r} field (they have "
                                 f"{', '.join(sorted(fields)) or 'only the prompt'}){hint}")
        elif not (isinstance(spec, str) and os.path.isdir(spec)):
            resolve(spec)


def combined(specs, weights: Sequence[float] | None = None) -> RewardFn:
    """One reward from several specs: the weighted sum (weights default 1.0 each)."""
    fns = [resolve(s) for s in _specs(specs)]
    if not fns:
        raise ValueError("reward: give at least one")
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ValueError(f"reward_weights: {len(weights)} weights for {len(fns)} rewards")
    if len(fns) == 1 and weights[0] == 1.0:
        return fns[0]

    def reward(prompts, completions, **fields):
        return list(sum(w * score(fn, prompts, completions, fields) for fn, w in zip(fns, weights)))

    return reward


def score(fn: RewardFn, prompts, completions, fields) -> np.ndarray:
    """fp32 [rows]: `fn` called on the rows and checked (one number per row, none missing)."""
    out = fn(list(prompts), list(completions), **fields)
    name = getattr(fn, "__name__", repr(fn))
    try:
        arr = np.asarray(out, np.float32).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"reward {name}: returned {type(out).__name__}; return a list of floats, one per "
                         "completion") from None
    if arr.shape[0] != len(completions):
        raise ValueError(f"reward {name}: {arr.shape[0]} values for {len(completions)} completions")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"reward {name}: returned a value that is not a finite number")
    return arr


__all__ = ["resolve", "check_specs", "combined", "score", "exact_match", "regex_match", "reward_model", "RewardFn"]
