"""One-step off-policy GRPO rollouts (`off_policy=1`) with truncated importance sampling, on a
tiny Llama over 8 virtual CPU devices, SGD.

References, each independent of the code under test: (a) the on-policy loss recomputed by hand in
float64 from the rollout's tokens (rewards re-scored, group advantages by hand) and the log-probs;
(b) the original on-policy code path (`RolloutBatches.rollout` on the live weights) of a second
engine held at the weights one step back, same seed; (c) min(exp(old - rollout), C) and the loss
formula in float64; (d) a run whose weights never move (lr 0) is on-policy: mismatch 0.
"""
import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import cli
from zerojax.data.rows import ByteTokens
from zerojax.methods import get as get_method
from zerojax.methods.grpo import make_grpo_loss, policy_loss
from zerojax.models import Llama, LlamaConfig
from zerojax.rl import RolloutBatches, load_prompts, tasks
from zerojax.rl.policy import EnginePolicy
from zerojax.rl.prompts import decode
from zerojax.rl.rollouts import GRPOOptions

G, ROWS, NEW, KL, CAP, SEED, STEPS = 4, 16, 4, 0.05, 1.02, 3, 3


def _engine(lr, off_policy=1):
    cfg = {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": lr}},
           "zero_optimization": {"stage": 2}}
    loss = make_grpo_loss(kl_coef=KL, group=G, off_policy=off_policy, tis_cap=CAP)
    return zerojax.shard(lambda: Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)), cfg, loss_fn=loss)


def _options(off_policy=1):
    return GRPOOptions(group=G, kl_coef=KL, reference="copy", max_new_tokens=NEW, off_policy=off_policy, tis_cap=CAP)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _run(data, lr, off_policy, steps=STEPS):
    """Each step's (batch, the trainer's log-probs before the update, weights before it, metrics)."""
    engine = _engine(lr, off_policy)
    rollouts = RolloutBatches(engine, data, "digit", _options(off_policy), seed=SEED, num_steps=steps)
    policy = EnginePolicy(engine, group=G)
    out = []
    for batch in rollouts:
        before, old = _host(engine.params), policy.logps(batch)
        metrics = {k: float(v) for k, v in engine.train_step(batch).items() if np.ndim(v) == 0}
        out.append({"batch": batch, "old": old, "weights": before, "metrics": {**rollouts.metrics, **metrics}})
    return out, engine


@pytest.fixture(scope="module")
def digits():
    return load_prompts("digit", ByteTokens(), seq_len=11)  # "nn:" + 8 new bytes


@pytest.fixture(scope="module")
def off_run(digits):
    return _run(digits, 0.5, off_policy=1)


def _loss64(batch, old, ref_logps, rollout=None, cap=CAP):
    """GRPO's sequence-level loss at iterations 1 (ratio 1 in value) in float64, TIS-weighted where
    `rollout` is given: mean over rows of sum_t m_t (-w_t A + KL k3_t) / max(sum_t m_t, 1)."""
    m, old, ref = (np.asarray(x, np.float64) for x in (batch["completion_mask"], old, ref_logps))
    adv = np.asarray(batch["advantages"], np.float64)[:, None]
    w = np.ones_like(old) if rollout is None else np.minimum(np.exp(old - np.asarray(rollout, np.float64)), cap)
    per_token = -w * adv + KL * (np.exp(ref - old) - (ref - old) - 1)
    return float(((per_token * m).sum(1) / np.maximum(m.sum(1), 1)).mean())


def _advantages64(data, batch):
    """The rows' group advantages from their completions re-scored by the task's reward, in float64."""
    texts = [decode(data.tokenizer, row[n:n + NEW]) for row, n in zip(batch["input_ids"], batch["prompt_lengths"])]
    r = np.asarray(tasks.digit_reward([""] * ROWS, texts), np.float64).reshape(-1, G)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def test_on_policy_losses_equal_a_float64_reference(digits):
    """(a) off_policy 0 (the default): each step's loss is the formula's, from the rollout's tokens
    and rewards by hand; no rollout log-probs are taken or logged."""
    steps, _ = _run(digits, 0.5, off_policy=0)
    assert GRPOOptions().off_policy == 0
    for s in steps:
        batch = s["batch"]
        np.testing.assert_allclose(batch["advantages"], _advantages64(digits, batch), rtol=1e-5, atol=1e-5)
        assert not batch["rollout_logps"].any() and "policy/rollout_mismatch" not in s["metrics"]
        np.testing.assert_allclose(s["metrics"]["loss"], _loss64(batch, s["old"], batch["ref_logps"]),
                                   rtol=1e-4, atol=1e-6)
    assert len({round(s["metrics"]["loss"], 6) for s in steps}) > 1  # the weights moved: not one loss repeated


def test_off_policy_rollouts_are_the_previous_steps_weights(digits, off_run):
    """(b) step t's rows are what on-policy generation from step t - 1's weights gives (step 0:
    the starting weights), same seed, and its rollout log-probs are those weights'. A second
    engine trained on the same batches, one step behind, generates them on the original path."""
    steps, engine = off_run
    behind = _engine(0.5)
    plain = RolloutBatches(behind, digits, "digit", _options(off_policy=0), seed=SEED)
    policy = EnginePolicy(behind, group=G)
    for t, s in enumerate(steps):
        if t >= 2:
            behind.train_step(steps[t - 2]["batch"])  # now at step t - 1's weights
        for a, b in zip(_host(behind.params), steps[max(t - 1, 0)]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
        want, _ = plain.rollout(t)
        for key in ("input_ids", "completion_mask", "advantages", "ref_logps"):
            np.testing.assert_array_equal(s["batch"][key], want[key], err_msg=f"step {t}: {key}")
        np.testing.assert_allclose(s["batch"]["rollout_logps"], policy.logps(want), atol=1e-6)
        assert s["metrics"]["rollout/staleness"] == min(t, 1)
    behind.train_step(steps[-2]["batch"])
    behind.train_step(steps[-1]["batch"])  # the same batches, the same SGD updates: the same weights
    for a, b in zip(_host(behind.params), _host(engine.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_tis_weights_and_loss_equal_float64(off_run):
    """(c) on the stale steps: the logged mismatch, truncation and weights are min(exp(old -
    rollout), C) by hand in float64, and the loss is the TIS-weighted formula's."""
    steps, _ = off_run
    for s in steps[1:]:
        batch, m = s["batch"], s["metrics"]
        mask = batch["completion_mask"].astype(bool)
        gap = np.asarray(s["old"], np.float64)[mask] - np.asarray(batch["rollout_logps"], np.float64)[mask]
        np.testing.assert_allclose(m["policy/rollout_mismatch"], np.abs(gap).mean(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(m["policy/tis_weight"], np.minimum(np.exp(gap), CAP).mean(), rtol=1e-5)
        np.testing.assert_allclose(m["policy/tis_clip_fraction"], (np.exp(gap) > CAP).mean(), atol=1e-6)
        np.testing.assert_allclose(m["loss"], _loss64(batch, s["old"], batch["ref_logps"], batch["rollout_logps"]),
                                   rtol=1e-4, atol=1e-6)
    clipped = [s["metrics"]["policy/tis_clip_fraction"] for s in steps[1:]]
    assert max(clipped) > 0 and min(clipped) < 1  # the cap is exercised, and not on every token


def test_tis_gradient_equals_float64():
    """(c) the TIS weight scales the policy-gradient term and is not trained through: d loss /
    d logp = (-w A + KL (1 - exp(ref - logp))) m / (rows x tokens of the row), old = logp."""
    rng = np.random.default_rng(0)
    B, C = 6, 5
    logps = rng.normal(-2, 0.5, (B, C)).astype(np.float32)
    rollout = (logps + rng.normal(0, 0.3, (B, C))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.3, (B, C))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    mask = (np.arange(C) < rng.integers(1, C + 1, B)[:, None]).astype(np.float32)

    def loss(lp):
        return policy_loss(lp, jax.lax.stop_gradient(lp), ref, adv, mask, kl_coef=KL, rollout_logps=rollout,
                           tis_cap=CAP)[0]

    lp, ro, rf, m = (np.asarray(x, np.float64) for x in (logps, rollout, ref, mask))
    w = np.minimum(np.exp(lp - ro), CAP)
    want = (-w * adv[:, None] + KL * (1 - np.exp(rf - lp))) * m / (B * m.sum(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(logps)), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(loss(logps)), _loss64({"completion_mask": mask, "advantages": adv}, logps,
                                                           ref, rollout), rtol=1e-5)


def test_mismatch_is_zero_on_policy(digits, off_run):
    """(d) where the generating weights are the trainer's (the first step; every step at lr 0) the
    logged mismatch is 0 and no weight is truncated."""
    steps, _ = off_run
    still, _ = _run(digits, 0.0, off_policy=1, steps=2)
    for m in [steps[0]["metrics"]] + [s["metrics"] for s in still]:
        assert m["policy/rollout_mismatch"] < 1e-6 and m["policy/tis_clip_fraction"] == 0
        np.testing.assert_allclose(m["policy/tis_weight"], 1.0, atol=1e-6)
    assert still[1]["metrics"]["rollout/staleness"] == 1


def test_options_are_checked_in_one_line(digits):
    with pytest.raises(ValueError, match=r"^off_policy=2: 0 \(on-policy\) or 1"):
        GRPOOptions(off_policy=2).check(ROWS, 8)
    with pytest.raises(ValueError, match="off_policy=1 with iterations=2: .* give iterations=1"):
        GRPOOptions(off_policy=1, iterations=2).check(ROWS, 8)
    with pytest.raises(ValueError, match=r"^tis_cap=0: the truncated importance weight's cap"):
        make_grpo_loss(off_policy=1, tis_cap=0)
    GRPOOptions(off_policy=True).check(ROWS, 8)  # the command line's JSON true
    ppo = get_method("ppo")
    options = ppo.resolve({"off_policy": 1}, ppo.data("digit", ByteTokens(), 11, ROWS))
    with pytest.raises(ValueError, match="off_policy=1 is GRPO's: PPO's rollout trains the critic"):
        ppo.check(options, ROWS, ppo.data("digit", ByteTokens(), 11, ROWS))


@pytest.mark.parametrize("option,message", [
    ("off_policy=2", "error: --method grpo: off_policy=2: 0 (on-policy) or 1"),
    ("tis_cap=-1", "error: --method grpo: tis_cap=-1: the truncated importance weight's cap C"),
])
def test_the_trainer_refuses_bad_values(capsys, option, message):
    argv = ["train", "--model", "tiny-llama", "--method", "grpo", "--data", "digit", "--seq-len", "11",
            "--micro-batch", "1", "--method-option", "group=8", "--method-option", option, "--steps", "1"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_the_trainer_logs_the_mismatch(capsys):
    argv = ["train", "--model", "tiny-llama", "--method", "grpo", "--data", "digit", "--seq-len", "11",
            "--micro-batch", "1", "--method-option", "group=8", "--method-option", "off_policy=1",
            "--method-option", "max_new_tokens=3", "--method-option", "kl_coef=0.0", "--steps", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "policy/rollout_mismatch" in out and "policy/tis_clip_fraction" in out and "rollout/staleness 1" in out
