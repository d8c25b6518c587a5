"""`PPORollouts`: PPO's training batches (DeepSpeed-Chat's step 3), made on the live actor engine,
with the critic's step taken inside.

Per rollout (`RolloutBatches`' machinery: prompts and sampling keys by (seed, step), generation on
the actor's live weights, rewards, packing into fixed-shape rows), then: the actor's log-probs at
generation ("old_logps") and the reference's, the critic's values, the per-token rewards (KL
penalty + clipped score on the last token) and GAE (`zerojax.rl.gae`); the critic engine trains on
(values, returns) `iterations` steps, then the actor's batch (per-token "advantages") is handed
out for `engine.train_step` (loss: `zerojax.methods.ppo.make_actor_loss`).

    rollouts = PPORollouts(actor, data, "digit", PPOOptions(critic_lr=1e-5), seed=0, num_steps=100)
    for batch in rollouts:
        actor.train_step(batch)
        print(rollouts.metrics)        # reward/mean, policy/kl, critic/value_loss, time/critic_s, ...
    actor.save_checkpoint(d); rollouts.save(d)            # the critic: d/critic
    ...; actor.load_checkpoint(d); rollouts.load(d)

The critic is a second engine (`zerojax.shard`): the actor's DeepSpeed config with the optimizer's
lr set to critic_lr, the same mesh and engine options; its own weights, master copy, gradients
and optimizer state (as much memory again as the actor for a critic of the policy's size).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import ClassVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.rl import gae
from zerojax.rl.prompts import PromptData
from zerojax.rl.rollouts import RolloutBatches, RolloutOptions

GRPO_ONLY = ("scale_std", "drop_zero_variance", "max_refills", "loss_level", "adv_eps")
CRITIC_KEYS = ("input_ids", "prompt_lengths", "completion_mask", "token_weights", "old_values", "returns")


def check_ppo_options(*, kl_ctl, clip_reward_value, gamma, lam, cliprange, cliprange_value, critic_lr=None) -> None:
    """Each PPO setting a number in its range, else a ValueError naming it."""
    ranges = {"kl_ctl": (kl_ctl, 0, None, "the KL penalty's weight (DeepSpeed-Chat 0.1)"),
              "clip_reward_value": (clip_reward_value, 0, None, "the score's clip (DeepSpeed-Chat 5.0)"),
              "gamma": (gamma, 0, 1, "the discount (DeepSpeed-Chat 1.0)"),
              "lam": (lam, 0, 1, "GAE's lambda (DeepSpeed-Chat 0.95)"),
              "cliprange": (cliprange, 0, None, "the ratio's clip (DeepSpeed-Chat 0.2)"),
              "cliprange_value": (cliprange_value, 0, None, "the value's clip (DeepSpeed-Chat 0.2)")}
    if critic_lr is not None:
        ranges["critic_lr"] = (critic_lr, 0, None, "the critic's learning rate (None: the actor's)")
    for name, (v, low, high, what) in ranges.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < low or (high is not None and v > high):
            span = f"{low} to {high}" if high is not None else f">= {low}"
            raise ValueError(f"{name}={v!r}: {what}, a number {span}")


@dataclasses.dataclass(frozen=True)
class PPOOptions(RolloutOptions):
    """RolloutOptions (group: completions per prompt, 1 as DeepSpeed-Chat; max_new_tokens,
    temperature, top_p / top_k / stop / ignore_eos, reference, iterations: as GRPO's) and PPO's,
    DeepSpeed-Chat's defaults: kl_ctl (the KL penalty in the rewards), clip_reward_value (the
    score's clip), gamma, lam (GAE), cliprange (the actor's ratio), cliprange_value (the critic's
    values); critic_lr (None: the actor's lr), critic (a reward model folder to start the critic
    from, or None: the policy's weights and a fresh head)."""

    reward: object = None           # as GRPO's (zerojax.rl.rewards)
    reward_weights: object = None
    group: int = 1
    loss_level: str = "token"
    kl_coef: float | None = None  # set from kl_ctl
    kl_ctl: float = 0.1
    clip_reward_value: float = 5.0
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    critic_lr: float | None = None
    critic: str | None = None
    min_group: ClassVar[int] = 1

    def __post_init__(self):
        if self.kl_coef is not None and self.kl_coef != self.kl_ctl:
            raise ValueError(f"kl_coef={self.kl_coef}: PPO's KL weight is kl_ctl (a penalty in the rewards); give "
                             "kl_ctl instead")
        object.__setattr__(self, "kl_coef", self.kl_ctl)  # what picks the reference

    def check(self, rows: int, completion_len: int) -> None:
        super().check(rows, completion_len)
        defaults = {f.name: f.default for f in dataclasses.fields(PPOOptions)}
        for name in GRPO_ONLY:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}={getattr(self, name)!r} is GRPO's; PPO's advantages are GAE's, averaged "
                                 f"over the step's tokens, every rollout kept: leave {name} unset")
        if self.off_policy:
            raise ValueError("off_policy=1 is GRPO's: PPO's rollout trains the critic on the values and GAE returns "
                             "of the weights that generated it, and truncated importance sampling corrects the "
                             "policy's gradient only, not a critic fit to the previous policy; leave off_policy 0")
        check_ppo_options(kl_ctl=self.kl_ctl, clip_reward_value=self.clip_reward_value, gamma=self.gamma, lam=self.lam,
                      cliprange=self.cliprange, cliprange_value=self.cliprange_value, critic_lr=self.critic_lr)
        if self.critic is not None and not os.path.isdir(self.critic):
            raise ValueError(f"critic={self.critic!r}: not a folder; give a reward model folder (Hugging Face "
                             "...ForSequenceClassification or ...ForCausalLM) or None (the policy + a fresh head)")


class PPOPromptData(PromptData):
    """PromptData whose example batches have PPO's per-token "advantages" [B, C]."""

    @classmethod
    def of(cls, data: PromptData) -> PPOPromptData:
        out = copy.copy(data)
        out.__class__ = cls
        return out

    def example_batch(self, rows: int) -> dict:
        batch = super().example_batch(rows)
        batch["advantages"] = np.zeros((rows, self.completion_len), np.float32)
        return batch


def critic_config(engine, critic_lr: float | None) -> dict:
    """The actor's DeepSpeed config (as JSON) with the optimizer's lr (and a warmup scheduler's
    warmup_max_lr) set to critic_lr; unchanged where critic_lr is None."""
    cfg = engine.cfg.to_dict()
    if critic_lr is None:
        return cfg
    if not cfg.get("optimizer"):
        raise ValueError("critic_lr: the DeepSpeed config has no \"optimizer\" section to set it in; add one")
    cfg["optimizer"] = {**cfg["optimizer"], "params": {**cfg["optimizer"].get("params", {}), "lr": critic_lr}}
    if "warmup_max_lr" in (cfg.get("scheduler") or {}).get("params", {}):
        cfg["scheduler"] = {**cfg["scheduler"], "params": {**cfg["scheduler"]["params"], "warmup_max_lr": critic_lr}}
    return cfg


def make_critic_engine(engine, options: PPOOptions, *, seed: int = 0):
    """The critic's engine beside the actor's (see the module docstring)."""
    import zerojax
    from zerojax.scoring.critic import make_critic, make_critic_loss

    model = make_critic(engine.model, critic=options.critic, seed=seed)
    return zerojax.shard(lambda: model, critic_config(engine, options.critic_lr),
                         loss_fn=make_critic_loss(cliprange_value=options.cliprange_value), mesh=engine.mesh,
                         options=engine.options)


class EngineValues:
    """`values(batch)` -> fp32 numpy [B, C]: `completion_values` on a critic engine's live weights."""

    def __init__(self, critic):
        from zerojax.generation.decoder import EngineSource
        from zerojax.scoring.critic import completion_values
        from zerojax.sharding import partition

        self.critic = critic
        self._rows = NamedSharding(critic.mesh, P(partition.data_axes(critic.mesh)))
        source = EngineSource(critic.step_settings)
        self._run = jax.jit(lambda weights, batch: completion_values(source.model(weights), batch))

    def __call__(self, batch) -> np.ndarray:
        self.critic.synchronize()
        placed = {k: jax.device_put(np.asarray(batch[k]), self._rows)
                  for k in ("input_ids", "prompt_lengths", "completion_mask")}
        return np.asarray(self._run((self.critic.state.params, self.critic.state.rest), placed), np.float32)


class PPORollouts(RolloutBatches):
    """RolloutBatches for PPO: the actor's batches, the critic trained on the way. critic: an
    engine made by `make_critic_engine` (default: made here from the actor's current weights, or
    options.critic's folder)."""

    def __init__(self, engine, data: PromptData, reward, options: PPOOptions | Mapping | None = None, *,
                 seed: int = 0, start_step: int = 0, num_steps: int | None = None, tokenizer=None, critic=None):
        options = options if isinstance(options, PPOOptions) else PPOOptions.from_options(options or {})
        super().__init__(engine, data, reward, options, seed=seed, start_step=start_step, num_steps=num_steps,
                         tokenizer=tokenizer)
        self.critic = critic if critic is not None else make_critic_engine(engine, options, seed=seed)
        self.values = EngineValues(self.critic)

    # the critic's state goes with the actor's checkpoint

    def save(self, path, tag=None, *, keep: int | None = None) -> str:
        """The critic engine's checkpoint into `path`/critic (path: the actor's save_checkpoint folder;
        tag: the actor's, so a resume reads the pair; keep: as the actor's)."""
        return self.critic.save_checkpoint(os.path.join(os.fspath(path), "critic"), tag=tag, keep=keep)

    def load(self, path, tag=None):
        """The critic engine's state from `path`/critic (tag None: its latest)."""
        return self.critic.load_checkpoint(os.path.join(os.fspath(path), "critic"), tag=tag)

    # ------------------------------------------------------------------ one rollout

    def rollout(self, r: int, weights=None):  # weights: None here, PPO refuses off_policy
        batch, metrics = super().rollout(r, weights)
        critic_batch = {k: batch.pop(k) if k in ("old_values", "returns") else batch[k] for k in CRITIC_KEYS}
        began = time.perf_counter()
        for _ in range(self.options.iterations):
            trained = self.critic.train_step(critic_batch)
        metrics.update({"critic/value_loss": float(trained["loss"]),
                        "critic/clip_fraction": float(trained["critic/clip_fraction"]),
                        "time/critic_s": time.perf_counter() - began})
        metrics.update(batch.pop("metrics"))
        return batch, metrics

    def _pack(self, groups) -> dict:
        batch = super()._pack(groups)
        batch["scores"] = np.zeros(self.rows, np.float32)
        batch["scores"][:len(groups)] = [score for _, _, score, _ in groups]
        return batch

    def _with_logps(self, batch, weights=None) -> dict:
        o, mask = self.options, batch["completion_mask"]  # weights: None here, PPO refuses off_policy
        logps = self.policy.logps(batch)
        ref = self.policy.ref_logps(batch) if self.reference != "none" else logps
        values = self.values(batch)
        rewards = gae.token_rewards(logps, ref, batch.pop("scores"), mask, kl_ctl=o.kl_ctl,
                                    clip_reward_value=o.clip_reward_value)
        advantages, returns = gae.advantages_and_returns(values, rewards, mask, gamma=o.gamma, lam=o.lam)
        batch.update(old_logps=logps, ref_logps=ref, advantages=advantages, old_values=values, returns=returns)
        tokens = max(float(mask.sum()), 1.0)
        batch["metrics"] = {"policy/kl": float(((logps - ref) * mask).sum() / tokens),
                            "critic/values": float((values * mask).sum() / tokens),
                            "critic/returns": float((returns * mask).sum() / tokens),
                            "policy/advantages": float((advantages * mask).sum() / tokens)}
        return batch


__all__ = ["PPORollouts", "PPOOptions", "PPOPromptData", "EngineValues", "make_critic_engine", "critic_config"]
