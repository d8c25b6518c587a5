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
