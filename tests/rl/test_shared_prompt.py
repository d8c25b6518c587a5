"""Rollout log-probs with each group's prompt run once (`zerojax.scoring.shared_prompt`) equal the
whole rows' (`completion_logps` without group), values and gradients, on a Llama with a sliding
window and full remat, a GPT-2 and a LoRA Llama (prompt lengths differing between groups, ragged
completions); what the shared pass does not take falls back to the whole rows; the GRPO method
wires its group in, and shared_prompt=false takes it out."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax import lora
from zerojax.methods import get as get_method
from zerojax.methods.grpo import make_grpo_loss
from zerojax.models import GPT2, GPT2Config, Llama, LlamaConfig
from zerojax.rl import RolloutOptions
from zerojax.scoring import shared_prompt
from zerojax.scoring.logprobs import completion_logps

GROUPS, GROUP, PROMPT, COMPLETION = 3, 4, 9, 7


def _batch(vocab, seed=0):
    """Rollout rows: GROUPS prompts of 2..PROMPT tokens, GROUP completions each of 1..COMPLETION."""
    rng = np.random.default_rng(seed)
    rows = GROUPS * GROUP
    ids = np.zeros((rows, PROMPT + COMPLETION), np.int32)
    plen, mask = np.zeros(rows, np.int32), np.zeros((rows, COMPLETION), np.float32)
    for g, n in enumerate((PROMPT, 2, 5)):
        prompt = rng.integers(1, vocab, n)
        for r in range(g * GROUP, (g + 1) * GROUP):
            k = rng.integers(1, COMPLETION + 1)
            ids[r, :n], ids[r, n:n + k], plen[r], mask[r, :k] = prompt, rng.integers(1, vocab, k), n, 1
    return {"input_ids": ids, "prompt_lengths": plen, "completion_mask": mask}


MODELS = {
    "llama_window_remat": lambda: Llama(LlamaConfig.named("tiny", sliding_window=5), rngs=nnx.Rngs(0),
                                        remat_policy="full"),
    "gpt2": lambda: GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0)),
    "lora_llama": lambda: lora.apply(Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)),
                                     {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                      "init_lora_weights": False}),
}


@pytest.mark.parametrize("name", MODELS)
def test_shared_prompt_equals_whole_rows(name):
    model = MODELS[name]()
    batch = _batch(model.config.vocab_size)
    assert shared_prompt.shared_prompt_runs(model, GROUPS * GROUP, GROUP)
    graphdef, state = nnx.split(model)
    weights = jnp.asarray(batch["completion_mask"]) * jnp.linspace(0.5, 1.5, COMPLETION)

    @functools.partial(jax.jit, static_argnums=1)
    def logps_and_grad(state, group):
        """(per-token log-probs, the gradient of their weighted sum)."""
        def weighted(s):
            logps = completion_logps(nnx.merge(graphdef, s), batch, group=group)
            return (logps * weights).sum(), logps

        (_, logps), grad = jax.value_and_grad(weighted, has_aux=True)(state)
        return logps, grad

    (whole, g_whole), (shared, g_shared) = logps_and_grad(state, None), logps_and_grad(state, GROUP)
    mask = batch["completion_mask"] != 0
    np.testing.assert_allclose(np.asarray(shared)[mask], np.asarray(whole)[mask], rtol=1e-5, atol=1e-5)
    assert (np.asarray(shared)[~mask] == 0).all()
    leaves = jax.tree.leaves(g_whole)
    assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
    for a, b in zip(leaves, jax.tree.leaves(g_shared), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))


def test_what_the_shared_pass_does_not_take():
    model = MODELS["llama_window_remat"]()
    runs = shared_prompt.shared_prompt_runs
    assert runs(model, 12, 4) and not runs(model, 12, None) and not runs(model, 12, 1) and not runs(model, 10, 4)
    model.layer_scan = lambda *a: None  # an engine's own layer scan (pipeline stages, offload_param's prefetch)
    assert not runs(model, 12, 4)
    dropped = lora.apply(Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)),
                         {"r": 4, "target_modules": "all-linear", "lora_dropout": 0.1})
    assert runs(dropped, 12, 4)  # eval mode: no dropout
    dropped.lora_dropout.deterministic = False  # training mode: each row's tokens draw their own masks
    assert not runs(dropped, 12, 4)


def test_grpo_wires_the_group(monkeypatch):
    calls = []
    real = shared_prompt.completion_logps_shared
    monkeypatch.setattr(shared_prompt, "completion_logps_shared",
                        lambda *a, **k: calls.append(k["group"]) or real(*a, **k))
    grpo = get_method("grpo")
    model = MODELS["gpt2"]()
    batch = {**_batch(model.config.vocab_size), "advantages": np.linspace(-1, 1, GROUPS * GROUP, dtype=np.float32),
             "ref_logps": np.zeros((GROUPS * GROUP, COMPLETION), np.float32)}
    for shared, want in ((True, [GROUP]), (False, [])):
        calls.clear()
        loss_fn = grpo.loss(grpo.resolve({"reward": "digit", "group": GROUP, "shared_prompt": shared}))
        jax.eval_shape(loss_fn, model, batch)  # traced, not compiled: which pass it takes is all we ask
        assert calls == want
    with pytest.raises(ValueError, match="shared_prompt='yes'"):
        RolloutOptions(shared_prompt="yes").check(8, 4)
    with pytest.raises(ValueError, match="group=0"):
        make_grpo_loss(group=0)


def test_rollouts_refuse_a_loss_whose_groups_they_would_split():
    """The loss's group must divide the rollouts'; and where accumulation interleaves 8 devices'
    rows into each micro-batch, each device's micro-batch (2 rows here) must hold whole groups (4)."""
    import zerojax
    from zerojax.data.rows import ByteTokens
    from zerojax.rl import RolloutBatches, load_prompts

    digits = load_prompts("digit", ByteTokens(), seq_len=11)
    engine = zerojax.shard(lambda: Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0)),
                           {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                           loss_fn=make_grpo_loss(group=4, kl_coef=0.0))
    with pytest.raises(ValueError, match="rollouts give 2 completions per prompt: give the loss group=2"):
        RolloutBatches(engine, digits, "digit", RolloutOptions(group=2, kl_coef=0.0))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=2 is not a multiple of group=4"):
        RolloutBatches(engine, digits, "digit", RolloutOptions(group=4, kl_coef=0.0))
