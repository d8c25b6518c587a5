"""The main job, short: examples/gpt2_large.py trains a tiny GPT-2 on the embedded corpus.

References: the loss must fall clearly from its value at the first step (the job works), and
the config's csv_monitor writes DeepSpeed's files (deepspeed/monitor/csv_monitor.py: one
`Train_Samples_<name>.csv` per event, header `step,<name>`, one row per optimizer step indexed by
global samples), with the losses the engine reported; its tensorboard section writes the same
events as TensorBoard's event file (TFRecord frames of `tensorflow.Event` protobufs), with no
package beyond zerojax's own dependencies.
"""
import contextlib
import csv
import functools
import importlib.util
import io
import json
import os
import re

import numpy as np
import pytest

from zerojax.models import registry
from zerojax.trainer import choice, flags, setup
from zerojax.trainer.errors import ConfigMismatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("gpt2_large", os.path.join(ROOT, "examples", "gpt2_large.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _shared_run(*argv):
    """The example's run for `argv`, once for the module: (its summary, what it printed). Tests that
    need the same run (as a reference they compare against) read this one; none changes it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = _example().main(list(argv))
    return summary, out.getvalue()


@pytest.mark.slow
def test_main_job_trains_and_writes_deepspeed_csv_logs(tmp_path, capsys):
    with open(os.path.join(ROOT, "configs", "zero2_bf16.json")) as f:
        cfg = json.load(f)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "tiny"}
    cfg["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "tiny"}
    cfg["steps_per_print"] = 10
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    steps = 30
    summary = _example().main(["--config", str(path), "--model", "tiny", "--steps", str(steps),
                               "--seq-len", "64", "--micro-batch", "1", "--eval-batches", "2", "--peak-tflops", "1"])
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
    _check_log_lines(capsys.readouterr(), steps, summary)
    assert summary["val_loss"] < summary["first_loss"], summary

    batch = summary["train_batch_size"]  # 1 x 1 x 8 devices
    with open(tmp_path / "logs" / "tiny" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [batch * k for k in range(1, steps + 1)]
    losses = [float(r[1]) for r in rows[1:]]
    assert losses[0] == pytest.approx(summary["first_loss"], rel=1e-6)
    assert losses[-1] == pytest.approx(summary["last_loss"], rel=1e-6)
    assert os.path.exists(tmp_path / "logs" / "tiny" / "Train_Samples_lr.csv")
    # no fp16: DeepSpeed logs no loss scale
    assert not os.path.exists(tmp_path / "logs" / "tiny" / "Train_Samples_loss_scale.csv")

    # tensorboard: one event file, the same events (the float32 TensorBoard stores)
    from zerojax.engine.monitor import read_events

    (events,) = (tmp_path / "tb" / "tiny").glob("events.out.tfevents.*")
    got = read_events(str(events))
    loss = [(step, value) for step, tag, value in got if tag == "Train/Samples/train_loss"]
    assert [s for s, _ in loss] == [batch * k for k in range(1, steps + 1)]
    assert [v for _, v in loss] == pytest.approx(summary["losses"], rel=1e-6)
    assert sorted({tag for _, tag, _ in got}) == ["Train/Samples/lr", "Train/Samples/train_loss"]
    _check_with_protobuf(events.read_bytes(), loss)


def _check_log_lines(captured, steps, summary):
    """Output to a file or pipe (not a terminal, as under pytest): no progress bar redrawn with
    carriage returns but one line every 10 steps and at the end, whose tokens/s (per device, steps
    that compile excluded) and MFU are the SUMMARY's: one definition everywhere."""
    out = captured.out
    assert "\r" not in out + captured.err
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == [f"step {k}/{steps}" for k in range(10, steps + 1, 10)], out
    tps = float(lines[-1].split(", ")[1].split(" tokens/s per device")[0].replace(",", ""))
    mfu = float(lines[-1].split("MFU ")[1].split("%")[0])
    assert tps == pytest.approx(summary["tokens_per_s_per_device"], abs=1)
    assert mfu == pytest.approx(100 * summary["mfu"], abs=0.06)
    assert ("MFU against 1 TFLOP/s per device (--peak-tflops); tokens/s are per device, "
            "steps that compile excluded") in out
    # DeepSpeed's steps_per_print lines (the config sets 10) carry no second speed figure
    ds_lines = [line for line in out.splitlines() if line.startswith("[Rank 0] step=")]
    assert len(ds_lines) == steps // 10 and not any("tokens/s" in line for line in ds_lines), ds_lines
    # the host's peak, as the kernel counts it (VmHWM: the high-water mark of this process's RSS,
    # read after the run, not below the figure the example read at its end; VmRSS: what the
    # process holds now, most of which it held then)
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmHWM", "VmRSS")}
    assert kib["VmRSS"] / 2 <= summary["host_peak_rss_gib"] * 2**30 <= kib["VmHWM"] + 2**30 / 100
    assert f"host peak RSS {summary['host_peak_rss_gib']:.2f} GiB" in out


def _check_with_protobuf(data, loss):
    """The event file read by protobuf itself (tensorflow/core/util/event.proto and summary.proto,
    the fields TensorBoard reads, declared here), not by zerojax's own reader."""
    import struct

    descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
    from google.protobuf import descriptor_pool, message_factory

    f = descriptor_pb2.FileDescriptorProto(name="zerojax_test_event.proto", package="tensorflow")
    T = descriptor_pb2.FieldDescriptorProto
    value = f.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
    summary = f.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=T.TYPE_MESSAGE, type_name=".tensorflow.Value",
                      label=T.LABEL_REPEATED)
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, type_name=".tensorflow.Summary",
                    label=T.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    Event = message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Event"))
    events, i = [], 0
    while i < len(data):  # TFRecord: u64 length, u32 crc, data, u32 crc
        (n,) = struct.unpack("<Q", data[i:i + 8])
        events.append(Event.FromString(data[i + 12:i + 12 + n]))
        i += 16 + n
    assert events[0].file_version == "brain.Event:2"
    scalars = [(e.step, v.simple_value) for e in events[1:] for v in e.summary.value
               if v.tag == "Train/Samples/train_loss"]
    assert scalars == loss


def test_tfrecord_crc_is_crc32c():
    from zerojax.engine.monitor import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720, iSCSI)


# --------------------------------------------------------------------------- every flag,
# file and resume does what the user asked, through the example's entry point

import subprocess  # noqa: E402
import sys  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "gpt2_large.py")
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "1", "--eval-batches", "0"]


def _cli(*argv, timeout=300):
    """The example as a user runs it (output to pipes, not a terminal): exit status and everything it printed."""
    p = subprocess.run([sys.executable, EXAMPLE, *argv], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return p.returncode, p.stdout + p.stderr


def _command_line(capsys, *argv):
    """What the example's `__main__` runs (trainer.run_cli with its prog and description: a user's
    mistake as one `error:` line and exit status 1), in this process: exit status and everything it
    printed, stdout then stderr as `_cli` joins them. A process of its own costs a jax import (~4
    CPU seconds); the `__main__` itself runs in one in test_a_bad_flag_through_the_entry_point (argparse's
    exit status 2) and test_a_bad_jsonl_line_is_one_error_line_naming_file_and_line (a mistake's 1)."""
    from zerojax import trainer

    capsys.readouterr()  # what earlier steps of the test printed is not this command's
    code = trainer.run_cli(list(argv), prog="gpt2_large.py", description=_example().__doc__)
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def _config_file(tmp_path, name="ds.json", base="zero2_bf16.json", **sections):
    with open(os.path.join(ROOT, "configs", base)) as f:
        cfg = json.load(f)
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("case", ["wandb", "fp16 flag", "typo"])
def test_setup_errors_are_one_line_before_anything_is_built(case, tmp_path, capsys, monkeypatch):
    """Refused at once, as `error: ...` naming the flag / file / section and the fix, exit status 1,
    before the run block and the model (and so before any folder a monitor would write)."""
    if case == "wandb":  # wandb not importable, whatever this environment has installed
        (tmp_path / "shadow").mkdir()
        (tmp_path / "shadow" / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
        monkeypatch.syspath_prepend(str(tmp_path / "shadow"))  # found first, as on PYTHONPATH
        monkeypatch.delitem(sys.modules, "wandb", raising=False)  # an import earlier in this process
        path = _config_file(tmp_path, wandb={"enabled": True},
                            csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"})
        want = ("error: wandb.enabled is true but the wandb package cannot be imported (No module named wandb): "
                "`pip install zerojax[wandb]` (or `pip install wandb`), or set wandb.enabled to false")
    elif case == "fp16 flag":  # the config leaves precision to the flag: the flag is named, not the config
        path = _config_file(tmp_path, bf16={"enabled": "auto"})
        want = ("error: --fp16: XLA does not run fp16 matrix products on CPU ('F16_F16_F32' is not supported by "
                "dot_general); use --bf16 or --fp32 here, or --fp16 on a GPU")
    else:
        path = _config_file(tmp_path, zero_optimization={"stage": 2, "overlap_com": True})
        want = (f"error: 1 problem(s) in the DeepSpeed config {path}:\n"
                "  - zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?")
    code, out = _command_line(capsys, "--config", str(path), *TINY, "--steps", "2",
                              *(["--fp16"] if case == "fp16 flag" else []))
    assert code == 1 and out.strip() == want, out
    assert not (tmp_path / "csv").exists()


def test_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        _example().main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "--eval-batches EVAL_BATCHES\n                        validation batches" in out, out
    assert "--summary-json PATH" in out, out


def test_help_says_what_precision_the_default_config_runs_on_cpu(capsys):
    """--help's precision paragraph against what resolve_precision does with the default config (its
    --config default) on a CPU: bf16, since zero2_bf16.json sets bf16.enabled true."""
    from types import SimpleNamespace

    from zerojax.config import read_source

    with pytest.raises(SystemExit):
        flags.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    _, mode, why, _ = setup.resolve_precision(read_source(flags.parse_args([]).config), None, cpu)
    assert (mode, why) == ("bf16", "the config's bf16.enabled: true")
    assert (f"the default config, configs/zero2_bf16.json, sets {mode}, so a run without --config trains in {mode}, "
            "on CPU too") in help_text, help_text
    # and where the config leaves it open, the CPU default the paragraph names
    assert setup.resolve_precision({"bf16": {"enabled": "auto"}}, None, cpu)[1] == "fp32"
    assert "or no fp16 / bf16 section): bf16 on a GPU that has it, fp32 on CPU" in help_text


def test_hf_checkpoint_path_that_is_missing_says_so(tmp_path):
    """A mistyped --hf-checkpoint is named as missing (with the absolute path it looked for); a
    folder that exists but is no model keeps its "no config.json"; both before anything is built."""
    example = _example()
    missing = tmp_path / "tiny-lama"
    with pytest.raises(FileNotFoundError) as info:
        example.main(["--hf-checkpoint", str(missing), *TINY[2:], "--steps", "1"])
    assert str(info.value) == (f"--hf-checkpoint {missing}: no such folder ({missing}); give the folder holding "
                               "config.json and model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no config.json"):
        example.main(["--hf-checkpoint", str(tmp_path / "empty"), *TINY[2:], "--steps", "1"])




@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "argument --steps: -1 must be >= 0"),
    # without "=": argparse alone would answer "expected one argument"
    (["--lr", "-1e-3"], "argument --lr: -1e-3: a negative learning rate climbs the loss; give a value >= 0"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    (["--seq-len", "1"], "argument --seq-len: 1 must be >= 2"),
    (["--keep", "0", "--save", "d"], "argument --keep: 0 must be >= 1"),
    (["--keep", "2"], "--keep needs --save DIR"),
    (["--resume"], "--resume needs --save DIR"),
    (["--micro-batch", "0"], "argument --micro-batch: 0 must be >= 1 (or auto)"),
])
def test_bad_flag_values_are_refused_with_the_reason(argv, message, capsys):
    # in-process through the trainer's parser (the example's and `zerojax train`'s): each `python
    # gpt2_large.py` costs a jax import (~3.5 CPU seconds); the entry point itself is run by the test below
    with pytest.raises(SystemExit) as info:
        flags.parse_args(argv)
    out = capsys.readouterr().err
    assert info.value.code == 2 and message in out, out  # argparse's usage-error status


def test_a_bad_flag_through_the_entry_point():
    code, out = _cli("--steps", "-1")
    assert code == 2 and "argument --steps: -1 must be >= 0" in out, out


@pytest.mark.slow
def test_data_errors_name_file_and_place_before_any_compile(tmp_path, capsys):
    # three through the example's command line; every case is in tests/data/test_data.py
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "model.bin.txt").write_bytes(b"PK\x03\x04" + bytes(range(256)))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "no closing quote}\n')
    for name, message in [("empty.txt", "empty.txt: no text"),
                          ("model.bin.txt", "model.bin.txt: byte offset 4: a NUL byte, so this is a binary file"),
                          ("bad.jsonl", "bad.jsonl:2: column 10: not JSON (Unterminated string")]:
        code, out = _command_line(capsys, "--data", str(tmp_path / name), *TINY, "--steps", "1")
        assert code == 1 and f"error: {tmp_path / name}" in out and message in out, (name, out)
        assert "Traceback" not in out and "run: GPT-2" not in out, out  # refused before the model


def _summary(out):
    return json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[8:])


STRAIGHT = (*TINY, "--steps", "4", "--schedule-steps", "40")  # the default config (zero2_bf16.json), 4 steps


@pytest.mark.slow
def test_resume_matches_the_uninterrupted_run_step_for_step(tmp_path, capsys, monkeypatch):
    """Straight 4 steps vs 2 + resume to 4, same flags. The schedule (WarmupDecayLR over 40
    steps, warmup 4) is the one saved with the checkpoint: had the resumed run rebuilt it from
    --steps 4 (warmup 1), the update before the 4th loss would use another lr (checked below
    with zerojax.build_schedule) and that loss would differ. The resumed program is the same
    jitted step on the same state (orbax restores bf16 / fp32 leaves exactly) and the same
    batches (random access by step), so the losses are compared bitwise."""
    import zerojax

    def lr(total, k):  # the example's fill: warmup 10% of the schedule, at least 1
        cfg = zerojax.load_config(os.path.join(ROOT, "configs", "zero2_bf16.json"), world_size=8, fill={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.0,
            "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": max(1, total // 10),
            "scheduler.params.total_num_steps": total})
        return float(zerojax.build_schedule(cfg)(k))

    assert lr(40, 2) > 0 and lr(40, 2) != lr(4, 2)  # the test can tell the two schedules apart
    example = _example()
    straight = _shared_run(*STRAIGHT)[0]
    ckpt = tmp_path / "ckpt"
    first = example.main([*TINY, "--steps", "2", "--schedule-steps", "40", "--save", str(ckpt)])
    # a save killed mid-way leaves orbax's temporary folder: removed at the next start
    leftover = ckpt / "global_step3.orbax-checkpoint-tmp"
    (leftover / "meta").mkdir(parents=True)
    capsys.readouterr()
    second = example.main([*TINY, "--steps", "4", "--save", str(ckpt), "--resume", "--keep", "1"])
    out = capsys.readouterr().out
    assert first["losses"] + second["losses"] == straight["losses"], (first, second, straight)
    assert len(straight["losses"]) == 4 and straight["last_loss"] == straight["losses"][-1]
    assert f"removed {leftover}: left by an interrupted save" in out and not leftover.exists()
    assert f"resumed from {ckpt / 'global_step2'} at step 2 (data position: batch 2" in out
    assert "[length 40: saved with the checkpoint]" in out and "lr:        0.001 (saved with the checkpoint)" in out
    # --keep 1: the older step is pruned after the save, the one `latest` names is kept
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["global_step4", "latest"]
    assert (ckpt / "latest").read_text() == "global_step4"
    assert "--keep 1: removed the older checkpoint(s) global_step2" in out

    # another model size over this checkpoint: refused in one line from its metadata, before the model
    # is built (no "run:" block, no traceback listing leaf shapes). In-process: the entry point
    # prints a CheckpointError as `error: <message>`, exit status 1 (as for the config and data
    # errors it is run with above)
    from zerojax.checkpoint.state import CheckpointError

    with pytest.raises(CheckpointError) as info:
        example.main([*TINY, "--model", "small", "--steps", "5", "--save", str(ckpt), "--resume"])
    said = capsys.readouterr().out
    assert f"error: {info.value}" == (f"error: {ckpt}: this checkpoint is GPT-2 tiny; use --model tiny (this "
                                      "run asks for GPT-2 small; another --save folder starts it afresh)"), info.value
    assert "run:" not in said, said
    # past the saved schedule's end, with another global batch (as fewer devices or processes give):
    # both said before the run, with how to keep the schedule going (the run itself stopped where
    # its engine would be built: what is checked is printed before it)

    class Built(Exception):
        pass

    def stop(*a, **k):
        raise Built

    monkeypatch.setattr(zerojax, "shard", stop)
    with pytest.raises(Built):
        example.main([*TINY, "--micro-batch", "2", "--steps", "42", "--save", str(ckpt), "--resume"])
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert ("note:      the global batch changes from the checkpoint's 8 = 1 x 1 x 8 data-parallel to "
            "16 = 2 x 1 x 8 data-parallel") in out, out
    assert ("note:      --steps 42 runs past the schedule's 40 steps (saved with the checkpoint): past its end "
            "the lr stays at 0 (the weights stop changing); "
            "to extend the schedule, add --schedule-steps 42") in out, out


@pytest.mark.slow
def test_one_step_stage3_lr0_and_cpu_precision_default(tmp_path, capsys):
    """--lr 0 is honoured (the engine reports lr 0 for the step, DeepSpeed's csv_monitor file),
    one step gives a last loss, and the config's ZeRO "auto"s are filled as the Hugging Face
    Trainer fills them from the model's width (tiny GPT-2: hidden 64 -> reduce_bucket_size 64^2,
    stage3_prefetch_bucket_size int(0.9 * 64^2), stage3_param_persistence_threshold 10 * 64), so
    stage 3 partitions the model (DeepSpeed's default threshold, 1e5 elements, is above its
    largest leaf, 64*256: nothing would be partitioned); every filled value is printed once."""
    with open(os.path.join(ROOT, "configs", "zero3_bf16.json")) as f:
        cfg = json.load(f)
    cfg["bf16"]["enabled"] = "auto"  # precision left to the flags: fp32 on CPU by default
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "lr0"}
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(cfg))
    summary = _example().main(["--config", str(path), *TINY, "--steps", "1", "--lr", "0"])
    out = capsys.readouterr().out
    assert summary["last_loss"] is not None and summary["last_loss"] == summary["first_loss"]
    assert summary["precision"] == "fp32" and "precision: fp32 (default on CPU" in out
    assert "lr:        0 (--lr)" in out
    with open(tmp_path / "logs" / "lr0" / "Train_Samples_lr.csv") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == [0.0]
    auto = [line for line in out.splitlines() if line.startswith("  auto:      ")]
    assert len(auto) == 1, out
    for filled in ("train_batch_size=8 (batch rule)", "train_micro_batch_size_per_gpu=1", "optimizer.params.lr=0.0",
                   "optimizer.params.weight_decay=0.0", "scheduler.params.total_num_steps=1",
                   "zero_optimization.reduce_bucket_size=4096 (model width)",
                   "zero_optimization.stage3_prefetch_bucket_size=3686 (model width)",
                   "zero_optimization.stage3_param_persistence_threshold=640 (model width)"):
        assert filled in auto[0], auto
    assert "replicated on every device" not in out, out


def test_replicated_warning_names_the_threshold(capsys):
    """Where stage 3 leaves most parameters whole on every device (their tensors under
    stage3_param_persistence_threshold), the example says so once, naming the key."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    import zerojax

    cfg = zerojax.load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 100_000}}, world_size=8)
    params = {"w": jnp.zeros((64, 256)), "b": jnp.zeros((64,))}  # replicated: a single device's arrays
    engine = SimpleNamespace(mesh=SimpleNamespace(shape={"data": 8}), state=SimpleNamespace(params=params))
    setup.warn_replicated(engine, cfg)
    out = capsys.readouterr().out
    assert out.count("replicated on every device: tensors under "
                     "zero_optimization.stage3_param_persistence_threshold = 100,000 elements") == 1, out
    setup.warn_replicated(engine, zerojax.load_config({**cfg.to_dict(), "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 640}}, world_size=8))
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_offload_loop_flag_trains_like_the_default_and_is_checked_against_the_config(capsys, monkeypatch):
    """--offload-loop host with configs/zero2_offload_optimizer.json: the same losses as the default
    loop (the same arithmetic; fp32 on CPU); with a config that does not offload the optimizer it is
    refused before the engine is built, naming the key and a config that fits. A run that exports
    nothing never reads the whole fp32 master (under offload, every host chunk merged on the device)."""
    from zerojax.engine.engine import Engine

    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_offload_optimizer.json")
    default, default_out = _shared_run("--config", cfg, *TINY, "--steps", "2")  # also test_offload_loop_auto_...'s
    with monkeypatch.context() as m:
        m.setattr(Engine, "master_params", property(lambda self: pytest.fail("the run read Engine.master_params")))
        runs = [default, example.main(["--config", cfg, *TINY, "--steps", "2", "--offload-loop", "host"])]
    assert runs[1]["last_loss"] == pytest.approx(runs[0]["last_loss"], rel=1e-5)
    out = capsys.readouterr().out
    assert "optimizer offload: in_place loop" in default_out and "optimizer offload: host loop, 1 layer group(s)" in out
    # --adam-mu-dtype reaches the engine (its first moment stored in bf16); the config's bf16 with
    # the host loop keeps the master split by default
    example.main(["--config", cfg, *TINY, "--steps", "1", "--offload-loop", "host", "--adam-mu-dtype", "bfloat16"])
    assert "master split (bf16 copy + 16-bit host remainder), first moment bfloat16" in capsys.readouterr().out
    with pytest.raises(ConfigMismatch, match="offload_optimizer.device .cpu.*zero2_offload_optimizer"):
        example.main(["--config", os.path.join(ROOT, "configs", "zero2_bf16.json"), *TINY, "--steps", "1",
                      "--offload-loop", "host"])


@pytest.mark.slow
def test_master_split_flag_trains_as_without_it_and_is_refused_without_bf16(capsys, monkeypatch, tmp_path):
    """--master-split (EngineOptions(split_master="on")) reaches the engine and trains as the whole
    fp32 master does (the same losses); under optimizer offload to cpu it is the host loop's split
    (kept); with a config that does not compute in bf16 it is refused before anything is built,
    naming the flag and a config that fits."""
    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_bf16.json")
    # without the flag: test_resume_matches_the_uninterrupted_run_step_for_step's uninterrupted run
    runs = [_shared_run(*STRAIGHT)[0], example.main([*STRAIGHT, "--master-split"])]
    assert [r["master_split"] for r in runs] == [False, True]
    assert len(runs[0]["losses"]) == 4 and runs[1]["losses"] == runs[0]["losses"]
    # micro-batch auto: the planner compiles its candidates with the flag (the same run)
    from zerojax import load_config
    from zerojax.planning import memory

    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    planned = example.main(["--config", cfg, *TINY, "--steps", "3", "--master-split", "--micro-batch", "auto"])
    assert planned["master_split"] is True and planned["last_loss"] < planned["first_loss"]
    out = capsys.readouterr().out
    assert "micro-batch auto: remat none, micro-batch 4 x 1 accumulation, stage 2, offload none" in out
    off = load_config(os.path.join(ROOT, "configs", "zero2_offload_optimizer.json"),
                      fill={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                            "optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.0,
                            "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": 1})
    options = setup.engine_options(flags.parse_args([*TINY, "--master-split"]), off, planned=True)
    assert options.split_master == "on" and options.offload_loop == "auto"
    import hjson

    fp32 = tmp_path / "zero2_fp32.json"
    fp32.write_text(json.dumps({**hjson.load(open(cfg)), "bf16": {"enabled": False}}))
    with pytest.raises(ConfigMismatch, match="--master-split needs bf16.*zero2_fp32.json.*zero2_bf16.json"):
        example.main(["--config", str(fp32), *TINY, "--steps", "1", "--master-split"])


@pytest.mark.slow
def test_master_split_reaches_a_planned_in_place_offload(capsys):
    """--master-split with --micro-batch auto on a config whose plan offloads parameters and the
    optimizer (the in_place loop): the host copy of the master is split there too (it gave way,
    saying the host loop would split it, which does not run there)."""
    example = _example()
    example.main(["--config", os.path.join(ROOT, "configs", "zero3_offload_param_optimizer.json"), "--model", "tiny",
                  "--seq-len", "32", "--micro-batch", "auto", "--eval-batches", "0", "--steps", "1", "--master-split"])
    out = capsys.readouterr().out
    assert "optimizer offload: in_place loop, 2 layer group(s), master split (bf16 copy + 16-bit host remainder)" in out
    assert "--master-split:" not in out  # nothing gave way


def test_offload_hint_names_the_missing_flags_and_their_bytes():
    """micro-batch auto's note where the planner's choice offloads a bf16 run: the flags not given and
    the model state each keeps off every device, counted independently: --master-split 2 bytes a
    parameter (an int16 remainder for the fp32 master's 4), --adam-mu-dtype bfloat16 2 (Adam's first
    moment), divided over the data ranks from stage 1 (not at stage 0); a flag given is not named;
    no note without offload, in fp32, or with both flags."""
    import jax.numpy as jnp

    from zerojax import EngineOptions
    from zerojax.planning.planner import Plan

    P, GiB = 1_557_611_200, 2**30  # GPT-2 XL's parameters
    offloading = Plan(3, 8, remat="full", offload_optimizer=True, offload_ratio=0.5)
    split, mu = "--master-split {:.2f} GiB (", "--adam-mu-dtype bfloat16 {:.2f} GiB ("
    for options, named, absent in ((EngineOptions(), (split, mu), ()),
                                   (EngineOptions(split_master="on"), (mu,), (split,)),
                                   (EngineOptions(adam_mu_dtype="bfloat16"), (split,), (mu,))):
        for n_data in (1, 4):
            hint = setup.offload_hint(offloading, P, n_data, options, jnp.bfloat16)
            assert hint.startswith("micro-batch auto: this plan offloads;")
            for flag in named:  # 2 bytes a parameter each, over the data ranks
                assert flag.format(2 * P / n_data / GiB) in hint
            for flag in absent:
                assert flag.split(" {")[0] not in hint
    both = EngineOptions(split_master="on", adam_mu_dtype="bfloat16")
    assert setup.offload_hint(offloading, P, 1, both, jnp.bfloat16) is None
    assert setup.offload_hint(offloading, P, 1, EngineOptions(), jnp.float32) is None
    assert setup.offload_hint(Plan(2, 8, remat="full"), P, 1, EngineOptions(), jnp.bfloat16) is None
    stage0 = Plan(0, 8, remat="full", offload_optimizer=True)
    assert split.format(2 * P / GiB) in setup.offload_hint(stage0, P, 4, EngineOptions(), jnp.bfloat16)


@pytest.mark.slow
def test_offload_loop_auto_takes_host_where_its_step_fits(capsys, monkeypatch):
    """No --offload-loop, a config offloading the optimizer to cpu, a device that reports its memory
    (here a stand-in budget): "host" where its step (compiled on an abstract engine) fits, trained
    as the in-place loop trains (1e-5, as above); "in_place" where it would not, naming the bytes;
    no budget known (CPU as it is): "in_place"."""
    from flax import nnx

    import zerojax
    from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss
    from zerojax.planning import memory

    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_offload_optimizer.json")
    args = ["--config", cfg, *TINY, "--steps", "2"]
    plain, plain_out = _shared_run(*args)  # also test_offload_loop_flag_...'s default run
    assert "in_place loop, 2 layer group(s), master fp32, first moment fp32 (default; this device reports no " \
           "memory limit" in plain_out
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    auto = example.main(args)
    assert "optimizer offload: host loop, 1 layer group(s), master split (bf16 copy + 16-bit host remainder), " \
           "first moment fp32 (auto: its step needs" in capsys.readouterr().out
    assert auto["last_loss"] == pytest.approx(plain["last_loss"], rel=1e-5)
    # a budget below the host step's peak: in_place, and why
    with open(cfg) as f:
        raw = json.load(f)
    loaded = zerojax.load_config(raw, fill={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                            "optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.0,
                                            "scheduler.params.warmup_max_lr": 1e-3,
                                            "scheduler.params.warmup_num_steps": 1})
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**20)
    make = lambda: GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0))  # noqa: E731
    loop, why = setup.offload_loop_auto(loaded, make, 32, gpt2_loss)
    assert loop == "in_place"
    assert why.startswith('auto: "host" would need ') and why.endswith("of the device's 1.00 MiB")
    # fp16 (its loss-scale skips untested in the host loop: fp16 matmuls do not run on CPU): in_place
    fp16 = zerojax.load_config({**loaded.to_dict(), "bf16": {"enabled": False}, "fp16": {"enabled": True}})
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    assert setup.offload_loop_auto(fp16, make, 32, gpt2_loss)[0] == "in_place"
    # several processes: "host" only where it fits on every one (their answers gathered)
    import jax
    from jax.experimental import multihost_utils
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for answers, want, said in (([True, False], "in_place", 'auto: "host" fits here but not on every process'),
                                ([True, True], "host", "auto: its step needs")):
        monkeypatch.setattr(multihost_utils, "process_allgather", lambda x, a=answers: np.asarray(a)[:, None])
        loop, why = setup.offload_loop_auto(loaded, make, 32, gpt2_loss)
        assert loop == want and why.startswith(said), why


@pytest.mark.slow
def test_mfu_is_reported_against_the_measured_ceiling_or_the_flag(capsys, monkeypatch, tmp_path):
    """The example's MFU: tokens/s per device x the model's FLOPs a token (flops_per_token, checked
    against the written-out count in test_gpt2) over --peak-tflops, or over the matmul ceiling it
    measured at start in the run's own precision (zerojax.planning.ceiling: an fp32 run against
    fp32); the header says which. On CPU, whose measured rate varied 8x from run to run, no
    ceiling is measured and no MFU reported unless --peak-tflops gives one."""
    from zerojax.models.gpt2 import GPT2Config, flops_per_token
    from zerojax.planning import ceiling

    example = _example()
    monkeypatch.setattr(ceiling, "measure_matmul_ceiling", lambda *a, **k: pytest.fail("measured on CPU"))
    auto = ["--config", str(_config_file(tmp_path, bf16={"enabled": "auto"}))]  # precision from the flag
    run = example.main([*auto, *TINY, "--steps", "3", "--fp32"])
    assert "no MFU on CPU: its matmul rate varies from run to run" in capsys.readouterr().out
    assert "mfu" not in run and run["tokens_per_s_per_device"] > 0
    # where the ceiling is stable (a GPU / TPU): measured in the run's precision
    asked = []
    monkeypatch.setattr(ceiling, "ceiling_is_stable", lambda backend=None: True)
    monkeypatch.setattr(ceiling, "measure_matmul_ceiling",
                        lambda n=None, iters=None, dtype="bfloat16": asked.append(dtype) or {"ceiling_tflops": 0.5})
    run = example.main([*auto, *TINY, "--steps", "2", "--fp32"])
    assert "MFU against 0.5 TFLOP/s per device (the float32 matmul ceiling measured here)" in capsys.readouterr().out
    assert [np.dtype(d).name for d in asked] == ["float32"] and run["mfu_against_tflops"] == 0.5
    fpt = flops_per_token(GPT2Config.named("tiny"), 32)
    assert run["mfu"] == pytest.approx(run["tokens_per_s_per_device"] * fpt / 0.5e12, rel=2e-2, abs=1e-4)


def test_speed_excludes_every_step_that_compiles():
    """SpeedMeter (the example's one definition of tokens/s): per device, over the windows between
    syncs in which nothing compiled; a step that compiles (the first, or a later one) is waited for
    and its window dropped."""
    import jax
    import jax.numpy as jnp

    from zerojax.engine.monitor import SpeedMeter

    now = [0.0]
    meter = SpeedMeter(tokens_per_step=100, n_devices=4, flops_per_token=10.0, peak_tflops=1e-9,
                       clock=lambda: now[0])
    f = jax.jit(lambda x: x + 1)

    def step(x, seconds, new_shape=False):
        meter.before_step()
        y = f(jnp.zeros(7 if new_shape else 3) + x)  # a new shape compiles
        now[0] += seconds
        meter.after_step(y[0])
        return y

    step(0, 30.0)                  # compiles: 30 s never counted
    step(1, 1.0)
    step(2, 1.0)
    meter.sync(0.0)                # 200 tokens in 2 s
    step(3, 1.0)
    step(4, 50.0, new_shape=True)  # compiles: its window (steps 3-4) dropped
    step(5, 2.0)
    meter.sync(0.0)                # + 100 tokens in 2 s
    assert meter.compiled_steps == 2
    assert meter.tokens_per_s_per_device == pytest.approx(300 / 4 / 4)
    assert meter.mfu == pytest.approx(300 / 4 / 4 * 10.0 / 1e3)


def test_steps_zero_evaluates_only(monkeypatch, capsys):
    """--steps 0: evaluation only; no step is timed, so no MFU and no ceiling measured for it."""
    from zerojax.planning import ceiling

    monkeypatch.setattr(ceiling, "measure_matmul_ceiling", lambda *a, **k: pytest.fail("measured for no step"))
    summary = _example().main([*TINY, "--steps", "0", "--eval-batches", "1"])
    assert summary["losses"] == [] and summary["last_loss"] is None and summary["val_loss"] > 0
    assert "mfu" not in summary and "no MFU (fewer than 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("sections, flag, device, expect", [
    # the config decides when it enables a mode and no flag is given; a flag replaces it, said in a line
    ({"bf16": {"enabled": True}}, None, "cpu", ("bf16", {"bf16": True})),
    ({"bf16": {"enabled": True}}, "bf16", "gpu9", ("bf16", {"bf16": True})),
    ({"bf16": {"enabled": True}}, "fp16", "gpu9", ("fp16", {"bf16": False, "fp16": True},
                                                   "--fp16 replaces the config's bf16.enabled = true")),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "bf16", "cpu", ("bf16", {"fp16": False, "bf16": True},
                                                                   "--bf16 replaces the config's fp16.enabled = true")),
    ({"fp16": {"enabled": True}}, "fp32", "cpu", ("fp32", {"fp16": False}, "--fp32 replaces the config's fp16")),
    # "auto" (or no section, as the guide's config has no bf16): the flag, else the default
    ({"fp16": {"enabled": "auto"}}, None, "gpu9", ("bf16", {"bf16": True, "fp16": False})),
    ({"fp16": {"enabled": "auto"}}, "fp16", "gpu9", ("fp16", {"fp16": True})),
    ({"fp16": {"enabled": "auto"}}, None, "cpu", ("fp32", {"fp16": False})),
    ({"fp16": {"enabled": "auto"}}, None, "gpu7", ("fp32", {"fp16": False})),  # V100: no fast bf16
    ({"bfloat16": {"enabled": "auto"}}, "bf16", "cpu", ("bf16", {"bfloat16": True})),
    ({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, "fp32", "gpu9",
     ("fp32", {"bf16": False, "fp16": False})),
    # a mode the config turns off is never chosen
    ({"bf16": {"enabled": False}}, None, "gpu9", ("fp32", {"bf16": False})),
    ({"bf16": {"enabled": False}}, "bf16", "gpu9", ("bf16", {"bf16": True}, "--bf16 replaces the config's "
                                                                             "bf16.enabled = false")),
])
def test_precision_resolved_as_hugging_face_fills_it(sections, flag, device, expect):
    from types import SimpleNamespace

    dev = {"cpu": SimpleNamespace(platform="cpu", device_kind="cpu"),
           "gpu9": SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0"),
           "gpu7": SimpleNamespace(platform="gpu", device_kind="Tesla V100", compute_capability="7.0")}[device]
    raw = {"train_batch_size": 8, **sections}
    out, mode, _, said = setup.resolve_precision(raw, flag, dev)
    assert mode == expect[0] and {k: out[k]["enabled"] for k in expect[1]} == expect[1]
    # one line where the flag replaced what the config set, none otherwise
    assert ([line[:len(expect[2])] for line in said] == [expect[2]]) if len(expect) > 2 else said == [], said
    import zerojax
    from zerojax.precision import compute_dtype

    assert compute_dtype(zerojax.load_config(out)).name == {"fp32": "float32", "bf16": "bfloat16",
                                                             "fp16": "float16"}[mode]


# --------------------------------------------------------------------------- the Llama family, fine-tuning
# data and LoRA through the example: a tiny Llama written by transformers, a word-level tokenizer
# with a chat template (tests/data/test_finetune_data.py's), fp32 so that exports compare closely

WORDS = ["[UNK]", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "hello", "there", "hi",
         "friend", "what", "is", "two", "plus", "four", "be", "brief", "yes", "no", "ok"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' + eos_token }}"
                 "\n{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
LLAMA_RUN = ["--seq-len", "32", "--micro-batch", "1", "--eval-batches", "0"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random tiny LlamaForCausalLM (vocabulary 101: padded on zerojax's side; GQA 4:2) with a
    tokenizer folder's files beside it, prompt / completion and chat .jsonl data, an fp32 config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=3, pad_token_id=1)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # an LM head that frozen-base LoRA can steer (at 0.02 the logits stay within +-1)
        hf.lm_head.weight.mul_(25.0)
    hf.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    rng = np.random.default_rng(0)
    words = WORDS[7:]
    pairs = [{"prompt": " ".join(rng.choice(words, 3)), "completion": " ".join(rng.choice(words[:4], 2))}
             for _ in range(64)]
    (path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
             for r in pairs]
    (path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    with open(os.path.join(ROOT, "configs", "zero2_bf16.json")) as f:
        ds = json.load(f)
    ds["bf16"] = {"enabled": False}
    (path / "ds_fp32.json").write_text(json.dumps(ds))
    return path


def _capture(monkeypatch, module, name):
    """Wrap module.name so that the model it is given is kept (the trained model the example exports),
    and what it returns (zerojax.shard: the engine)."""
    got, real = {}, getattr(module, name)

    def wrapper(model, *a, **k):
        got.setdefault("model", model)
        out = real(model, *a, **k)
        got.setdefault("engine", out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return got


def _logits_ours(model, ids):
    import jax.numpy as jnp

    model.dtype = jnp.dtype(jnp.float32)  # the export is the fp32 master: compare in fp32
    model.eval()
    return np.asarray(model(jnp.asarray(ids)))


def _logits_torch(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.numpy()


IDS = np.random.default_rng(1).integers(0, 101, (2, 12), dtype=np.int32)


@pytest.mark.slow
def test_llama_from_hf_folder_fine_tunes_on_prompt_completion_and_exports(hf_llama, tmp_path, monkeypatch):
    """--hf-checkpoint of a Llama (model_type "llama": zerojax.models.from_hf) with its tokenizer folder,
    prompt / completion .jsonl packed with segment ids: the loss on the completions falls; --export-hf
    writes a folder transformers loads, whose logits are the trained zerojax model's."""
    import transformers

    import zerojax.models

    got = _capture(monkeypatch, zerojax, "shard")
    out = tmp_path / "export"
    summary = _example().main(["--config", str(hf_llama / "ds_fp32.json"), "--hf-checkpoint", str(hf_llama),
                               "--data", str(hf_llama / "pc.jsonl"), *LLAMA_RUN, "--steps", "8", "--lr", "1e-2",
                               "--export-hf", str(out)])
    assert summary["family"] == "llama" and summary["model"] == "hf" and summary["lora"] is None
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary["losses"]
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours = _logits_ours(got["engine"].model, IDS)
    np.testing.assert_allclose(_logits_torch(hf, IDS), ours, rtol=1e-4, atol=1e-4)
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    assert np.abs(_logits_torch(base, IDS) - ours).max() > 1e-2  # trained: not the checkpoint it started from
    assert (out / "tokenizer_config.json").exists() and (out / "tokenizer.json").exists()


@pytest.mark.slow
def test_lora_trains_adapters_only_and_exports_peft_and_merged(hf_llama, tmp_path, monkeypatch, capsys):
    """--lora 4 on chat .jsonl (the loss on the assistant turns): only the adapters train (the frozen
    base is bitwise the checkpoint's); --export-hf --merge writes PEFT's adapter folder, which
    peft.PeftModel.from_pretrained loads onto the transformers base with the trained model's logits,
    and the merged model, which transformers loads with the same logits."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from flax import nnx

    from zerojax import lora
    from zerojax.models import from_hf

    got = _capture(monkeypatch, lora, "save_peft")
    out = tmp_path / "export"
    summary = _example().main(["--config", str(hf_llama / "ds_fp32.json"), "--hf-checkpoint", str(hf_llama),
                               "--data", str(hf_llama / "chat.jsonl"), *LLAMA_RUN, "--steps", "8", "--lr", "2e-2",
                               "--lora", "4", "--export-hf", str(out), "--merge"])
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary["losses"]
    model = got["model"]
    settings = summary["lora"]
    assert settings["r"] == 4 and settings["target_modules"] == "all-linear"
    assert summary["trained_params"] == lora.trainable_count(model) < 0.2 * sum(
        x.size for x in jax_leaves(nnx.state(model)))
    fresh = lora.apply(from_hf(hf_llama), settings)
    frozen = lambda m: nnx.to_pure_dict(nnx.state(m, lora.FrozenWeight))  # noqa: E731
    import jax

    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), frozen(model), frozen(fresh))
    b_norms = [float(np.abs(np.asarray(v)).max()) for path, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.Param))) if "lora_B" in jax.tree_util.keystr(path)]
    assert b_norms and min(b_norms) > 0  # every adapter trained (PEFT's init: B = 0)

    ours = _logits_ours(model, IDS)
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    np.testing.assert_allclose(_logits_torch(with_adapter, IDS), ours, rtol=1e-4, atol=1e-4)
    merged = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(_logits_torch(merged, IDS), ours, rtol=1e-4, atol=1e-4)
    assert "LoRA: rank 4, alpha 8, targets" in capsys.readouterr().out
    # the adapter alone names its base (the --hf-checkpoint folder, absolute): PEFT's Auto class loads
    # both from another directory, offline, with the trained model's logits
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf_llama)
    np.testing.assert_allclose(_auto_peft_logits(out / "adapter", IDS, tmp_path), ours, rtol=1e-4, atol=1e-4)


def _auto_peft_logits(adapter_dir, ids, tmp_path):
    """peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)'s logits for `ids`, in a fresh
    process started elsewhere with HF_HUB_OFFLINE=1 (read at import: a hub lookup fails, not hangs)."""
    np.save(tmp_path / "ids.npy", ids)
    code = ("import sys, numpy as np, torch, peft\n"
            "m = peft.AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "with torch.no_grad():\n"
            "    x = m(input_ids=torch.from_numpy(np.load('ids.npy').astype(np.int64))).logits.numpy()\n"
            "np.save('logits.npy', x)\n")
    p = subprocess.run([sys.executable, "-c", code, str(adapter_dir)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return np.load(tmp_path / "logits.npy")


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_model_names_cover_the_llama_shapes_and_an_unknown_name_lists_them(capsys):
    from zerojax.models import LlamaConfig

    with pytest.raises(ValueError) as info:  # the shapes LlamaConfig.named offers, from its own message
        LlamaConfig.named("?")
    offered = set(json.loads(str(info.value).split("choose one of ")[1].replace("'", '"')))
    assert set(registry.get("llama").shapes.values()) == offered
    for name in registry.get("llama").shapes:
        assert choice.named_model(name).family == "llama"
    with pytest.raises(SystemExit) as info:
        flags.parse_args(["--model", "llama-9b"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "argument --model: invalid choice: 'llama-9b' (choose from " in err, err
    assert all(name in err for name in registry.shape_names()), err


@pytest.mark.slow
def test_lora_on_gpt2_trains_the_adapters_only(tmp_path, monkeypatch):
    """--model tiny --lora 4: GPT-2's adapters train (every lora_B moves from PEFT's zero init) and
    nothing else: the frozen base is bitwise the one the same seed builds, the trained count is the
    adapters'; --export-hf writes PEFT's adapter folder for GPT-2's module names."""
    import jax
    from flax import nnx

    from zerojax import lora

    example = _example()
    got = _capture(monkeypatch, lora, "save_peft")
    out = tmp_path / "adapter"
    summary = example.main([*TINY, "--steps", "3", "--lora", "4", "--export-hf", str(out)])  # zero2_bf16.json
    model, settings = got["model"], summary["lora"]
    assert summary["family"] == "gpt2" and settings["r"] == 4 and np.isfinite(summary["losses"]).all()
    assert summary["trained_params"] == lora.trainable_count(model)
    fresh = lora.apply(choice.named_model("tiny").build(0, model.dtype, None, param_dtype=settings["base_dtype"]),
                       settings)
    frozen = lambda m: nnx.to_pure_dict(nnx.state(m, lora.FrozenWeight))  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), frozen(model), frozen(fresh))
    b_max = [float(np.abs(np.asarray(v)).max()) for path, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.Param))) if "lora_B" in jax.tree_util.keystr(path)]
    assert len(b_max) == 4 and min(b_max) > 0, b_max  # c_attn, attn.c_proj, c_fc, mlp.c_proj: all trained
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and sorted(config["target_modules"]) == ["c_attn", "c_fc", "c_proj"]


@pytest.mark.parametrize("case", ["offload_param", "quantize alone", "bad section"])
def test_lora_refusals_are_one_line_before_anything_is_built(case, tmp_path):
    """What LoRA cannot run with is refused from the flags and the config alone (no data read, no
    model built): offload_param or pipeline stages (zerojax.lora's layer scans), a LoRA flag
    without a rank, a "lora" section zerojax.lora.from_config_dict refuses."""
    from zerojax.config import ConfigError

    example = _example()
    argv, sections = ["--model", "tiny-llama", *TINY[2:], "--steps", "1", "--lora", "4"], {}
    if case == "offload_param":
        sections = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
        want = (ConfigMismatch, "LoRA with zero_optimization.offload_param.device 'cpu'")
    elif case == "quantize alone":
        argv = [*argv[:-2], "--quantize", "nf4"]
        want = (ConfigMismatch, "--quantize is a LoRA setting: add --lora R")
    else:
        argv = argv[:-2]
        sections = {"lora": {"r": 4, "target_modules": "all-linear", "lora_alhpa": 16}}
        want = (ConfigError, "lora.lora_alhpa: unknown key; did you mean 'lora_alpha'?")
    path = _config_file(tmp_path, **sections)
    with pytest.raises(want[0], match=want[1].replace("(", r"\(")):
        example.main(["--config", str(path), *argv, "--data", str(tmp_path / "never-read.jsonl")])


def test_a_bad_jsonl_line_is_one_error_line_naming_file_and_line(tmp_path):
    # in a process of its own, as a user runs the example: its `__main__` ends a mistake with exit
    # status 1 and that one line, nothing else printed (the refusals above run the same run_cli in-process)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "completion": "there"}\n\n{"prompt": "hi", "completion": 3}\n')
    code, out = _cli("--model", "tiny-llama", *TINY[2:], "--steps", "1", "--data", str(bad))
    assert code == 1 and out.strip() == (f"error: {bad}:3: 'completion' must be a string (got int); each line is "
                                         '{"prompt": "...", "completion": "..."}'), out


@pytest.mark.slow
def test_llama_lora_resumes_with_the_checkpoints_settings_and_ends_with_a_closing_line(tmp_path, capsys):
    """A tiny Llama with LoRA (rank 2, alpha 16) saved at step 2; --resume with neither --model nor a
    LoRA flag takes the checkpoint's model and adapter settings and continues as the uninterrupted
    4-step run, loss for loss. Another model or other LoRA settings are refused in one line naming
    only what differs, with both values, before anything is built. The uninterrupted run also shows
    how every run ends: the `SUMMARY {...}` line for programs (its JSON also in --summary-json's
    file), then one line for people, last."""
    from zerojax.checkpoint.state import CheckpointError

    example = _example()
    ckpt = str(tmp_path / "ckpt")
    run, lora_flags = [*TINY[2:], "--schedule-steps", "40"], ["--lora", "2", "--lora-alpha", "16"]
    straight = example.main(["--model", "tiny-llama", *run, *lora_flags, "--steps", "4",
                             "--summary-json", str(tmp_path / "summary.json")])
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    as_json = json.loads(json.dumps(straight))
    (summary_line,) = [line for line in lines if line.startswith("SUMMARY ")]
    assert json.loads(summary_line[len("SUMMARY "):]) == as_json == json.loads((tmp_path / "summary.json").read_text())
    first, last = straight["losses"][0], straight["losses"][-1]
    assert lines.index(summary_line) < len(lines) - 1
    assert lines[-1].startswith(f"trained 4 steps in {straight['train_seconds']:.1f} s: "
                                f"loss {first:.2f} -> {last:.2f}, "), lines[-1]

    example.main(["--model", "tiny-llama", *run, *lora_flags, "--steps", "2", "--save", ckpt])
    for argv, message in ((["--model", "tiny-qwen3"],
                           "this checkpoint is tiny-llama (llama); use --model tiny-llama (this run asks for "
                           "tiny-qwen3 (qwen3); another --save folder starts it afresh)"),
                          (["--model", "tiny"], "this checkpoint is tiny-llama (llama); use --model tiny-llama"),
                          (["--lora", "4"], "this run's LoRA settings differ from the checkpoint's adapters: r 4 (the "
                                            "checkpoint's: 2); resume without --lora / --lora-alpha"),
                          (["--lora-alpha", "8", "--lora-targets", "q_proj"],
                           "adapters: lora_alpha 8.0 (the checkpoint's: 16.0), target_modules [\"q_proj\"] (the "
                           "checkpoint's: \"all-linear\"); resume without")):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            example.main([*argv, *run, "--steps", "4", "--save", ckpt, "--resume"])
    capsys.readouterr()
    resumed = example.main([*run, "--steps", "4", "--save", ckpt, "--resume"])
    out = capsys.readouterr().out
    assert resumed["model"] == "tiny-llama" and resumed["start_step"] == 2 and resumed["lora"] == straight["lora"]
    assert "note:      lora: the checkpoint's settings (no LoRA flag given)" in out, out
    assert resumed["losses"] == straight["losses"][2:], (resumed["losses"], straight["losses"])
    assert out.rstrip("\n").splitlines()[-1].startswith("trained 2 steps (2 -> 4) in ")
