"""PPO's arithmetic against PyTorch float64 transcriptions of DeepSpeed-Chat's step 3
(`ppo_trainer.py`: compute_rewards, get_advantages_and_returns, actor_loss_fn, critic_loss_fn),
rows of varied lengths (one empty), the clips exercised."""
import numpy as np
import pytest

from zerojax.methods.grpo import policy_loss
from zerojax.methods.ppo import value_loss
from zerojax.rl.gae import advantages_and_returns, token_rewards

torch = pytest.importorskip("torch")


def _inputs(B=5, C=6, seed=0):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-2.0, 0.5, (B, C)).astype(np.float32)
    ref = (logps + rng.normal(0, 0.3, (B, C))).astype(np.float32)
    values = rng.normal(0, 1, (B, C)).astype(np.float32)
    scores = np.array([7.5, -1.0, 0.3, -9.0, 2.0], np.float32)[:B]  # two beyond the clip of 5
    mask = np.zeros((B, C), np.float32)
    for r, n in enumerate([C, 3, 1, 0, 4][:B]):
        mask[r, :n] = 1
    return logps, ref, values, scores, mask


def _torch_rewards_and_gae(logps, ref, values, scores, mask, kl_ctl=0.1, clip=5.0, gamma=1.0, lam=0.95):
    """DeepSpeed-Chat's loops (start 0: the completion's first column), score on the last token,
    rewards and values past a row's end zeroed as train_rlhf zeroes them."""
    lp, rf, v, s, m = (torch.tensor(x, dtype=torch.float64) for x in (logps, ref, values, scores, mask))
    rewards = -kl_ctl * (lp - rf)
    ends = m.sum(1).long()
    clipped = torch.clamp(s, -clip, clip)
    old_values = v.clone()
    for j in range(lp.shape[0]):
        if ends[j] > 0:
            rewards[j, :ends[j]][-1] += clipped[j]
        rewards[j, ends[j]:] = 0
        old_values[j, ends[j]:] = 0
    lastgaelam, reversed_ = 0, []
    length = rewards.size()[-1]
    for t in reversed(range(length)):
        nextvalues = old_values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - old_values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + old_values
    return rewards.numpy(), advantages.numpy(), returns.numpy()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_rewards_and_gae_equal_torch(gamma, lam):
    logps, ref, values, scores, mask = _inputs()
    want_r, want_a, want_ret = _torch_rewards_and_gae(logps, ref, values, scores, mask, gamma=gamma, lam=lam)
    rewards = token_rewards(logps, ref, scores, mask, kl_ctl=0.1, clip_reward_value=5.0)
    np.testing.assert_allclose(rewards, want_r, rtol=1e-6, atol=1e-6)
    assert abs(rewards[0, -1] - (5.0 - 0.1 * (logps[0, -1] - ref[0, -1]))) < 1e-5  # the clip is exercised
    adv, ret = advantages_and_returns(values, rewards, mask, gamma=gamma, lam=lam)
    m = mask.astype(bool)  # past the end DeepSpeed-Chat's advantages are 0 too, ours are 0 by mask
    np.testing.assert_allclose(adv, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret[m], want_ret[m], rtol=1e-5, atol=1e-5)
    assert not ret[~m].any() and not adv[3].any()


def test_actor_and_critic_losses_equal_torch():
    rng = np.random.default_rng(1)
    logps, _, values, _, mask = _inputs(seed=1)
    old = (logps + rng.normal(0, 0.4, logps.shape)).astype(np.float32)  # ratios beyond 1 +- 0.2
    adv = rng.normal(0, 1, logps.shape).astype(np.float32)
    old_values = (values + rng.normal(0, 0.4, values.shape)).astype(np.float32)  # beyond +- 0.2
    returns = rng.normal(0, 1, values.shape).astype(np.float32)
    lp, o, a, m, v, ov, ret = (torch.tensor(x, dtype=torch.float64)
                               for x in (logps, old, adv, mask, values, old_values, returns))
    # actor_loss_fn
    ratio = torch.exp((lp - o) * m)
    pg = torch.max(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    want_actor = (torch.sum(pg * m) / m.sum()).item()
    # critic_loss_fn
    clipped = torch.max(torch.min(v, ov + 0.2), ov - 0.2)
    losses = torch.max((v - ret) ** 2, (clipped - ret) ** 2)
    want_critic = (0.5 * torch.sum(losses * m) / m.sum()).item()
    want_vclip = (((clipped - ret) ** 2 > (v - ret) ** 2).double() * m).sum().item() / m.sum().item()

    B = logps.shape[0]
    weights = np.full((B,), B / mask.sum(), np.float32)  # the rollouts' token weights: rows / tokens
    for tw in (None, weights):
        loss, _ = policy_loss(logps, old, None, adv, mask, eps_low=0.2, eps_high=0.2, kl_coef=0.0,
                              loss_level="token", token_weights=tw)
        np.testing.assert_allclose(float(loss), want_actor, rtol=1e-5, atol=1e-6)
        loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=0.2, token_weights=tw)
        np.testing.assert_allclose(float(loss), want_critic, rtol=1e-5, atol=1e-6)
    assert 0 < want_vclip < 1
    np.testing.assert_allclose(float(metrics["critic/clip_fraction"]), want_vclip, rtol=1e-6)


def test_critic_from_a_reward_folder_values_every_position(tmp_path):
    """The critic read from a transformers LlamaForSequenceClassification folder: its values are
    the classifier's score head on transformers' hidden state at each completion-predicting
    position."""
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp
    from models.test_lora import _hf_folder  # tests/ on sys.path

    from zerojax.methods.ppo import completion_values, make_critic

    torch.manual_seed(3)
    hf = transformers.LlamaForSequenceClassification.from_pretrained(_hf_folder(tmp_path / "lm", pad_token_id=0),
                                                                    num_labels=1).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "rm")
    critic = make_critic(None, critic=str(tmp_path / "rm"))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 100, (3, 9)).astype(np.int32)
    batch = {"input_ids": ids, "prompt_lengths": np.array([2, 4, 3], np.int32),
             "completion_mask": np.ones((3, 5), np.float32)}
    got = np.asarray(completion_values(critic, {k: jnp.asarray(v) for k, v in batch.items()}))
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.from_numpy(ids.astype(np.int64))).last_hidden_state
        per_position = (hidden @ hf.score.weight.T)[..., 0].numpy()
    want = np.stack([per_position[r, n - 1:n + 4] for r, n in enumerate(batch["prompt_lengths"])])
    np.testing.assert_allclose(got, want, atol=1e-5)
