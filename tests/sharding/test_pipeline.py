"""Pipeline parallelism (zerojax.sharding.pipeline) on 8 virtual CPU devices with a tiny GPT-2:
pipelined steps against the unpipelined model, the collectives XLA emits, checkpoints across stage
counts, and the errors."""
import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx
from hlo_text import matmul_flops, parse  # noqa: E402 (tests/ is on sys.path under pytest)
from tiny_mlp import MLP  # noqa: E402 (tests/ is on sys.path under pytest)
from tiny_mlp import loss_fn as mlp_loss

import zerojax
from zerojax.config import ConfigError
from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss

MODEL = GPT2Config.named("tiny", vocab_size=64, n_positions=16, n_embd=32, n_head=2, n_layer=8)
ROWS, SEQ, GA, STEPS, LR = 32, 16, 4, 3, 0.1
EPS32 = float(np.finfo(np.float32).eps)
# Tolerance. Pipelined and plain steps compute the same per-row functions with the same weights in
# fp32; only the order of the sums differs: the loss and every gradient entry sum the
# contributions of ROWS x (SEQ - 1) = 480 predicted tokens (plain: per micro-batch, then over
# 8 data devices; pipelined: per stage iteration, then over 4 or 2 data devices). A reordered
# n-term fp32 sum differs by at most (n - 1) eps times the sum of the terms' magnitudes, ~5.7e-5
# relative. SGD moves the weights by LR x gradient (gradient_clipping 1.0 bounds every entry by 1),
# so after STEPS steps they differ by at most STEPS x LR x 5.7e-5 ~ 1.7e-5 in absolute terms.
REL = ROWS * (SEQ - 1) * EPS32
WEIGHT_ATOL = STEPS * LR * REL


def config(stages, zero_stage=0, ckpt=0, **extra):
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": GA,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": zero_stage},
            "pipeline": {"stages": stages, "activation_checkpoint_interval": ckpt}, **extra}


def model():
    return GPT2(MODEL, rngs=nnx.Rngs(0))


def engine(stages, repeats=1, zero_stage=0, ckpt=0):
    return zerojax.shard(model, config(stages, zero_stage, ckpt), loss_fn=gpt2_loss,
                         options=zerojax.EngineOptions(pipeline_repeats=repeats))


def batches():
    return [{"input_ids": np.random.default_rng(i).integers(0, MODEL.vocab_size, (ROWS, SEQ)).astype(np.int32)}
            for i in range(STEPS)]


def host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)), tree)


def trained(stages, repeats=1, zero_stage=0, ckpt=0):
    """(engine, per-step losses and grad norms, weights after step 1, weights after STEPS steps),
    one training run per setting (the cache key spells out every argument)."""
    return _trained(stages, repeats, zero_stage, ckpt)


@functools.cache
def _trained(stages, repeats, zero_stage, ckpt):
    eng = engine(stages, repeats, zero_stage, ckpt)
    metrics, first = [], None
    for i, b in enumerate(batches()):
        m = eng.train_step(b)
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
        if i == 0:
            first = host(eng.master_params)
    return eng, np.asarray(metrics), first, host(eng.master_params)


# (stages, circular repeats, ZeRO stage, pipeline.activation_checkpoint_interval): with 8 layers,
# interval 2 at 4 stages is one checkpoint per stage iteration, 1 at 4 stages x 2 repeats too
CASES = [(2, 1, 0, 0), (4, 1, 1, 2), (2, 2, 1, 0), (4, 2, 0, 1)]


@pytest.mark.parametrize("stages,repeats,zero_stage,ckpt", CASES)
@pytest.mark.slow
def test_pipelined_steps_match_the_plain_model(stages, repeats, zero_stage, ckpt):
    eng, metrics, first, last = trained(stages, repeats, zero_stage, ckpt)
    _, ref_metrics, ref_first, ref_last = trained(1, 1, zero_stage)
    assert eng.layout.pipeline.stages == stages and eng.mesh.shape["pipe"] == stages
    assert eng.mesh.shape["data"] == 8 // stages
    np.testing.assert_allclose(metrics, ref_metrics, rtol=REL, atol=0)
    # step 1's update is -LR x (clipped) gradient: the gradients themselves
    for got, want in ((first, ref_first), (last, ref_last)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL, err_msg=jax.tree_util.keystr(path))
    # the bubble the engine reports: (S - 1) / (M R + S - 1)
    assert eng.pipeline_bubble == pytest.approx((stages - 1) / (GA * repeats + stages - 1))
    # ZeRO-1: the fp32 master / momentum split over "data" too (the stacked layers: over "pipe")
    spec = eng.layout.shardings.master["h"]["mlp"]["c_fc"]["kernel"].spec
    assert spec[0] == "pipe" and (("data" in spec) == (zero_stage == 1)), spec


def _loops(hlo: str):
    """{while body: (trip count, [trip counts of the while loops directly in that body])}."""
    comps = parse(hlo)["computations"]
    trips = lambda rest: int((re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest) or [0, 0])[1])  # noqa: E731
    body = lambda rest: re.search(r"body=%?([\w.\-]+)", rest).group(1)  # noqa: E731
    loops = {}
    for ins in comps.values():
        for _, _, op, rest in ins:
            if op == "while":
                inner = [trips(r) for _, _, o, r in comps[body(rest)] if o == "while"]
                loops[body(rest)] = (trips(rest), inner)
    return loops


@pytest.mark.slow
def test_a_stage_runs_its_layers_unrolled():
    """With no checkpoints a stage's layers run unrolled inside each pipeline iteration: no loop
    over them nested in the iterations' loops, forward or backward. Why: a nested loop keeps its
    saved activations in a stack of its own, which the iterations' loop copies into its stack
    every iteration and back out in the backward pass (the copies were a third of a GPT-2 Large
    step on 2 H200s)."""
    eng = trained(2, 2, 1, 0)[0]
    per = MODEL.n_layer // (2 * 2)
    iterations = [inner for trips, inner in _loops(eng.compiled_step(SHAPES).as_text()).values()
                  if trips == eng.layout.pipeline.iterations]
    assert len(iterations) >= 2, iterations  # the forward and the backward pass
    assert all(per not in inner for inner in iterations), iterations


def _collectives(hlo: str):
    pat = r"= (\(?[^=]*?\)?) (all-gather|collective-permute|all-to-all|all-reduce)(?:-start)?\("
    return [(m.group(2), m.group(1)) for m in re.finditer(pat, hlo)]


@pytest.mark.parametrize("stages,repeats", [(4, 1), (2, 2)])
@pytest.mark.slow
def test_activations_move_by_collective_permute(stages, repeats):
    """The stage-to-stage shift is a collective-permute of one micro-batch's hidden states
    [1, micro rows, SEQ, n_embd] per stage; no collective carries the whole stacked layer axis
    (8 layers): each device keeps its own stage's layers. Without repeats nothing moves the
    weights between stages at all (the all-to-alls there split the pipeline's output rows over
    "pipe" for the head); with circular repeats the layers, stored
    contiguously per stage, are exchanged once per step into the circular order (stage s runs
    blocks r S + s) by all-to-alls of half a stage's layers each way -- the cost of the option."""
    eng = trained(*{c[:2]: c for c in CASES}[(stages, repeats)])[0]
    ops = _collectives(eng.compiled_step(SHAPES).as_text())
    rows = ROWS // GA // eng.mesh.shape["data"]
    hidden = f"[1,{rows},{SEQ},{MODEL.n_embd}]"
    assert any(op == "collective-permute" and hidden in shp for op, shp in ops), ops
    stack = f"[{MODEL.n_layer},"
    assert not [o for o in ops if o[0] in ("all-gather", "all-to-all") and stack in o[1]], ops
    # the MLP's up-projection [.., n_embd, 4 n_embd] stands for the layers' weights
    weights = f"{MODEL.n_embd},{4 * MODEL.n_embd}]"
    assert any(op == "all-to-all" and weights in shp for op, shp in ops) == (repeats > 1), ops


SHAPES = {"input_ids": jax.ShapeDtypeStruct((ROWS, SEQ), np.int32)}
# Matmul FLOPs per token of the tiny model's forward pass (the independent reference): a layer's
# four projections 2 x 12 d^2, attention's scores and weighted sum 2 x 2 T d (XLA's attention
# computes the full T x T), the tied head 2 d V. The backward pass costs two forwards (the
# gradients of each matmul's two inputs); a recomputed forward adds one.
LAYER_FLOPS = 24 * MODEL.n_embd ** 2 + 4 * SEQ * MODEL.n_embd
# the head's gemm runs over the padded vocabulary (GPT2Config.make_vocab_size_divisible_by: 64 -> 128)
HEAD_FLOPS = 2 * MODEL.n_embd * MODEL.padded_vocab_size


@pytest.mark.parametrize("stages,repeats,zero_stage,ckpt", [(1, 1, 0, 0)] + CASES)
@pytest.mark.slow
def test_per_device_flops(stages, repeats, zero_stage, ckpt):
    """Per device, the compiled step's matmul FLOPs (every loop iteration counted) are what the
    schedule says and nothing more: each stage runs its L / (S R) layers on one micro-batch in each
    of the M R + S - 1 iterations (idle stages compute on zeros), a recomputation only with an
    activation_checkpoint_interval, and the head on 1 / (data x pipe) of the rows, not repeated on
    every stage. Exact: these are counts of matmul shapes, not timings."""
    eng = trained(stages, repeats, zero_stage, ckpt)[0]
    data = eng.mesh.shape["data"]
    tokens_per_iteration = ROWS // GA // data * SEQ
    passes = 3 + (ckpt > 0)  # forward, two for the backward, a recomputed forward
    if stages == 1:          # plain: the layer scan inside the accumulation scan
        layers = GA * MODEL.n_layer * tokens_per_iteration * LAYER_FLOPS * passes
    else:
        per = MODEL.n_layer // (stages * repeats)
        layers = eng.layout.pipeline.iterations * per * tokens_per_iteration * LAYER_FLOPS * passes
        if ckpt == 1:
            # a checkpointed group of one layer (no loop left: XLA inlines a one-trip scan) is
            # recomputed without its last matmul, the MLP's down-projection 2 x 4d x d: the
            # backward pass needs that matmul's inputs, not its output
            layers -= eng.layout.pipeline.iterations * per * tokens_per_iteration * 8 * MODEL.n_embd ** 2
    head = ROWS // 8 * SEQ * HEAD_FLOPS * 3
    assert matmul_flops(eng.compiled_step(SHAPES).as_text()) == layers + head


@pytest.mark.slow
def test_checkpoint_resumes_across_stage_counts(tmp_path):
    """A pipelined run's checkpoint is the plain model's state: it resumes under 4 stages and
    without pipelining with the same weights and optimizer state, bit for bit."""
    src = trained(2, 1, 0)[0]
    src.save_checkpoint(str(tmp_path), tag="t")
    want = host((src.master_params, src.state.opt_state))
    # into the engines other tests trained (4 stages with ZeRO-1; the plain model): what those tests
    # read of them (copies of their metrics and weights, their compiled steps) a load does not change.
    # One step more first, so that the load must restore every value (weights, momentum, step count)
    for eng in (trained(4, 1, 1, 2)[0], trained(1, 1, 0)[0]):
        eng.train_step(batches()[0])
        assert eng.global_steps == STEPS + 1
        eng.load_checkpoint(str(tmp_path), tag="t")
        got = host((eng.master_params, eng.state.opt_state))
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert eng.global_steps == STEPS


def _refusal(cfg, *, module=model, loss=gpt2_loss, repeats=1):
    with pytest.raises((ConfigError, ValueError)) as e:
        zerojax.shard(module, cfg, loss_fn=loss, options=zerojax.EngineOptions(pipeline_repeats=repeats))
    return str(e.value)


def test_errors():
    # layers not divisible by stages x repeats: 8 layers, 4 x 4
    msg = _refusal(config(4), repeats=4)
    assert "pipeline.stages=4" in msg and "8 stacked layers" in msg
    # circular repeats need at least as many micro-batches as stages
    msg = _refusal({**config(4), "gradient_accumulation_steps": 2, "train_batch_size": 8}, repeats=2)
    assert "gradient_accumulation_steps >= pipeline.stages" in msg
    # a checkpoint interval that does not divide a stage's 4 layers
    msg = _refusal(config(2, ckpt=3))
    assert "pipeline.activation_checkpoint_interval=3" in msg and "[1, 2, 4]" in msg
    # stages that do not divide the devices
    msg = _refusal(config(3))
    assert "pipeline.stages" in msg and "must divide the 8 devices" in msg
    # a model without a layer stack
    msg = _refusal({**config(2), "train_batch_size": 32}, module=lambda: MLP(nnx.Rngs(0)), loss=mlp_loss)
    assert "pipeline.stages = 2" in msg and "layer_scan" in msg
    # DeepSpeed's refusal of ZeRO-2/3 with pipelining, and offload
    for zero in ({"stage": 2}, {"stage": 3}):
        assert "incompatible with pipeline parallelism" in _refusal({**config(2), "zero_optimization": zero})
    msg = _refusal({**config(2, 1), "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})
    assert "zero_optimization.offload_optimizer.device" in msg and "pipeline.stages" in msg
    with pytest.raises(ValueError, match=r"pipeline_repeats=0: use an int >= 1"):
        zerojax.EngineOptions(pipeline_repeats=0)


def test_batch_rule_counts_data_devices_only():
    """DeepSpeed's batch rule with pipelining: train_batch_size = micro x gradient_accumulation_steps
    x data-parallel size, the data-parallel size being devices / (pipe x tensor) (DeepSpeed 0.19.8:
    PipelineEngine's dp_world_size from its PipeDataParallelTopology)."""
    for stages, data in ((1, 8), (2, 4), (4, 2)):
        cfg = zerojax.load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                                   "pipeline": {"stages": stages}})
        assert (cfg.world_size, cfg.train_batch_size) == (data, 2 * 4 * data)
    assert zerojax.load_config({"train_batch_size": 32, "pipeline": {"stages": "auto"}}).world_size == 8


def test_gpu_steps_compile_with_the_zero_init_option():
    # On GPU every train step is compiled with XLA's dus_accumulator_zero_init_elimination (one H200:
    # pipe 2 329.5 -> 309.5 ms, ZeRO-2 +0.9%, benchmarks/RESULTS.md); nowhere else. The option must be
    # one this XLA knows: DebugOptions fields are the same on every platform, so a CPU compile that
    # names it fails if a jaxlib renames or drops it (the engine would then warn and compile without it).
    from zerojax.engine.engine import ZERO_INIT_OPTION, step_compiler_options
    assert step_compiler_options(platform="gpu") == {ZERO_INIT_OPTION: True}
    assert step_compiler_options(platform="cpu") == {}
    x = np.zeros(3, np.float32)
    f = jax.jit(lambda x: x + 1).lower(x).compile(compiler_options={ZERO_INIT_OPTION: True})
    np.testing.assert_array_equal(f(x), np.ones(3))
