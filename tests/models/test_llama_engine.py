"""Every engine feature on a tiny Llama (GQA 4:2, q/k/v/o biases, untied head) equals the stage-0
run: ZeRO 1-3, tensor parallel 2 (kv heads split), pipeline 2, optimizer offload to CPU and NVMe,
parameter offload, remat, checkpoints across ZeRO stages. 8 virtual CPU devices, fp32, SGD."""
import functools

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.config import remat_policy_for
from zerojax.models import Llama, LlamaConfig, from_hf, llama_loss

pytestmark = pytest.mark.slow  # every test trains engines

MODEL = LlamaConfig.named("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                          attention_out_bias=True)
ROWS, SEQ, GA, STEPS, LR, MOMENTUM = 16, 8, 2, 3, 0.1, 0.9
EPS32 = float(np.finfo(np.float32).eps)
# Tolerance (tests/sharding/test_pipeline.py's derivation). Every run computes the same per-row
# functions with the same weights in fp32; only the order of sums differs (the data-parallel
# gradient reduce over 8 / 4 devices, the tensor ranks' partial sums, the pipeline's per-stage
# order, chunked offloaded updates). A reordered n-term fp32 sum moves by at most (n - 1) eps of
# the sum of the terms' magnitudes: REL over the ROWS x (SEQ - 1) predicted tokens. Clipping at 1.0
# bounds every gradient entry by 1, so a step's gradient moves by <= REL; SGD with momentum m adds
# step k's gradient into the weights with weight lr (1 + m + ... + m^(STEPS-k)), so after STEPS
# steps the weights differ by <= lr REL sum_k sum_{j<=k} m^j = lr REL (1 + 1.9 + 2.71).
REL = ROWS * (SEQ - 1) * EPS32
WEIGHT_ATOL = LR * REL * sum(sum(MOMENTUM ** j for j in range(k + 1)) for k in range(STEPS))


def config(stage=0, **extra):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": GA,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "gradient_clipping": 1.0, "zero_optimization": zero, **extra}


def model(remat_policy=None):
    return Llama(MODEL, rngs=nnx.Rngs(0), remat_policy=remat_policy)


def batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, MODEL.vocab_size, (ROWS, SEQ)).astype(np.int32)} for _ in range(n)]


def host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), tree)


def train(cfg, steps=STEPS, eng=None):
    """(engine, per-step losses, fp32 master weights after `steps` steps)."""
    if eng is None:
        remat = remat_policy_for(zerojax.load_config(cfg, world_size=_world(cfg)))
        eng = zerojax.shard(functools.partial(model, remat), cfg, loss_fn=llama_loss)
    losses = [float(eng.train_step(b)["loss"]) for b in batches()[:steps]]
    eng.synchronize()
    return eng, np.asarray(losses), host(eng.master_params)


def _world(cfg):
    return 8 // cfg.get("pipeline", {}).get("stages", 1)


def assert_same(a, b, atol=WEIGHT_ATOL):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
    _, losses, master = train(config(0))
    return losses, master


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("swap"))


CASES = {
    "zero1": lambda _: config(1),
    "zero2": lambda _: config(2),
    "zero3": lambda _: config(3),
    "tensor2": lambda _: config(1, tensor_parallel={"autotp_size": 2}),
    "pipeline2": lambda _: config(0, pipeline={"stages": 2}),
    "offload_cpu": lambda _: config(2, zero={"offload_optimizer": {"device": "cpu"}}),
    "offload_nvme": lambda d: config(3, zero={"offload_optimizer": {"device": "nvme", "nvme_path": d}}),
    "offload_param": lambda _: config(3, zero={"offload_optimizer": {"device": "cpu"},
                                               "offload_param": {"device": "cpu"}}),
    "remat_full": lambda _: config(2, activation_checkpointing={}),
    "remat_offload": lambda _: config(0, activation_checkpointing={"cpu_checkpointing": True}),
}


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """ZeRO-3 saved after 2 steps, then its third step; ZeRO-1's 3 steps, then that checkpoint loaded
    into it and the third step taken again from there. One engine per stage serves the feature
    test and test_checkpoint_across_zero_stages."""
    ck = tmp_path_factory.mktemp("ck") / "ck"
    a, losses3, saved = train(config(3), steps=2)
    a.save_checkpoint(ck)
    losses3 = np.append(losses3, float(a.train_step(batches()[2])["loss"]))
    a.synchronize()
    b, losses1, master1 = train(config(1))
    b.load_checkpoint(ck)
    loaded = host(b.master_params)
    b.train_step(batches()[2])
    return {"zero3": (a, losses3, host(a.master_params)), "zero1": (b, losses1, master1),
            "saved": saved, "ck": ck, "loaded": loaded, "resumed": host(b.master_params)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_feature_equals_stage0(case, reference, nvme_dir, request):
    if case in ("zero1", "zero3"):  # engines shared with test_checkpoint_across_zero_stages
        runs = request.getfixturevalue("stage_runs")
        eng, losses, master = runs["zero1"] if case == "zero1" else runs["zero3"]
    else:
        eng, losses, master = train(CASES[case](nvme_dir))
    ref_losses, ref = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same(master, ref)
    if case == "tensor2":  # the kv heads (2) are split over the 2 tensor ranks, as the q heads
        p = eng.state.params["layers"]["self_attn"]
        for name in ("q_proj", "k_proj", "v_proj"):
            assert tuple(p[name]["kernel"].sharding.spec)[2] == "tensor", name
        assert tuple(p["o_proj"]["kernel"].sharding.spec)[1] == "tensor"
    if case == "zero3":
        k = eng.state.params["layers"]["mlp"]["up_proj"]["kernel"]
        assert k.addressable_shards[0].data.size == k.size // 8
    if case.startswith("remat"):
        assert eng.step_settings.graphdef is not None
    if case == "offload_nvme":
        eng.close()


def test_checkpoint_across_zero_stages(reference, stage_runs, tmp_path):
    # saved at stage 3 after 2 steps, resumed at stage 1 (another sharding of every state leaf):
    # the third step lands where the uninterrupted stage-0 run does
    saved = stage_runs["saved"]
    assert_same(stage_runs["loaded"], saved, atol=0)
    assert_same(stage_runs["resumed"], reference[1])
    # and the checkpoint exports as a Hugging Face folder that from_hf reads back
    from zerojax.checkpoint import export
    from zerojax.models import weights_writer
    export(str(stage_runs["ck"]), str(tmp_path / "hf"), writer_for=weights_writer)
    back = from_hf(tmp_path / "hf")
    assert_same(host(nnx.to_pure_dict(nnx.state(back, nnx.Param))), saved, atol=0)


def test_tensor_parallel_with_indivisible_kv_heads():
    """One kv head, tensor 2: the q heads split, the kv head whole on both ranks (GQA's design),
    and the two steps land where the same model's stage-0 run does."""
    cfg = LlamaConfig.named("tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1)
    make = lambda: Llama(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    runs = [zerojax.shard(make, c, loss_fn=llama_loss)
            for c in (config(0), config(1, tensor_parallel={"autotp_size": 2}))]
    for eng in runs:
        for b in batches()[:2]:
            eng.train_step(b)
    p = runs[1].state.params["layers"]["self_attn"]
    assert tuple(p["q_proj"]["kernel"].sharding.spec)[2] == "tensor"
    assert "tensor" not in tuple(p["k_proj"]["kernel"].sharding.spec)
    assert_same(host(runs[1].master_params), host(runs[0].master_params))
