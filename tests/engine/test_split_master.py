"""EngineOptions.split_master: the fp32 master kept as the bf16 compute copy plus an int16 remainder,
in host memory under offload_loop="host" (the default there) or on the device without offload
("on") (`zerojax.offload.split_master`). References: the fp32 values themselves (the round trip is
bit-exact but for exact ties), and the same training with the whole fp32 master
(split_master="off")."""
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.models import gpt2
from zerojax.offload.split_master import master_of, remainder

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "offload"))  # run alone, too
from test_engine_offload import C, batches, config  # noqa: E402

HOST = {True: "on", False: "off", None: "auto"}  # split_master for the host split (offload_loop="host")
DEVICE = {True: "on", False: "auto"}  # ... and for the device split (no offload)
# four fp32 ulps, relative: a weight moved by a tie (one ulp) and what follows from it, and the
# code generator's contraction of multiply-adds, which may differ between the two runs' programs
# by a rounding (tests/conftest.py)
ULP4 = 2.0 ** -21
# ... and where a weight is small beside Adam's moves, the update's own roundings: two ulps of the
# largest move, lr (Adam's |u| <= 1 here), a step, over the four steps of these runs (lr 1e-2)
UPDATES = 4 * 2 * 2.0 ** -30


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_remainder_round_trip_is_exact_but_for_ties_rounded_down():
    rng = np.random.default_rng(0)
    m = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-30, 30, 50_000)).astype(np.float32)
    m = np.concatenate([m, np.float32([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 2.0e-38])])
    m = m[(bits(m) & 0xFFFF) != 0x8000]  # exact ties apart (below)
    c = jnp.asarray(m).astype(jnp.bfloat16)
    rem = remainder(m, c)
    assert rem.dtype == jnp.int16
    np.testing.assert_array_equal(bits(master_of(c, rem)), bits(m))
    # exact ties: a bf16 value plus half its last place. Rounded up (odd last bit) the remainder is
    # -32768 and exact; rounded down to the even copy it would be +32768, stored as 32767: the
    # rebuilt weight is one ulp nearer the copy
    base = np.float32([1.0, 1.0 + 2.0 ** -7, -1.0, -(1.0 + 2.0 ** -7), 3.0, 2.0 ** -100])
    ties = (bits(base) | 0x8000).view(np.float32)
    ct = jnp.asarray(ties).astype(jnp.bfloat16)
    back = bits(master_of(ct, remainder(ties, ct)))
    even = (bits(base) >> 16) % 2 == 0
    assert even.tolist() == [True, False, True, False, True, True]
    np.testing.assert_array_equal(back[~even], bits(ties)[~even])
    np.testing.assert_array_equal(back[even], bits(ties)[even] - 1)


def host_engine(split, stage=2):
    # one layer a chunk (offload_host_chunk_bytes=1): the tiny model's layers as separate chunks
    opts = zerojax.EngineOptions(offload_loop="host", split_master=HOST[split], offload_host_chunk_bytes=1)
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)  # noqa: E731
    return zerojax.shard(make, config(stage, "bf16", "cpu"), loss_fn=gpt2.gpt2_loss, options=opts)


class Runs:
    """The option on (`split`) and off (`whole`), each built by `engine_with(option)` and trained on
    `data` side by side: per-step losses, the whole run's fp32 master after step 2 (numpy) and, where
    `save_to` is given, the split run's checkpoint after step 2 (`saved`). One pair of runs serves a
    trains-as test and a checkpoint test: the engines are read afterwards, never trained further.
    A non-finite loss (a batch whose "scale" is NaN) is a skipped step, reported at synchronize."""

    def __init__(self, engine_with, data, save_to=None):
        self.split, self.whole = engine_with(True), engine_with(False)
        self.losses = {True: [], False: []}
        self.saved = None
        for i, b in enumerate(data):
            for option, eng in ((True, self.split), (False, self.whole)):
                self.losses[option].append(float(eng.train_step(b)["loss"]))
                if np.isnan(self.losses[option][-1]):
                    with pytest.raises(FloatingPointError, match="not finite"):
                        eng.synchronize()
            if i == 1:
                self.whole_master_at2 = [np.asarray(x) for x in jax.tree.leaves(self.whole.master_params)]
                if save_to is not None:
                    self.split.save_checkpoint(save_to / "a")
                    self.saved = save_to / "a"


@pytest.fixture(scope="module")
def host_runs(tmp_path_factory):
    """{stage: Runs} of the host split (offload_loop="host") on batches(4), built on first use; stage
    2's split run saved after step 2 (test_split_master_checkpoints_store_the_fp32_master's)."""
    runs = {}

    def get(stage):
        if stage not in runs:
            save_to = tmp_path_factory.mktemp("host_split") if stage == 2 else None
            runs[stage] = Runs(lambda split: host_engine(split, stage), batches(4), save_to)
        return runs[stage]

    return get


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
def test_split_master_trains_as_the_fp32_master(stage, host_runs):
    # the same steps with the whole fp32 master in host memory: the same losses and compute params
    # (bitwise: a tie's one-ulp move never changes the bf16 copy), the master within four ulps
    trains_as_the_whole_master(host_runs(stage))


def trains_as_the_whole_master(runs):
    """The split run against the whole-master run: the same 4 losses and compute params (bitwise: a
    tie's one-ulp move never changes the bf16 copy), the master within four ulps, and the host
    chunks holding int16 remainders, half the fp32 master's bytes."""
    split, whole = runs.split, runs.whole
    assert len(runs.losses[True]) == 4 and runs.losses[True] == runs.losses[False]
    for x, y in zip(jax.tree.leaves(split.state.params), jax.tree.leaves(whole.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    for x, y in zip(jax.tree.leaves(split.master_params), jax.tree.leaves(whole.master_params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=ULP4, atol=UPDATES)
    hosts = [i for i, c in enumerate(split.layout.offload.layout.chunks) if c.host]
    assert hosts and all(x.dtype == jnp.int16 for i in hosts for x in jax.tree.leaves(split.state.master[i]))
    nbytes = lambda e: sum(x.nbytes for i in hosts for x in jax.tree.leaves(e.state.master[i]))  # noqa: E731
    assert 2 * nbytes(split) == nbytes(whole)


def resumes_both_ways(tmp_path, runs, engine_with, later):
    """`runs.saved` (the option on, saved after step 2): an engine without the option
    (`engine_with(False)`) loads it, holds the whole run's fp32 master after step 2 (within four ulps)
    and saves; one with it loads that: each trains on `later` (the batches after those trained, steps
    3-4) as the whole run did (`runs.losses[False][2:]`: the uninterrupted run's losses there)."""
    ref, want = runs.whole_master_at2, runs.losses[False][2:]
    assert runs.saved is not None and len(want) == len(later) == 2
    for option, src in ((False, runs.saved), (True, tmp_path / "b")):
        eng = engine_with(option)
        eng.load_checkpoint(src)
        for x, y in zip(jax.tree.leaves(eng.master_params), ref, strict=True):
            np.testing.assert_allclose(np.asarray(x), y, rtol=ULP4, atol=UPDATES)
        if src == runs.saved:
            eng.save_checkpoint(tmp_path / "b")  # saved without the option, resumed with it next
        assert [float(eng.train_step(b)["loss"]) for b in later] == want


@pytest.mark.slow
def test_split_master_checkpoints_store_the_fp32_master(tmp_path, host_runs):
    # a checkpoint saved with the option stores the fp32 master: that of the same run with the
    # whole master in host memory (within four ulps); it resumes without the option (and back) and
    # trains on as that run does
    resumes_both_ways(tmp_path, host_runs(2), lambda option: host_engine(option, 2), batches(4)[2:])


def in_place_engine(split, par):
    # the in_place loop (offload_param's): "on" splits its host chunks, "off" keeps them fp32
    opts = zerojax.EngineOptions(offload_loop="in_place", split_master=HOST[split])
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)  # noqa: E731
    return zerojax.shard(make, config(3, "bf16", "cpu", par), loss_fn=gpt2.gpt2_loss, options=opts)


@pytest.mark.parametrize("par", ["none", "cpu"], ids=["optimizer", "param_and_optimizer"])
@pytest.mark.slow
def test_in_place_split_trains_as_the_fp32_master_and_checkpoints_it(par, tmp_path_factory, tmp_path, monkeypatch):
    # split_master="on" with the in_place loop (ZeRO-3, optimizer offload; with offload_param the
    # compute params it rebuilds from are host-resident): each host group's fp32 master rebuilt on
    # the device from its compute copy and remainder, updated, split again. Against the same steps
    # with the whole fp32 master: the same losses and compute params, the master within four ulps;
    # the host chunks hold int16 remainders; a checkpoint stores the fp32 master and resumes both ways
    from zerojax.offload import split_master, stored

    # a checkpoint rebuilds the embeddings' fp32 rows a block at a time: blocks of 4 KiB here; the
    # init and a restore split the master a batch of leaves at a time: one leaf a batch here
    monkeypatch.setattr(stored, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(split_master, "CONSUME_BYTES", 1)
    runs = Runs(lambda split: in_place_engine(split, par), batches(4), tmp_path_factory.mktemp("in_place_split"))
    settings = runs.split.layout.offload_settings
    assert settings["loop"] == "in_place" and settings["split_master"] is True
    assert stored.rows_per_block(runs.split.state.params["wte"]) < runs.split.state.params["wte"].shape[0]
    trains_as_the_whole_master(runs)
    resumes_both_ways(tmp_path, runs, lambda option: in_place_engine(option, par), batches(4)[2:])


def test_split_master_is_the_default_where_it_applies():
    # split_master="auto" (the default): the host split with bf16 and "host" (the host chunks int16),
    # off with fp32 compute or the in-place loop (the fp32 master), neither an error
    make = lambda dtype: lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=dtype)  # noqa: E731
    for prec, dtype, loop, want in (("bf16", jnp.bfloat16, "host", True), ("fp32", jnp.float32, "host", False),
                                    ("bf16", jnp.bfloat16, "in_place", False)):
        eng = zerojax.shard(make(dtype), config(2, prec, "cpu"), loss_fn=gpt2.gpt2_loss,
                            options=zerojax.EngineOptions(offload_loop=loop))
        assert eng.layout.offload_settings["split_master"] is want
        hosts = [i for i, c in enumerate(eng.layout.offload.layout.chunks) if c.host]
        dtypes = {x.dtype for i in hosts for x in jax.tree.leaves(eng.state.master[i])}
        assert dtypes == ({jnp.dtype(jnp.int16)} if want else {jnp.dtype(jnp.float32)})


# ------------------------------------------------------------------ split_master="on" without offload
# the device-resident master (no optimizer offload) kept the same way: against the same training
# with the whole fp32 master on the device


def scaled_loss(model, batch):
    """GPT-2's loss times the batch's "scale" (NaN there: a non-finite loss, a skipped step)."""
    loss, aux = gpt2.gpt2_loss(model, {"input_ids": batch["input_ids"]})
    return loss * batch["scale"].mean(), aux


def device_batches(n, accum=1, nan_at=()):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, C.vocab_size, (8 * accum, 8)).astype(np.int32),
             "scale": np.full((8 * accum,), np.nan if i in nan_at else 1.0, np.float32)} for i in range(n)]


ACCUM = 2  # the stage-2 engine's accumulation steps (the checkpoint tests' and the memory guard's too)
DEVICE_NAN_AT = (1,)  # the stage-2 runs' non-finite step (device_runs): skipped before the checkpoint after step 2


def device_engine(option, stage=2, accum=ACCUM):
    cfg = {**config(stage, "bf16"), "gradient_accumulation_steps": accum}
    return zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), cfg,
                         loss_fn=scaled_loss, options=zerojax.EngineOptions(split_master=DEVICE[option]))


def train_on_device(split, stage=2, steps=3, accum=1, nan_at=()):
    eng = device_engine(split, stage, accum)
    losses = []
    for b in device_batches(steps, accum, nan_at):
        losses.append(float(eng.train_step(b)["loss"]))
        if np.isnan(losses[-1]):
            with pytest.raises(FloatingPointError, match="not finite"):
                eng.synchronize()
    return eng, losses


# Stage 1 keeps the master and optimizer state as stage 2 does (sharded over "data"; the stages differ
# in the gradient's sharding, which the split does not touch): its case, with 2 accumulation steps,
# is stage 2's, with the non-finite step; stage 1 itself runs under the pipeline axis below (accumulation 4)
@pytest.mark.parametrize("stage,accum,nan_at", [(0, 1, ()), (2, ACCUM, DEVICE_NAN_AT), (3, 1, ())])
@pytest.mark.slow
def test_device_master_split_trains_as_the_fp32_master(stage, accum, nan_at, request):
    # the same losses and compute params (bitwise), the master within four ulps; a non-finite step
    # (stage 2's second, both of its micro-batches) skipped by both, the remainders kept as the master is.
    # Stage 2's pair of runs is device_runs' (4 steps), which the checkpoint tests below read too
    if stage == 2:
        runs = request.getfixturevalue("device_runs")
        (split, losses), (whole, want) = (runs.split, runs.losses[True]), (runs.whole, runs.losses[False])
    else:
        split, losses = train_on_device(True, stage, accum=accum, nan_at=nan_at)
        whole, want = train_on_device(False, stage, accum=accum, nan_at=nan_at)
    assert sum(np.isnan(losses)) == len(nan_at)
    np.testing.assert_array_equal(losses, want)
    assert split.skipped_steps == whole.skipped_steps == len(nan_at)
    for x, y in zip(jax.tree.leaves(split.state.params), jax.tree.leaves(whole.state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    for x, y in zip(jax.tree.leaves(split.master_params), jax.tree.leaves(whole.master_params), strict=True):
        assert x.dtype == jnp.float32 and x.sharding == y.sharding
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=ULP4, atol=UPDATES)
    # the state holds int16 remainders in the master's sharding: half the fp32 master's bytes
    assert {x.dtype for x in jax.tree.leaves(split.state.master)} == {jnp.dtype(jnp.int16)}
    for x, y in zip(jax.tree.leaves(split.state.master), jax.tree.leaves(whole.state.master), strict=True):
        assert x.sharding == y.sharding
    assert 2 * split.memory_report()["master"] == whole.memory_report()["master"]
    assert "master (int16 remainder)" in str(split.memory_report()) and "fp32 master" in str(whole.memory_report())


@pytest.mark.parametrize("built", [False, True])
@pytest.mark.slow
def test_device_master_split_initial_state_is_the_split_of_the_fp32_one(built):
    """The split master's initial state (allocated longest-lived first, its fp32 master last:
    init_state.initial_state) is the default initial state split: the same compute params, rest
    and optimizer state, and as remainders exactly `step.stored_master` of the fp32 master; from a
    model callable and from a built model's values."""
    from zerojax.engine import step

    def engine(split):
        make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)  # noqa: E731
        return zerojax.shard(make() if built else make, config(2, "bf16"), loss_fn=gpt2.gpt2_loss,
                             options=zerojax.EngineOptions(split_master=DEVICE[split]))

    split, whole = engine(True), engine(False)
    # the split writes into the donated params / remainder buffers (no second copy of either at
    # init: measured on an H200, jit's default of dropping unused arguments cost 2.9 GiB and a
    # fragmented pool): every output aliases an input
    from zerojax.engine.init_state import split_into_program

    args = (whole.state.master, split.state.params, split.state.master)
    hlo = split_into_program(split.layout).lower(*args).compile().as_text()
    aliased = [line for line in hlo.splitlines() if "input_output_alias=" in line]
    assert aliased and len(re.findall(r"(may|must)-alias", aliased[0])) == len(jax.tree.leaves(args[1:]))
    want = step.stored_master(split.layout.step, whole.state.master)
    for got, ref in ((split.state.params, whole.state.params), (split.state.master, want),
                     (split.state.opt_state, whole.state.opt_state), (split.state.rest, whole.state.rest)):
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            assert x.dtype == y.dtype and x.sharding == y.sharding
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def device_runs(tmp_path_factory):
    """The device split on and off (stage 2, ACCUM micro-batches) on 4 batches, the second of them
    non-finite (DEVICE_NAN_AT: a skipped step), the split run saved after step 2: the stage-2 case
    of test_device_master_split_trains_as_the_fp32_master and the checkpoint the two tests below load
    (one pair of engines trained once for the three)."""
    return Runs(device_engine, device_batches(4, ACCUM, DEVICE_NAN_AT), tmp_path_factory.mktemp("device_split"))


@pytest.mark.slow
def test_device_master_split_checkpoints_store_the_fp32_master(tmp_path, device_runs):
    # saved after a skipped step: the resumed engines train on as the uninterrupted run did
    resumes_both_ways(tmp_path, device_runs, device_engine, device_batches(4, ACCUM, DEVICE_NAN_AT)[2:])


@pytest.mark.slow
def test_device_master_split_restore_frees_its_fp32_read_before_repacking(device_runs, monkeypatch):
    """Where the allocator reports free memory (a GPU; here a stand-in), load_checkpoint repacks the
    restored state (checkpoint.engine_io._repacked); the fp32 master it read and split must be freed before that,
    or it stays where it was read while the state is packed around it (on an H200 capped at 16 GiB
    it split the free memory and the next step ran out of it). At the repack no new
    fp32 array lives beside the state; the state equals a plain load's."""
    from zerojax.checkpoint import engine_io as engine_mod
    from zerojax.planning import memory

    saved = device_runs.saved  # a split run's checkpoint after 2 steps
    plain = device_engine(True)
    plain.load_checkpoint(saved)
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: 1 << 50)
    eng = device_engine(True)
    before, beside, real = {id(x) for x in jax.live_arrays()}, [], engine_mod._repacked

    def repacked(state, superseded=()):
        out = real(state, superseded)
        ids = {id(x) for x in jax.tree.leaves(out)}
        beside.extend(x.shape for x in jax.live_arrays()
                      if id(x) not in ids | before and x.dtype == jnp.float32 and x.ndim)
        return out

    monkeypatch.setattr(engine_mod, "_repacked", repacked)
    eng.load_checkpoint(saved)
    assert beside == []
    raw = lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)  # noqa: E731
    for x, y in zip(jax.tree.leaves(eng.state), jax.tree.leaves(plain.state), strict=True):
        np.testing.assert_array_equal(raw(x), raw(y))


def test_split_master_on_is_an_error_where_it_cannot_apply():
    # "on" splits wherever it applies (bf16: on the device without offload, in host memory where
    # the optimizer is offloaded to cpu); where neither does, one message names the field, the
    # config and the fix
    opts = zerojax.EngineOptions(split_master="on")
    make = lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0))  # noqa: E731
    needs = (r"split_master='on' needs bf16 compute with no offload or with the optimizer offloaded to cpu "
             r"\(this config: ")
    with pytest.raises(ValueError, match=needs + r"fp32, offload none, optimizer not in cpu memory\).*"
                                              r"split_master='auto'"):
        zerojax.shard(make, config(2, "fp32"), loss_fn=gpt2.gpt2_loss, options=opts)
    with pytest.raises(ValueError, match=needs + r"fp32, offload host, optimizer in cpu memory\)"):
        zerojax.shard(make, config(2, "fp32", "cpu"), loss_fn=gpt2.gpt2_loss, options=opts)
    with pytest.raises(ValueError, match=needs + r"bf16, offload in_place, optimizer not in cpu memory\)"):
        zerojax.shard(make, config(3, "bf16", par="cpu"), loss_fn=gpt2.gpt2_loss, options=opts)  # params alone
    with pytest.raises(ValueError, match=r"split_master='yes': use one of \('auto', 'on', 'off'\)"):
        zerojax.EngineOptions(split_master="yes")


@pytest.mark.parametrize("axis", [{"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 2}},
                                  {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 4,
                                   "zero_optimization": {"stage": 1}}])
@pytest.mark.slow
def test_device_master_split_with_tensor_and_pipeline_axes(axis):
    # the remainders live in the master's sharding on a tensor / pipe axis too: the same losses
    # and, within four ulps, the same master as the whole fp32 master there
    def run(split):
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "bf16": {"enabled": True}, **axis}
        eng = zerojax.shard(lambda: gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jnp.bfloat16), cfg,
                            loss_fn=gpt2.gpt2_loss, options=zerojax.EngineOptions(split_master=DEVICE[split]))
        rng = np.random.default_rng(0)
        rows = eng.cfg.train_batch_size
        losses = [float(eng.train_step({"input_ids": rng.integers(0, C.vocab_size,
                                                                  (rows, 8)).astype(np.int32)})["loss"])
                  for _ in range(3)]
        return eng, losses

    (split, losses), (whole, want) = run(True), run(False)
    assert losses == want
    assert {x.dtype for x in jax.tree.leaves(split.state.master)} == {jnp.dtype(jnp.int16)}
    for x, y in zip(jax.tree.leaves(split.master_params), jax.tree.leaves(whole.master_params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=ULP4, atol=UPDATES)


@pytest.mark.slow
def test_too_little_memory_names_master_split_and_what_it_saves(monkeypatch):
    # the memory guard's error (a stand-in budget below the step's peak), bf16 without offload:
    # it names EngineOptions(split_master='on') and half the master's bytes on the device (what
    # the option saves, as the memory report counts them); with the option on it is not offered
    from zerojax.planning import memory

    monkeypatch.setattr(memory, "device_budget", lambda device=None: 1)
    for split in (False, True):
        eng = device_engine(split)
        master = eng.memory_report()["master"]
        with pytest.raises(memory.WillNotFitError) as info:
            eng.train_step(device_batches(1, ACCUM)[0])
        offered = f"split_master='on') keeps the fp32 master ({memory.fmt_bytes(master)} on this device)"
        assert (offered in str(info.value)) is not split
        if not split:
            assert f"{memory.fmt_bytes(master // 2)} less" in str(info.value)


def test_in_place_split_converts_a_layer_group_at_a_time():
    # the in_place loop keeps every host layer in one chunk (32 GB of fp32 master at 8B): building
    # the split, saving it and exporting it convert that chunk a layer group at a time, so nothing
    # moves to the device larger than one group (before, the whole chunk went there at once)
    eng = in_place_engine(True, "cpu")
    jax.block_until_ready(eng.master_params)  # (the conversion back to fp32, as a save or an export runs it)
    off, cache = eng.layout.offload, eng.layout.step.offload.converters
    loops = [(i, c) for i, c in enumerate(off.layout.chunks) if c.host and c.loop > 1]
    assert loops, off.layout.chunks
    i, c = loops[0]
    per = (c.hi - c.lo) // c.loop
    rems = eng.state.master[i]
    for to_split in (False, True):
        # (init makes the remainders a batch of leaves at a time, one program a batch; any takes the whole chunk)
        run = next(v for k, v in cache.items() if k[:4] == (c.rest, c.hi - c.lo, c.loop, to_split))
        m = rems if not to_split else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), rems)
        out = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32 if not to_split else jnp.int16), rems)  # noqa: B023 - called within this iteration
        text = str(jax.make_jaxpr(run.loop)(m, eng.state.params, c.lo, out))
        moved = [tuple(int(d) for d in dims.split(",")) for line in text.splitlines() if "device_put[" in line
                 for dims in re.findall(r":\w+\[([\d,]+)\]", line.split("device_put[")[0])]
        assert moved and max(d[0] for d in moved) == per < c.hi - c.lo, moved
