"""The inputs some cases write before their runs and the comparisons some make after them
(benchmarks/cases.py names them as a case's `prepare` / `post`)."""
from __future__ import annotations

import csv
import json
import os
import random
import re
import string

LOWER = "abcdefghijklmnopqrstuvwxyz "


def reward_pairs(out: str, smoke: bool) -> None:
    """A toy preference set a reward model learns in a few dozen steps: each pair's chosen completion
    is lower-case letters, its rejected one the same letters upper-case (byte-level tokenizer: one
    token a character; id 0, which the data never uses, is the pad that marks each row's end)."""
    half = 24 if smoke else 500
    rng = random.Random(0)
    with open(os.path.join(out, "reward-pairs.jsonl"), "w") as f:
        for _ in range(1024):
            chosen = "".join(rng.choices(LOWER, k=half))
            f.write(json.dumps({"prompt": "".join(rng.choices(LOWER, k=half)), "chosen": chosen,
                                "rejected": chosen.upper()}) + "\n")


def dpo_pairs(out: str, smoke: bool) -> None:
    """DPO pairs whose rows fill the sequence exactly (no padding): ASCII prompts and completions of
    seq / 2 characters each, one byte token a character; checked through zerojax's reader, so that
    zerojax and the PyTorch anchor score the same tokens (seq / 2 completion tokens a row)."""
    from zerojax.data.preference import load_preference_data
    from zerojax.data.rows import ByteTokens

    seq, pairs = (64, 4) if smoke else (2048, 8)
    plen = seq // 2
    rng = random.Random(0)

    def text(n):
        return "".join(rng.choices(string.ascii_letters + string.digits + " .,", k=n))

    path = os.path.join(out, f"dpo-pairs-{seq}.jsonl")
    with open(path, "w") as f:
        # more pairs than one step's: the trainer holds ~5% out for validation and cycles the rest
        f.writelines(json.dumps({"prompt": text(plen), "chosen": text(seq - plen),
                                "rejected": text(seq - plen)}) + "\n" for _ in range(max(64, 2 * pairs)))
    data = load_preference_data(path, ByteTokens(), seq, pairs)
    for side in ("chosen", "rejected"):
        ids, labels = data.arrays[f"{side}_ids"], data.arrays[f"{side}_labels"]
        if ids.shape[1] != seq or not (ids != data.pad_id).all():
            raise SystemExit(f"{path}: {side} rows are not {seq} tokens without padding")
        if not ((labels[:, 1:] != -100).sum(1) == seq - plen).all():
            raise SystemExit(f"{path}: {side} rows do not have {seq - plen} completion targets each")


LAUNCH_RUNS = [(stage, procs) for stage in (2, 3) for procs in (1, 2)]


def launch_configs(out: str, smoke: bool) -> None:
    """configs/zero{2,3}_bf16.json with a CSV monitor, one per (stage, processes) run, so that the
    losses of one process x 2 GPUs and of 2 processes x 1 GPU can be compared step by step."""
    for stage, procs in LAUNCH_RUNS:
        name = f"zero{stage}_procs{procs}"
        with open(f"configs/zero{stage}_bf16.json") as f:
            cfg = json.load(f)
        cfg["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out, "logs"), "job_name": name}
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(cfg, f)


def launch_losses(out: str) -> list[dict]:
    """One record per launch run: tokens/s per GPU, the last loss and the largest relative loss
    difference to the one-process run of the same stage, step by step."""
    def losses(name):
        path = os.path.join(out, "logs", name, "Train_Samples_train_loss.csv")
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f)}

    def summary(name):
        path = os.path.join(out, f"x2-{name}.log")  # the runner's log of that run
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            text = f.read()
        found = re.findall(r"^(?:\[0\] )?SUMMARY (.*)$", text, re.MULTILINE)
        return json.loads(found[-1]) if found else {}

    records = []
    for stage, procs in LAUNCH_RUNS:
        name = f"zero{stage}_procs{procs}"
        ref, got = losses(f"zero{stage}_procs1"), losses(name)
        common = set(ref) & set(got)
        diff = max((abs(got[k] - ref[k]) / abs(ref[k]) for k in common), default=None)
        s = summary(name)
        records.append({"framework": "zerojax", "row": f"launch zero{stage} {procs} proc",
                        "stage": stage, "tokens_per_s": s.get("tokens_per_s_per_device"),
                        "last_loss": s.get("last_loss"), "max_rel_loss_diff": diff})
    return records
