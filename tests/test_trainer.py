"""The trainer (`zerojax.trainer`) as `zerojax train` runs it: methods plug in as a loss and a data
reader (`--method dpo`, `--method reward`), hooks run every N steps, a resume keeps the method.

References: DPO's loss at its first step, where the policy is its reference (LoRA's B = 0, the
reference the base with the adapters off), is ln 2 (Rafailov et al.); the exported reward model
is scored by transformers' `AutoModelForSequenceClassification` as zerojax's own reader scores it.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from zerojax import cli
from zerojax.checkpoint.state import CheckpointError

ROWS = 8  # 1 a device: the suite's 8 CPU devices


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """Preference pairs a byte-level model learns in a few steps: one answer always preferred."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    with open(path, "w") as f:
        for _ in range(96):
            a, b = (int(x) for x in rng.integers(1, 10, 2))
            f.write(json.dumps({"prompt": f"is {a}+{b} even? ", "chosen": "yes", "rejected": "no"}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def fp32_config(tmp_path_factory):
    """configs/zero2_bf16.json computing in fp32 (bf16 off): exact references on CPU."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "configs", "zero2_bf16.json")) as f:
        cfg = json.load(f)
    cfg["bf16"] = {"enabled": False}
    path = tmp_path_factory.mktemp("cfg") / "zero2_fp32.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def train(tmp_path, *argv):
    out = tmp_path / "summary.json"
    assert cli.main(["train", "--model", "tiny-llama", "--seq-len", "16", "--micro-batch", "1", "--eval-batches", "1",
                     "--summary-json", str(out), *argv]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_dpo_through_zerojax_train_starts_at_ln2_and_widens_the_margin(prefs, fp32_config, tmp_path, capsys):
    summary = train(tmp_path, "--method", "dpo", "--data", prefs, "--lora", "8", "--lr", "1e-2", "--steps", "16",
                    "--config", fp32_config,
                    "--method-option", "beta=0.5", "--save", str(tmp_path / "ck"), "--save-every", "8")
    assert summary["method"] == "dpo" and summary["method_options"]["beta"] == 0.5
    assert summary["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert summary["method_metrics"]["rewards/margins"] > 0.05, summary["method_metrics"]
    assert min(summary["losses"][-4:]) < math.log(2) - 0.02, summary["losses"]
    out = capsys.readouterr().out
    assert "rewards/margins" in out.split("step 10/16: ")[1].splitlines()[0]
    # a pair trains its chosen and its rejected sequence: 8 pairs x 2 x 16 tokens a step
    assert "seq 16: 256 tokens/step (2 sequences a row)" in out
    # --save-every 8: steps 8 and 16, and the run's end does not save step 16 twice
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step16", "global_step8", "latest"]
    assert out.count("checkpoint saved") == 2
    # a resume keeps the method: another one is refused naming both
    with pytest.raises(CheckpointError, match="trained --method dpo, this run asks for --method sft"):
        from zerojax import trainer

        trainer.main(["--model", "tiny-llama", "--seq-len", "16", "--micro-batch", "1", "--lora", "8",
                      "--save", str(tmp_path / "ck"), "--resume", "--steps", "20"])


@pytest.mark.slow
def test_reward_model_through_zerojax_train_exports_what_transformers_scores(prefs, fp32_config, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification

    from zerojax.methods.reward import reward_from_hf

    summary = train(tmp_path, "--method", "reward", "--data", prefs, "--lr", "3e-3", "--steps", "12",
                    "--method-option", "pad_token_id=0",
                    "--config", fp32_config, "--export-hf", str(tmp_path / "rm"))
    assert summary["method"] == "reward" and summary["last_loss"] < summary["first_loss"], summary
    ids = np.random.default_rng(1).integers(1, 256, (3, 12)).astype(np.int64)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits[:, 0].numpy()
    ours = np.asarray(reward_from_hf(str(tmp_path / "rm"), pad_token_id=0)(ids.astype(np.int32)))
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)


def test_methods_and_their_options_are_checked_before_anything_is_built(prefs, tmp_path, capsys):
    from zerojax import trainer
    from zerojax.data.text import DataError
    from zerojax.trainer.errors import ConfigMismatch

    with pytest.raises(ConfigMismatch, match="--method dop: not a training method; choose sft or dpo"):
        trainer.main(["--model", "tiny-llama", "--method", "dop", "--data", prefs, "--steps", "1"])
    with pytest.raises(ConfigMismatch, match="unknown option 'bta'; did you mean 'beta'"):
        trainer.main(["--model", "tiny-llama", "--method", "dpo", "--method-option", "bta=1", "--data", prefs])
    with pytest.raises(DataError, match="no pad token.*--method-option pad_token_id=N"):
        trainer.main(["--model", "tiny-llama", "--method", "reward", "--data", prefs, "--steps", "1"])
    with pytest.raises(SystemExit):
        trainer.main(["--method-option", "beta=1"])
    assert "--method-option needs --method NAME" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"  # prompts, no task
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in map(json.loads, open(prefs))))
    with pytest.raises(ConfigMismatch, match="--method ppo: method 'ppo': no reward; give --method-option reward="):
        trainer.main(["--model", "tiny-llama", "--method", "ppo", "--data", str(prompts), "--steps", "1"])
    with pytest.raises(DataError, match="a preference pair .* not an RL prompt"):
        trainer.main(["--model", "tiny-llama", "--method", "ppo", "--data", prefs, "--steps", "1"])
    with pytest.raises(ConfigMismatch, match="--method grpo: train_batch_size=8 is not a multiple of group=3"):
        trainer.main(["--model", "tiny-llama", "--method", "grpo", "--data", "digit", "--method-option", "group=3",
                      "--micro-batch", "1", "--steps", "1"])
    with pytest.raises(DataError, match="--sample-prompts nope.txt: no such file"):
        trainer.main(["--model", "tiny-llama", "--sample-prompts", "nope.txt", "--steps", "1"])


def test_a_programs_own_hook_runs_every_n_steps(tmp_path):
    from zerojax import trainer
    from zerojax.trainer.flags import parse_args

    seen = []
    run = trainer.Trainer(parse_args(["--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--steps", "7",
                                      "--eval-batches", "0"]))
    run.add_hook(3, lambda info: seen.append((info.step, float(info.metrics["loss"]))))
    summary = run.run()
    assert [s for s, _ in seen] == [3, 6]
    assert [loss for _, loss in seen] == pytest.approx([summary["losses"][2], summary["losses"][5]])
    with pytest.raises(ValueError, match="every=0"):
        run.add_hook(0, print)


@pytest.mark.slow
def test_mlp_tile_trains_as_the_untiled_mlp(fp32_config, tmp_path, capsys, monkeypatch):
    """--mlp-tile 4 on a tiny Llama, 16-token rows (four pieces a row): the losses of the untiled
    run. Each position's MLP is the same arithmetic; only the weight gradients' sums over the row
    run piece by piece, an order fp32 may round differently (rtol 1e-5; on CPU they come out
    equal). --mlp-tile auto hands the tile to the planner of --micro-batch auto (a device limit
    stands in for a GPU's): on rows this short its one choice is untiled."""
    from zerojax.engine import memory

    argv = ("--config", fp32_config, "--steps", "3", "--eval-batches", "0")
    untiled = train(tmp_path, *argv)
    tiled = train(tmp_path, *argv, "--mlp-tile", "4")
    assert (untiled["mlp_tile"], tiled["mlp_tile"]) == (None, 4)
    np.testing.assert_allclose(tiled["losses"], untiled["losses"], rtol=1e-5)
    assert "  MLP tile:  4 (--mlp-tile)" in capsys.readouterr().out
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    planned = train(tmp_path, "--config", fp32_config, "--steps", "1", "--eval-batches", "0",
                    "--micro-batch", "auto", "--mlp-tile", "auto")
    assert planned["mlp_tile"] is None
    assert "  MLP tile:  none (--mlp-tile auto: chosen by the planner)" in capsys.readouterr().out


def test_mlp_tile_is_refused_in_one_line_before_anything_is_read(capsys):
    """GPT-2 has no tiled MLP: `zerojax train` ends with one line naming the flag and the fix, before
    the data is read (a missing --data file would otherwise be the error) and so before any compile;
    auto without the planner of --micro-batch auto, and a tile < 1, are refused too."""
    assert cli.main(["train", "--model", "tiny", "--mlp-tile", "4", "--data", "no-such-file.txt"]) == 1
    assert capsys.readouterr().err == ("error: --mlp-tile 4: GPT-2 has no tiled MLP (its model takes no mlp_tile); "
                                       "drop --mlp-tile, or train a Llama-family model\n")
    assert cli.main(["train", "--model", "tiny-llama", "--micro-batch", "2", "--mlp-tile", "auto"]) == 1
    assert capsys.readouterr().err.startswith("error: --mlp-tile auto: the planner of --micro-batch auto chooses")
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", "tiny-llama", "--mlp-tile", "0"])
    assert "argument --mlp-tile: 0 must be >= 1 (positions per piece, or auto)" in capsys.readouterr().err


def _resume_from(ck, tag):
    """Point the checkpoint folder's `latest` at `tag`, as if the run had stopped there."""
    (ck / "latest").write_text(tag)


@pytest.mark.slow
def test_grpo_through_zerojax_train_raises_the_reward_and_resumes_exactly(fp32_config, tmp_path, capsys):
    # the built-in digit task ("nn:" prompts, reward for each "7"), its reward found from --data alone
    argv = ["--method", "grpo", "--data", "digit", "--config", fp32_config, "--micro-batch", "4", "--seq-len", "11",
            "--lr", "2e-2", "--method-option", "kl_coef=0.0", "--save", str(tmp_path / "ck")]
    whole = train(tmp_path, *argv, "--steps", "14", "--save-every", "12")
    assert whole["method"] == "grpo" and whole["method_options"]["reward"] == "digit"
    out = capsys.readouterr().out
    rewards = [float(line.split("reward/mean ")[1].split(",")[0]) for line in out.splitlines()
               if line.startswith("step ") and "reward/mean" in line]
    assert len(rewards) == 2 and rewards[0] < rewards[1], out  # logged at steps 10 and 14
    assert whole["method_metrics"]["reward/mean"] > 0.3, whole["method_metrics"]
    # the rollout plan, in the header and the SUMMARY: CPU reports no limit, so every row at once
    assert whole["rollout_plan"]["chunk"] == whole["rollout_plan"]["rows"] == 32
    assert "rollouts: 32 rows (4 prompts x group 8, prompt 3 + 8 new tokens), generated all at once" in out
    timed = whole["rollouts"]  # steps 2 .. 13: neither the first (compiles) nor the last (no next rollout)
    assert timed["steps_timed"] == 12 and timed["generate_s"] > 0 and timed["train_s"] > 0
    assert timed["samples_per_s"] == pytest.approx(32 * 12 / (timed["generate_s"] + timed["train_s"]), rel=1e-2)
    # resumed at step 12: the same rollouts, the same losses as the uninterrupted run's last two
    _resume_from(tmp_path / "ck", "global_step12")
    resumed = train(tmp_path, *argv, "--steps", "14", "--resume")
    assert resumed["start_step"] == 12
    np.testing.assert_array_equal(resumed["losses"], whole["losses"][12:])


@pytest.mark.slow
def test_ppo_through_zerojax_train_saves_the_critic_beside_the_actor(fp32_config, tmp_path):
    argv = ["--method", "ppo", "--data", "digit", "--config", fp32_config, "--micro-batch", "1", "--seq-len", "8",
            "--lr", "1e-2", "--save", str(tmp_path / "ck")]
    whole = train(tmp_path, *argv, "--steps", "3", "--save-every", "2")
    assert sorted(os.listdir(tmp_path / "ck" / "critic")) == ["global_step2", "global_step3", "latest"]
    assert "critic/value_loss" in whole["method_metrics"]
    _resume_from(tmp_path / "ck", "global_step2")  # the critic's step-2 state read back with the actor's
    resumed = train(tmp_path, *argv, "--steps", "3", "--resume")
    np.testing.assert_array_equal(resumed["losses"], whole["losses"][2:])
    assert resumed["method_metrics"]["critic/value_loss"] == whole["method_metrics"]["critic/value_loss"]


@pytest.mark.slow
def test_samples_from_the_live_weights_are_what_transformers_generates_from_the_export(fp32_config, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The cat\nab\n")
    summary = train(tmp_path, "--steps", "2", "--config", fp32_config, "--eval-every", "2", "--sample-prompts",
                    str(prompts), "--sample-tokens", "6", "--export-hf", str(tmp_path / "hf"))
    out = capsys.readouterr().out
    assert out.count("step 2: sample 1: 'The cat' -> ") == 2  # at the evaluation and at the end
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    want = []
    for text in ("The cat", "ab"):  # one at a time: no padding on the reference's side
        ids = torch.tensor([list(text.encode())])
        new = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        want.append(bytes(new.tolist()).decode("utf-8", errors="replace"))
    assert summary["samples"] == want
