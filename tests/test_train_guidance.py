"""What a new user trips on in `zerojax train`, each refused or guided in one line before anything is
built: the RL batch that is not whole groups names the flags that fix it (and docs/rl.md's command
runs on one device as written).

References: the group arithmetic itself (train_batch_size = micro-batch x accumulation x devices,
a multiple of group), `zerojax.rl.rollouts.RolloutOptions`'s default group, the docs' own text.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys

import pytest

from zerojax import cli
from zerojax.rl.rollouts import RolloutOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = 8  # tests/conftest.py's virtual CPU devices


def _doc_commands(name):
    """The `zerojax ...` commands of a doc's fenced blocks, continuation lines joined, comments dropped."""
    fenced, inside = [], False
    with open(os.path.join(REPO, "docs", name)) as f:
        for line in f:
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside:
                fenced.append(line)
    text = "".join(fenced).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip().startswith("zerojax ")]


def test_rl_doc_commands_train_whole_groups_on_one_device():
    commands = [c for c in _doc_commands("rl.md") if "grpo" in c and "--micro-batch" in c]
    assert commands
    for argv in commands:
        options = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--method-option")
        group = int(options.get("group", RolloutOptions.group))
        micro = int(argv[argv.index("--micro-batch") + 1])
        assert micro % group == 0, (argv, group)  # one device, no accumulation: train_batch_size = micro


def test_a_batch_of_no_whole_groups_names_the_flags_that_fix_it(capsys):
    argv = ["train", "--model", "tiny-llama", "--method", "grpo", "--data", "digit", "--seq-len", "11",
            "--micro-batch", "1", "--method-option", "group=3", "--steps", "1"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --method grpo: train_batch_size=8 is not a multiple of group=3"), err
    micro = int(re.search(r"give --micro-batch (\d+)", err).group(1))
    group = int(re.search(r"--method-option group=(\d+)", err).group(1))
    assert micro * DEVICES % 3 == 0 and micro > 1 and (micro - 1) * DEVICES % 3  # the smallest that fits
    assert 1 * DEVICES % group == 0 and 2 <= group < 3


def test_dpo_without_lora_takes_the_precomputed_reference(tmp_path):
    """Full fine-tuning has no adapters to turn off: the reference is the starting model's log-probs,
    computed once; at the first step the policy is that model, so DPO's loss is ln 2 (Rafailov et al.)."""
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}? ", "chosen": "yes", "rejected": "no"}) + "\n"
                             for i in range(24)))
    config = tmp_path / "fp32.json"
    config.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto",
                                  "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    out = tmp_path / "summary.json"
    assert cli.main(["train", "--model", "tiny-llama", "--method", "dpo", "--data", str(prefs), "--config", str(config),
                     "--seq-len", "16", "--micro-batch", "1", "--steps", "1", "--eval-batches", "0",
                     "--summary-json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["method_options"]["reference"] == "precomputed" and summary["lora"] is None
    assert summary["losses"][0] == pytest.approx(math.log(2), abs=1e-5)


def test_reward_specs_resolve_from_the_working_folder_and_are_checked_before_the_build(tmp_path, monkeypatch, capsys):
    from zerojax.rl.rewards import resolve

    (tmp_path / "cwd_rewards.py").write_text(
        "def length(prompts, completions, **fields):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)  # the `zerojax` command's working folder, not on sys.path
    monkeypatch.delitem(sys.modules, "cwd_rewards", raising=False)
    try:
        assert resolve("cwd_rewards:length")(["p", "q"], ["ab", "abcd"]) == [2.0, 4.0]
        grpo = ["train", "--model", "tiny-llama", "--method", "grpo", "--data", "arithmetic", "--micro-batch", "1",
                "--steps", "1", "--method-option", "group=8"]
        assert cli.main([*grpo, "--method-option", "reward=cwd_rewards:lenght"]) == 1  # the module found, a typo in it
        assert "module 'cwd_rewards' has no attribute 'lenght'" in capsys.readouterr().err
    finally:
        sys.modules.pop("cwd_rewards", None)
    # a field the prompt records do not have: refused before the model is built (no run header)
    assert cli.main([*grpo, "--method-option", "reward=exact_match:anwser"]) == 1
    out, err = capsys.readouterr()
    assert "the prompt records have no 'anwser' field" in err and "did you mean exact_match:answer?" in err
    assert "run:" not in out


def test_small_trips_are_named_in_one_line(tmp_path, capsys):
    from zerojax import methods
    from zerojax.rl import tasks
    from zerojax.trainer.flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}: {m.what}" in said for name, m in methods.methods().items())  # every registered method

    def refused(*argv):
        assert cli.main(["train", "--model", "tiny-llama", "--steps", "1", *argv]) == 1
        out, err = capsys.readouterr()
        assert "run:" not in out and err.count("\n") == 1 and err.startswith("error: "), (out, err)
        return err

    assert "did you mean dpo?" in refused("--method", "DPO")
    err = refused("--data", "digits")
    assert f"the built-in tasks ({', '.join(tasks.TASKS)}; did you mean digit?)" in err and "--method grpo" in err
    prompts, pairs = tmp_path / "prompts.jsonl", tmp_path / "pairs.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    assert "an RL prompt record" in refused("--data", str(prompts))
    from zerojax.data.rows import ByteTokens
    from zerojax.rl.prompts import load_prompts

    # the run header's data line: "N prompts", not the file's name again
    assert load_prompts(str(prompts), ByteTokens(), 32).what == "prompts"
    digit = load_prompts("digit", ByteTokens(), 32, n=4)
    assert (digit.what, digit.task) == ("prompts of the built-in task 'digit'", "digit")
    assert "a preference pair" in refused("--method", "grpo", "--data", str(pairs), "--micro-batch", "1")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/b"}))
    assert cli.main(["train", "--hf-checkpoint", str(adapter)]) == 1
    assert "a PEFT adapter folder (adapter_config.json), not a model; give its base model to --hf-checkpoint (/b)" \
        in capsys.readouterr().err


def test_the_summary_line_lists_the_losses_of_a_short_run_only():
    from zerojax.trainer.setup import SUMMARY_LINE_LOSSES, summary_line

    short = {"first_loss": 2.0, "last_loss": 1.0, "losses": [2.0, 1.0]}
    assert json.loads(summary_line(short)) == short
    losses = [float(i) for i in range(SUMMARY_LINE_LOSSES + 1)]
    long_ = json.loads(summary_line({"first_loss": 0.0, "last_loss": losses[-1], "losses": losses}))
    assert long_ == {"first_loss": 0.0, "last_loss": losses[-1], "loss_count": len(losses)}
