"""The cases that span several GPUs, long rows or two trees (benchmarks/cases.py lists them all)."""
from __future__ import annotations

import json
import os

from benchmarks import case_steps
from benchmarks.case_types import BENCH, BEST_FLAGS, CAP24, EXAMPLE, Case, Run


def _bench2(label, out_name, *args, timeout_s):
    path = "{out}/" + out_name
    argv = (BENCH, "--steps", "6", "--warmup", "2", "--timeout", "150", *args, "--out", path)
    return Run(label, argv, timeout_s, smoke=(*argv, "--tiny"), reader="bench", records_file=path)


_LAUNCH_ARGS = ("--model", "large", "--steps", "40", "--micro-batch", "8", "--remat", "full", "--seq-len", "1024",
                "--eval-batches", "0")


def _launch_run(stage, procs):
    name = f"zero{stage}_procs{procs}"
    config = ("--config", "{out}/" + name + ".json", *_LAUNCH_ARGS)
    if procs == 1:
        return Run(name, (EXAMPLE, *config), 200)
    return Run(name, ("-m", "zerojax.cli", "launch", "--proc_per_gpu", "--master_port", str(29500 + stage),
                      EXAMPLE, *config), 200)


X2 = Case(
    "x2", "two GPUs, GPT-2 Large seq 1024 bf16: plain and ZeRO 1-3 with and without remat; TP 2 beside ZeRO-2 / 3; "
    "pipe 2 at 16 x 2 and 8 x 4 micro-batches (and checkpoint interval 18) beside ZeRO-1 on the same rows; "
    "zerojax launch (2 processes x 1 GPU) against 1 process x 2 GPUs, losses compared step by step",
    "plain jax.jit step; one process for launch", 10, gpus=2, match=("size",), headline="tokens_per_s",
    prepare=case_steps.launch_configs, post=case_steps.launch_losses,
    runs=(_bench2("zero", "x2_zero.json", "--matrix", "custom", "--stages", "plain,1,2,3", "--remat", "on,off",
                  timeout_s=1300),
          _bench2("tensor", "x2_tensor.json", "--matrix", '[{"stage": 2}, {"stage": 3}, {"stage": 0, "tp": 2}]',
                  timeout_s=500),
          _bench2("pipe", "x2_pipe.json", "--matrix", json.dumps([
              {"stage": 1, "micro": 8, "accum": 2},
              {"stage": 1, "pipe": 2, "micro": 2, "accum": 16},
              {"stage": 1, "pipe": 2, "micro": 2, "accum": 16, "ckpt": 18},
              {"stage": 1, "pipe": 2, "micro": 4, "accum": 8}]), timeout_s=650),
          *(_launch_run(stage, procs) for stage, procs in case_steps.LAUNCH_RUNS)))


def _plan(size):
    return Run(f"plan-{size}", ("-m", "zerojax.cli", "plan", "--model", size, "--devices", "4", "--search-mesh",
                                "--budget", "120GiB", "--global-batch", "64", "--top", "8",
                                "--json", "{out}/plan_" + size + ".json"), 300)


X4 = Case(
    "x4", "four GPUs: zerojax plan --search-mesh ranks every data x tensor x pipe shape for GPT-2 XL and Large, "
    "planned_matrix.py turns each layout's pick into bench.py entries (64-row global batch, no remat), "
    "bench.py measures them", "none (the planner's ranking)", 20, gpus=4, match=("size",),
    runs=(_plan("xl"), _plan("large"),
          Run("matrix", ("benchmarks/planned_matrix.py", "{out}/plan_xl.json", "{out}/plan_large.json"), 60,
              stdout_to="{out}/matrix_x4.json"),
          Run("bench", (BENCH, "--sizes", "xl", "--remat", "off", "--matrix", "{out}/matrix_x4.json", "--steps", "5",
                        "--warmup", "2", "--timeout", "240", "--out", "{out}/x4.json"), 2400,
              reader="bench", records_file="{out}/x4.json")))

# the abstract probe's compiled step is the real engine's: the real step's compile is then a cache read
_CACHE = (("JAX_COMPILATION_CACHE_DIR", "/tmp/zerojax-long-context-cache"),)
_WHOLE_CARD = (("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"), *_CACHE)
_LC = "benchmarks/long_context_bench.py"


def _long(label, bench, timeout_s, gpu_args, smoke_args, common, env, out_name):
    """A long_context_bench.py run with --deadline 10 s inside its timeout (it prints a
    {"timed_out": true, ...} row rather than being killed silently)."""
    out = ("--out", "{out}/" + out_name)
    tail = (*common, "--deadline", str(timeout_s - 10), *out)
    return Run(label, (_LC, bench, *gpu_args, *tail), timeout_s, env=env,
               smoke=(_LC, bench, "--tiny", *smoke_args, *tail))


def _longest_full(limit, timeout_s):
    # cuDNN's place is taken by XLA's dense path on the CPU (--smoke)
    return _long("longest-full", "longest-full", timeout_s, ("--attention", "cudnn", "blockwise"),
                 ("--attention", "xla", "blockwise"),
                 ("--remat", "full", "offload", "--docs", "1", "--mlp-tile", "2048", "--start", "65536", "--limit",
                  str(limit), "--real-steps", "2", "--length-timeout", "300"), _WHOLE_CARD,
                 "long-context-longest-full.json")


# timeouts: the estimates for an H100 that share one call of 550 s (their arithmetic is in
# benchmarks/long_context_bench.py's docstring and docs/long-context.md)
LONG_CONTEXT = Case(
    "long-context", "long rows: Llama-3.2-1B throughput at seq 2048 and 32768 (tiled MLP at 32K; the ratio 32K / 2K in "
    "tokens/s and in achieved TFLOP/s of the mask's kept pairs, goal >= 0.90); the longest row of Llama-3.1-8B "
    "LoRA r16 under 24 GB (goal >= 65,536); the longest row of the 8B full fine-tune with the optimizer in host memory",
    "PyTorch + PEFT longest row (gradient checkpointing, sdpa, the same cap)", 9.5,
    headline=("longest_seq", "ratio_long_over_short", "tokens_per_s_ratio", "tokens_per_s_per_device"),
    match=("bench",), runs=(_long("throughput", "throughput", 100, (), (),
                ("--seq", "2048", "32768", "--mlp-tile", "0", "2048", "--attention", "blockwise", "--docs", "4",
                 "--warmup", "1", "--steps", "4"), _WHOLE_CARD, "long-context-throughput.json"),
          _long("longest", "longest", 170, ("--attention", "cudnn", "blockwise"), ("--attention", "xla", "blockwise"),
                ("--cap-gib", "23.77", "--remat", "offload", "full", "--docs", "1", "--mlp-tile", "2048", "--start",
                 "65536", "--limit", "65536", "--real-steps", "2", "--length-timeout", "300"), (*CAP24, *_CACHE),
                "long-context-longest-zerojax.json"),
          Run("longest-torch", ("benchmarks/long_context_torch.py", "longest", "--cap-gib", "23.77", "--limit", "65536",
                                "--out", "{out}/long-context-longest-torch.json"), 70, anchor=True,
              env=(("JAX_PLATFORMS", "cpu"),),
              smoke=("benchmarks/long_context_torch.py", "longest", "--tiny", "--cap-gib", "23.77", "--limit",
                     "65536", "--out", "{out}/long-context-longest-torch.json")),
          _longest_full(65536, 210)),
    post=lambda out: long_context_comparisons(out, "long-context"))

LONG_CONTEXT_FULL = Case(
    "long-context-full", "the longest row of the Llama-3.1-8B full fine-tune on one card (fp32 master and Adam "
    "m, v in pinned host memory, ZeRO-2), up to 131,072, with a whole call's budget", "none", 9.5,
    headline=("longest_seq", "tokens_per_s_per_device"), match=("bench",), runs=(_longest_full(131072, 550),),
    post=lambda out: long_context_comparisons(out, "long-context-full"))


def _rows(out, name):
    path = os.path.join(out, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def long_context_comparisons(out: str, case: str) -> list[dict]:
    """The long row against the short one, in tokens/s and in achieved FLOP/s (the FLOPs of the
    query-key pairs the mask keeps: long_context_bench's flops_per_token), and the longest rows
    of zerojax and its anchor side by side (from the runs' records, {out}/{case}-{run}.jsonl)."""
    records = []
    tp = [r for r in _rows(out, f"{case}-throughput") if r.get("bench") == "throughput"]
    if len(tp) >= 2:
        short, long_ = min(tp, key=lambda r: r["seq"]), max(tp, key=lambda r: r["seq"])
        tokens = _ratio(long_["tokens_per_s_per_device"], short["tokens_per_s_per_device"])
        ratio = _ratio(*(r["tokens_per_s_per_device"] * r["flops_per_token"] for r in (long_, short)))
        records.append({"framework": "zerojax", "row": f"achieved FLOP/s (kept pairs) {long_['seq']} / {short['seq']}",
                        "ratio_long_over_short": ratio, "tokens_per_s_ratio": tokens, "goal": ">= 0.90",
                        "met": None if ratio is None else ratio >= 0.90})
    # the LoRA row pairs with the anchor's (bench "longest-row"); the full fine-tune has no anchor
    for run, paired in (("longest", "longest-row"), ("longest-full", "longest-full-row")):
        found = [r for r in _rows(out, f"{case}-{run}") if r.get("bench") == run]
        if found:
            r = found[-1]
            records.append({"framework": "zerojax", "row": f"{run} row", "bench": paired,
                            "longest_seq": r.get("seq"), "config": f"{r.get('remat')}/{r.get('attention')}",
                            "peak_gib": r.get("peak_gib")})
    torch = [r for r in _rows(out, f"{case}-longest-torch") if "longest_seq" in r]
    if torch:
        records.append({"framework": "torch+peft", "row": "longest row", "bench": "longest-row", "anchor": True,
                        "longest_seq": torch[-1]["longest_seq"], "peak_gib": torch[-1].get("peak_gib")})
    return records


def _ratio(a, b):
    return round(a / b, 3) if b else None


def _tree_example(label, *args, timeout_s, env=()):
    argv = (EXAMPLE, "--model", "large", "--steps", "16", "--eval-batches", "0", *args)
    return Run(label, argv, timeout_s, env=env,
               smoke=(EXAMPLE, "--model", "tiny", "--steps", "3", "--eval-batches", "0", *args))


_OFFLOAD = ("--config", "{tree}/configs/zero2_offload_optimizer.json", "--micro-batch", "8", "--remat", "full")
_BA_BENCH = (BENCH, "--matrix", "custom", "--stages", "plain,0,2,3", "--remat", "on", "--micro", "8")
BEFORE_AFTER = Case(
    "before-after", "two trees on GPT-2 Large, each run for the earlier tree (--before DIR) then this one: bench.py "
    "plain vs ZeRO 0 / 2 / 3 (full remat, micro 8), the example's fastest flags, the guide's config on 24 GB with "
    "--micro-batch auto, the 24 GB optimizer-offload row with no offload flags and with --offload-loop host",
    "the earlier tree (e.g. `git archive <commit> zerojax examples configs benchmarks | tar -x -C .before`)",
    14, needs_before=True, headline="tokens_per_s",
    runs=(Run("bench", (*_BA_BENCH, "--sizes", "large", "--steps", "6", "--warmup", "2", "--timeout", "200",
                        "--out", "{out}/before-after-{tree_name}.json"), 600,
              smoke=(*_BA_BENCH, "--tiny", "--out", "{out}/before-after-{tree_name}.json"),
              reader="bench", records_file="{out}/before-after-{tree_name}.json"),
          _tree_example("fastest-flags", *BEST_FLAGS, timeout_s=300),
          _tree_example("guide-24gb", "--config", "{tree}/configs/oom_guide_zero2_offload.json", "--micro-batch",
                        "auto", timeout_s=400, env=CAP24),
          _tree_example("offload-24gb", *_OFFLOAD, timeout_s=300, env=CAP24),
          _tree_example("offload-24gb-host", *_OFFLOAD, "--offload-loop", "host", timeout_s=300, env=CAP24)))
