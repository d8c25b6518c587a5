"""Where a training step's time goes, read by kernel: a headline step built by the trainer from the
flags its case runs (benchmarks/cases.py), warmed up, timed, then a few steps under
`jax.profiler.trace` with every device kernel put in a category (benchmarks/kernel_categories.py).

    python benchmarks/step_profile.py gpt2-large       # GPT-2 Large, the example's fastest flags (speed)
    python benchmarks/step_profile.py llama-1b         # Llama-3.2-1B seq 2048, micro 4, full remat (models)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.30 python benchmarks/step_profile.py llama8b-lora    # 24 GB of an H100
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.30 python benchmarks/step_profile.py llama8b-qlora   # (llama8b-24gb)
    python benchmarks/step_profile.py llama-1b --tiny  # CPU smoke test: tiny-llama, the whole path

Prints one table per step: category, ms a step, share of the profiled step (first kernel to last,
over the profiled steps), the matmul's attained TFLOP/s against the matmul ceiling (the model's
matmul FLOPs: 6N, 4N with a frozen LoRA base, without the attention's 12 L w T, which runs in the
attention kernels, and without remat's recomputed forward), idle (no compute kernel running) and
what the sum counts twice; then the top kernels by time; then a `STEP_PROFILE {json}` line for the
suite's runner. The step's optimized HLO is dumped (XLA_FLAGS, a temporary folder) so that each
fusion's code (its op_name, function and file) can tell the loss, the optimizer update, norms and
rope apart from other elementwise fusions.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from benchmarks.case_types import BEST_FLAGS  # noqa: E402

_LLAMA8B = ("--model", "llama-3.1-8b", "--seq-len", "2048", "--lora", "16", "--lora-alpha", "32")
# the headline steps, each with the flags its case gives the trainer (speed's example-best,
# models' llama-zerojax-full, llama8b-24gb's lora-r16 and qlora-nf4)
STEPS = {
    "gpt2-large": ("--model", "large", *BEST_FLAGS),
    "llama-1b": ("--model", "llama-3.2-1b", "--seq-len", "2048", "--micro-batch", "4", "--remat", "full",
                 "--loss-chunk", "256"),
    "llama8b-lora": (*_LLAMA8B, "--micro-batch", "auto"),
    "llama8b-qlora": (*_LLAMA8B, "--quantize", "nf4", "--micro-batch", "2", "--remat", "full"),
}
# --tiny: the same flags on a test shape, short rows, two rows a micro-batch
_TINY = {"--model": lambda v: "tiny" if v == "large" else "tiny-llama", "--seq-len": lambda v: "64",
         "--micro-batch": lambda v: "2", "--loss-chunk": lambda v: "32"}


def trainer_flags(step: str, tiny: bool, total_steps: int) -> list[str]:
    """The trainer's command line for a headline step, run for total_steps with no evaluation."""
    flags = list(STEPS[step])
    if tiny:
        flags = [(_TINY[flags[i - 1]](f) if i and flags[i - 1] in _TINY else f) for i, f in enumerate(flags)]
        if "--seq-len" not in flags:
            flags += ["--seq-len", "64"]
    return [*flags, "--steps", str(total_steps), "--eval-batches", "0"]


def build(step: str, tiny: bool, total_steps: int):
    """The trainer with its engine built (the same path as `zerojax train`), nothing trained yet."""
    from zerojax.trainer.flags import parse_args
    from zerojax.trainer.trainer import Trainer

    trainer = Trainer(parse_args(trainer_flags(step, tiny, total_steps)))
    trainer.resolve()
    trainer.build()
    return trainer


def run_steps(trainer, batches, n: int) -> float:
    """n training steps, waited for: their wall seconds."""
    import jax

    t0 = time.perf_counter()
    for _ in range(n):
        trainer.train_step(next(batches))
    trainer.engine.synchronize()
    jax.block_until_ready(trainer.engine.state)
    return time.perf_counter() - t0


def matmul_flops_per_step(trainer) -> float:
    """One device's model matmul FLOPs a step: the trainer's FLOPs a token (6N, 4N for LoRA, plus
    the attention's 12 L w T) less the attention's, times the step's tokens a device."""
    import jax
    from flax import nnx

    from zerojax.model import model_dims

    dims = model_dims(nnx.eval_shape(lambda: trainer.choice.build(trainer.seed, trainer.dtype, trainer.remat)))
    attention = 12.0 * dims.layers * (dims.heads * dims.head_dim or dims.d_model) * trainer.seq_len
    tokens = trainer.cfg.train_batch_size * trainer.row_tokens / jax.device_count()
    return (trainer.flops_per_token - attention) * tokens


def categorized(trace_dir: str, dump_dir: str, tiny: bool) -> list[tuple[str, object, str]]:
    """[(category, kernel, its code)] of the profiled steps, the code read from the HLO dump."""
    from kernel_categories import categorize
    from trace_kernels import code_of, hlo_code, kernels, xplane_file

    table = hlo_code(dump_dir)
    coded = [(k, code_of(k, table)) for k in kernels(xplane_file(trace_dir), tiny)]
    return [(categorize(k.name, code), k, code) for k, code in coded]


def top_kernels(labelled, steps: int, top: int) -> list[tuple[float, float, str, str]]:
    """[(ms a step, launches a step, category, name)] of the kernels with the most time."""
    sums: dict[tuple[str, str], list[float]] = {}
    for category, k, _ in labelled:
        row = sums.setdefault((category, k.name), [0.0, 0])
        row[0] += (k.end_ns - k.start_ns) / 1e6 / steps
        row[1] += 1 / steps
    rows = [(ms, n, c, name) for (c, name), (ms, n) in sums.items()]
    return sorted(rows, key=lambda r: -r[0])[:top]


def matmul_rate(matmul_ms: float, flops: float, ceiling: float | None) -> dict:
    """The matmul kernels' attained TFLOP/s and its share of the ceiling (None where not known)."""
    tflops = flops / (matmul_ms / 1e3) / 1e12 if matmul_ms > 0 else None
    share = tflops / ceiling if tflops and ceiling else None
    return {"matmul_tflops": None if tflops is None else round(tflops, 1), "ceiling_tflops": ceiling,
            "matmul_of_ceiling": None if share is None else round(share, 3)}


def print_table(record: dict, top: list) -> None:
    """The step's table: a row a category (ms, share), idle and the double count, then the top kernels."""
    span = record["profiled_step_ms"] or 1.0
    print(f"\n== {record['step']}: {record['model']}, {record['device']}; {record['step_ms']:.1f} ms a step timed "
          f"({record['timed_steps']} steps), {span:.1f} ms profiled ({record['profiled_steps']} steps, first "
          f"kernel to last); {record['kernels_with_code']} of {record['kernels']} kernels matched to their HLO code")
    print(f"{'category':<28} {'ms/step':>9} {'share':>7}")
    ms = record["ms"]
    for category in [c for c in ms if c not in ("idle", "concurrent")]:
        extra = ""
        if category == "matmul" and record["matmul_tflops"] is not None:
            extra = f"  {record['matmul_tflops']:.0f} TFLOP/s" + (
                f" of {record['ceiling_tflops']:.0f} ceiling ({100 * record['matmul_of_ceiling']:.0f}%)"
                if record["matmul_of_ceiling"] is not None else " (no ceiling measured)")
        print(f"{category:<28} {ms[category]:9.2f} {100 * ms[category] / span:6.1f}%{extra}")
    print(f"{'idle (no compute kernel)':<28} {ms['idle']:9.2f} {100 * ms['idle'] / span:6.1f}%")
    print(f"{'counted twice (concurrent)':<28} {-ms['concurrent']:9.2f} {-100 * ms['concurrent'] / span:6.1f}%")
    print(f"top {len(top)} kernels:  ms/step  launches/step  category  name")
    for k_ms, n, category, name in top:
        print(f"  {k_ms:9.3f} {n:8.1f}  {category:<13} {name[:100]}")


def profile_record(args, trainer, labelled, timed_s: float) -> dict:
    """The step's figures: timed ms, the breakdown a step in ms, the matmul's rate."""
    import jax
    from kernel_categories import CATEGORIES, step_breakdown

    b = step_breakdown([(c, k.start_ns, k.end_ns) for c, k, _ in labelled], args.profile_steps)
    present = [c for c in CATEGORIES if c in b["categories"]]
    ms = {c: round(b["categories"][c] / 1e6, 3) for c in present}
    ms.update(idle=round(b["idle"] / 1e6, 3), concurrent=round(b["concurrent"] / 1e6, 3))
    tokens = trainer.cfg.train_batch_size * trainer.row_tokens / jax.device_count()
    step_ms = 1e3 * timed_s / args.steps
    ceiling = args.peak_tflops or getattr(trainer, "peak", None)
    cfg = trainer.cfg
    return {"step": args.step, "model": trainer.size, "device": jax.devices()[0].device_kind,
            "seq_len": trainer.seq_len, "micro": cfg.train_micro_batch_size_per_gpu,
            "grad_accum": cfg.gradient_accumulation_steps, "remat": trainer.remat, "timed_steps": args.steps,
            "profiled_steps": args.profile_steps, "step_ms": round(step_ms, 2),
            "tokens_per_s": round(tokens / step_ms * 1e3), "profiled_step_ms": round(b["span"] / 1e6, 3),
            "ms": ms, **matmul_rate(ms.get("matmul", 0.0), matmul_flops_per_step(trainer), ceiling),
            "kernels": len(labelled), "kernels_with_code": sum(bool(code) for _, _, code in labelled)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step", choices=STEPS)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (the first compiles)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler")
    p.add_argument("--top", type=int, default=15, help="kernels listed by time")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the matmul ceiling (default: measured by the trainer before building, on a GPU)")
    p.add_argument("--trace-dir", default="", help="keep the trace here (default: a temporary folder)")
    p.add_argument("--tiny", action="store_true", help="a test shape on CPU: does the whole path run?")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dump_dir = tempfile.mkdtemp(prefix="step_profile_hlo_")
    from trace_kernels import dump_flags

    # before JAX starts its backend: XLA reads its flags once
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump_dir)}".strip()
    import jax

    trainer = build(args.step, args.tiny, args.warmup + args.steps + args.profile_steps)
    batches = iter(trainer.batches())
    run_steps(trainer, batches, args.warmup)
    timed_s = run_steps(trainer, batches, args.steps)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="step_profile_trace_")
    with jax.profiler.trace(trace_dir):
        run_steps(trainer, batches, args.profile_steps)
    labelled = categorized(trace_dir, dump_dir, args.tiny)
    record = profile_record(args, trainer, labelled, timed_s)
    print_table(record, top_kernels(labelled, args.profile_steps, args.top))
    print("STEP_PROFILE " + json.dumps(record), flush=True)
    trainer.close()
    # the dumps of an 8B step and its planner's candidates are large; a trace asked for is kept
    shutil.rmtree(dump_dir, ignore_errors=True)
    if not args.trace_dir:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
