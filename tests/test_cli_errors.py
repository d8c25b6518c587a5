"""Every `zerojax` command ends a user's mistake in one `error:` line and exit status 1 (argparse's
usage errors: its status 2), never a traceback; `--debug`, before or after the command, shows the
traceback; Ctrl-C outside training is one line and status 130 (the shell's for SIGINT).

Each command runs as a user runs it, in its own process (all of them at once: most fail before jax
is imported). The reference is the process itself: its exit status and what it printed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# `zerojax` started as a terminal's shell starts it, SIGINT at its default: a child inherits an ignored
# SIGINT through exec, and the xdist worker running these tests is at times caught with SIGINT and
# SIGQUIT ignored (as C's system() leaves them while it waits: seen in a child's SigIgn), when Python
# installs no KeyboardInterrupt handler and Ctrl-C does nothing
_AS_FROM_A_SHELL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.executable, [sys.executable, '-m', 'zerojax.cli', *sys.argv[1:]])")


def _start(argv, cwd):
    return subprocess.Popen([sys.executable, "-c", _AS_FROM_A_SHELL, *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistakes")
    (path / "adapter").mkdir()
    (path / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": "/models/base"}))
    (path / "bad.json").write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 5}}')
    return path


MISTAKES = {  # argv -> (exit status, what the last line says)
    ("estimate", "--params", "1e9", "--aot"): (1, "error: --aot needs --model (a model to compile), not --params"),
    # was a ZeroDivisionError
    ("estimate", "--model", "tiny", "--gpus", "0"): (2, "error: argument --gpus: 0 must be >= 1"),
    ("plan", "--devices", "2", "--model", "tiny"): (1, "error: --budget is required without --aot"),
    ("export", "no-such-run", "out"): (1, "error: CKPT no-such-run: no such folder"),
    ("generate", "--hf-checkpoint", "no-such-model", "--prompt", "hi"):
        (1, "error: --hf-checkpoint no-such-model: no such folder"),
    ("chat", "--hf-checkpoint", "adapter"):
        (1, "error: --hf-checkpoint adapter: a PEFT adapter folder (adapter_config.json), "
            "not a model; give its base model to --hf-checkpoint and this folder to "
            "--adapter: --hf-checkpoint /models/base --adapter adapter"),
    ("launch", "--include", "nohost", "train.py"):
        (1, "error: zerojax launch: Hostname 'nohost' not found in hostfile"),
    ("train", "--model", "tiny", "--config", "bad.json"): (1, "  - zero_optimization.stage = 5: expected a value <= 3"),
    ("--debug", "plan", "--devices", "2", "--model", "tiny"): (1, "FlagError: --budget is required without --aot"),
    ("plan", "--devices", "2", "--model", "tiny", "--debug"): (1, "FlagError: --budget is required without --aot"),
}


def test_each_command_ends_a_mistake_in_one_error_line(folder):
    runs = {argv: _start(argv, folder) for argv in MISTAKES}
    for argv, run in runs.items():
        _, err = run.communicate(timeout=300)
        status, says = MISTAKES[argv]
        last = err.strip().splitlines()[-1]
        assert run.returncode == status and says in last, (argv, run.returncode, err)
        errors = [line for line in err.splitlines() if "error: " in line]
        if "--debug" in argv:
            assert "Traceback (most recent call last)" in err, (argv, err)
        else:
            assert "Traceback" not in err and len(errors) == 1, (argv, err)


def test_ctrl_c_outside_training_is_one_line_and_status_130(tmp_path):
    # a model factory that takes its time (a download, a big init): Ctrl-C while it runs
    (tmp_path / "slow_model.py").write_text(
        "import sys, time\n\ndef build():\n    print('building', file=sys.stderr, flush=True)\n"
        "    for _ in range(1200):\n        time.sleep(0.1)\n")
    run = _start(["estimate", "--model", "slow_model:build"], tmp_path)
    assert run.stderr.readline().strip() == "building"
    time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    try:
        _, err = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # how its signals stand, for the report
        with open(f"/proc/{run.pid}/status") as f:
            status = [line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        run.kill()
        run.communicate()
        pytest.fail(f"no exit 60 s after SIGINT; its signal masks: {status}")
    assert run.returncode == 130 and err.strip() == "interrupted (Ctrl-C); --debug shows where", err


def test_chat_without_a_chat_template_says_what_to_use_instead():
    from types import SimpleNamespace

    from zerojax.generation.api import check_chat_template

    with pytest.raises(ValueError) as e:  # was the fine-tuning reader's advice about {"messages"} records
        check_chat_template(SimpleNamespace(path="base/tokenizer.json", chat_template=None))
    said = str(e.value)
    assert "\n" not in said and "no chat template" in said and "zerojax generate --prompt" in said
    check_chat_template(SimpleNamespace(path="x", chat_template=None), template="{{ messages }}")  # given: fine
