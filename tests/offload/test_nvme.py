"""NVMe offload (ZeRO-Infinity, `device: "nvme"`) on 8 virtual CPU devices, tiny scanned GPT-2, swap
files in pytest's tmp_path.

The reference is the same engine with CPU offload (`device: "cpu"`): the NVMe tier runs the same
per-group arithmetic (`update._apply`) on the same values, written to the files and read back bit for
bit. Measured: after one step the moments are bitwise equal and the master differs by <= 1 ulp (XLA
fuses `master + update` differently around the host callbacks). Over more steps such an ulp is not a
bound: GPT-2's attention key bias has an analytically zero gradient, numerically noise, which Adam
normalises to ~lr, so any ulp in the forward moves it by ~lr (measured 3e-3 after 2 fp32 steps).
Hence one step, compared to 2 ulp. The swapper itself is tested against numpy.
"""
import contextlib
import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax.config import ConfigError
from zerojax.engine.engine import abstract_engine
from zerojax.models import gpt2
from zerojax.offload.nvme.swapper import NvmeSwapper, SwapLeaf, check_swap_path

STEPS = 1
C = gpt2.GPT2Config.named("tiny", n_embd=32, n_head=2, vocab_size=64, n_positions=16, n_layer=4)


def config(opt, par="none", *, path=None, stage=3, prec="bf16", **opt_extra):
    nv = {"nvme_path": str(path)} if path is not None else {}
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 0.1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": opt, **(nv if opt == "nvme" else {}), **opt_extra},
                              "offload_param": {"device": par, **(nv if par == "nvme" else {})}},
        "bf16": {"enabled": prec == "bf16"},
    }


def batches(n=STEPS):
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, C.vocab_size, (8, 8)).astype(np.int32)} for _ in range(n)]


def make():
    return gpt2.GPT2(C, rngs=nnx.Rngs(0), dtype=jax.numpy.bfloat16)


def engine(cfg, steps=STEPS):
    eng = zerojax.shard(make, cfg, loss_fn=gpt2.gpt2_loss)
    for b in batches(steps):
        eng.train_step(b)
    eng.synchronize()
    return eng


def master(eng):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), eng.master_params)



def stored(eng):
    """The layout-free (checkpoint) form of master and optimizer state, numpy."""
    st = eng.layout.to_stored(eng.state)
    return [np.asarray(x, np.float32) for x in jax.tree.leaves((st.master, st.opt_state))]


def read_swap_files(tier):
    """Each swap file read with plain numpy: its groups (at block-padded strides) joined on the layers axis
    (the disk groups: the split's host groups come first and are not in the files)."""
    tier.swapper.flush()
    out = []
    for i, (leaf, stride) in enumerate(zip(tier.swap_leaves(), tier.swapper.strides, strict=True)):
        raw = np.fromfile(os.path.join(tier.swapper.dir, f"leaf{i}.swap"), dtype=np.uint8)
        out.append(np.concatenate([raw[g * stride:g * stride + leaf.group_bytes].view(leaf.dtype).reshape(
            leaf.group_shape) for g in range(tier.swapper.disk_groups)]))
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """fp32, after STEPS: (CPU offload of params + optimizer, NVMe offload of both; CPU offload of the
    optimizer alone, NVMe of it alone with the read / write pipeline on)."""
    path = tmp_path_factory.mktemp("nvme")
    return (engine(config("cpu", "cpu", prec="fp32")), engine(config("nvme", "nvme", path=path, prec="fp32")),
            engine(config("cpu", "none", prec="fp32")),
            engine(config("nvme", "none", path=path, prec="fp32", pipeline_read=True, pipeline_write=True)))


# the master after one step: w - lr (u + wd w) from the same values in a differently fused program.
# Each rounding is at most an ulp of its own term, and the code generator may contract a multiply
# and an add into one rounding in one program and not in the other (tests/conftest.py): 4 ulp of
# |w| (rtol 2**-21) plus 2 ulp of the update term, |lr u| <= lr = 1e-2 at step 1 (Adam's |u| = 1),
# ulp(1e-2) = 2**-30: atol 2**-29. Measured: 3.7e-9 at |w| = 7.7e-3 (the bound there: 5.5e-9)
RTOL, ATOL = 2.0**-21, 2.0**-29


def assert_close(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("which", [1, 3], ids=["param_and_optimizer", "optimizer_only"])
@pytest.mark.slow
def test_nvme_trains_like_cpu_offload(engines, which):
    cpu, eng = engines[which - 1], engines[which]
    assert_close(master(eng), master(cpu))
    a, b = stored(eng), stored(cpu)  # master + moments + counts
    assert len(a) == len(b) > 10
    n_master = len(jax.tree.leaves(master(cpu)))
    assert_close(a[:n_master], b[:n_master])
    for x, y in zip(a[n_master:], b[n_master:], strict=True):  # the moments: the same arithmetic on the same values
        np.testing.assert_array_equal(x, y)


HOST_LAYERS = 2   # of C.n_layer = 4: the split keeps layers 0-1's state in host memory, 2-3 in the files


@pytest.fixture(scope="module")
def split_engine(tmp_path_factory):
    """NVMe offload of the optimizer with a host / disk split, after STEPS (compare: engines[2:4])."""
    return engine(config("nvme", "none", path=tmp_path_factory.mktemp("split"), prec="fp32",
                         pipeline_read=True, host_layers=HOST_LAYERS))


@pytest.mark.slow
def test_host_disk_split_trains_like_cpu_and_nvme_offload(engines, split_engine, tmp_path):
    # the split keeps the host groups in the swapper's memory and runs every group through the same
    # loop and callbacks as all-NVMe: bitwise like it, like CPU offload to the ulps of the module's
    # docstring; and the files hold exactly the disk layers
    cpu, nvme, split = engines[2], engines[3], split_engine
    tier = split.layout.nvme
    h = HOST_LAYERS
    assert tier.host_layers == h and tier.swapper.disk_groups == C.n_layer - h
    ms = master(split)
    for x, y in zip(jax.tree.leaves(ms), jax.tree.leaves(master(nvme)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert_close(ms, master(cpu))
    for x, y in zip(stored(split), stored(nvme), strict=True):   # master, moments, counters
        np.testing.assert_array_equal(x, y)
    files = read_swap_files(tier)
    for got, want in zip(files, jax.tree.leaves(ms["h"]),
                         strict=False):  # the master leaves come first, then the moments
        np.testing.assert_array_equal(got, want[h:])
    assert [os.path.getsize(os.path.join(tier.swapper.dir, f"leaf{i}.swap")) for i in range(len(files))] == [
        s * (C.n_layer - h) for s in tier.swapper.strides]
    # a checkpoint reads the host and disk groups into the layout-free form and puts them back
    want = stored(split)
    split.save_checkpoint(tmp_path / "split")
    split.load_checkpoint(tmp_path / "split")
    for x, y in zip(stored(split), want, strict=True):
        np.testing.assert_array_equal(x, y)
    report = split.layout.offload_settings
    assert report["nvme_host_layers"] == h
    half = nvme.layout.offload_settings["nvme_disk_bytes"] // 2
    assert report["nvme_disk_bytes"] == report["nvme_host_bytes"] == half


@pytest.mark.slow
def test_state_lives_in_the_files(engines):
    eng = engines[1]
    tier = eng.layout.nvme
    is_none = lambda x: x is None  # noqa: E731
    # the engine keeps None for the layers' master and moments; only the counters stay
    assert all(x is None for x in jax.tree.leaves(eng.state.master[tier.chunk], is_leaf=is_none))
    kept = [x for x in jax.tree.leaves(eng.state.opt_state[tier.chunk]) if x is not None]
    assert kept and all(x.ndim == 0 for x in kept)
    # the files, read with plain numpy, hold the stored form's layer leaves
    files = sorted(os.listdir(tier.swapper.dir))
    leaves = tier.swap_leaves()
    assert files == sorted(f"leaf{i}.swap" for i in range(len(leaves)))
    layers = [np.asarray(x, np.float32) for x in jax.tree.leaves(eng.master_params["h"])]
    for got, want in zip(read_swap_files(tier)[:len(tier.m_files)], layers, strict=True):
        np.testing.assert_array_equal(got, want)
    report = eng.layout.offload_settings
    assert report["nvme_disk_bytes"] == sum(x.group_bytes for x in leaves) * tier._c.loop


@pytest.mark.slow
def test_resume_across_nvme_and_cpu(engines, tmp_path):
    # a checkpoint is layout-free: NVMe saves what CPU offload would (and what a run without offload
    # loads: the codec test_engine_offload checks); each engine loads the other's, bitwise
    cpu, eng = engines[:2]
    want_cpu, want_nvme = stored(cpu), stored(eng)
    cpu.save_checkpoint(tmp_path / "cpu")
    eng.save_checkpoint(tmp_path / "nvme")
    assert not any("swap" in f for _, _, fs in os.walk(tmp_path) for f in fs)  # scratch is no checkpoint
    cpu.load_checkpoint(tmp_path / "nvme")
    eng.load_checkpoint(tmp_path / "cpu")
    for x, y in zip(stored(cpu), want_nvme, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(stored(eng), want_cpu, strict=True):
        np.testing.assert_array_equal(x, y)
    # and it trains on from there as CPU offload does from the same state
    batch = batches(1)[0]
    eng.train_step(batch)
    cpu.load_checkpoint(tmp_path / "cpu")
    cpu.train_step(batch)
    assert_close(master(eng), master(cpu))


@pytest.mark.slow
def test_close_removes_the_swap_files(engines):
    eng = engines[3]
    root = eng.layout.nvme.swapper.root
    assert os.path.isdir(root)
    eng.close()
    assert not os.path.exists(root)
    with pytest.raises(RuntimeError, match="removed by engine.close"):
        eng.layout.nvme.open()


# --------------------------------------------------------------------------- the swapper alone


def leaves_of(n_groups, per=2, width=1000):
    rng = np.random.default_rng(1)
    specs = [SwapLeaf("a", (per, width), np.dtype(np.float32)), SwapLeaf("b", (per, 3, 7), np.dtype(np.float32))]
    whole = [rng.standard_normal((n_groups * per,) + s.group_shape[1:]).astype(np.float32) for s in specs]
    return specs, whole


@pytest.mark.parametrize("pipelined,host_groups", [(False, 0), (True, 2)])
def test_swapper_round_trip(tmp_path, pipelined, host_groups):
    # numpy is the reference: a step of "read g, add g, write g" over every group, twice (the split:
    # the first host_groups groups in memory, the rest in the files)
    specs, whole = leaves_of(5)
    sw = NvmeSwapper(str(tmp_path), specs, 5, buffer_count=2, block_size=4096, threads=3,
                     pipeline_read=pipelined, pipeline_write=pipelined, host_groups=host_groups)
    sw.write_all(whole)
    for _ in range(2):
        for g in range(5):
            sw.write(g, *[x + g for x in sw.read(g)])
    g_of_row = np.repeat(np.arange(5, dtype=np.float32), 2).reshape((-1,) + (1,) * (whole[0].ndim - 1))
    want = [(x + g_of_row.reshape((-1,) + (1,) * (x.ndim - 1))) + g_of_row.reshape((-1,) + (1,) * (x.ndim - 1))
            for x in whole]
    for got, w in zip(sw.read_all(), want, strict=True):
        np.testing.assert_array_equal(got, w)
    assert len(sw.pass_s) == 2 and min(sw.pass_s) > 0   # one I/O window per pass over the groups
    assert sw.disk_bytes == (5 - host_groups) * sum(-(-s.group_bytes // 4096) * 4096 for s in specs)
    assert [os.path.getsize(os.path.join(sw.dir, f"leaf{i}.swap")) for i in range(2)] == [
        (5 - host_groups) * -(-s.group_bytes // 4096) * 4096 for s in specs]
    sw.close()
    assert os.listdir(tmp_path) == []


@contextlib.contextmanager
def rss_growth():
    """Yields a list that, on exit, holds the process's peak resident memory growth over the block
    (sampled every 2 ms on a thread; psutil)."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    peak, stop = [proc.memory_info().rss], threading.Event()
    base, out = peak[0], []

    def sample():
        while not stop.is_set():
            peak.append(proc.memory_info().rss)
            stop.wait(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out.append(max(peak) - base)


def test_swapper_host_memory_is_bounded_by_its_buffers(tmp_path):
    # 24 groups of 8 MiB (192 MiB on disk) streamed read -> update -> write with the pipeline on: the
    # process's resident memory may grow by the groups in flight -- buffer_count (one read ahead, the
    # rest being written) plus the caller's two (the group it updates and its result) -- and a slack
    # of one freed group per malloc arena (the 4 I/O threads' and the main thread's) + 16 MiB: glibc
    # raises its mmap threshold (to 32 MiB) after the first free of a block, so later 8 MiB blocks
    # come from per-thread arenas that keep freed memory a while (measured on the shared 2-core box:
    # 63.5 to 88 MiB growth against 40 MiB in flight; the former slack of 3 groups failed 1 run in 3);
    # never by the 192 MiB of state
    group = 8 << 20
    spec = [SwapLeaf("x", (group // 4,), np.dtype(np.float32))]
    n = 24
    sw = NvmeSwapper(str(tmp_path), spec, n, buffer_count=3, threads=4)
    for g in range(n):
        sw.write(g, np.full(group // 4, g, np.float32))
    sw.flush()
    with rss_growth() as growth:
        for _ in range(2):
            for g in range(n):
                x = sw.read(g)[0]
                sw.write(g, x + 1)
                del x
        sw.flush()
    budget = (3 + 2 + 4 + 1) * group + (16 << 20)
    assert budget < n * group
    assert growth[0] <= budget, (growth[0], budget)
    assert sw.bytes_read >= 2 * n * group and sw.bytes_written >= 3 * n * group
    np.testing.assert_array_equal(sw.read(7)[0][:4], np.full(4, 9, np.float32))
    sw.close()


@pytest.mark.slow
def test_init_writes_the_files_without_the_state_in_host_memory(tmp_path, monkeypatch):
    # NVMe init never holds the swapped layers' state: at every write to the files, the arrays alive
    # (jax.live_arrays: device and host, every memory kind) are the bf16 compute params, the non-layer
    # leaves' master + moments (host memory, as CPU offload), and one call's outputs: the groups of one
    # leaf and their moments, at most init_group_bytes; the numpy side (tracemalloc) holds the write
    # buffers: buffer_count groups. Not the 12 B/param of the layers' master + moments (what the former
    # init built in pinned host memory and copied out: 12 + 12 B/param). Exact byte accounting, not RSS:
    # on CPU the "device" is host memory too, so RSS also counts XLA's random-bit temporaries, its
    # compilations and the allocator's slack (measured: 170 to 460 MiB of growth for this model, in
    # either init), which on a GPU live in device memory or not at all
    import tracemalloc
    big = gpt2.GPT2Config.named("tiny", n_embd=256, n_head=2, vocab_size=64, n_positions=32, n_layer=8)
    make_big = lambda: gpt2.GPT2(big, rngs=nnx.Rngs(0), dtype=jax.numpy.bfloat16)  # noqa: E731
    params = jax.eval_shape(lambda: nnx.state(make_big(), nnx.Param))
    size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))  # noqa: E731
    total, layers = size(params), size(params["h"])
    limit = 4 * layers // 8    # init_group_bytes: an eighth of the layers' fp32 weights
    # one call's outputs twice: device_get's per-device views of the group it copies out are listed as
    # arrays of their own (the same buffers); 1 MiB: the counters, rng keys
    budget_jax = 2 * total + 12 * (total - layers) + 2 * limit + (1 << 20)
    budget_np = 4 * (12 * layers // big.n_layer) + (1 << 20)           # buffer_count = 4 groups of one layer
    import zerojax.offload.nvme.swapper as nvme_mod
    seen, write = [], nvme_mod.NvmeSwapper.write_leaves

    def watched(self, g, leaves, arrays):
        write(self, g, leaves, arrays)
        seen.append((sum(x.nbytes for x in jax.live_arrays()) - base, tracemalloc.get_traced_memory()[1]))

    monkeypatch.setattr(nvme_mod.NvmeSwapper, "write_leaves", watched)
    base = sum(x.nbytes for x in jax.live_arrays())
    tracemalloc.start()
    try:
        eng = zerojax.shard(make_big, config("nvme", "none", path=tmp_path, prec="bf16"), loss_fn=gpt2.gpt2_loss,
                            options=zerojax.EngineOptions(init_group_bytes=limit))
    finally:
        tracemalloc.stop()
    tier = eng.layout.nvme
    assert tier.disk_bytes() == 12 * layers > 3 * budget_jax
    assert len(seen) >= big.n_layer * len(tier.m_files)   # every group of every leaf went through the writer
    assert max(j for j, _ in seen) <= budget_jax, (max(j for j, _ in seen), budget_jax)
    assert max(n for _, n in seen) <= budget_np, (max(n for _, n in seen), budget_np)
    # the files hold the model's initial master (its initialiser run whole) and Adam's zero moments;
    # the groups' programs draw the same normal values, each with code of its own, which may round
    # their arithmetic an ulp differently (tests/conftest.py): 4 eps relative
    from zerojax.engine.init_state import init_pure
    want = jax.tree.leaves(jax.jit(lambda: init_pure(make_big)[0]["h"])())
    got = read_swap_files(tier)
    for x, y in zip(got[:len(want)], want, strict=True):  # the master's files; the moments' below
        np.testing.assert_allclose(x, np.asarray(y), rtol=4 * np.finfo(np.float32).eps, atol=0)
    assert len(got) == 3 * len(want) and all(not x.any() for x in got[len(want):])
    eng.close()


def test_swap_path_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist; create it"):
        check_swap_path(str(tmp_path / "missing"), 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        check_swap_path(str(tmp_path / "file"), 1)
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"need [\d,]+ bytes .* has [\d,]+ bytes .* free") as e:
        check_swap_path(str(tmp_path), free * 4)
    assert "nvme_path" in str(e.value)
    if os.path.isdir("/dev/shm") and __import__("zerojax.offload.nvme.swapper",
                                                fromlist=["x"])._filesystem_type("/dev/shm") == "tmpfs":
        with pytest.raises(ValueError, match="RAM disk"):
            check_swap_path("/dev/shm", 1)
    # read-only: as root every path is writable, so the check's probe is replaced
    import zerojax.offload.nvme.swapper as nvme_mod
    monkeypatch.setattr(nvme_mod.os, "access", lambda p, mode: False)
    with pytest.raises(ValueError, match="not writable"):
        check_swap_path(str(tmp_path), 1)


# --------------------------------------------------------------------------- config


def test_nvme_config_keys_and_refusals():
    from zerojax import load_config
    ok = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pipeline_read": True}},
        "aio": {"thread_count": 4, "queue_depth": 16}}, world_size=1)
    aio = ok.aio
    # DeepSpeed 0.19.8 runtime/swap_tensor/constants.py defaults, thread_count the old name
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism, aio.single_submit, aio.overlap_events,
            aio.use_gds) == (1048576, 16, 4, False, True, False)
    assert ok.zero_optimization.offload_optimizer.buffer_count == 4  # DeepSpeed's default
    with pytest.warns(UserWarning, match="aio.blok_size: unknown key"):
        load_config({"train_batch_size": 8, "aio": {"blok_size": 4}}, world_size=1)
    cases = [
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "needs ZeRO stage 3"),
        ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "needs zero_optimization.offload_optimizer.nvme_path"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "needs zero_optimization.offload_param.nvme_path"),
        ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 1}},
         "at least 2 buffers"),
        ({"stage": 3, "offload_optimizer": {"device": "cpu", "host_layers": 2}},
         "host_layers = 2 with device = \"cpu\""),
    ]
    for zero, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            load_config({"train_batch_size": 8, "zero_optimization": zero}, world_size=1)


def test_host_layers_refusals(tmp_path):
    # (one layer a group: any host_layers below the layer count is a whole number of groups)
    def build(host_layers):
        cfg = config("nvme", path=tmp_path, host_layers=host_layers)
        return abstract_engine(make, cfg, loss_fn=gpt2.gpt2_loss)
    assert build(2).layout.nvme.host_groups == 2 and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="host_layers = 4 keeps all 4 offloaded layers .* at most 3"):
        build(4)


def test_engine_refuses_a_bad_nvme_path_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match="nvme_path = .*does not exist"):
        zerojax.shard(make, config("nvme", path=tmp_path / "missing"), loss_fn=gpt2.gpt2_loss)


def test_offload_param_nvme_above_max_in_cpu_is_refused(tmp_path):
    cfg = config("cpu", "nvme", path=tmp_path)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 1000
    with pytest.raises(ValueError, match="more than offload_param.max_in_cpu = 1,000"):
        abstract_engine(make, cfg, loss_fn=gpt2.gpt2_loss)  # the layout refuses it: nothing is built


def test_tier_bytes_and_the_nvme_suggestion():
    from zerojax.planning.estimate import nvme_suggestion, tier_bytes
    # the ZeRO paper's per-device accounting by hand (Ψ params, one device, stage 3, param offload):
    # host 2Ψ params + 12Ψ master and moments; NVMe moves the layers' 12Ψf of it to disk and keeps
    # buffer_count of the L layer groups in host memory
    psi, f, L = 7_060_000_000, 0.97, 32
    cpu = tier_bytes(psi, 3, 1, offload_optimizer=True, offload_param=True)
    nv = tier_bytes(psi, 3, 1, offload_param=True, nvme=True, layer_fraction=f, n_layers=L, buffer_count=4)
    assert cpu == {"device": 2 * psi, "host": 14 * psi, "disk": 0}
    assert nv["device"] == 2 * psi and nv["disk"] == int(12 * psi * f)
    assert abs(nv["host"] - (2 * psi + 12 * psi * (1 - f) + 4 * 12 * psi * f / L)) < 16
    # the split: the first h of L layers' 12Ψf/L each stay in host memory, the rest on disk
    h = 20
    sp = tier_bytes(psi, 3, 1, offload_param=True, nvme=True, layer_fraction=f, n_layers=L, buffer_count=4,
                    host_layers=h)
    assert abs(sp["disk"] - 12 * psi * f * (L - h) / L) < 16
    assert abs(sp["host"] - (2 * psi + 12 * psi * (1 - f) + (h + 4) * 12 * psi * f / L)) < 16
    assert '"device": "nvme"' in nvme_suggestion(cpu["host"], 80 * 2**30, disk_bytes=nv["disk"])
    assert nvme_suggestion(cpu["host"], 200 * 2**30, disk_bytes=nv["disk"]) is None
    assert "disk too" in nvme_suggestion(cpu["host"], 80 * 2**30, disk_bytes=nv["disk"], disk_free=60 * 2**30)
    # the 7.06B case on the 1-GPU machine: 98.8 GB of host state with CPU offload, 92 GiB free, a 60 GiB disk.
    # By hand: a layer's state is 12Ψf/L = 2.57 GB; d layers on disk save (d - 4) layers of host memory
    # (the swapper's 4 in flight), so d = 4 + ceil((98.84e9 - 92 x 2**30) / 2.57e9) = 4 + 1 = 5 disk layers
    # (12.8 GB), host_layers 27
    tip = nvme_suggestion(cpu["host"], 92 * 2**30, disk_bytes=nv["disk"], disk_free=60 * 2**30, n_layers=L)
    assert '"host_layers": 27' in tip and "swaps 5" in tip
    assert "disk too" in nvme_suggestion(cpu["host"], 20 * 2**30, disk_bytes=nv["disk"], disk_free=60 * 2**30,
                                         n_layers=L)   # 79 GB over host memory: more than the disk holds
    with pytest.raises(ValueError, match="stage=3"):
        tier_bytes(psi, 2, 1, nvme=True)
    # the planner's plan line offers NVMe when its host bytes exceed the host memory free now
    from zerojax.planning.estimate import host_free_bytes
    from zerojax.planning.planner import Plan
    big = Plan(stage=3, micro_batch=1, offload_optimizer=True, host_bytes=4 * host_free_bytes())
    assert '"device": "nvme"' in big.describe()
    assert "nvme" not in Plan(stage=3, micro_batch=1, offload_optimizer=True, host_bytes=1 << 20).describe()


def test_abstract_engine_makes_no_swap_files(tmp_path):
    # the planner builds engines of ShapeDtypeStructs: the layout has the tier, no file is made
    eng = abstract_engine(make, config("nvme", path=tmp_path), loss_fn=gpt2.gpt2_loss)
    assert eng.layout.nvme is not None and eng.layout.nvme.swapper is None
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", [True, False])
def test_swapper_direct_io_round_trip(tmp_path, direct):
    # O_DIRECT (the default where the filesystem takes it) moves whole 4 KiB blocks between aligned
    # buffers: a leaf whose group is not a whole number of blocks (3 x 100 float32 = 1200 B) goes
    # through a bounce buffer, an aligned one straight; either way the files hold exactly what the
    # buffered path writes (numpy reads them back) and reads return what was written
    specs = [SwapLeaf("odd", (3, 100), np.dtype(np.float32)), SwapLeaf("whole", (1, 2048), np.dtype(np.float32))]
    rng = np.random.default_rng(3)
    groups = [[rng.standard_normal(s.group_shape).astype(np.float32) for s in specs] for _ in range(4)]
    sw = NvmeSwapper(str(tmp_path), specs, 4, buffer_count=2, block_size=8192, threads=2, direct=direct)
    assert sw.direct <= direct   # never direct when asked not to be; buffered where the filesystem refuses
    for g, arrays in enumerate(groups):
        sw.write(g, *arrays)
    for g in (2, 0, 3, 1):
        for got, want in zip(sw._read_now(g), groups[g], strict=True):
            np.testing.assert_array_equal(got, want)
    sw.flush()
    for i, s in enumerate(specs):
        raw = np.fromfile(os.path.join(sw.dir, f"leaf{i}.swap"), dtype=np.uint8)
        stride = sw.strides[i]
        assert stride % 4096 == 0 and stride % 8192 == 0
        for g in range(4):
            np.testing.assert_array_equal(raw[g * stride:g * stride + s.group_bytes].view(np.float32).reshape(
                s.group_shape), groups[g][i])
    sw.close()
