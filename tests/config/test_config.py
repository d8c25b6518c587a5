"""zerojax.config: DeepSpeed JSON/hjson configs, "auto", the batch trio, validation."""
import dataclasses
import json
import pathlib
import re
import warnings

import pytest

from zerojax.config import Config, ConfigError, load_config, xla_flags_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
GUIDE = CONFIGS / "oom_guide_zero2_offload.json"
INTRO = CONFIGS / "ds_intro_fp16_zero2.json"

GUIDE_TEXT = """{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-5, "warmup_num_steps": 1000}},
 "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
 "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true},
   "offload_param": {"device": "cpu", "pin_memory": true}, "overlap_comm": true, "contiguous_gradients": true,
   "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
 "gradient_clipping": 1.0, "steps_per_print": 2000, "wall_clock_breakdown": false}"""  # noqa: E501 - the guide's text as published

INTRO_TEXT = """{
  "train_batch_size": 8,

  #혼합 정밀도
  "fp16": {
    "enabled": true
  },

  #zero
  "zero_optimization": {
    "stage": 2
  }
}"""


def quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(*args, **kwargs)


def problems_of(source, **kwargs):
    with pytest.raises(ConfigError) as info:
        quiet_load(source, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


# --- an independent reference: DeepSpeed's _set_batch_related_parameters + _batch_assertion ------

def deepspeed_batch(tb, mb, ga, ws):
    """Returns (tb, mb, ga) or raises AssertionError with DeepSpeed's message."""
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = tb // mb
        ga //= ws
    elif tb is not None and ga is not None:
        mb = tb // ws
        mb //= ga
    elif mb is not None and ga is not None:
        tb = mb * ga
        tb *= ws
    elif tb is not None:
        ga = 1
        mb = tb // ws
    elif mb is not None:
        tb = mb * ws
        ga = 1
    else:
        raise AssertionError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    # explicit raises: pytest rewrites `assert` messages in test modules
    if not tb > 0:
        raise AssertionError(f"Train batch size: {tb} has to be greater than 0")
    if not mb > 0:
        raise AssertionError(f"Micro batch size per gpu: {mb} has to be greater than 0")
    if not ga > 0:
        raise AssertionError(f"Gradient accumulation steps: {ga} has to be greater than 0")
    if tb != mb * ga * ws:
        raise AssertionError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step"
            f" * world_size {tb} != {mb} * {ga} * {ws}")
    return tb, mb, ga


def trio(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# --- the two configs from the issue ---------------------------------------------------------------

def test_shipped_configs_are_verbatim():
    assert GUIDE.read_text(encoding="utf-8").rstrip("\n") == GUIDE_TEXT
    assert INTRO.read_text(encoding="utf-8").rstrip("\n") == INTRO_TEXT


@pytest.mark.parametrize("world", [1, 2, 8])
def test_intro_config_batch_rule(world):
    cfg = quiet_load(INTRO, world_size=world)
    assert trio(cfg) == deepspeed_batch(8, None, None, world)
    assert cfg.world_size == world
    assert cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.zero_optimization.stage == 2
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.hysteresis == 2  # DeepSpeed defaults


def test_intro_config_world_8_and_2():
    assert trio(quiet_load(INTRO, world_size=8)) == (8, 1, 1)
    assert trio(quiet_load(INTRO, world_size=2)) == (8, 4, 1)


def test_intro_config_world_3_uses_deepspeed_wording():
    err = problems_of(INTRO, world_size=3)
    with pytest.raises(AssertionError) as ref:
        deepspeed_batch(8, None, None, 3)
    assert str(ref.value) in str(err)
    assert "8 != 2 * 1 * 3" in str(err)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_guide_config_with_filled_micro_batch(world):
    with pytest.warns(UserWarning, match="offload_param has no effect at ZeRO stage 2"):
        cfg = load_config(GUIDE, world_size=world, fill={"train_micro_batch_size_per_gpu": 4})
    assert trio(cfg) == deepspeed_batch(None, 4, None, world) == (4 * world, 4, 1)
    z = cfg.zero_optimization
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    # "auto" inside zero_optimization -> DeepSpeed's defaults
    assert z.reduce_bucket_size == 500_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000
    assert cfg.fp16.enabled is False  # "auto" without a fill -> DeepSpeed's default
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 2000
    assert cfg.optimizer.type == "AdamW" and dict(cfg.optimizer.params) == {"lr": 1e-5, "weight_decay": 0.01}
    assert cfg.scheduler.type == "WarmupLR"


def test_guide_config_fill_micro_and_accumulation_and_fp16():
    cfg = quiet_load(GUIDE, world_size=2, fill={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
                                               "fp16.enabled": True})
    assert trio(cfg) == deepspeed_batch(None, 4, 3, 2) == (24, 4, 3)
    assert cfg.fp16.enabled is True


def test_guide_config_unfilled_trio_is_reported_as_unresolved_autos():
    err = problems_of(GUIDE, world_size=2)
    msg = str(err)
    assert "unresolved" in msg
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert key in msg


@pytest.mark.parametrize("tb,mb,ga,ws", [
    (32, 4, None, 2), (32, None, 2, 4), (None, 2, 3, 8), (None, 3, None, 2), (64, None, None, 8),
    (16, 2, 4, 2), (12, 4, None, 2), (8, None, 3, 2), (6, 4, None, 1), (None, None, 2, 4), (8, 16, None, 1),
])
def test_batch_trio_matches_deepspeed(tb, mb, ga, ws):
    raw = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"), (tb, mb, ga)) if v is not None}
    try:
        expected = deepspeed_batch(tb, mb, ga, ws)
    except AssertionError as ref:
        err = problems_of(raw, world_size=ws)
        assert str(ref) in str(err)
    else:
        assert trio(quiet_load(raw, world_size=ws)) == expected


def test_default_world_size_is_device_count():
    import jax

    cfg = quiet_load({"train_micro_batch_size_per_gpu": 2})
    assert cfg.world_size == jax.device_count()
    assert cfg.train_batch_size == 2 * jax.device_count()
    cfg = quiet_load({"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}})
    # DeepSpeed 0.19.8 counts tensor ranks in the batch rule ("8 != 8 * 1 * 2" for autotp_size 2 on 2 GPUs)
    assert cfg.world_size == jax.device_count() and cfg.tensor_parallel.autotp_size == 2


# --- shipped configs ------------------------------------------------------------------------------

HF_FILL = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer.params.lr": 3e-4,
           "optimizer.params.weight_decay": 0.1, "scheduler.params.warmup_max_lr": 3e-4,
           "scheduler.params.warmup_num_steps": 100, "scheduler.params.total_num_steps": 1000}


@pytest.mark.parametrize("name,stage,dtype", [
    ("zero0_bf16.json", 0, "bf16"), ("zero1_bf16.json", 1, "bf16"), ("zero2_bf16.json", 2, "bf16"),
    ("zero3_bf16.json", 3, "bf16"), ("zero2_fp16.json", 2, "fp16"), ("zero2_offload_optimizer.json", 2, "bf16"),
    ("zero3_offload_param_optimizer.json", 3, "bf16"),
])
def test_shipped_configs_load(name, stage, dtype, recwarn):
    cfg = load_config(CONFIGS / name, world_size=4, fill=HF_FILL)
    assert not [w for w in recwarn.list if issubclass(w.category, UserWarning)]
    assert cfg.zero_optimization.stage == stage
    assert getattr(cfg, dtype).enabled
    assert trio(cfg) == (16, 2, 2)
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params["lr"] == 3e-4
    resolved = cfg.to_dict()
    assert resolved.pop("pipeline")["stages"] == "auto"  # DeepSpeed's own default for pipeline stages
    assert "\"auto\"" not in json.dumps(resolved)
    if "offload" in name:
        assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    if "offload_param" in name:
        assert cfg.zero_optimization.offload_param.device == "cpu"
        assert cfg.activation_checkpointing is not None


# --- bad configs: each a ConfigError naming the key path -------------------------------------------

BAD = [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 1, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization"),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 5, "stage3_prefetch_bucket_size": 5}},
     "zero_optimization"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": True}, "gradient_clipping"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"gradient_predivide_factor": 0}, "gradient_predivide_factor"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"data_types": {"grad_accum_dtype": "fp64"}}, "data_types.grad_accum_dtype"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled"),
    ({"fp16": {"enabled": True, "fused_mode": True}}, "fp16.fused_mode"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"bf16": {"enabeld": True}}, "bf16.enabeld"),
    ({"fp16": {"fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"optimizer": {"type": "Adamm", "params": {}}}, "optimizer.type"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nestrov": True}}}, "optimizer.params.nestrov"),
    ({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm"),
    ({"optimizer": {"type": "Adam", "parms": {}}}, "optimizer.parms"),
    ({"scheduler": {"type": "CosineLR", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, "scheduler.params.warmup_num_step"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}}, "scheduler.params.cycle_max_lr"),
    ({"amp": {"enabled": False}}, "amp"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled"),
    ({"compile": {"deepcompil": True}}, "compile.deepcompil"),
    ({"hybrid_engine": {"max_out_tokens": 0}}, "hybrid_engine.max_out_tokens"),
    ({"timers": {"throughput": {"enable": True}}}, "timers.throughput.enable"),
    ({"comms_logger": {"enabled": True, "prof": True}}, "comms_logger.prof"),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": None}}, "zero_optimization.zeropp_loco_param"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ({"activation_checkpointing": {"partition_activation": True}}, "activation_checkpointing.partition_activation"),
    ({"activation_checkpointing": {"number_checkpoints": -2}}, "activation_checkpointing.number_checkpoints"),
    ({"tensorboard": {"enabled": True, "output_dir": "x"}}, "tensorboard.output_dir"),
    ({"wandb": {"enabled": 1}}, "wandb.enabled"),
    ({"flops_profiler": {"profile_step": 0}}, "flops_profiler.profile_step"),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation"),
    ({"tensor_parallel": {"autotp_size": -1}}, "tensor_parallel.autotp_size"),
    ({"tensor_parallel": {"autotp": 2}}, "tensor_parallel.autotp"),
    ({"pipeline": {"stages": 0}}, "pipeline.stages"),
    ({"sparse_attention": "fixed"}, "sparse_attention"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 2}}, "zero_optimization.mics_shard_size"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, "zero_optimization.offload_optimizer"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
]


@pytest.mark.parametrize("bad,path", BAD, ids=[p for _, p in BAD])
def test_bad_config_names_key_path(bad, path):
    raw = dict(bad)
    raw.setdefault("train_micro_batch_size_per_gpu", 1)
    err = problems_of(raw, world_size=1)
    assert err.problems, "ConfigError.problems must list the problems"
    assert any(p.startswith(path) or f" {path}" in p or f"{path}:" in p for p in err.problems), err.problems


def test_bad_config_count():
    assert len(BAD) >= 30


def test_all_problems_reported_at_once():
    err = problems_of({
        "train_batch_size": 8, "gradient_clipping": -1,
        "zero_optimization": {"stgae": 2, "offload_optimizer": {"device": "nvme"}},
        "fp16": {"enabled": True, "hysteresis": 0}, "bf16": {"enabled": True},
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    }, world_size=3)
    text = str(err)
    for needle in ("gradient_clipping", "did you mean 'stage'?", "NVMe", "fp16.hysteresis",
                   "cannot be simultaneously enabled", "'Adam'", "scheduler.params.warmup_max_lr",
                   "8 != 2 * 1 * 3"):
        assert needle in text, needle
    assert len(err.problems) >= 8


def test_did_you_mean_stage_and_top_level():
    err = problems_of({"train_batch_size": 8, "zero_optimization": {"stgae": 2}}, world_size=1)
    assert "zero_optimization.stgae" in str(err) and "did you mean 'stage'?" in str(err)
    with pytest.warns(UserWarning, match="did you mean 'gradient_clipping'?"):
        load_config({"train_batch_size": 8, "gradient_clipping_norm": 0.5}, world_size=1)


# --- parity with DeepSpeed 0.19.8 ----------------------------------------------------------------------
# Transcribed from DeepSpeed 0.19.8 deepspeed/runtime/config.py: DeepSpeedConfig.__init__ calls
# _reject_removed_config_keys(param_dict) before reading anything; it raises DeepSpeedConfigError for
# each key of _REMOVED_TOP_LEVEL_CONFIG_KEYS present at top level (whatever its value) and each key of
# _REMOVED_ZERO_CONFIG_KEYS present in a dict "zero_optimization". Each message says "... has been
# removed" and links https://github.com/deepspeedai/DeepSpeed/issues/8489.
DS_0_19_8_REMOVED_TOP_LEVEL = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                               "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                               "curriculum_learning", "progressive_layer_drop")
DS_0_19_8_REMOVED_ZERO = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


@pytest.mark.parametrize("value", [None, {}, False, {"enabled": False}])
@pytest.mark.parametrize("key", DS_0_19_8_REMOVED_TOP_LEVEL)
def test_removed_top_level_features_are_refused_with_deepspeeds_reason(key, value):
    err = problems_of({"train_batch_size": 8, key: value}, world_size=1)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(f"{key}: ")
    assert "removed" in err.problems[0] and "issues/8489" in err.problems[0] and "remove the key" in err.problems[0]


@pytest.mark.parametrize("key", DS_0_19_8_REMOVED_ZERO)
def test_removed_zero_features_are_refused_with_deepspeeds_reason(key):
    err = problems_of({"train_batch_size": 8, "zero_optimization": {"stage": 3, key: 4}}, world_size=1)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(f"zero_optimization.{key}: ")
    assert "removed" in err.problems[0] and "issues/8489" in err.problems[0]


def test_removed_keys_are_exactly_deepspeeds():
    from zerojax.config import REMOVED_TOP_LEVEL_KEYS, REMOVED_ZERO_KEYS

    assert set(REMOVED_TOP_LEVEL_KEYS) == set(DS_0_19_8_REMOVED_TOP_LEVEL)
    assert set(REMOVED_ZERO_KEYS) == set(DS_0_19_8_REMOVED_ZERO)


def test_amp_reason_names_the_replacements():
    # DeepSpeed 0.19.8: "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or
    # 'torch_autocast' instead."
    err = problems_of({"train_batch_size": 8, "amp": {"enabled": True, "opt_level": "O2"}}, world_size=1)
    assert "Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' instead" in str(err)


@pytest.mark.parametrize("key", ["_comment", "cuda_visible_devices", "comms_config", "monitor_config"])
def test_unknown_top_level_keys_load_with_one_warning_each(key):
    # DeepSpeed 0.19.8 reads top-level keys with get_scalar_param / param_dict.get and never lists the
    # rest, so these real-world keys load there; zerojax loads them and warns once per key.
    with pytest.warns(UserWarning) as record:
        cfg = load_config({"train_batch_size": 8, key: {"x": 1}, "gradient_clipping": 0.5}, world_size=1)
    mine = [str(w.message) for w in record if key in str(w.message)]
    assert len(mine) == 1 and "unknown top-level key, ignored" in mine[0]
    assert cfg == quiet_load({"train_batch_size": 8, "gradient_clipping": 0.5}, world_size=1)


def test_unknown_top_level_keys_warn_once_per_key_with_did_you_mean():
    # farther than one slip from a key zerojax reads: loaded, with a hint where one is close
    with pytest.warns(UserWarning) as record:
        load_config({"train_batch_size": 8, "gradient_clipping_norm": 0.5, "_comment": "x", "fp32": {}},
                    world_size=1)
    unknown = [str(w.message) for w in record if "unknown top-level key" in str(w.message)]
    assert len(unknown) == 3
    assert any(m.startswith("gradient_clipping_norm:") and "did you mean 'gradient_clipping'?" in m for m in unknown)
    assert any(m.startswith("_comment:") and "did you mean" not in m for m in unknown)
    assert any(m.startswith("fp32:") for m in unknown)  # two letters from fp16: not taken for it


@pytest.mark.parametrize("key, meant", [
    ("zero_optimisation", "zero_optimization"),  # British spelling
    ("Zero_Optimization", "zero_optimization"),  # case
    ("gradient_cliping", "gradient_clipping"),  # a letter dropped
    ("stpes_per_print", "steps_per_print"),  # two swapped
    ("optimiser", "optimizer"),
    ("bf32", None),  # 2 edits from bf16: a warning
    ("fp8", None),  # under 4 letters: a warning
])
def test_a_top_level_key_one_slip_from_a_known_one_is_an_error(key, meant):
    """A typo'd section would load at its defaults (ZeRO stage 0 for zero_optimisation), so a key one
    letter (added, dropped, changed, swapped) from one zerojax reads is refused with the key it meant."""
    raw = {"train_batch_size": 8, key: {"stage": 3}}
    if meant is None:
        with pytest.warns(UserWarning, match=f"{key}: unknown top-level key, ignored"):
            load_config(raw, world_size=1)
        return
    err = problems_of(raw, world_size=1)
    assert err.problems == [f"{key}: unknown top-level key; did you mean {meant!r}? (as written, DeepSpeed ignores "
                            f"it and trains with {meant}'s defaults; rename it)"]


def test_config_warnings_print_as_one_line_without_a_source_path():
    """Shown by Python's own warnings machinery (as a user sees them on stderr): `warning: <note>`,
    not the default `<zerojax file>:<line>: UserWarning: <note>` followed by a source line."""
    import subprocess
    import sys

    code = ("import zerojax.config as c; c.load_config({'train_batch_size': 8, '_comment': 'x'}, world_size=1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == ("warning: _comment: unknown top-level key, ignored (as DeepSpeed ignores "
                                              "it) (docs/config-keys.md lists the keys zerojax reads)\n"), p.stderr
    import zerojax.config

    assert issubclass(zerojax.config.ConfigWarning, UserWarning)  # filters on UserWarning still apply
    other = warnings.formatwarning("m", UserWarning, "f.py", 3, "x = 1")
    assert other.startswith("f.py:3: UserWarning: m")  # other warnings keep Python's format


def test_gradient_clipping_default_is_deepspeeds():
    # DeepSpeed 0.19.8 runtime/constants.py: GRADIENT_CLIPPING_DEFAULT = 1.0 ("By default, this feature is
    # enabled with a value of 1.0"); get_gradient_clipping reads it with get_scalar_param.
    assert quiet_load({"train_batch_size": 8}, world_size=1).gradient_clipping == 1.0
    assert quiet_load({"train_batch_size": 8, "gradient_clipping": 0.0}, world_size=1).gradient_clipping == 0.0


def test_defaults_changed_in_deepspeed_0_19_5():
    # DeepSpeed pull 8207 (v0.19.5): offload buffers pinned by default (runtime/zero/offload_config.py
    # pin_memory: bool = True); pull 8035 (v0.19.5): bf16 check_grad_overflow defaults to True
    # (runtime/precision_config.py).
    cfg = quiet_load({"train_batch_size": 8}, world_size=1)
    assert cfg.zero_optimization.offload_param.pin_memory is True
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert cfg.bf16.check_grad_overflow is True


@pytest.mark.parametrize("section,key", [("compile", "deepcompil"), ("hybrid_engine", "enabeld"),
                                         ("comms_logger", "verbos"), ("fp16", "enabeld")])
def test_strict_sections_refuse_unknown_keys_with_did_you_mean(section, key):
    # DeepSpeed 0.19.8 builds these with DeepSpeedConfigModel subclasses (runtime/config_utils.py:
    # model_config = ConfigDict(extra="forbid", ...)), so an unknown key is a pydantic ValidationError.
    err = problems_of({"train_batch_size": 8, section: {key: True}}, world_size=1)
    assert f"{section}.{key}: unknown key; did you mean" in str(err)


@pytest.mark.parametrize("raw", [
    {"train_micro_batch_size_per_gpu": 0},
    {"train_micro_batch_size_per_gpu": -2, "gradient_accumulation_steps": 2},
    {"train_batch_size": 0},
    {"train_batch_size": 8, "gradient_accumulation_steps": 0},
])
def test_batch_errors_name_the_key_the_user_wrote(raw):
    ws = 2
    # DeepSpeed refuses each too (gradient_accumulation_steps 0 with train_batch_size: a ZeroDivisionError)
    with pytest.raises((AssertionError, ZeroDivisionError)):
        deepspeed_batch(*(raw.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps")), ws)
    err = problems_of(raw, world_size=ws)
    bad = [k for k, v in raw.items() if v <= 0]
    assert [p.split(" ")[0] for p in err.problems] == bad
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key not in raw:
            assert key not in str(err), f"the message talks about {key}, which the config does not hold"
    assert "has to be greater than 0" in str(err) and "give a positive integer" in str(err)


def test_unresolved_autos_listed_together():
    err = problems_of({
        "train_batch_size": 8, "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
    }, world_size=1)
    unresolved = [p for p in err.problems if "unresolved" in p]
    assert len(unresolved) == 1
    for key in ("gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
                "scheduler.params.total_num_steps"):
        assert key in unresolved[0]


def test_fill_replaces_autos_and_ignores_non_auto_keys():
    cfg = quiet_load({"train_batch_size": 8, "gradient_clipping": "auto",
                      "optimizer": {"type": "adamw", "params": {"lr": "auto", "eps": 1e-6}}},
                     world_size=1, fill={"gradient_clipping": 0.5, "optimizer.params.lr": 3e-4,
                                         "optimizer.params.eps": 1.0, "train_batch_size": 99})
    assert cfg.gradient_clipping == 0.5
    assert dict(cfg.optimizer.params) == {"lr": 3e-4, "eps": 1e-6}  # eps was not "auto": fill not used
    assert cfg.optimizer.type == "adamw"  # as written; DeepSpeed matches names case-insensitively
    assert cfg.train_batch_size == 8


def test_hidden_size_fills_zero_autos_as_the_hugging_face_trainer():
    """transformers' trainer_config_finalize: reduce_bucket_size hidden^2; at stage 3 also
    stage3_prefetch_bucket_size int(0.9 hidden^2) and stage3_param_persistence_threshold 10 hidden.
    Without the hidden size: DeepSpeed's defaults; a fill entry for the same key wins."""
    from zerojax.config import auto_keys, hidden_size_fill

    zero = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    for stage, want in ((3, (64 * 64, int(0.9 * 64 * 64), 640)), (2, (64 * 64, 50_000_000, 100_000))):
        z = quiet_load({"train_batch_size": 8, "zero_optimization": {"stage": stage, **zero}}, world_size=1,
                       hidden_size=64).zero_optimization
        assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == want
    z = quiet_load(GUIDE_TEXT.replace('"stage": 2', '"stage": 3'), world_size=1, hidden_size=1280,
                   fill={"train_micro_batch_size_per_gpu": 1,
                         "zero_optimization.reduce_bucket_size": 7}).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        7, 1_474_560, 12_800)
    default = quiet_load({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}},
                         world_size=1).zero_optimization
    assert (default.reduce_bucket_size, default.stage3_param_persistence_threshold) == (500_000_000, 100_000)
    assert hidden_size_fill(64, stage3=False) == {"zero_optimization.reduce_bucket_size": 4096}
    assert auto_keys(GUIDE_TEXT) == [
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16.enabled",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold"]


def test_errors_name_the_config_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": true}}')
    err = problems_of(str(path), world_size=1)
    assert str(err).startswith(f"1 problem(s) in the DeepSpeed config {path}:\n  - zero_optimization.overlap_com: "
                               "unknown key; did you mean 'overlap_comm'?"), str(err)
    # a dict read from the file (as a caller that edits it first): name= says where it came from
    err = problems_of({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": True}},
                      world_size=1, name="my.json")
    assert err.source == "my.json" and "problem(s) in the DeepSpeed config my.json:" in str(err)


def test_monitors_are_checked_before_any_folder_is_made(tmp_path, monkeypatch):
    """An enabled monitor that cannot start (here wandb, not importable) stops the Monitor before
    any backend starts: the csv_monitor folder is not left behind. csv_monitor / tensorboard need
    no package beyond zerojax's dependencies; their folders appear at the first write."""
    import builtins

    from zerojax.engine.monitor import Monitor, MonitorError, monitor_problems

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    files = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"},
             "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "j"}}
    cfg = quiet_load({"train_batch_size": 8, **files, "wandb": {"enabled": True}}, world_size=1)
    with pytest.raises(MonitorError, match=r"wandb.enabled is true but the wandb package cannot be imported .*"
                                           r"pip install zerojax\[wandb\]"):
        Monitor(cfg)
    assert not (tmp_path / "csv").exists() and not (tmp_path / "tb").exists()
    monitor = Monitor(quiet_load({"train_batch_size": 8, **files}, world_size=1))
    assert len(monitor.backends) == 2 and not (tmp_path / "csv").exists()
    monitor.record(8, {"loss": 2.5, "lr": 1e-3})
    monitor.close()
    assert (tmp_path / "csv" / "j" / "Train_Samples_train_loss.csv").exists()
    assert len(list((tmp_path / "tb" / "j").glob("events.out.tfevents.*"))) == 1
    (tmp_path / "file").write_text("")
    bad = quiet_load({"train_batch_size": 8, "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "file")}},
                     world_size=1)
    assert monitor_problems(bad) == [f"csv_monitor.output_path / job_name: "
                                     f"{str(tmp_path / 'file' / 'DeepSpeedJobName')!r} "
                                     f"cannot be a folder ({str(tmp_path / 'file')!r} is a file); set "
                                     "csv_monitor.output_path to a folder"]


def test_fill_value_is_validated():
    err = problems_of({"train_batch_size": 8, "gradient_clipping": "auto"}, world_size=1,
                      fill={"gradient_clipping": -3.0})
    assert "gradient_clipping" in str(err)


def test_duplicate_keys():
    err = problems_of('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}', world_size=1)
    assert "duplicate" in str(err).lower() and "stage" in str(err)


def test_nvme_message():
    err = problems_of({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
                      world_size=1)
    assert ('zero_optimization.offload_param.device = "nvme" needs '
            'zero_optimization.offload_param.nvme_path') in str(err)


def test_max_grad_norm_message_is_deepspeeds():
    err = problems_of({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
                      world_size=1)
    assert ("'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
            "parameter 'gradient_clipping' see: https://www.deepspeed.ai/docs/config-json/#gradient-clipping for "
            "more details") in str(err)


def test_torch_autocast_says_use_bf16_or_fp16():
    err = problems_of({"train_batch_size": 8, "torch_autocast": {"enabled": True}}, world_size=1)
    assert "torch_autocast.enabled" in str(err) and '"bf16"' in str(err) and '"fp16"' in str(err)
    cfg = quiet_load({"train_batch_size": 8, "torch_autocast": {"enabled": False}}, world_size=1)
    assert cfg.torch_autocast["enabled"] is False


@pytest.mark.parametrize("name,closest", [("OneBitAdam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb"),
                                          ("MuAdam", "Adam"), ("MuAdamW", "AdamW"), ("MuSGD", "SGD")])
def test_unsupported_deepspeed_optimizers_name_closest(name, closest):
    err = problems_of({"train_batch_size": 8, "optimizer": {"type": name, "params": {"lr": 1e-3}}}, world_size=1)
    assert f"closest supported choice is {closest!r}" in str(err)
    assert "change results" in str(err)


def test_unknown_optimizer_lists_supported():
    err = problems_of({"train_batch_size": 8, "optimizer": {"type": "RMSprop"}}, world_size=1)
    for name in ("Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad"):
        assert name in str(err)
    err = problems_of({"train_batch_size": 8, "scheduler": {"type": "Cosine"}}, world_size=1)
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        assert name in str(err)


@pytest.mark.parametrize("typ", ["adam", "ADAMW", "lamb", "Lion", "sgd", "Adagrad"])
def test_optimizer_names_case_insensitive(typ):
    cfg = quiet_load({"train_batch_size": 8, "optimizer": {"type": typ, "params": {"lr": 0.1}}}, world_size=1)
    assert cfg.optimizer.type == typ


# --- aliases, numbers, comments, round trip, warnings -----------------------------------------------

def test_deprecated_aliases_load():
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": True}, world_size=1)
    assert cfg.zero_optimization.stage == 1
    assert quiet_load({"train_batch_size": 8, "zero_optimization": False}, world_size=1).zero_optimization.stage == 0
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}, world_size=1)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    cfg = quiet_load({"train_batch_size": 8,
                      "zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}},
                     world_size=1)
    assert cfg.zero_optimization.offload_param.device == "cpu"
    cfg = quiet_load({"train_batch_size": 8, "bfloat16": {"enabled": True}}, world_size=1)
    assert cfg.bf16.enabled
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 7, "param_persistence_threshold": 11, "max_live_parameters": 13,
        "max_reuse_distance": 17, "gather_16bit_weights_on_model_save": True}}, world_size=1)
    z = cfg.zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.stage3_max_live_parameters,
            z.stage3_max_reuse_distance, z.stage3_gather_16bit_weights_on_model_save) == (7, 11, 13, 17, True)
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}, world_size=1)
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save


def test_overlap_comm_default_follows_stage():
    for stage in range(4):
        cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {"stage": stage}}, world_size=1)
        assert cfg.zero_optimization.overlap_comm is (stage == 3)


def test_integral_floats_for_ints_but_not_bools():
    cfg = quiet_load({"train_batch_size": 8.0, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
                                                                     "allgather_bucket_size": 2e8}}, world_size=1)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int and type(cfg.train_batch_size) is int
    err = problems_of({"train_batch_size": True}, world_size=1)
    assert "train_batch_size" in str(err)


def test_comments_and_text_and_path_sources(tmp_path):
    text = '{\n  // C++ style\n  "train_batch_size": 4, # shell style\n  /* block */ "bf16": {"enabled": true}\n}'
    a = quiet_load(text, world_size=2)
    path = tmp_path / "ds.json"
    path.write_text(text, encoding="utf-8")
    assert quiet_load(path, world_size=2) == a == quiet_load(str(path), world_size=2)
    assert a.bf16.enabled and trio(a) == (4, 2, 1)
    err = problems_of(str(tmp_path / "missing.json"))
    assert "missing.json" in str(err)


@pytest.mark.parametrize("source,fill", [
    (GUIDE, {"train_micro_batch_size_per_gpu": 4}),
    (INTRO, None),
    (CONFIGS / "zero3_offload_param_optimizer.json", HF_FILL),
    ({"train_batch_size": 16, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3}},
      "activation_checkpointing": {"partition_activations": True}, "torch_autocast": {"enabled": False},
      "tensorboard": {"enabled": True, "output_path": "/tmp/tb"}, "compile": {"deepcompile": True},
      "hybrid_engine": {"max_out_tokens": 64}, "timers": {"throughput": {"synchronized": False}},
      "data_types": {"grad_accum_dtype": "float32"}, "communication_data_type": "BF16",
      "pipeline": {"stages": 2}}, None),
])
def test_to_dict_round_trip(source, fill):
    cfg = quiet_load(source, world_size=2, fill=fill)
    d = cfg.to_dict()
    again = quiet_load(json.loads(json.dumps(d)), world_size=2)
    assert again == cfg
    assert isinstance(cfg, Config)


def test_offload_param_below_stage3_warns_not_errors():
    with pytest.warns(UserWarning, match="offload_param has no effect at ZeRO stage 1"):
        cfg = load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 1, "offload_param": {"device": "cpu"}}}, world_size=1)
    assert cfg.zero_optimization.offload_param.device == "cpu"


def test_frozen():
    cfg = quiet_load(INTRO, world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train_batch_size = 3
    with pytest.raises(TypeError):
        cfg.zero_optimization.leaf_module["x"] = 1


def test_tensor_parallel_default_and_zero():
    assert quiet_load(INTRO, world_size=1).tensor_parallel.autotp_size == 1
    cfg = quiet_load({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 0}}, world_size=1)
    assert cfg.tensor_parallel.autotp_size == 1


def test_xla_flags_for():
    cfg = quiet_load({"train_batch_size": 8, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 2e6,
                                            "overlap_comm": True}}, world_size=1)
    flags = xla_flags_for(cfg)
    assert "--xla_gpu_reduce_scatter_combine_threshold_bytes=2000000" in flags  # 1e6 bf16 elements
    assert "--xla_gpu_all_gather_combine_threshold_bytes=4000000" in flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {"stage": 3, "overlap_comm": False}}, world_size=1)
    flags = xla_flags_for(cfg)
    assert f"--xla_gpu_all_gather_combine_threshold_bytes={50_000_000 * 4}" in flags
    assert not any("latency_hiding" in f for f in flags)


def _schema_keys(cls, prefix):
    import dataclasses

    out = []
    for f in dataclasses.fields(cls):
        if f.name == "world_size":
            continue
        path = f"{prefix}{f.name}"
        out.append(path)
        if f.metadata.get("cls") is not None:
            out += _schema_keys(f.metadata["cls"], path + ".")
    return out


def test_config_keys_page_is_generated_from_the_schema():
    from zerojax.config import docs as config_docs

    committed = (ROOT / "docs" / "config-keys.md").read_text(encoding="utf-8")
    assert committed == config_docs.render(), (
        "docs/config-keys.md is stale: run python -m zerojax.config.docs --write docs/config-keys.md")
    documented = set(re.findall(r"^\| `([A-Za-z0-9_.]+)` \|", committed, flags=re.M))
    missing = [k for k in _schema_keys(Config, "") if k not in documented]
    assert not missing, missing
    assert "DeepSpeed 0.19.8" in committed


def test_config_keys_page_check_command(tmp_path):
    from zerojax.config import docs as config_docs

    page = tmp_path / "keys.md"
    assert config_docs.main(["--write", str(page)]) == 0
    assert config_docs.main(["--check", str(page)]) == 0
    page.write_text(page.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    assert config_docs.main(["--check", str(page)]) == 1


# --- real-world configs (tests/data/ds_configs, sources in its README.md) ---------------------------

DS_CONFIGS = ROOT / "tests" / "data" / "ds_configs"
# What Hugging Face's Trainer writes into the "auto" values (trainer_config_process) for
# per_device_train_batch_size=2, gradient_accumulation_steps=2, one process, default TrainingArguments
# (lr 5e-5, betas (0.9, 0.999), eps 1e-8, weight_decay 0, max_grad_norm 1.0), --bf16.
TRAINER_FILL = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4,
                "gradient_clipping": 1.0, "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999],
                "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
                "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 5e-5,
                "scheduler.params.warmup_num_steps": 10, "scheduler.params.total_num_steps": 100,
                "fp16.enabled": False, "bf16.enabled": True}
# DeepSpeed's DeepSpeedConfig(filled config) at world size 1 (README.md there says how this was run):
# (train_batch_size, micro, accumulation), gradient_clipping, stage, fp16, bf16, optimizer, scheduler.
DS_LOADS = {
    "hf_transformers_ds_config_zero2.json": ((4, 2, 2), 1.0, 2, False, False, "adamw", "WarmupLR"),
    "hf_transformers_ds_config_zero3.json": ((4, 2, 2), 1.0, 3, False, False, "adamw", "WarmupLR"),
    "llama_factory_ds_z0_config.json": ((4, 2, 2), 1.0, 0, False, True, None, None),
    "llama_factory_ds_z2_autotp_config.json": ((4, 2, 2), 1.0, 2, False, True, None, None),
    "llama_factory_ds_z3_offload_config.json": ((4, 2, 2), 1.0, 3, False, True, None, None),
    "axolotl_zero3_bf16.json": ((4, 2, 2), 1.0, 3, False, True, None, None),
    "fastchat_deepspeed_config_s3.json": ((4, 2, 2), 1.0, 3, False, False, "adamw", None),
    "deepspeedexamples_tp_hf_integration_ds_config.json": ((4, 2, 2), 1.0, 2, False, True, "adamw", "WarmupDecayLR"),
    "deepspeedexamples_bing_bert_bsz64k_lamb_seq128.json": ((65536, 64, 1024), 1.0, 0, True, False, "lamb", None),
}
# The unknown top-level keys DeepSpeed ignores in them: one warning each in zerojax.
DS_UNKNOWN = {"llama_factory_ds_z2_autotp_config.json": ["_comment"],
              "fastchat_deepspeed_config_s3.json": ["micro_batch_size_per_gpu"]}
# Refused by DeepSpeed 0.19.8, with the key DeepSpeed's error names.
DS_REFUSES = {
    "axolotl_zero2_torch_compile.json": ["compile.disable", "compile.backend"],  # CompileConfig: extra="forbid"
    "deepspeed_unit_test_pld.json": ["progressive_layer_drop"],  # removed (_reject_removed_config_keys)
    # removed (_reject_removed_config_keys); with no batch size, DeepSpeed's batch rule would fail next
    # ("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"): reported together.
    "deepspeed_unit_test_elasticity.json": ["elasticity", "train_batch_size"],
}


def test_every_fixture_has_an_expectation():
    files = {p.name for p in DS_CONFIGS.glob("*.json")}
    assert files == set(DS_LOADS) | set(DS_REFUSES)
    assert len(files) >= 10


@pytest.mark.parametrize("name", sorted(DS_LOADS))
def test_real_world_config_loads_as_deepspeed_loads_it(name):
    trio_, clip, stage, fp16, bf16, opt, sched = DS_LOADS[name]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(DS_CONFIGS / name, world_size=1, fill=TRAINER_FILL)
    assert trio(cfg) == trio_
    assert cfg.gradient_clipping == clip
    assert cfg.zero_optimization.stage == stage
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (fp16, bf16)
    assert (cfg.optimizer.type.lower() if cfg.optimizer else None) == opt
    assert (cfg.scheduler.type if cfg.scheduler else None) == sched
    unknown = sorted(str(w.message).split(":")[0] for w in record if "unknown top-level key" in str(w.message))
    assert unknown == sorted(DS_UNKNOWN.get(name, []))
    assert "\"auto\"" not in json.dumps({k: v for k, v in cfg.to_dict().items() if k != "pipeline"})


@pytest.mark.parametrize("name", sorted(DS_REFUSES))
def test_real_world_config_refused_where_deepspeed_refuses_it(name):
    err = problems_of(DS_CONFIGS / name, world_size=1, fill=TRAINER_FILL)
    assert sorted(p.split(" ")[0].rstrip(":") for p in err.problems) == sorted(DS_REFUSES[name])


def test_a_switch_zerojax_does_not_act_on_warns_when_turned_on():
    """Every section whose `enabled` the schema documents as "accepted, no effect" (and the ZeRO++
    quantization switches) warns, naming the key, when a config turns it on; off, nothing is said."""
    import dataclasses
    import warnings

    from zerojax.config import _load, _schema
    from zerojax.config.docs import field_docs

    sections = {f.name: getattr(_schema, str(f.type), None) for f in dataclasses.fields(_schema.Config)}
    documented = {(name, "enabled") for name, cls in sections.items() if isinstance(cls, type)
                  and dataclasses.is_dataclass(cls) and "accepted, no effect" in field_docs(cls).get("enabled", "")}
    assert len(documented) == 5 and documented <= set(_load.INERT_SWITCHES)
    for section, key in _load.INERT_SWITCHES:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            load_config({"train_batch_size": 8, section: {key: True}})
            load_config({"train_batch_size": 8, section: {key: False}})
        assert [str(w.message).split(":")[0] for w in seen] == [f"{section}.{key} = true"]
