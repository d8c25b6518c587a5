"""What a run says of itself when it ends: the closing line people read, the RL time split, where the
good weights are."""
from __future__ import annotations

import os


def rollout_times(history: list, rows: int) -> dict:
    """An RL run's split of time over the steps that compiled nothing (the first is left out):
    seconds generating (rollouts, rewards, log-probs) and training, and completions trained a
    second. A step's training is timed when the next rollout starts (`history[k + 1]`'s
    "time/train_s"), so the last step, whose training no rollout follows, is left out too."""
    pairs = [(history[k]["time/generate_s"], history[k + 1]["time/train_s"]) for k in range(1, len(history) - 1)]
    generate, train = sum(g for g, _ in pairs), sum(t for _, t in pairs)
    total = generate + train
    return {"steps_timed": len(pairs), "generate_s": round(generate, 3), "train_s": round(train, 3),
            "generate_share": round(generate / total, 3) if total > 0 else None,
            "samples_per_s": round(rows * len(pairs) / total, 2) if total > 0 else None}


def rollout_summary(rollouts, rows: int) -> dict:
    """An RL run's SUMMARY entries: "rollout_plan" (rows generated at once, the bytes planned,
    `zerojax.rl.rollout_plan`) and, past two steps, "rollouts" (`rollout_times`); {} without rollouts."""
    if rollouts is None:
        return {}
    out = {"rollout_plan": rollouts.plan.to_dict()} if getattr(rollouts, "plan", None) is not None else {}
    if len(rollouts.history) > 2:
        out["rollouts"] = rollout_times(rollouts.history, rows)
    return out


def closing_line(summary: dict) -> str:
    """The run in one line for people, from its SUMMARY: steps and time, loss first -> last,
    speed, validation loss, device peak."""
    losses, start = summary["losses"], summary["start_step"]
    if not losses:
        parts = [f"no training step (at global step {start})"]
    else:
        parts = [f"trained {len(losses)} step{'s' if len(losses) != 1 else ''}"
                 + (f" ({start} -> {start + len(losses)})" if start else "")
                 + f" in {summary['train_seconds']:.1f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}"]
    if summary.get("tokens_per_s_per_device") is not None:
        parts.append(f"{summary['tokens_per_s_per_device']:,} tokens/s per device")
    if summary.get("mfu") is not None:
        parts.append(f"MFU {100 * summary['mfu']:.1f}%")
    if summary.get("val_loss") is not None:
        parts.append(f"validation loss {summary['val_loss']:.2f}")
    if summary.get("peak_gib_device0") is not None:
        parts.append(f"peak {summary['peak_gib_device0']:.1f} GiB")
    elif summary.get("host_peak_rss_gib") is not None:  # CPU: its devices report no peak
        parts.append(f"host peak {summary['host_peak_rss_gib']:.1f} GiB")
    return ", ".join(parts)


def last_good_checkpoint(save_dir) -> str:
    """Where a stopped run's last good weights are: the tag `latest` names (only finite state is ever
    written), or that there is none."""
    from zerojax.checkpoint import files

    tag = files.latest_tag(save_dir)
    if tag is None:
        return f"No checkpoint was saved in {save_dir}"
    return f"The last good checkpoint: {os.path.join(save_dir, tag)} (--resume continues from it)"


def stopped_line(signal_name: str, step: int, path: str | None) -> str:
    """The one line of a run a signal stopped after a whole step."""
    if path:
        return f"{signal_name}: stopped after step {step}; checkpoint saved: {path} (--resume continues from it)"
    return f"{signal_name}: stopped after step {step}; nothing saved (no --save folder)"


__all__ = ["rollout_times", "rollout_summary", "closing_line", "last_good_checkpoint", "stopped_line"]
