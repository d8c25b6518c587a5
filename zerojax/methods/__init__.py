"""Training methods by name, for the trainer (`--method NAME`): what loss, what data, what change
to the model each needs. One `Method` a method; `register` adds one, `get(name)` reads it.

The trainer's use (options: the method's settings as a dict, `Method.resolve` fills defaults and
refuses unknown keys):

    method = zerojax.methods.get("dpo")
    method.resolve(user_options)                                         # early: refuses unknown keys
    data = method.data(path, tokenizer, seq_len, batch_size)            # a reader (train_batches, ...)
    options = method.resolve(user_options, data)                         # + what the data decides (pad id)
    model = method.prepare_model(model, options) if method.prepare_model else model   # after LoRA
    if method.prepare_data: data = method.prepare_data(data, model, options, batch_size)
    engine = zerojax.shard(lambda: model, cfg, loss_fn=method.loss(options))
    batches = (method.rollouts(engine, data, options, seed=seed, start_step=start, num_steps=steps)
               if method.rollouts else data.train_batches(...))             # RL: made on the live engine

Built in: "dpo" (DPO / IPO, `zerojax.methods.dpo`) and "reward" (a reward model, Bradley-Terry,
`zerojax.methods.reward`), both on preference pairs (`zerojax.data.preference`); "grpo" (GRPO /
DAPO, `zerojax.methods.grpo`) on prompts, its batches made by `zerojax.rl.RolloutBatches`.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Method:
    """One training method.

    name: the trainer's `--method` value; what: a phrase for the run header.
    loss(options) -> loss_fn(model, batch) -> (loss, metrics) for `zerojax.shard`.
    data(path, tokenizer, seq_len, batch_size, **kw) -> the trainer's reader of this method's
        batches (`train_batches(batch_size, *, seed, start_step, num_steps)`, `val_batches`,
        `n_train`, `n_val`, `what`, `vocab_size`, `steps_per_epoch`).
    prepare_model(model, options) -> the model to train (after LoRA is applied), or None: as built.
    prepare_data(data, model, options, batch_size) -> the data to train on (e.g. with a frozen
        model's reference log-probs added), or None: as read.
    data_options(data) -> options the data decides (e.g. the pad id), merged over `options`.
    options: the settings and their defaults.
    defaults_for(lora) -> the settings whose default depends on whether the run trains LoRA adapters
        (True) or the whole model (False), under the user's options (DPO's reference: the base with
        the adapters off, else the starting model's log-probs computed once).
    check(options, rows, data) -> None: refuses (ValueError, one line) settings this run cannot take
        (rows: train_batch_size), before anything is built; or None.
    rollouts(engine, data, options, *, seed, start_step, num_steps) -> an iterator of the training
        batches, made each step on the live engine (RL methods: `zerojax.rl.RolloutBatches`, whose
        `.metrics` holds the last step's rollout metrics), or None: `data.train_batches` is the
        training data (`data.train_batches` then only gives the batches' shapes)."""

    name: str
    what: str
    loss: Callable[[Mapping], Callable]
    data: Callable[..., Any]
    prepare_model: Callable | None = None
    prepare_data: Callable | None = None
    data_options: Callable[[Any], dict] = lambda data: {}
    options: Mapping = dataclasses.field(default_factory=dict)
    rollouts: Callable | None = None
    check: Callable | None = None
    defaults_for: Callable[[bool], dict] = lambda lora: {}

    def resolve(self, options: Mapping | None = None, data=None) -> dict:
        """The settings: the defaults, what `data` decides (`data_options`) over them, `options` (the
        user's) over both; an unknown key is a ValueError naming the known ones."""
        options = dict(options or {})
        for key in options:
            if key not in self.options:
                near = difflib.get_close_matches(key, list(self.options), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"method {self.name!r}: unknown option {key!r}{hint} "
                                 f"(options: {sorted(self.options)})")
        return {**self.options, **(self.data_options(data) if data is not None else {}), **options}


class LazyDefaults(Mapping):
    """A method's settings read from its options dataclass on first use: `zerojax.rl` imports this
    package (the log-prob pieces), so the RL methods' dataclasses cannot be imported while it loads."""

    def __init__(self, read: Callable[[], dict]):
        self._read, self._values = read, None

    def _get(self) -> dict:
        if self._values is None:
            self._values = dict(self._read())
        return self._values

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())


_METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add `method` (the same name again replaces it)."""
    _METHODS[method.name] = method
    return method


def get(name: str) -> Method:
    if name not in _METHODS:
        raise KeyError(f"no training method {name!r}; registered: {', '.join(_METHODS)}")
    return _METHODS[name]


def methods() -> dict[str, Method]:
    return dict(_METHODS)


# --------------------------------------------------------------------------- built in


def _preference_data(path, tokenizer, seq_len, batch_size, **kw):
    from zerojax.data.preference import load_preference_data

    return load_preference_data(path, tokenizer, seq_len, batch_size, **kw)


def _dpo_loss(options):
    from zerojax.methods.dpo import make_dpo_loss

    return make_dpo_loss(**{k: options[k] for k in ("beta", "loss_type", "label_smoothing", "reference", "chunk")})


def _dpo_model(model, options):
    """Checks the settings and that the reference can be had, before anything compiles."""
    from zerojax.methods.dpo import check_options, check_reference

    check_options(options["beta"], options["loss_type"], options["label_smoothing"], options["reference"])
    check_reference(model, options["reference"])
    return model


def _dpo_data(data, model, options, batch_size):
    if options["reference"] != "precomputed" or "ref_chosen_logps" in data.arrays:
        return data
    from zerojax.methods.dpo import precompute_reference

    return precompute_reference(model, data, batch_size, chunk=options["chunk"])


def _reward_loss(options):
    from zerojax.methods.reward import reward_loss

    return reward_loss


def _reward_model(model, options):
    from zerojax.methods.reward import as_reward_model

    if options["pad_token_id"] is None:  # the score is read on the last token before padding
        from zerojax.data.text import DataError

        raise DataError("method 'reward': the tokenizer names no pad token, which marks where each sequence "
                        "ends; give one with --method-option pad_token_id=N (an id your data never uses)")

    return as_reward_model(model, pad_token_id=options["pad_token_id"], seed=options["seed"])


register(Method(
    name="dpo", what="DPO / IPO on preference pairs", loss=_dpo_loss, data=_preference_data,
    prepare_model=_dpo_model, prepare_data=_dpo_data,
    defaults_for=lambda lora: {"reference": "adapters_off" if lora else "precomputed"},
    options={"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0, "reference": "adapters_off", "chunk": None}))
register(Method(
    name="reward", what="a reward model on preference pairs (Bradley-Terry)", loss=_reward_loss,
    data=_preference_data, prepare_model=_reward_model, data_options=lambda data: {"pad_token_id": data.named_pad_id},
    options={"pad_token_id": None, "seed": 0}))


def _prompt_data(path, tokenizer, seq_len, batch_size, **kw):
    from zerojax.rl.prompts import load_prompts

    return load_prompts(path, tokenizer, seq_len, batch_size, **kw)


def _grpo_loss(options):
    from zerojax.methods.grpo import make_grpo_loss

    return make_grpo_loss(**{k: options[k] for k in ("eps_low", "eps_high", "kl_coef", "loss_level", "iterations",
                                                     "temperature", "off_policy", "tis_cap")},
                          group=options["group"] if options["shared_prompt"] else None)


def _reward(options):
    """The RL methods' reward: their `reward` specs summed with `reward_weights`."""
    from zerojax.rl.rewards import combined

    return combined(options["reward"], options["reward_weights"])


def _check_reward_given(name, options, data):
    """RL methods: a reward, given or decided by the data (a built-in task's), that resolves against
    the prompt records (an exact_match's field among theirs), before anything is built."""
    from zerojax.rl.rewards import check_specs

    if options["reward"] is None:
        raise ValueError(f"method {name!r}: no reward; give --method-option reward=SPEC (module:function, "
                         "exact_match[:FIELD], regex:PATTERN, or a reward model folder)")
    check_specs(options["reward"], getattr(data, "fields", None))


def _grpo_rollouts(engine, data, options, *, seed, start_step, num_steps):
    from zerojax.rl.rollouts import RolloutBatches

    return _announced(RolloutBatches(engine, data, _reward(options), options, seed=seed, start_step=start_step,
                                     num_steps=num_steps))


def _announced(rollouts):
    """The rollouts, their plan said in the run's header (rows generated at once, predicted peak)."""
    print(rollouts.plan.describe())
    return rollouts


def _grpo_check(options, rows, data):
    from zerojax.methods.grpo import check_options
    from zerojax.rl.rollouts import RolloutOptions

    _check_reward_given("grpo", options, data)
    RolloutOptions.from_options(options).check(rows, data.completion_len)
    # the loss's own settings too, before anything is built (make_grpo_loss checks them again)
    check_options(*(options[k] for k in ("eps_low", "eps_high", "kl_coef", "loss_level", "tis_cap")))


def _grpo_data_options(data):
    task = getattr(data, "task", None)  # a built-in task's prompts: its reward
    return {"reward": task} if task else {}


def _grpo_options() -> dict:
    from zerojax.rl.rollouts import GRPOOptions, defaults

    return defaults(GRPOOptions)


register(Method(
    name="grpo", what="GRPO on prompts, rollouts from the live engine", loss=_grpo_loss, data=_prompt_data,
    data_options=_grpo_data_options, rollouts=_grpo_rollouts, check=_grpo_check,
    options=LazyDefaults(_grpo_options)))  # every field of GRPOOptions, its default there


# PPO's settings: PPOOptions' fields but the rollouts' GRPO-only ones (the group's std, dynamic sampling, the
# loss level: PPO's advantages are GAE's, its loss per token), their defaults in PPOOptions
PPO_OPTIONS = ("reward", "reward_weights", "group", "max_new_tokens", "temperature", "top_p", "top_k", "stop",
               "ignore_eos", "reference", "iterations", "kl_ctl", "clip_reward_value", "gamma", "lam", "cliprange",
               "cliprange_value", "critic_lr", "critic", "decode_attention",
               "off_policy")  # known, so that PPOOptions.check says why PPO refuses it


def _ppo_options() -> dict:
    from zerojax.rl.ppo_rollouts import PPOOptions
    from zerojax.rl.rollouts import defaults

    return defaults(PPOOptions, PPO_OPTIONS)


def _ppo_loss(options):
    from zerojax.methods.ppo import make_actor_loss

    return make_actor_loss(cliprange=options["cliprange"], iterations=options["iterations"],
                           temperature=options["temperature"])


def _ppo_data(path, tokenizer, seq_len, batch_size, **kw):
    from zerojax.rl.ppo_rollouts import PPOPromptData

    return PPOPromptData.of(_prompt_data(path, tokenizer, seq_len, batch_size, **kw))


def _ppo_check(options, rows, data):
    from zerojax.rl.ppo_rollouts import PPOOptions

    _check_reward_given("ppo", options, data)
    PPOOptions.from_options(options).check(rows, data.completion_len)


def _ppo_rollouts(engine, data, options, *, seed, start_step, num_steps):
    from zerojax.rl.ppo_rollouts import PPORollouts

    return _announced(PPORollouts(engine, data, _reward(options), options, seed=seed, start_step=start_step,
                                  num_steps=num_steps))


register(Method(
    name="ppo", what="PPO with a critic (DeepSpeed-Chat step 3), rollouts from the live engine", loss=_ppo_loss,
    data=_ppo_data, data_options=_grpo_data_options, rollouts=_ppo_rollouts, check=_ppo_check,
    options=LazyDefaults(_ppo_options)))


__all__ = ["Method", "register", "get", "methods"]
