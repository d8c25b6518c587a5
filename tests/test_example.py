"""The main job, short: examples/gpt2_large.py trains a tiny GPT-2 on the embedded corpus.

References: the loss must fall clearly from its value at the first step (the job works), and
the config's csv_monitor writes DeepSpeed's files (deepspeed/monitor/csv_monitor.py: one
`Train_Samples_<name>.csv` per event, header `step,<name>`, one row per optimizer step indexed by
global samples), with the losses the engine reported.
"""
import csv
import importlib.util
import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example():
    spec = importlib.util.spec_from_file_location("gpt2_large", os.path.join(ROOT, "examples", "gpt2_large.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_trains_and_writes_deepspeed_csv_logs(tmp_path):
    with open(os.path.join(ROOT, "configs", "zero2_bf16.json")) as f:
        cfg = json.load(f)
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "tiny"}
    cfg["steps_per_print"] = 10
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    steps = 30
    summary = _example().main(["--config", str(path), "--model", "tiny", "--steps", str(steps),
                               "--seq-len", "64", "--micro-batch", "1", "--eval-batches", "2"])
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary
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


# --------------------------------------------------------------------------- issue #20: every flag,
# file and resume does what the user asked, through the example's entry point

import subprocess  # noqa: E402
import sys  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "gpt2_large.py")
TINY = ["--model", "tiny", "--seq-len", "32", "--micro-batch", "1", "--eval-batches", "0"]


def _cli(*argv, timeout=300):
    """The example as a user runs it: exit status and everything it printed."""
    p = subprocess.run([sys.executable, EXAMPLE, *argv], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "argument --steps: -1 must be >= 0"),
    # without "=": argparse alone would answer "expected one argument"
    (["--lr", "-1e-3"], "argument --lr: -0.001 must be >= 0.0 (as torch.optim.AdamW"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    (["--seq-len", "1"], "argument --seq-len: 1 must be >= 2"),
    (["--keep", "0", "--save", "d"], "argument --keep: 0 must be >= 1"),
    (["--keep", "2"], "--keep needs --save DIR"),
    (["--resume"], "--resume needs --save DIR"),
    (["--micro-batch", "0"], "argument --micro-batch: 0 must be >= 1 (or auto)"),
])
def test_bad_flag_values_are_refused_with_the_reason(argv, message, capsys):
    # in-process through the example's own parser: each `python gpt2_large.py` costs a jax import
    # (its __main__ imports zerojax's error types first), ~3.5 CPU seconds; the entry point
    # itself is run by the test below
    with pytest.raises(SystemExit) as info:
        _example().parse_args(argv)
    out = capsys.readouterr().err
    assert info.value.code == 2 and message in out, out  # argparse's usage-error status


def test_a_bad_flag_through_the_entry_point():
    code, out = _cli("--steps", "-1")
    assert code == 2 and "argument --steps: -1 must be >= 0" in out, out


def test_data_errors_name_file_and_place_before_any_compile(tmp_path):
    # the three through the entry point; every case is in tests/test_data.py
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "model.bin.txt").write_bytes(b"PK\x03\x04" + bytes(range(256)))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "no closing quote}\n')
    for name, message in [("empty.txt", "empty.txt: no text"),
                          ("model.bin.txt", "model.bin.txt: byte offset 4: a NUL byte, so this is a binary file"),
                          ("bad.jsonl", "bad.jsonl:2: column 10: not JSON (Unterminated string")]:
        code, out = _cli("--data", str(tmp_path / name), *TINY, "--steps", "1")
        assert code == 1 and f"error: {tmp_path / name}" in out and message in out, (name, out)
        assert "Traceback" not in out and "run: GPT-2" not in out, out  # refused before the model


def _summary(out):
    return json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[8:])


def test_resume_matches_the_uninterrupted_run_step_for_step(tmp_path, capsys):
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
    straight = example.main([*TINY, "--steps", "4", "--schedule-steps", "40"])
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


def test_one_step_stage3_lr0_and_cpu_precision_default(tmp_path, capsys):
    """--lr 0 is honoured (the engine reports lr 0 for the step, DeepSpeed's csv_monitor file),
    one step gives a last loss, and a stage-3 run whose tensors all sit under the persistence
    threshold (tiny GPT-2: the largest leaf is 64*256 elements < DeepSpeed's 1e5 default)
    warns once naming the key."""
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
    warning = "replicated on every device: tensors under zero_optimization.stage3_param_persistence_threshold"
    assert out.count(warning) == 1, out


def test_offload_loop_flag_trains_like_the_default_and_is_checked_against_the_config(capsys):
    """--offload-loop host with configs/zero2_offload_optimizer.json: the same losses as the default
    loop (the same arithmetic; fp32 on CPU); with a config that does not offload the optimizer it is
    refused before the engine is built, naming the key and a config that fits."""
    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_offload_optimizer.json")
    runs = [example.main(["--config", cfg, *TINY, "--steps", "2", *flag]) for flag in ([], ["--offload-loop", "host"])]
    assert runs[1]["last_loss"] == pytest.approx(runs[0]["last_loss"], rel=1e-5)
    out = capsys.readouterr().out
    assert "optimizer offload: in_place loop" in out and "optimizer offload: host loop, 1 layer group(s)" in out
    # --adam-mu-dtype reaches the engine (its first moment stored in bf16); the config's bf16 with
    # the host loop keeps the master split by default
    example.main(["--config", cfg, *TINY, "--steps", "1", "--offload-loop", "host", "--adam-mu-dtype", "bfloat16"])
    assert "master split (bf16 copy + 16-bit host remainder), first moment bfloat16" in capsys.readouterr().out
    with pytest.raises(example.ConfigMismatch, match="offload_optimizer.device .cpu.*zero2_offload_optimizer"):
        example.main(["--config", os.path.join(ROOT, "configs", "zero2_bf16.json"), *TINY, "--steps", "1",
                      "--offload-loop", "host"])


def test_master_split_flag_trains_as_without_it_and_is_refused_under_offload(capsys, monkeypatch):
    """--master-split (EngineOptions.master_split) reaches the engine and trains as the whole fp32
    master does (the same losses); with a config that offloads the optimizer it is refused before
    anything is built, naming the flag and a config that fits."""
    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_bf16.json")
    runs = [example.main(["--config", cfg, *TINY, "--steps", "3", *flag]) for flag in ([], ["--master-split"])]
    assert [r["master_split"] for r in runs] == [False, True]
    assert runs[1]["losses"] == runs[0]["losses"]
    # micro-batch auto: the planner compiles its candidates with the flag (the same run), and where
    # its choice offloads, the flag gives way with a note (the user's config did not offload)
    from zerojax import load_config
    from zerojax.planning import memory

    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    planned = example.main(["--config", cfg, *TINY, "--steps", "3", "--master-split", "--micro-batch", "auto"])
    assert planned["master_split"] is True and planned["last_loss"] < planned["first_loss"]
    assert "micro-batch auto: remat none, micro-batch 4 x 1 accumulation, stage 2, offload none" in capsys.readouterr().out
    off = load_config(os.path.join(ROOT, "configs", "zero2_offload_optimizer.json"),
                      fill={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                            "optimizer.params.lr": 1e-3, "optimizer.params.weight_decay": 0.0,
                            "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": 1})
    options = example._engine_options(example.parse_args([*TINY, "--master-split"]), off, planned=True)
    assert options.master_split is False
    assert "--master-split: the planner's choice offloads" in capsys.readouterr().out
    with pytest.raises(example.ConfigMismatch, match="--master-split needs bf16 and no offload.*"
                                                     "offload_optimizer.device .cpu.*zero2_bf16.json"):
        example.main(["--config", os.path.join(ROOT, "configs", "zero2_offload_optimizer.json"), *TINY,
                      "--steps", "1", "--master-split"])


def test_offload_hint_names_the_missing_flags_and_their_bytes():
    """micro-batch auto's note where the planner's choice offloads a bf16 run: the flags not given and
    the model state each keeps off every device, counted independently: --master-split 2 bytes a
    parameter (an int16 remainder for the fp32 master's 4), --adam-mu-dtype bfloat16 2 (Adam's first
    moment), divided over the data ranks from stage 1 (not at stage 0); a flag given is not named;
    no note without offload, in fp32, or with both flags."""
    import jax.numpy as jnp

    from zerojax import EngineOptions
    from zerojax.planning.planner import Plan

    example = _example()
    P, GiB = 1_557_611_200, 2**30  # GPT-2 XL's parameters
    offloading = Plan(3, 8, remat="full", offload_optimizer=True, offload_ratio=0.5)
    split, mu = "--master-split {:.2f} GiB (", "--adam-mu-dtype bfloat16 {:.2f} GiB ("
    for options, named, absent in ((EngineOptions(), (split, mu), ()),
                                   (EngineOptions(master_split=True), (mu,), (split,)),
                                   (EngineOptions(adam_mu_dtype="bfloat16"), (split,), (mu,))):
        for n_data in (1, 4):
            hint = example._offload_hint(offloading, P, n_data, options, jnp.bfloat16)
            assert hint.startswith("micro-batch auto: this plan offloads;")
            for flag in named:  # 2 bytes a parameter each, over the data ranks
                assert flag.format(2 * P / n_data / GiB) in hint
            for flag in absent:
                assert flag.split(" {")[0] not in hint
    both = EngineOptions(master_split=True, adam_mu_dtype="bfloat16")
    assert example._offload_hint(offloading, P, 1, both, jnp.bfloat16) is None
    assert example._offload_hint(offloading, P, 1, EngineOptions(), jnp.float32) is None
    assert example._offload_hint(Plan(2, 8, remat="full"), P, 1, EngineOptions(), jnp.bfloat16) is None
    stage0 = Plan(0, 8, remat="full", offload_optimizer=True)
    assert split.format(2 * P / GiB) in example._offload_hint(stage0, P, 4, EngineOptions(), jnp.bfloat16)


def test_offload_loop_auto_takes_host_where_its_step_fits(capsys, monkeypatch):
    """No --offload-loop, a config offloading the optimizer to cpu, a device that reports its memory
    (here a stand-in budget): "host" where its step (compiled on an abstract engine) fits, trained
    as the in-place loop trains (1e-5, as above); "in_place" where it would not, naming the bytes;
    no budget known (CPU as it is): "in_place"."""
    from flax import nnx

    import zerojax
    from zerojax.planning import memory
    from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss

    example = _example()
    cfg = os.path.join(ROOT, "configs", "zero2_offload_optimizer.json")
    args = ["--config", cfg, *TINY, "--steps", "2"]
    plain = example.main(args)
    assert "in_place loop, 2 layer group(s), master fp32, first moment fp32 (default; this device reports no " \
           "memory limit" in capsys.readouterr().out
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
    loop, why = example._offload_loop_auto(loaded, make, 32, gpt2_loss)
    assert loop == "in_place" and why.startswith('auto: "host" would need ') and why.endswith("of the device's 1.00 MiB")
    # fp16 (its loss-scale skips untested in the host loop: fp16 matmuls do not run on CPU): in_place
    fp16 = zerojax.load_config({**loaded.to_dict(), "bf16": {"enabled": False}, "fp16": {"enabled": True}})
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    assert example._offload_loop_auto(fp16, make, 32, gpt2_loss)[0] == "in_place"
    # several processes: "host" only where it fits on every one (their answers gathered)
    import jax
    from jax.experimental import multihost_utils
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for answers, want, said in (([True, False], "in_place", 'auto: "host" fits here but not on every process'),
                                ([True, True], "host", "auto: its step needs")):
        monkeypatch.setattr(multihost_utils, "process_allgather", lambda x, a=answers: np.asarray(a)[:, None])
        loop, why = example._offload_loop_auto(loaded, make, 32, gpt2_loss)
        assert loop == want and why.startswith(said), why


def test_mfu_is_reported_against_the_measured_ceiling_or_the_flag(capsys):
    """The example's MFU: tokens/s x the model's FLOPs a token (flops_per_token, checked against
    the written-out count in test_gpt2) over the bf16 matmul ceiling it measured at start
    (zerojax.planning.ceiling), or over --peak-tflops where given; the header says which."""
    from zerojax.models.gpt2 import GPT2Config, flops_per_token

    example = _example()
    fpt = flops_per_token(GPT2Config.named("tiny"), 32)
    for flags, basis in ((["--peak-tflops", "2.5"], "--peak-tflops"), ([], "the bf16 matmul ceiling measured here")):
        run = example.main([*TINY, "--steps", "3", *flags])
        assert f"TFLOP/s per device ({basis})" in capsys.readouterr().out
        against = run["mfu_against_tflops"]
        assert against == 2.5 if flags else against > 0
        assert run["mfu"] == pytest.approx(run["tokens_per_s_per_device"] * fpt / (against * 1e12), rel=2e-2, abs=1e-4)


def test_steps_zero_evaluates_only(monkeypatch, capsys):
    """--steps 0: evaluation only; no step is timed, so no MFU and no ceiling measured for it."""
    from zerojax.planning import ceiling

    monkeypatch.setattr(ceiling, "measure_matmul_ceiling", lambda *a, **k: pytest.fail("measured for no step"))
    summary = _example().main([*TINY, "--steps", "0", "--eval-batches", "1"])
    assert summary["losses"] == [] and summary["last_loss"] is None and summary["val_loss"] > 0
    assert "mfu" not in summary and "no MFU (fewer than 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("sections, flag, device, expect", [
    # the config decides when it enables a mode (the flag must agree, as HF's "mismatch" check)
    ({"bf16": {"enabled": True}}, None, "cpu", ("bf16", {"bf16": True})),
    ({"bf16": {"enabled": True}}, "bf16", "gpu9", ("bf16", {"bf16": True})),
    ({"bf16": {"enabled": True}}, "fp16", "gpu9", "--fp16 asks for fp16, but the config sets bf16.enabled: true"),
    # "auto" (or no section, as the guide's config has no bf16): the flag, else the default
    ({"fp16": {"enabled": "auto"}}, None, "gpu9", ("bf16", {"bf16": True, "fp16": False})),
    ({"fp16": {"enabled": "auto"}}, "fp16", "gpu9", ("fp16", {"fp16": True})),
    ({"fp16": {"enabled": "auto"}}, None, "cpu", ("fp32", {"fp16": False})),
    ({"fp16": {"enabled": "auto"}}, None, "gpu7", ("fp32", {"fp16": False})),  # V100: no fast bf16
    ({"bfloat16": {"enabled": "auto"}}, "bf16", "cpu", ("bf16", {"bfloat16": True})),
    ({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, "fp32", "gpu9", ("fp32", {"bf16": False, "fp16": False})),
    # a mode the config turns off is never chosen
    ({"bf16": {"enabled": False}}, None, "gpu9", ("fp32", {"bf16": False})),
    ({"bf16": {"enabled": False}}, "bf16", "gpu9", "--bf16 asks for bf16, but the config sets bf16.enabled: false"),
])
def test_precision_resolved_as_hugging_face_fills_it(sections, flag, device, expect):
    from types import SimpleNamespace

    example = _example()
    dev = {"cpu": SimpleNamespace(platform="cpu", device_kind="cpu"),
           "gpu9": SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0"),
           "gpu7": SimpleNamespace(platform="gpu", device_kind="Tesla V100", compute_capability="7.0")}[device]
    raw = {"train_batch_size": 8, **sections}
    if isinstance(expect, str):
        with pytest.raises(example.ConfigMismatch, match=expect.replace("(", r"\(")):
            example.resolve_precision(raw, flag, dev)
        return
    out, mode, _ = example.resolve_precision(raw, flag, dev)
    assert mode == expect[0] and {k: out[k]["enabled"] for k in expect[1]} == expect[1]
    import zerojax
    from zerojax.precision import compute_dtype

    assert compute_dtype(zerojax.load_config(out)).name == {"fp32": "float32", "bf16": "bfloat16",
                                                             "fp16": "float16"}[mode]
