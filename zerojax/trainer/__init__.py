"""The training program over the engine: flags, model choice, data, planner, loop, export.

`zerojax train ...` and `python examples/gpt2_large.py ...` run `main` (flags: `zerojax.trainer.flags`).
It sits above `train/` (the engine) and `planning/` (the planner), and nothing below imports it.
"""
from zerojax.trainer.trainer import Hook, StepInfo, Trainer, main, run_cli

__all__ = ["Trainer", "Hook", "StepInfo", "main", "run_cli"]
