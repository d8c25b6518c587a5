"""A checkpoint folder survives every mistake: a tag used as a path, a second run on the folder,
non-finite weights with --keep 1, a flipped bit, a full disk, a SIGTERM mid-run.

References: the folder's files before and after (what must stay untouched), the run trained without
the interruption (a resume after SIGTERM equals it, loss for loss), the save of a finite state.
"""
from __future__ import annotations

import collections
import errno
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax import cli
from zerojax.api import shard
from zerojax.checkpoint import files, lock
from zerojax.checkpoint import state as checkpoint
from zerojax.checkpoint.finite import NonFiniteState
from zerojax.checkpoint.space import DiskFull
from zerojax.checkpoint.tags import TagError
from zerojax.sharding.partition import make_mesh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--eval-batches", "0"]


class Spare(nnx.Module):
    """A linear layer and a parameter the loss reads times 0: its gradient is exactly 0 at every step."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.spare = nnx.Param(jnp.ones((8,)))

    def __call__(self, x):
        return self.lin(x) + 0.0 * self.spare


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def engine(eps=1e-8):
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": eps}}}
    return shard(Spare(nnx.Rngs(0)), cfg, loss_fn=mse, mesh=make_mesh(devices=jax.devices()[:1]))


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 8)).astype(np.float32)}


def listing(root) -> dict:
    """Every file under `root` with its bytes: what a refused save must leave as it was."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder holding global_step1 and global_step2 of the Spare model, and the engine."""
    d = tmp_path_factory.mktemp("saved") / "ck"
    eng = engine()
    for step in (1, 2):
        eng.train_step(batch(step))
        eng.save_checkpoint(d)
    return d, eng


def test_a_tag_is_a_name_never_a_path(saved, tmp_path):
    d, eng = saved
    victim = d.parent / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "data.txt").write_text("keep me")
    before, kept = listing(d), listing(victim)
    for tag in (".", "", "../victim", str(victim), "latest", "a/b", ".hidden"):
        with pytest.raises(TagError, match="is not a plain name: a tag is a name of letters"):
            eng.save_checkpoint(d, tag=tag)
        with pytest.raises(TagError):
            eng.load_checkpoint(d, tag=tag)
        with pytest.raises(TagError):
            checkpoint.export(d, tmp_path / "out", tag=tag)
    assert listing(d) == before and listing(victim) == kept
    assert checkpoint.list_tags(d) == ["global_step1", "global_step2"]


def test_a_flipped_bit_is_found_before_anything_is_read(saved, tmp_path):
    d, _ = saved
    ck = tmp_path / "ck"
    import shutil

    shutil.copytree(d, ck)
    opt = ck / "global_step2" / "opt_state"
    biggest = max((os.path.join(r, n) for r, _, ns in os.walk(opt) for n in ns), key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.seek(os.path.getsize(biggest) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"global_step2/opt_state/\S+ differs from its checksum "
                             r"\(corrupt on disk\); load another tag \(\['global_step1'\]\)"):
        engine().load_checkpoint(ck)
    path, _ = engine().load_checkpoint(ck, tag="global_step1")  # the previous tag still loads
    assert path.endswith("global_step1")


def test_nonfinite_weights_stop_the_run_and_are_never_checkpointed(tmp_path):
    """Adam with eps 0 on a parameter whose gradient is 0 makes it 0/0 = NaN from a finite loss and
    gradient norm (step 1): the next loss is NaN, and the run stops naming step 1, the leaf and the
    lr; the state is never saved, and --keep 1 keeps the good tag."""
    d = tmp_path / "ck"
    eng = engine(eps=0.0)
    eng.save_checkpoint(d, keep=1)
    good = listing(d / "global_step0")
    assert np.isfinite(float(eng.train_step(batch(1))["loss"]))
    eng.train_step(batch(2))
    with pytest.raises(FloatingPointError,
                       match=r"step 1: the update made the weights non-finite \(\['spare'\] "
                             r"first\) from a finite loss .* at lr=0\.01, loss scale 1, so step 2's "
                             r"loss is not finite.*eps 0"):
        eng.save_checkpoint(d, keep=1)
    with pytest.raises(NonFiniteState, match=r"step 2 not written: \.params\['spare'\] holds inf or NaN.*"
                                             r"'global_step0', untouched"):
        eng.save_checkpoint(d, keep=1)
    assert files.latest_tag(d) == "global_step0" and checkpoint.list_tags(d) == ["global_step0"]
    assert listing(d / "global_step0") == good


class Gain(nnx.Module):
    """Elementwise only: fp16 runs on CPU without matrix products (XLA's CPU has no fp16 dot)."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((8,)))

    def __call__(self, x):
        return x * self.w


def fp16_engine(loss_fn, **fp16):
    cfg = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0}, "fp16": {"enabled": True, **fp16},
           "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    return shard(Gain(), cfg, loss_fn=loss_fn, mesh=make_mesh(devices=jax.devices()[:1]))


def test_fp16_a_static_scale_that_always_overflows_is_reported(tmp_path):
    from zerojax.engine.step_checks import STATIC_SCALE_PATIENCE

    eng = fp16_engine(lambda m, b: jnp.mean((m(b["x"]) - b["y"]).astype(jnp.float32) ** 2), loss_scale=2.0 ** 40)
    with pytest.raises(FloatingPointError, match=rf"static loss scale 1\.09951e\+12 \(fp16.loss_scale\): the last "
                                                 rf"{STATIC_SCALE_PATIENCE} steps all overflowed"):
        for _ in range(STATIC_SCALE_PATIENCE + 1):
            eng.train_step(batch())
        eng.synchronize()
    assert eng.skipped_steps >= STATIC_SCALE_PATIENCE and np.all(np.asarray(eng.master_params["w"]) == 1.0)


def test_fp16_an_inf_loss_with_finite_gradients_stops_like_bf16():
    eng = fp16_engine(lambda m, b: jnp.mean((m(b["x"]) - b["y"]).astype(jnp.float32) ** 2)
                      + jax.lax.stop_gradient(jnp.float32(jnp.inf)), initial_scale_power=4)
    eng.train_step(batch())
    with pytest.raises(FloatingPointError, match=r"step 1: the loss or gradients are not finite \(loss=inf, "
                                                 r"grad_norm=[0-9.]+\) under fp16"):
        eng.synchronize()


def test_a_full_disk_is_one_line_and_the_older_tags_stay(saved, monkeypatch, tmp_path):
    d, eng = saved
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(d, ck)
    before = listing(ck)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("zerojax.checkpoint.space.shutil.disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(DiskFull, match=r"not enough disk space for checkpoint 'x1': it needs about 0\.\d\d GiB, "
                                       r"the disk has 0\.00 GiB free.*older checkpoints are intact"):
        eng.save_checkpoint(ck, tag="x1")
    assert listing(ck) == before
    monkeypatch.undo()

    class FillsUp:  # orbax's writer, with the disk filling half-way through the tag
        def save(self, path, args, force):
            os.makedirs(f"{path}.orbax-checkpoint-tmp-7/master")
            raise ValueError("tensorstore write failed") from OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_checkpointer", FillsUp)
    with pytest.raises(DiskFull, match=r"the disk filled while writing checkpoint 'x2'.*unfinished tag was removed"):
        eng.save_checkpoint(ck, tag="x2")
    assert listing(ck) == before and files.interrupted_saves(ck) == []


HOLD = ("import sys, time; from zerojax.checkpoint import lock; lock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)")


def test_a_second_run_on_a_folder_is_refused_and_a_dead_runs_lock_is_taken_over(saved, tmp_path, capsys):
    d, eng = saved
    ck = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=REPO)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ck)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # what a save in progress looks like: the second run's start-up clean-up must not touch it
        in_progress = ck / "global_step9.orbax-checkpoint-tmp-123" / "meta"
        in_progress.mkdir(parents=True)
        assert cli.main(["train", *TINY, "--steps", "1", "--save", str(ck)]) == 1
        assert re.fullmatch(rf"error: {ck} is in use by another run \(pid {holder.pid} on .*-c {ck}\); wait for it "
                            rf"to end, or give this run another checkpoint folder\n", capsys.readouterr().err)
        assert in_progress.is_dir()
        with pytest.raises(lock.FolderInUse, match=f"pid {holder.pid}"):
            eng.save_checkpoint(ck)
    finally:
        holder.kill()
        holder.wait()
    note = lock.acquire(ck)  # the holder died (kill -9): its lock is stale
    try:
        assert f"took over the lock of {ck} left by a run that ended (pid {holder.pid}" in note
    finally:
        lock.release(ck)
    assert not (ck / lock.LOCK_FILE).exists()


def test_sigterm_saves_at_the_step_boundary_and_the_resume_equals_the_uninterrupted_run(tmp_path, capsys):
    from zerojax import trainer
    from zerojax.trainer.flags import parse_args

    handler = signal.getsignal(signal.SIGTERM)
    straight = trainer.Trainer(parse_args([*TINY, "--steps", "4"])).run()["losses"]
    save = ["--save", str(tmp_path / "ck")]
    run = trainer.Trainer(parse_args([*TINY, "--steps", "4", *save]))
    run.add_hook(2, lambda info: os.kill(os.getpid(), signal.SIGTERM))  # a preemption after step 2
    stopped = run.run()
    assert stopped == {"interrupted": "SIGTERM", "step": 2, "checkpoint": str(tmp_path / "ck" / "global_step2"),
                       "exit_status": 0}
    assert "SIGTERM: stopped after step 2; checkpoint saved:" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop's handler is gone with the loop
    resumed = trainer.Trainer(parse_args([*TINY, "--steps", "4", *save, "--resume"])).run()
    assert resumed["start_step"] == 2 and resumed["losses"] == straight[2:]


def test_ctrl_c_once_asks_the_loop_to_stop_twice_stops_now(capsys):
    from zerojax.trainer.stopping import StopRequest

    handler = signal.getsignal(signal.SIGINT)
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal == "SIGINT" and stop.agreed() and stop.exit_status(saved=False) == 128 + signal.SIGINT
        assert "SIGINT: stopping after this step (Ctrl-C again stops now)" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is handler and stop.exit_status(saved=True) == 0


def test_several_processes_agree_on_the_stop_every_few_steps(monkeypatch):
    """With several processes the stop is agreed by a collective every AGREE_EVERY steps (not every step:
    the host would wait for the device), and a signal to any one process stops them all."""
    from jax.experimental import multihost_utils

    from zerojax.trainer import stopping

    asked = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: asked.append(x)
                        or np.stack([x, np.asarray([True])]))  # the other process was signalled
    stop = stopping.StopRequest()
    assert [stop.agreed(k) for k in range(1, 2 * stopping.AGREE_EVERY + 1)] == \
        [False] * (stopping.AGREE_EVERY - 1) + [True] + [False] * (stopping.AGREE_EVERY - 1) + [True]
    assert len(asked) == 2 and stop.signal == "SIGTERM" and not asked[0].any()
