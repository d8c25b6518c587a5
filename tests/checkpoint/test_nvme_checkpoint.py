"""Checkpoints of an NVMe-offloaded run stream the swapped layers' state a layer group at a time
(zerojax/checkpoint/stream.py): exact byte accounting of a save and a load, and the layout-free
round trips the streamed leaves take (into the swap files, into CPU offload, into a run without
offload). The round trips NVMe <-> CPU offload after a training step are in tests/offload/test_nvme.py
(test_resume_across_nvme_and_cpu, and the host / disk split's own save and load)."""
import os
import re
import shutil
import subprocess
import sys
import tracemalloc

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.models import gpt2

pytestmark = pytest.mark.slow  # NVMe-offloaded engines of a ~76 MB state, saved and loaded

# 8 layers of d 256: the layers' master and Adam moments (12 B/param) are ~90% of the state, so a save
# or load holding them whole is far over the budgets below
BIG = gpt2.GPT2Config.named("tiny", n_embd=256, n_head=2, vocab_size=64, n_positions=32, n_layer=8)


def make():
    return gpt2.GPT2(BIG, rngs=nnx.Rngs(0), dtype=jax.numpy.bfloat16)


def config(device, path=None):
    opt = {"device": device, **({"nvme_path": str(path)} if device == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "offload_optimizer": opt} if device != "none" else {"stage": 3},
            "bf16": {"enabled": True}}


def random_files(tier, seed):
    """Fill the swap files with random values (the layers' master and moments as after some steps; one
    -0.0 per leaf, which a round trip must keep bitwise); -> the whole leaves written."""
    rng = np.random.default_rng(seed)
    sw = tier.open()
    whole = []
    for leaf in tier.swap_leaves():
        x = rng.standard_normal((sw.groups * leaf.group_shape[0],) + leaf.group_shape[1:]).astype(leaf.dtype)
        x.reshape(-1)[0] = -0.0
        whole.append(x)
    sw.write_all(whole)
    return whole


def file_leaf(tier, k):
    """Swap leaf k, whole, read back through the swapper a group at a time."""
    sw = tier.open()
    return np.concatenate([sw.read_leaf(g, k) for g in range(sw.groups)])


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


@pytest.fixture(scope="module")
def nvme_engine(tmp_path_factory):
    eng = zerojax.shard(make, config("nvme", tmp_path_factory.mktemp("swap")), loss_fn=gpt2.gpt2_loss)
    yield eng
    eng.close()


def test_save_and_load_hold_a_few_groups_not_the_state(tmp_path):
    # In a fresh interpreter: tracemalloc counts what every thread of the process allocates, and threads
    # other tests leave running (an engine's prefetch, orbax's and tensorstore's background loops) would
    # count against the budgets below, so beside them the test could fail in one order and pass in another.
    # There only the save and the load (and the threads they start) run; the checks are the same.
    code = ("import runpy, sys; runpy.run_path(sys.argv[1])['save_and_load_hold_a_few_groups'](sys.argv[2])")
    p = subprocess.run([sys.executable, "-c", code, os.path.abspath(__file__), str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stdout + p.stderr


def save_and_load_hold_a_few_groups(tmp):
    """The save / load byte accounting, run by the test above in its own interpreter (whose environment
    carries the suite's XLA_FLAGS: 8 CPU devices)."""
    from pathlib import Path

    tmp_path = Path(tmp)
    (tmp_path / "swap").mkdir()
    eng = zerojax.shard(make, config("nvme", tmp_path / "swap"), loss_fn=gpt2.gpt2_loss)
    try:
        _save_and_load_hold_a_few_groups(eng, tmp_path)
    finally:
        eng.close()


def _save_and_load_hold_a_few_groups(eng, tmp_path):
    # Exact byte accounting (as the streamed init's test): the numpy bytes allocated at the peak of a save
    # and of a load (tracemalloc: numpy's own allocations on every thread -- the swapper's buffers and
    # copies, orbax's host copies; not buffers tensorstore allocates itself, which the next test counts per
    # orbax read) and the bytes that went through the swapper. RSS would count XLA and the allocator too.
    tier, sw = eng.layout.nvme, eng.layout.nvme.open()
    want = random_files(tier, seed=1)
    state_bytes = sum(x.nbytes for x in want)                    # the layers' master + moments: 12 B/param
    assert state_bytes == sw.disk_groups * sw.group_bytes
    size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))  # noqa: E731
    params = size(eng.layout.abstract_master)
    leaf_group = max(leaf.group_bytes for leaf in tier.swap_leaves())
    # What may be in host memory at once, besides the swapped state: one host copy of the items orbax writes
    # or reads whole -- the bf16 compute params (2 B/param) and the non-layer leaves' master + moments
    # (12 B/param) -- and 1 MiB (metadata, counters). Of the swapped state: a save holds one group of one
    # leaf read from the swapper plus one being written by tensorstore; a load holds the group read from the
    # checkpoint, its dtype copy, and the swapper's buffer_count - 1 groups of one leaf being written.
    # Measured on CPU: save 2.8-2.9 MB, load 15.6 MB (orbax's copy of the compute params), of 76 MB of state.
    rest = 2 * params + 12 * (params - tier.disk_bytes() // 12) + (1 << 20)
    budget_save = rest + 2 * leaf_group
    budget_load = rest + (2 + sw.buffer_count - 1) * leaf_group
    assert state_bytes > 3 * budget_load          # holding the state whole could not pass

    read0 = sw.bytes_read
    tracemalloc.start()
    try:
        eng.save_checkpoint(tmp_path / "ck")
        save_peak = tracemalloc.get_traced_memory()[1]
        random_files(tier, seed=2)                # something else in the files, to be overwritten by the load
        tracemalloc.reset_peak()
        written1 = sw.bytes_written
        eng.load_checkpoint(tmp_path / "ck")
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sw.bytes_read - read0 == state_bytes, "the save reads each swapped byte once"
    assert sw.bytes_written - written1 == state_bytes, "the load writes each swapped byte once"
    assert save_peak <= budget_save, (save_peak, budget_save)
    assert load_peak <= budget_load, (load_peak, budget_load)
    # bitwise: the files hold what was saved (read with plain numpy: the swapper's own layout)
    for i, (leaf, stride, x) in enumerate(zip(tier.swap_leaves(), sw.strides, want, strict=True)):
        raw = np.fromfile(os.path.join(sw.dir, f"leaf{i}.swap"), dtype=np.uint8)
        got = np.concatenate([raw[g * stride:g * stride + leaf.group_bytes].view(leaf.dtype).reshape(
            leaf.group_shape) for g in range(sw.disk_groups)])
        same_bits(got, x)
    # the checkpoint keeps the manifest of a run without NVMe; the swapped leaves are named apart
    meta = zerojax.checkpoint.state.read_meta(tmp_path / "ck")
    streamed = meta["streamed"]
    assert len(streamed["master"]) + len(streamed["opt_state"]) == len(want)
    assert os.path.isdir(tmp_path / "ck" / "global_step0" / "streamed")


def test_streamed_checkpoint_resumes_without_offload_and_back(nvme_engine, tmp_path, monkeypatch):
    # layout-free: the streamed leaves load into a run without offload (each process reads its slices),
    # bitwise; and that run's checkpoint (orbax's arrays, no streamed item) loads back into the NVMe run's
    # files, bitwise. (CPU offload <-> NVMe after a training step: tests/offload/test_nvme.py)
    eng = nvme_engine
    want_files = random_files(eng.layout.nvme, seed=3)
    stored = lambda e: [np.asarray(x) for x in jax.tree.leaves(  # noqa: E731
        (lambda st: (st.params, st.master, st.opt_state))(e.layout.to_stored(e.state)))]
    want = stored(eng)
    eng.save_checkpoint(tmp_path / "nvme")
    other = zerojax.shard(make, config("none"), loss_fn=gpt2.gpt2_loss)
    other.load_checkpoint(tmp_path / "nvme")
    got = stored(other)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        same_bits(a, b)
    other.save_checkpoint(tmp_path / "other")
    assert "streamed" not in os.listdir(tmp_path / "other" / "global_step0")
    random_files(eng.layout.nvme, seed=4)
    tier, sw = eng.layout.nvme, eng.layout.nvme.open()
    # orbax holds each leaf as one chunk, so the load reads swapped leaves whole into host memory: one at a
    # time, not all of them. Counted: the numpy bytes each orbax read returns (tensorstore allocates them,
    # which tracemalloc does not see); at most the largest swapped leaf, where all at once is 76 MB
    from zerojax.checkpoint import state as ck
    reads, real = [], ck._checkpointer

    class Counting:
        def __init__(self):
            self.inner = real()

        def restore(self, *a, **kw):
            out = self.inner.restore(*a, **kw)
            reads.append(sum(x.nbytes for x in jax.tree.leaves(dict(out)) if isinstance(x, np.ndarray)))
            return out

    largest = max(leaf.group_bytes for leaf in tier.swap_leaves()) * sw.groups
    with monkeypatch.context() as m:
        m.setattr(ck, "_checkpointer", Counting)
        eng.load_checkpoint(tmp_path / "other")
    assert max(reads) == largest < tier.disk_bytes() // 4, (max(reads), largest)
    for k, x in enumerate(want_files):
        got = np.concatenate([tier.open().read_leaf(g, k) for g in range(tier.open().groups)])
        same_bits(got, x)


def test_export_of_a_streamed_checkpoint(nvme_engine, tmp_path):
    # `zerojax export` reads the master whole (the export is the whole model), streamed leaves included:
    # the weights equal the master the engine reads back from its files
    from safetensors.numpy import load_file
    eng = nvme_engine
    random_files(eng.layout.nvme, seed=5)
    eng.save_checkpoint(tmp_path / "ck")
    out = zerojax.checkpoint.state.export(tmp_path / "ck", tmp_path / "flat")
    flat = load_file(out)
    master = {".".join(str(getattr(k, "key", k)) for k in p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(eng.master_params)}
    assert sorted(flat) == sorted(master)
    for name, x in master.items():
        same_bits(flat[name], x)


def test_fp32_checkpoint_into_a_bf16_nvme_run(nvme_engine, tmp_path):
    # across precisions the compute params are the master cast to bf16; with the master going to the swap
    # files they are read from the checkpoint's master with the cast on reading. Reference: the fp32 run's
    # own master cast by XLA (round to nearest even both ways: bitwise)
    eng = nvme_engine
    cfg = config("none")
    cfg["bf16"] = {"enabled": False}
    fp32 = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss)
    fp32.save_checkpoint(tmp_path / "fp32")
    random_files(eng.layout.nvme, seed=6)
    eng.load_checkpoint(tmp_path / "fp32")
    want = jax.tree.map(lambda x: np.asarray(x.astype(jax.numpy.bfloat16)), fp32.state.params)
    for a, b in zip(jax.tree.leaves(eng.state.params), jax.tree.leaves(want), strict=True):
        same_bits(np.asarray(a), b)
    tier = eng.layout.nvme
    master = jax.tree.leaves(fp32.state.params)
    for k, j in enumerate(tier.m_files):
        same_bits(file_leaf(tier, k), np.asarray(master[j]))


def test_a_missing_streamed_leaf_names_it_and_another_tag(nvme_engine, tmp_path):
    eng = nvme_engine
    eng.save_checkpoint(tmp_path / "ck", tag="good")
    eng.save_checkpoint(tmp_path / "ck", tag="bad")
    meta = zerojax.checkpoint.state.read_meta(tmp_path / "ck", "bad")
    path, folder = next(iter(meta["streamed"]["master"].items()))
    shutil.rmtree(tmp_path / "ck" / "bad" / "streamed" / folder)
    with pytest.raises(zerojax.checkpoint.state.CheckpointError,  # the checksums' record lists every file
                       match=rf"bad/streamed/{folder}/\S+ is missing \(and \d+ more\); "
                             r"load another tag \(\['good'\]\)"):
        eng.load_checkpoint(tmp_path / "ck", tag="bad")
    os.remove(tmp_path / "ck" / "bad" / "checksums.json")  # a tag saved before checksums: the read names the leaf
    with pytest.raises(zerojax.checkpoint.state.CheckpointError,
                       match=rf"item .master {re.escape(path)} \(streamed/{folder}\). .*corrupt or incomplete.*'good'"):
        eng.load_checkpoint(tmp_path / "ck", tag="bad")
