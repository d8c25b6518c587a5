"""DPO / IPO (`zerojax.methods.dpo`) and per-sequence log-probs (`zerojax.scoring.logprobs`):
the log-probs equal transformers' LlamaForCausalLM on a tiny folder (plain and chunked); the DPO,
conservative-DPO and IPO losses equal PyTorch computations of the published formulas (TRL's
forms); through a real engine (ZeRO-2, 8 virtual CPU devices) a LoRA model with B = 0 starts at
ln 2 against its adapters-off reference, and a few SGD steps raise the reward margin and accuracy
on a toy preference set read by `zerojax.data.preference`."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import lora
from zerojax.data.preference import load_preference_data
from zerojax.methods import get as get_method
from zerojax.methods.dpo import dpo_loss, make_dpo_loss, precompute_reference
from zerojax.models import Llama, LlamaConfig, from_hf
from zerojax.scoring.logprobs import sequence_logps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

from models.test_lora import _hf_folder  # noqa: E402 (tests/ on sys.path)

RTOL, ATOL = 1e-5, 1e-4  # sums of ~10 fp32 log-probs of size ~5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _hf_folder(tmp_path_factory.mktemp("hf"))


def _pairs(vocab=101, rows=4, seq=12, seed=0):
    """A preference batch: prompts of 3-5 tokens, completions to the end or padded (pad id 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for side in ("chosen", "rejected"):
        ids = rng.integers(1, vocab, (rows, seq)).astype(np.int32)
        labels = ids.copy()
        for r in range(rows):
            prompt, end = rng.integers(3, 6), rng.integers(8, seq + 1)
            labels[r, :prompt] = -100
            labels[r, end:], ids[r, end:] = -100, 0
        out[f"{side}_ids"], out[f"{side}_labels"] = ids, labels
    return out


def _torch_logps(hf, ids, labels):
    """(summed completion log-probs, token counts) by transformers' logits and log_softmax."""
    with torch.no_grad():
        logits = hf(input_ids=torch.from_numpy(ids.astype(np.int64))).logits[:, :-1].double()
    target = torch.from_numpy(labels[:, 1:].astype(np.int64))
    mask = target != -100
    lp = torch.gather(F.log_softmax(logits, -1), 2, target.clamp(min=0)[..., None])[..., 0]
    return (lp * mask).sum(-1).numpy(), mask.sum(-1).numpy()


@pytest.mark.parametrize("chunk", [None, 5])
def test_sequence_logps_equal_transformers(folder, chunk):
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = from_hf(folder)
    batch = _pairs()
    ids, labels = batch["chosen_ids"], batch["chosen_labels"]
    logps, counts = sequence_logps(model, {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}, chunk=chunk)
    ref, n = _torch_logps(hf, ids, labels)
    assert logps.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logps), ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(counts), n)


def _torch_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    """The published formulas on torch tensors: DPO (Rafailov et al. eq. 7), conservative DPO
    (label smoothing, Mitchell), IPO (Azar et al. eq. 17, tau = beta)."""
    h = (pc - pr) - (rc - rr)
    if loss_type == "ipo":
        return ((h - 1 / (2 * beta)) ** 2).mean()
    return (-(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)).mean()


@pytest.mark.parametrize("loss_type,beta,ls", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                               ("ipo", 1.0, 0.0)])
def test_dpo_loss_equals_published_formula(loss_type, beta, ls):
    rng = np.random.default_rng(1)
    pc, pr, rc, rr = (rng.normal(-20, 5, 16).astype(np.float32) for _ in range(4))
    losses, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=ls)
    t = [torch.from_numpy(a).double() for a in (pc, pr, rc, rr)]
    ref = float(_torch_dpo(*t, beta, loss_type, ls))
    assert abs(float(losses.mean()) - ref) < 1e-5 * max(1.0, abs(ref))
    np.testing.assert_allclose(np.asarray(cr), beta * (pc - rc), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rj), beta * (pr - rr), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_fn_with_precomputed_reference_equals_torch(folder, loss_type):
    """make_dpo_loss end to end on a model: IPO on per-token averages (TRL), metrics TRL's."""
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = _pairs(seed=2)
    rng = np.random.default_rng(3)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = (rng.normal(-40, 3, 4).astype(np.float32)
                                                              for _ in range(2))
    loss, metrics = make_dpo_loss(beta=0.2, loss_type=loss_type, reference="precomputed")(from_hf(folder), batch)
    (pc, nc), (pr, nr) = (_torch_logps(hf, batch[f"{s}_ids"], batch[f"{s}_labels"]) for s in ("chosen", "rejected"))
    rc, rr = batch["ref_chosen_logps"].astype(np.float64), batch["ref_rejected_logps"].astype(np.float64)
    if loss_type == "ipo":
        pc, rc, pr, rr = pc / nc, rc / nc, pr / nr, rr / nr
    t = [torch.from_numpy(a) for a in (pc, pr, rc, rr)]
    assert abs(float(loss) - float(_torch_dpo(*t, 0.2, loss_type, 0.0))) < 1e-4
    margins = 0.2 * ((pc - rc) - (pr - rr))
    assert abs(float(metrics["rewards/margins"]) - margins.mean()) < 1e-4
    assert float(metrics["rewards/accuracies"]) == pytest.approx((margins > 0).mean())
    assert abs(float(metrics["logps/chosen"]) - pc.mean()) < 1e-4


# --------------------------------------------------------------------------- through the engine

WORDS = ["<pad>", "</s>", "q", "a", "good", "bad", "yes", "no", "why", "how", "fine", "wrong"]
PAIRS = [("q why", "good fine", "bad wrong"), ("q how", "good", "bad"), ("q a", "yes fine", "no wrong"),
         ("a why", "fine good", "wrong bad"), ("a how", "yes", "no"), ("why how", "good yes", "bad no"),
         ("q q", "fine", "wrong"), ("a a", "good good", "bad bad")]
ROWS = 8  # pairs per step: one a device


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(PreferenceRows of the toy pairs, the tokenizer folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("toy")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    data = path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    return load_preference_data(data, path, seq_len=8, batch_size=ROWS), path


def _lora_model():
    model = Llama(LlamaConfig.named("tiny", vocab_size=len(WORDS)), rngs=nnx.Rngs(0))
    return lora.apply(model, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})


def test_engine_dpo_starts_at_ln2_and_raises_the_margin(toy):
    rows, _ = toy
    assert rows.n_train == ROWS and rows.n_val == 0 and "preference" in rows.what
    method = get_method("dpo")
    options = method.resolve({"beta": 0.5}, rows)
    model = method.prepare_model(_lora_model(), options)
    cfg = {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
           "zero_optimization": {"stage": 2}}
    engine = zerojax.shard(lambda: model, cfg, loss_fn=method.loss(options))
    batch = next(rows.train_batches(ROWS, seed=0, start_step=0, num_steps=1))
    history = [engine.train_step(batch) for _ in range(6)]
    first, last = history[0], history[-1]
    assert float(first["loss"]) == pytest.approx(math.log(2), abs=1e-6)  # reference = policy (B = 0)
    assert float(first["rewards/margins"]) == pytest.approx(0.0, abs=1e-6)
    assert float(last["rewards/margins"]) > float(first["rewards/margins"]) + 0.05
    assert float(last["rewards/accuracies"]) > float(first["rewards/accuracies"])
    assert float(last["loss"]) < float(first["loss"])


def test_precompute_reference_equals_adapters_off(toy):
    """The precomputed reference of the starting LoRA model (B = 0) is its adapters-off reference:
    both give the same loss and metrics."""
    rows, _ = toy
    model = _lora_model()
    with_ref = precompute_reference(model, rows, batch_size=3)  # 8 pairs: a padded last batch
    assert with_ref.arrays["ref_chosen_logps"].shape == (ROWS,) and "precomputed" in with_ref.what
    batch = next(with_ref.train_batches(ROWS, seed=1, start_step=0, num_steps=1))
    a = make_dpo_loss(reference="precomputed")(model, batch)
    b = make_dpo_loss(reference="adapters_off")(model, batch)
    assert float(a[0]) == pytest.approx(float(b[0]), abs=1e-6) == pytest.approx(math.log(2), abs=1e-6)
    for k in a[1]:  # (accuracies: chosen > rejected on rewards of ~0 +- an ulp, a tie either way)
        if k != "rewards/accuracies":
            assert float(a[1][k]) == pytest.approx(float(b[1][k]), abs=1e-5), k


def test_settings_refused_with_the_fix():
    method = get_method("dpo")
    with pytest.raises(ValueError, match="did you mean 'beta'"):
        method.resolve({"betta": 0.1})
    with pytest.raises(ValueError, match="precomputed"):  # adapters_off needs LoRA
        method.prepare_model(Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)), method.resolve())
    with pytest.raises(ValueError, match="label_smoothing"):
        make_dpo_loss(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="modules_to_save"):
        model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0))
        model = lora.apply(model, {"r": 2, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})
        method.prepare_model(model, method.resolve())


def test_sequence_logps_of_gpt2_agree_with_its_loss():
    """Any registered family: GPT-2's per-sequence log-probs (plain and chunked) sum to its own
    mean next-token loss times the token count."""
    from zerojax.models import GPT2, GPT2Config, gpt2_loss

    model = GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(4).integers(1, 200, (2, 16)).astype(np.int32)
    logps, n = sequence_logps(model, {"input_ids": ids})
    loss, _ = gpt2_loss(model, {"input_ids": jnp.asarray(ids)})
    assert float(-logps.sum() / n.sum()) == pytest.approx(float(loss), rel=1e-5)
    np.testing.assert_allclose(np.asarray(sequence_logps(model, {"input_ids": ids}, chunk=3)[0]), np.asarray(logps),
                               rtol=1e-5)


def test_the_reference_pass_is_differentiated_as_the_policy_pass_is(toy, monkeypatch):
    """Where a pass is differentiated decides its program on a GPU: cuDNN's attention (and the
    flash kernel) run their training forward (`custom_vjp`'s fwd rule) only where a tangent flows
    in, their inference forward otherwise, and the two round differently. A reference pass with its
    LoRA terms dropped depends on no trained weight, took the inference forward, and at step 0 its
    log-probs differed from the policy's (8B, 1,024 completion tokens: a first loss of 0.63, not
    ln 2). The reference pass runs the adapters' terms at scale 0 instead: the same program as the
    policy's. A spy attention names each rule's ops; the program of the engine's gradient (of the
    trained LoRA weights only) must hold the training rule's alone."""
    from zerojax.models import llama

    rows, _ = toy
    real = llama.causal_attention

    def spied(**kw):  # custom_vjp takes arrays only: the call's settings are closed over
        @jax.custom_vjp
        def spy(q, k, v):
            with jax.named_scope("spy_inference_forward"):
                return real(q, k, v, **kw)

        def spy_fwd(q, k, v):
            with jax.named_scope("spy_training_forward"):
                return real(q, k, v, **kw), (q, k, v)

        spy.defvjp(spy_fwd, lambda res, g: jax.vjp(lambda *qkv: real(*qkv, **kw), *res)[1](g))
        return spy

    monkeypatch.setattr(llama, "causal_attention", lambda q, k, v, **kw: spied(**kw)(q, k, v))
    graphdef, trained, frozen = nnx.split(_lora_model(), nnx.Param, ...)  # the engine differentiates the Params
    batch = next(rows.train_batches(ROWS, seed=0, start_step=0, num_steps=1))
    loss = make_dpo_loss()
    step = jax.jit(jax.value_and_grad(lambda t: loss(nnx.merge(graphdef, t, frozen), batch)[0]))
    program = step.lower(trained).as_text(debug_info=True)
    assert "spy_training_forward" in program and "spy_inference_forward" not in program
    assert float(step(trained)[0]) == pytest.approx(math.log(2), abs=1e-6)  # B = 0: reference = policy
