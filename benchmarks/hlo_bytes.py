"""Bytes a compiled (SPMD-partitioned) XLA step writes per device, by kind of op, loops counted in full.

Issue #15: GPT-2 Large pipelined over 2 H200s ran at 61% of ZeRO-1's tokens/s with 1.058x its
matmul FLOPs; the profile put 177 ms of a 499 ms step in copies and 154 ms in element-wise
kernels. This says which ops those are, from the optimized HLO text alone (CPU or GPU): every
instruction of a computation that runs as a program step (the entry, while bodies, called and
conditional computations) writes its result's bytes, `known_trip_count` times inside a scan's
loop; a fusion is one kernel whose kind is its fused root op (a fusion rooted at a
dynamic-update-slice writes in place: only the update's bytes count). Views that move no data
(parameter, get-tuple-element, tuple, bitcast, constant) write nothing. A multi-output fusion
counts all its outputs in full (an upper bound where one of them is updated in place).

    python benchmarks/hlo_bytes.py                # CPU: pipe 2 vs ZeRO-1 on a small GPT-2, 2 devices
    python benchmarks/hlo_bytes.py step.hlo ...   # any optimized HLO text (e.g. dumped on a GPU)
    (one GPU: benchmarks/pipe_stage_loop_1gpu.py times the schedule and prints the same table)
    from hlo_bytes import bytes_by_kind; bytes_by_kind(compiled.as_text())
"""
from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict

from hlo_flops import _operands, parse

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
         "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAYS = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "while", "conditional", "call", "copy-done",
         "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "async-update"}


def nbytes(shape: str) -> int:
    """Bytes of a result shape's text (tuples summed; layouts and tokens ignored)."""
    return sum(_ITEM.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in _ARRAYS.findall(shape))


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape's text ("(a, (b, c), d)" -> [a, (b, c), d])."""
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(shape[start:i].strip())
                break
        elif ch == "," and depth == 1:
            out.append(shape[start:i].strip())
            start = i + 1
    return out


def _called(rest: str, key: str) -> list[str]:
    m = re.search(key + r"=\{?([%\w.\-, ]+)\}?", rest)
    return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []


def writes(hlo: str) -> list[dict]:
    """Every data-writing instruction of the step: {comp, name, kind, shape, bytes, trips}, where
    trips is how often it runs per step (the product of its enclosing loops' trip counts)."""
    module = parse(hlo)
    comps, shapes = module["computations"], module["shapes"]
    roots = {c: ins[-1] for c, ins in comps.items() if ins}
    out: list[dict] = []

    def kind_of(op: str, rest: str, comp: str, shape: str) -> tuple[str, int]:
        if op.endswith("-start"):
            # an async op's result is ((operands), outputs, context): only the outputs are written
            # (GPU: fusion-start / all-reduce-start ...; its -done writes nothing more)
            parts = _elements(shape)
            return kind_of(op[: -len("-start")], rest, comp, parts[1] if len(parts) > 2 else shape)
        if op == "fusion":
            fused = _called(rest, "calls")
            root = roots.get(fused[0]) if fused else None
            if root is None:
                return "fusion", nbytes(shape)
            _, rshape, rop, rrest = root
            if rop == "dynamic-update-slice":  # in place: the update's bytes
                upd = _operands(rrest)[1]
                return "fusion:dynamic-update-slice", nbytes(shapes[fused[0]].get(upd, ""))
            if rop == "tuple":  # multi-output fusion: name it by its first non-tuple producers
                ops = {n: o for n, _, o, _ in comps[fused[0]]}
                kinds = sorted({ops.get(o, "?") for o in _operands(rrest)})
                return "fusion:" + "+".join(kinds), nbytes(shape)
            return "fusion:" + rop, nbytes(shape)
        if op == "dynamic-update-slice":
            return op, nbytes(shapes[comp].get(_operands(rest)[1], ""))
        if op == "custom-call":  # cuBLAS gemms, cuDNN attention, ...: by target
            m = re.search(r'custom_call_target="([^"]*)"', rest)
            return f"custom-call:{m.group(1) if m else '?'}", nbytes(shape)
        return op, nbytes(shape)

    def walk(comp: str, trips: int, seen: tuple = ()):
        if comp in seen:
            return
        for name, shape, op, rest in comps.get(comp, []):
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                for body in _called(rest, "body"):
                    walk(body, trips * (int(n.group(1)) if n else 1), seen + (comp,))
                continue
            if op == "conditional":
                for b in _called(rest, "branch_computations"):
                    walk(b, trips, seen + (comp,))
                continue
            if op in ("call", "async-start") or (op == "custom-call" and "called_computations" in rest):
                for c in _called(rest, "calls") + _called(rest, "to_apply"):
                    walk(c, trips, seen + (comp,))
            if op in _FREE or op.endswith("-done"):
                continue
            kind, b = kind_of(op, rest, comp, shape)
            out.append(dict(comp=comp, name=name, kind=kind, shape=re.sub(r"\{[\d,]*\}", "", shape)[:120],
                            bytes=b, trips=trips))

    walk(module["entry"], 1)
    return out


def bytes_by_kind(hlo: str) -> dict[str, int]:
    """Bytes written per step per device, by kind ("copy", "dynamic-update-slice" (the update's
    bytes), "fusion:<root op>", collectives by name, ...), largest first."""
    tally: dict[str, int] = defaultdict(int)
    for w in writes(hlo):
        tally[w["kind"]] += w["bytes"] * w["trips"]
    return dict(sorted(tally.items(), key=lambda kv: -kv[1]))


def bytes_by_loop(hlo: str) -> dict[str, dict]:
    """Per program step that runs (the entry, each loop body, ...): {trips, bytes (per step, loops
    counted)}, largest first -- which loop the bytes are written in (a pipeline's forward and
    backward iterations, the accumulation loop, the entry's setup and optimizer)."""
    tally: dict[str, dict] = {}
    for w in writes(hlo):
        t = tally.setdefault(w["comp"], {"trips": w["trips"], "bytes": 0})
        t["bytes"] += w["bytes"] * w["trips"]
    return dict(sorted(tally.items(), key=lambda kv: -kv[1]["bytes"]))


def top(hlo: str, n: int = 15) -> list[dict]:
    """The n instructions writing the most bytes per step."""
    return sorted(writes(hlo), key=lambda w: -w["bytes"] * w["trips"])[:n]


# ---------------------------------------------------------------------------------------------
# Driver: the steps of benchmarks/gpu_x2_pipe.sh's target (pipe 2 at 16 micro-batches of 2 rows vs
# ZeRO-1 data 2 at 2 of 8: the same 32-row global batch; bf16, AdamW, no remat), compiled only
# (an abstract engine holds no memory), on CPU with a small GPT-2 or on two GPUs.

SMALL = dict(vocab_size=512, n_positions=128, n_embd=256, n_head=4, n_layer=4)  # CPU: seconds


_MLIR_TYPES = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "f16": 2, "bf16": 2, "i32": 4, "ui32": 4, "f32": 4,
               "i64": 8, "f64": 8}


def _tensor_bytes(t: str) -> int:
    """Bytes of a StableHLO tensor type's text, e.g. "5x2x16x32xf32"."""
    *dims, dtype = t.split("x")
    return _MLIR_TYPES.get(dtype, 0) * math.prod(int(d) for d in dims)


def initial_fills(mlir: str) -> dict[str, int]:
    """Bytes of the buffers a lowered (StableHLO) module fills with zeros (a zero scalar broadcast:
    what `lax.scan` makes for its stacked outputs, `jax.lax.empty` on CPU) vs leaves uninitialised
    (`AllocateBuffer` custom calls: `jax.lax.empty` lowered for GPU or TPU), each op counted once
    as written in the text (issue #15: XLA writes a zero-filled stack in full before the loop
    that overwrites it). Shapes as written: global outside a shard_map, per device inside one.
    Lower for GPU on any machine: `jitted.trace(...).lower(lowering_platforms=("cuda",))`."""
    zeros, out = set(), {"zero_filled": 0, "uninitialised": 0}
    for line in mlir.splitlines():
        if "func.func" in line:
            zeros = set()  # SSA names are per function
        m = re.match(r"\s*(%[\w#]+) = stablehlo.constant dense<(?:0\.0+e\+00|0|false)> : tensor<\w+>", line)
        if m:
            zeros.add(m.group(1))
        m = re.search(r"stablehlo.broadcast_in_dim (%[\w#]+), dims = \[\] : "
                      r"\(tensor<\w+>\) -> tensor<([\dx]+x\w+)>", line)
        if m and m.group(1) in zeros:
            out["zero_filled"] += _tensor_bytes(m.group(2))
        m = re.search(r"custom_call @AllocateBuffer\(\).*-> tensor<([\dx]+x\w+)>", line)
        if m:
            out["uninitialised"] += _tensor_bytes(m.group(1))
    return out


def engine_hlo(pipe: int, micro: int, accum: int, *, size: str = "small-cpu", seq: int = 128,
               ckpt: int = 0, dtype: str = "bf16", stage_loop: str = "unrolled", repeats: int = 1) -> tuple[str, dict]:
    """(optimized HLO text of one step, {compile_s, peak_gib: XLA's predicted peak per device})
    on all of jax's devices (two or more: a pipeline needs a "pipe" axis)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import zerojax
    from zerojax.engine import abstract_engine
    from zerojax.memory import CompiledMemory
    from zerojax.models.gpt2 import GPT2, GPT2Config, gpt2_loss

    config = GPT2Config.named("tiny", **SMALL) if size == "small-cpu" else GPT2Config.named(size)
    ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          **({dtype: {"enabled": True}} if dtype != "f32" else {})}
    if pipe > 1:
        ds["pipeline"] = {"stages": pipe, "activation_checkpoint_interval": ckpt}
    n = jax.device_count() // pipe
    compute = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "f32": jnp.float32}[dtype]
    eng = abstract_engine(lambda: GPT2(config, rngs=nnx.Rngs(0), dtype=compute),
                          zerojax.load_config(ds, world_size=n), loss_fn=gpt2_loss,
                          options=zerojax.EngineOptions(pipeline_stage_loop=stage_loop, pipeline_repeats=repeats,
                                                        memory_guard=False))
    t0 = time.perf_counter()
    compiled = eng.compiled_step({"input_ids": jax.ShapeDtypeStruct((micro * accum * n, seq), np.int32)})
    seconds = time.perf_counter() - t0
    mem = CompiledMemory.of(compiled)
    # the same step lowered for GPU (nothing compiled): which buffers start zero-filled there
    gpu = eng.lower_step({"input_ids": jax.ShapeDtypeStruct((micro * accum * n, seq), np.int32)},
                         platforms=("cuda",)).as_text()
    return compiled.as_text(), {"compile_s": round(seconds, 1), "peak_gib": mem.peak / 2**30,
                                **{f"{k}_mib": getattr(mem, k) / 2**20 for k in ("argument", "output", "temp", "alias")},
                                **{f"gpu_{k}_mib": v / 2**20 for k, v in initial_fills(gpu).items()}}


# name -> engine_hlo arguments: the baseline, the pipeline's stage loop in its three forms
# (EngineOptions.pipeline_stage_loop: a scan, unrolled slicing each layer's weights out of the
# stage's stack every iteration (session 6), unrolled with the weights cut once (the default)),
# and with pipeline.activation_checkpoint_interval 1 (every layer a checkpointed group)
STEPS = {"zero1 mb8x2": dict(pipe=1, micro=8, accum=2),
         "pipe2 mb2x16 scan": dict(pipe=2, micro=2, accum=16, stage_loop="scan"),
         "pipe2 mb2x16 unrolled_sliced": dict(pipe=2, micro=2, accum=16, stage_loop="unrolled_sliced"),
         "pipe2 mb2x16 unrolled": dict(pipe=2, micro=2, accum=16, stage_loop="unrolled"),
         "pipe2 mb2x16 ckpt1 unrolled_sliced": dict(pipe=2, micro=2, accum=16, ckpt=1, stage_loop="unrolled_sliced"),
         "pipe2 mb2x16 ckpt1 unrolled": dict(pipe=2, micro=2, accum=16, ckpt=1),
         # the iterations' own backward pass, their residuals in jax.lax.empty buffers (no zero-fill on GPU)
         # EngineOptions.pipeline_repeats 2: circular repeats (each stage holds 2 blocks of 1 layer)
         "pipe2 mb2x16 R2": dict(pipe=2, micro=2, accum=16, repeats=2)}


def table(named: dict[str, str], n_top: int = 12, min_share: float = 0.0) -> str:
    """Per kind, MiB written per step per device in each HLO of `named`, then each one's top ops;
    kinds under `min_share` of the largest total are left out."""
    kinds = {name: bytes_by_kind(hlo) for name, hlo in named.items()}
    order = sorted({k for t in kinds.values() for k in t}, key=lambda k: -max(t.get(k, 0) for t in kinds.values()))
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    width = max([22] + [len(n) + 2 for n in named])
    lines = [f"{'MiB written / step / device':<32}" + "".join(f"{n:>{width}}" for n in named)]
    for k in order:
        floor = max(2**20 / 10, min_share * max(sum(t.values()) for t in kinds.values()))
        if max(kinds[n].get(k, 0) for n in named) >= floor:
            lines.append(f"{k[:31]:<32}" + "".join(f"{mib(kinds[n].get(k, 0)):>{width}}" for n in named))
    lines.append(f"{'total':<32}" + "".join(f"{mib(sum(kinds[n].values())):>{width}}" for n in named))
    for name, hlo in named.items():
        lines.append(f"\n{name}: MiB written per loop (trips: runs per step)")
        for comp, t in list(bytes_by_loop(hlo).items())[:6]:
            lines.append(f"  {mib(t['bytes']):>10}  x {t['trips']:<4} {comp[:80]}")
    for name, hlo in named.items():
        if n_top:
            lines.append(f"\n{name}: top ops (MiB per step = MiB x trips)")
        for w in top(hlo, n_top):
            lines.append(f"  {mib(w['bytes'] * w['trips']):>10} = {mib(w['bytes']):>8} x {w['trips']:<4}"
                         f"{w['kind']:<30}{w['shape'][:56]:<58}{w['comp'][:40]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", nargs="*", help="optimized HLO text files (default: compile the STEPS)")
    ap.add_argument("--size", default="small-cpu", help="GPT-2 size (large, xl) or small-cpu (default)")
    ap.add_argument("--seq", type=int, default=None, help="tokens a row (default 128 small-cpu, else 1024)")
    # XLA:CPU computes bf16 in f32: it wraps each in-place update of a bf16 buffer in converts of
    # the whole buffer (its artifact, absent on GPU), so the CPU default is f32
    ap.add_argument("--dtype", default=None, help="bf16, fp16 or f32 (default f32 small-cpu, else bf16)")
    ap.add_argument("--top", type=int, default=12, help="top ops listed per step")
    ap.add_argument("--json", help="write {name: {kind: bytes}} (and compile seconds) here")
    ap.add_argument("--dump", help="a folder to write the compiled steps' HLO text to")
    ap.add_argument("--only", help=f"comma-separated names of STEPS to compile (default all: {', '.join(STEPS)})")
    args = ap.parse_args(argv)
    seconds = {}
    if args.hlo:
        named = {os.path.basename(p): open(p).read() for p in args.hlo}
    else:
        if args.size == "small-cpu":
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        seq = args.seq or (128 if args.size == "small-cpu" else 1024)
        dtype = args.dtype or ("f32" if args.size == "small-cpu" else "bf16")
        named = {}
        only = args.only.split(",") if args.only else list(STEPS)
        unknown = [o for o in only if o not in STEPS]
        if unknown:
            ap.error(f"--only {unknown}: not in STEPS, which has {list(STEPS)}")
        for name in only:
            try:
                named[name], seconds[name] = engine_hlo(size=args.size, seq=seq, dtype=dtype, **STEPS[name])
                m = seconds[name]
                print(f"{name}: compiled in {m['compile_s']} s, predicted peak {m['peak_gib']:.3f} GiB per "
                      f"device (MiB: arguments {m['argument_mib']:.1f}, outputs {m['output_mib']:.1f}, "
                      f"temporaries {m['temp_mib']:.1f}, aliased {m['alias_mib']:.1f}); lowered for GPU: "
                      f"{m['gpu_zero_filled_mib']:.1f} MiB zero-filled, {m['gpu_uninitialised_mib']:.1f} MiB "
                      "uninitialised buffers", flush=True)
            except Exception as e:  # noqa: BLE001 -- report, and compare the others
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        if args.dump:
            import gzip
            os.makedirs(args.dump, exist_ok=True)
            for name, hlo in named.items():
                with gzip.open(os.path.join(args.dump, name.replace(" ", "_") + ".hlo.gz"), "wt") as f:
                    f.write(hlo)
    print(table(named, args.top))
    if args.json:
        json.dump({"size": args.size, "compile": seconds, "bytes": {n: bytes_by_kind(h) for n, h in named.items()}},
                  open(args.json, "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    main()
