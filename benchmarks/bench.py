"""zerojax against a bare jax.jit step (and, through the anchor figures in RESULTS.md, DeepSpeed) on GPT-2.

    python benchmarks/bench.py --tiny                         # CPU, < 1 minute: does it run?
    python benchmarks/bench.py                                # default matrix on all local GPUs
    python benchmarks/bench.py --matrix custom --sizes xl --stages plain,3 --remat on \
        --offload none,optimizer --micro 4,8 --mem-fraction 0.17
    python benchmarks/bench.py --matrix custom --stages 2 --offload optimizer --mem-fraction 0.17 \
        --offload-loop host --adam-mu-dtype bfloat16      # engine options for every entry

Each matrix entry runs in a fresh subprocess (`--one <json spec>`): a device's
`peak_bytes_in_use` is a process-lifetime maximum, so entries sharing a process would mix peaks,
and the parent never touches the accelerator (a preallocating parent would starve its children).
The bf16 matmul ceiling for MFU is measured first, in its own child: one 8192^3 matmul per
local device, all at once.

A JSON spec (`--matrix '[{...}, ...]'`) takes the keys of `_base` plus: "remat" false / true /
a policy name of zerojax.models.gpt2.REMAT_POLICIES ("dots", "save_qkv", ...); "unroll" (the
model's scan_unroll); "loss_chunk" (N: the cross entropy N positions at a time,
zerojax.models.chunked_gpt2_loss, whose fused head never holds the whole logits); "env"
(variables for that entry's child only; its XLA_FLAGS are appended to the run's, so one entry can
A/B one XLA flag or JAX_OPTIMIZATION_LEVEL); "options" (zerojax.EngineOptions fields for that
entry, on top of the run's --offload-loop / --adam-mu-dtype / --split-master / ... flags);
"label" (shown in the name).

Columns: tokens/s per device after warm-up, model TFLOP/s per device (FLOPs/token = 6N + 12*L*d*T),
MFU against the measured ceiling, measured peak per device (max over local devices), the
planner's predicted peak (XLA's compiled memory analysis of the same step), compile seconds.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TAG = "BENCH_RESULT "
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)

# ---------------------------------------------------------------------------------------------
# Matrix


def build_matrix(args, n_devices: int) -> list[dict]:
    if args.matrix not in ("default", "quick", "custom"):
        text = open(args.matrix).read() if os.path.exists(args.matrix) else args.matrix
        specs = json.loads(text)
        base = _base(args)
        return [{**base, **s, "options": {**base["options"], **(s.get("options") or {})}}
                for s in (specs if isinstance(specs, list) else [specs])]
    multi = n_devices > 1
    stages = args.stages or (["plain", 1, 2, 3] if multi else ["plain", 0, 1, 2, 3])
    remats = args.remat or ["off", "on"]
    if args.matrix == "quick":
        stages = args.stages or ["plain", 2 if not multi else 1, 3]
        remats = args.remat or ["on"]
    out = []
    for size in args.sizes:
        for dtype in args.dtypes:
            for accum in args.accum:
                for micro in args.micro:
                    for stage in stages:
                        for off in args.offload:
                            if off != "none" and stage in ("plain", 0):
                                continue
                            if off.partition(":")[0] == "param" and stage != 3:
                                continue
                            for remat in remats:
                                for pipe in args.pipe:
                                    for tp in args.tp:
                                        if pipe > 1 and (stage == "plain" or stage > 1 or off != "none"):
                                            continue  # pipelining: ZeRO stage <= 1, no offload
                                        if tp > 1 and stage == "plain":
                                            continue  # the plain baseline has no tensor axis
                                        out.append(dict(_base(args), size=size, dtype=dtype, accum=accum,
                                                        micro=micro, stage=stage, offload=off,
                                                        remat=remat == "on", pipe=pipe, tp=tp))
    return out


def _base(args) -> dict:
    return dict(seq=args.seq, steps=args.steps, warmup=args.warmup, size=args.sizes[0],
                dtype=args.dtypes[0], accum=args.accum[0], micro=args.micro[0], stage="plain",
                offload="none", remat=False, attention=args.attention, pipe=1, tp=args.tp[0],
                options=engine_options_of(args))


# the EngineOptions fields the command line sets (--offload-loop, ..., --no-memory-guard)
OPTION_FLAGS = ("offload_loop", "offload_host_chunk_bytes", "offload_host_window",
                "offload_host_prefetch", "adam_mu_dtype", "split_master", "pipeline_repeats",
                "memory_guard", "init_group_bytes")


def engine_options_of(args) -> dict:
    """The EngineOptions fields given on the command line (the rest keep the library's defaults)."""
    return {k: getattr(args, k) for k in OPTION_FLAGS if getattr(args, k, None) is not None}


def name_of(s: dict) -> str:
    what = "plain" if s["stage"] == "plain" else f"zero{s['stage']}"
    extra = "" if s.get("offload", "none") == "none" else f"+off-{s['offload']}"
    extra += f" pipe{s['pipe']}" if s.get("pipe", 1) > 1 else ""
    extra += f" tp{s['tp']}" if s.get("tp", 1) > 1 else ""
    extra += f" ckpt{s['ckpt']}" if s.get("ckpt") else ""
    extra += f" accum-{s['grad_accum']}" if s.get("grad_accum") else ""
    extra += f" vocab/{s['vocab_multiple']}" if s.get("vocab_multiple") else ""
    extra += f" ce/{s['loss_chunk']}" if s.get("loss_chunk") else ""
    policy = remat_policy_of(s)
    remat = "" if policy is None else " remat" if policy == "full" else f" remat-{policy}"
    remat += f" unroll{s['unroll']}" if s.get("unroll", 1) > 1 else ""
    opts = " ".join(f"{k}={v}" for k, v in sorted((s.get("options") or {}).items()))
    label = f" [{s['label']}]" if s.get("label") else f" [{opts}]" if opts else ""
    return f"{s['size']} {what}{extra} {s['dtype']} mb{s['micro']}x{s['accum']}{remat}{label}"


def remat_policy_of(spec: dict):
    """The spec's "remat": false / true (per-layer "full") or a policy name of
    zerojax.models.gpt2.REMAT_POLICIES ("dots", "save_qkv", ...; "none" = off)."""
    r = spec.get("remat")
    if r is True:
        return "full"
    if r in (False, None, "none", "off"):
        return None
    return "full" if r == "on" else r


def loss_fn_of(spec: dict):
    """The entry's loss: gpt2_loss, or chunked_gpt2_loss(spec["loss_chunk"]) where it is set."""
    from zerojax.models.gpt2 import chunked_gpt2_loss, gpt2_loss

    return chunked_gpt2_loss(int(spec["loss_chunk"])) if spec.get("loss_chunk") else gpt2_loss


def entry_env(env: dict, spec: dict) -> dict:
    """The child's environment for one entry: the spec's "env" on top (its XLA_FLAGS appended to
    the run's, so an entry can A/B an XLA flag or set JAX_OPTIMIZATION_LEVEL alone)."""
    from zerojax.xla_flags import merged_xla_flags

    extra = dict(spec.get("env") or {})
    out = dict(env)
    if "XLA_FLAGS" in extra:
        out["XLA_FLAGS"] = merged_xla_flags(env.get("XLA_FLAGS", ""), extra.pop("XLA_FLAGS").split())
    out.update({k: str(v) for k, v in extra.items()})
    return out


# ---------------------------------------------------------------------------------------------
# Children


def child_env(args) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # One compilation cache per bench run: an entry's second compile of the same program (the
    # engine's AOT compile, then its jitted step) loads instead of recompiling. Entries differ in
    # their programs, so nothing is shared between them.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", args.cache_dir)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if args.mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
        # a smoke test: skip LLVM's optimisations, which dominate CPU compile time
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={args.tiny_devices}"
                            " --xla_backend_optimization_level=0").strip()
    return env


def run_child(spec: dict, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            out = json.loads(line[len(TAG):])
            out["wall_s"] = time.perf_counter() - t0
            return out
    lines = (p.stderr or p.stdout).strip().splitlines()
    tail = lines[-12:]
    # the exception line ("XlaRuntimeError: RESOURCE_EXHAUSTED: ...") may sit above a long XLA
    # stack trace, so search the whole output, last match first
    err = next((l for l in reversed(lines) if "Error:" in l), None) or next(
        (l for l in reversed(tail) if "rror" in l), tail[-1] if tail else "")
    return {"error": err.strip()[:300], "returncode": p.returncode, "stderr_tail": tail}


def one(spec: dict) -> dict:
    """Run one matrix entry in this process; returns the result dict."""
    if spec["kind"] == "ceiling":
        return measure_ceiling(spec.get("n", 8192))
    return run_entry(spec)


def measure_ceiling(n: int) -> dict:
    """Per-device bf16 matmul TFLOP/s with every local device busy at once (zerojax.ceiling)."""
    from zerojax.planning.ceiling import measure_matmul_ceiling

    return measure_matmul_ceiling(n)


def fmt_tflops(x) -> str:
    """Three significant digits: a CPU's 0.02 TFLOP/s must not print as 0 beside its MFU."""
    return "-" if x is None else f"{x:.3g}"


def _peak_bytes():
    import jax

    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001
            stats = None
        peaks.append(None if not stats else stats.get("peak_bytes_in_use"))
    return peaks


def model_config(spec: dict):
    """The entry's GPT2Config: its size; "vocab_multiple" (optional) sets the vocabulary padding
    (GPT2Config.make_vocab_size_divisible_by; 1 = GPT-2's exact 50257 rows)."""
    from zerojax.models import gpt2 as G

    extra = {"make_vocab_size_divisible_by": int(spec["vocab_multiple"])} if spec.get("vocab_multiple") else {}
    return G.GPT2Config.named(spec["size"], **extra)


def run_entry(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zerojax.models import gpt2 as G

    config = model_config(spec)
    seq = min(spec["seq"] or config.n_positions, config.n_positions)
    n_dev = jax.device_count()
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[spec["dtype"]]
    pipe = int(spec.get("pipe", 1))
    global_batch = spec["micro"] * spec["accum"] * (n_dev // pipe)  # data-parallel size: devices / pipe
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (global_batch, seq), dtype=np.int32)
    batch = {"input_ids": tokens}

    if spec["stage"] == "plain":
        runner = PlainRunner(config, spec, dtype, batch)
    else:
        runner = ZeroRunner(config, spec, dtype, batch, n_dev // pipe)

    losses = []
    t0 = time.perf_counter()
    for i in range(spec["warmup"]):
        losses.append(runner.step())
        if i == 0:
            runner.block()
            first_step_s = time.perf_counter() - t0  # a step plus any compile left to do
    runner.block()
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        losses.append(runner.step())
    runner.block()
    dt = time.perf_counter() - t0
    tokens_per_s_dev = spec["steps"] * global_batch * seq / dt / n_dev
    fpt = (G.flops_per_token(config, seq) if hasattr(G, "flops_per_token")
           else 6 * G.num_params(config) + 12 * config.n_layer * config.n_embd * seq)
    peaks = _peak_bytes()
    return {
        "tokens_per_s_per_device": tokens_per_s_dev,
        "tflops_per_device": tokens_per_s_dev * fpt / 1e12,
        "flops_per_token": fpt,
        "step_s": dt / spec["steps"],
        "compile_s": runner.compile_s,
        "first_step_s": first_step_s if spec["warmup"] else None,
        "peak_bytes": max((p for p in peaks if p is not None), default=None),
        "peak_bytes_per_device": peaks,
        "predicted_peak_bytes": runner.predicted.peak if runner.predicted else None,
        "predicted": runner.predicted.to_dict() if runner.predicted else None,
        "losses": [float(x) for x in jax.device_get(losses)],
        "n_devices": n_dev, "global_batch": global_batch, "seq": seq,
        "params": G.num_params(config), "backend": jax.default_backend(),
        # the offload's resolved knobs (layer groups, loop, split master), where the engine offloads
        "offload_settings": getattr(getattr(runner, "engine", None), "offload_settings", None),
        "pipe": pipe, "predicted_bubble": getattr(getattr(runner, "engine", None), "pipeline_bubble", None),
    }


class PlainRunner:
    """The overhead baseline: no zerojax. fp32 master + AdamW (optax) replicated, the step casts
    params to the compute dtype, grads of the cast params, clip 1.0, per-layer remat optional,
    cuDNN attention on GPU (the model's default), batch split over all devices."""

    def __init__(self, config, spec, dtype, batch):
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from zerojax.models.gpt2 import GPT2
        from zerojax.planning.memory import CompiledMemory

        loss_fn = loss_fn_of(spec)
        mesh = jax.make_mesh((jax.device_count(),), ("data",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        model = GPT2(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                     remat_policy=remat_policy_of(spec), scan_unroll=int(spec.get("unroll", 1)),
                     attention_impl=spec.get("attention"))
        graphdef, params = nnx.split(model)
        params = jax.device_put(params, rep)
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))
        opt_state = jax.jit(tx.init, out_shardings=rep)(params)
        accum = spec["accum"]

        def loss_of(p16, mb):
            return loss_fn(nnx.merge(graphdef, p16), mb)[0]

        def step(params, opt_state, batch):
            p16 = jax.tree.map(lambda x: x.astype(dtype), params)
            if accum == 1:
                loss, g = jax.value_and_grad(loss_of)(p16, batch)
            else:
                mbs = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

                def body(carry, mb):
                    l, g = jax.value_and_grad(loss_of)(p16, mb)
                    return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, (l, g)), None

                zero = (jnp.float32(0), jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p16))
                (loss, g), _ = jax.lax.scan(body, zero, mbs)
                loss, g = loss / accum, jax.tree.map(lambda x: x / accum, g)
            g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.batch = jax.device_put(batch, data)
        jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(rep, rep, rep))
        t0 = time.perf_counter()
        self.compiled = jitted.lower(params, opt_state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.predicted = CompiledMemory.of(self.compiled)
        self.state = (params, opt_state)

    def step(self):
        params, opt_state, loss = self.compiled(*self.state, self.batch)
        self.state = (params, opt_state)
        return loss

    def block(self):
        import jax

        jax.block_until_ready(self.state)


class ZeroRunner:
    """zerojax.shard on a DeepSpeed config dict; the engine's own AOT step gives the prediction."""

    def __init__(self, config, spec, dtype, batch, n_dev):
        """n_dev: the data-parallel size (devices / pipe)."""
        import jax.numpy as jnp
        from flax import nnx

        import zerojax
        from zerojax.models.gpt2 import GPT2
        from zerojax.planning import memory as M

        off, _, ratio = spec["offload"].partition(":")  # "optimizer:0.5": offload_optimizer.ratio
        zero = {"stage": int(spec["stage"]),
                "offload_optimizer": {"device": "cpu" if off in ("optimizer", "param") else "none",
                                      "pin_memory": True, "ratio": float(ratio or 1.0)}}
        if int(spec["stage"]) == 3:
            zero["offload_param"] = {"device": "cpu" if off == "param" else "none",
                                     "pin_memory": True}
        ds = {
            "train_micro_batch_size_per_gpu": spec["micro"],
            "gradient_accumulation_steps": spec["accum"],
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            # DeepSpeed's batch rule counts tensor ranks: the global batch stays micro x accum x
            # devices, so tokens/s per device compare across tensor sizes
            "tensor_parallel": {"autotp_size": int(spec.get("tp", 1))},
        }
        if spec.get("pipe", 1) > 1:  # micro-batches through the stages = gradient_accumulation_steps
            ds["pipeline"] = {"stages": spec["pipe"], "activation_checkpoint_interval": int(spec.get("ckpt", 0))}
        if spec.get("grad_accum"):  # data_types.grad_accum_dtype, e.g. "bf16" (default fp32)
            ds["data_types"] = {"grad_accum_dtype": spec["grad_accum"]}
        if spec["dtype"] == "bf16":
            ds["bf16"] = {"enabled": True}
        elif spec["dtype"] == "fp16":
            ds["fp16"] = {"enabled": True}
        cfg = zerojax.load_config(ds, world_size=n_dev)
        # a callable, so the engine builds the weights already sharded (an eager model would put
        # a full fp32 copy on device 0 first, and into its lifetime peak)
        model = lambda: GPT2(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,  # noqa: E731
                             remat_policy=remat_policy_of(spec), scan_unroll=int(spec.get("unroll", 1)),
                             attention_impl=spec.get("attention"))
        # the run's engine-option flags, with the entry's own "options" on top
        options = zerojax.EngineOptions(**(spec.get("options") or {}))
        self.engine = zerojax.shard(model, cfg, loss_fn=loss_fn_of(spec), options=options)
        self.batch = batch
        self.predicted, self.compile_s, self.compiled = None, None, None
        t0 = time.perf_counter()
        try:
            compiled = self.compiled = M.compile_engine_step(self.engine, batch)
            self.compile_s = time.perf_counter() - t0
            self.predicted = M.CompiledMemory.of(compiled)
        except NotImplementedError as e:
            print(f"no prediction: {e}", file=sys.stderr)
        self._first = True

    def step(self):
        t0 = time.perf_counter()
        metrics = self.engine.train_step(self.batch)
        if self._first and self.compile_s is None:
            import jax

            jax.block_until_ready(metrics)
            self.compile_s = time.perf_counter() - t0  # includes one step
        self._first = False
        return metrics["loss"]

    def block(self):
        import jax

        jax.block_until_ready(self.engine.state)


# ---------------------------------------------------------------------------------------------
# Table and main


def fmt_table(rows: list[dict], ceiling: dict) -> str:
    biggest = max([r["result"].get("predicted_peak_bytes") or 0 for r in rows] +
                  [r["result"].get("peak_bytes") or 0 for r in rows])
    unit, gib = ("GiB", 2**30) if biggest >= 2**30 else ("MiB", 2**20)
    head = (f"{'entry':<56}{'tok/s/dev':>11}{'TFLOP/s':>9}{'MFU':>7}{'peak ' + unit:>10}"
            f"{'pred ' + unit:>10}{'compile s':>11}  loss")
    lines = [f"ceiling: {fmt_tflops(ceiling.get('ceiling_tflops'))} TFLOP/s bf16 per device, all busy "
             f"({ceiling.get('matmul_n')}^3 matmul) on {ceiling.get('n_devices')} x "
             f"{ceiling.get('device_kind')} ({ceiling.get('backend')}, jax {ceiling.get('jax_version')})",
             head, "-" * len(head)]
    for r in rows:
        res = r["result"]
        if "error" in res:
            lines.append(f"{r['name']:<56}  FAILED: {res['error']}")
            continue
        g = lambda b: "-" if b is None else f"{b / gib:.2f}"  # noqa: E731
        mfu = f"{res['mfu']:.1%}" if res.get("mfu") is not None else "-"  # only against a measured ceiling
        comp = "-" if res.get("compile_s") is None else f"{res['compile_s']:.1f}"
        loss = res["losses"][-1] if res.get("losses") else float("nan")
        lines.append(f"{r['name']:<56}{res['tokens_per_s_per_device']:>11,.0f}"
                     f"{fmt_tflops(res['tflops_per_device']):>9}{mfu:>7}{g(res['peak_bytes']):>10}"
                     f"{g(res['predicted_peak_bytes']):>10}{comp:>11}  {loss:.3f}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    csv = lambda f: lambda s: [f(x) for x in s.split(",") if x]  # noqa: E731
    stage = lambda x: x if x == "plain" else int(x)  # noqa: E731
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--matrix", default="default",
                   help="default | quick | custom (from the flags below) | a JSON list of specs "
                        "or a path to one")
    p.add_argument("--tiny", action="store_true", help="tiny GPT-2 on 2 virtual CPU devices, 2 steps")
    p.add_argument("--tiny-devices", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024)")
    p.add_argument("--sizes", type=csv(str), default=None, help="GPT-2 sizes (default large)")
    p.add_argument("--stages", type=csv(stage), default=None,
                   help="plain and/or ZeRO stages, e.g. plain,0,1,2,3")
    p.add_argument("--remat", type=csv(str), default=None, help="off,on (default both)")
    p.add_argument("--offload", type=csv(str), default=None,
                   help="none,optimizer,param (default none); optimizer:R / param:R set "
                        "offload_optimizer.ratio R (the fraction offloaded)")
    p.add_argument("--micro", type=csv(int), default=None, help="micro-batch per device (default 8)")
    p.add_argument("--pipe", type=csv(int), default=None,
                   help="pipeline stages (pipeline.stages; ZeRO stage <= 1), e.g. 1,2 (default 1); the "
                        "data-parallel size is devices / pipe, the micro-batches are --accum")
    p.add_argument("--accum", type=csv(int), default=None, help="gradient accumulation (default 1)")
    p.add_argument("--tp", type=csv(int), default=[1],
                   help="tensor_parallel.autotp_size values, e.g. 1,2 (default 1; plain runs only at 1)")
    p.add_argument("--dtypes", type=csv(str), default=None, help="bf16,fp16,fp32 (default bf16)")
    p.add_argument("--attention", default=None, choices=(None, "xla", "cudnn"),
                   help="attention implementation (default: cuDNN on GPU where it applies)")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION for the children (e.g. 0.17 ~ 24 GB of an H200)")
    o = p.add_argument_group("engine options (zerojax.EngineOptions fields, for every entry; "
                             "unset = the library's default)")
    o.add_argument("--offload-loop", dest="offload_loop", choices=("auto", "in_place", "host"),
                   help="offload_loop: how optimizer offload streams the state (default auto)")
    o.add_argument("--offload-host-chunk-bytes", dest="offload_host_chunk_bytes", type=int,
                   help="offload_host_chunk_bytes: fp32 master bytes per host-loop chunk (256 MiB)")
    o.add_argument("--offload-host-window", dest="offload_host_window", type=int,
                   help="offload_host_window: host-loop chunks on the device at once (3)")
    o.add_argument("--offload-host-prefetch", dest="offload_host_prefetch", type=int,
                   help="offload_host_prefetch: chunks read in before the step's jit (2)")
    o.add_argument("--adam-mu-dtype", dest="adam_mu_dtype", choices=("bfloat16",),
                   help="adam_mu_dtype: Adam's first moment in bf16 (default: fp32)")
    o.add_argument("--split-master", dest="split_master", choices=("auto", "on", "off"),
                   help="split_master: the fp32 master as bf16 params + 16-bit remainder (auto)")
    o.add_argument("--pipeline-repeats", dest="pipeline_repeats", type=int,
                   help="pipeline_repeats: circular pipeline repeats (1)")
    o.add_argument("--no-memory-guard", dest="memory_guard", action="store_const", const=False,
                   default=None, help="memory_guard=False: no fit check before the first step")
    o.add_argument("--init-group-bytes", dest="init_group_bytes", type=int,
                   help="init_group_bytes: offload init's weight groups (default: a quarter of the device)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per entry")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<timestamp>.json)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.steps = args.steps if args.steps is not None else (2 if tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.seq = args.seq if args.seq is not None else (32 if tiny else 1024)
    args.sizes = args.sizes or (["tiny"] if tiny else ["large"])
    args.micro = args.micro or ([2] if tiny else [8])
    args.accum = args.accum or [1]
    args.pipe = args.pipe or [1]
    args.dtypes = args.dtypes or ["bf16"]
    args.offload = args.offload or ["none"]
    if tiny and args.matrix == "default" and not args.stages:
        args.matrix = json.dumps(
            [{"stage": "plain"}, {"stage": 1}, {"stage": 2, "offload": "optimizer"},
             {"stage": 3, "remat": True}])
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        print(TAG + json.dumps(one(json.loads(args.one))), flush=True)
        return 0

    import tempfile

    args.cache_dir = tempfile.mkdtemp(prefix="zerojax-bench-cache-")
    env = child_env(args)
    ceiling = run_child({"kind": "ceiling", "n": 1024 if args.tiny else 8192}, env, args.timeout)
    if "error" in ceiling:
        print(f"ceiling measurement failed: {ceiling}", file=sys.stderr)
        return 1
    specs = build_matrix(args, ceiling["n_devices"])
    print(f"{len(specs)} entries on {ceiling['n_devices']} x {ceiling['device_kind']}; ceiling "
          f"{fmt_tflops(ceiling['ceiling_tflops'])} TFLOP/s per device", flush=True)
    rows = []
    for spec in specs:
        spec = dict(spec, kind="entry")
        name = name_of(spec)
        res = run_child(spec, entry_env(env, spec), args.timeout)
        rows.append({"name": name, "spec": spec, "result": res})
        status = (f"FAILED {res['error']}" if "error" in res else
                  f"{res['tokens_per_s_per_device']:,.0f} tok/s/dev")
        print(f"  {name}: {status}  ({res.get('wall_s', 0):.0f}s)", flush=True)
    if ceiling.get("ceiling_tflops"):
        for r in rows:
            if "tflops_per_device" in r["result"]:
                r["result"]["mfu"] = r["result"]["tflops_per_device"] / ceiling["ceiling_tflops"]
    print()
    print(fmt_table(rows, ceiling))

    report = {"time": _dt.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
              "ceiling": ceiling, "entries": rows,
              "mem_fraction": args.mem_fraction}
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"{stamp}{'-tiny' if args.tiny else ''}.json")
    paths = [out]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], os.path.basename(out)))
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}")
    import shutil

    shutil.rmtree(args.cache_dir, ignore_errors=True)
    return 0 if all("error" not in r["result"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
