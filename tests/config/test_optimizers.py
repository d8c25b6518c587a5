"""Optimizers against torch.optim (Adam, AdamW, SGD, Adagrad) and numpy transcriptions of
DeepSpeed's FusedLamb / Lion kernels, over 10 steps on a small tree.

float64 runs (under jax.enable_x64) must agree to 1e-12; float32 runs are compared with the
float64 reference at float32 round-off (rtol 1e-5, atol 1e-6).
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from zerojax.optim import clip_by_global_norm, momentum_schedule_from, optimizer_from, schedule_from

STEPS = 10
SHAPES = {"w": (4, 3), "b": (5,), "s": (1,)}


def _tree(rng, scale=1.0):
    return {k: rng.standard_normal(s) * scale for k, s in SHAPES.items()}


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = _tree(rng)
    grads = [_tree(rng, scale=0.5 + i / 5) for i in range(STEPS)]
    return params, grads


def _x64(dtype):
    if dtype == np.float64:
        if not hasattr(jax, "enable_x64"):
            pytest.skip("jax.enable_x64 not available")
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def run_ours(tx, params, grads, dtype):
    """Apply tx for every grad tree; returns the params after each step (float64 numpy)."""
    with _x64(dtype):
        p = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
        state = tx.init(p)
        step = jax.jit(tx.update)
        out = []
        for g in grads:
            g = jax.tree.map(lambda x: jnp.asarray(x, dtype), g)
            updates, state = step(g, state, p)
            p = optax.apply_updates(p, updates)
            out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), p))
        return out


def run_torch(make, params, grads, hook=None):
    tp = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()}
    opt = make(list(tp.values()))
    out = []
    for i, g in enumerate(grads):
        if hook is not None:
            hook(opt, i)
        for k, t in tp.items():
            t.grad = torch.tensor(g[k], dtype=torch.float64)
        opt.step()
        out.append({k: t.detach().numpy().copy() for k, t in tp.items()})
    return out


def assert_trajectories(got, want, dtype):
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == np.float64 else dict(rtol=1e-5, atol=1e-6)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(g[k], w[k], **tol, err_msg=f"step {step} leaf {k}")


DTYPES = [np.float64, np.float32]

TORCH_CASES = [
    # (zerojax type, params, torch constructor)
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False},
     lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1},  # adam_w_mode defaults to true in DeepSpeed
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False, "betas": [0.8, 0.99], "eps": 1e-6},
     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)),
    ("adam", {"lr": 1e-2, "torch_adam": True, "amsgrad": True, "adam_w_mode": False},
     lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
    ("Adam", {}, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)),  # DeepSpeed defaults
    ("SGD", {"lr": 0.1}, lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.25, "weight_decay": 0.01},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.01)),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ("SGD", {}, lambda ps: torch.optim.SGD(ps)),  # torch's default lr
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1,
                 "eps": 1e-6},
     lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.05, weight_decay=0.01, initial_accumulator_value=0.1,
                                    eps=1e-6)),
    ("Adagrad", {}, lambda ps: torch.optim.Adagrad(ps)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind,params,make", TORCH_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TORCH_CASES)])
def test_matches_torch(kind, params, make, dtype):
    p0, grads = _problem()
    assert_trajectories(run_ours(optimizer_from(kind, params), p0, grads, dtype), run_torch(make, p0, grads), dtype)


def test_adam_w_mode_false_is_l2_and_differs_from_true():
    p0, grads = _problem(1)
    l2 = run_ours(optimizer_from("Adam", {"lr": 1e-2, "weight_decay": 0.5, "adam_w_mode": False}),
                  p0, grads, np.float32)
    decoupled = run_ours(optimizer_from("Adam", {"lr": 1e-2, "weight_decay": 0.5}), p0, grads, np.float32)
    assert np.abs(l2[-1]["w"] - decoupled[-1]["w"]).max() > 1e-3
    # the name AdamW forces decoupled decay whatever adam_w_mode says
    forced = run_ours(optimizer_from("AdamW", {"lr": 1e-2, "weight_decay": 0.5, "adam_w_mode": False}),
                      p0, grads, np.float32)
    np.testing.assert_array_equal(forced[-1]["w"], decoupled[-1]["w"])


# ---- numpy references for DeepSpeed's own kernels ----

def numpy_fused_adam_no_bias_correction(p0, grads, lr, b1, b2, eps, wd):
    p = {k: v.copy() for k, v in p0.items()}
    m = {k: np.zeros_like(v) for k, v in p0.items()}
    v = {k: np.zeros_like(x) for k, x in p0.items()}
    out = []
    for g in grads:
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
            p[k] = p[k] - lr * (m[k] / (np.sqrt(v[k]) + eps) + wd * p[k])  # bias_correction=False, ADAM_MODE_1
        out.append({k: x.copy() for k, x in p.items()})
    return out


def numpy_fused_lamb(p0, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, eps_inside_sqrt=False, max_coeff=10.0,
                     min_coeff=0.01, bias_correction=True):
    """csrc/lamb/fused_lamb_cuda_kernel.cu, one tensor at a time."""
    p = {k: v.copy() for k, v in p0.items()}
    m = {k: np.zeros_like(v) for k, v in p0.items()}
    v = {k: np.zeros_like(x) for k, x in p0.items()}
    out = []
    for step, g in enumerate(grads, start=1):
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        bc2 = 1 - b2 ** step if bias_correction else 1.0
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
            m_hat, v_hat = m[k] / bc1, v[k] / bc2
            denom = np.sqrt(v_hat + eps) if eps_inside_sqrt else np.sqrt(v_hat) + eps
            update = m_hat / denom + wd * p[k]
            w_norm, u_norm = np.sqrt((p[k] ** 2).sum()), np.sqrt((update ** 2).sum())
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            p[k] = p[k] - lr * coeff * update
        out.append({k: x.copy() for k, x in p.items()})
    return out


def numpy_lion(p0, grads, lr, b1=0.9, b2=0.999, wd=0.0):
    """csrc/lion/cpu_lion_impl.cpp Step_1."""
    p = {k: v.copy() for k, v in p0.items()}
    m = {k: np.zeros_like(v) for k, v in p0.items()}
    out = []
    for g in grads:
        for k in p:
            c = m[k] * b1 + g[k] * (1 - b1)
            p[k] = p[k] * (1 - lr * wd) - lr * np.sign(c)
            m[k] = m[k] * b2 + g[k] * (1 - b2)
        out.append({k: x.copy() for k, x in p.items()})
    return out


NUMPY_CASES = [
    ("Lamb", {"lr": 1e-2}, lambda p, g: numpy_fused_lamb(p, g, 1e-2)),
    ("Lamb", {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.8, 0.95], "eps": 1e-6},
     lambda p, g: numpy_fused_lamb(p, g, 1e-2, b1=0.8, b2=0.95, eps=1e-6, wd=0.1)),
    ("lamb", {"lr": 1e-2, "eps_inside_sqrt": True, "max_coeff": 1.2, "min_coeff": 0.9, "bias_correction": False},
     lambda p, g: numpy_fused_lamb(p, g, 1e-2, eps_inside_sqrt=True, max_coeff=1.2, min_coeff=0.9,
                                   bias_correction=False)),
    ("Lion", {"lr": 1e-2}, lambda p, g: numpy_lion(p, g, 1e-2)),
    ("Lion", {"lr": 1e-2, "betas": [0.95, 0.98], "weight_decay": 0.3},
     lambda p, g: numpy_lion(p, g, 1e-2, b1=0.95, b2=0.98, wd=0.3)),
    ("Adam", {"lr": 1e-2, "bias_correction": False, "weight_decay": 0.1},
     lambda p, g: numpy_fused_adam_no_bias_correction(p, g, 1e-2, 0.9, 0.999, 1e-8, 0.1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind,params,ref", NUMPY_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(NUMPY_CASES)])
def test_matches_deepspeed_kernel_transcription(kind, params, ref, dtype):
    p0, grads = _problem(2)
    assert_trajectories(run_ours(optimizer_from(kind, params), p0, grads, dtype), ref(p0, grads), dtype)


def test_lamb_clamps_and_zero_norm_leaf():
    p0, grads = _problem(3)
    p0["s"] = np.zeros(1)  # ||p|| = 0 -> coefficient 1
    params = {"lr": 1e-2, "max_coeff": 0.5, "min_coeff": 0.2}
    got = run_ours(optimizer_from("Lamb", params), p0, grads, np.float64)
    assert_trajectories(got, numpy_fused_lamb(p0, grads, 1e-2, max_coeff=0.5, min_coeff=0.2), np.float64)


def numpy_clip(g, max_norm):
    norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
    coef = max_norm / (norm + 1e-6)
    return {k: x * coef for k, x in g.items()} if coef < 1 else g


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clipping_by_global_norm(max_norm):
    _, grads = _problem(4)
    with jax.enable_x64(True):
        tx = clip_by_global_norm(max_norm)
        for g in grads[:3]:
            out, _ = tx.update(jax.tree.map(jnp.asarray, g), tx.init(None))
            want = numpy_clip(g, max_norm)
            for k in SHAPES:
                np.testing.assert_allclose(np.asarray(out[k]), want[k], rtol=1e-13)
            tg = [torch.tensor(g[k]) for k in SHAPES]
            for t in tg:
                t.grad = t.clone()
            torch.nn.utils.clip_grad_norm_(tg, max_norm)
            for k, t in zip(SHAPES, tg, strict=True):
                np.testing.assert_allclose(np.asarray(out[k]), t.grad.numpy(), rtol=1e-13)


def test_gradient_clipping_comes_first_in_the_chain():
    p0, grads = _problem(5)
    got = run_ours(optimizer_from("SGD", {"lr": 1.0}, gradient_clipping=0.5), p0, grads, np.float64)
    p = dict(p0)
    for step, g in enumerate(grads):
        g = numpy_clip(g, 0.5)
        p = {k: p[k] - g[k] for k in p}
        for k in SHAPES:
            np.testing.assert_allclose(got[step][k], p[k], rtol=1e-13)


def test_schedule_drives_lr_and_onecycle_drives_betas():
    """lr(k) and OneCycle's beta1(k) (with beta2 = 0.99, as DeepSpeed writes betas) reach step k."""
    p0, grads = _problem(6)
    sched = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4, "cycle_min_mom": 0.8,
             "cycle_max_mom": 0.95, "decay_step_size": 2, "decay_lr_rate": 0.3, "decay_mom_rate": 0.01}
    lr = schedule_from("OneCycle", sched)
    mom = momentum_schedule_from("OneCycle", sched)
    tx = optimizer_from("Adam", {"weight_decay": 0.1, "betas": [0.5, 0.5]}, schedule=lr, momentum_schedule=mom)
    lrs = [float(lr(k)) for k in range(STEPS)]
    moms = [float(mom(k)) for k in range(STEPS)]
    assert len(set(np.round(lrs, 9))) > 5 and len(set(np.round(moms, 9))) > 5

    def hook(opt, i):
        opt.param_groups[0]["lr"] = lrs[i]
        opt.param_groups[0]["betas"] = (moms[i], 0.99)

    want = run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), p0, grads, hook)
    # lr(k) and beta1(k) were rounded to float32 by the schedule: compare at float32 precision
    assert_trajectories(run_ours(tx, p0, grads, np.float32), want, np.float32)


def test_sgd_ignores_momentum_cycling_like_deepspeed():
    mom = momentum_schedule_from("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0})
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        tx = optimizer_from("SGD", {"lr": 0.1}, momentum_schedule=mom)
    p0, grads = _problem(7)
    assert_trajectories(run_ours(tx, p0, grads, np.float64),
                        run_torch(lambda ps: torch.optim.SGD(ps, lr=0.1), p0, grads), np.float64)


@pytest.mark.parametrize("kind,params,error", [
    ("RMSprop", {}, "not supported"),
    ("OneBitAdam", {}, "closest supported choice is 'Adam'"),
    ("ZeroOneAdam", {}, "'Adam'"),
    ("OneBitLamb", {}, "'Lamb'"),
    ("MuAdamW", {}, "'AdamW'"),
    ("Adam", {"max_grad_norm": 1.0}, "gradient_clipping"),
    ("Adam", {"amsgrad": True}, "AMSGrad"),
    ("AdamW", {"lr": 1e-3, "beta": [0.9, 0.99]}, "beta"),
    ("SGD", {"nesterov": True}, "Nesterov"),
])
def test_bad_optimizer_sections(kind, params, error):
    from zerojax.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        optimizer_from(kind, params)


def test_build_optimizer_through_load_config():
    import zerojax

    cfg = zerojax.load_config({
        "train_batch_size": 8,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }, world_size=1)
    p0, grads = _problem(8)

    def make(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)

    tp = {k: torch.tensor(v) for k, v in p0.items()}
    opt = make(list(tp.values()))
    want = []
    for g in grads:
        for k, t in tp.items():
            t.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.5)
        opt.step()
        want.append({k: t.detach().numpy().copy() for k, t in tp.items()})
    assert_trajectories(run_ours(zerojax.build_optimizer(cfg), p0, grads, np.float64), want, np.float64)


# --- one parameter table (zerojax.config.OPTIMIZER_PARAMS) for validation and the builders ---------

def _every_param(table):
    """A valid value for every key of a table: its default, or one where the builder computes it."""
    return {name: spec.default for name, spec in table.items()}


class _ReadLog:
    """Patches optim._Args so that every key a builder reads is logged."""

    def __init__(self, monkeypatch):
        import zerojax.optim as optim

        self.read = set()
        log = self.read

        class Recording(optim._Args):
            def __getitem__(self, name):
                log.add(name)
                return super().__getitem__(name)

            def given(self, name):
                log.add(name)
                return super().given(name)

        monkeypatch.setattr(optim, "_Args", Recording)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Lamb", "Lion", "SGD", "Adagrad"])
def test_every_accepted_optimizer_key_reaches_the_builder(kind, monkeypatch):
    from zerojax.config import OPTIMIZER_PARAMS

    table = OPTIMIZER_PARAMS[kind]
    log = _ReadLog(monkeypatch)
    optimizer_from(kind, _every_param(table))
    # The builder reads exactly the keys that change the update; a key outside the table would be a
    # KeyError in optim._Args, so every key a builder reads is one validation accepts.
    assert log.read == {name for name, spec in table.items() if not spec.inert}
    assert all(spec.inert for name, spec in table.items() if name not in log.read)


@pytest.mark.parametrize("kind,extra", [("Lion", {"fp32_optimizer_states": True}), ("SGD", {"maximize": False}),
                                        ("Adam", {"set_grad_none": True, "foreach": False})])
def test_load_config_accepts_what_the_builders_take(kind, extra):
    # load_config once refused Lion fp32_optimizer_states and SGD maximize, which optim implements.
    import zerojax
    from zerojax.config import OPTIMIZER_PARAMS

    params = {**_every_param(OPTIMIZER_PARAMS[kind]), **extra}
    cfg = zerojax.load_config({"train_batch_size": 8, "optimizer": {"type": kind, "params": params}}, world_size=1)
    p0, grads = _problem(3)
    plain = {k: v for k, v in params.items() if not OPTIMIZER_PARAMS[kind][k].inert}
    # The inert keys change nothing: same trajectory as the optimizer built without them.
    assert_trajectories(run_ours(zerojax.build_optimizer(cfg), p0, grads, np.float64),
                        run_ours(optimizer_from(kind, plain, gradient_clipping=cfg.gradient_clipping),
                                 p0, grads, np.float64), np.float64)


def test_maximize_true_is_refused_with_the_way_out():
    from zerojax.config import ConfigError

    with pytest.raises(ConfigError, match="maximize: only false is supported; negate the loss"):
        optimizer_from("SGD", {"lr": 0.1, "maximize": True})
