"""lr schedules against DeepSpeed's lr_schedules.py, transcribed below in plain Python.

The reference drives each transcribed scheduler the way DeepSpeed's engine does: the scheduler
is built (last_batch_iteration=-1 writes the first lr into the param group), each optimizer step
reads the group's lr, then `scheduler.step()` runs. lr(k) of zerojax must equal the lr the k-th
step read.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.optim import momentum_schedule_from, schedule_from

STEPS = 260
RTOL = 1e-6


# ---- transcription of deepspeed/runtime/lr_schedules.py (DeepSpeed 0.19), one param group ----

class _Opt:
    def __init__(self, lr, betas=(0.9, 0.999)):
        self.param_groups = [{"lr": lr, "betas": betas}]
        self.defaults = {"lr": lr, "betas": betas}


class RefWarmupLR:
    def __init__(self, opt, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log"):
        self.opt = opt
        if warmup_max_lr is None:
            warmup_max_lr = opt.param_groups[0]["lr"]
        self.min_lr, self.max_lr = warmup_min_lr, warmup_max_lr
        self.delta = warmup_max_lr - warmup_min_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        opt.param_groups[0]["lr"] = self.get_lr()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + self.delta * self._get_gamma()

    def _warm(self):
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warm()
        return 1.0

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()


class RefWarmupDecayLR(RefWarmupLR):
    def __init__(self, opt, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
        self.total_num_steps = total_num_steps
        super().__init__(opt, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warm()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class RefWarmupCosineLR:
    def __init__(self, opt, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log"):
        self.opt = opt
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = -1
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lr = opt.param_groups[0]["lr"]
        opt.param_groups[0]["lr"] = self.get_lr()

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return 0.0
        return self.org_lr * self.get_lr_ratio()

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()


class RefOneCycle:
    def __init__(self, opt, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0):
        self.opt = opt
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        opt.param_groups[0]["lr"] = cycle_min_lr
        if math.isclose(decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_mom, self.max_mom = (cycle_min_mom, 0.99), (cycle_max_mom, 0.99)
            opt.param_groups[0]["betas"] = self.min_mom
            if math.isclose(decay_mom_rate, 0):
                self.skip_mom_decay = True
        self.last_batch_iteration = -1

    def _get_scale_factor(self):
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                stair_position = cycle_iteration * stair_count / self.first_step_size
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    def get_lr(self):
        if self.last_batch_iteration < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self._get_scale_factor()
        if self.skip_lr_decay:
            return self.min_lr
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.min_lr / (1 + self.decay_lr_rate * decay_interval)

    def get_mom(self):
        if self.last_batch_iteration < self.total_size:
            return (self.max_mom[0] - (self.max_mom[0] - self.min_mom[0]) * self._get_scale_factor(), 0.99)
        if self.skip_mom_decay:
            return self.max_mom
        decay_interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return (self.max_mom[0] * (1 + self.decay_mom_rate * decay_interval), 0.99)

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()
        if self.cycle_momentum:
            self.opt.param_groups[0]["betas"] = self.get_mom()


class RefLRRangeTest:
    def __init__(self, opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
                 lr_range_test_staircase=False):
        self.opt = opt
        self.min_lr, self.step_size, self.step_rate = lr_range_test_min_lr, lr_range_test_step_size, \
            lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = -1
        opt.param_groups[0]["lr"] = self.min_lr

    def get_lr(self):
        if self.staircase:
            interval = math.floor(float(self.last_batch_iteration + 1) / self.step_size)
        else:
            interval = float(self.last_batch_iteration + 1) / self.step_size
        return self.min_lr * (1 + self.step_rate * interval)

    def step(self):
        self.last_batch_iteration += 1
        self.opt.param_groups[0]["lr"] = self.get_lr()


_REF = {"WarmupLR": RefWarmupLR, "WarmupDecayLR": RefWarmupDecayLR, "WarmupCosineLR": RefWarmupCosineLR,
        "OneCycle": RefOneCycle, "LRRangeTest": RefLRRangeTest}


def reference_trajectory(kind, params, optimizer_lr=1e-3, steps=STEPS):
    """The (lr, beta1) each of `steps` optimizer steps uses, as DeepSpeed's engine drives it."""
    opt = _Opt(optimizer_lr)
    sched = _REF[kind](opt, **params)
    lrs, moms = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        sched.step()  # after every applied optimizer step
    return np.array(lrs), np.array(moms)


def ours(fn, steps=STEPS):
    return np.asarray(jax.jit(jax.vmap(fn))(jnp.arange(steps, dtype=jnp.int32)), dtype=np.float64)


CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 100}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 100, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 50}),  # warmup_max_lr from the optimizer's lr
    ("WarmupLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 1}),  # clamped to 2 steps
    ("WarmupDecayLR", {"total_num_steps": 200, "warmup_min_lr": 1e-6, "warmup_max_lr": 2e-3,
                       "warmup_num_steps": 40}),
    ("WarmupDecayLR", {"total_num_steps": 200, "warmup_max_lr": 2e-3, "warmup_num_steps": 40,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 150}),  # default warm-up of 1000 > total
    ("WarmupCosineLR", {"total_num_steps": 220, "warmup_num_steps": 30, "warmup_min_ratio": 0.05,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 220, "warmup_num_steps": 30, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 30}),  # no decay window
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 60,
                  "cycle_second_step_size": 90, "decay_step_size": 10, "decay_lr_rate": 0.1,
                  "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 50}),  # no decay
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 60,
                  "cycle_second_step_size": 40, "cycle_first_stair_count": 6, "cycle_second_stair_count": 4,
                  "decay_step_size": 7, "decay_lr_rate": 0.5}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 30,
                  "cycle_second_step_size": 45, "cycle_first_stair_count": 5}),  # second count follows first
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 25, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 25, "lr_range_test_step_rate": 2.0,
                     "lr_range_test_staircase": True}),
    ("LRRangeTest", {}),
]


@pytest.mark.parametrize("kind,params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_schedule_matches_deepspeed(kind, params):
    optimizer_lr = 7e-4
    want, want_mom = reference_trajectory(kind, params, optimizer_lr)
    got = ours(schedule_from(kind, params, optimizer_lr=optimizer_lr))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)
    mom = momentum_schedule_from(kind, params)
    if kind == "OneCycle":
        np.testing.assert_allclose(ours(mom), want_mom, rtol=RTOL, atol=0)
    else:
        assert mom is None


def test_features_are_exercised():
    """The cases above reach the regions they are meant to (guards the test, not the code)."""
    lrs, _ = reference_trajectory("WarmupDecayLR", dict(CASES[4][1]))
    assert lrs[0] == lrs[1] == 1e-6 and lrs[41] == pytest.approx(2e-3) and lrs[210] == 1e-6  # decayed to warmup_min_lr
    lrs, _ = reference_trajectory("WarmupCosineLR", dict(CASES[7][1]), optimizer_lr=1.0)
    assert lrs[0] == 0.0 and lrs[250] == pytest.approx(0.01)
    lrs, moms = reference_trajectory("OneCycle", dict(CASES[10][1]))
    assert lrs[60] == pytest.approx(1e-2) and lrs[150] == pytest.approx(1e-4) and lrs[200] < 1e-4
    assert moms[0] == 0.85 and moms[60] == pytest.approx(0.85) and moms[200] > 0.95
    lrs, _ = reference_trajectory("OneCycle", dict(CASES[12][1]))
    assert len(set(np.round(lrs[1:60], 12))) == 6  # six stairs on the way up
    lrs, _ = reference_trajectory("LRRangeTest", dict(CASES[15][1]))
    assert lrs[24] == 1e-4 and lrs[25] == pytest.approx(3e-4)


def test_log_and_linear_warmup_differ():
    log = ours(schedule_from("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 100}))
    lin = ours(schedule_from("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 100, "warmup_type": "linear"}))
    assert np.all(log[2:101] > lin[2:101]) and log[150] == lin[150] == 1.0


def test_names_match_case_insensitively():
    a = ours(schedule_from("warmupdecaylr", {"total_num_steps": 100, "warmup_num_steps": 10}))
    b = ours(schedule_from("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 10}))
    np.testing.assert_array_equal(a, b)


def test_schedule_accepts_python_int_and_traced_count():
    fn = schedule_from("WarmupLR", {"warmup_max_lr": 1e-3, "warmup_num_steps": 10})
    assert float(fn(5)) == pytest.approx(float(jax.jit(fn)(jnp.int32(5))), rel=1e-7)


@pytest.mark.parametrize("kind,params,error", [
    ("CyclicLR", {}, "not supported"),
    ("WarmupDecayLR", {}, "total_num_steps"),
    ("OneCycle", {"cycle_max_lr": 1.0}, "cycle_min_lr"),
    ("WarmupLR", {"warmup_max": 1.0}, "warmup_max"),
    ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps"),
])
def test_bad_scheduler_sections(kind, params, error):
    from zerojax.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        schedule_from(kind, params)


def test_build_schedule_through_load_config():
    import zerojax

    cfg = zerojax.load_config({
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 220, "warmup_num_steps": 30}},
    }, world_size=1)
    want, _ = reference_trajectory("WarmupCosineLR", {"total_num_steps": 220, "warmup_num_steps": 30},
                                   optimizer_lr=5e-4)
    np.testing.assert_allclose(ours(zerojax.build_schedule(cfg)), want, rtol=RTOL, atol=0)
    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {}}}, world_size=1)
    np.testing.assert_allclose(ours(zerojax.build_schedule(cfg), 5), 1e-3, rtol=RTOL)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_every_accepted_scheduler_key_reaches_the_builder(kind, monkeypatch):
    # One table (zerojax.config.SCHEDULER_PARAMS) for load_config's validation and optim's builders:
    # the builders read every key it accepts, and a key outside it is a KeyError in optim._Args.
    import zerojax.optim as optim
    from zerojax.config import SCHEDULER_PARAMS

    read = set()

    class Recording(optim._Args):
        def __getitem__(self, name):
            read.add(name)
            return super().__getitem__(name)

    monkeypatch.setattr(optim, "_Args", Recording)
    table = SCHEDULER_PARAMS[kind]
    # A valid value for each key: the table's default, or one where it is required / computed.
    given = {"warmup_max_lr": 1e-3, "total_num_steps": 100, "cycle_min_lr": 0.0, "cycle_max_lr": 1e-3,
             "cycle_second_step_size": 500, "cycle_second_stair_count": 0}
    params = {name: given.get(name, spec.default) for name, spec in table.items()}
    schedule_from(kind, params)
    momentum_schedule_from(kind, params)
    assert read == {name for name, spec in table.items() if not spec.inert}
