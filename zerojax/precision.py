"""Mixed precision: the compute dtype, and fp16 loss scaling as an optax wrapper.

`dynamic_loss_scale(inner)` is DeepSpeed's `DynamicLossScaler` (deepspeed/runtime/fp16/
loss_scaler.py) as a GradientTransformation: `update()` receives gradients of
(loss x state.loss_scale), unscales them, checks that every element of every leaf is finite
(a jnp reduction, so it works on sharded trees under jit), and then either applies `inner` or
skips the step: zero updates, `inner_state` returned untouched (so the lr schedule, which reads
the inner optimizer's count, does not advance either: DeepSpeed's engine does not call
`lr_scheduler.step()` on an overflow step). The scale then moves by `update_scale(overflow)`.

The same logic apart from any optimizer is a `LossScaler` (`loss_scaler_from_config`): `check`
(unscale + finite flag + new scale state) and `next_state` (the scale's move for a flag computed
elsewhere). Host offload uses it: its optimizer runs chunk by chunk over host memory, so the
finiteness of the gradients is computed as they stream and the skip is applied per chunk.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# DeepSpeed raises this (DynamicLossScaler.update_scale) when an overflow arrives with the scale
# already at min_loss_scale and no hysteresis left; zerojax sets `overflow_at_min` instead, and
# the engine raises with this text.
MIN_SCALE_ERROR = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."

SCALE_FACTOR = 2.0  # DynamicLossScaler.scale_factor


class DynamicLossScaleState(NamedTuple):
    loss_scale: jax.Array  # float32 scalar: the scale the next loss is multiplied by
    inner_state: Any
    cur_iter: jax.Array  # int32: update_scale() calls so far
    last_overflow_iter: jax.Array  # int32, -1 before the first overflow
    cur_hysteresis: jax.Array  # int32: overflows still tolerated before the scale drops
    skipped: jax.Array  # bool: the last update was skipped (non-finite gradients)
    overflow_at_min: jax.Array  # bool, sticky: DeepSpeed would have raised MIN_SCALE_ERROR


LossScaleState = DynamicLossScaleState  # the static scaler uses the same state (counters unused)


def finite_leaves(tree) -> jax.Array:
    """A bool per leaf of `tree`: whether it holds no inf / NaN (the checkpoint's check names the first)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.ones((0,), jnp.bool_)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def all_finite(tree) -> jax.Array:
    return finite_leaves(tree).all()


def _unscale(grads, loss_scale):
    """grads / loss_scale, in at least float32 (fp16 gradients are unscaled into fp32, as
    DeepSpeed unscales into its fp32 master gradients)."""
    inv = 1.0 / loss_scale

    def one(g):
        dtype = jnp.promote_types(g.dtype, jnp.float32)
        return g.astype(dtype) * inv.astype(dtype)

    return jax.tree.map(one, grads)


def _inner_or_skip(inner, unscaled, finite, inner_state, params):
    """inner.update on finite gradients, else (zero updates, inner_state unchanged)."""
    out_shape = jax.eval_shape(inner.update, unscaled, inner_state, params)[0]

    def apply(operands):
        g, s, p = operands
        return inner.update(g, s, p)

    def skip(operands):
        _, s, _ = operands
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out_shape), s

    return jax.lax.cond(finite, apply, skip, (unscaled, inner_state, params))


class LossScaler(NamedTuple):
    """The loss-scale logic apart from any optimizer (host offload runs the optimizer itself).

    init(inner_state) -> LossScaleState around `inner_state`.
    check(grads, state) -> (unscaled grads, finite flag, new state): unscale, check finiteness
        (after unscaling), and move the scale; the new state's `inner_state` is the old one.
    next_state(state, finite) -> the new state for a finiteness flag computed elsewhere (e.g.
        over gradients streamed from host memory); what `check` uses.
    skip_nonfinite: whether a non-finite step is skipped (False: fp32 / bf16 pass-through).
    """

    init: Any
    check: Any
    next_state: Any
    skip_nonfinite: bool = True


def _wrap(inner: optax.GradientTransformation, scaler: LossScaler) -> optax.GradientTransformation:
    """`inner` behind `scaler`: the GradientTransformation form of a LossScaler."""

    def init(params):
        return scaler.init(inner.init(params))

    def update(grads, state, params=None):
        unscaled, finite, new_state = scaler.check(grads, state)
        if scaler.skip_nonfinite:
            updates, inner_state = _inner_or_skip(inner, unscaled, finite, state.inner_state, params)
        else:
            updates, inner_state = inner.update(unscaled, state.inner_state, params)
        return updates, new_state._replace(inner_state=inner_state)

    return optax.GradientTransformation(init, update)


def dynamic_loss_scaler(*, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                        consecutive_hysteresis: bool = False, min_loss_scale: float = 1.0) -> LossScaler:
    """DeepSpeed's DynamicLossScaler as a LossScaler (see `dynamic_loss_scale`)."""
    if loss_scale_window < 1 or hysteresis < 1 or min_loss_scale <= 0:
        raise ValueError(f"{loss_scale_window=} and {hysteresis=} must be >= 1, {min_loss_scale=} must be > 0")
    init_scale = float(2.0 ** initial_scale_power)
    window, delayed_shift, min_scale = int(loss_scale_window), int(hysteresis), float(min_loss_scale)

    def init(inner_state):
        return DynamicLossScaleState(
            loss_scale=jnp.asarray(init_scale, jnp.float32), inner_state=inner_state,
            cur_iter=jnp.zeros([], jnp.int32), last_overflow_iter=jnp.full([], -1, jnp.int32),
            cur_hysteresis=jnp.full([], delayed_shift, jnp.int32), skipped=jnp.asarray(False),
            overflow_at_min=jnp.asarray(False))

    def next_state(state, finite):
        scale, hyst, it = state.loss_scale, state.cur_hysteresis, state.cur_iter

        # overflow: drop the scale only once hysteresis is used up, else spend one unit of it
        drop = (delayed_shift == 1) | (hyst == 1)
        at_min = drop & (scale == min_scale)
        scale_ovf = jnp.where(drop, jnp.maximum(scale / SCALE_FACTOR, min_scale), scale)
        hyst_ovf = jnp.where(drop, hyst, hyst - 1)

        # clean step: x2 once every `window` clean iterations after the last overflow
        stable = it - state.last_overflow_iter - 1
        grow = (stable > 0) & (stable % window == 0)
        scale_ok = jnp.where(grow, scale * SCALE_FACTOR, scale)
        if consecutive_hysteresis:
            hyst_ok = jnp.full_like(hyst, delayed_shift)
        else:
            hyst_ok = jnp.where(grow, delayed_shift, hyst)

        return DynamicLossScaleState(
            loss_scale=jnp.where(finite, scale_ok, scale_ovf).astype(jnp.float32),
            inner_state=state.inner_state,
            cur_iter=it + 1,
            last_overflow_iter=jnp.where(finite, state.last_overflow_iter, it),
            cur_hysteresis=jnp.where(finite, hyst_ok, hyst_ovf).astype(jnp.int32),
            skipped=~finite,
            overflow_at_min=state.overflow_at_min | (~finite & at_min))

    def check(grads, state):
        unscaled = _unscale(grads, state.loss_scale)
        # Checked after unscaling: catches every non-finite input and an unscale that overflows.
        finite = all_finite(unscaled)
        return unscaled, finite, next_state(state, finite)

    return LossScaler(init, check, next_state)


def dynamic_loss_scale(inner: optax.GradientTransformation, *, initial_scale_power: int = 16,
                       loss_scale_window: int = 1000, hysteresis: int = 2, consecutive_hysteresis: bool = False,
                       min_loss_scale: float = 1.0) -> optax.GradientTransformation:
    """DeepSpeed's dynamic loss scaling around `inner` (fp16 section names and defaults)."""
    return _wrap(inner, dynamic_loss_scaler(
        initial_scale_power=initial_scale_power, loss_scale_window=loss_scale_window, hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis, min_loss_scale=min_loss_scale))


def static_loss_scaler(loss_scale: float, *, skip_nonfinite: bool = True) -> LossScaler:
    """A fixed loss scale as a LossScaler (see `static_loss_scale`)."""
    scale = float(loss_scale)
    if scale <= 0:
        raise ValueError(f"{loss_scale=} must be > 0")

    def init(inner_state):
        return DynamicLossScaleState(
            loss_scale=jnp.asarray(scale, jnp.float32), inner_state=inner_state,
            cur_iter=jnp.zeros([], jnp.int32), last_overflow_iter=jnp.full([], -1, jnp.int32),
            cur_hysteresis=jnp.zeros([], jnp.int32), skipped=jnp.asarray(False),
            overflow_at_min=jnp.asarray(False))

    def next_state(state, finite):
        finite = jnp.asarray(finite) if skip_nonfinite else jnp.asarray(True)
        return state._replace(cur_iter=state.cur_iter + 1,
                              last_overflow_iter=jnp.where(finite, state.last_overflow_iter, state.cur_iter),
                              skipped=~finite)

    def check(grads, state):
        if skip_nonfinite:
            unscaled = _unscale(grads, state.loss_scale)
            finite = all_finite(unscaled)
        else:
            unscaled = _unscale(grads, state.loss_scale) if scale != 1.0 else grads
            finite = jnp.asarray(True)
        return unscaled, finite, next_state(state, finite)

    return LossScaler(init, check, next_state, skip_nonfinite)


def static_loss_scale(inner: optax.GradientTransformation, loss_scale: float, *,
                      skip_nonfinite: bool = True) -> optax.GradientTransformation:
    """A fixed loss scale (fp16.loss_scale > 0).

    DeepSpeed's static LossScaler never changes the scale, but its fp16 / ZeRO optimizers still
    check gradients for inf/NaN and skip such steps (`self.overflow = ...; if self.overflow:
    return`), so non-finite steps are skipped here too. `skip_nonfinite=False` (used for fp32 /
    bf16, where DeepSpeed does not check) always applies `inner`.
    """
    return _wrap(inner, static_loss_scaler(loss_scale, skip_nonfinite=skip_nonfinite))


def loss_scaler_from_config(fp16) -> LossScaler:
    """The LossScaler the fp16 section asks for: dynamic (loss_scale == 0), static, or (fp16 off) none."""
    if fp16 is None or not fp16.enabled:
        return static_loss_scaler(1.0, skip_nonfinite=False)
    if fp16.loss_scale and fp16.loss_scale > 0:
        return static_loss_scaler(fp16.loss_scale)
    return dynamic_loss_scaler(initial_scale_power=fp16.initial_scale_power,
                               loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                               consecutive_hysteresis=fp16.consecutive_hysteresis,
                               min_loss_scale=fp16.min_loss_scale)


def loss_scale_from_config(inner: optax.GradientTransformation, fp16) -> optax.GradientTransformation:
    """Wrap `inner` as the fp16 section says: dynamic (loss_scale == 0), static, or (fp16 off) none."""
    return _wrap(inner, loss_scaler_from_config(fp16))


def compute_dtype(cfg) -> jnp.dtype:
    """float16 with fp16.enabled, bfloat16 with bf16.enabled, else float32."""
    fp16 = getattr(cfg, "fp16", None)
    bf16 = getattr(cfg, "bf16", None)
    fp16_on = bool(fp16 is not None and fp16.enabled)
    bf16_on = bool(bf16 is not None and bf16.enabled)
    if fp16_on and bf16_on:
        from zerojax.config import ConfigError

        raise ConfigError(["fp16.enabled and bf16.enabled: bfloat16 and fp16 modes cannot be simultaneously "
                           "enabled; turn one of them off"])
    if fp16_on:
        return jnp.dtype(jnp.float16)
    if bf16_on:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)
