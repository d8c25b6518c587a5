"""The DeepSpeed config schema's sections that observe a run rather than shape it: the monitors
(tensorboard, csv_monitor, wandb, comet, trackio), the FLOPs profiler, the communication logger
and the timers, each field with its documentation string. `zerojax.config._schema` re-exports these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerojax.config._values import config_field as _f


@dataclass(frozen=True)
class _FileMonitorConfig:
    """The fields DeepSpeed's TensorBoardConfig and CSVConfig share (monitor/config.py)."""

    enabled: bool = _f(False, "bool")
    """Turn this monitor on.
    zerojax: **acted on**: metrics writer on
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    output_path: str = _f("", "str")
    """Directory for the logs.
    zerojax: **acted on**: writer output directory
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    job_name: str = _f("DeepSpeedJobName", "str")
    """Sub-directory / run name.
    zerojax: **acted on**: writer run name
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""


@dataclass(frozen=True)
class TensorBoardConfig(_FileMonitorConfig):
    pass


@dataclass(frozen=True)
class CSVConfig(_FileMonitorConfig):
    pass


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = _f(False, "bool")
    """Turn wandb on.
    zerojax: **acted on**: metrics writer on
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    group: str | None = _f(None, "str", optional=True)
    """wandb group.
    zerojax: **acted on**: passed to wandb.init
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    team: str | None = _f(None, "str", optional=True)
    """wandb team (entity).
    zerojax: **acted on**: passed to wandb.init
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""
    project: str = _f("deepspeed", "str")
    """wandb project.
    zerojax: **acted on**: passed to wandb.init
    Model needs: nothing (the engine's metrics writer, outside the compiled step)"""


@dataclass(frozen=True)
class CometConfig:
    enabled: bool = _f(False, "bool")
    """Turn Comet on.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    samples_log_interval: int = _f(100, "int", ge=1)
    """Log every N samples.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    project: str | None = _f(None, "str", optional=True)
    """Comet project.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    workspace: str | None = _f(None, "str", optional=True)
    """Comet workspace.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    api_key: str | None = _f(None, "str", optional=True)
    """Comet API key.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    experiment_name: str | None = _f(None, "str", optional=True)
    """Experiment name.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    experiment_key: str | None = _f(None, "str", optional=True)
    """Experiment key.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    online: bool | None = _f(None, "bool", optional=True)
    """Log online vs offline.
    zerojax: **accepted, no effect**: no Comet writer yet"""
    mode: str | None = _f(None, "str", optional=True, choices=("get", "create", "get_or_create"))
    """get / create / get_or_create.
    zerojax: **accepted, no effect**: no Comet writer yet"""


@dataclass(frozen=True)
class TrackioConfig:
    enabled: bool = _f(False, "bool")
    """Turn Trackio on.
    zerojax: **accepted, no effect**: no Trackio writer yet"""
    project: str = _f("deepspeed", "str")
    """Trackio project.
    zerojax: **accepted, no effect**: no Trackio writer yet"""


@dataclass(frozen=True)
class FlopsProfilerConfig:
    enabled: bool = _f(False, "bool")
    """Profile one step.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    recompute_fwd_factor: float = _f(0.0, "float", ge=0.0)
    """Extra forward FLOPs from recomputation.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    profile_step: int = _f(1, "int", ge=1)
    """Step to profile.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    module_depth: int = _f(-1, "int")
    """Depth of the module table.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    top_modules: int = _f(1, "int", ge=1)
    """Modules listed.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    detailed: bool = _f(True, "bool")
    """Per-module detail.
    zerojax: **accepted, no effect**: no FLOPs profiler"""
    output_file: str | None = _f(None, "str", optional=True)
    """Where to write the profile.
    zerojax: **accepted, no effect**: no FLOPs profiler"""


@dataclass(frozen=True)
class CommsLoggerConfig:
    enabled: bool = _f(False, "bool")
    """Log collective calls.
    zerojax: **accepted, no effect**: read the collectives in the compiled HLO or the JAX profiler"""
    prof_all: bool = _f(True, "bool")
    """Profile every collective.
    zerojax: **accepted, no effect**: —"""
    prof_ops: Any = _f(kind="any", factory=tuple)
    """Collectives to profile when prof_all is false.
    zerojax: **accepted, no effect**: —"""
    verbose: bool = _f(False, "bool")
    """Print every logged call.
    zerojax: **accepted, no effect**: —"""
    debug: bool = _f(False, "bool")
    """Add the caller to each log line.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class ThroughputTimerConfig:
    enabled: bool = _f(True, "bool")
    """Throughput timer on.
    zerojax: **accepted, no effect**: the engine reports its own step times"""
    synchronized: bool = _f(True, "bool")
    """Synchronise the device when timing.
    zerojax: **accepted, no effect**: —"""


@dataclass(frozen=True)
class TimersConfig:
    throughput: ThroughputTimerConfig = _f(kind="section", factory=ThroughputTimerConfig, cls=ThroughputTimerConfig)
    """Section: the throughput timer.
    zerojax: **accepted, no effect**: see its keys"""
