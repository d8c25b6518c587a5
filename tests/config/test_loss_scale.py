"""Dynamic / static loss scaling against DeepSpeed's DynamicLossScaler (loss_scaler.py)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.optim import optimizer_from, schedule_from
from zerojax.precision import (
    MIN_SCALE_ERROR,
    DynamicLossScaleState,
    compute_dtype,
    dynamic_loss_scale,
    loss_scale_from_config,
    static_loss_scale,
)

# ---- transcription of DeepSpeed 0.19 DynamicLossScaler.update_scale (raise -> flag) ----

class RefDynamicLossScaler:
    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raised = False  # DeepSpeed raises MIN_SCALE_ERROR here

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    self.raised = True
                else:
                    self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((16, 4)) + 3.0, jnp.float32),
            "b": jnp.asarray(rng.standard_normal((8,)) + 3.0, jnp.float32)}


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return {"w": rng.standard_normal((16, 4)).astype(np.float32), "b": rng.standard_normal((8,)).astype(np.float32)}


def _poison(g, step):
    """A non-finite value in one element of one leaf (alternating inf / nan / -inf)."""
    g = {k: v.copy() for k, v in g.items()}
    g["w"][step % 16, step % 4] = [np.inf, np.nan, -np.inf][step % 3]
    return g


def run(tx, script, params=None, place=lambda x: x):
    """Feed `script` ('.' finite, 'O' overflow); returns per-step records."""
    params = place(params if params is not None else _params())
    state = tx.init(params)
    step = jax.jit(tx.update)
    records = []
    for i, c in enumerate(script):
        g = _grads(i)
        if c == "O":
            g = _poison(g, i)
        scaled = place({k: jnp.asarray(v) * state.loss_scale for k, v in g.items()})
        updates, new_state = step(scaled, state, params)
        new_params = optax.apply_updates(params, updates)
        records.append(dict(c=c, scale=float(new_state.loss_scale), skipped=bool(new_state.skipped),
                            at_min=bool(new_state.overflow_at_min), params=params, new_params=new_params,
                            inner=state.inner_state, new_inner=new_state.inner_state, state=new_state))
        params, state = new_params, new_state
    return records


SCRIPT = "....." "OOO" "." "O" "....." "O" "." "OOOO" "....." "....." "..." "O"
#          0-4    5-7  8   9   10-14  15  16  17-20   21-25  26-30  31-33 34

# Derivation, window 4, hysteresis 2, initial scale 2**4 = 16, min_loss_scale 1. At iteration i a
# clean step doubles the scale when stable = i - last_overflow_iter - 1 is > 0 and divisible by 4.
# not consecutive_hysteresis:
#   i=0-3 clean, stable 0..3: 16.  i=4 stable 4: x2 -> 32 (hysteresis refilled to 2).
#   i=5 O: hysteresis 2 -> 1, scale stays 32.  i=6 O: hysteresis is 1 -> 16.  i=7 O: -> 8.
#   i=8 clean: stable 0, hysteresis NOT refilled (stays 1): 8.  i=9 O: hysteresis 1 -> 4.
#   i=10-13 clean, stable 0..3: 4.  i=14 stable 4: -> 8, hysteresis refilled to 2.
#   i=15 O: hysteresis 2 -> 1: 8.  i=16 clean: 8.  i=17,18,19 O: 4, 2, 1.
#   i=20 O: hysteresis 1 and scale == min 1: DeepSpeed raises MIN_SCALE_ERROR; scale stays 1,
#        overflow_at_min is set (and stays set).
#   i=21-24 clean, stable 0..3: 1.  i=25 stable 4: 2.  i=29 stable 8: 4.  i=33 stable 12: 8.
#   i=34 O: hysteresis (refilled at i=25) 2 -> 1: 8.
EXPECTED = [16, 16, 16, 16, 32, 32, 16, 8, 8, 4, 4, 4, 4, 4, 8, 8, 8, 4, 2, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 4,
            4, 4, 4, 8, 8]
EXPECTED_AT_MIN = [False] * 20 + [True] * 15
# consecutive_hysteresis: every clean step refills hysteresis to 2, so:
#   i=0-7 as above: 16,16,16,16,32,32,16,8.  i=8 clean: hysteresis back to 2.  i=9 O: 2 -> 1, stays 8.
#   i=10 clean (refill), i=10-13 stable 0..3: 8.  i=14 stable 4: 16.  i=15 O: 2 -> 1: 16.
#   i=16 clean: refill.  i=17 O: 2 -> 1: 16.  i=18,19,20 O: 8, 4, 2 (min never reached).
#   i=21-24: 2.  i=25 stable 4: 4.  i=29: 8.  i=33: 16.  i=34 O: 2 -> 1: 16.
EXPECTED_CONSECUTIVE = [16, 16, 16, 16, 32, 32, 16, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 8, 4, 2, 2, 2, 2, 2,
                        4, 4, 4, 4, 8, 8, 8, 8, 16, 16]


def _tx(consecutive, inner=None):
    inner = inner or optimizer_from("Adam", {"lr": 1e-2, "weight_decay": 0.1},
                                    schedule=schedule_from("WarmupLR", {"warmup_max_lr": 1e-2,
                                                                        "warmup_num_steps": 10}))
    return dynamic_loss_scale(inner, initial_scale_power=4, loss_scale_window=4, hysteresis=2,
                              consecutive_hysteresis=consecutive, min_loss_scale=1.0)


@pytest.mark.parametrize("consecutive,expected", [(False, EXPECTED), (True, EXPECTED_CONSECUTIVE)])
def test_scripted_trajectory(consecutive, expected):
    assert len(SCRIPT) == len(expected) == 35
    records = run(_tx(consecutive), SCRIPT)
    assert [r["scale"] for r in records] == expected
    assert [r["skipped"] for r in records] == [c == "O" for c in SCRIPT]
    at_min = EXPECTED_AT_MIN if not consecutive else [False] * 35
    assert [r["at_min"] for r in records] == at_min


@pytest.mark.parametrize("window,hysteresis,consecutive,power,min_scale", [
    (4, 2, False, 4, 1.0), (4, 2, True, 4, 1.0), (1, 1, False, 3, 1.0), (3, 3, False, 5, 0.25),
    (3, 3, True, 5, 0.25), (2, 1, True, 2, 2.0), (5, 2, False, 16, 1.0),
])
def test_matches_deepspeed_transcription(window, hysteresis, consecutive, power, min_scale):
    rng = np.random.default_rng(window * 100 + hysteresis * 10 + int(consecutive))
    script = "".join(rng.choice([".", "O"], p=[0.7, 0.3], size=60))
    inner = optimizer_from("SGD", {"lr": 0.1})
    tx = dynamic_loss_scale(inner, initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                            consecutive_hysteresis=consecutive, min_loss_scale=min_scale)
    ref = RefDynamicLossScaler(2.0 ** power, window, min_scale, hysteresis, consecutive)
    for r, c in zip(run(tx, script), script, strict=True):
        ref.update_scale(c == "O")
        assert r["scale"] == ref.cur_scale
        assert r["at_min"] == ref.raised
        assert int(r["state"].cur_hysteresis) == ref.cur_hysteresis
        assert int(r["state"].last_overflow_iter) == ref.last_overflow_iter
        assert int(r["state"].cur_iter) == ref.cur_iter


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_overflow_leaves_params_and_inner_state_bit_identical_and_lr_does_not_advance():
    lr = schedule_from("WarmupLR", {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10,
                                    "warmup_type": "linear"})
    inner = optimizer_from("Adam", {"lr": 1e-2, "weight_decay": 0.1}, schedule=lr)
    records = run(_tx(False, inner), SCRIPT)
    for r in records:
        if r["c"] == "O":
            assert _leaves_equal(r["new_params"], r["params"])
            assert _leaves_equal(r["new_inner"], r["inner"])
        else:
            assert not _leaves_equal(r["new_params"], r["params"])
    # the same optimizer fed only the clean steps' true gradients gives the same params: the
    # schedule (read from the inner count) advanced only on applied steps
    params, state = _params(), inner.init(_params())
    update = jax.jit(inner.update)
    clean = [i for i, c in enumerate(SCRIPT) if c == "."]
    for i in clean:
        updates, state = update(jax.tree.map(jnp.asarray, _grads(i)), state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.count) == len(clean) == int(records[-1]["state"].inner_state.count)
    for k in params:
        np.testing.assert_allclose(np.asarray(records[-1]["new_params"][k]), np.asarray(params[k]),
                                   rtol=1e-6, atol=1e-7)


def test_sharded_over_8_devices_matches_unsharded():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))

    def place(tree):
        return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)

    sharded = run(_tx(False), SCRIPT, place=place)
    plain = run(_tx(False), SCRIPT)
    assert [r["scale"] for r in sharded] == EXPECTED
    assert [r["skipped"] for r in sharded] == [c == "O" for c in SCRIPT]
    for rs, rp in zip(sharded, plain, strict=True):
        for k in rp["new_params"]:
            np.testing.assert_allclose(np.asarray(rs["new_params"][k]), np.asarray(rp["new_params"][k]),
                                       rtol=1e-6, atol=1e-7)
    last = sharded[-1]
    assert last["new_params"]["w"].sharding.spec == P("data")
    assert last["state"].inner_state.mu["w"].sharding.spec == P("data")


def test_state_fields_and_dtypes():
    state = _tx(False).init(_params())
    assert isinstance(state, DynamicLossScaleState)
    assert state.loss_scale.dtype == jnp.float32 and float(state.loss_scale) == 16.0
    assert state.skipped.dtype == jnp.bool_ and state.overflow_at_min.dtype == jnp.bool_
    assert MIN_SCALE_ERROR == ("Current loss scale already at minimum - cannot decrease scale anymore. "
                               "Exiting run.")


def test_fp16_gradients_are_unscaled_into_fp32():
    inner = optimizer_from("SGD", {"lr": 1.0})
    tx = dynamic_loss_scale(inner, initial_scale_power=10)
    params = {"w": jnp.ones((4,), jnp.float32)}
    g = jnp.asarray([1e-3, 2e-3, -3e-3, 4e-3], jnp.float32)
    updates, _ = tx.update({"w": (g * 1024).astype(jnp.float16)}, tx.init(params), params)
    assert updates["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(updates["w"]), -np.asarray((g * 1024).astype(jnp.float16),
                                                                     np.float32) / 1024, rtol=0)


def test_static_loss_scale_keeps_scale_and_skips_nonfinite():
    inner = optimizer_from("SGD", {"lr": 0.5})
    tx = static_loss_scale(inner, 128.0)
    records = run(tx, "..O.O..")
    assert all(r["scale"] == 128.0 for r in records)
    assert [r["skipped"] for r in records] == [False, False, True, False, True, False, False]
    for i, r in enumerate(records):
        if r["skipped"]:
            assert _leaves_equal(r["new_params"], r["params"]) and _leaves_equal(r["new_inner"], r["inner"])
        else:
            want = jax.tree.map(lambda p, g: p - 0.5 * g, r["params"], _grads(i))
            for k in want:
                np.testing.assert_allclose(np.asarray(r["new_params"][k]), np.asarray(want[k]), rtol=1e-6)


def _fp16(**kw):
    base = dict(enabled=True, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                consecutive_hysteresis=False, min_loss_scale=1.0, auto_cast=False)
    return types.SimpleNamespace(**{**base, **kw})


def test_loss_scale_from_config_sections():
    inner = optimizer_from("SGD", {"lr": 0.1})
    params = _params()
    dyn = loss_scale_from_config(inner, _fp16(initial_scale_power=8, hysteresis=1))
    assert float(dyn.init(params).loss_scale) == 256.0
    assert run(dyn, "O")[0]["scale"] == 128.0  # hysteresis 1: halves on the first overflow
    static = loss_scale_from_config(inner, _fp16(loss_scale=64.0))
    assert [r["scale"] for r in run(static, ".O.")] == [64.0] * 3
    off = loss_scale_from_config(inner, _fp16(enabled=False))
    r = run(off, "O")[0]  # fp32 / bf16: DeepSpeed does not check for overflow, nothing is skipped
    assert not r["skipped"] and r["scale"] == 1.0 and not np.isfinite(np.asarray(r["new_params"]["w"])).all()


def test_compute_dtype():
    def cfg(fp16, bf16):
        return types.SimpleNamespace(fp16=types.SimpleNamespace(enabled=fp16), bf16=types.SimpleNamespace(enabled=bf16))

    assert compute_dtype(cfg(True, False)) == jnp.float16
    assert compute_dtype(cfg(False, True)) == jnp.bfloat16
    assert compute_dtype(cfg(False, False)) == jnp.float32


def test_through_load_config():
    import zerojax
    from zerojax.config import ConfigError

    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                               "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 4,
                                        "hysteresis": 2, "min_loss_scale": 1}}, world_size=1)
    assert compute_dtype(cfg) == jnp.float16
    tx = loss_scale_from_config(zerojax.build_optimizer(cfg), cfg.fp16)
    assert [r["scale"] for r in run(tx, SCRIPT)] == EXPECTED
    with pytest.raises(ConfigError):
        compute_dtype(types.SimpleNamespace(fp16=types.SimpleNamespace(enabled=True),
                                            bf16=types.SimpleNamespace(enabled=True)))
