"""DeepSpeed JSON configs -> frozen dataclasses, with DeepSpeed's defaults, aliases and batch rule.

Modules: `_values` (ConfigError, field specs, shared checks), `_schema` (one dataclass per
section, with its docs), `_params` (the optimizer / scheduler parameter table), `_load`
(load_config, "auto", the batch rule), `docs` (the generator of docs/config-keys.md).

Follows DeepSpeed 0.19.8 (`deepspeed/runtime/config.py`, `constants.py`, `precision_config.py`,
`zero/config.py`, `zero/offload_config.py`, `monitor/config.py`, `compile/config.py`,
`lr_schedules.py`, and the optimizer construction in `runtime/engine.py`). Configs are parsed with
hjson as DeepSpeed does, so `#` and `//` comments load; duplicate keys are an error.

Each schema field carries its documentation as the string under it (DeepSpeed's meaning, then
"zerojax:" and what zerojax does with it); `docs/config-keys.md` is generated from them
(`python -m zerojax.config.docs --write docs/config-keys.md`).

`"auto"` (the Hugging Face convention DeepSpeed tolerates):
- inside a section (`zero_optimization`, `fp16`, ...) it means DeepSpeed's default, as DeepSpeed's
  pydantic models drop `"auto"` values;
- at top level and in `optimizer.params` / `scheduler.params` it must be resolved: from `fill`
  (dotted keys, e.g. `{"optimizer.params.lr": 3e-4}`) or, for the batch trio, by DeepSpeed's
  batch-size rule. A `fill` value replaces an `"auto"` at any dotted key (`"fp16.enabled"` too); a
  `fill` entry whose key does not hold `"auto"` is not used. Autos left unresolved are reported
  together in one ConfigError.

Unknown keys, as DeepSpeed treats them: at top level DeepSpeed reads the keys it knows and never
looks at the others, so zerojax loads them too, with one warning per key ("did you mean" when one
is close to a known key). Sections DeepSpeed validates with pydantic models (extra="forbid":
`zero_optimization` and its offload sections, `fp16`, `bf16`, monitors, `compile`, ...) are
strict here as well, with a "did you mean". Features DeepSpeed 0.19.8 removed are refused with
DeepSpeed's reason.
"""
from __future__ import annotations

from zerojax.config._load import auto_keys, hidden_size_fill, load_config, read_source, xla_flags_for  # noqa: F401 -- the public names
from zerojax.config._params import (  # noqa: F401 -- the public names
    FLOAT32_MAX,
    MAX_GRAD_NORM_MSG,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    UNSUPPORTED_OPTIMIZERS,
    Param,
    canonical_optimizer,
    check_optimizer_params,
    check_scheduler_params,
    learning_rate_problem,
)
from zerojax.config._schema import (  # noqa: F401 -- the public names
    DEEPSPEED_VERSION,
    REMAT_POLICY_NAMES,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CompileConfig,
    Config,
    CSVConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    HybridEngineConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    ThroughputTimerConfig,
    TimersConfig,
    TrackioConfig,
    WandbConfig,
    ZeroConfig,
    pipeline_stages,
    remat_policy_for,
)
from zerojax.config._values import AUTO, ConfigError, ConfigWarning  # noqa: F401 -- the public names
