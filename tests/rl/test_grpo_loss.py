"""The GRPO loss (`zerojax.methods.grpo.policy_loss`) equals a PyTorch computation of TRL's
formulas on the same log-probs, advantages and masks (clipping active on both sides, the k3 KL
term, per-sequence and per-token averaging); group advantages equal a numpy reference; reward
specs resolve, or fail naming the spec."""
import numpy as np
import pytest

from zerojax.methods.grpo import policy_loss
from zerojax.rl import rewards, tasks
from zerojax.rl.advantages import group_advantages, zero_variance

torch = pytest.importorskip("torch")


def _inputs(B=6, C=7, seed=0):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-2.0, 0.5, (B, C)).astype(np.float32)
    old = (logps + rng.normal(0, 0.4, (B, C))).astype(np.float32)  # ratios well outside [0.8, 1.28]
    ref = (logps + rng.normal(0, 0.3, (B, C))).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    mask = np.zeros((B, C), np.float32)
    for r, n in enumerate(rng.integers(1, C + 1, B)):
        mask[r, :n] = 1
    return logps, old, ref, adv, mask


def _torch_loss(logps, old, ref, adv, mask, eps_low, eps_high, beta, level):
    """TRL GRPOTrainer._compute_loss, written out in torch (float64)."""
    lp, old, ref, A, m = (torch.tensor(x, dtype=torch.float64) for x in (logps, old, ref, adv, mask))
    coef_1 = torch.exp(lp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * A[:, None], coef_2 * A[:, None])
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    if beta:
        per_token = per_token + beta * kl
    if level == "sequence":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    else:
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    low = ((coef_1 < 1 - eps_low) & (A[:, None] < 0)).double()
    high = ((coef_1 > 1 + eps_high) & (A[:, None] > 0)).double()
    clip = ((low + high).clamp(max=1) * m).sum() / m.sum()
    return loss.item(), ((kl * m).sum() / m.sum()).item(), clip.item()


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("beta,eps_high", [(0.04, 0.2), (0.0, 0.28)], ids=["grpo", "dapo_clip_higher"])
def test_loss_equals_torch(level, beta, eps_high):
    x = _inputs()
    want, want_kl, want_clip = _torch_loss(*x, 0.2, eps_high, beta, level)
    B = x[0].shape[0]
    weights = np.full((B,), B / x[4].sum(), np.float32)  # the rollouts' token weights: rows / tokens
    for tw in ([None, weights] if level == "token" else [None]):
        loss, metrics = policy_loss(*x, eps_low=0.2, eps_high=eps_high, kl_coef=beta, loss_level=level,
                                    token_weights=tw)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    assert 0 < want_clip < 1  # the clip is exercised
    np.testing.assert_allclose(float(metrics["policy/clip_fraction"]), want_clip, rtol=1e-6)
    if beta:
        np.testing.assert_allclose(float(metrics["policy/kl"]), want_kl, rtol=1e-5)


def test_loss_gradient_equals_torch():
    import jax

    logps, old, ref, adv, mask = _inputs(seed=1)
    g = jax.grad(lambda lp: policy_loss(lp, old, ref, adv, mask, kl_coef=0.04)[0])(logps)
    lp = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    t = [torch.tensor(v, dtype=torch.float64) for v in (old, ref, adv, mask)]
    c1 = torch.exp(lp - t[0])
    per = -torch.min(c1 * t[2][:, None], torch.clamp(c1, 0.8, 1.2) * t[2][:, None])
    per = per + 0.04 * (torch.exp(t[1] - lp) - (t[1] - lp) - 1)
    ((per * t[3]).sum(-1) / t[3].sum(-1)).mean().backward()
    np.testing.assert_allclose(np.asarray(g), lp.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_advantages_equal_numpy():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 3, 24).astype(np.float32)
    r[8:12] = 1.0  # a group of equal rewards
    G = 4
    want = np.empty(24)
    for g in range(6):
        x = r[g * G:(g + 1) * G].astype(np.float64)
        want[g * G:(g + 1) * G] = (x - x.mean()) / (np.sqrt(((x - x.mean()) ** 2).sum() / (G - 1)) + 1e-4)
    np.testing.assert_allclose(group_advantages(r, G), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(group_advantages(r, G, scale_std=False), r - np.repeat(r.reshape(6, 4).mean(1), 4),
                               atol=1e-6)
    assert zero_variance(r, G).tolist() == [bool(np.all(r[g * 4:g * 4 + 4] == r[g * 4])) for g in range(6)]
    assert zero_variance(r, G)[2]


def exact_sum(prompts, completions, **fields):  # a reward given as module:function
    return [float(c == str(eval(p[:-1]))) for p, c in zip(prompts, completions)]


def test_reward_specs():
    recs = tasks.records("arithmetic", 4, seed=3)
    assert recs == tasks.records("arithmetic", 4, seed=3) and all(r["prompt"].endswith("=") for r in recs)
    prompts, answers = [r["prompt"] for r in recs], [r["answer"] for r in recs]
    comps = [answers[0], answers[1] + "\nmore", "x", " " + answers[3] + " "]
    assert rewards.resolve("arithmetic")(prompts, comps, answer=answers) == [1.0, 1.0, 0.0, 1.0]
    assert rewards.resolve("exact_match:answer")(prompts, comps, answer=answers) == [1.0, 1.0, 0.0, 1.0]
    assert rewards.resolve("regex:^x$")(prompts, comps) == [0.0, 0.0, 1.0, 0.0]
    fn = rewards.resolve("rl.test_grpo_loss:exact_sum")
    assert fn(prompts, [answers[0], "0", "", ""]) == [1.0, 0.0, 0.0, 0.0]
    both = rewards.combined(["arithmetic", "regex:^x$"], [2.0, 0.5])
    assert both(prompts, comps, answer=answers) == [2.0, 2.0, 0.5, 2.0]
    assert tasks.digit_reward([""] * 3, ["777", "7a", "1"]) == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="'no_such_module:fn'"):
        rewards.resolve("no_such_module:fn")
    with pytest.raises(ValueError, match="'nothing'"):
        rewards.resolve("nothing")
    with pytest.raises(ValueError, match="2 values for 3"):
        rewards.score(lambda p, c: [1.0, 2.0], ["a"] * 3, ["b"] * 3, {})
