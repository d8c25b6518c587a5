"""--resume continues on the run's own data: the checkpoint records the data source (--data as an
absolute path), a resume without --data reads it (and says so), another --data is a warning naming
both.

Reference: the same run uninterrupted; its losses after the checkpoint's step are the resumed run's.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from zerojax import cli

RUN = ["train", "--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--eval-batches", "0"]


@pytest.fixture(scope="module")
def fp32_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "fp32.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto",
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    return str(path)


def _losses(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    assert cli.main([*RUN, "--summary-json", str(out), *argv]) == 0
    return json.loads(out.read_text())["losses"]


def test_resume_without_data_continues_on_the_runs_file(fp32_config, tmp_path, capsys, monkeypatch):
    data = tmp_path / "digits.txt"  # nothing like the embedded corpus (Python's documentation)
    data.write_text("".join(f"{i * 7919 % 10007:05d}\n" for i in range(2000)))
    other = tmp_path / "other.txt"
    other.write_text("abc\n" * 2000)
    ck = tmp_path / "ck"
    common = ["--config", fp32_config, "--lr", "1e-2", "--steps", "4", "--save", str(ck)]
    monkeypatch.chdir(tmp_path)  # a relative --data: the checkpoint records it absolute
    whole = _losses(tmp_path, "whole", *common, "--data", "digits.txt", "--save-every", "2")
    monkeypatch.chdir("/")
    (ck / "latest").write_text("global_step2")  # as if the run had stopped at step 2
    capsys.readouterr()
    resumed = _losses(tmp_path, "resumed", *common, "--resume")
    assert f"data: the checkpoint's run's, {data}" in capsys.readouterr().out
    np.testing.assert_array_equal(resumed, whole[2:])

    # at step 4 now: another --data is said (nothing left to train)
    _losses(tmp_path, "other", *common, "--resume", "--data", str(other))
    said = capsys.readouterr().out
    assert f"warning: --data {other} is not the data this checkpoint trained on ({data})" in said
