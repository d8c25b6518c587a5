"""Optimizer and scheduler parameters: one table read by load_config's validation and by zerojax.optim's
builders (which take each default from it)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from zerojax.config._values import convert, freeze, is_auto, unknown

SUPPORTED_OPTIMIZERS = ("Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad")
_NUM, _NONNEG, _BOOL, _BETAS, _POSINT, _INT = "num", "nonneg", "bool", "betas", "posint", "int"
_LR = "lr"  # a learning rate: finite, >= 0, and one that float32 holds (the optimizer's arithmetic is fp32)
# the largest float32: an lr above it is inf in the update, and every weight it touches becomes NaN
FLOAT32_MAX = 3.4028234663852886e38
_OPT_BOOL = "bool_or_null"  # torch.optim's foreach / fused: None means "let torch choose"


class Param(NamedTuple):
    """One constructor argument of a DeepSpeed optimizer / scheduler: the one table that both
    `load_config` (validation) and `zerojax.optim` (the builders, which read `default`) use."""

    check: str  # the value check: _LR, _NUM, _NONNEG, _BOOL, _OPT_BOOL, _BETAS, _POSINT, _INT or "warmup_type"
    default: Any = None  # the default of the class DeepSpeed builds; None: computed by the builder or required
    required: bool = False
    inert: str = ""  # non-empty: accepted, but changes nothing in zerojax, and why


_TORCH_SWITCH = Param(_OPT_BOOL, inert="a PyTorch kernel choice (foreach / fused / capturable / differentiable); "
                                   "the update is the same")
_SET_GRAD_NONE = Param(_BOOL, True, inert="frees PyTorch .grad tensors; JAX gradients are values")
_FP32_STATES = Param(_BOOL, True, inert="optimizer states are always fp32 in zerojax")
_MAXIMIZE = Param(_BOOL, False)  # torch.optim: only false is supported (the builder refuses true)
_BETAS_DEFAULT = (0.9, 0.999)
# deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam and, with torch_adam, torch.optim.Adam(W)
# (engine.py `_configure_basic_optimizer` pops torch_adam and adam_w_mode first).
_ADAM_PARAMS = {"lr": Param(_LR, 1e-3), "betas": Param(_BETAS, _BETAS_DEFAULT), "eps": Param(_NONNEG, 1e-8),
                "weight_decay": Param(_NONNEG, 0.0), "adam_w_mode": Param(_BOOL, True),
                "bias_correction": Param(_BOOL, True), "amsgrad": Param(_BOOL, False),
                "torch_adam": Param(_BOOL, False), "set_grad_none": _SET_GRAD_NONE,
                "fp32_optimizer_states": _FP32_STATES, "maximize": _MAXIMIZE, "foreach": _TORCH_SWITCH,
                "fused": _TORCH_SWITCH, "capturable": _TORCH_SWITCH, "differentiable": _TORCH_SWITCH}
OPTIMIZER_PARAMS = {
    "Adam": _ADAM_PARAMS,
    "AdamW": _ADAM_PARAMS,
    # deepspeed.ops.lamb.FusedLamb (max_grad_norm is refused by the engine for every optimizer)
    "Lamb": {"lr": Param(_LR, 1e-3), "bias_correction": Param(_BOOL, True), "betas": Param(_BETAS, _BETAS_DEFAULT),
             "eps": Param(_NONNEG, 1e-8), "eps_inside_sqrt": Param(_BOOL, False), "weight_decay": Param(_NONNEG, 0.0),
             "max_coeff": Param(_NONNEG, 10.0), "min_coeff": Param(_NONNEG, 0.01), "amsgrad": Param(_BOOL, False)},
    # deepspeed.ops.lion.FusedLion / DeepSpeedCPULion
    "Lion": {"lr": Param(_LR, 1e-3), "betas": Param(_BETAS, _BETAS_DEFAULT), "weight_decay": Param(_NONNEG, 0.0),
             "set_grad_none": _SET_GRAD_NONE, "fp32_optimizer_states": _FP32_STATES},
    # torch.optim.SGD (DeepSpeed passes names it does not know to torch.optim)
    "SGD": {"lr": Param(_LR, 1e-3), "momentum": Param(_NONNEG, 0.0), "dampening": Param(_NONNEG, 0.0),
            "weight_decay": Param(_NONNEG, 0.0), "nesterov": Param(_BOOL, False), "maximize": _MAXIMIZE,
            "foreach": _TORCH_SWITCH, "fused": _TORCH_SWITCH, "differentiable": _TORCH_SWITCH},
    # torch.optim.Adagrad / DeepSpeedCPUAdagrad
    "Adagrad": {"lr": Param(_LR, 1e-2), "lr_decay": Param(_NONNEG, 0.0), "weight_decay": Param(_NONNEG, 0.0),
                "initial_accumulator_value": Param(_NONNEG, 0.0), "eps": Param(_NONNEG, 1e-10),
                "maximize": _MAXIMIZE, "foreach": _TORCH_SWITCH, "fused": _TORCH_SWITCH,
                "differentiable": _TORCH_SWITCH},
}
# DeepSpeed optimizers zerojax does not run: (closest supported, why results would differ).
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": ("Adam", "1-bit Adam compresses gradient communication with error feedback"),
    "zerooneadam": ("Adam", "0/1 Adam skips and compresses variance updates and communication"),
    "onebitlamb": ("Lamb", "1-bit LAMB compresses gradient communication with error feedback"),
    "muadam": ("Adam", "MuAdam (muP) rescales per-layer learning rates by width"),
    "muadamw": ("AdamW", "MuAdamW (muP) rescales per-layer learning rates by width"),
    "musgd": ("SGD", "MuSGD (muP) rescales per-layer learning rates by width"),
    "muon": ("AdamW", "Muon orthogonalises matrix updates (Newton-Schulz)"),
}
MAX_GRAD_NORM_MSG = (
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the deepspeed "
    "parameter 'gradient_clipping' see: https://www.deepspeed.ai/docs/config-json/#gradient-clipping "
    "for more details")

SUPPORTED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# deepspeed/runtime/lr_schedules.py constructor defaults.
_LAST = Param(_INT, -1)
_WARMUP = {"warmup_min_lr": Param(_LR, 0.0),
           # WarmupLR: the optimizer's lr when absent; WarmupDecayLR: 0.001 (computed by the builder)
           "warmup_max_lr": Param(_LR),
           "warmup_num_steps": Param(_POSINT, 1000), "warmup_type": Param("warmup_type", "log"),
           "last_batch_iteration": _LAST}
SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": Param(_POSINT, required=True), **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": Param(_POSINT, required=True), "warmup_min_ratio": Param(_NONNEG, 0.0),
                       "warmup_num_steps": Param(_POSINT, 1000), "cos_min_ratio": Param(_NONNEG, 0.0001),
                       "warmup_type": Param("warmup_type", "log"), "last_batch_iteration": _LAST},
    "OneCycle": {"cycle_min_lr": Param(_LR, required=True), "cycle_max_lr": Param(_LR, required=True),
                 "decay_lr_rate": Param(_NUM, 0.0), "cycle_first_step_size": Param(_POSINT, 2000),
                 "cycle_second_step_size": Param(_POSINT),  # None: cycle_first_step_size
                 "cycle_first_stair_count": Param(_INT, 0),
                 "cycle_second_stair_count": Param(_INT),  # None: cycle_first_stair_count
                 "decay_step_size": Param(_INT, 0), "cycle_momentum": Param(_BOOL, True),
                 "cycle_min_mom": Param(_NUM, 0.8), "cycle_max_mom": Param(_NUM, 0.9),
                 "decay_mom_rate": Param(_NUM, 0.0), "last_batch_iteration": _LAST},
    "LRRangeTest": {"lr_range_test_min_lr": Param(_LR, 1e-3), "lr_range_test_step_size": Param(_POSINT, 2000),
                    "lr_range_test_step_rate": Param(_NUM, 1.0), "lr_range_test_staircase": Param(_BOOL, False),
                    "last_batch_iteration": _LAST},
}


def canonical_optimizer(name):
    """DeepSpeed matches optimizer names case-insensitively; the table's spelling, or None."""
    return next((c for c in SUPPORTED_OPTIMIZERS if c.lower() == str(name).lower()), None)


def check_optimizer_params(type, params, problems, path="optimizer.params"):
    """Validate `params` of optimizer `type` (a supported name) against OPTIMIZER_PARAMS."""
    return _check_params(params, OPTIMIZER_PARAMS[canonical_optimizer(type)], path, problems)


def check_scheduler_params(type, params, problems, path="scheduler.params"):
    """Validate `params` of scheduler `type` (a name in SUPPORTED_SCHEDULERS) against SCHEDULER_PARAMS."""
    return _check_params(params, SCHEDULER_PARAMS[type], path, problems)


def _check_params(params, schema, path, problems):
    out = {}
    for name, value in params.items():
        where = f"{path}.{name}"
        if name == "max_grad_norm":
            problems.append(f"{where}: {MAX_GRAD_NORM_MSG}")
            continue
        if name not in schema:
            unknown(path, name, schema, problems)
            continue
        if is_auto(value):
            out[name] = value  # reported as unresolved
            continue
        ok, conv = _check_param(value, schema[name].check, where, problems)
        if ok:
            out[name] = conv
    for name, spec in schema.items():
        if spec.required and name not in params:
            problems.append(f"{path}.{name}: required by this scheduler and missing")
    return freeze(out)


def _check_param(value, kind, where, problems):
    if kind == _OPT_BOOL and value is None:
        return True, None
    if kind in (_BOOL, _OPT_BOOL):
        return convert(value, {"kind": "bool"}, where, problems)
    if kind in (_NUM, _NONNEG, _LR):
        if isinstance(value, (list, tuple)):  # DeepSpeed allows one value per param group
            results = [_check_param(v, kind, where, problems) for v in value]
            return all(r[0] for r in results), [r[1] for r in results]
        if kind == _LR:
            return _check_learning_rate(value, where, problems)
        ok, conv = convert(value, {"kind": "float", **({"ge": 0.0} if kind == _NONNEG else {})}, where, problems)
        return ok, (value if ok else None)  # keep the user's int/float as written
    if kind in (_INT, _POSINT):
        return convert(value, {"kind": "int", **({"ge": 1} if kind == _POSINT else {})}, where, problems)
    if kind == _BETAS:
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
            problems.append(f"{where} = {value!r}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")
            return False, None
        return True, list(value)
    if kind == "warmup_type":
        if value not in ("log", "linear"):
            problems.append(f"{where} = {value!r}: expected one of ['log', 'linear']")
            return False, None
        return True, value
    return True, value


def learning_rate_problem(value) -> str | None:
    """Why `value` is not a learning rate (a number, finite, >= 0, at most float32's largest: the update
    runs in fp32, where 1e39 is inf and turns every weight it touches into NaN), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "expected a number"
    if not math.isfinite(value):
        return "expected a finite number"
    if value < 0:
        return "a negative learning rate climbs the loss; give a value >= 0"
    if value > FLOAT32_MAX:
        return f"float32 holds at most {FLOAT32_MAX:.4g} (the update would be inf); give a smaller value"
    return None


def _check_learning_rate(value, where, problems):
    why = learning_rate_problem(value)
    if why is not None:
        problems.append(f"{where} = {value!r}: {why}")
        return False, None
    return True, value  # the user's int/float as written
