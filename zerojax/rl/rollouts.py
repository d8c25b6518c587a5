"""`RolloutBatches`: the training batches of an RL run, made on the live engine.

For each optimizer step: a batch of prompts (`PromptData.indices`), `group` completions each from
`zerojax.generate(engine, ...)` (the engine's compute-dtype weights as they are sharded: the
hybrid engine trains and generates on the same arrays), scored by the reward, group-relative
advantages, the old policy's and the reference's per-token log-probs (`EnginePolicy`), packed
into rows of fixed shapes (`PromptData.example_batch`): engine.train_step takes them directly.

    rollouts = RolloutBatches(engine, data, reward, RolloutOptions(group=8), seed=0, start_step=0, num_steps=100)
    for batch in rollouts:
        metrics = engine.train_step(batch)          # loss_fn = zerojax.methods.grpo.make_grpo_loss(...)
        print(rollouts.metrics)                     # reward/mean, time/generate_s, ...

Determinism: step s's prompts and sampling key are functions of (seed, s) only, so a run resumed
at step s (the engine restored from its checkpoint) generates what the uninterrupted run did.
With iterations = mu > 1 one rollout serves mu steps (rollout s // mu); a resume inside such a
span regenerates that rollout from the restored weights (a warning says so).

Time: `metrics["time/generate_s"]` (generation, rewards, log-probs) and `["time/train_s"]` (from
handing out the previous batch until this call, the engine's work waited for) per step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import warnings
from collections.abc import Mapping
from typing import ClassVar

import jax
import numpy as np

from zerojax.generation.decoder import check_decode_attention_choice
from zerojax.rl import advantages as adv_mod
from zerojax.rl.policy import EnginePolicy, pick_reference
from zerojax.rl.prompts import PromptData, decode
from zerojax.rl.rewards import combined, score
from zerojax.rl.rollout_plan import CHUNK_AUTO, check_chunk_option, chunks, plan_rollouts

LOSS_LEVELS = ("sequence", "token")
GENERATORS = ("generate", "serving")


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """group: completions per prompt (G); max_new_tokens: None = the data's completion region;
    temperature / top_p / top_k / stop / ignore_eos: generation's; scale_std: divide advantages by the group's
    std (GRPO; False: DAPO / Dr. GRPO); drop_zero_variance: DAPO's dynamic sampling (groups whose
    rewards are all equal are dropped and more prompts drawn, up to max_refills extra
    generations; rows still missing get mask 0); loss_level: "sequence" (each completion's
    tokens averaged, then the rows: GRPO) or "token" (every token of the step weighted alike:
    DAPO); kl_coef: the KL term's weight (0: no reference pass); reference: "auto",
    "adapters_off", "copy", "none" (`zerojax.rl.policy`); iterations: optimizer steps per
    rollout (mu; > 1 computes the old policy's log-probs); adv_eps: the std's eps;
    decode_attention: generation's (`zerojax.generation.decoder.DECODE_ATTENTIONS`); shared_prompt:
    the log-prob passes run each prompt once per group, not once per row
    (`zerojax.scoring.shared_prompt`: same numbers, fewer FLOPs; the loss takes it as
    `make_grpo_loss(group=)`); generator: what generates the completions, "generate"
    (`zerojax.generate`: one batch decoded to its longest row's end) or "serving" (`zerojax.serving`'s
    continuous batching over the same live weights, `zerojax.rl.serving_rollouts`: a finished row
    frees its place; greedy rollouts equal generate's, sampled ones draw each row's own stream);
    off_policy: 0 (on-policy) or 1: one-step off-policy, each step's rollout generated from the
    weights of the step before, while that step trains (`RolloutBatches`; GRPO corrects it with
    truncated importance sampling, `GRPOOptions.tis_cap`); rollout_chunk: rows generate decodes at once
    (generator "generate"), "auto" the most that fit the device beside the training states
    (`zerojax.rl.rollout_plan`, checked before the first rollout; greedy rows are the same at any
    chunk, sampled ones are drawn per chunk: an int pins them across devices)."""

    group: int = 8
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple = ()
    ignore_eos: bool = False
    scale_std: bool = True
    drop_zero_variance: bool = False
    max_refills: int = 4
    loss_level: str = "sequence"
    kl_coef: float = 0.04
    reference: str = "auto"
    iterations: int = 1
    adv_eps: float = 1e-4
    decode_attention: str = "auto"
    shared_prompt: bool = True
    generator: str = "generate"
    off_policy: int = 0
    rollout_chunk: int | str = "auto"
    min_group: ClassVar[int] = 2  # GRPO compares a prompt's completions

    @classmethod
    def from_options(cls, options: Mapping) -> RolloutOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in options.items() if k in names}
        if "stop" in picked:
            stop = picked["stop"]
            picked["stop"] = tuple([stop] if isinstance(stop, (str, int)) else stop or ())
        return cls(**picked)

    def check(self, rows: int, completion_len: int) -> None:
        if self.group < self.min_group:
            raise ValueError(f"group={self.group}: completions per prompt, >= {self.min_group}")
        if rows % self.group:
            raise ValueError(f"train_batch_size={rows} is not a multiple of group={self.group}: each step trains "
                             f"whole groups (train_batch_size = prompts per step x group)")
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= completion_len:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: 1 to {completion_len} (seq_len minus the "
                             "longest prompt); raise seq_len for longer completions")
        if self.loss_level not in LOSS_LEVELS:
            raise ValueError(f"loss_level={self.loss_level!r}; choose one of {LOSS_LEVELS}")
        if self.iterations < 1:
            raise ValueError(f"iterations={self.iterations}: optimizer steps per rollout, >= 1")
        check_decode_attention_choice(self.decode_attention)
        if not isinstance(self.shared_prompt, bool):
            raise ValueError(f"shared_prompt={self.shared_prompt!r}: true or false")
        if self.generator not in GENERATORS:
            raise ValueError(f"generator={self.generator!r}; choose one of {GENERATORS}")
        check_off_policy(self.off_policy, self.iterations)
        check_chunk_option(self.rollout_chunk)
        if self.generator == "serving" and self.rollout_chunk != CHUNK_AUTO:
            raise ValueError(f"rollout_chunk={self.rollout_chunk!r} is generate's: the serving engine holds a "
                             "rollout's rows in its page pool; leave rollout_chunk \"auto\" with generator \"serving\"")
        if self.generator == "serving" and self.decode_attention != "auto":
            raise ValueError(f"decode_attention={self.decode_attention!r} is generate's: the serving engine "
                             "attends over its pages; leave decode_attention \"auto\" with generator \"serving\"")


@dataclasses.dataclass(frozen=True)
class GRPOOptions(RolloutOptions):
    """Every setting of the "grpo" method and its default, the one home of them (the trainer's
    `--method-option`, `zerojax.methods.get("grpo").options` and `make_grpo_loss`'s keywords read
    these): the rollouts' (`RolloutOptions`), the reward (`reward`: specs, `zerojax.rl.rewards`;
    `reward_weights`: their weights) and the clipped ratio's bounds (eps_low, eps_high: DAPO's
    clip-higher where they differ), and tis_cap: off_policy's truncated importance weight's cap C
    (2.0, Yao et al. 2025's and verl's example value; verl ships it off)."""

    reward: object = None
    reward_weights: object = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float = 2.0


def check_off_policy(off_policy, iterations: int = 1) -> None:
    """off_policy 0 or 1 (True / False too: the command line's JSON gives either), else a ValueError
    in one line; 1 takes one optimizer step per rollout only."""
    if off_policy not in (0, 1):  # bool is an int: True == 1
        raise ValueError(f"off_policy={off_policy!r}: 0 (on-policy) or 1 (each step trains on rollouts generated "
                         "from the weights one step back, while that step trains)")
    if off_policy and iterations != 1:
        raise ValueError(f"off_policy=1 with iterations={iterations}: a rollout generated during one optimizer "
                         f"step would then serve {iterations} steps, up to {iterations} steps stale; give "
                         "iterations=1")


def defaults(options_class, names=None) -> dict:
    """{field: default} of an options dataclass (only `names` where given): a method's settings."""
    fields = {f.name: f for f in dataclasses.fields(options_class)}
    picked = fields if names is None else {n: fields[n] for n in names}
    return {n: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for n, f in picked.items()}


class RolloutBatches:
    """An iterator of training batches (dicts of numpy arrays, engine.cfg.train_batch_size rows)
    for steps start_step .. start_step + num_steps - 1 (None: without end). `metrics`: the last
    batch's rollout metrics; `history`: every step's."""

    def __init__(self, engine, data: PromptData, reward, options: RolloutOptions | Mapping | None = None, *,
                 seed: int = 0, start_step: int = 0, num_steps: int | None = None, tokenizer=None):
        self.options = o = (options if isinstance(options, RolloutOptions)
                            else RolloutOptions.from_options(options or {}))
        self.engine, self.data, self.seed = engine, data, int(seed)
        self.rows = int(engine.cfg.train_batch_size)
        o.check(self.rows, data.completion_len)
        check_loss_groups(engine, o.group)
        self.reward = combined(reward)
        self.tokenizer = tokenizer if tokenizer is not None else data.tokenizer
        self.max_new_tokens = o.max_new_tokens or data.completion_len
        self.reference = pick_reference(engine, o.reference, o.kl_coef)
        self.policy = EnginePolicy(engine, temperature=o.temperature or 1.0, reference=self.reference,
                                   group=o.group if o.shared_prompt else None)
        self.step, self.end = int(start_step), None if num_steps is None else int(start_step) + int(num_steps)
        self.plan = plan_rollouts(self)  # before the first rollout: refused here where it cannot fit
        self.metrics: dict = {}
        self.history: list[dict] = []
        self._cached = None  # (rollout index, batch, metrics)
        self._handed = None  # when the last batch was handed out
        self._served = None  # the serving engine's generator (generator "serving"), built at the first rollout
        self._ahead = None  # off_policy: (r, Future) of the next step's rollout, generating while this step trains
        self._thread = None  # off_policy: the one thread that generates ahead (its pool, made at the first use)
        if o.off_policy and self.step:
            warnings.warn(f"resuming at step {self.step} with off_policy=1: its rollout is generated from the "
                          "restored weights (the uninterrupted run generated it from the step before's, which no "
                          "checkpoint holds); the steps after it are one step off-policy again",
                          RuntimeWarning, stacklevel=2)
        if o.iterations > 1 and self.step % o.iterations:
            warnings.warn(f"resuming at step {self.step}, inside a rollout of iterations={o.iterations}: it is "
                          "generated again from the restored weights (the uninterrupted run generated it "
                          f"{self.step % o.iterations} steps earlier); save at multiples of iterations for an "
                          "exact resume", RuntimeWarning, stacklevel=2)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.end is not None and self.step >= self.end:
            raise StopIteration
        train_s = 0.0
        if self._handed is not None:
            jax.block_until_ready(self.engine.state.params)  # the previous step's training
            train_s = time.perf_counter() - self._handed
        r = self.step // self.options.iterations
        if self.options.off_policy:
            self._cached = (r, *self._off_policy_rollout(r))
            metrics = self._cached[2]
        elif self._cached is None or self._cached[0] != r:
            self._cached = (r, *self._timed_rollout(r))
            metrics = self._cached[2]
        else:
            metrics = {**self._cached[2], "time/generate_s": 0.0}
        self.metrics = {**metrics, "time/train_s": train_s, "step": self.step}
        self.history.append(self.metrics)
        self.step += 1
        self._handed = time.perf_counter()
        return self._cached[1]

    def _timed_rollout(self, r: int, weights=None):
        """(batch, metrics) of rollout r, its time as metrics["time/generate_s"]."""
        began = time.perf_counter()
        batch, metrics = self.rollout(r, weights)
        metrics["time/generate_s"] = time.perf_counter() - began
        return batch, metrics

    def _off_policy_rollout(self, r: int):
        """(batch, metrics) of rollout r, one step off-policy: generated from the weights of step
        r - 1 while that step trained (the first step of a run or a resume, with nothing generated
        ahead: from the weights now). Then rollout r + 1 starts on a thread from a copy of the
        weights now (the step about to train donates the live arrays), overlapping that step.
        time/generate_s: what the step waited for its rollout (the part not overlapped, as the
        run's generation / training split counts it); time/generate_ahead_s: the thread's time."""
        began = time.perf_counter()
        ahead, self._ahead = (self._ahead[1] if self._ahead is not None and self._ahead[0] == r else None), None
        more = self.end is None or r + 1 < self.end
        # this step's weights, before its update: copied only where a rollout is generated from them
        weights = self.policy.snapshot() if ahead is None or more else None
        if ahead is not None:
            batch, metrics = ahead.result()
            metrics = {**metrics, "time/generate_ahead_s": metrics["time/generate_s"],
                       "time/generate_s": time.perf_counter() - began, "rollout/staleness": 1}
        else:
            batch, metrics = self._timed_rollout(r, weights)
            metrics = {**metrics, "time/generate_ahead_s": 0.0, "rollout/staleness": 0}
        if more:
            # a pool's worker is joined at exit: a run stopped early lets the rollout finish, not exit under XLA
            self._thread = self._thread or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
            self._ahead = (r + 1, self._thread.submit(self._timed_rollout, r + 1, weights))
        return batch, metrics

    # ------------------------------------------------------------------ one rollout

    def _sample_seed(self, r: int, refill: int) -> int:
        return int(np.random.default_rng([self.seed, r, refill, 7]).integers(2 ** 31 - 1))

    def warm_up(self) -> int:
        """Compile the generator's programs ahead of the first rollout where it can: the serving
        engine's every shape bucket (generator "serving"; rows ending at different lengths reach
        new buckets in later rollouts otherwise) -> programs compiled (0: generate compiles per call)."""
        if self.options.generator != "serving":
            return 0
        return self._serving_generator().warm_up()

    def _serving_generator(self):
        if self._served is None:
            from zerojax.rl.serving_rollouts import ServingGenerator

            self._served = ServingGenerator(self.engine, self.options, rows=self.rows, prompt_len=self.data.prompt_len,
                                            max_new_tokens=self.max_new_tokens,
                                            tokenizer=_TextTokenizer(self.tokenizer))
        return self._served

    def generate(self, prompts: np.ndarray, seed: int, weights=None):
        """(completion token lists, completion texts) of each prompt index (already repeated per
        group), from `weights` (a `EnginePolicy.snapshot`) where given, else the live weights."""
        import zerojax

        o = self.options
        if o.generator == "serving":
            return self._serving_generator()([self.data.ids[i] for i in prompts], seed, weights)
        tokens, texts = [], []
        parts = chunks(prompts, self.plan.chunk)
        for j, part in enumerate(parts):
            # one chunk keeps the rollout's seed (the rows of an unchunked run); more draw each its own
            key = seed if len(parts) == 1 else int(np.random.default_rng([seed, j]).integers(2 ** 31 - 1))
            gen = zerojax.generate(self.engine, [self.data.ids[i] for i in part], max_new_tokens=self.max_new_tokens,
                                   temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, stop=list(o.stop),
                                   ignore_eos=o.ignore_eos, seed=key, tokenizer=_TextTokenizer(self.tokenizer),
                                   add_special_tokens=False, decode_attention=o.decode_attention, weights=weights)
            tokens += gen.tokens
            texts += gen.texts
        return tokens, texts

    def rollout(self, r: int, weights=None):
        """(training batch, metrics) of rollout r, generated from `weights` (a snapshot) where
        given, else the live weights."""
        o, G = self.options, self.options.group
        n = self.rows // G
        groups = []  # (prompt index, tokens, reward, advantage) per kept group's row
        seen_rewards, lengths, dropped = [], [], 0
        for k in range(1 + (o.max_refills if o.drop_zero_variance else 0)):
            prompts = np.repeat(self.data.indices(n, seed=self.seed, step=r, refill=k), G)
            tokens, texts = self.generate(prompts, self._sample_seed(r, k), weights)
            fields = {**self.data.fields_of(prompts), "completion_ids": tokens}
            rewards = score(self.reward, [self.data.texts[i] for i in prompts], texts, fields)
            advs = adv_mod.group_advantages(rewards, G, scale_std=o.scale_std, eps=o.adv_eps)
            seen_rewards.append(rewards)
            lengths += [len(t) for t in tokens]
            flat = adv_mod.zero_variance(rewards, G) if o.drop_zero_variance else np.zeros(n, bool)
            dropped += int(flat.sum())
            for g in np.flatnonzero(~flat)[:n - len(groups) // G]:
                groups += [(prompts[i], tokens[i], rewards[i], advs[i]) for i in range(g * G, (g + 1) * G)]
            if len(groups) >= self.rows:
                break
        batch = self._pack(groups)
        batch = self._with_logps(batch, weights)
        rewards = np.concatenate(seen_rewards)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                   "completion/length": float(np.mean(lengths)), "groups/dropped": dropped,
                   "groups/generations": k + 1, "rows/trained": len(groups)}
        return batch, metrics

    def _pack(self, groups) -> dict:
        """Rows of fixed shapes: prompt from position 0, completion after it, then padding; rows
        beyond `groups` (all groups dropped, refills spent) are padding with mask 0."""
        batch = self.data.example_batch(self.rows)
        ids, mask = batch["input_ids"], batch["completion_mask"]
        for row, (p, tokens, _, a) in enumerate(groups):
            prompt = self.data.ids[p]
            ids[row, :len(prompt)] = prompt
            ids[row, len(prompt):len(prompt) + len(tokens)] = tokens
            batch["prompt_lengths"][row] = len(prompt)
            mask[row, :len(tokens)] = 1.0
            batch["advantages"][row] = a
        total = mask.sum()
        # "token": each token weighted 1 / (the step's completion tokens), as rows x weight / rows
        batch["token_weights"][:] = self.rows / max(total, 1.0) if self.options.loss_level == "token" else 1.0
        return batch

    def _with_logps(self, batch, weights=None) -> dict:
        if self.options.iterations > 1:
            batch["old_logps"] = self.policy.logps(batch)
        if self.options.off_policy:  # the generating weights' log-probs: the loss's importance weights
            batch["rollout_logps"] = self.policy.logps(batch, weights)
        if self.reference != "none":
            batch["ref_logps"] = self.policy.ref_logps(batch, weights)
        return batch


def check_loss_groups(engine, group: int) -> None:
    """A loss that runs each prompt once per group of consecutive rows
    (`make_grpo_loss(group=)`, `zerojax.scoring.shared_prompt`) must find whole groups there: its
    group must divide the rollouts', and each device's micro-batch must hold whole groups where the
    engine interleaves devices' rows into a micro-batch (accumulation over several data-parallel
    devices; `zerojax.accumulate.split_microbatches`). Else a ValueError in one line."""
    from zerojax.sharding import partition

    shared = getattr(engine.loss_fn, "shared_prompt_group", None)
    if not shared or shared < 2:
        return
    if group % shared:
        raise ValueError(f"the loss runs each prompt once per {shared} rows (make_grpo_loss(group={shared})) but the "
                         f"rollouts give {group} completions per prompt: give the loss group={group}")
    cfg, n = engine.cfg, partition.data_size(engine.mesh)
    micro, steps = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    if steps > 1 and n > 1 and micro % shared and (n * micro) % shared == 0:
        raise ValueError(f"train_micro_batch_size_per_gpu={micro} is not a multiple of group={shared}: with "
                         f"gradient_accumulation_steps={steps} over {n} data-parallel devices a micro-batch would "
                         "join parts of different groups, which the loss's shared prompt pass cannot take; give a "
                         "micro-batch of whole groups, or shared_prompt=false (make_grpo_loss without group)")


class _TextTokenizer:
    """The run's tokenizer with `decode` (the trainer's byte-level ByteTokens has none)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, add_special_tokens=False):
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return decode(self._tok, ids)


__all__ = ["RolloutBatches", "RolloutOptions", "GRPOOptions", "check_off_policy", "LOSS_LEVELS", "GENERATORS"]
