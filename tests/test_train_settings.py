"""`zerojax train`'s settings: the config checked as written, as `zerojax.load_config` checks it,
before any flag rewrites a key; a learning rate that is negative or that float32 cannot hold is
refused wherever it is read; a flag that replaces a config value says so and is what trains.

References: `zerojax.load_config` on the same file (the library's own verdict, which the command
must not soften), numpy's float32 (where 1e39 is inf), and the lr the engine's step reports.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import zerojax
from zerojax import cli, trainer
from zerojax.trainer.flags import parse_args

BATCH_AUTOS = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
               "gradient_accumulation_steps": "auto"}
FILL = {"optimizer.params.lr": 1e-3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def _config(tmp_path, name, **sections):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**BATCH_AUTOS, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, **sections}))
    return str(path)


@pytest.mark.parametrize("sections", [
    {"fp16": {"enabled": True}, "bf16": {"enabled": True}},  # the precision flags used to be set first
    {"bf16": {"enabled": "banana"}},
    {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -0.01}}},  # trained with a negative rate
    {"optimizer": {"type": "AdamW", "params": {"lr": 1e39}}},  # inf in float32
], ids=["fp16-and-bf16", "enabled-banana", "negative-warmup-max-lr", "lr-past-float32"])
def test_train_refuses_what_load_config_refuses(sections, tmp_path, capsys):
    path = _config(tmp_path, "bad", **sections)
    with pytest.raises(zerojax.ConfigError) as library:
        zerojax.load_config(path, fill=FILL)
    assert cli.main(["train", "--model", "tiny", "--config", path, "--steps", "1"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("error: ") and path in said
    assert all(problem in said for problem in library.value.problems), (said, library.value.problems)


def test_lr_flag_past_float32_or_negative_is_refused_naming_the_flag(capsys):
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1e39))  # what the update would compute with
    for value in ("1e39", "-0.01", "nan"):
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "--model", "tiny", "--lr", value, "--steps", "1"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --lr: " in err and value in err.split("argument --lr: ")[1]


def test_a_flag_replacing_a_config_value_says_so_and_trains_with_it(tmp_path, capsys):
    path = tmp_path / "explicit.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                                "activation_checkpointing": {"partition_activations": True}}))
    seen = []
    run = trainer.Trainer(parse_args([
        "--model", "tiny", "--config", str(path), "--lr", "0.002", "--micro-batch", "1", "--remat", "none",
        "--seq-len", "8", "--steps", "1", "--eval-batches", "0"]))
    run.add_hook(1, lambda info: seen.append(float(info.metrics["lr"])))
    summary = run.run()
    header = capsys.readouterr().out
    assert "--lr 0.002 replaces the config's optimizer.params.lr = 0.01" in header
    assert "--micro-batch 1 replaces the config's train_micro_batch_size_per_gpu = 2" in header
    assert "remat:     none (--remat, replacing the config's activation_checkpointing (full))" in header
    assert seen == [pytest.approx(0.002)] and summary["train_batch_size"] == 8  # 1 a device x the 8 devices


def _shipped(name):
    import pathlib

    return str(pathlib.Path(__file__).resolve().parent.parent / "configs" / name)


def test_bf16_flag_trains_a_shipped_fp16_config_as_its_bf16_rewrite(tmp_path, capsys):
    """--bf16 over configs/zero2_fp16.json: its fp16 section off (one header line), and the run is the
    one a user gets by rewriting the file by hand (the fp16 section replaced by bf16 enabled)."""
    shipped = _shipped("zero2_fp16.json")
    rewritten = json.loads(open(shipped).read())
    del rewritten["fp16"]
    rewritten["bf16"] = {"enabled": True}
    (tmp_path / "by_hand.json").write_text(json.dumps(rewritten))
    # one step: its loss is computed in the run's precision before any update
    run = ["train", "--model", "tiny", "--seq-len", "8", "--micro-batch", "1", "--steps", "1", "--eval-batches", "0"]
    summaries = []
    for argv in (["--config", shipped, "--bf16"], ["--config", str(tmp_path / "by_hand.json")]):
        out = tmp_path / f"summary{len(summaries)}.json"
        assert cli.main([*run, *argv, "--summary-json", str(out)]) == 0
        summaries.append(json.loads(out.read_text()))
    header = capsys.readouterr().out
    said = [line for line in header.splitlines() if "--bf16 replaces" in line]
    assert len(said) == 1 and "fp16.enabled = true" in said[0] and "fp16 section off" in said[0], header
    flagged, by_hand = summaries
    assert flagged["precision"] == by_hand["precision"] == "bf16"
    assert flagged["losses"] == by_hand["losses"]


def test_an_fp16_config_on_cpu_is_one_line_naming_bf16(capsys):
    assert cli.main(["train", "--model", "tiny", "--config", _shipped("zero2_fp16.json"), "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "add --bf16" in err[0], err
    assert "zero2_fp16.json" in err[0], err
