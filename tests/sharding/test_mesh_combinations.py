"""Data x pipe x tensor combinations on virtual CPU devices, against the plain model (stage 0, no tensor or
pipe axis, all 8 devices: one shared reference run) on the same rows. Where each is tested:

- tensor 2 x pipe 2 x data 2, ZeRO-1 (all three axes): here, 8 devices;
- tensor 2 x pipe 2 with one data rank (the 4-GPU layout): here, on 4 of the 8 devices;
- ZeRO-3 over data; tensor 2 x data with ZeRO-1 and ZeRO-3: test_tensor_parallel.py's
  test_tensor_parallel_trains_like_tp1_stage0 (tensor 2 x data 4, ZeRO 0-3; 4 x data 2);
- pipe 2 x data, ZeRO 0 / 1: test_pipeline.py's test_pipelined_steps_match_the_plain_model (pipe 2 x
  data 4; pipe 4 x data 2 with ZeRO-1).
The 4-GPU shapes of those differ from the tested 8-device ones only in the data size (2 or 4 instead
of 4 or 8), which changes no code path; a run each would cost ~30 s of the suite for no new one.
"""
import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss
from zerojax.sharding.partition import make_mesh

pytestmark = pytest.mark.slow  # every test trains engines on all three axes

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


@functools.cache
def trained(tensor, stages, zero_stage, devices=None):
    """(engine, [(loss, grad_norm)] per step, final fp32 weights); devices: the first N devices
    (default all 8, the mesh `zerojax.shard` builds from the config)."""
    mesh = None if devices is None else make_mesh(tensor=tensor, pipe=stages, devices=jax.devices()[:devices])
    eng = zerojax.shard(lambda: GPT2(MODEL, rngs=nnx.Rngs(0)), config(tensor, stages, zero_stage), loss_fn=gpt2_loss,
                        mesh=mesh)
    metrics = [(float(m["loss"]), float(m["grad_norm"])) for m in map(eng.train_step, batches())]
    return eng, np.asarray(metrics), host(eng.master_params)


def assert_trains_like_the_plain_model(run):
    """Same losses, gradient norms (REL) and weights (WEIGHT_ATOL) as the plain 8-device run."""
    _, metrics, weights = run
    _, ref_metrics, ref_weights = trained(1, 1, 0)
    np.testing.assert_allclose(metrics, ref_metrics, rtol=REL, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL), weights, ref_weights)


def test_tensor_pipe_and_data_together_train_like_the_plain_model():
    eng = trained(2, 2, 1)[0]
    assert dict(eng.mesh.shape) == {"data": 2, "pipe": 2, "tensor": 2}
    assert_trains_like_the_plain_model(trained(2, 2, 1))
    # the layer stack over "pipe", Megatron's MLP split over "tensor", ZeRO-1's optimizer state over "data"
    spec = tuple(eng.layout.shardings.master["h"]["mlp"]["c_fc"]["kernel"].spec)
    assert spec[0] == "pipe" and spec[2] == "tensor", spec
    mu = [a for path, a in jax.tree_util.tree_leaves_with_path(eng.state.opt_state)
          if re.search(r"'c_fc'.*'kernel'", jax.tree_util.keystr(path)) and a.ndim == 3]
    assert mu and {"pipe", "tensor", "data"} <= set(mu[0].sharding.spec), mu[0].sharding.spec


def test_tensor_and_pipe_with_one_data_rank_on_four_devices_train_like_the_plain_model():
    """TP 2 x pipe 2 as on a 4-GPU node: the data axis has one rank (nothing for ZeRO to
    split), the mesh a subset of the devices. Same losses, gradient norms and weights as the plain
    8-device run (REL / WEIGHT_ATOL above: the same sums, grouped differently)."""
    assert dict(trained(2, 2, 1, 4)[0].mesh.shape) == {"data": 1, "pipe": 2, "tensor": 2}
    assert_trains_like_the_plain_model(trained(2, 2, 1, 4))


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
    # into the plain reference run's engine (what the other tests read of it, copies of its metrics and
    # weights, a load does not change), one step past it first so that the load must restore every
    # value (weights, momentum, step count)
    eng = trained(1, 1, 0)[0]
    eng.train_step(batches()[0])
    assert eng.global_steps == STEPS + 1
    eng.load_checkpoint(str(tmp_path), tag="t")
    jax.tree.map(np.testing.assert_array_equal, host((eng.master_params, eng.state.opt_state)),
                 host((src.master_params, src.state.opt_state)))
    assert eng.global_steps == STEPS
