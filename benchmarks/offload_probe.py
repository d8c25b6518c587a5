"""Optimizer-offload probe: how should the fp32 master + Adam moments stream from pinned host memory?

GPT-2 (default Large: 36 layers, d=1280, vocab 50257), seq 1024, bf16 compute, per-layer remat,
AdamW, clip 1.0. One jitted step: forward/backward on bf16 params on the device, then the
optimizer update over master + state in `pinned_host` by one chunk layout of `zerojax.offload`:

  none          everything on the device, plain optax (the reference)
  loop/K        the library's layout: the layers in one host chunk updated in place K groups a time
  whole         whole state to the device and back inside the step (MaxText's way; ANCHORS: 17.4k)
  chunked/K     K layer groups (+ the embeddings chunk), unrolled
  engine-opt[/K]    the real engine: zerojax.shard, ZeRO-3 + offload_optimizer cpu
  engine-param[/K]  ... + offload_param cpu (layers fetched inside the layer scan)

"whole" and "chunked" lost to "loop" on the GPU (README, "Measured"); they live here, built from
`zerojax.offload.Chunk`s and run by the library's update. ("scan/K", a lax.scan over stacked layer
groups, and the "chunked" window barriers were measured too and removed from the library.)

Each configuration runs in its own process so that `peak_bytes_in_use` is its own.

  PYTHONPATH=. python3 benchmarks/offload_probe.py --mem-fraction 0.17      # GPU, ~3 min
  PYTHONPATH=. python3 benchmarks/offload_probe.py --tiny                    # CPU smoke test
Writes $OUT/offload_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT = ["none", "whole", "chunked/4", "chunked/12", "chunked/36", "loop/36"]
TINY = ["none", "whole", "chunked/1", "chunked/2", "loop/2"]


def run_engine(args, name: str) -> dict:
    """"engine-opt[/K[/candidate[/wW]]]" or "engine-param[...]": the real zerojax.shard path (ZeRO-3,
    bf16, AdamW, clip 1.0, remat), offload_optimizer (+ offload_param) to cpu, model built under
    jit (never whole on one device); K sets EngineOptions.offload_chunks."""
    import jax
    import numpy as np
    from flax import nnx

    import zerojax
    from zerojax.models import gpt2

    parts = name.split("/")
    kw = {}
    if len(parts) > 1 and parts[1]:
        kw["offload_chunks"] = int(parts[1])
    cfg = _gpt_config(args)
    param = parts[0] == "engine-param"
    ds = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "cpu" if param else "none", "pin_memory": True}}}
    n = jax.device_count()
    cfg_ds = zerojax.load_config(ds, world_size=n)
    make = lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(0), dtype=jax.numpy.bfloat16,  # noqa: E731
                             remat_policy=args.remat)
    t0 = time.perf_counter()
    loss_fn = gpt2.chunked_gpt2_loss(args.loss_chunk) if args.loss_chunk else gpt2.gpt2_loss
    eng = zerojax.shard(make, cfg_ds, loss_fn=loss_fn, options=zerojax.EngineOptions.from_env(**kw))
    init_s = time.perf_counter() - t0
    B, T = args.micro * n, (64 if args.tiny else args.seq)
    batch = {"input_ids": np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)}
    t0 = time.perf_counter()
    compiled = eng.compiled_step(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch))
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for _ in range(args.warmup):
        loss = eng.train_step(batch)["loss"]
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = eng.train_step(batch)["loss"]
    jax.block_until_ready((eng.state, loss))
    dt = (time.perf_counter() - t0) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    hlo = compiled.as_text()
    rep = eng.memory_report()
    return {
        "config": name, "candidate": "loop", "k": eng.offload_settings["chunks"],
        "model": _model_name(args), "micro": args.micro, "seq": T,
        "n_params": int(sum(x.size for x in jax.tree.leaves(eng.state.params))),
        "loss_chunk": args.loss_chunk, "step_s": dt, "tokens_per_s": B * T / dt / n, "compile_s": compile_s, "init_s": init_s,
        "loss": float(loss), "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30,
        "host_gib": rep["host"] / 2**30, "device_state_gib": rep["model_states"] / 2**30,
        "hlo_copy_start": hlo.count("copy-start"), "hlo_S5": hlo.count("S(5)"),
        "backend": jax.default_backend(), "jax": jax.__version__,
    }


def _gpt_config(args):
    from zerojax.models import gpt2

    if args.tiny:
        return gpt2.GPT2Config.named("tiny", n_layer=2)
    over = {k: v for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer), ("n_head", args.n_head))
            if v is not None}
    return gpt2.GPT2Config.named(args.size, **over)


def _model_name(args):
    if args.tiny:
        return "tiny"
    extra = "".join(f" {k}={v}" for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer),
                                             ("n_head", args.n_head)) if v is not None)
    return args.size + extra


def lost_layout(candidate: str, tree, k: int):
    """The chunk layout of `candidate`: "loop" (the library's), or one that lost to it, built from
    the layer pieces: "chunked" one chunk per piece, in an unrolled Python loop (independent
    chains, so XLA may copy chunk k+1 in while chunk k computes); "whole" all pieces in one chunk."""
    from zerojax import offload as O

    if candidate == "loop":
        return O.chunk_layout(tree, k)
    treedef, flags, n, host, _ = O.layer_pieces(tree, k)
    if candidate == "chunked":
        chunks = [O.Chunk(rest=r, lo=lo, hi=hi) for r, lo, hi in host]
    elif candidate == "whole":
        layers = [p for p in host if not p[0]]
        chunks = [O.Chunk(rest=host[0][0], lo=layers[0][1] if layers else 0, hi=host[-1][2])]
    else:
        raise ValueError(f"candidate {candidate!r}: choose loop, chunked or whole")
    return O.ChunkLayout(treedef, flags, n, tuple(chunks))


def run_one(args, name: str) -> dict:
    if name.startswith("engine"):
        return run_engine(args, name)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from zerojax import offload as O
    from zerojax.models import gpt2

    parts = name.split("/")
    cand, k = parts[0], int(parts[1]) if len(parts) > 1 else 1
    cfg = _gpt_config(args)
    dtype = jnp.bfloat16
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    rep = NamedSharding(mesh, P())

    model = nnx.eval_shape(lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                              remat_policy=args.remat))
    graphdef, abstract = nnx.split(model)
    shardings = jax.tree.map(lambda _: rep, abstract)
    init = jax.jit(lambda: nnx.split(gpt2.GPT2(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                 remat_policy=args.remat))[1], out_shardings=shardings)
    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    clip = optax.clip_by_global_norm(1.0)
    master = init()
    compute = jax.jit(lambda m: jax.tree.map(lambda x: x.astype(dtype), m))(master)

    def grads_of(cp, batch):
        loss_fn = lambda p: gpt2.gpt2_loss(nnx.merge(graphdef, p), batch)[0]  # noqa: E731
        loss, g = jax.value_and_grad(loss_fn)(cp)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        g, _ = clip.update(g, clip.init(g))
        return loss, g

    if cand == "none":
        state = jax.jit(tx.init)(master)

        def step(cp, st, batch):
            m, s = st
            loss, g = grads_of(cp, batch)
            u, s = tx.update(g, s, m)
            m = optax.apply_updates(m, u)
            return jax.tree.map(lambda x: x.astype(dtype), m), (m, s), loss

        st = (master, state)
    else:
        st, plan = O.init_offloaded(tx, master, lost_layout(cand, master, k), shardings,
                                    O.host_memory_kind(True))
        del master

        def step(cp, st, batch):
            loss, g = grads_of(cp, batch)
            cp, st = O.streamed_update(tx, g, st, plan, compute_dtype=dtype)
            return cp, st, loss

    B, T = args.micro, (64 if args.tiny else args.seq)
    batch = {"input_ids": jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)),
                                      jnp.int32)}
    jstep = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = jstep.lower(compute, st, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    for _ in range(args.warmup):
        compute, st, loss = compiled(compute, st, batch)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        compute, st, loss = compiled(compute, st, batch)
    jax.block_until_ready((compute, st, loss))
    dt = (time.perf_counter() - t0) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    hlo = compiled.as_text()
    return {
        "config": name, "candidate": cand, "k": k,
        "model": "tiny" if args.tiny else args.size, "micro": B, "seq": T,
        "step_s": dt, "tokens_per_s": B * T / dt, "compile_s": compile_s, "loss": float(loss),
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30,
        "hlo_copy_start": hlo.count("copy-start"), "hlo_S5": hlo.count("S(5)"),
        "backend": jax.default_backend(), "jax": jax.__version__,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny GPT-2 on CPU: checks it runs")
    ap.add_argument("--size", default="large")
    ap.add_argument("--n-embd", type=int, default=None, help="override the named size's width")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--n-head", type=int, default=None)
    ap.add_argument("--micro", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--remat", default="full", help="model remat policy (full | dots | offload)")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="engine configs: cross entropy N positions at a time (0: full logits)")
    ap.add_argument("--mem-fraction", type=float, default=None, help="XLA_PYTHON_CLIENT_MEM_FRACTION")
    ap.add_argument("--configs", default=None, help="comma list, e.g. whole,chunked/12,loop/36")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.micro is None:
        args.micro = 2 if args.tiny else 8

    if args.one:
        print("RESULT " + json.dumps(run_one(args, args.one)), flush=True)
        return

    configs = args.configs.split(",") if args.configs else (TINY if args.tiny else DEFAULT)
    passthrough_extra: list = []
    env = dict(os.environ)
    if args.mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    if args.tiny:
        env.setdefault("JAX_PLATFORMS", "cpu")
    for flag in ("n_embd", "n_layer", "n_head"):
        if getattr(args, flag) is not None:
            args_extra = ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
            passthrough_extra.extend(args_extra)
    passthrough = passthrough_extra + ["--size", args.size, "--micro", str(args.micro), "--seq", str(args.seq),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--remat", args.remat,
                   "--loss-chunk", str(args.loss_chunk)]
    passthrough += ["--tiny"] if args.tiny else []
    rows = []
    for name in configs:
        cmd = [sys.executable, __file__, *passthrough, "--one", name]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                err = (p.stderr.strip().splitlines() or ["no output"])[-1]
                row = {"config": name, "error": err[-300:]}
            else:
                row = json.loads(line[7:])
        except subprocess.TimeoutExpired:
            row = {"config": name, "error": f"timeout after {args.timeout}s"}
        rows.append(row)
        print(_fmt(row), flush=True)

    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "offload_probe.json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "results": rows}, f, indent=1)


def _fmt(r):
    if "error" in r:
        return f"{r['config']:<16} ERROR {r['error']}"
    return (f"{r['config']:<16} {r['step_s'] * 1e3:8.1f} ms {r['tokens_per_s']:10.0f} tok/s "
            f"peak {r['peak_gib']:6.2f} GiB temp {r['temp_gib']:6.2f} GiB "
            f"compile {r['compile_s']:5.1f} s copy-start {r['hlo_copy_start']}")


if __name__ == "__main__":
    main()
