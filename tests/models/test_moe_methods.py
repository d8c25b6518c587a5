"""DPO and GRPO through `zerojax train` on a tiny Qwen3-MoE folder written by transformers (byte
vocabulary, no tokenizer: the trainer reads bytes): both run, learn, add the router's
load-balancing loss at the config's router_aux_loss_coef and log it. References from transformers
on the very batch the trainer took: DPO's first loss is ln 2 (LoRA's B = 0: the policy is its
reference) plus router_aux_loss_coef x transformers' `aux_loss` of the pair batch (TRL's sum);
GRPO's reference log-probs of its first rollouts (the base, adapters off) are transformers'."""
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_trainer import fp32_config  # noqa: E402,F401 (configs/zero2_bf16.json computing in fp32)

from zerojax import trainer  # noqa: E402
from zerojax.trainer.flags import parse_args  # noqa: E402

pytestmark = pytest.mark.slow  # trains through the CLI's trainer
AUX_COEF = 0.05


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny qwen3_moe folder (vocab 256 for the byte tokenizer, 4 experts, top 2), its router
    scaled up so that routing decides the outputs; (path, the transformers model)."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=32,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64, router_aux_loss_coef=AUX_COEF,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    return str(path), hf


class Recording(trainer.Trainer):
    """The trainer, keeping its first batch and every step's metrics (as floats)."""

    def train_step(self, batch):
        if not hasattr(self, "first_batch"):
            self.first_batch = {k: np.asarray(v) for k, v in batch.items()}
        metrics = super().train_step(batch)
        self.__dict__.setdefault("seen", []).append({k: float(v) for k, v in metrics.items()})
        return metrics


def run(folder, *argv):
    rec = Recording(parse_args(["--hf-checkpoint", folder, "--micro-batch", "1", "--eval-batches", "0", *argv]))
    return rec, rec.run()


def hf_logps(hf, ids, targets):
    """transformers' log p(targets[:, t] | ids[:, :t + 1]) [B, T - 1] (float64)."""
    with torch.no_grad():
        logits = hf(torch.as_tensor(ids, dtype=torch.long)).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1)
    return torch.gather(logp, 2, torch.as_tensor(targets, dtype=torch.long)[..., None].clamp(min=0))[..., 0].numpy()


def test_dpo_on_a_mixture_of_experts_starts_at_ln2_plus_the_router_loss_and_learns(folder, fp32_config, tmp_path):
    path, hf = folder
    prefs = tmp_path / "prefs.jsonl"
    rng = np.random.default_rng(0)
    prefs.write_text("".join(json.dumps({"prompt": f"is {a}+{b} even? ", "chosen": "yes", "rejected": "no"}) + "\n"
                             for a, b in rng.integers(1, 10, (64, 2))))
    rec, summary = run(path, "--method", "dpo", "--data", str(prefs), "--lora", "8", "--lr", "2e-2", "--steps", "4",
                       "--seq-len", "16", "--config", fp32_config, "--method-option", "beta=0.5")
    first = rec.seen[0]
    assert "router/aux_loss" in summary["method_metrics"] and "router/aux_loss" in first
    # transformers on the trainer's first pair batch (chosen rows then rejected, TRL's concatenated
    # forward): the aux loss over each row's tokens up to its last target, the policy's log-probs
    b = rec.first_batch
    ids = np.concatenate([b["chosen_ids"], b["rejected_ids"]])
    labels = np.concatenate([b["chosen_labels"], b["rejected_labels"]])
    last = np.max(np.where(labels != -100, np.arange(labels.shape[1])[None], -1), axis=1)
    mask = (np.arange(labels.shape[1])[None] <= last[:, None]).astype(np.int64)
    with torch.no_grad():
        out = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                 output_router_logits=True)
    aux = float(out.aux_loss)
    np.testing.assert_allclose(first["router/aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(summary["losses"][0], math.log(2) + AUX_COEF * aux, rtol=1e-6)
    sums = np.where(labels[:, 1:] != -100, hf_logps(hf, ids, labels[:, 1:]), 0.0).sum(1)
    np.testing.assert_allclose(first["logps/chosen"], sums[:len(sums) // 2].mean(), rtol=1e-5)
    # learns: the chosen answer's reward pulls ahead of the rejected one's
    assert rec.seen[-1]["rewards/margins"] > 0.05 and summary["losses"][-1] < summary["losses"][0], rec.seen


def test_grpo_on_a_mixture_of_experts_logs_the_router_loss_and_its_reference_is_transformers(
        folder, fp32_config, tmp_path):
    path, hf = folder
    rec, summary = run(path, "--method", "grpo", "--data", "digit", "--lora", "8", "--micro-batch", "4",
                       "--seq-len", "11", "--lr", "3e-2", "--steps", "6", "--config", fp32_config)
    assert summary["method"] == "grpo" and "router/aux_loss" in summary["method_metrics"]
    assert all(s["router/aux_loss"] > 0 for s in rec.seen)
    # the first rollouts' reference log-probs (the base, adapters off) against transformers' on
    # the same tokens: each completion token given its row's prompt and the completion before it
    b = rec.first_batch
    ids, plen, cmask = b["input_ids"], b["prompt_lengths"], b["completion_mask"]
    C = cmask.shape[1]
    at = np.clip(plen[:, None] - 1 + np.arange(C)[None], 0, ids.shape[1] - 2)
    every = hf_logps(hf, ids, ids[:, 1:])
    want = np.take_along_axis(every, at, axis=1)
    np.testing.assert_allclose(np.where(cmask != 0, b["ref_logps"], 0), np.where(cmask != 0, want, 0),
                               rtol=1e-4, atol=1e-5)
    rewards = [s["reward/mean"] for s in rec.seen]
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]), rewards  # learns the digit task
