"""Tensor parallelism (DeepSpeed's `tensor_parallel.autotp_size`): Megatron's splits of a tiny GPT-2
over the mesh's "tensor" axis, with ZeRO over "data", against TP 1 / stage 0 on 8 CPU devices."""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_mlp import MLP  # noqa: E402 (tests/ is on sys.path under pytest)
from tiny_mlp import loss_fn as mlp_loss

from zerojax import ConfigError, load_config, shard
from zerojax.engine.layout import build_layout
from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss
from zerojax.planning import estimate as est

N = 8  # devices (tests/conftest.py)
STEPS, LR, SEQ = 3, 1e-2, 16
# Adam's eps: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
# all keys), so it is pure rounding noise (<~1e-9) that differs with the reduction order; eps 1e-8
# would normalise that noise into a full lr-sized step of random sign. With eps 1e-4 it moves the
# weight by <= lr x 1e-5 per step, below the tolerance below; real gradients (>~1e-3) stay normalised.
EPS = 1e-4
# every split axis divides by 4: heads 4, mlp 128, vocab 64 padded to 128 rows (GPT-2's default)
TINY = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)


def config(tp, stage, prec="fp32", ga=1, **extra):
    return {
        # DeepSpeed's batch rule counts every rank (tensor ranks too): 1 x ga x 8 rows at any TP size
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "eps": EPS}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "fp16": {"enabled": prec == "fp16", "initial_scale_power": 12},
        "tensor_parallel": {"autotp_size": tp},
        **extra,
    }


def batches(rows, n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, TINY.vocab_size, size=(rows, SEQ)).astype(np.int32)} for _ in range(n)]


def as_numpy(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


@functools.cache
def run(tp, stage, prec="fp32", ga=1):
    """Engine after STEPS steps, its fp32 master weights and losses (shared by several tests)."""
    eng = shard(GPT2(TINY, rngs=nnx.Rngs(0)), config(tp, stage, prec, ga), loss_fn=gpt2_loss)
    losses = [float(eng.train_step(b)["loss"]) for b in batches(N * ga)]
    return eng, as_numpy(eng.master_params), np.asarray(losses)


def assert_trees_close(a, b, atol, rtol=0.0):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def spec(a):
    s = tuple(a.sharding.spec)
    return s + (None,) * (a.ndim - len(s))


# Tolerances. fp32: TP and ZeRO change only the order of the sums (a row-parallel matmul's partial
# sums over head / mlp slices added by the all-reduce; the gradient reduce over 8 / 4 / 2 data
# devices): each result moves by a few ulps, ~1e-7 relative. Through AdamW's normalised update a
# relative gradient change r moves a weight by <= lr x r per step; r reaches ~1e-4 on components
# whose gradient cancels over rows (kappa = sum|terms| / |sum| ~ 1e3), so after STEPS steps
# |dw| <= STEPS x lr x 1e-4 = 3e-6. The loss (a mean of fp32 terms) moves by ~10 ulps: rtol 1e-5.
FP32_ATOL = STEPS * LR * 1e-4
# fp16 (fp32 master compared): the compute-dtype roundings themselves move with the split, so each
# component of a weight's update (master - initial) moves by eps16 x kappa relative (eps16 = 2^-11).
# Elementwise that is unbounded where a gradient nearly cancels (a rare token's embedding row moved
# 2% in a trial run), so the update is compared as a whole per leaf, in the 2-norm, where the typical
# component dominates: kappa <= 40 gives 2^-11 x 40 = 2%. A wrong split or a lost loss-scale factor
# moves updates by O(1).
FP16_UPDATE_RTOL = 2.0**-11 * 40


@pytest.mark.parametrize("tp, stage", [(2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 3)])
@pytest.mark.slow
def test_tensor_parallel_trains_like_tp1_stage0(tp, stage):
    eng, master, losses = run(tp, stage)
    _, ref, ref_losses = run(1, 0)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(master, ref, atol=FP32_ATOL)
    assert eng.mesh.shape["tensor"] == tp and eng.mesh.shape["data"] == N // tp
    # Megatron's layout: q/k/v column-parallel on heads (the size-3 axis whole), attention output and
    # MLP down row-parallel, MLP up column-parallel; ZeRO adds "data" on a free axis from stage 3
    p = eng.state.params
    attn, mlp = p["h"]["attn"], p["h"]["mlp"]
    assert spec(attn["c_attn"]["kernel"])[2:4] == (None, "tensor")       # (L, d, qkv, heads, head_dim)
    assert spec(attn["c_proj"]["kernel"])[1] == "tensor"                 # (L, heads, head_dim, d)
    assert spec(mlp["c_fc"]["kernel"])[2] == "tensor"                    # (L, d, mlp)
    assert spec(mlp["c_proj"]["kernel"])[1] == "tensor"                  # (L, mlp, d)
    assert spec(p["wte"])[0] == "tensor" and "tensor" not in spec(p["h"]["ln_1"]["scale"])
    assert ("data" in spec(mlp["c_fc"]["kernel"])) == (stage == 3)
    opt_mu = [a for path, a in jax.tree_util.tree_leaves_with_path(eng.state.opt_state)
              if re.search(r"mu.*'c_fc'.*'kernel'", jax.tree_util.keystr(path))]
    assert opt_mu and set(spec(opt_mu[0])) >= ({"tensor", "data"} if stage >= 1 else {"tensor"})


@pytest.mark.slow
def test_fused_loss_under_tensor_parallelism_trains_like_tp1_stage0():
    """zerojax.models.chunked_gpt2_loss (the LM head and cross entropy 4 positions at a time) with
    the vocabulary split over "tensor" (TP 2, ZeRO-2): the same losses and weights as the whole-
    logits loss at TP 1 / stage 0 (fp32; only the order of the sums differs), and no device holds
    a whole chunk's logits over the padded vocabulary (128 rows: 64 a tensor rank)."""
    from zerojax.models import chunked_gpt2_loss
    eng = shard(GPT2(TINY, rngs=nnx.Rngs(0)), config(2, 2), loss_fn=chunked_gpt2_loss(4))
    losses = [float(eng.train_step(b)["loss"]) for b in batches(N)]
    _, ref, ref_losses = run(1, 0)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(as_numpy(eng.master_params), ref, atol=FP32_ATOL)
    hlo = eng.compiled_step({"input_ids": jax.ShapeDtypeStruct((N, SEQ), jnp.int32)}).as_text()
    rows = N // 4  # a data rank's rows (4 data ranks x 2 tensor ranks)
    assert f"f32[{rows},4,64]" in hlo  # a chunk's logits: the rank's rows, 4 positions, half the vocabulary
    assert f"f32[{rows},4,128]" not in hlo, "a whole chunk's logits over the padded vocabulary"


@pytest.mark.slow
def test_fp16_loss_scaling_and_accumulation_under_tensor_parallelism():
    """TP 2 x ZeRO-2, fp16 with dynamic loss scaling, 2 micro-batches of 8 rows each, against TP 1
    stage 0 with the same settings (micro-batches hold other rows -- DeepSpeed groups rows per data
    rank -- but the step's gradient is the mean over the same 16 rows)."""
    eng, master, losses = run(2, 2, "fp16", 2)
    ref_eng, ref, ref_losses = run(1, 0, "fp16", 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=2 * 2.0**-11)
    init = as_numpy(nnx.to_pure_dict(nnx.state(GPT2(TINY, rngs=nnx.Rngs(0)), nnx.Param)))
    for (path, x), y, x0 in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(ref),
                                jax.tree.leaves(init), strict=True):
        moved = np.linalg.norm(y - x0)
        assert moved > 0 and np.linalg.norm(x - y) <= FP16_UPDATE_RTOL * moved, jax.tree_util.keystr(path)
    assert eng.skipped_steps == ref_eng.skipped_steps
    assert float(eng.state.opt_state.loss_scale) == float(ref_eng.state.opt_state.loss_scale)


def _collectives_by_computation(hlo):
    """{computation name: [(op, result shape, replica groups text)]} of the compiled module."""
    out, comp = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            comp = line.split()[0] if not line.startswith("ENTRY") else "ENTRY"
        m = re.search(r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", line)
        if m:
            groups = re.search(r"replica_groups=(\{[\d,{}]*\}|\[[^ ]*)", line)
            # a combined collective's tuple result counts once per operand
            for shape in re.findall(r"[a-z]\w*\[[\d,]*\]", m.group(1)):
                out.setdefault(comp, []).append((m.group(2), shape, groups and groups.group(1)))
    return out


@pytest.mark.slow
def test_compiled_step_has_megatrons_collectives_with_sequence_parallelism():
    """Per transformer layer (one iteration of the layer scan), with the residual stream split on its
    sequence between sublayers (Megatron-LM's sequence parallelism), on [rows, T, d] activations:
    forward, an all-gather of the sequence before attention's and the MLP's column-parallel matmul
    and a reduce-scatter after each row-parallel one; backward, the transposes (an all-gather of each
    sublayer's output gradient, a reduce-scatter of its input gradient) plus an all-gather of each
    layer-norm output again for the weight gradients (Megatron-SP re-gathers too, rather than keep
    the gathered copy). All within a tensor group: activations never cross "data". XLA's CPU
    backend writes a reduce-scatter as an all-reduce of the whole [rows, T, d] and a slice (its GPU
    pipeline fuses the pair), so either form counts as one. The vocab-parallel loss never gathers
    the logits [rows, T, vocab]."""
    eng = run(2, 0)[0]
    tp = eng.mesh.shape["tensor"]
    rows = N // eng.mesh.shape["data"]  # a data shard's rows: micro 1 x tensor 2
    hlo = eng.compiled_step({"input_ids": jax.ShapeDtypeStruct((N, SEQ), jnp.int32)}).as_text()
    whole, split = f"f32[{rows},{SEQ},{TINY.n_embd}]", f"f32[{rows},{SEQ // tp},{TINY.n_embd}]"

    def kind(op, shape):
        if op == "all-gather" and shape == whole:
            return "gather"
        if (op, shape) in (("all-reduce", whole), ("reduce-scatter", split)):
            return "reduce"
        return None

    per_comp = {}
    for comp, ops in _collectives_by_computation(hlo).items():
        found = [(kind(op, shape), groups) for op, shape, groups in ops if kind(op, shape)]
        if found and comp != "ENTRY":  # the layer scans' bodies (ENTRY: embedding and LM head)
            per_comp[comp] = found
    counts = sorted(tuple(sorted((k, [x for x, _ in ops].count(k)) for k in ("gather", "reduce")))
                    for ops in per_comp.values())
    # two loop bodies: forward (2 gathers, 2 reduces), backward (4 gathers, 2 reduces)
    assert counts == [(("gather", 2), ("reduce", 2)), (("gather", 4), ("reduce", 2))], per_comp
    # the planner's byte count per layer (zerojax.planning.estimate) is the compiled step's: each collective
    # sends (t - 1) / t of the tensor group's [rows, T, d] residual stream
    layers = lambda n: est.ModelShape(0, 0, n, TINY.n_embd, SEQ)  # noqa: E731
    per_layer = (est.tensor_parallel_bytes(layers(1), micro_batch=1, n_tensor=tp, precision="fp32")
                 - est.tensor_parallel_bytes(layers(0), micro_batch=1, n_tensor=tp, precision="fp32"))
    compiled = sum(len(ops) for ops in per_comp.values()) * (tp - 1) / tp * rows * SEQ * TINY.n_embd * 4
    assert per_layer == compiled
    ids = np.vectorize(lambda d: d.id)(eng.mesh.devices)
    tensor_groups = {frozenset(row) for row in ids.reshape(-1, tp).tolist()}
    for ops in per_comp.values():
        for _, groups in ops:
            if groups and groups.startswith("{"):  # explicit groups: exactly the tensor groups
                found = {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", groups)}
                assert found == tensor_groups
    logits = re.compile(rf"f32\[{rows},(?:{SEQ}|{SEQ - 1}),{TINY.padded_vocab_size}\]")
    assert not [x for ops in _collectives_by_computation(hlo).values() for x in ops if logits.fullmatch(x[1])]
    # the embedding and the LM head are split on the (padded) vocabulary, and the whole wte is never
    # moved: each rank looks up its own rows (the partial sums added as activations) and its rows'
    # gradient is reduced over "data" only
    assert spec(eng.state.params["wte"])[0] == "tensor"
    wte_whole = f"f32[{TINY.padded_vocab_size},{TINY.n_embd}]"
    assert not [x for ops in _collectives_by_computation(hlo).values() for x in ops if x[1] == wte_whole]
    # without a tensor axis the layers need no collective on activations
    ref = run(1, 0)[0].compiled_step({"input_ids": jax.ShapeDtypeStruct((N, SEQ), jnp.int32)}).as_text()
    assert not [x for ops in _collectives_by_computation(ref).values() for x in ops
                if x[1].startswith(f"f32[1,{SEQ},")]


# --- checkpoints ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_reshards_across_tensor_sizes_and_exports_whole_tensors(tmp_path):
    """Saved at TP 2 x data 4 (ZeRO-1), resumed at TP 4 x data 2 and at TP 1 x data 8: the same fp32
    weights and Adam moments, bitwise (resharding moves bytes, it computes nothing); the Hugging
    Face export holds the whole (unsplit) tensors."""
    from zerojax import cli
    from zerojax.models.hf import load_hf

    eng, master, _ = run(2, 1)
    path = eng.save_checkpoint(str(tmp_path / "ckpt"))
    moments = lambda e: as_numpy([a for p, a in jax.tree_util.tree_leaves_with_path(e.state.opt_state)  # noqa: E731
                                  if re.search(r"\.(mu|nu)", jax.tree_util.keystr(p))])
    saved_moments = moments(eng)
    # into the engines test_tensor_parallel_trains_like_tp1_stage0 trained (TP 4 ZeRO-3, TP 1 stage 0:
    # what the tests read of them, copies of their weights and losses, their shardings and compiled
    # steps, a load does not change), one step past them first so that the load must restore every
    # value (weights, moments, step count)
    for tp, stage in ((4, 3), (1, 0)):
        other = run(tp, stage)[0]
        other.train_step(batches(N, n=1, seed=1)[0])
        assert other.global_steps == STEPS + 1
        other.load_checkpoint(str(tmp_path / "ckpt"))
        assert other.mesh.shape["tensor"] == tp
        assert_trees_close(as_numpy(other.master_params), master, atol=0)
        for a, b in zip(moments(other), saved_moments, strict=True):
            np.testing.assert_array_equal(a, b)
        assert other.global_steps == STEPS
        if tp == 4:
            assert spec(other.state.params["h"]["mlp"]["c_fc"]["kernel"])[2] == "tensor"
    assert path.startswith(str(tmp_path / "ckpt"))
    # a checkpoint says what it holds: its padded wte (128 rows) is refused by an unpadded model
    exact = GPT2Config(**{**TINY.__dict__, "make_vocab_size_divisible_by": 1})
    unpadded = shard(GPT2(exact, rngs=nnx.Rngs(1)), config(2, 1), loss_fn=gpt2_loss)
    with pytest.raises(ValueError, match=r"wte.*\(128, 32\).*\(64, 32\)"):
        unpadded.load_checkpoint(str(tmp_path / "ckpt"))
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    _, exported = load_hf(str(tmp_path / "hf"))
    assert_trees_close(as_numpy(exported), master, atol=0)


# --- layer_specs on any NNX model -----------------------------------------------------------------

MLP_SPECS = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r"^l1\."], "partition_type": "column"},   # up: split its output axis (and bias)
    {"patterns": [r"^l2\.kernel$"], "partition_type": "row"},  # down: split its input axis
    {"patterns": [r"^l2\.bias$"], "partition_type": "skip"},   # added after the all-reduce: whole
]}


def mlp_run(tp, stage, partition_config=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "tensor_parallel": {"autotp_size": tp, "partition_config": partition_config}}
    eng = shard(MLP(nnx.Rngs(0)), cfg, loss_fn=mlp_loss)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        eng.train_step({"x": rng.normal(size=(N, 16)).astype(np.float32),
                        "y": rng.normal(size=(N, 16)).astype(np.float32)})
    return eng


def test_layer_specs_split_a_plain_nnx_model_megatron_style():
    eng = mlp_run(2, 1, MLP_SPECS)
    p = eng.state.params
    assert (spec(p["l1"]["kernel"]), spec(p["l1"]["bias"])) == ((None, "tensor"), ("tensor",))
    assert (spec(p["l2"]["kernel"]), spec(p["l2"]["bias"])) == (("tensor", None), (None,))
    # same training as without a tensor axis (fp32; the reduction-order bound of FP32_ATOL)
    assert_trees_close(as_numpy(eng.master_params), as_numpy(mlp_run(1, 0).master_params), atol=FP32_ATOL)


LAYOUT_ONLY = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}


def _abstract_gpt2(**overrides):
    cfg = GPT2Config(**{**TINY.__dict__, **overrides})
    return nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0)))


def test_unknown_logical_names_are_replicated_with_a_warning():
    class Named(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((8, 16)), out_sharding=("embed", "experts"), eager_sharding=False)

    cfg = {**LAYOUT_ONLY, "tensor_parallel": {"autotp_size": 2}}
    with pytest.warns(UserWarning, match=r"\['experts'\].*stay replicated"):
        lay = build_layout(Named(), cfg, loss_fn=lambda m, b: 0.0)
    assert tuple(lay.shardings.params["w"].spec) in ((), (None,), (None, None))


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, tp_extra, name, size, fits", [
    (dict(n_embd=48, n_head=6), {}, r"h\.attn\.c_attn\.kernel.*'heads'", 6, [1, 2]),
    (dict(n_inner=66), {}, r"h\.mlp\.c_fc\.kernel.*'mlp'", 66, [1, 2]),
    (dict(vocab_size=66, make_vocab_size_divisible_by=1), {"partition_config": {"layer_specs": [
        {"patterns": [r"^wte$"], "partition_type": "column", "partition_dim": 0}]}}, r"wte.*'vocab'", 66, [1, 2]),
])
def test_indivisible_split_is_a_config_error_naming_sizes_that_work(overrides, tp_extra, name, size, fits):
    cfg = {**LAYOUT_ONLY, "tensor_parallel": {"autotp_size": 4, **tp_extra}}
    with pytest.raises(ConfigError, match=rf"tensor_parallel\.autotp_size = 4: {name}.* of size {size}.*"
                                          rf"not divisible by 4; tensor sizes that would work on 8 devices: "
                                          rf"{re.escape(str(fits))}"):
        build_layout(_abstract_gpt2(**overrides), cfg, loss_fn=gpt2_loss)


def test_an_unpadded_vocabulary_the_tensor_size_does_not_divide_stays_whole_with_a_warning():
    """GPT-2's own 50257 (here 66) with padding off: the embedding is replicated, not an error, and the
    warning names the fix; the rest of the model is still split."""
    cfg = {**LAYOUT_ONLY, "tensor_parallel": {"autotp_size": 4}}
    with pytest.warns(UserWarning, match=r"wte's 'vocab' axis of size 66 .*GPT2Config.make_vocab_size_divisible_by"):
        lay = build_layout(_abstract_gpt2(vocab_size=66, make_vocab_size_divisible_by=1), cfg, loss_fn=gpt2_loss)
    assert "tensor" not in tuple(lay.shardings.params["wte"].spec)
    assert "tensor" in tuple(lay.shardings.params["h"]["mlp"]["c_fc"]["kernel"].spec)


def test_autotp_size_must_divide_the_devices():
    cfg = {**LAYOUT_ONLY, "tensor_parallel": {"autotp_size": 3}}
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size = 3: .*8 devices.*\[1, 2, 4, 8\]"):
        build_layout(_abstract_gpt2(), cfg, loss_fn=gpt2_loss)


@pytest.mark.parametrize("layer_spec, key", [
    ({"patterns": ["c_fc"], "partition_type": "diagonal"}, r"layer_specs\[0\]\.partition_type"),
    ({"patterns": ["c_fc("]}, r"layer_specs\[0\]\.patterns"),
    ({"patterns": "c_fc"}, r"layer_specs\[0\]\.patterns"),
    ({"patterns": ["qkv"], "shape": [3, -1]}, r"layer_specs\[0\]\.shape"),
    ({"patterns": ["c_fc"], "partition_typ": "row"}, r"layer_specs\[0\]\.partition_typ"),
])
def test_partition_config_is_validated(layer_spec, key):
    with pytest.raises(ConfigError, match=r"tensor_parallel\.partition_config\." + key):
        load_config({"train_batch_size": 8, "tensor_parallel": {
            "autotp_size": 2, "partition_config": {"layer_specs": [layer_spec]}}}, world_size=8)


def test_deepspeed_filled_autotp_config_loads_with_its_batch_rule():
    """LLaMA-Factory's ds_z2_autotp_config.json as the Hugging Face Trainer fills it on 8 processes
    (per-device batch 2, accumulation 2): train_batch_size = 2 x 2 x 8, every rank counted, which is
    what DeepSpeed 0.19.8 demands ("8 != 8 * 1 * 2" for micro 8 on 2 GPUs with autotp_size 2)."""
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "data" / "ds_configs" / "llama_factory_ds_z2_autotp_config.json"
    fill = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "fp16.enabled": False, "bf16.enabled": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "_comment" key
        cfg = load_config(path, fill={**fill, "train_batch_size": 32})
        assert (cfg.train_batch_size, cfg.world_size, cfg.tensor_parallel.autotp_size) == (32, 8, 2)
        # counting only the 4 data-parallel ranks is what DeepSpeed refuses, and so does zerojax
        with pytest.raises(ConfigError, match=r"16 != 2 \* 2 \* 8"):
            load_config(path, fill={**fill, "train_batch_size": 16})


# --- the planner's view -----------------------------------------------------------------------------


def test_estimates_split_model_states_and_activations_over_the_tensor_axis():
    """Model states: each device holds 1 / t of the parameters before ZeRO divides by the data ranks
    (the ZeRO paper's accounting: 2 + 12 bytes a parameter without gradients, stage 0, Adam).
    Activations: Korthikanti et al. 2022, table 2, s·b·h·(34 + 5·a·s/h) per layer without parallelism,
    34/t with tensor + sequence
    parallelism (flash attention: no score matrices); a tensor group trains micro x t rows, so under
    DeepSpeed's batch rule a device saves what a data-parallel device does at the same micro-batch."""
    psi = 774_030_080  # GPT-2 Large (HF's num_parameters)
    assert est.model_state_floor(psi, stage=0, n_data=1, precision="bf16", n_tensor=2) == int(14 * psi / 2)
    # with the gradients, kept in fp32 by zerojax (2 + 4 + 4 + 8 bytes; the paper's 16 has 2-byte ones)
    assert est.model_state_bytes(psi, stage=0, n_data=1, precision="bf16", n_tensor=2) == int(18 * psi / 2)
    s, b, h, a = 1024, 8, 1280, 20
    paper = s * b * h * (34 + 5 * a * s / h)
    assert est.activation_bytes_per_layer(seq_len=s, rows=b, d_model=h, n_head=a, flash_attention=False) == int(paper)
    dp = est.activation_bytes_per_layer(seq_len=s, rows=b, d_model=h, n_head=a)
    tp = est.activation_bytes_per_layer(seq_len=s, rows=2 * b, d_model=h, n_head=a, n_tensor=2)
    no_sp = est.activation_bytes_per_layer(seq_len=s, rows=2 * b, d_model=h, n_head=a, n_tensor=2,
                                           sequence_parallel=False)
    assert dp == tp == s * b * h * 34 and no_sp == s * 2 * b * h * (24 / 2 + 10)


def test_activation_rules_claim_the_tensor_axis_in_rule_order():
    """heads / mlp / vocab come before the sequence: inside a sublayer the activation splits its heads
    (Megatron), between sublayers the residual stream splits its sequence (sequence parallelism);
    flax's name-order matching would have split q/k/v on the sequence."""
    from jax.sharding import PartitionSpec as P

    from zerojax.sharding import partition

    mesh = partition.make_mesh(tensor=2)
    rules = partition.ACTIVATION_RULES
    assert partition.logical_to_mesh(("batch", "seq", "qkv", "heads", "head_dim"), mesh, rules) == \
        P("data", None, None, "tensor", None)
    assert partition.logical_to_mesh(("batch", "seq", "embed"), mesh, rules) == P("data", "tensor", None)
    assert partition.logical_to_mesh(("batch", None, "vocab"), mesh, rules) == P("data", None, "tensor")
