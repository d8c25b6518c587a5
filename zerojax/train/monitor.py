"""DeepSpeed's monitors (csv_monitor, tensorboard, wandb) for zerojax metrics.

DeepSpeed logs `Train/Samples/train_loss`, `Train/Samples/lr` and (fp16) `Train/Samples/loss_scale`
once per optimizer step, indexed by global samples. Reading a metric forces a device sync, so we
buffer the step's metrics as device arrays and write them on `flush()` (every `steps_per_print`
steps and at the end): the numbers are the same, the step is not slowed.
Imports nothing of zerojax: sections are read by attribute (enabled, output_path, job_name, ...).
"""
from __future__ import annotations

import csv
import os
from typing import Any, Iterable

# metric key in the engine's metrics dict -> DeepSpeed event name
EVENT_NAMES = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
}


def _log_dir(section, default_job: str) -> str:
    # DeepSpeed: output_path/job_name; its default output_path is "" (the working directory).
    return os.path.join(section.output_path or "", section.job_name or default_job)


class CSVMonitor:
    """One `<event name with / -> _>.csv` per event with a `step,<last part>` header, as DeepSpeed."""

    def __init__(self, section):
        self.log_dir = _log_dir(section, "DeepSpeedJobName")
        os.makedirs(self.log_dir, exist_ok=True)

    def write_events(self, events: Iterable[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    def __init__(self, section):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "config section 'tensorboard' is enabled but tensorboardX is not installed; "
                "run `pip install tensorboardX` (or `pip install zerojax[monitor]`), "
                "or set tensorboard.enabled to false"
            ) from e
        self.writer = SummaryWriter(log_dir=_log_dir(section, "DeepSpeedJobName"))

    def write_events(self, events):
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbMonitor:
    def __init__(self, section):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover
            raise ImportError(
                "config section 'wandb' is enabled but wandb is not installed; "
                "run `pip install wandb` or set wandb.enabled to false"
            ) from e
        self.wandb = wandb
        wandb.init(project=section.project, group=section.group, entity=section.team)

    def write_events(self, events):
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self):
        self.wandb.finish()


class Monitor:
    """All enabled monitors of a config; buffers device metrics until `flush()`."""

    def __init__(self, cfg, *, is_writer: bool = True):
        self.backends = []
        if is_writer:  # DeepSpeed writes from rank 0 only
            for attr, cls in (("csv_monitor", CSVMonitor), ("tensorboard", TensorBoardMonitor),
                              ("wandb", WandbMonitor)):
                section = getattr(cfg, attr, None)
                if section is not None and section.enabled:
                    self.backends.append(cls(section))
        self._pending: list[tuple[int, dict[str, Any]]] = []
        fp16 = getattr(cfg, "fp16", None)
        # DeepSpeed logs the loss scale only when fp16 is on.
        self._names = [k for k in EVENT_NAMES if k != "loss_scale" or (fp16 is not None and fp16.enabled)]

    @property
    def enabled(self) -> bool:
        return bool(self.backends)

    def record(self, global_samples: int, metrics: dict[str, Any]) -> None:
        if self.backends:
            self._pending.append((global_samples, {k: metrics[k] for k in self._names if k in metrics}))

    def flush(self) -> None:
        if not self._pending:
            return
        events = [(EVENT_NAMES[k], float(v), step) for step, m in self._pending for k, v in m.items()]
        self._pending.clear()
        for backend in self.backends:
            backend.write_events(events)

    def close(self) -> None:
        self.flush()
        for backend in self.backends:
            backend.close()
