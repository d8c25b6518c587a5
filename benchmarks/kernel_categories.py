"""What a profiled device kernel is doing, from its name (and, where the compiled HLO says, the code
that made it), and where a step's time goes: the sum per category, the union of the busy intervals
and the idle gaps between them. Pure functions of names and numbers (benchmarks/step_profile.py
reads the trace; tests/test_kernel_categories.py checks these on CPU).

The names are the ones a CUDA trace of an XLA program shows: cuBLAS / cuBLASLt kernels
(`sm90_xmma_gemm_...`, `nvjet_tst_...`, `cutlass3x_sm90_tensorop_...`, `ampere_bf16_s16816gemm...`),
XLA's Triton gemm fusions (`gemm_fusion_dot_12`), cuDNN's attention (`cudnn_generated_fort_native_sdpa_
sm90_flash_fprop_...`), the repository's Pallas flash kernels (`zerojax_flash_forward` / `_backward`),
XLA's own fusions (`loop_multiply_fusion`, `input_reduce_fusion`, ...), CUPTI's copies
(`MemcpyH2D`, `MemcpyD2H`, `MemcpyD2D`, `Memset`) and NCCL's (`ncclDevKernel_AllReduce_Sum_bf16_RING_LL`).
"""
from __future__ import annotations

import re

# in the order the tables print them; "idle" and "concurrent" are not kernels (step_breakdown)
CATEGORIES = ("matmul", "attention", "norm", "rope", "elementwise", "loss", "optimizer", "copies",
              "host transfer", "collective", "other")

# a kernel's own name decides first: a library kernel says what it is whoever called it
_BY_NAME = (
    ("host transfer", re.compile(r"memcpy.?(h2d|d2h|htod|dtoh)|memcpy.*(host|pinned)", re.I)),
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                              r"collective[-_]?permute", re.I)),
    # before matmul: cuDNN's and CUTLASS's attention kernels run gemms inside and some say so
    ("attention", re.compile(r"fmha|flash|sdpa|attention|_mha_", re.I)),
    # any other cuDNN kernel is one of its gemm fusions (XLA's cuDNN GEMM fusion level)
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|cudnn|s16816|s1688|wgmma|hmma|tensorop|matmul|"
                          r"(^|[_.])dot([_.]|$)|dot_general|convolution", re.I)),
)
# then the code the kernel's HLO instruction came from (its op_name, function and file): a fusion's
# name says only its root op, the code says whether it was the loss, the update or a norm
_BY_CODE = (
    ("loss", {"loss", "entropy", "nll", "log_softmax", "logsumexp", "softmax_cross_entropy", "mean_over_tokens",
              "shifted_labels"}),
    ("optimizer", {"optax", "optim", "adam", "adamw", "optimizer", "optimizer_update", "global_norm", "master",
                   "apply_updates", "clip_by_global_norm", "compute_params"}),
    ("rope", {"rope", "rotary", "rotate", "rope_frequencies"}),
    ("norm", {"norm", "rms_norm", "rmsnorm", "layer_norm", "layernorm", "normalization"}),
)
# last, XLA's own kernels by name: copies, then any other fusion is elementwise work
_COPIES = re.compile(r"memcpy|memset|(^|[_.])copy|dynamic[-_]update[-_]slice|dynamic[-_]slice|concatenate", re.I)
_XLA_FUSION = re.compile(r"fusion|^(loop|input|wrapped|reduce|transpose|convert|broadcast|select|add|multiply|"
                         r"subtract|divide|exponential|negate|iota|slice|pad|scatter|gather)[_.]", re.I)


def _words(text: str) -> set[str]:
    """The lower-case words of a name or a path, and the snake_case runs of two and three words
    ("global_norm", "rms_norm"): `_normal` is not "norm", `_global_norm` is."""
    parts = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", text).lower()) if w]
    runs = {"_".join(parts[i:i + n]) for n in (2, 3) for i in range(len(parts) - n + 1)}
    return set(parts) | runs | {text.lower()}


def categorize(name: str, code: str = "") -> str:
    """The category of one kernel (CATEGORIES): `name` its name in the trace, `code` what the compiled
    HLO says of the instruction it ran (op_name, function, file; empty where unknown)."""
    for category, pattern in _BY_NAME:
        if pattern.search(name):
            return category
    words = _words(code)
    for category, keys in _BY_CODE:
        if words & keys:
            return category
    if _COPIES.search(name):
        return "copies"
    if _XLA_FUSION.search(name) or code:
        return "elementwise"
    return "other"


def merged(intervals) -> list[tuple[int, int]]:
    """[(start, end)] sorted and merged where they overlap or touch; empty ones dropped."""
    out: list[list[int]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def union_length(intervals) -> int:
    """The time covered by at least one interval."""
    return sum(e - s for s, e in merged(intervals))


def step_breakdown(kernels, steps: int) -> dict:
    """Where `steps` profiled steps' time went, per step. kernels: [(category, start_ns, end_ns)].

    span: the first kernel's start to the last one's end; busy: the union of the kernels that are
    not host transfers (the compute / copy engines of the card: a transfer runs beside them);
    idle: span - busy, the gaps with no compute kernel (launch, host work, waiting on a transfer);
    per category: its kernels' summed time. concurrent: what the sum counts twice (kernels on
    several streams at once, transfers beside compute or inside its gaps), so that
    sum(categories) + idle - concurrent = span. All in ns per step."""
    if not kernels:
        return {"span": 0.0, "busy": 0.0, "idle": 0.0, "concurrent": 0.0, "categories": {}}
    per = max(steps, 1)
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = union_length((s, e) for c, s, e in kernels if c != "host transfer")
    sums: dict[str, float] = {}
    for category, start, end in kernels:
        sums[category] = sums.get(category, 0) + (end - start)
    total = sum(sums.values())
    return {"span": span / per, "busy": busy / per, "idle": (span - busy) / per,
            "concurrent": (total - busy) / per, "categories": {c: v / per for c, v in sums.items()}}
