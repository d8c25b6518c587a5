"""Host offload through the engine (zerojax.shard) on 8 virtual CPU devices, tiny scanned GPT-2.

Each offloaded engine is compared with the same engine without offload after STEPS steps: the
offloaded update runs the same arithmetic chunk by chunk (fp32: 1e-6). On CPU the host memory
kinds are one address space, so these tests check placement (memory kinds), numerics, skip
logic and byte accounting; transfer schedules and device peaks are for the GPU benchmarks.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import offload
from zerojax.config import ConfigError
from zerojax.engine import init_state
from zerojax.models import gpt2

STEPS = 3
LR = 1e-2
C = gpt2.GPT2Config.named("tiny", n_embd=32, n_head=2, vocab_size=64, n_positions=16, n_layer=4)
HOST = ("pinned_host", "unpinned_host")
IN_PLACE = zerojax.EngineOptions(offload_loop="in_place")  # the default ("auto") is "host" for optimizer offload to cpu
HOST_ONE_LAYER_A_CHUNK = zerojax.EngineOptions(offload_loop="host", offload_host_chunk_bytes=1)


OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "sgd": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}


def config(stage, prec, opt="none", par="none", ratio=1.0, pin=False, optimizer="adamw", **extra):
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": OPTIMIZERS[optimizer],
        "gradient_clipping": 0.1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": opt, "ratio": ratio, "pin_memory": pin},
                              "offload_param": {"device": par, "pin_memory": pin}},
        "bf16": {"enabled": prec == "bf16"}, "fp16": {"enabled": prec == "fp16"},
        **extra,
    }


def batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, C.vocab_size, (8, 8)).astype(np.int32)} for _ in range(n)]


def _dtype(prec):
    return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[prec]


def _model(prec, remat, gather=True):
    m = gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=_dtype(prec), remat_policy=remat)
    if not gather:  # no per-layer hook: stage 3's weights placed as GSPMD does by default
        del m.layer_fetch
    return m


def run(stage, prec, opt="none", par="none", ratio=1.0, remat=None, pin=False, optimizer="adamw",
        options=zerojax.EngineOptions(), gather=True):
    """Engine after STEPS steps and its fp32 master weights (numpy): one engine per setting for the
    whole file, however the arguments are spelled (tests read it; none trains it further)."""
    return _run(stage, prec, opt, par, ratio, remat, pin, optimizer, options, gather)


@functools.cache
def _run(stage, prec, opt, par, ratio, remat, pin, optimizer, options, gather):
    make = functools.partial(_model, prec, remat, gather)
    eng = zerojax.shard(make, config(stage, prec, opt, par, ratio, pin, optimizer), loss_fn=gpt2.gpt2_loss,
                        options=options)
    for b in batches():
        eng.train_step(b)
    eng.synchronize()
    return eng, jax.tree.map(lambda a: np.asarray(a, np.float32), eng.master_params)


def close(a, b, tol, skip=()):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in skip):
            continue
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=name)


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def check_placement(eng, *, params_host):
    s = eng.state
    master_chunks = eng.layout.offload.layout.chunks
    for c, m, st in zip(master_chunks, s.master, s.opt_state.inner_state if eng.layout.fp16 else s.opt_state,
                        strict=True):
        want = "unpinned_host" if c.host else "device"
        assert kinds(m) == kinds(st) == {want}, (c, kinds(m), kinds(st))
    assert kinds(s.params) == ({"unpinned_host"} if params_host else {"device"})
    # the declared placement is the real one
    for x, sh in zip(jax.tree.leaves(s), jax.tree.leaves(eng.layout.state_shardings), strict=True):
        assert x.sharding.memory_kind == sh.memory_kind


# fp32: the offloaded step differs in where the gradient norm is summed (one tree vs chunks), where
# the clip factor is applied (one product 1/scale x coef) and in how XLA fuses the rest of the step
# (the order of the gradients' sums): ~1e-7 relative. SGD with momentum, whose update is linear in
# the gradient, keeps that at ~1e-7 and 1e-6 holds; Adam's m / sqrt(v) would amplify it 10x-100x
# where v is tiny (an optimizer property; the offloaded Adam itself: test_streamed_update_groups_agree).
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_offload_optimizer_fp32_matches_device(stage):
    eng, master = run(stage, "fp32", "cpu", options=IN_PLACE, optimizer="sgd")
    _, ref = run(stage, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    check_placement(eng, params_host=False)
    # fp32 compute: the device params are a copy apart from the host master
    assert eng.state.params["wte"].dtype == jnp.float32 and kinds(eng.state.params) == {"device"}
    # "in_place": the non-layer chunk + the 4 layers updated in place one at a time
    assert [(c.rest, c.loop) for c in eng.layout.offload.layout.chunks] == [(True, 0), (False, 4)]


# bf16: the whole step is one XLA program, and a different update lets XLA fuse and partition the
# bf16 forward/backward differently; Adam turns rounding noise in near-zero gradients into moves
# of up to lr per step, whatever their size. So the comparison has two parts: nearly every element
# (all but BF16_FRAC of each leaf, or one element) within BF16_TOL (measured on one CPU: offloaded vs not moves
# the rest by < 5e-3, stage 2 vs stage 3 of the same run by up to 4e-2), and every element within
# Adam's bound for a gradient whose sign is noise: 2 lr a step (lr each way) plus weight decay, which
# no CPU's summation order can exceed. The attention q/k/v bias is left out: its key part has an
# analytically zero gradient (softmax is shift-invariant), so all of it is sign noise.
BF16_TOL, BF16_FRAC, NOISE = 5e-3, 1e-3, ("c_attn']['bias",)
ADAM_NOISE_BOUND = 2 * LR * STEPS * 1.1  # the first step's bias-corrected update is exactly +-lr; 10% for later ones


def close_adam(a, b, tol=BF16_TOL, skip=NOISE):
    """Two Adam runs: all but BF16_FRAC of each leaf's elements within `tol`, every one within
    Adam's noise bound (see above)."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in skip):
            continue
        diff = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
        outside = diff > tol * (1 + np.abs(np.asarray(y, np.float64)))
        assert outside.sum() <= max(1, BF16_FRAC * diff.size), (name, int(outside.sum()), diff.size, float(diff.max()))
        assert diff.max() <= ADAM_NOISE_BOUND, (name, float(diff.max()))


@pytest.mark.parametrize("ratio", [1.0, 0.5])
@pytest.mark.slow
def test_offload_optimizer_stage3_bf16(ratio):
    eng, master = run(3, "bf16", "cpu", ratio=ratio, options=IN_PLACE)
    _, ref = run(3, "bf16")
    close_adam(master, ref)
    check_placement(eng, params_host=False)
    hosts = [c.host for c in eng.layout.offload.layout.chunks]
    # pieces: the non-layer leaves + 4 layers; ratio 0.5 keeps ceil(2.5) = 3 of them on the host
    assert hosts == ([True, True] if ratio == 1.0 else [True, True, False])


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
@pytest.mark.slow
def test_offload_param_and_optimizer_stage3(prec):
    # param offload re-fetches each layer in the backward pass (the fetched weights are never
    # saved; activations are, as without offload). Fetched layers change how GSPMD partitions the
    # forward, so gradients differ at ~1e-7 relative. fp32 uses SGD with momentum, whose update is
    # linear in the gradient, so that difference stays ~1e-7 and 1e-6 holds; Adam's m / sqrt(v)
    # would amplify it 10x-100x where v is tiny (an optimizer property, not offload's).
    if prec == "fp32":
        eng, master = run(3, prec, "cpu", "cpu", optimizer="sgd")
        _, ref = run(3, prec, optimizer="sgd")
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    else:
        # bf16: Adam moves every weight by ~lr a step whatever its gradient, so bf16 rounding
        # differences between two partitionings of the layer math show up at lr scale. The
        # fetched layers are partitioned as GSPMD does by default, so the reference is stage 3
        # without the per-layer gather (a model without the layer hook), both with "full" remat.
        eng, master = run(3, prec, "cpu", "cpu", remat="full")
        _, ref = run(3, prec, remat="full", gather=False)
        close_adam(master, ref)
    check_placement(eng, params_host=True)
    # the model's scan fetched each layer: the compiled step's parameters are host buffers
    assert eng.step_settings.graphdef is not None and eng.step_settings.fetch_rest is not None
    # ... one layer ahead (offload.prefetch_scan), the path these numbers went through
    from zerojax.engine.step import merge
    assert merge(eng.step_settings, eng.state.params, eng.state.rest).layer_scan is offload.prefetch_scan


@pytest.mark.slow
def test_in_place_loop_with_offload_param_matches_device():
    # "in_place" (the only loop with offload_param) updates the layers in place, one at a time, and
    # writes the new compute copy into the previous step's params, here host-resident: the device
    # update's arithmetic; SGD as above (Adam would amplify the fetched layers' 1e-7 partitioning noise)
    eng, master = run(3, "fp32", "cpu", "cpu", optimizer="sgd")
    _, ref = run(3, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    assert eng.layout.offload_settings["loop"] == "in_place"
    assert [(c.rest, c.loop) for c in eng.layout.offload.layout.chunks] == [(True, 0), (False, 4)]


def test_streamed_update_groups_agree():
    # offload.streamed_update alone (no engine: cheap), 8 stacked layers + a non-layer leaf, 2 AdamW
    # steps: the layers in 8 groups (one a layer) or 4 (two a layer) place the same elementwise
    # arithmetic differently, so they agree bitwise; and the update on the whole tree on the device
    # (no offload) to fp32 rounding: every value is O(1), the same ops in the same order per
    # element, 1e-6. A skipped step (fp16 overflow) leaves master and moments as they were.
    from zerojax.optim import scale_by_fused_adam
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    tree = {"h": {"w": rng.standard_normal((8, 16, 16)), "b": rng.standard_normal((8, 16))},
            "wte": rng.standard_normal((40, 16))}
    tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), tree)
    sh = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), tree)
    tx = scale_by_fused_adam(lambda c: 1e-2, weight_decay=0.1)

    def two_steps(k):
        state, off = offload.init_offloaded(tx, tree, k, sh, kind="pinned_host")
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
        f = jax.jit(lambda st, p: offload.streamed_update(tx, grads, st, off, compute_init=p), donate_argnums=(0, 1))
        for _ in range(2):
            params, state = f(state, params)
        assert [c.loop for c in off.layout.chunks] == [0, k]
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} <= set(HOST)  # still on the host
        return offload.offload_master(state, off), params

    got, want = two_steps(4), two_steps(8)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    m, st = tree, tx.init(tree)
    for _ in range(2):
        u, st = tx.update(grads, st, m)
        m = jax.tree.map(lambda p, d: p + d, m, u)
    close(got[0], m, 1e-6)
    state, off = offload.init_offloaded(tx, tree, 8, sh, kind="pinned_host")
    before = jax.tree.map(np.asarray, (offload.offload_master(state, off), state.opt_state))
    state = jax.jit(lambda st: offload.streamed_update(tx, grads, st, off, skip=jnp.asarray(True))[1],
                    donate_argnums=0)(state)
    after = jax.tree.map(np.asarray, (offload.offload_master(state, off), state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)


@pytest.mark.parametrize("host", [{}, {"offload_host_prefetch": 4, "offload_host_window": 1}])
@pytest.mark.slow
def test_host_loop_matches_device(host):
    # offload_loop="host" through the engine (ZeRO-2 on 8 devices): the 4 layers as 4 host chunks
    # (offload_host_chunk_bytes=1: one layer a chunk), updated one after another after the step's
    # jit, from Python (by default two chunks read in before the jit, window 3; or every chunk
    # before it, window 1): the device update's arithmetic, only where it is stored and run
    # differs: 1e-6 with SGD as in test_offload_optimizer_fp32_matches_device
    opts = zerojax.EngineOptions(offload_loop="host", offload_host_chunk_bytes=1, **host)
    eng, master = run(2, "fp32", "cpu", options=opts, optimizer="sgd")
    _, ref = run(2, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    check_placement(eng, params_host=False)
    assert [(c.rest, c.lo, c.hi, c.loop) for c in eng.layout.offload.layout.chunks] == [
        (True, 0, 0, 0)] + [(False, i, i + 1, 1) for i in range(4)]
    # one layer's c_fc kernel (d 32, 4d 128) as master or moment among the step's inputs: none,
    # the groups are left to Python
    inputs = eng.compiled_step({"input_ids": jax.ShapeDtypeStruct((8, 8), jnp.int32)}).args_info
    assert [tuple(a.shape) for a in jax.tree.leaves(inputs)].count((1, 32, 128)) == 0


def test_offload_loop_auto_picks_host_where_it_applies(tmp_path):
    # "auto" (the default): "host" for optimizer offload to cpu alone, "in_place" with offload_param
    # or the NVMe tier; "host" where it cannot run is an error naming the fix
    from zerojax.engine.engine import abstract_engine
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0))  # noqa: E731

    def loop(cfg, **opts):
        return abstract_engine(make, cfg, loss_fn=gpt2.gpt2_loss,
                               options=zerojax.EngineOptions(**opts)).offload_settings["loop"]

    nvme = config(3, "fp32", "nvme")
    nvme["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    assert loop(config(2, "fp32", "cpu")) == loop(config(3, "bf16", "cpu", ratio=0.5)) == "host"
    assert loop(config(3, "fp32", "cpu", "cpu")) == loop(nvme) == "in_place"
    assert loop(config(2, "fp32", "cpu"), offload_loop="in_place") == "in_place"
    with pytest.raises(ValueError, match="offload_loop='host' works with offload_optimizer to cpu alone.*"
                                         "use offload_loop='auto' or 'in_place'"):
        loop(config(3, "fp32", "cpu", "cpu"), offload_loop="host")


@pytest.mark.slow
def test_host_loop_groups_layers_by_bytes():
    # offload_loop="host": each chunk is the fewest layers (a divisor of the
    # 4) whose fp32 master holds offload_host_chunk_bytes on one device (ZeRO-2 on 8 devices);
    # the bytes counted by numpy on the one-layer-a-chunk engine's host chunks
    # (test_host_loop_matches_device's engine; its byte counts are the same after its steps)
    one = run(2, "fp32", "cpu", options=zerojax.EngineOptions(offload_loop="host", offload_host_chunk_bytes=1),
              optimizer="sgd")[0]
    chunks = one.layout.offload.layout.chunks
    assert [(c.lo, c.hi) for c in chunks if not c.rest] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    layer = [sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(one.state.master[i]))
             for i, c in enumerate(chunks) if not c.rest]
    assert len(set(layer)) == 1 and layer[0] > 0
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), one.master_params)
    shardings = jax.tree.map(lambda a: a.sharding, one.master_params)
    for least, groups in ((1, 4), (layer[0], 4), (layer[0] + 1, 2), (2 * layer[0], 2), (2 * layer[0] + 1, 1),
                          (10 * layer[0], 1)):
        assert offload.groups_of_at_least(abstract, least, shardings) == groups, least
    # through the engine: 1.5 layers' bytes -> 2 chunks of 2 layers, the device update's arithmetic
    eng, master = run(2, "fp32", "cpu", optimizer="sgd", options=zerojax.EngineOptions(
        offload_loop="host", offload_host_chunk_bytes=layer[0] * 3 // 2))
    assert [(c.lo, c.hi) for c in eng.layout.offload.layout.chunks if not c.rest] == [(0, 2), (2, 4)]
    assert eng.layout.offload_settings["chunks"] == 2
    _, ref = run(2, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    # the default (256 MiB) takes the tiny model's 4 layers as one chunk (the layout: an abstract engine)
    from zerojax.engine.engine import abstract_engine
    default = abstract_engine(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0)), config(2, "fp32", "cpu"), loss_fn=gpt2.gpt2_loss,
                              options=zerojax.EngineOptions(offload_loop="host"))
    assert default.layout.offload_settings["chunks"] == 1
    with pytest.raises(ValueError, match=r"offload_host_chunk_bytes=0: use an int >= 1"):
        zerojax.EngineOptions(offload_host_chunk_bytes=0)


def test_offload_init_from_a_built_model_keeps_its_weights_quietly():
    # a built (eager) model's fp32 weights are donated to the offload init, which XLA can take
    # only where an output shares their dtype and sharding (fp32 ZeRO-3); elsewhere JAX warned
    # "Some donated buffers were not usable", noise the user can do nothing about. The weights
    # must come through as they were
    model = gpt2.GPT2(C, rngs=nnx.Rngs(0))
    want = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        eng = zerojax.shard(model, config(2, "fp32", "cpu"), loss_fn=gpt2.gpt2_loss)
    close(jax.tree.map(np.asarray, eng.master_params), want, 0)


@pytest.mark.slow
def test_host_loop_with_part_of_the_state_on_the_device():
    # offload_loop="host" with offload_optimizer.ratio 0.5 (ZeRO-3): the step's jit updates the
    # device chunk, the host loop the rest; its compute copy and the loop's go into the same
    # params: the device update's arithmetic, 1e-6 (fp32, SGD: test_offload_optimizer_fp32_matches_device)
    eng, master = run(3, "fp32", "cpu", ratio=0.5, options=HOST_ONE_LAYER_A_CHUNK, optimizer="sgd")
    _, ref = run(3, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    assert [(c.lo, c.hi, c.host) for c in eng.layout.offload.layout.chunks] == [
        (0, 0, True), (0, 1, True), (1, 2, True), (2, 4, False)]
    assert eng._host_loop.loops == [0, 1, 2]


def test_host_loop_chunks_count_in_the_memory_guard(monkeypatch):
    # offload_loop="host": during the step's jit the prefetched chunks and the previous step's last
    # `window` write-backs sit beside the jit's temporaries; after it the loop's chunks in flight
    # (window + 1 of them), beside the params and gradients: the largest chunks; all with window 0.
    # The guard's figure takes the larger, and refuses a budget between the jit's peak and the loop's
    from zerojax.offload.host_loop import HostLoop
    from zerojax.planning import memory
    shapes = {"input_ids": jax.ShapeDtypeStruct((8, 8), jnp.int32)}
    eng = zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0)), config(2, "fp32", "cpu"), loss_fn=gpt2.gpt2_loss,
                        options=zerojax.EngineOptions(offload_loop="host", offload_host_window=1,
                                                      offload_host_prefetch=2, offload_host_chunk_bytes=1))
    # numpy's count of each host chunk's bytes on one of the 8 devices
    per_chunk = [sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((m, st)))
                 for m, st in zip(eng.state.master, eng.state.opt_state, strict=True)]
    largest = sorted(per_chunk, reverse=True)
    during_jit = sum(largest[:3])  # 2 prefetched + window 1
    want = sum(largest[:2])  # the loop: window 1 + 1
    assert eng._host_loop.device_bytes(eng.state.master, eng.state.opt_state) == (during_jit, want)
    every = HostLoop(eng.layout.offload, eng.step_settings.offload.tx, compute_dtype=jnp.float32,
                     params_shardings=eng.layout.state_shardings.params, window=0)
    assert every.device_bytes(eng.state.master, eng.state.opt_state) == (sum(per_chunk),) * 2
    jit_only = memory.CompiledMemory.of(eng.compiled_step(shapes))
    assert eng.step_memory(shapes).temp == max(jit_only.temp + during_jit, want)
    # a jit whose temporaries are smaller than the loop's chunks: the guard sees the chunks
    zero_temp = memory.CompiledMemory(jit_only.argument, jit_only.output, 0, jit_only.alias, jit_only.generated_code)
    monkeypatch.setattr(eng, "compiled_step", lambda batch_shapes: zero_temp)
    small = eng.step_memory(shapes)
    want = max(during_jit, want)
    assert small.temp == want and small.peak > jit_only.peak - jit_only.temp
    monkeypatch.setattr(memory, "device_budget", lambda device=None: small.peak - 1)
    # the error says what the chunks hold (numpy's count) and the options that hold less
    held = memory.fmt_bytes(want)
    with pytest.raises(memory.WillNotFitError, match=rf"offload_loop='host' keeps up to {held} of optimizer-state "
                       r"chunks on the device \(4 layer groups; offload_host_prefetch=2, "
                       r"offload_host_window=1\)\. EngineOptions\(offload_loop='in_place'\)"):
        eng.train_step(batches(1)[0])


@pytest.mark.slow
def test_bf16_first_moment_offloaded_matches_device():
    # EngineOptions.adam_mu_dtype="bfloat16": Adam's first moment stored in bf16 (host memory under
    # offload). Offloaded and not, the arithmetic is the same (fp32 compute, the moment rounded
    # where it is stored) but for the order of the gradients' sums, which can put a stored moment on
    # the other side of a bf16 rounding: each such flip moves a later step by <= 1.25e-4 (derived in
    # test_fused_adam_bf16_first_moment_against_float64), 2 later steps: 2.5e-4. Against the
    # fp32 moment the weights must move (the option took effect): the first step alone moves a
    # weight by lr x (relative rounding of m, up to 2^-9), far above the fp32 test's 1e-6 noise.
    opts = zerojax.EngineOptions(adam_mu_dtype="bfloat16")
    eng, master = run(2, "fp32", "cpu", options=opts)
    _, ref = run(2, "fp32", options=opts)
    close(master, ref, 2.5e-4, skip=NOISE)  # NOISE: the key bias (see close_adam)
    check_placement(eng, params_host=False)
    mus = [st.mu for st in eng.state.opt_state]
    assert {x.dtype for x in jax.tree.leaves(mus)} == {jnp.dtype(jnp.bfloat16)}
    assert kinds(mus) <= set(HOST)
    _, fp32_mu = run(2, "fp32")
    assert max(float(np.max(np.abs(a - b))) for a,
               b in zip(jax.tree.leaves(master), jax.tree.leaves(fp32_mu), strict=True)) > 1e-6


def test_fused_adam_bf16_first_moment_against_float64():
    # scale_by_fused_adam(mu_dtype=bf16) against Adam written out in float64 with the stored
    # moment rounded to bf16 after each step (the update itself uses the unrounded moment).
    # The stored moment: equal up to one bf16 ulp (2^-8 relative: fp32 vs float64, or an FMA the
    # CPU contracts, can put the value on the other side of a bf16 rounding boundary). The weights:
    # fp32 vs float64 is ~1e-7; one such flipped moment moves a later step by <= lr x 2^-8 x 3.2
    # (Adam's step bound lr (1 - b1) / sqrt(1 - b2), Kingma & Ba 2.1) = 1.25e-4, at most 2 later
    # steps: atol 2.5e-4, against ~1e-2 a step moves them
    from zerojax.optim import scale_by_fused_adam
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(16).astype(np.float32) for _ in range(3)]
    tx = scale_by_fused_adam(lambda c: lr, b1=b1, b2=b2, eps=eps, mu_dtype=jnp.bfloat16)
    p = jnp.ones(16, jnp.float32)
    st = tx.init(p)
    assert st.mu.dtype == jnp.bfloat16
    m, v, pr = np.zeros(16), np.zeros(16), np.ones(16)
    for t, g in enumerate(grads, 1):
        u, st = tx.update(jnp.asarray(g), st, p)
        p = p + u
        m_new = b1 * m + (1 - b1) * g.astype(np.float64)
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        pr = pr - lr * (m_new / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        m = m_new.astype(jnp.bfloat16).astype(np.float64)
        np.testing.assert_allclose(np.asarray(st.mu, np.float64), m, rtol=2.0 ** -8, atol=0)
        np.testing.assert_allclose(np.asarray(p, np.float64), pr, rtol=0, atol=2.5e-4)


def test_offload_options_are_checked():
    with pytest.raises(ValueError, match="adam_mu_dtype='float16'"):
        zerojax.EngineOptions(adam_mu_dtype="float16")
    with pytest.raises(ValueError, match=r"offload_loop='paired': use one of \('auto', 'in_place', 'host'\)"):
        zerojax.EngineOptions(offload_loop="paired")
    with pytest.raises(ValueError, match="adam_mu_dtype='bfloat16'.*Adam / AdamW only; optimizer.type is 'SGD'"):
        zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0)), config(2, "fp32", optimizer="sgd"),
                      loss_fn=gpt2.gpt2_loss, options=zerojax.EngineOptions(adam_mu_dtype="bfloat16"))
    tree = {"h": jnp.zeros((4, 3)), "wte": jnp.zeros((5, 3))}
    with pytest.raises(ValueError, match="layer count 4 is not divisible by k=3"):
        offload.chunk_layout(tree, 3, stacked=4)


@pytest.mark.parametrize("par", ["none", "cpu"])
@pytest.mark.slow
def test_init_by_leaf_groups_equals_one_jit(par):
    # a model too large to initialise on the device at once is built a group of leaves at a time
    # (here: one leaf a group); the state must be the one the single-jit init builds. "full" remat
    # changes no state: with offload_param the step is test_offload_param_and_optimizer_stage3's (bf16)
    make = functools.partial(_model, "bf16", "full")
    cfg = config(3, "bf16", "cpu", par)
    ref = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss)
    eng = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss, options=zerojax.EngineOptions(init_group_bytes=1))
    assert len(init_state.init_groups(eng.layout)) == len(jax.tree.leaves(eng.state.params)) > 1
    for a, b, sa, sb in zip(jax.tree.leaves(eng.state), jax.tree.leaves(ref.state),
                            jax.tree.leaves(eng.layout.state_shardings), jax.tree.leaves(ref.layout.state_shardings),
                            strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert a.sharding.memory_kind == sa.memory_kind == sb.memory_kind
    check_placement(eng, params_host=par == "cpu")
    before = np.asarray(eng.master_params["wte"], np.float32)
    eng.train_step(batches(1)[0])  # and it trains
    assert not np.array_equal(np.asarray(eng.master_params["wte"], np.float32), before)


@pytest.mark.slow
def test_offload_param_with_cpu_checkpointing():
    # offload_param + saved layer inputs in host memory (remat "offload", DeepSpeed's
    # cpu_checkpointing): the prefetching scan keeps the inputs on the host; same numbers as the
    # engine without any offload (fp32 SGD, as above)
    eng, master = run(3, "fp32", "cpu", "cpu", remat="offload", optimizer="sgd")
    _, ref = run(3, "fp32", optimizer="sgd")
    close(master, ref, 1e-6)
    check_placement(eng, params_host=True)


def _accumulating(opt, prec, optimizer, tmp_path=None, **opt_extra):
    """An engine with offload_param (+ optimizer offload `opt`), 4 accumulation steps, after 3 steps."""
    cfg = config(3, prec, opt, "cpu" if opt != "none" else "none", optimizer=optimizer)
    cfg["gradient_accumulation_steps"] = 4
    if opt == "nvme":
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(tmp_path), **opt_extra)
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=_dtype(prec))  # noqa: E731
    eng = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss)
    rng = np.random.default_rng(1)
    losses = [float(eng.train_step({"input_ids": rng.integers(0, C.vocab_size, (32, 8)).astype(np.int32)})["loss"])
              for _ in range(STEPS)]
    return eng, losses, jax.tree.map(lambda a: np.asarray(a, np.float32), eng.master_params)


@pytest.mark.slow
def test_offload_param_accumulates_in_host_memory(tmp_path):
    # offload_param with gradient accumulation: each micro-batch's host-resident gradients are added
    # into an fp32 accumulator in host memory a layer group at a time on the device (DeepSpeed also
    # sums offloaded gradients in host memory), instead of a whole fp32 accumulator on the device.
    # Reference: stage 3 without offload, its fp32 accumulator on the device. fp32 SGD, as in
    # test_offload_param_and_optimizer_stage3 (linear in the gradient: the fetched layers'
    # ~1e-7 partitioning difference stays ~1e-7, hence 1e-6).
    eng, losses, master = _accumulating("cpu", "fp32", "sgd")
    _, ref_losses, ref = _accumulating("none", "fp32", "sgd")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    close(master, ref, 1e-6)
    acc = eng.state.grad_accumulator
    assert jax.tree.structure(acc) == jax.tree.structure(eng.state.params)
    assert kinds(acc) <= set(HOST) and {x.dtype for x in jax.tree.leaves(acc)} == {jnp.dtype(jnp.float32)}
    check_placement(eng, params_host=True)
    # scratch, not state: a checkpoint does not store it, and a resumed engine keeps its own
    eng.save_checkpoint(tmp_path / "ck")
    assert "grad_accumulator" not in zerojax.checkpoint.state.read_meta(tmp_path / "ck", None)["items"]
    eng.load_checkpoint(tmp_path / "ck")
    assert eng.state.grad_accumulator is not None
    # the NVMe tier (layers' optimizer state in swap files, half of them in host memory) accumulates
    # the same way: bitwise the CPU-offload engine's numbers (the same per-group arithmetic)
    (tmp_path / "swap").mkdir()
    nv, nv_losses, nv_master = _accumulating("nvme", "bf16", "adamw", tmp_path / "swap", host_layers=2)
    _, cpu_losses, cpu_master = _accumulating("cpu", "bf16", "adamw")
    assert nv_losses == cpu_losses
    close(nv_master, cpu_master, 0.0)
    nv.close()


@pytest.mark.slow
def test_offload_checkpoint_resumes_under_any_layout(tmp_path, monkeypatch):
    # A checkpoint stores the state unchunked, as a run without offload keeps it. Saved from
    # param + optimizer offload after 2 steps, it resumes (a) under the same offload: the next 2
    # steps equal the uninterrupted run's bitwise; (b) under another chunk layout and (c) with no
    # offload at all: the same weights and optimizer state (moments, counts) bitwise, and the next
    # losses to 1e-4 (the layer math is partitioned differently in bf16: ~2e-5 measured)
    from zerojax.checkpoint import state as checkpoint
    from zerojax.models import weights_writer
    from zerojax.models.hf import load_hf, save_hf
    from zerojax.offload import stored
    from zerojax.offload.stored import ChunkRows

    # "full" remat (it changes no state): `a` runs the programs of test_offload_param_and_optimizer_stage3's
    # bf16 engine, compiled once
    make = functools.partial(_model, "bf16", "full")
    data = batches(4)
    a = zerojax.shard(make, config(3, "bf16", "cpu", "cpu"), loss_fn=gpt2.gpt2_loss)
    for b in data[:2]:
        a.train_step(b)
    # the embeddings (no layers axis) are written a block of rows at a time: blocks of 4 KiB here
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4096)
    assert stored.rows_per_block(a.state.master[0]["wte"]) < C.padded_vocab_size
    a.save_checkpoint(tmp_path / "ck")
    saved = jax.tree.map(lambda x: np.asarray(x, np.float32), a.master_params)
    # every host-resident leaf went to the files a layer group (the embeddings: a block of rows) at
    # a time, not through orbax whole (orbax copies a leaf whole into host memory: the state twice
    # there); the master to write out (the example's --export-hf) is read the same way: the saved
    # weights, bitwise, in a folder too
    streamed = checkpoint.read_meta(tmp_path / "ck")["streamed"]
    n_leaves = len(a.layout.offload.layout.stacked)   # all in host memory: parameters offloaded too
    assert len(streamed["master"]) == len(streamed["params"]) == n_leaves > sum(a.layout.offload.layout.stacked)
    assert len(streamed["opt_state"]) == 2 * n_leaves  # Adam's two moments
    written = a.consolidated_master()
    assert sum(isinstance(x, ChunkRows) for x in jax.tree.leaves(written)) == n_leaves
    save_hf(written, C, str(tmp_path / "written"))
    for x, y in zip(jax.tree.leaves(load_hf(str(tmp_path / "written"))[1]), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), y)
    unchunked_opt = lambda e: [np.asarray(x, np.float32)  # noqa: E731
                               for x in jax.tree.leaves(e.layout.to_stored(e.state).opt_state)]
    saved_opt = unchunked_opt(a)
    want = [float(a.train_step(b)["loss"]) for b in data[2:]]
    uninterrupted = jax.tree.map(lambda x: np.asarray(x, np.float32), a.master_params)

    def resume(cfg, options=zerojax.EngineOptions(), eng=None):
        if eng is None:
            eng = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss, options=options)
        eng.load_checkpoint(tmp_path / "ck")
        assert eng.global_steps == 2
        for x, y in zip(jax.tree.leaves(eng.master_params), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(np.asarray(x, np.float32), y)
        opt = unchunked_opt(eng)
        assert len(opt) == len(saved_opt) > 3
        for x, y in zip(opt, saved_opt, strict=True):
            np.testing.assert_array_equal(x, y)
        return eng, [float(eng.train_step(b)["loss"]) for b in data[2:]]

    # (a) the same offload: loaded back into the engine that saved it, now 2 steps past the checkpoint
    # (every state leaf must be replaced for the next steps to repeat bitwise), on a host too short
    # of memory for the restore beside the live state: that is released first (at 8B the state is
    # ~80 GB of a 128 GB host)
    from zerojax import byte_sizes

    live = jax.tree.leaves(a.state.master)[0]
    with monkeypatch.context() as m:
        m.setattr(byte_sizes, "host_free_bytes", lambda: 1)
        same, losses = resume(None, eng=a)
    assert live.is_deleted()
    assert losses == want
    check_placement(same, params_host=True)
    for x, y in zip(jax.tree.leaves(same.master_params), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), y)
    # another layout: half the pieces offloaded (offload_optimizer.ratio 0.5)
    other, losses = resume(config(3, "bf16", "cpu", "cpu", ratio=0.5))
    assert [(c.host, c.lo, c.hi) for c in other.layout.offload.layout.chunks] == [
        (True, 0, 0), (True, 0, 2), (False, 2, 4)]  # rest + layers 0-1 on the host, 2-3 on the device
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    # no offload: the file's stage-3 bf16 reference engine (what other tests read of it, a copy of its
    # weights taken when built and its state's byte counts, a checkpoint does not change)
    _, losses = resume(None, eng=run(3, "bf16")[0])
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    # one host chunk per layer (the layout of offload_loop "host"), updated after the
    # step's jit from Python ("host"; optimizer offload alone); the whole fp32 master on the host
    # (bitwise; the split master, the default with bf16, is test_split_master's: an exact tie
    # moves by one ulp, and this model's ~50k weights are likely to hold one)
    host, losses = resume(config(3, "bf16", "cpu"), zerojax.EngineOptions(
        offload_loop="host", offload_host_chunk_bytes=1, split_master="off"))
    assert [(c.lo, c.hi) for c in host.layout.offload.layout.chunks] == [(0, 0), (0, 1), (1, 2), (2, 3), (3, 4)]
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    assert kinds(host.state.master) <= set(HOST) and kinds(host.state.params) == {"device"}

    # export: the weights as saved
    checkpoint.export(tmp_path / "ck", tmp_path / "hf", writer_for=weights_writer)
    _, exported = load_hf(str(tmp_path / "hf"))
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), y)


@pytest.mark.slow
def test_chunked_checkpoint_of_earlier_zerojax_exports(tmp_path, monkeypatch):
    # zerojax before layout-free checkpoints saved an offloaded state chunk by chunk (and could
    # not load it): export still joins its chunks; resuming names the cause and the way out
    from zerojax.checkpoint import state as checkpoint
    from zerojax.models import weights_writer
    from zerojax.models.hf import load_hf

    # one host chunk a layer: test_host_loop_with_part_of_the_state_on_the_device's programs, more chunks to join
    eng = zerojax.shard(functools.partial(_model, "fp32", None), config(3, "fp32", "cpu", ratio=0.5),
                        loss_fn=gpt2.gpt2_loss, options=HOST_ONE_LAYER_A_CHUNK)
    eng.train_step(batches(1)[0])
    with monkeypatch.context() as m:
        m.setattr(type(eng.layout), "to_stored", lambda layout, state, **_: state)  # the old, chunked form
        eng.save_checkpoint(tmp_path / "old")
    checkpoint.export(tmp_path / "old", tmp_path / "hf", writer_for=weights_writer)
    _, exported = load_hf(str(tmp_path / "hf"))
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(eng.master_params), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with pytest.raises(checkpoint.CheckpointError, match="chunk by chunk.*zerojax export"):
        eng.load_checkpoint(tmp_path / "old")


def test_pin_memory_true_is_pinned_host():
    eng, _ = run(2, "fp32", "cpu", pin=True)
    assert kinds(eng.state.master) == kinds(eng.state.opt_state) == {"pinned_host"}


@pytest.mark.slow
def test_memory_report_moves_bytes_to_host():
    off = run(3, "bf16", "cpu", options=IN_PLACE)[0].memory_report()
    ref = run(3, "bf16")[0].memory_report()
    moved = ref["master"] + ref["optimizer_state"]
    assert off["master"] == 0 and off["optimizer_state"] == 0 and off["params"] == ref["params"]
    assert ref["host"] == 0
    # the same bytes, give or take the per-chunk step counters (3 chunks x int32 vs one)
    assert abs(off["host"] - moved) <= 16
    assert abs((ref["model_states"] - off["model_states"]) - moved) <= 16
    # (test_offload_param_and_optimizer_stage3's engine: remat changes no state array, so no byte here)
    both = run(3, "bf16", "cpu", "cpu", remat="full")[0].memory_report()
    assert both["params"] == both["gradients"] == both["model_states"] == 0
    assert abs(both["host"] - (moved + ref["params"] + ref["gradients"] // 2)) <= 16  # bf16 host grads


@pytest.mark.parametrize("loop", ["in_place", "host"])
@pytest.mark.slow
def test_fp16_overflow_is_skipped_with_offload(loop):
    cfg = config(2, "fp16", "cpu", fp16={"enabled": True, "initial_scale_power": 8})
    # fp16 params (the engine's compute dtype) computed on in fp32: XLA:CPU has no fp16 x fp16 -> fp32 dot
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.float32)  # noqa: E731
    eng = zerojax.shard(make, cfg, loss_fn=lambda m, b: gpt2.gpt2_loss(m, b)[0] * b["mult"][0],
                        options=zerojax.EngineOptions(offload_loop=loop))
    b0, b1 = batches(2)
    ones = np.ones((8,), np.float32)
    eng.train_step({**b0, "mult": ones})
    eng.synchronize()
    before = jax.tree.map(np.asarray, eng.master_params)
    scale = float(eng.state.opt_state.loss_scale)
    m = eng.train_step({**b1, "mult": np.full((8,), np.inf, np.float32)})  # inf loss -> inf grads
    eng.synchronize()
    assert bool(m["skipped"]) and eng.skipped_steps == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, eng.master_params), before)
    # hysteresis 2: the first overflow spends hysteresis, the second halves the scale
    eng.train_step({**b1, "mult": np.full((8,), np.inf, np.float32)})
    eng.synchronize()
    assert float(eng.state.opt_state.loss_scale) == scale / 2 and eng.skipped_steps == 2
    m = eng.train_step({**b1, "mult": ones})
    eng.synchronize()
    assert not bool(m["skipped"])
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, eng.master_params)),
                                                       jax.tree.leaves(before), strict=True))
    assert kinds(eng.state.master) == {"unpinned_host"}


def test_lamb_with_offload_is_a_config_error():
    cfg = config(2, "fp32", "cpu")
    cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="Lamb"):
        zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0)), cfg, loss_fn=gpt2.gpt2_loss)


class NoHook(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 16, 16)))

    def __call__(self, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, self.w[...])[0]


def test_offload_param_needs_a_model_hook():
    cfg = config(3, "fp32", "cpu", "cpu")
    with pytest.raises(ConfigError, match="fetch hook.*zerojax.models.gpt2.GPT2 does"):
        zerojax.shard(NoHook(nnx.Rngs(0)), cfg, loss_fn=lambda m, b: jnp.mean(m(b["x"]) ** 2))


def test_engine_options_validate():
    # every bad value is named with the values it takes, in one message; the knobs that lost their
    # measurements are gone, and shard() says where engine knobs go
    with pytest.raises(ValueError, match=r"split_master='yes': use one of \('auto', 'on', 'off'\).*"
                                         r"offload_host_prefetch=-1: use an int >= 0.*"
                                         r"init_group_bytes=0: use an int >= 1 or None.*memory_guard='no'"):
        zerojax.EngineOptions(split_master="yes", offload_host_prefetch=-1, init_group_bytes=0, memory_guard="no")
    with pytest.raises(ValueError, match=r"offload_host_chunk_bytes=0: use an int >= 1"):
        zerojax.EngineOptions(offload_host_chunk_bytes=0)
    for gone in ("offload_chunks", "stage3_gather", "pipeline_stage_loop", "plans_for"):
        with pytest.raises(TypeError):
            zerojax.EngineOptions(**{gone: None})
    assert not hasattr(zerojax.EngineOptions, "from_env")
    with pytest.raises(TypeError, match=r"options=zerojax.EngineOptions\(offload_host_window=2\)"):
        zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0)), config(2, "fp32", "cpu"),
                      loss_fn=gpt2.gpt2_loss, offload_host_window=2)
