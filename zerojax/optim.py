"""DeepSpeed's `optimizer` and `scheduler` sections as optax transforms, with DeepSpeed's formulas.

Learning-rate schedules are functions of the optimizer's update count k (optax's convention):
`lr(k)` is the rate DeepSpeed uses for its k-th *applied* optimizer step. DeepSpeed builds the
scheduler with last_batch_iteration=-1 (which writes the lr of iteration "-1" into the param
groups), and the engine calls `scheduler.step()` after every optimizer step that was not skipped
for fp16 overflow. So step 0 runs with the construction-time value and step k >= 1 with the
value of `get_lr()` at last_batch_iteration = k - 1. A skipped step leaves the optimizer state
(and so k) untouched, so the schedule does not advance either, as in DeepSpeed.

Optimizers follow DeepSpeed's engine (`_configure_basic_optimizer`): "Adam"/"AdamW" are FusedAdam
(adam_w_mode defaults to true: decoupled weight decay; "AdamW" always decoupled), "Lamb" is
FusedLamb, "Lion" is FusedLion, and anything else falls through to torch.optim (SGD, Adagrad).
All updates are computed on the fp32 master weights; clipping by global norm comes first.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax.config import (
    MAX_GRAD_NORM_MSG,
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_SCHEDULERS,
    UNSUPPORTED_OPTIMIZERS,
    ConfigError,
    canonical_optimizer,
    check_optimizer_params,
    check_scheduler_params,
)

Schedule = Callable[[Any], Any]

# DeepSpeed's OneCycle writes betas = (momentum, 0.99) into every param group when it cycles
# momentum (`_initialize_momentum`), replacing the optimizer's beta2.
ONECYCLE_BETA2 = 0.99


def _error(message: str) -> Exception:
    return ConfigError([message])


def _norm(name: str) -> str:
    return "".join(c for c in str(name).lower() if c.isalnum())


class _Args:
    """A checked `params` section read through its table (zerojax.config's OPTIMIZER_PARAMS /
    SCHEDULER_PARAMS): `args[name]` is the user's value or the table's default, and a name the
    table does not list is a KeyError, so a builder cannot read a key that validation refuses."""

    def __init__(self, params: Mapping[str, Any], table: Mapping[str, Any]):
        self.params, self.table = params, table

    def __getitem__(self, name: str):
        default = self.table[name].default
        return self.params.get(name, default)

    def given(self, name: str) -> bool:
        self.table[name]  # noqa: B018 -- same KeyError as __getitem__ for a name outside the table
        return name in self.params


def _checked(check, type, params, table) -> _Args:
    problems: list[str] = []
    checked = check(type, dict(params or {}), problems)
    if problems:
        raise ConfigError(problems)
    return _Args(checked, table)


def _scheduler_args(type: str, params: Mapping[str, Any] | None) -> tuple[str, _Args]:
    """Case-insensitive here (a Python API); load_config keeps DeepSpeed's exact class names."""
    name = next((n for n in SUPPORTED_SCHEDULERS if n.lower() == str(type).lower()), None)
    if name is None:
        raise _error(f"scheduler.type: {type!r} is not supported; use one of {list(SUPPORTED_SCHEDULERS)}")
    args = _checked(check_scheduler_params, name, params, SCHEDULER_PARAMS[name])
    if name != "OneCycle" and args["last_batch_iteration"] != -1:
        raise _error("scheduler.params.last_batch_iteration: only -1 is supported; resume from a checkpoint")
    return name, args


def _float(count):
    """The update count as the default float dtype (float32, or float64 under x64)."""
    return jnp.asarray(count).astype(float)


# --------------------------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------------------------

def constant_schedule(lr: float) -> Schedule:
    lr = float(lr)

    def schedule(count):
        return jnp.full(jnp.shape(count), lr, dtype=float)

    return schedule


def _warmup_gamma(it, warmup_num_steps: int, warmup_type: str):
    """WarmupLR._get_gamma inside the warm-up (it = last_batch_iteration >= 0)."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * jnp.log(it + 1.0)
    return it / warmup_num_steps


def _warmup_args(p: _Args) -> tuple[int, str]:
    # DeepSpeed: max(2, warmup_num_steps) so that log(warmup_num_steps) is not 0.
    return max(2, p["warmup_num_steps"]), p["warmup_type"]


def _warmup_lr(p: _Args, optimizer_lr, decay_total=None):
    n, warmup_type = _warmup_args(p)
    min_lr = float(p["warmup_min_lr"])
    default_max = optimizer_lr if decay_total is None else 0.001  # WarmupDecayLR's own default
    max_lr = float(p["warmup_max_lr"] if p["warmup_max_lr"] is not None else default_max)
    delta = max_lr - min_lr

    def schedule(count):
        k = jnp.asarray(count)
        it = jnp.maximum(_float(k) - 1.0, 0.0)  # last_batch_iteration for k >= 1
        gamma = jnp.where(it < n, _warmup_gamma(it, n, warmup_type), 1.0)
        if decay_total is not None:
            decay = jnp.maximum(0.0, (decay_total - it) / float(max(1.0, decay_total - n)))
            gamma = jnp.where(it < n, gamma, decay)
        return jnp.where(k == 0, min_lr, min_lr + delta * gamma)

    return schedule


def _warmup_cosine_lr(p: _Args, optimizer_lr):
    total = p["total_num_steps"]
    n, warmup_type = _warmup_args(p)
    wmin = float(p["warmup_min_ratio"])
    cmin = float(p["cos_min_ratio"])
    real_total = float(max(1, total - n))

    def schedule(count):
        k = jnp.asarray(count)
        it = jnp.maximum(_float(k) - 1.0, 0.0)
        warm = wmin + _warmup_gamma(it, n, warmup_type) * (1.0 - wmin)
        # (1 + cos(pi * progress)) / 2 written as sin^2(pi/2 * (1 - progress)), with 1 - progress
        # formed from integers: no cancellation near the end of the decay in float32.
        remaining = jnp.clip((real_total - (it - n + 1.0)) / real_total, 0.0, 1.0)
        cos_ratio = jnp.maximum(0.0, cmin + (1.0 - cmin) * jnp.sin(0.5 * math.pi * remaining) ** 2)
        ratio = jnp.where(it < n, warm, cos_ratio)
        # Before its first step() DeepSpeed's WarmupCosineLR sets lr = 0 (get_lr at iteration -1).
        return jnp.where(k == 0, 0.0, optimizer_lr * ratio)

    return schedule


class _OneCycle(NamedTuple):
    min_lr: float
    max_lr: float
    decay_lr_rate: float
    first: float
    second: float
    first_stairs: int
    second_stairs: int
    decay_step_size: float
    cycle_momentum: bool
    min_mom: float
    max_mom: float
    decay_mom_rate: float

    @classmethod
    def parse(cls, p: _Args):
        if p["last_batch_iteration"] != -1:
            raise _error("scheduler.params.last_batch_iteration: only -1 is supported; resume from a checkpoint")
        first = float(p["cycle_first_step_size"])
        second = p["cycle_second_step_size"]
        first_stairs = int(p["cycle_first_stair_count"])
        second_stairs = p["cycle_second_stair_count"]
        return cls(
            min_lr=float(p["cycle_min_lr"]), max_lr=float(p["cycle_max_lr"]),
            decay_lr_rate=float(p["decay_lr_rate"]),
            first=first, second=first if second is None else float(second),
            first_stairs=first_stairs,
            second_stairs=first_stairs if second_stairs is None else int(second_stairs),
            decay_step_size=float(p["decay_step_size"]),
            cycle_momentum=bool(p["cycle_momentum"]),
            min_mom=float(p["cycle_min_mom"]), max_mom=float(p["cycle_max_mom"]),
            decay_mom_rate=float(p["decay_mom_rate"]),
        )

    @property
    def total(self):
        return self.first + self.second

    def scale(self, b):
        """OneCycle._get_scale_factor at batch_iteration b = last_batch_iteration + 1.

        DeepSpeed's x = frac(b / total) compared with first / total is the same as comparing
        the in-cycle position b mod total with the first step size; done that way here so that
        float32 stays exact on whole-step boundaries.
        """
        pos = jnp.mod(b, self.total)
        rising = pos <= self.first
        up, down = pos, self.total - pos
        scale = jnp.where(rising, up / self.first, down / self.second)
        if self.first_stairs > 0:
            stair_up = jnp.floor(up * self.first_stairs / self.first) / self.first_stairs
            scale = jnp.where(rising, stair_up, scale)
        if self.second_stairs > 0:
            stair_down = jnp.floor(down * self.second_stairs / self.second) / self.second_stairs
            scale = jnp.where(rising, scale, stair_down)
        return scale

    def lr(self, count):
        k = jnp.asarray(count)
        kf = _float(k)
        cycle = self.min_lr + (self.max_lr - self.min_lr) * self.scale(kf)
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0):
            decay = jnp.full(jnp.shape(kf), self.min_lr, dtype=kf.dtype)
        else:
            decay = self.min_lr / (1.0 + self.decay_lr_rate * (kf - self.total) / self.decay_step_size)
        return jnp.where(kf - 1.0 < self.total, cycle, decay)

    def momentum(self, count):
        k = jnp.asarray(count)
        kf = _float(k)
        cycle = self.max_mom - (self.max_mom - self.min_mom) * self.scale(kf)
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0):
            decay = jnp.full(jnp.shape(kf), self.max_mom, dtype=kf.dtype)
        else:
            decay = self.max_mom * (1.0 + self.decay_mom_rate * (kf - self.total) / self.decay_step_size)
        mom = jnp.where(kf - 1.0 < self.total, cycle, decay)
        # At construction OneCycle writes betas = (cycle_min_mom, 0.99): the first step uses it.
        return jnp.where(k == 0, self.min_mom, mom)


def _lr_range_test(p: _Args):
    min_lr = float(p["lr_range_test_min_lr"])
    step_size = float(p["lr_range_test_step_size"])
    rate = float(p["lr_range_test_step_rate"])
    staircase = bool(p["lr_range_test_staircase"])

    def schedule(count):
        k = _float(count)  # interval uses last_batch_iteration + 1 = k
        interval = jnp.floor(k / step_size) if staircase else k / step_size
        return min_lr * (1.0 + rate * interval)

    return schedule


def schedule_from(type: str, params: Mapping[str, Any] | None = None, *, optimizer_lr: float = 1e-3) -> Schedule:
    """The `scheduler` section as a jittable `lr(count)`.

    `optimizer_lr` is the optimizer's lr, which DeepSpeed's WarmupLR (warmup_max_lr default) and
    WarmupCosineLR (the lr its ratios multiply) read from the param groups.
    """
    kind, args = _scheduler_args(type, params)
    if kind == "WarmupLR":
        return _warmup_lr(args, float(optimizer_lr))
    if kind == "WarmupDecayLR":
        return _warmup_lr(args, float(optimizer_lr), decay_total=args["total_num_steps"])
    if kind == "WarmupCosineLR":
        return _warmup_cosine_lr(args, float(optimizer_lr))
    if kind == "OneCycle":
        return _OneCycle.parse(args).lr
    return _lr_range_test(args)


def momentum_schedule_from(type: str, params: Mapping[str, Any] | None = None) -> Schedule | None:
    """OneCycle's beta1 schedule `beta1(count)` when it cycles momentum, else None.

    When it is used, beta2 is ONECYCLE_BETA2 (DeepSpeed writes betas = (momentum, 0.99)).
    """
    kind, args = _scheduler_args(type, params)
    if kind != "OneCycle":
        return None
    cycle = _OneCycle.parse(args)
    return cycle.momentum if cycle.cycle_momentum else None


def _optimizer_lr(cfg) -> float:
    """The optimizer's lr, or the default of the class DeepSpeed builds (1e-3 without an optimizer)."""
    opt = getattr(cfg, "optimizer", None)
    if opt is None:
        return 1e-3
    return float(_Args(opt.params, OPTIMIZER_PARAMS[canonical_optimizer(opt.type)])["lr"])


def build_schedule(cfg) -> Schedule:
    """lr(k) of the k-th applied update, from `cfg.scheduler` (constant optimizer lr without one)."""
    lr = _optimizer_lr(cfg)
    if cfg.scheduler is None:
        return constant_schedule(lr)
    return schedule_from(cfg.scheduler.type, cfg.scheduler.params, optimizer_lr=lr)


# --------------------------------------------------------------------------------------------
# Gradient clipping (DeepSpeed / torch.nn.utils.clip_grad_norm_ formula)
# --------------------------------------------------------------------------------------------

def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale the whole tree by max_norm / (norm + 1e-6) when that is below 1.

    DeepSpeed's optimizers (`clip = (norm + 1e-6) / clip_grad; if clip > 1: grads /= clip`) and
    torch's clip_grad_norm_ both keep the 1e-6; optax.clip_by_global_norm does not.
    """
    max_norm = float(max_norm)

    def update(updates, state, params=None):
        del params
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
                            for g in jax.tree.leaves(updates)))
        coef = max_norm / (norm + 1e-6)
        factor = jnp.where(coef < 1.0, coef, 1.0)
        return jax.tree.map(lambda g: (g * factor).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------

class AdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any
    nu_max: Any  # amsgrad only, else None


class LionState(NamedTuple):
    count: jax.Array
    mu: Any


class SGDState(NamedTuple):
    count: jax.Array
    momentum_buffer: Any  # None without momentum


class AdagradState(NamedTuple):
    count: jax.Array
    sum: Any


def _zeros(params):
    return jax.tree.map(jnp.zeros_like, params)


def _need_params(params, name):
    if params is None:
        raise ValueError(f"{name} needs `params` in update() (weight decay / trust ratio)")


def _betas(b1: float, b2: float, momentum: Schedule | None):
    """(beta1(count), beta2) with OneCycle's momentum cycling when given."""
    if momentum is None:
        return (lambda count: b1), b2
    return momentum, ONECYCLE_BETA2


def scale_by_fused_adam(lr: Schedule, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                        bias_correction=True, amsgrad=False, momentum: Schedule | None = None,
                        mu_dtype=None):
    """DeepSpeed FusedAdam (csrc multi_tensor_adam) / torch Adam, AdamW; returns -lr * step.

    mu_dtype: None (the params' dtype) or e.g. jnp.bfloat16: the first moment is *stored* in it
    (EngineOptions.adam_mu_dtype; optax's `mu_dtype`), updated and used in fp32 within a step."""
    beta1_fn, b2 = _betas(b1, b2, momentum)

    def init(params):
        mu = _zeros(params) if mu_dtype is None else jax.tree.map(lambda p: jnp.zeros_like(p, mu_dtype), params)
        return AdamState(jnp.zeros([], jnp.int32), mu, _zeros(params),
                         _zeros(params) if amsgrad else None)

    def update(grads, state, params=None):
        if weight_decay:
            _need_params(params, "Adam")
        count = state.count
        t = count + 1
        beta1, lr_t = beta1_fn(count), lr(count)
        if weight_decay and not adam_w_mode:  # L2: added to the gradient (ADAM_MODE_0)
            grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        mu = jax.tree.map(lambda m, g: beta1 * m.astype(g.dtype) + (1 - beta1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu) if amsgrad else None
        if bias_correction:
            bc1, bc2 = 1 - beta1 ** t, 1 - b2 ** t
        else:
            bc1 = bc2 = 1.0

        def step(m, v, p):
            upd = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
            if weight_decay and adam_w_mode:  # decoupled (ADAM_MODE_1): p -= lr * (upd + wd * p)
                upd = upd + weight_decay * p
            return (-lr_t * upd).astype(m.dtype)

        v_used = nu_max if amsgrad else nu
        p_tree = params if params is not None else mu
        updates = jax.tree.map(step, mu, v_used, p_tree)
        if mu_dtype is not None:
            mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return updates, AdamState(t, mu, nu, nu_max)

    return optax.GradientTransformation(init, update)


def scale_by_fused_lamb(lr: Schedule, *, b1=0.9, b2=0.999, eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0,
                        bias_correction=True, max_coeff=10.0, min_coeff=0.01, momentum: Schedule | None = None):
    """DeepSpeed FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu): per-tensor trust ratio."""
    beta1_fn, b2 = _betas(b1, b2, momentum)

    def init(params):
        return AdamState(jnp.zeros([], jnp.int32), _zeros(params), _zeros(params), None)

    def update(grads, state, params=None):
        _need_params(params, "Lamb")
        count = state.count
        t = count + 1
        beta1, lr_t = beta1_fn(count), lr(count)
        mu = jax.tree.map(lambda m, g: beta1 * m + (1 - beta1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        if bias_correction:
            bc1, bc2 = 1 - beta1 ** t, 1 - b2 ** t
        else:
            bc1 = bc2 = 1.0

        def step(m, v, p):
            v_hat = v / bc2
            denom = jnp.sqrt(v_hat + eps) if eps_inside_sqrt else jnp.sqrt(v_hat) + eps
            upd = (m / bc1) / denom + weight_decay * p
            w_norm = jnp.sqrt(jnp.sum(jnp.square(p)))
            u_norm = jnp.sqrt(jnp.sum(jnp.square(upd)))
            coeff = jnp.where((w_norm != 0) & (u_norm != 0),
                              jnp.clip(w_norm / jnp.where(u_norm != 0, u_norm, 1), min_coeff, max_coeff), 1.0)
            return (-lr_t * coeff * upd).astype(m.dtype)

        updates = jax.tree.map(step, mu, nu, params)
        return updates, AdamState(t, mu, nu, None)

    return optax.GradientTransformation(init, update)


def scale_by_lion(lr: Schedule, *, b1=0.9, b2=0.999, weight_decay=0.0, momentum: Schedule | None = None):
    """DeepSpeed FusedLion / CPULion: p = p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g)."""
    beta1_fn, b2 = _betas(b1, b2, momentum)

    def init(params):
        return LionState(jnp.zeros([], jnp.int32), _zeros(params))

    def update(grads, state, params=None):
        if weight_decay:
            _need_params(params, "Lion")
        beta1, lr_t = beta1_fn(state.count), lr(state.count)

        def step(m, g, p):
            upd = jnp.sign(beta1 * m + (1 - beta1) * g)
            if weight_decay:
                upd = upd + weight_decay * p
            return (-lr_t * upd).astype(m.dtype)

        p_tree = params if params is not None else grads
        updates = jax.tree.map(step, state.mu, grads, p_tree)
        mu = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g, state.mu, grads)
        return updates, LionState(state.count + 1, mu)

    return optax.GradientTransformation(init, update)


def scale_by_torch_sgd(lr: Schedule, *, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD: the first momentum step stores the gradient itself (no dampening)."""

    def init(params):
        return SGDState(jnp.zeros([], jnp.int32), _zeros(params) if momentum else None)

    def update(grads, state, params=None):
        if weight_decay:
            _need_params(params, "SGD")
            grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        lr_t = lr(state.count)
        buf = None
        if momentum:
            first = state.count == 0
            buf = jax.tree.map(lambda b, g: jnp.where(first, g, momentum * b + (1 - dampening) * g),
                               state.momentum_buffer, grads)
            if nesterov:
                grads = jax.tree.map(lambda g, b: g + momentum * b, grads, buf)
            else:
                grads = buf
        updates = jax.tree.map(lambda g: (-lr_t * g).astype(g.dtype), grads)
        return updates, SGDState(state.count + 1, buf)

    return optax.GradientTransformation(init, update)


def scale_by_torch_adagrad(lr: Schedule, *, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                           eps=1e-10):
    """torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay); p -= clr * g / (sqrt(sum) + eps)."""

    def init(params):
        return AdagradState(jnp.zeros([], jnp.int32),
                            jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params))

    def update(grads, state, params=None):
        if weight_decay:
            _need_params(params, "Adagrad")
            grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        clr = lr(state.count) / (1 + state.count * lr_decay)
        acc = jax.tree.map(lambda s, g: s + g * g, state.sum, grads)
        updates = jax.tree.map(lambda g, s: (-clr * g / (jnp.sqrt(s) + eps)).astype(g.dtype), grads, acc)
        return updates, AdagradState(state.count + 1, acc)

    return optax.GradientTransformation(init, update)


def optimizer_from(type: str, params: Mapping[str, Any] | None = None, *, gradient_clipping: float = 0.0,
                   schedule: Schedule | None = None,
                   momentum_schedule: Schedule | None = None, mu_dtype=None) -> optax.GradientTransformation:
    """The `optimizer` section as an optax transform: clip (if > 0), then the optimizer at `schedule`.

    Without `schedule` the lr is constant: `params["lr"]`, or the default of the class DeepSpeed
    would build. `momentum_schedule` (OneCycle's beta1 cycling, see momentum_schedule_from) applies
    to optimizers with betas; DeepSpeed turns it off, with a warning, for the others.
    """
    closest = UNSUPPORTED_OPTIMIZERS.get(_norm(type))
    if closest is not None:
        raise _error(f"optimizer.type: {type!r} changes the update ({closest[1]}) and is not supported by zerojax; "
                     f"the closest supported choice is {closest[0]!r}")
    kind = canonical_optimizer(type)
    if kind is None:
        raise _error(f"optimizer.type: {type!r} is not supported; use one of {list(SUPPORTED_OPTIMIZERS)}")
    if "max_grad_norm" in (params or {}):
        raise _error(f"optimizer.params.max_grad_norm: {MAX_GRAD_NORM_MSG}")
    p = _checked(check_optimizer_params, kind, params, OPTIMIZER_PARAMS[kind])
    if "maximize" in p.table and p["maximize"]:  # torch.optim's flag
        raise _error("optimizer.params.maximize: only false is supported; negate the loss instead")
    lr_fn = schedule if schedule is not None else constant_schedule(float(p["lr"]))
    wd = float(p["weight_decay"])

    if mu_dtype is not None and kind not in ("Adam", "AdamW"):
        raise _error(f"EngineOptions.adam_mu_dtype={jnp.dtype(mu_dtype).name!r} stores Adam's first moment in "
                     f"a lower precision and applies to Adam / AdamW only; optimizer.type is {type!r}: "
                     "leave adam_mu_dtype None")
    if momentum_schedule is not None and kind in ("SGD", "Adagrad"):
        warnings.warn(f"cycle_momentum is disabled because optimizer {type} does not support momentum, "
                      "no betas attribute in defaults", stacklevel=2)
        momentum_schedule = None

    if kind in ("Adam", "AdamW"):
        b1, b2 = p["betas"]
        torch_adam, amsgrad = bool(p["torch_adam"]), bool(p["amsgrad"])
        if amsgrad and not torch_adam:
            raise _error("optimizer.params.amsgrad: FusedAdam does not support the AMSGrad variant; "
                         "set torch_adam: true to use torch.optim.Adam")
        if torch_adam and p.given("bias_correction"):
            raise _error("optimizer.params.bias_correction is a FusedAdam option; torch.optim.Adam does not take it")
        # The name "AdamW" forces decoupled weight decay; "Adam" follows adam_w_mode (default true).
        adam_w_mode = bool(p["adam_w_mode"]) or kind == "AdamW"
        opt = scale_by_fused_adam(lr_fn, b1=b1, b2=b2, eps=float(p["eps"]), weight_decay=wd,
                                  adam_w_mode=adam_w_mode, bias_correction=bool(p["bias_correction"]),
                                  amsgrad=amsgrad, momentum=momentum_schedule, mu_dtype=mu_dtype)
    elif kind == "Lamb":
        if p["amsgrad"]:
            raise _error("optimizer.params.amsgrad: FusedLamb does not support the AMSGrad variant")
        b1, b2 = p["betas"]
        opt = scale_by_fused_lamb(lr_fn, b1=b1, b2=b2, eps=float(p["eps"]),
                                  eps_inside_sqrt=bool(p["eps_inside_sqrt"]), weight_decay=wd,
                                  bias_correction=bool(p["bias_correction"]),
                                  max_coeff=float(p["max_coeff"]),
                                  min_coeff=float(p["min_coeff"]), momentum=momentum_schedule)
    elif kind == "Lion":
        b1, b2 = p["betas"]
        opt = scale_by_lion(lr_fn, b1=b1, b2=b2, weight_decay=wd, momentum=momentum_schedule)
    elif kind == "SGD":
        momentum, dampening, nesterov = float(p["momentum"]), float(p["dampening"]), bool(p["nesterov"])
        if nesterov and (momentum <= 0 or dampening != 0):
            raise _error("optimizer.params.nesterov: Nesterov momentum requires a momentum and zero dampening")
        opt = scale_by_torch_sgd(lr_fn, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)
    else:
        opt = scale_by_torch_adagrad(lr_fn, lr_decay=float(p["lr_decay"]), weight_decay=wd,
                                     initial_accumulator_value=float(p["initial_accumulator_value"]),
                                     eps=float(p["eps"]))
    if gradient_clipping and gradient_clipping > 0:
        return optax.chain(clip_by_global_norm(gradient_clipping), opt)
    return opt


def build_optimizer(cfg, *, clip: bool = True, mu_dtype=None) -> optax.GradientTransformation:
    """`cfg.optimizer` + `cfg.scheduler` + `cfg.gradient_clipping` -> one optax transform (no loss scaling).

    clip=False leaves out the global-norm clipping (host offload clips the whole gradient itself,
    then runs the optimizer chunk by chunk). mu_dtype: Adam's stored first moment (see
    `scale_by_fused_adam`)."""
    if cfg.optimizer is None:
        raise _error("optimizer: the config has no optimizer section; add one, e.g. "
                     '{"type": "AdamW", "params": {"lr": 1e-4}}')
    momentum = None
    if cfg.scheduler is not None:
        momentum = momentum_schedule_from(cfg.scheduler.type, cfg.scheduler.params)
    return optimizer_from(cfg.optimizer.type, cfg.optimizer.params,
                          gradient_clipping=float(cfg.gradient_clipping or 0.0) if clip else 0.0,
                          schedule=build_schedule(cfg), momentum_schedule=momentum, mu_dtype=mu_dtype)
