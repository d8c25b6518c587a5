"""Reward models (`zerojax.methods.reward`): scores equal transformers' LlamaForSequenceClassification
on padded batches, both ways (a classifier folder transformers wrote, read by `reward_from_hf`;
ours written by `save_reward_hf` from a causal LM folder, loaded by transformers); the
Bradley-Terry loss equals torch's; the last-token rule is transformers'."""
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.methods import get as get_method
from zerojax.methods.reward import last_token_index, reward_from_hf, reward_loss, save_reward_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.test_lora import _hf_folder  # noqa: E402 (tests/ on sys.path)

PAD = 0
ATOL = 1e-5


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory):
    return _hf_folder(tmp_path_factory.mktemp("causal"), pad_token_id=PAD)


@pytest.fixture(scope="module")
def classifier_folder(causal_folder, tmp_path_factory):
    """transformers' own LlamaForSequenceClassification (num_labels 1) on the causal LM's base, its
    score head perturbed away from its initialisation."""
    torch.manual_seed(3)
    hf = transformers.LlamaForSequenceClassification.from_pretrained(causal_folder, num_labels=1).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("classifier")
    hf.save_pretrained(path)
    return path


def _padded(vocab=101, rows=4, seq=10, seed=0):
    """Right-padded rows of lengths 10, 7, 4, 1 (pad id 0 only as padding)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (rows, seq)).astype(np.int32)
    for r, n in enumerate((10, 7, 4, 1)[:rows]):
        ids[r, n:] = PAD
    return ids


def _hf_scores(folder, ids):
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == PAD
    with torch.no_grad():
        t = torch.from_numpy(ids.astype(np.int64))
        return hf(input_ids=t, attention_mask=(t != PAD).long()).logits[:, 0].numpy()


def test_reads_transformers_classifier(classifier_folder):
    model = reward_from_hf(classifier_folder)
    assert model.pad_token_id == PAD and not hasattr(model.model, "lm_head")
    ids = _padded()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _hf_scores(classifier_folder, ids), atol=ATOL)


def test_saved_classifier_loads_in_transformers_with_same_scores(causal_folder, tmp_path):
    model = reward_from_hf(causal_folder, seed=1)  # a causal LM: the head initialised as transformers does
    assert float(jnp.std(model.score[...])) == pytest.approx(0.02, rel=0.5)
    model.score[...] = model.score[...] * 40  # scores of order 1
    out = tmp_path / "rm"
    save_reward_hf(model, out)
    ids = _padded(seed=1)
    ours = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, _hf_scores(out, ids), atol=ATOL)
    np.testing.assert_allclose(np.asarray(reward_from_hf(out)(jnp.asarray(ids))), ours, atol=1e-6)  # round trip


def test_bradley_terry_loss_equals_torch(classifier_folder):
    model = reward_from_hf(classifier_folder)
    chosen, rejected = _padded(seed=2), _padded(seed=3)
    loss, metrics = reward_loss(model, {"chosen_ids": chosen, "rejected_ids": rejected})
    rc, rr = (torch.from_numpy(_hf_scores(classifier_folder, x)).double() for x in (chosen, rejected))
    assert float(loss) == pytest.approx(float(-torch.nn.functional.logsigmoid(rc - rr).mean()), abs=1e-5)
    assert float(metrics["accuracy"]) == pytest.approx(float((rc > rr).double().mean()))
    assert float(metrics["rewards/margins"]) == pytest.approx(float((rc - rr).mean()), abs=1e-5)


def test_last_token_rule_is_transformers():
    ids = jnp.asarray([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [0, 0, 0, 0, 0], [5, 0, 6, 0, 0]])
    # rightmost non-pad token (left or right padding); a row of pads reads position 0
    assert last_token_index(ids, 0).tolist() == [2, 4, 0, 2]
    with pytest.raises(ValueError, match="padding token"):
        last_token_index(ids, None)


def test_method_wraps_a_causal_lm(causal_folder):
    from zerojax.models import from_hf

    method = get_method("reward")
    options = method.resolve({"seed": 2}, data=type("Rows", (), {"pad_id": PAD, "named_pad_id": PAD})())
    assert options == {"pad_token_id": PAD, "seed": 2}
    model = method.prepare_model(from_hf(causal_folder), options)
    assert model.pad_token_id == PAD and method.loss(options) is reward_loss


def test_engine_trains_a_reward_model(causal_folder):
    """Through a real engine (ZeRO-2, 8 devices): the wrapped model (base + score head, LoRA on
    the base) trains, the loss falls and the margin grows."""
    import zerojax
    from zerojax import lora
    from zerojax.models import from_hf

    method = get_method("reward")
    options = method.resolve({}, data=type("Rows", (), {"pad_id": PAD, "named_pad_id": PAD})())
    base = lora.apply(from_hf(causal_folder), {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    model = method.prepare_model(base, options)
    cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "zero_optimization": {"stage": 2}}
    engine = zerojax.shard(lambda: model, cfg, loss_fn=method.loss(options))
    batch = {"chosen_ids": np.concatenate([_padded(seed=4), _padded(seed=5)]),
             "rejected_ids": np.concatenate([_padded(seed=6), _padded(seed=7)])}
    history = [engine.train_step(batch) for _ in range(5)]
    assert float(history[-1]["loss"]) < float(history[0]["loss"])
    assert float(history[-1]["rewards/margins"]) > float(history[0]["rewards/margins"])
