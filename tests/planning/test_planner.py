"""zerojax.planning.planner: the choice it makes under a budget (measured from compiled peaks, never
hard-coded), its ranking against an independent FLOP count, and its config patch."""
import dataclasses
import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny_gpt2 import tiny_gpt2 as factory
from zerojax import EngineOptions
from zerojax.config import load_config
from zerojax.models import Llama, LlamaConfig
from zerojax.models.gpt2 import GPT2, GPT2Config
from zerojax.planning import estimate as E
from zerojax.planning import planner as PL
from zerojax.sharding.partition import make_mesh

SEQ = 32
CFG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
}


@pytest.mark.slow
def test_only_remat_fits_at_the_full_micro_batch():
    """Budget between the compiled peaks of the remat and no-remat steps at micro-batch 4: the
    planner keeps micro-batch 4 (no accumulation) with per-layer remat, which its step-time model
    predicts faster than no remat at micro-batch 2 x 2, and writes DeepSpeed's section for it."""
    peak = {r: PL.step_memory(factory, CFG, SEQ, 4, remat=r).peak for r in (None, "full")}
    assert peak["full"] < peak[None]  # remat frees the saved activations
    budget = (peak["full"] + peak[None]) // 2
    found = PL.search(factory, CFG, budget, SEQ, stages=(2,), offloads=("none",), max_plans=1)
    best = found.plans[0]
    assert (best.remat, best.micro_batch, best.grad_accum, best.stage) == ("full", 4, 1, 2)
    assert best.peak_bytes == peak["full"] <= budget
    tried = {(p.remat, p.micro_batch): outcome for p, outcome in found.tried}
    assert tried[(None, 4)] == "does not fit"
    patch = best.config_patch()
    assert patch["activation_checkpointing"] == {"partition_activations": False, "cpu_checkpointing": False}
    assert (patch["train_micro_batch_size_per_gpu"], patch["gradient_accumulation_steps"]) == (4, 1)
    # the patched config keeps the global batch and loads as DeepSpeed's keys
    cfg = load_config(best.apply(CFG), world_size=jax.device_count())
    assert cfg.train_batch_size == 4 * jax.device_count()
    assert cfg.activation_checkpointing is not None and not cfg.activation_checkpointing.cpu_checkpointing
    assert "remat full, micro-batch 4 x 1" in found.explain()


@pytest.mark.slow
def test_search_takes_zerojax_remat_policies_and_orders_them_by_what_they_keep():
    """planner.search with remat choices beyond DeepSpeed's (dots, save_attention): a budget below
    every micro-batch-4 peak used to end in a KeyError (the pruning knew only none / full /
    offload). Now every plan it returns fits, and a candidate is skipped unseen only when it keeps
    at least what a too-big one kept: the partial order of what each policy saves."""
    keeps = PL.remat_keeps_at_least
    assert keeps(None, "dots") and not keeps("dots", None) and keeps("full", "offload")
    assert keeps("save_qkv_attention", "save_attention") and keeps("save_qkv_attention", "full")
    assert keeps("dots", "save_qkv") and not keeps("dots", "save_attention") and not keeps("save_attention", "dots")
    assert keeps("dots_3", "dots_2") and not keeps("dots_2", "dots_3") and keeps("dots", "dots_2")
    assert keeps("dots_2", "full") and not keeps("dots_2", "save_attention") and not keeps("full", "dots_2")
    remats = ("full", "save_attention", "dots")
    peak4 = {r: PL.step_memory(factory, CFG, SEQ, 4, remat=r).peak for r in remats}
    budget = min(peak4.values()) - 1
    found = PL.search(factory, CFG, budget, SEQ, stages=(2,), offloads=("none",), remat=remats, max_plans=3)
    assert found.plans and all(p.peak_bytes <= budget and p.micro_batch < 4 for p in found.plans)
    assert {p.remat for p, outcome in found.tried if p.micro_batch == 4} == set(remats)


@pytest.mark.slow
def test_planning_compiles_with_the_runs_engine_options():
    """The planner compiles each candidate with the EngineOptions the run will use. The split master
    (an int16 remainder, not an fp32 master: 2 bytes a parameter) and the bf16 first moment (2 bytes)
    shrink the step's arguments by exactly what the state formula says (ZeRO-2 over 8 devices: / 8),
    the formula's floor stays under every compiled peak, and a budget that only the bf16 moment
    meets is met only when the search is told of it. A candidate that offloads drops the device
    split (layout.options_for_config) instead of failing."""
    from zerojax.engine.offload_choice import options_for_config

    params = PL.model_shape(factory, SEQ).params
    split_mu = EngineOptions(split_master="on", adam_mu_dtype="bfloat16")
    mu = EngineOptions(adam_mu_dtype="bfloat16")
    mems = {name: PL.step_memory(factory, CFG, SEQ, 4, remat="full", options=o)
            for name, o in (("default", None), ("mu", mu), ("split_mu", split_mu))}

    def floor(o):
        return E.model_state_floor(params, stage=2, n_data=8, precision="bf16", master_split=o.split_master == "on",
                                   adam_mu_dtype=o.adam_mu_dtype)

    default = EngineOptions()
    assert floor(default) - floor(split_mu) == (2 + 2) * params // 8
    for name, o in (("mu", mu), ("split_mu", split_mu)):
        assert mems["default"].argument - mems[name].argument == floor(default) - floor(o)
    for name, o in (("default", default), ("mu", mu), ("split_mu", split_mu)):
        assert mems[name].peak >= floor(o)
    # a budget between the two peaks: micro-batch 4 fits only with the bf16 moment
    assert mems["mu"].peak < mems["default"].peak
    budget = (mems["mu"].peak + mems["default"].peak) // 2
    kw = dict(stages=(2,), offloads=("none",), remat=("full",), micro_batch=4, max_plans=1)
    assert PL.plan(factory, CFG, budget, SEQ, **kw) == []
    (best,) = PL.plan(factory, CFG, budget, SEQ, options=mu, **kw)
    assert (best.micro_batch, best.peak_bytes) == (4, mems["mu"].peak)
    # the same through a built engine's plans (the memory guard's list): the engine's own options
    batch = {"input_ids": jax.ShapeDtypeStruct((4 * jax.device_count(), SEQ), jnp.int32)}
    for options, expect in ((None, set()), (mu, {(4, 1, 2)})):
        eng = abstract_engine(lambda: factory(remat_policy="full"), load_config(CFG, world_size=8),
                              loss_fn=PL.default_loss_fn(), options=options)
        plans = PL.engine_plans(eng, batch, budget, stages=(2,), offloads=("none",), max_plans=1)
        assert {(p.micro_batch, p.grad_accum, p.stage) for p in plans if p.micro_batch == 4} == expect
    # an offloading candidate keeps no device master: "on" splits the host loop's master there (the
    # default "auto" does too); a choice a candidate cannot take gives way to "auto"
    off = {**CFG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    adapted = options_for_config(split_mu.replace(offload_loop="host"), load_config(off, world_size=8))
    assert (adapted.split_master, adapted.offload_loop, adapted.adam_mu_dtype) == ("on", "host", "bfloat16")
    assert options_for_config(EngineOptions(offload_loop="host"), load_config(CFG, world_size=8)).offload_loop == "auto"
    fp32 = {**CFG, "bf16": {"enabled": False}}
    assert options_for_config(split_mu, load_config(fp32, world_size=8)).split_master == "auto"
    assert (PL.step_memory(factory, off, SEQ, 4, remat="full", options=split_mu).argument
            == PL.step_memory(factory, off, SEQ, 4, remat="full", options=mu).argument)
    found = PL.search(factory, CFG, 2**40, SEQ, stages=(2,), offloads=("optimizer",), remat=("full",),
                      micro_batch=4, options=split_mu)
    assert found.plans and all(outcome == "fits" for _, outcome in found.tried)


def hf_gpt2_params(cfg):
    """Hugging Face's GPT2LMHeadModel.num_parameters() (tied wte once) and one block's count,
    written out from HF's modules: ln_1, c_attn (d x 3d + 3d), c_proj (d x d + d), ln_2, c_fc
    (d x 4d + 4d), mlp c_proj (4d x d + d)."""
    d = cfg.n_embd
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab_size * d + cfg.n_positions * d + cfg.n_layer * block + 2 * d, block


def test_ranking_follows_an_independent_flop_count():
    """Candidates are tried in the order of their predicted step time; on one device (no
    collectives, no offload) that is tokens x FLOPs per token / (ceiling x efficiency), with
    FLOPs per token = 6N + 12·L·d·T (PaLM), plus one more forward of the blocks (2·N_blocks +
    4·L·d·T) under full remat, weighted by the hardware's recompute_weight; efficiency by the
    micro-batch's tokens x d_model. A 1-byte budget prunes
    every candidate by formula: no compile."""
    small = GPT2Config.named("small", make_vocab_size_divisible_by=1)  # HF's exact tensors (no padding rows)
    T = 1024
    N, block = hf_gpt2_params(small)
    assert (N, block) == (124_439_808, 7_087_872)  # HF's published counts for GPT-2 small

    def small_factory(remat_policy=None, dtype=jnp.bfloat16):
        return GPT2(small, rngs=nnx.Rngs(0), dtype=dtype, remat_policy=remat_policy)

    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    hw = E.Hardware()
    found = PL.search(small_factory, dict(CFG, train_micro_batch_size_per_gpu=8), 1, T,
                      offloads=("none",), mesh=mesh, max_plans=1)
    assert not found.plans and len(found.tried) == 2 * 4  # remat none / full x micro 8, 4, 2, 1
    L, d = small.n_layer, small.n_embd

    def independent_seconds(p):
        recompute = 2 * L * block + 4 * L * d * T if p.remat == "full" else 0
        flops = 6 * N + 12 * L * d * T + hw.recompute_weight * recompute
        tokens = p.micro_batch * T
        eff = hw.peak_efficiency * tokens * d / (tokens * d + hw.half_efficiency_work)
        return p.grad_accum * tokens * flops / (hw.matmul_flops * eff)

    seconds = [independent_seconds(p) for p, _ in found.tried]
    # the same arithmetic in another order: agreement to float rounding (1e-12 relative)
    for (p, outcome), s in zip(found.tried, seconds):
        assert outcome.startswith("pruned: model states alone")
        assert p.step_s == pytest.approx(s, rel=1e-12)
        assert p.tokens_per_s == pytest.approx(8 * T / s, rel=1e-12)
    assert seconds == sorted(seconds)
    # full remat costs one more forward of the blocks: slower than no remat at the same micro-batch
    by = {(p.remat, p.micro_batch): s for (p, _), s in zip(found.tried, seconds)}
    assert all(by[("full", m)] > by[(None, m)] for m in (1, 2, 4, 8))


# a Llama whose MLP is wide against its residual stream (d 32, intermediate 512): on a long row the
# MLP's [B, T, intermediate] activations are most of what a step without remat keeps
WIDE_MLP = LlamaConfig.named("tiny", hidden_size=32, intermediate_size=512, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=2 * PL.MLP_TILE)


def wide_mlp_llama(remat_policy=None, mlp_tile=None):
    return Llama(WIDE_MLP, rngs=nnx.Rngs(0), remat_policy=remat_policy, mlp_tile=mlp_tile,
                 attention_impl="blockwise")  # no [T, T] scores beside the MLP's activations


@pytest.mark.slow
def test_a_long_row_gets_a_tiled_mlp_where_the_untiled_one_does_not_fit():
    """A factory taking `mlp_tile`, on a row longer than MLP_TILE: the planner adds the default
    tile to its choices (at MLP_TILE positions, untiled only). At a budget between the compiled
    peaks of the untiled and the tiled step (no remat, micro-batch 1) the untiled step does not
    fit and the tiled one, predicted faster than a full remat, is chosen; the tile is carried
    beside the DeepSpeed keys, not in them. Its price in the step-time model: one more forward of
    the MLP kernels, 2 x 3·L·d·intermediate FLOPs a token, counted here from the config."""
    T = 2 * PL.MLP_TILE
    tile = PL.default_mlp_tile(T)
    assert tile == PL.MLP_TILE and PL.default_mlp_tile(3000) == 1500  # equal pieces, none padded
    assert PL.mlp_tile_choices(wide_mlp_llama, None, T) == (None, tile)
    assert PL.mlp_tile_choices(wide_mlp_llama, None, PL.MLP_TILE) == (None,)
    assert PL.mlp_tile_choices(factory, None, T) == (PL.AS_BUILT,)  # GPT-2's factory has no mlp_tile
    cfg = dict(CFG, train_micro_batch_size_per_gpu=1)
    peak = {t: PL.step_memory(wide_mlp_llama, cfg, T, 1, remat=None, mlp_tile=t).peak for t in (None, tile)}
    assert peak[tile] < peak[None]
    budget = (peak[tile] + peak[None]) // 2
    found = PL.search(wide_mlp_llama, cfg, budget, T, stages=(2,), offloads=("none",), max_plans=1)
    assert [(p.remat, p.mlp_tile, outcome) for p, outcome in found.tried] == [
        (None, None, "does not fit"), (None, tile, "fits")]
    best = found.plans[0]
    assert (best.mlp_tile, best.peak_bytes, best.micro_batch) == (tile, peak[tile], 1)
    assert f"remat none, MLP tile {tile}, micro-batch 1" in found.explain()
    assert best.to_dict()["mlp_tile"] == tile and "mlp_tile" not in json.dumps(best.config_patch())
    L, d, m = WIDE_MLP.num_hidden_layers, WIDE_MLP.hidden_size, WIDE_MLP.intermediate_size
    shape = PL.model_shape(wide_mlp_llama, T)
    assert E.train_flops_per_token(shape, tiled_mlp=True) - E.train_flops_per_token(shape) == 2 * 3 * L * d * m


@pytest.mark.slow
def test_a_built_engines_plans_vary_its_mlp_tile():
    """engine_plans (the memory guard's list) for an engine built untiled, on a row longer than
    MLP_TILE: the factory rebuilding its model takes `mlp_tile` (the model's own tile kept where
    the keyword is left out), and at a budget between the compiled peaks of the untiled and the
    tiled step the one plan returned is the tiled one, with that step's peak. The choices keep a
    model's own tile first; short or sequence-split rows plan it alone."""
    T = 2 * PL.MLP_TILE
    tile = PL.default_mlp_tile(T)
    cfg = dict(CFG, train_micro_batch_size_per_gpu=1)
    peak = {t: PL.step_memory(wide_mlp_llama, cfg, T, 1, remat=None, mlp_tile=t).peak for t in (None, tile)}
    budget = (peak[tile] + peak[None]) // 2
    eng = abstract_engine(wide_mlp_llama, load_config(cfg, world_size=8), loss_fn=PL.default_loss_fn())
    rebuild = PL.engine_model_factory(eng)
    assert inspect.signature(rebuild).parameters["mlp_tile"].default == PL.AS_BUILT
    assert (rebuild().mlp_tile, rebuild(mlp_tile=tile).mlp_tile) == (None, tile)
    batch = {"input_ids": jax.ShapeDtypeStruct((8, T), jnp.int32)}
    (best,) = PL.engine_plans(eng, batch, budget, stages=(2,), offloads=("none",), max_plans=1)
    assert (best.mlp_tile, best.remat, best.micro_batch, best.peak_bytes) == (tile, None, 1, peak[tile])
    assert f"MLP tile {tile}" in best.describe()
    # a model built with its own tile: that tile first, then the planner's; one choice where none is planned
    own = abstract_engine(lambda: wide_mlp_llama(mlp_tile=1024), load_config(cfg, world_size=8),
                          loss_fn=PL.default_loss_fn())
    assert PL.built_attributes(own)["mlp_tile"] == 1024
    rebuilt = PL.engine_model_factory(own)
    assert PL.built_mlp_tiles(1024, rebuilt, T, cfg) == (1024, None, tile)
    assert PL.built_mlp_tiles(None, rebuilt, T, cfg) == (None, tile)
    assert PL.built_mlp_tiles(1024, rebuilt, PL.MLP_TILE, cfg) == (1024,)
    assert PL.built_mlp_tiles(1024, rebuilt, T, dict(cfg, sequence_parallel_size=2)) == (1024,)
    assert PL.built_mlp_tiles(None, PL.engine_model_factory(abstract_engine(
        factory, load_config(cfg, world_size=8), loss_fn=PL.default_loss_fn())), T, cfg) == (PL.AS_BUILT,)


def test_precision_auto_is_explored_and_written_back():
    """fp16 / bf16 "auto" (Hugging Face's convention): on CPU the planner plans fp32 (bf16 on a
    GPU or TPU); the plan says so in the bf16 / fp16 sections it patches."""
    cfg = dict(CFG, fp16={"enabled": "auto", "loss_scale": 0}, bf16={"enabled": "auto"})
    choices = PL.precision_choices(cfg, factory)
    assert choices == (("bf16", "fp32") if jax.default_backend() in ("gpu", "tpu") else ("fp32",))
    assert PL.precision_choices(CFG, factory) == (None,)  # bf16 enabled: kept as configured
    p = PL.Plan(2, 4, remat=None, precision="fp32", grad_accum=2)
    merged = p.apply({**cfg, "activation_checkpointing": {"cpu_checkpointing": True}})
    assert merged["fp16"] == {"enabled": False, "loss_scale": 0} and merged["bf16"] == {"enabled": False}
    assert "activation_checkpointing" not in merged  # remat none removes the section
    assert load_config(merged, world_size=8).gradient_accumulation_steps == 2


def test_step_time_model_matches_the_measurements():
    """The step-time model against GPT-2 measured on one H200 (bf16, ZeRO-2, seq 1024;
    benchmarks/RESULTS.md): the eleven runs of Large its compute term was fitted to
    (remat policy, micro-batch, tokens/s), each within 5% (the fit's worst is 3.8%; runs of one
    setting vary by 1.5%: dots 76,909 and 78,121); Medium and XL, not fitted (predicted before they
    ran), within 5% (worst 4.5%; the model without the width term missed them by up to 8%); and,
    not fitted, with the optimizer offloaded in place (host bytes at the measured 53e9 B/s, no
    overlap): ZeRO-3, "save_attention_block", ratio 0.5 28,975 tokens/s and ZeRO-2,
    full remat, ratio 1 18,164, within 8%."""
    def shape_of(name):
        cfg = GPT2Config.named(name)
        N, block = hf_gpt2_params(cfg)
        return E.ModelShape(N, cfg.n_layer * block, cfg.n_layer, cfg.n_embd, 1024)

    large = shape_of("large")
    runs = [("large", "full", 4, 60_364), ("large", "full", 8, 72_499), ("large", "full", 16, 74_352),
            ("large", "dots", 4, 63_602), ("large", "dots", 8, 78_121), ("large", "dots", 8, 76_909),
            ("large", "save_attention", 8, 72_815), ("large", "save_attention", 16, 76_990),
            ("large", "save_qkv", 8, 71_946), ("large", "save_qkv_attention", 8, 73_864),
            ("large", "save_attention_block", 12, 77_753),
            ("medium", "full", 8, 146_485), ("medium", "full", 16, 155_705), ("medium", "dots", 8, 154_237),
            ("xl", "full", 8, 38_696), ("xl", "full", 4, 33_210), ("xl", "dots", 8, 42_047)]
    for name, remat, micro, measured in runs:
        t = E.predict_step_time(shape_of(name), stage=2, micro_batch=micro, remat=remat)
        assert t.tokens_per_s == pytest.approx(measured, rel=0.05), (name, remat, micro)
    for stage, remat, ratio, measured in ((3, "save_attention_block", 0.5, 28_975), (2, "full", 1.0, 18_164)):
        t = E.predict_step_time(large, stage=stage, micro_batch=8, remat=remat, offload_optimizer=True,
                                offload_ratio=ratio)
        assert t.tokens_per_s == pytest.approx(measured, rel=0.08), (remat, ratio)
    # a model that does not say its width: read from its blocks' ~12 d^2 parameters per layer
    assert E._width(dataclasses.replace(large, d_model=0)) == pytest.approx(1280, rel=0.01)
    assert E._width(E.ModelShape(10**9, 0)) == 1280  # nothing known: the fit's own width


def test_hardware_is_validated():
    with pytest.raises(ValueError, match="matmul_flops"):
        E.Hardware(matmul_flops=0)
    with pytest.raises(ValueError, match="remat choice"):
        PL.plan(factory, CFG, 10**9, SEQ, remat=("dot",))


# ---------------------------------------------------------------------------------------------
# The mesh search (zerojax.planning.mesh_search): data x tensor x pipe shapes of a device count

from tiny_gpt2 import TINY  # noqa: E402
from zerojax.engine.engine import abstract_engine  # noqa: E402
from zerojax.planning import mesh_search as MP  # noqa: E402
from zerojax.planning.memory import CompiledMemory, compile_engine_step  # noqa: E402
from zerojax.sharding.pipeline import PipelineSchedule  # noqa: E402

MESH_CFG = {**CFG, "train_batch_size": 32}
MESH_CFG.pop("train_micro_batch_size_per_gpu")


def test_mesh_search_lists_the_divisible_shapes_and_keeps_only_fitting_ones():
    """8 devices, tiny GPT-2 (4 heads, MLP 256, 2 layers), formula peaks: every data x tensor x pipe
    split whose tensor size divides the heads and MLP width and whose pipe size divides the layers
    (enumerated here from those rules) is tried, the others are refused with the reason; the plans
    fit the budget, keep the 32-row global batch by DeepSpeed's rule (micro x accum x data x
    tensor), pipelines use ZeRO 0/1 only, and they come fastest predicted first."""
    model = MP.mesh_model_of(factory, SEQ)
    # the counts read from the model's arrays agree with the ones written from GPT-2's config
    assert model == MP.gpt2_mesh_model(TINY, SEQ)
    assert (model.heads, model.mlp, model.shape.layers) == (TINY.n_head, 4 * TINY.n_embd, TINY.n_layer)
    allowed = {(8 // (t * p), t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)
               if 8 % (t * p) == 0 and TINY.n_head % t == 0 and 4 * TINY.n_embd % t == 0 and TINY.n_layer % p == 0}
    every = MP.search_mesh(factory, MESH_CFG, 2**40, SEQ, devices=8)
    assert {(p.data, p.tensor, p.pipe) for p, _ in every.tried} == allowed
    refused = dict(every.refused)
    assert "heads" in refused[(1, 8, 1)] and "layers" in refused[(2, 1, 4)]
    assert not allowed & set(refused)
    peaks = sorted(p.peak_bytes for p, _ in every.tried)
    budget = peaks[len(peaks) // 2]  # half the candidates over it
    found = MP.search_mesh(factory, MESH_CFG, budget, SEQ, devices=8)
    assert found.plans and all(p.peak_bytes <= budget and p.peak_source == "estimated" for p in found.plans)
    assert all(p.peak_bytes > budget for p, o in found.tried if o.startswith("does not fit"))
    for p, _ in found.tried:
        assert p.micro_batch * p.grad_accum * p.data * p.tensor == 32
        assert p.pipe == 1 or p.stage <= 1
    assert [p.step_s for p in found.plans] == sorted(p.step_s for p in found.plans)
    # one plan per (shape, stage): the fastest fitting micro-batch of each
    keys = [(p.data, p.tensor, p.pipe, p.stage) for p in found.plans]
    assert len(keys) == len(set(keys))
    # the config keys load, and size the mesh the plan names
    best = found.plans[0]
    cfg = load_config(best.apply(MESH_CFG), world_size=best.data * best.tensor)
    assert (cfg.tensor_parallel.autotp_size, cfg.train_batch_size) == (best.tensor, 32)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (best.micro_batch, best.grad_accum)


def test_mesh_step_time_adds_the_pipeline_bubble():
    """Without a pipeline the mesh model is `predict_step_time`; with S stages and M micro-batches a
    device runs 1/S of the FLOPs and idles the bubble, (S - 1) / (M + S - 1) of the step's
    iterations as zerojax.sharding.pipeline counts them: compute + bubble = compute x (M + S - 1) / M."""
    large = GPT2Config.named("large")
    model = MP.gpt2_mesh_model(large, 1024)
    _, block = hf_gpt2_params(large)
    assert model.shape.layer_params == large.n_layer * block  # HF's block, written out independently
    kw = dict(micro_batch=2, grad_accum=16, stage=1, precision="bf16")
    flat = E.predict_mesh_step_time(model.shape, n_data=2, **kw)
    ref = E.predict_step_time(model.shape, n_data=2, **kw)
    assert (flat.step_s, flat.tokens) == (ref.step_s, ref.tokens)
    piped = E.predict_mesh_step_time(model.shape, n_data=1, n_pipe=2, **kw)
    bubble = PipelineSchedule(stages=2, microbatches=16).bubble_fraction
    assert E.pipeline_bubble(2, 16) == pytest.approx(bubble, rel=1e-15)
    assert piped.bubble_s / (piped.compute_s + piped.bubble_s) == pytest.approx(bubble, rel=1e-12)
    assert piped.tokens == ref.tokens / 2 and piped.pipeline_s > 0


@pytest.mark.slow
def test_mesh_search_compiles_the_step_the_engine_runs():
    """compile=True: the peak the search reports for tensor 2 x pipe 2 on 4 devices (one compile:
    both axes' config keys at once) is the compiled memory of the engine built from the plan's own
    config keys on that mesh (independently: abstract engine, load_config of plan.apply,
    make_mesh), on CPU for the tiny GPT-2."""
    tensor, pipe, stage = 2, 2, 0
    found = MP.search_mesh(factory, MESH_CFG, 2**40, SEQ, devices=4, tensor_sizes=[tensor], pipe_sizes=[pipe],
                           stages=(stage,), micro_batch=4, compile=True, max_compiles=1)
    plan = found.plans[0]
    assert plan.peak_source == "compiled" and (plan.tensor, plan.pipe, plan.stage) == (tensor, pipe, stage)
    mesh = make_mesh(data=plan.data, tensor=tensor, pipe=pipe, devices=jax.devices()[:4])
    cfg = load_config(plan.apply(MESH_CFG), world_size=plan.data * tensor)
    eng = abstract_engine(factory, cfg, loss_fn=PL.default_loss_fn(), mesh=mesh)
    batch = {"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, SEQ), jnp.int32)}
    assert plan.peak_bytes == CompiledMemory.of(compile_engine_step(eng, batch, planning=True)).peak


def test_plan_command_searches_mesh_shapes_only_when_asked(capsys):
    """`zerojax plan --devices 4 --search-mesh` (formula peaks, tiny GPT-2: 4 heads, 2 layers): JSON
    with tensor and pipe sizes the model allows, each plan's config keys; without --search-mesh
    every plan is data-parallel. GPT-2 XL's 25 heads refuse every tensor size (its TP layouts
    cannot run), with the reason printed."""
    from zerojax.cli import main

    args = ["plan", "--model", "tiny", "--devices", "4", "--budget", "1GiB", "--global-batch", "16", "--json"]
    assert main(args + ["--search-mesh"]) == 0
    result = json.loads(capsys.readouterr().out)
    shapes = {(p["data"], p["tensor"], p["pipe"]) for p in result["plans"]}
    assert {(2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1)} <= shapes and result["peak_source"] == "estimated"
    for p in result["plans"]:
        patch = p["config_patch"]
        assert (patch["tensor_parallel"]["autotp_size"], patch["pipeline"]["stages"]) == (p["tensor"], p["pipe"])
        micro, accum = patch["train_micro_batch_size_per_gpu"], patch["gradient_accumulation_steps"]
        assert micro * accum * p["data"] * p["tensor"] == 16
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["plans"]
    assert {(p["tensor"], p["pipe"]) for p in plain} == {(1, 1)}
    # --master-split --adam-mu-dtype bfloat16: the same plans, each 4 bytes a parameter (/ its ZeRO
    # split of the master and moments) lighter by the formula
    assert main(args + ["--master-split", "--adam-mu-dtype", "bfloat16"]) == 0
    lean = {(p["data"], p["stage"], p["micro_batch"]): p["peak_bytes"]
            for p in json.loads(capsys.readouterr().out)["plans"]}
    params = MP.gpt2_mesh_model(TINY, TINY.n_positions).shape.params
    for p in plain:
        shard = p["data"] if p["stage"] >= 1 else 1
        extra = p["peak_bytes"] - lean[(p["data"], p["stage"], p["micro_batch"])]
        assert extra == pytest.approx(4 * params / shard, abs=2)
    assert main(["plan", "--model", "xl", "--devices", "4", "--budget", "139GiB", "--search-mesh", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "data 2 x tensor 2 x pipe 1: tensor 2 does not divide the 25 attention heads" in out


def test_mesh_formula_counts_the_models_mlp_and_what_a_tile_keeps():
    """estimate.mesh_peak_bytes' activations with the model's own MLP (`ModelShape.mlp_values`):
    GPT-2's (c_fc's output and GeLU's, 2 x 4d a position) is the paper's 16·s·b·h, so GPT-2's
    figures are those of a shape that says no MLP; the wide-MLP Llama keeps 3 x its intermediate
    (gate, up, their product), counted here from its config. A tile drops every layer's 2 bytes
    of each a position and adds one piece's once, both times ACTIVATION_FACTOR; the step-time
    model adds the MLP's rerun."""
    large = MP.gpt2_mesh_model(GPT2Config.named("large"), 1024).shape
    assert large.mlp_values == 8 * large.d_model
    kw = dict(heads=20, vocab=50304, micro_batch=8)
    assert E.mesh_peak_bytes(large, **kw) == E.mesh_peak_bytes(dataclasses.replace(large, mlp_params=0), **kw)
    T, tile, b = 2 * PL.MLP_TILE, 1024, 2
    shape = PL.model_shape(wide_mlp_llama, T)
    L, W = WIDE_MLP.num_hidden_layers, 3 * WIDE_MLP.intermediate_size
    assert shape.mlp_values == W
    kw = dict(heads=2, vocab=256, micro_batch=b, precision="bf16")
    untiled, tiled = (E.mesh_peak_bytes(shape, mlp_tile=t, **kw)["activations"] for t in (None, tile))
    # (each figure truncates each layer's bytes to an int once: under a byte a layer, x the factor)
    want = E.ACTIVATION_FACTOR * 2 * b * W * (L * T - tile)
    assert untiled - tiled == pytest.approx(want, abs=2 * L * E.ACTIVATION_FACTOR)
    plain, rerun = (E.predict_mesh_step_time(shape, micro_batch=b, tiled_mlp=t) for t in (False, True))
    assert rerun.step_s > plain.step_s


def _shard_bytes(tree) -> int:
    """Bytes of one device's shard of every leaf, from the leaves' own shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_mesh_state_formula_matches_the_engines_shards():
    """The mesh formula's model states (estimate.mesh_peak_bytes "states") against the per-device
    shards of the engine's own state on 4 of the 8 CPU devices (tiny GPT-2, bf16 compute over fp32
    master, AdamW; persistence threshold 0 so ZeRO-3 splits even tiny tensors), for every kind of
    split: ZeRO-3 over data 4, tensor 2 x data 2 (ZeRO-1 and ZeRO-3), pipe 2 x data 2, tensor 2 x
    pipe 2. The formula splits every parameter 1 / tensor; the model keeps R of them whole on each
    tensor rank (position embeddings, layer norms, the row-parallel projections' biases: counted here
    from GPT-2's architecture), so the shards hold R x (bytes a parameter, per device) x (1 - 1/t)
    more, plus optax's int32 step count: exact, nothing reordered."""
    d, L = TINY.n_embd, TINY.n_layer
    r_layers, r_rest = L * (2 * 2 * d + 2 * d), TINY.n_positions * d + 2 * d  # ln_1, ln_2; 2 row biases
    model = MP.gpt2_mesh_model(TINY, SEQ)
    cfg = dict(MESH_CFG, zero_optimization={"stage": 0, "stage3_param_persistence_threshold": 0})
    lean = EngineOptions(split_master="on", adam_mu_dtype="bfloat16")
    splits = [(4, 1, 1, 3), (2, 2, 1, 1), (2, 2, 1, 3), (2, 1, 2, 1), (1, 2, 2, 0)]
    for (data, t, p, stage), options in [(s, None) for s in splits] + [(s, lean) for s in splits[1:4]]:
        plan = MP.MeshPlan(data, t, p, stage, 4, 32 // (4 * data * t))
        mesh = make_mesh(data=data, tensor=t, pipe=p, devices=jax.devices()[:4])
        eng = abstract_engine(factory, load_config(plan.apply(cfg), world_size=data * t),
                              loss_fn=PL.default_loss_fn(), mesh=mesh, options=options)
        st = eng.state
        grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, eng.layout.accum_dtype), st.params)  # noqa: B023 - called within this iteration
        grads = jax.tree.map(lambda g, s: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=s), grads,
                             eng.layout.shardings.grads)
        shards = _shard_bytes((st.params, grads, st.master, st.opt_state))
        # the ZeRO paper's table with fp32 gradients: bf16 params, fp32 grads, fp32 master, Adam's 2 moments
        # (with the split master and the bf16 first moment: a 2-byte remainder, moments 2 + 4)
        master_opt = 2 + 6 if options else 4 + 8
        per_param = (2 / (data if stage == 3 else 1) + 4 / (data if stage >= 2 else 1)
                     + master_opt / (data if stage >= 1 else 1))
        replicated = r_layers / p + r_rest
        formula = E.mesh_peak_bytes(model.shape, heads=model.heads, vocab=model.vocab, micro_batch=4,
                                    n_data=data, n_tensor=t, n_pipe=p, stage=stage,
                                    master_split=options is not None,
                                    adam_mu_dtype=options and options.adam_mu_dtype)["states"]
        assert shards == formula + round(replicated * per_param * (1 - 1 / t)) + 4, (data, t, p, stage, options)
        if options:  # the mesh search's own formula peak counts them the same way
            est_plan = MP.predict(model, plan, options=options)
            assert est_plan.peak_bytes == E.mesh_peak_bytes(
                model.shape, heads=model.heads, vocab=model.vocab, micro_batch=4, grad_accum=plan.grad_accum,
                n_data=data, n_tensor=t, n_pipe=p, stage=stage, master_split=True, adam_mu_dtype="bfloat16")["total"]


# ---------------------------------------------------------------------------------------------
# Models written without zerojax in mind (tests/foreign_models.py): dims from the parameter tree

from foreign_models import ListQwen, QwenShape, ScanLM, ScanShape  # noqa: E402

QWEN = QwenShape(vocab=128, d=64, heads=4, kv_heads=2, head_dim=32, mlp=96, layers=4)  # H x Dh = 128 != d
SCAN = ScanShape(vocab=128, d=64, heads=4, mlp=96, layers=4)


def qwen_params(s):
    """(all parameters, one block's) of ListQwen, written out from its modules: two RMSNorms, q (d x H x
    Dh), k and v (d x KV x Dh), o (H x Dh x d), q / k norms (Dh each), SwiGLU (3 x d x mlp); tied
    embedding (V x d) and the final norm."""
    d, H, K, Dh, m = s.d, s.heads, s.kv_heads, s.head_dim, s.mlp
    block = 2 * d + d * H * Dh + 2 * d * K * Dh + H * Dh * d + 2 * Dh + 3 * d * m
    return s.vocab * d + s.layers * block + d, block


def scan_params(s):
    """(all, one block's) of ScanLM: two LayerNorms (scale + bias), wq / wk / wv / wo (d x d + d),
    w1 / w3 (d x mlp + mlp), w2 (mlp x d + d); embedding, final LayerNorm and untied output (d x V)."""
    d, m = s.d, s.mlp
    block = 2 * 2 * d + 4 * (d * d + d) + 2 * (d * m + m) + (m * d + d)
    return s.vocab * d + s.layers * block + 2 * d + d * s.vocab, block


@pytest.mark.parametrize("kind", ["list", "scan"])
def test_planner_reads_the_dims_and_flops_of_a_model_without_zerojax_names(kind):
    """planner.model_shape of a Qwen3-style list of blocks and of an nnx.vmap stack (no `.config`, no
    logical axis names): parameters, the blocks' parameters, layers, width and attention width
    (heads x head_dim: 128 on d = 64 for the Qwen3-style one) as counted in the test; training FLOPs
    6N + 12·L·(H·Dh)·T, plus 2·N_blocks + 4·L·(H·Dh)·T for a full remat; and the planner's predicted
    step time (a 1-byte budget prunes every candidate: nothing compiled) is that count at the
    hardware's efficiency for the micro-batch's tokens x d."""
    if kind == "list":
        s, (N, block) = QWEN, qwen_params(QWEN)
        width, make = QWEN.heads * QWEN.head_dim, lambda: ListQwen(QWEN, rngs=nnx.Rngs(0))
    else:
        s, (N, block) = SCAN, scan_params(SCAN)
        width, make = SCAN.d, lambda: ScanLM(SCAN, rngs=nnx.Rngs(0))
    T, L, d = 64, s.layers, s.d
    shape = PL.model_shape(make, T)
    assert (shape.params, shape.layer_params, shape.layers, shape.d_model, shape.attention_width, shape.seq_len) == (
        N, L * block, L, d, width, T)
    assert E.train_flops_per_token(shape) == 6 * N + 12 * L * width * T
    assert E.train_flops_per_token(shape, "full") == 6 * N + 12 * L * width * T + 2 * L * block + 4 * L * width * T
    hw = E.Hardware()
    found = PL.search(make, CFG, 1, T, offloads=("none",), mesh=make_mesh(data=1, devices=jax.devices()[:1]),
                      max_plans=1)
    assert not found.plans and [p.micro_batch for p, _ in found.tried] == [4, 2, 1]
    for p, outcome in found.tried:
        assert outcome.startswith("pruned: model states alone") and p.remat == PL.AS_BUILT
        tokens = p.micro_batch * T
        eff = hw.peak_efficiency * tokens * d / (tokens * d + hw.half_efficiency_work)
        seconds = p.grad_accum * tokens * (6 * N + 12 * L * width * T) / (hw.matmul_flops * eff)
        assert p.step_s == pytest.approx(seconds, rel=1e-12)


def test_mesh_search_of_a_model_without_zerojax_names():
    """mesh_model_of reads heads, vocabulary and MLP width from the model's dims (no `.config`): the
    Qwen3-style list (4 heads, MLP 96, 4 layers) and the nnx.vmap stack; tensor 8 is refused for its
    4 heads, pipe 8 for its 4 layers, and the formula search ranks the rest. A model without
    repeated blocks is an error naming what is missing."""
    for make, s in ((lambda: ListQwen(QWEN, rngs=nnx.Rngs(0)), QWEN), (lambda: ScanLM(SCAN, rngs=nnx.Rngs(0)), SCAN)):
        model = MP.mesh_model_of(make, SEQ)
        assert (model.heads, model.vocab, model.mlp) == (s.heads, s.vocab, s.mlp)
        assert model.shape == PL.model_shape(make, SEQ)
        ok, refused = MP.mesh_shapes(8, model)
        refused = dict(refused)
        assert refused[(1, 8, 1)] == "tensor 8 does not divide the 4 attention heads"
        assert refused[(1, 1, 8)] == "pipe 8 does not divide the 4 layers"
        assert {(2, 2, 2), (1, 4, 2), (4, 1, 2)} <= set(ok)
    found = MP.search_mesh(make, MESH_CFG, 2**40, SEQ, devices=8)
    assert found.plans and {(p.tensor, p.pipe) for p in found.plans} >= {(1, 1), (2, 2), (4, 1)}
    with pytest.raises(ValueError, match="needs the layers of Linear"):
        MP.mesh_model_of(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)), SEQ)
