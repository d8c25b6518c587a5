"""Where a training step's device time goes: one bench.py entry traced with the JAX profiler.

    python benchmarks/profile_step.py '{"stage": 2, "remat": true}'            # GPT-2 Large, 1 GPU
    python benchmarks/profile_step.py '{"stage": 2, "offload": "optimizer"}' --mem-fraction 0.17
    python benchmarks/profile_step.py '{"size": "tiny", "seq": 32, "micro": 2}' --cpu   # smoke test

The spec is bench.py's (size, stage, remat, offload, micro, accum, tp, pipe, ...). After warm-up,
`--steps` steps run under `jax.profiler.trace`; the trace is read back in-process with
`jax.profiler.ProfileData` and every device-kernel event is put in one bucket by its name:
matmul (cuBLAS / cuBLASLt / nvjet / cutlass gemms), attention (cuDNN / flash / fmha),
collective (NCCL), copy (memcpy host<->device and device<->device), other (XLA's fusions:
element-wise, reductions, the optimizer's update, layer norms, softmax of the non-cuDNN path).
Prints a table (ms per step and share of busy time per bucket, the wall time per step, the
idle share) and the 15 longest kernels; `--json` writes the same numbers.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BUCKETS = (  # first match wins; names of CUDA kernels as XLA / cuBLAS / cuDNN / NCCL emit them
    ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all", re.I)),
    ("attention", re.compile(r"fmha|flash|cudnn.*(attn|sdpa)|sdpa|__cudnn|cudnn_fused|xmma_fmha", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|cublas|xmma|sm\d+_.*(s16816|h16816|hmma)|dot", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic.update.slice", re.I)),
)


def bucket_of(name: str) -> str:
    for label, pat in BUCKETS:
        if pat.search(name):
            return label
    return "other"


def device_events(profile):
    """(plane name, event name, start ns, duration ns) for every kernel on an accelerator plane;
    on CPU (no device plane) the XLA op events of the host plane's XLA lines."""
    planes = list(profile.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    for plane in gpu or [p for p in planes if p.name.startswith("/host:CPU")]:
        print(f"{plane.name}: lines {[line.name for line in plane.lines]}", file=sys.stderr)
        for line in plane.lines:
            # GPU: one line per CUDA stream; "XLA Ops" / "XLA Modules" lines summarise the same
            # time again, so only the stream lines count
            if gpu and not line.name.startswith("Stream"):
                continue
            if not gpu and not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                if ev.name.startswith("ThreadpoolListener"):
                    continue
                yield plane.name, line.name, ev.name, ev.start_ns, ev.duration_ns, _hlo_op(ev)


def _hlo_op(ev) -> str:
    """The HLO instruction a GPU kernel ran for (the trace's "hlo_op" stat), or ""."""
    try:
        return str(dict(ev.stats).get("hlo_op", ""))
    except Exception:  # stats of another shape in some JAX version: no names, same buckets
        return ""


def summarise(events, steps: int, wall_s: float) -> dict:
    per_bucket = collections.Counter()
    per_kernel, per_kernel_calls = collections.Counter(), collections.Counter()
    other_calls, other_time = collections.Counter(), collections.Counter()
    per_stream = collections.Counter()
    intervals = collections.defaultdict(list)
    ops_of = collections.defaultdict(collections.Counter)  # kernel -> {HLO instruction: ns}
    for plane, line, name, start, dur, hlo_op in events:
        if hlo_op:
            ops_of[name[:90]][hlo_op] += dur
        per_bucket[bucket_of(name)] += dur
        per_kernel[name[:90]] += dur
        per_kernel_calls[name[:90]] += 1
        if bucket_of(name) == "other":
            other_calls[name[:90]] += 1
            other_time[name[:90]] += dur
        per_stream[f"{plane} {line}"] += dur
        intervals[plane].append((start, start + dur))
    # busy time per device = union of kernel intervals over its streams (overlap counted once)
    busy = {}
    for plane, iv in intervals.items():
        iv.sort()
        total, cur_s, cur_e = 0, None, None
        for s, e in iv:
            if cur_e is None or s > cur_e:
                total += 0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += 0 if cur_e is None else cur_e - cur_s
        busy[plane] = total
    n_dev = max(len(busy), 1)
    kernel_ms = sum(per_bucket.values()) / 1e6 / steps / n_dev
    return {
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "busy_ms_per_step": sum(busy.values()) / 1e6 / steps / n_dev,
        "kernel_ms_per_step": kernel_ms,
        "buckets_ms_per_step": {k: v / 1e6 / steps / n_dev for k, v in per_bucket.most_common()},
        # [name, ms per step, launches per step]
        "top_kernels_ms_per_step": [(k, v / 1e6 / steps / n_dev, per_kernel_calls[k] / steps / n_dev)
                                    for k, v in per_kernel.most_common(15)],
        # the HLO instructions behind each of those kernels (most time first, up to 4)
        "top_kernels_hlo_ops": {k: [op for op, _ in ops_of[k].most_common(4)]
                                for k, _ in per_kernel.most_common(15) if ops_of.get(k)},
        "streams_ms_per_step": {k: v / 1e6 / steps / n_dev for k, v in per_stream.most_common(8)},
        # the element-wise bucket's longest kernels: [name, ms per step, launches per step]
        "top_other_ms_per_step": [(k, v / 1e6 / steps / n_dev, other_calls[k] / steps / n_dev)
                                  for k, v in other_time.most_common(25)],
        "devices": n_dev,
    }


def fmt(summary: dict, title: str) -> str:
    s = summary
    wall, busy, kern = s["wall_ms_per_step"], s["busy_ms_per_step"], s["kernel_ms_per_step"]
    out = [f"## {title}",
           f"wall {wall:.1f} ms/step; device busy {busy:.1f} ms ({busy / wall:.0%} of wall); "
           f"kernel time summed over streams {kern:.1f} ms",
           "", "| bucket | ms/step | share of kernel time |", "|---|---:|---:|"]
    for k, v in s["buckets_ms_per_step"].items():
        out.append(f"| {k} | {v:.1f} | {v / kern:.1%} |")
    out += ["", "| longest kernels | ms/step | launches/step |", "|---|---:|---:|"]
    ops = s.get("top_kernels_hlo_ops", {})
    out[-1] = "|---|---:|---:|---|"
    out[-2] = "| longest kernels | ms/step | launches/step | HLO instructions |"
    out += [f"| `{k}` | {v:.2f} | {f'{n[0]:g}' if n else ''} | {', '.join(ops.get(k, []))} |"
            for k, v, *n in s["top_kernels_ms_per_step"]]
    out += ["", "| longest other kernels | ms/step | launches/step | HLO |", "|---|---:|---:|---|"]
    out += [f"| `{k}` | {v:.2f} | {n:g} | {s.get('hlo_of', {}).get(k, '')} |"
            for k, v, n in s.get("top_other_ms_per_step", [])]
    out += ["", "| stream | ms/step |", "|---|---:|"]
    out += [f"| {k} | {v:.1f} |" for k, v in s["streams_ms_per_step"].items()]
    return "\n".join(out)


def hlo_of_kernels(hlo_text: str, names) -> dict:
    """{kernel name: its HLO instruction, shortened}: a fusion kernel carries the name of the
    instruction it runs ("loop_multiply_fusion_3" for %loop_multiply_fusion.3), so the profile's
    longest element-wise kernels can be read against the compiled program (shapes, dtypes, the
    fused computation's ops)."""
    comps, current = {}, None
    for line in hlo_text.splitlines():  # fused computations: name -> their ops
        m = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            current = comps.setdefault(m.group(1), collections.Counter())
        elif current is not None:
            op = re.search(r"=\s*\S+\s+([a-z\-]+)\(", line)
            if op and op.group(1) not in ("parameter", "constant", "bitcast", "broadcast", "get-tuple-element"):
                current[op.group(1)] += 1
    out = {}
    for name in names:
        for cand in {name, re.sub(r"_(\d+)$", r".\1", name)}:
            m = re.search(r"^\s*(?:ROOT\s+)?%?" + re.escape(cand) + r" = (.*)$", hlo_text, re.M)
            if m:
                text = m.group(1)
                calls = re.search(r"calls=%?([\w.\-]+)", text)
                ops = comps.get(calls.group(1)) if calls else None
                shape = text.split(" fusion(")[0].split(" custom-call(")[0]
                out[name] = (shape[:160] + (" ops " + ",".join(f"{k}x{v}" for k, v in ops.most_common(8))
                                             if ops else ""))
                break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="bench.py entry as JSON (keys left out take bench.py's defaults)")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--title", default=None)
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--cpu", action="store_true", help="smoke test on 2 virtual CPU devices")
    p.add_argument("--hlo", default=None, help="write the compiled step's HLO here (gzip) and name the "
                                               "longest element-wise kernels' HLO instructions")
    args = p.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import bench

    # the spec's "env" (XLA flags, JAX_OPTIMIZATION_LEVEL) as bench.py gives it to its child:
    # before jax starts its backend, which reads XLA_FLAGS once
    os.environ.update(bench.entry_env(dict(os.environ), json.loads(args.spec)))
    import jax

    spec = dict(seq=1024, steps=0, warmup=0, size="large", dtype="bf16", accum=1, micro=8,
                stage=2, offload="none", remat=True, attention=None, pipe=1, tp=1)
    spec.update(json.loads(args.spec))
    runner_cls = bench.PlainRunner if spec["stage"] == "plain" else bench.ZeroRunner
    import numpy as np

    config = bench.model_config(spec)
    seq = min(spec["seq"], config.n_positions)
    n_dev = jax.device_count()
    pipe = int(spec.get("pipe", 1))
    gb = spec["micro"] * spec["accum"] * (n_dev // pipe)
    batch = {"input_ids": np.random.default_rng(0).integers(0, config.vocab_size, (gb, seq), dtype=np.int32)}
    import jax.numpy as jnp

    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[spec["dtype"]]
    runner = (runner_cls(config, spec, dtype, batch) if runner_cls is bench.PlainRunner
              else runner_cls(config, spec, dtype, batch, n_dev // pipe))
    for _ in range(args.warmup):
        runner.step()
    runner.block()
    trace_dir = tempfile.mkdtemp(prefix="zerojax-profile-")
    with jax.profiler.trace(trace_dir):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner.step()
        runner.block()
        wall = time.perf_counter() - t0
    paths = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs if f.endswith(".xplane.pb")]
    if not paths:
        print(f"no .xplane.pb under {trace_dir}", file=sys.stderr)
        return 1
    profile = jax.profiler.ProfileData.from_file(paths[0])
    summary = summarise(device_events(profile), args.steps, wall)
    summary["spec"] = spec
    compiled = getattr(runner, "compiled", None)
    if args.hlo and compiled is not None:
        import gzip

        text = compiled.as_text()
        with gzip.open(args.hlo, "wt") as f:
            f.write(text)
        summary["hlo_of"] = hlo_of_kernels(text, [k for k, _, _ in summary["top_other_ms_per_step"]])
    summary["tokens_per_s_per_device"] = gb * seq * args.steps / wall / n_dev
    title = args.title or json.dumps(json.loads(args.spec))
    print(fmt(summary, f"{title}: {summary['tokens_per_s_per_device']:,.0f} tokens/s per device"))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
