"""A method's own metrics (GRPO's reward/mean, policy/kl, ...) reach DeepSpeed's monitors beside the
loss: `Monitor.record_method` unit-tested with a csv_monitor section, then one short `zerojax train
--method grpo` whose CSV of reward/mean holds the reward the run's own log lines print (the
reference: the trainer's stdout, which does not go through the monitor)."""
import csv
import json
import types

import numpy as np

from zerojax import cli
from zerojax.engine.monitor import Monitor


def _csv(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_record_method_writes_each_slash_metric_as_its_own_csv(tmp_path):
    section = types.SimpleNamespace(enabled=True, output_path=str(tmp_path), job_name="j")
    cfg = types.SimpleNamespace(csv_monitor=section, tensorboard=None, wandb=None, fp16=None)
    mon = Monitor(cfg)
    mon.record(8, {"loss": 1.5, "lr": 0.1, "reward/mean": 9.0})  # the engine's: DeepSpeed's names only
    mon.record_method(8, {"loss": 1.5, "reward/mean": 0.25, "policy/kl": np.float32(0.5), "hist/x": np.zeros(3)})
    mon.record_method(16, {"reward/mean": 0.75})
    mon.close()
    assert _csv(tmp_path / "j" / "Train_Samples_reward_mean.csv") == [["step", "mean"], ["8", "0.25"],
                                                                      ["16", "0.75"]]
    assert _csv(tmp_path / "j" / "Train_Samples_policy_kl.csv") == [["step", "kl"], ["8", "0.5"]]
    assert _csv(tmp_path / "j" / "Train_Samples_train_loss.csv") == [["step", "train_loss"], ["8", "1.5"]]
    assert not (tmp_path / "j" / "Train_Samples_hist_x.csv").exists()  # not a scalar


def test_grpo_run_logs_its_reward_per_step_to_the_csv_monitor(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "g"}}))
    steps = 2
    assert cli.main(["train", "--model", "tiny-llama", "--method", "grpo", "--data", "digit", "--config", str(config),
                     "--seq-len", "11", "--micro-batch", "1", "--method-option", "group=8", "--method-option",
                     "kl_coef=0.0", "--steps", str(steps), "--eval-batches", "0"]) == 0
    out = capsys.readouterr().out
    last = [line for line in out.splitlines() if line.startswith(f"step {steps}/{steps}:")]
    printed = float(last[0].split("reward/mean ")[1].split(",")[0])
    rows = _csv(tmp_path / "logs" / "g" / "Train_Samples_reward_mean.csv")
    assert rows[0] == ["step", "mean"] and len(rows) == 1 + steps
    assert [int(r[0]) for r in rows[1:]] == [8 * k for k in range(1, steps + 1)]  # global samples, 8 rows a step
    assert abs(float(rows[-1][1]) - printed) < 5e-4  # the log line prints 3 decimals
    assert (tmp_path / "logs" / "g" / "Train_Samples_train_loss.csv").exists()
