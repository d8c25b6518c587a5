"""`zerojax train --seq-len auto` and `zerojax estimate --seq auto`: the planner's longest row
(`planner.longest_row`, tested against directly compiled steps in tests/planning/test_longest_row.py)
printed with its peaks before anything trains, then trained at; micro-batch auto searched at
micro-batch 1; the mistakes refused in one line. A device limit stands in for a GPU's (CPU
reports none)."""
from __future__ import annotations

import json
import os

import pytest

from zerojax import cli
from zerojax.engine import memory
from zerojax.planning import planner as PL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = 20_000_000  # a tiny Llama's fp32 step on the 8 CPU devices fits 256 tokens a row of it, not 384


def test_train_seq_len_auto_prints_the_row_and_trains_at_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory, "device_budget", lambda device=None: BUDGET)
    out = tmp_path / "summary.json"
    assert cli.main(["train", "--model", "tiny-llama", "--seq-len", "auto", "--micro-batch", "1", "--steps", "1",
                     "--eval-batches", "0", "--fp32", "--summary-json", str(out)]) == 0
    summary, printed = json.loads(out.read_text()), capsys.readouterr().out
    L = summary["seq_len"]
    assert L % PL.SEQ_GRANULE == 0 and L >= PL.SEQ_GRANULE
    header = printed.split("\nstep ")[0]  # the resolved settings, before the first step
    assert f"  seq-len:   {L:,} (--seq-len auto at micro-batch 1, remat none: {L:,} tokens (a multiple of 128): " \
           "predicted peak" in header
    assert f"{L + PL.SEQ_GRANULE:,} needs" in header and f"seq {L}: {8 * L:,} tokens/step" in header


def test_micro_batch_auto_searches_the_longest_row_at_micro_batch_1(monkeypatch):
    """With --micro-batch auto, the search runs at micro-batch 1, accumulation keeping the rows a
    device trains per step (the plan micro-batch auto then finds at that length)."""
    from zerojax import load_config
    from zerojax.trainer import flags, setup

    seen = {}

    def record(factory, cfg_dict, budget, **kw):
        seen.update(kw, budget=budget)
        return PL.LongestRow(512, 1, 0, 128, budget, 2**40, beyond=640, beyond_peak=budget + 1)

    monkeypatch.setattr(memory, "device_budget", lambda device=None: BUDGET)
    monkeypatch.setattr(PL, "longest_row", record)
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=8)
    args = flags.parse_args(["--model", "tiny-llama", "--seq-len", "auto", "--micro-batch", "auto"])
    found, micro = setup.longest_seq_len(args, cfg, None, lambda: None, None, None, micro_auto=True)
    assert (found.seq_len, micro, seen["micro_batch"], seen["grad_accum"], seen["budget"]) == (512, 1, 1, 8, BUDGET)
    setup.longest_seq_len(args, cfg, None, lambda: None, None, 1024, micro_auto=False)
    assert (seen["micro_batch"], seen["grad_accum"], seen["cap"]) == (4, 2, 1024)


def test_train_seq_len_auto_mistakes_are_one_line(capsys, monkeypatch):
    base = ["train", "--model", "tiny-llama", "--seq-len", "auto", "--micro-batch", "1", "--steps", "1"]
    assert cli.main(base) == 1  # CPU: no device limit to search against
    assert capsys.readouterr().err == (
        "error: --seq-len auto: this device reports no memory limit to search the longest row against (CPU); "
        "give --seq-len N, or find one with zerojax estimate --aot --budget B --seq auto\n")
    monkeypatch.setattr(memory, "device_budget", lambda device=None: BUDGET)
    assert cli.main([*base, "--method", "dpo"]) == 1
    assert capsys.readouterr().err.startswith("error: --seq-len auto: --method dpo trains on rows its records shape")
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**20)
    assert cli.main(base) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --seq-len auto: not even a row of 128 tokens (micro-batch 1) fits: its step needs ")
    assert "of the 1.00 MiB device budget; hold less with activation checkpointing" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["train", "--seq-len", "long"])
    assert "argument --seq-len: " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the mesh search plans at a length; only estimate searches one
        cli.main(["plan", "--model", "tiny", "--devices", "1", "--seq", "auto"])
    assert "argument --seq/--seq-len: 'auto' is not an integer" in capsys.readouterr().err


def test_estimate_seq_auto_reports_the_row_and_estimates_at_it(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    assert cli.main(["estimate", "--model", "tiny-llama", "--gpus", "1", "--aot", "--cpu", "--budget", "20MB",
                     "--seq-len", "auto", "--micro-batch", "1", "--remat", "off", "--stage", "0", "--no-plan",
                     "--json", str(out)]) == 0
    result, printed = json.loads(out.read_text()), capsys.readouterr().out
    longest = result["longest"]
    L = longest["seq_len"]
    assert longest["peak"] <= 20 * 10**6 < longest["beyond_peak"] and longest["beyond"] == L + 128
    assert result["seq_len"] == L and f"seq {L}, micro-batch 1" in printed
    assert printed.startswith(f"Longest row (--seq auto; micro-batch 1, remat none, ZeRO stage 0): {L:,} tokens")
    # the compiled table's row at that length is the peak the search read
    assert result["compiled"][0]["peak"] == longest["peak"]


def test_estimate_seq_auto_mistakes_are_one_line(capsys):
    assert cli.main(["estimate", "--model", "tiny-llama", "--seq", "auto"]) == 1
    assert capsys.readouterr().err == "error: --seq auto compiles the step to find the longest row: add --aot, " \
                                      "with --model\n"
    assert cli.main(["estimate", "--model", "tiny-llama", "--aot", "--cpu", "--seq", "auto"]) == 1
    assert capsys.readouterr().err == ("error: --seq auto: the device reports no memory limit (CPU); pass --budget, "
                                       "e.g. 24GB\n")
