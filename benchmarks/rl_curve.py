"""GRPO's reward curve on a built-in task (default word-problems, zerojax/rl/word_problems.py):
`zerojax train --method grpo` for --steps steps from a pretrained Hugging Face folder, DeepSpeed's
csv_monitor and tensorboard sections on, then reward/mean against the step as a PNG and one JSON
line (steps, wall time, the first and last rewards, the files written).

    python benchmarks/rl_curve.py --hf-checkpoint ./Qwen2.5-0.5B --out benchmarks/results
    python benchmarks/rl_curve.py --tiny --out /tmp/curve     # CPU: a tiny random model; it learns nothing

A random init learns nothing in a few hundred steps, so the GPU run needs the weights of a
pretrained 0.5B-1B model (Qwen2.5-0.5B, Llama-3.2-1B) in a local folder. Each step: 16 prompts x 8
completions of up to 256 new tokens (stopped at the next "\\nQ:" a base model starts), sampled at
temperature 1, full fine-tune ZeRO-2 bf16, lr 1e-6, no KL term (Dr. GRPO / DAPO drop it; none needs
a reference copy then). The trainer's own output goes to OUT/rl-curve-train.log.

Files in --out: logs/rl-curve/Train_Samples_reward_mean.csv (and the loss, lr, policy/* CSVs),
tb/rl-curve/events.out.tfevents.* (`tensorboard --logdir OUT/tb`), rl-curve.png, rl-curve-summary.json
(the trainer's SUMMARY). The PNG comes from matplotlib where it is installed, else from this file's
own PNG writer (benchmarks/png_plot.py: the curve, its moving average, gridlines and tick numbers,
no text labels).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

JOB = "rl-curve"
STOP = "\nQ:"  # a base model writes the next few-shot question after its answer: stop there
SMOOTH = 10    # steps in the moving average drawn over the raw curve and in the first / last figures


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", metavar="DIR", help="a pretrained model's Hugging Face folder (not with --tiny)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama, random init, a few steps")
    p.add_argument("--data", default="word-problems", help="a built-in task (zerojax.rl.tasks) or prompts .jsonl")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--steps", type=int, help="optimizer steps (default 200; --tiny 3)")
    p.add_argument("--prompts", type=int, help="prompts a step (default 16; --tiny 2)")
    p.add_argument("--group", type=int, help="completions a prompt (default 8; --tiny 2)")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches a step (default 4; --tiny 1)")
    p.add_argument("--max-new", type=int, help="new tokens a completion at most (default 256; --tiny 8)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if bool(args.tiny) == bool(args.hf_checkpoint):
        p.error("give --hf-checkpoint DIR (a pretrained Qwen2.5-0.5B / Llama-3.2-1B folder: a random init learns "
                "nothing in a few hundred steps) or --tiny (a CPU smoke run that learns nothing either)")
    tiny = {"steps": 3, "prompts": 2, "group": 2, "max_new": 8}
    full = {"steps": 200, "prompts": 16, "group": 8, "max_new": 256}
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny:
        args.grad_accum = 1
    return args


def prompt_tokens(args) -> int:
    """The task's longest prompt in the model's tokens (byte-level for the tiny model): the rows are
    that plus --max-new, so no row trains padding past the completions."""
    from zerojax.data.rows import ByteTokens
    from zerojax.rl.prompts import load_prompts

    if args.tiny:
        tokenizer = ByteTokens()
    else:
        from zerojax.models import load_tokenizer

        tokenizer = load_tokenizer(args.hf_checkpoint)
    return load_prompts(args.data, tokenizer, seq_len=1 << 20, seed=args.seed).prompt_len


def write_config(out: str) -> str:
    """configs/zero2_bf16.json (the trainer's default) with DeepSpeed's csv_monitor and tensorboard on."""
    with open(os.path.join(ROOT, "configs", "zero2_bf16.json")) as f:
        cfg = json.load(f)
    cfg["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out, "logs"), "job_name": JOB}
    cfg["tensorboard"] = {"enabled": True, "output_path": os.path.join(out, "tb"), "job_name": JOB}
    path = os.path.join(out, f"{JOB}-config.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def train_command(args, config: str, seq_len: int) -> list[str]:
    rows = args.prompts * args.group
    if rows % args.grad_accum:
        raise SystemExit(f"--prompts x --group = {rows} rows a step: not a multiple of --grad-accum {args.grad_accum}")
    model = ["--model", "tiny-llama"] if args.tiny else ["--hf-checkpoint", args.hf_checkpoint]
    options = {"group": args.group, "max_new_tokens": args.max_new, "kl_coef": args.kl_coef, "stop": [STOP]}
    return [sys.executable, "-m", "zerojax.cli", "train", *model, "--config", config, "--method", "grpo",
            "--data", args.data, "--steps", str(args.steps), "--seq-len", str(seq_len),
            "--micro-batch", str(rows // args.grad_accum), "--grad-accum", str(args.grad_accum),
            "--lr", str(args.lr), "--seed", str(args.seed), "--eval-batches", "0",
            "--summary-json", os.path.join(args.out, f"{JOB}-summary.json"),
            *[a for k, v in options.items() for a in ("--method-option", f"{k}={json.dumps(v)}")]]


def run_training(cmd: list[str], log_path: str) -> float:
    """The trainer in its own process, its output in log_path -> wall seconds (compiles included).
    Its output stays out of this program's stdout, whose one JSON line is the benchmark's record."""
    began = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                   p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)))
    wall = time.perf_counter() - began
    if code:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"zerojax train exited {code} ({log_path}):\n{tail}")
    return wall


def read_curve(path: str) -> list[tuple[int, float]]:
    """(optimizer step, reward/mean) from the csv_monitor's file: one row a step, in order (its own
    index is DeepSpeed's global samples, steps x train_batch_size over every device)."""
    with open(path) as f:
        return [(i, float(r["mean"])) for i, r in enumerate(csv.DictReader(f), 1)]


def moving_average(values: list[float], k: int = SMOOTH) -> list[float]:
    """The mean of each value and up to k - 1 before it."""
    return [sum(values[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(values))]


def plot(curve: list[tuple[int, float]], path: str, title: str) -> str:
    """reward/mean against the step as a PNG at path -> which writer drew it."""
    steps, rewards = [s for s, _ in curve], [r for _, r in curve]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from benchmarks.png_plot import write_line_plot

        write_line_plot(path, steps, [rewards, moving_average(rewards)], y_range=(0.0, 1.0))
        return "benchmarks/png_plot.py (matplotlib is not installed: no text labels)"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, color="#9ecae1", label="reward/mean")
    ax.plot(steps, moving_average(rewards), color="#08519c", label=f"moving average ({SMOOTH} steps)")
    ax.set(xlabel="optimizer step", ylabel="reward (exact answer)", title=title, ylim=(-0.02, 1.02))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def record(args, curve, wall: float, png: str, writer: str, csv_path: str) -> dict:
    rewards = [r for _, r in curve]
    k = min(SMOOTH, len(rewards))
    return {"framework": "zerojax", "case": JOB, "task": args.data,
            "model": "tiny-llama" if args.tiny else os.path.basename(os.path.normpath(args.hf_checkpoint)),
            "steps": len(curve), "prompts_per_step": args.prompts, "group": args.group, "max_new": args.max_new,
            "lr": args.lr, "kl_coef": args.kl_coef, "wall_s": round(wall, 1),
            f"reward_first{SMOOTH}": round(sum(rewards[:k]) / k, 4),
            f"reward_last{SMOOTH}": round(sum(rewards[-k:]) / k, 4), "reward_max": max(rewards),
            "png": png, "png_writer": writer, "csv": csv_path}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    seq_len = prompt_tokens(args) + args.max_new
    cmd = train_command(args, write_config(args.out), seq_len)
    wall = run_training(cmd, os.path.join(args.out, f"{JOB}-train.log"))
    csv_path = os.path.join(args.out, "logs", JOB, "Train_Samples_reward_mean.csv")
    curve = read_curve(csv_path)
    png = os.path.join(args.out, f"{JOB}.png")
    title = f"GRPO on {args.data}: {'tiny-llama (random init)' if args.tiny else args.hf_checkpoint}"
    writer = plot(curve, png, title)
    rec = record(args, curve, wall, png, writer, csv_path)
    print(json.dumps(rec), flush=True)
    return rec


if __name__ == "__main__":
    main()
