"""All three mesh axes at once (issue #19's combinations on 8 virtual CPU devices): tensor 2 x pipe 2
x data 2 with ZeRO-1 over "data", against the plain model (stage 0, no tensor or pipe axis) on the
same rows. The single-axis combinations (TP x ZeRO 0-3, pipe x ZeRO-1) are in test_tensor_parallel.py
and test_pipeline.py."""
import functools
import re

import jax
import numpy as np
from flax import nnx

import zerojax
from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss

# heads 2 and mlp 128 split over tensor 2; 8 layers over pipe 2
MODEL = GPT2Config.named("tiny", vocab_size=64, n_positions=16, n_embd=32, n_head=2, n_layer=8)
ROWS, SEQ, GA, STEPS, LR = 32, 16, 4, 3, 0.1
EPS32 = float(np.finfo(np.float32).eps)
# Tolerance (test_pipeline.py's derivation): the mesh changes only the order of fp32 sums. Every
# loss / gradient entry sums ROWS x (SEQ - 1) = 480 token contributions in a different grouping
# (per pipeline iteration and data device here, per micro-batch and 8 data devices in the plain
# run): <= 480 eps relative. The tensor split adds one more reordering, the row-parallel matmuls'
# two partial sums added by the all-reduce: one rounding, eps relative, inside that bound. SGD
# moves weights by LR x gradient (clipped to 1), so after STEPS steps they differ by <= STEPS x LR x REL.
REL = ROWS * (SEQ - 1) * EPS32
WEIGHT_ATOL = STEPS * LR * REL


def config(tensor=1, stages=1, zero_stage=0):
    cfg = {"train_batch_size": ROWS, "gradient_accumulation_steps": GA,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
           "gradient_clipping": 1.0, "zero_optimization": {"stage": zero_stage},
           "tensor_parallel": {"autotp_size": tensor}}
    if stages > 1:
        cfg["pipeline"] = {"stages": stages}
    return cfg


def host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


def batches():
    return [{"input_ids": np.random.default_rng(i).integers(0, MODEL.vocab_size, (ROWS, SEQ)).astype(np.int32)}
            for i in range(STEPS)]


@functools.lru_cache(maxsize=None)
def trained(tensor, stages, zero_stage):
    eng = zerojax.shard(lambda: GPT2(MODEL, rngs=nnx.Rngs(0)), config(tensor, stages, zero_stage), loss_fn=gpt2_loss)
    metrics = [(float(m["loss"]), float(m["grad_norm"])) for m in map(eng.train_step, batches())]
    return eng, np.asarray(metrics), host(eng.master_params)


def test_tensor_pipe_and_data_together_train_like_the_plain_model():
    eng, metrics, weights = trained(2, 2, 1)
    _, ref_metrics, ref_weights = trained(1, 1, 0)
    assert dict(eng.mesh.shape) == {"data": 2, "pipe": 2, "tensor": 2}
    np.testing.assert_allclose(metrics, ref_metrics, rtol=REL, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL), weights, ref_weights)
    # the layer stack over "pipe", Megatron's MLP split over "tensor", ZeRO-1's optimizer state over "data"
    spec = tuple(eng.shardings.master["h"]["mlp"]["c_fc"]["kernel"].spec)
    assert spec[0] == "pipe" and spec[2] == "tensor", spec
    mu = [a for path, a in jax.tree_util.tree_leaves_with_path(eng.state.opt_state)
          if re.search(r"'c_fc'.*'kernel'", jax.tree_util.keystr(path)) and a.ndim == 3]
    assert mu and {"pipe", "tensor", "data"} <= set(mu[0].sharding.spec), mu[0].sharding.spec


def test_stages_exchange_activations_and_keep_their_tensor_split_weights():
    """Stage to stage the hidden states move by collective-permute; no collective gathers a weight
    whose tensor split the pipeline would lose (a whole [.., n_embd, mlp] / [.., mlp, n_embd] MLP
    kernel, or the stacked layer axis)."""
    eng = trained(2, 2, 1)[0]
    hlo = eng.compiled_step({"input_ids": jax.ShapeDtypeStruct((ROWS, SEQ), np.int32)}).as_text()
    pat = r"= (\(?[^=]*?\)?) (all-gather|collective-permute|all-to-all|all-reduce)(?:-start)?\("
    ops = [(m.group(2), m.group(1)) for m in re.finditer(pat, hlo)]
    assert any(op == "collective-permute" and re.search(rf"\[1,\d+,\d+,{MODEL.n_embd}\]", s) for op, s in ops), ops
    d, mlp = MODEL.n_embd, 4 * MODEL.n_embd
    whole = (f"{d},{mlp}]", f"{mlp},{d}]", f"[{MODEL.n_layer},")
    assert not [o for o in ops if o[0] in ("all-gather", "all-to-all") and any(w in o[1] for w in whole)], ops


def test_checkpoint_from_all_three_axes_resumes_on_the_plain_model(tmp_path):
    src = trained(2, 2, 1)[0]
    src.save_checkpoint(str(tmp_path), tag="t")
    eng = zerojax.shard(lambda: GPT2(MODEL, rngs=nnx.Rngs(0)), config(1, 1, 1), loss_fn=gpt2_loss)
    eng.load_checkpoint(str(tmp_path), tag="t")
    jax.tree.map(np.testing.assert_array_equal, host((eng.master_params, eng.state.opt_state)),
                 host((src.master_params, src.state.opt_state)))
    assert eng.global_steps == STEPS
