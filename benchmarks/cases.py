"""The benchmark suite's named cases: `python -m benchmarks` lists them, `python -m benchmarks CASE ...`
runs them (benchmarks/README.md). Each case is one study that used to be its own shell script: the
same commands, timeouts and memory caps, zerojax's runs and its anchor's back to back."""
from __future__ import annotations

import json

from benchmarks import case_steps
from benchmarks.case_types import BENCH, BEST_FLAGS, CAP24, Case, Run
from benchmarks.cases_scale import BEFORE_AFTER, LONG_CONTEXT, LONG_CONTEXT_FULL, X2, X4

EXAMPLE = ("examples/gpt2_large.py", "--eval-batches", "0")


def bench(label, out_name, *args, timeout_s=180, smoke=True, anchor=False, env=()):
    """A bench.py run (each matrix entry in its own process; its plain `jax.jit` entries are the
    anchor rows); its records are read from its --out report."""
    path = "{out}/" + out_name
    argv = (BENCH, *args, "--out", path)
    return Run(label, argv, timeout_s, smoke=(*argv, "--tiny") if smoke else None, reader="bench",
               records_file=path, anchor=anchor, env=env)


def example(label, *args, timeout_s, env=(), smoke=None, host_rss=False):
    """One run of examples/gpt2_large.py; its SUMMARY line is the record."""
    return Run(label, (*EXAMPLE, *args), timeout_s, env=env, smoke=smoke, host_rss=host_rss)


def pair(name, zerojax, zerojax_s, anchor, anchor_s):
    """zerojax's program and its anchor's, each with its --tiny smoke mode."""
    return (Run(name, (zerojax,), zerojax_s, smoke=(zerojax, "--tiny")),
            Run(f"{name}-anchor", (anchor,), anchor_s, smoke=(anchor, "--tiny"), anchor=True))


def _speed_matrix():
    zero_init = {"env": {"XLA_FLAGS": "--xla_gpu_enable_dus_accumulator_zero_init_elimination=true"},
                 "label": "zero-init"}
    best = {"stage": 2, "loss_chunk": 256, "options": {"adam_mu_dtype": "bfloat16", "split_master": "on"}}
    return json.dumps([
        {"stage": "plain", "remat": True, **zero_init},
        {"stage": 2, "remat": True},
        {"stage": 2, "remat": True, "options": {"split_master": "on"}},
        {**best, "remat": "dots"},
        {**best, "remat": "save_attention_block", "micro": 12},
        {**best, "remat": "save_attention", "micro": 16}])


SPEED = Case(
    "speed", "GPT-2 Large seq 1024 bf16 ZeRO-2: default remat, split master, the fastest remat / fused-loss "
    "rows; then the best row through the example (40 steps)", "plain jax.jit step", 6, headline="tokens_per_s",
    match=("size",),
    runs=(bench("matrix", "speed.json", "--steps", "6", "--warmup", "2", "--timeout", "180",
                "--matrix", _speed_matrix(), timeout_s=1500),
          example("example-best", *BEST_FLAGS, "--steps", "40", timeout_s=300)))

_OFFLOAD_BENCH = ("--matrix", "custom", "--sizes", "large", "--remat", "on", "--micro", "8", "--mem-fraction",
                  "{cap24}", "--steps", "5", "--warmup", "2", "--timeout", "150")
OFFLOAD_24GB = Case(
    "offload-24gb", "GPT-2 Large / XL under a 24 GB cap: the guide's config with --micro-batch auto, "
    "optimizer offload with each --offload-loop, XL with --micro-batch auto, bench.py's offload rows",
    "none (the 24 GB rows against each other)", 10, match=("size",),
    runs=(example("guide", "--config", "configs/oom_guide_zero2_offload.json", "--micro-batch", "auto",
                  "--steps", "20", timeout_s=180, env=CAP24),
          *(example(f"offload{label}", "--config", "configs/zero2_offload_optimizer.json", "--micro-batch", "8",
                    "--remat", "full", "--steps", "40", *flags, timeout_s=150, env=CAP24)
            for label, flags in (("-in_place", ("--offload-loop", "in_place")), ("-auto", ()),
                                 ("-host-mu16", ("--offload-loop", "host", "--adam-mu-dtype", "bfloat16")))),
          *(example(f"xl{label}", "--model", "xl", "--micro-batch", "auto", "--loss-chunk", "256", "--steps", "12",
                    *flags, timeout_s=280, env=CAP24)
            for label, flags in (("", ()), ("-master-split", ("--master-split",)))),
          bench("bench-offload-optimizer", "offload_optimizer.json", *_OFFLOAD_BENCH, "--stages", "2,3",
                "--offload", "optimizer,optimizer:0.25", timeout_s=900, smoke=False),
          bench("bench-offload-param", "offload_param.json", *_OFFLOAD_BENCH, "--stages", "3",
                "--offload", "param:0,param", timeout_s=600, smoke=False)))

_NVME_SMALL = ("benchmarks/nvme_gpt.py", "--n-embd", "256", "--n-layer", "4", "--n-head", "4", "--micro", "1",
               "--accum", "2", "--seq", "128", "--offload", "nvme", "--param", "--host-layers", "2",
               "--nvme-path", "{nvme}", "--steps", "1", "--warmup", "1", "--json", "{out}/nvme_gpt_small.json")
NVME = Case(
    "nvme", "NVMe offload on a 24 GB cap: the disk through the swapper's I/O path, then a 7.46B GPT "
    "(d 4096 x 36, ZeRO-3, optimizer state 12 layers in host memory, the rest on NVMe); --smoke: a "
    "small GPT through the whole path", "none (disk bandwidth: nvme_io.py's buffered / O_DIRECT rows)", 9,
    headline="tokens_per_s",
    runs=(Run("disk", ("benchmarks/nvme_io.py", "--path", "{nvme}", "--mib", "64", "--total-mib", "2048",
                       "--buffer-count", "2", "4", "--no-tensorstore", "--json", "{out}/nvme_io.json"), 100, env=CAP24),
          Run("gpt-7.46b", ("benchmarks/nvme_gpt.py", "--n-embd", "4096", "--n-layer", "36", "--n-head", "32",
                            "--micro", "8", "--accum", "16", "--offload", "nvme", "--param", "--buffer-count", "2",
                            "--host-layers", "12", "--nvme-path", "{nvme}", "--steps", "0", "--warmup", "1",
                            "--json", "{out}/nvme_gpt.json"), 420,
              # XLA's pinned host pool grows by doubling and never shrinks: capped near what it needs
              env=(*CAP24, ("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "65"))),
          Run("gpt-small", _NVME_SMALL, 60, smoke=_NVME_SMALL, env=CAP24)))


def _models_run(label, *args):
    argv = ("benchmarks/models_bench.py", *args, "--peak-tflops", "{peak_tflops}")
    plain = "plain" in args
    return Run(label, (*argv, "--steps", "8"), 300, smoke=(*argv, "--tiny", "--steps", "2"), anchor=plain,
               tag=(("framework", "jax.jit"),) if plain else ())


_LLAMA = ("--model", "llama-3.2-1b", "--micro", "4", "--seq", "2048")
_LIST = ("--model", "qwen3-0.6b-list", "--micro", "4", "--seq", "1024")
MODELS = Case(
    "models", "Qwen3-0.6B's shape as a list of 28 blocks (the model contract alone) and Llama-3.2-1B seq 2048: "
    "build time, zerojax beside a bare jax.jit step at the same remat, zerojax 'full' / 'dots'",
    "plain jax.jit step (the model's own remat)", 8, headline="tokens_per_s_per_device", match=("model", "remat"),
    runs=(_models_run("list-plain", *_LIST, "--mode", "plain"),
          _models_run("list-zerojax", *_LIST, "--mode", "zerojax"),
          _models_run("list-remat", *_LIST, "--mode", "zerojax", "--remat", "full"),
          _models_run("llama-plain-full", *_LLAMA, "--mode", "plain", "--remat", "full"),
          _models_run("llama-zerojax-full", *_LLAMA, "--mode", "zerojax", "--remat", "full"),
          _models_run("llama-plain", *_LLAMA, "--mode", "plain"),
          _models_run("llama-zerojax", *_LLAMA, "--mode", "zerojax"),
          _models_run("llama-dots", *_LLAMA, "--mode", "zerojax", "--remat", "dots")))


def _llama8b_run(label, *args):
    return example(label, "--model", "llama-3.1-8b", "--seq-len", "2048", "--steps", "8", *args, timeout_s=420,
                   env=CAP24, smoke=(*EXAMPLE, "--model", "tiny-llama", "--seq-len", "64", "--steps", "3", *args),
                   host_rss=True)


LLAMA8B_24GB = Case(
    "llama8b-24gb", "Llama-3.1-8B's shape seq 2048 under a 24 GB cap through the example: LoRA r16 bf16 base "
    "(--micro-batch auto), QLoRA nf4 micro 2, the full fine-tune with parameters and optimizer offloaded; "
    "host peak RSS under GNU time", "none (the three against each other)", 15, match=("lora",),
    runs=(_llama8b_run("lora-r16", "--lora", "16", "--lora-alpha", "32", "--micro-batch", "auto"),
          _llama8b_run("qlora-nf4", "--lora", "16", "--lora-alpha", "32", "--quantize", "nf4", "--micro-batch", "2",
                       "--remat", "full"),
          # accumulation 1 (an fp32 accumulator for 8B would not fit 128 GB of host memory); lr 3e-5 (at
          # 3e-4 the random-init model's loss rises after a few steps)
          _llama8b_run("full-offload", "--config", "configs/zero3_offload_param_optimizer.json", "--micro-batch",
                       "auto", "--grad-accum", "1", "--remat", "full", "--adam-mu-dtype", "bfloat16", "--master-split",
                       "--lr", "3e-5")))

# the 8B decode program compiled from shapes (nothing allocated): XLA's bytes an iteration and the
# kernels that only move data
DECODE_HLO_RUN = Run("decode-hlo", ("benchmarks/decode_hlo_report.py",), 60,
                     smoke=("benchmarks/decode_hlo_report.py", "--tiny"))
DECODE_HLO = Case(
    "decode-hlo", "one decode iteration of Llama-3.1-8B bf16 batch 1 compiled from shapes (nothing allocated): "
    "XLA's bytes accessed and the instructions that only move data", "none (the bytes the iteration must read: "
    "must_read_one_layer_iteration, in the record)", 1, headline="bytes_accessed_one_layer_iteration",
    runs=(DECODE_HLO_RUN,))

GENERATE = Case(
    "generate", "generation on random-init Llama-3.1-8B bf16 (batch 1 x 128 + 256 and its HBM-bound share; "
    "64 x 512 + 512) and a Llama-3.2-1B engine that trains, generates and trains again; XLA's bytes a "
    "decode step", "transformers generate (sdpa, static cache, bf16, greedy)", 8,
    headline="decode_tokens_per_s", match=("case", "model"),
    runs=(*pair("generate", "benchmarks/generate_bench.py", 270, "benchmarks/hf_generate_bench.py", 200),
          DECODE_HLO_RUN))

RL = Case(
    "rl", "GRPO, ZeRO-2 bf16 full fine-tune, frozen reference, on random-init Qwen2.5-0.5B and Llama-3.2-1B "
    "shapes, group 8 x 8 prompts of 256 + 256 sampled tokens: samples/s, generation / training split",
    "PyTorch + transformers (generate with sdpa, the same loss, AdamW bf16)", 8, headline="samples_per_s",
    runs=pair("rl", "benchmarks/rl_bench.py", 270, "benchmarks/rl_bench_torch.py", 190))


def _decode_run(label, shape, attention, timeout_s=100, flags="", lean=True, anchor=False):
    argv = ("benchmarks/decode_profile.py", shape, "--decode-attention", attention, *(("--lean",) if lean else ()))
    buffers = (("command_buffer", label.split("-")[0]),) if flags else ()
    env = (("XLA_FLAGS", "{XLA_FLAGS} --xla_gpu_enable_command_buffer=" + flags),) if flags else ()
    return Run(label, argv, timeout_s, smoke=(*argv, "--tiny"), env=env, tag=buffers, anchor=anchor)


# XLA's command buffers (CUDA graphs): "body" adds the cuBLAS gemms on slices of the stacked weights
# (without DYNAMIC_SLICE_FUSION each gemm ends a graph), "while" the decode loop itself (XLA's
# default leaves WHILE out: each token's ~15 kernels a layer launched one by one)
_BODY = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,DYNAMIC_SLICE_FUSION"
DECODE_ATTENTION = Case(
    "decode-attention", "the decode step's attention, generate's fused kernel against XLA's products: "
    "Llama-3.2-1B batch 64 (profiled, its kernel table) and Llama-3.1-8B batch 1, then 1b64 with XLA's "
    "command buffers over the step's body and over the while loop", "XLA's attention (the same step)", 6,
    headline="decode_tokens_per_s", match=("shape", "command_buffer"),
    runs=(_decode_run("1b64-kernel-profiled", "1b64", "kernel", timeout_s=170, lean=False),
          _decode_run("1b64-xla", "1b64", "xla", anchor=True),
          _decode_run("8b1-kernel", "8b1", "kernel"),
          _decode_run("8b1-xla", "8b1", "xla", anchor=True),
          _decode_run("body-kernel", "1b64", "kernel", flags=_BODY),
          _decode_run("body-xla", "1b64", "xla", flags=_BODY, anchor=True),
          _decode_run("while-kernel", "1b64", "kernel", flags=_BODY + ",WHILE,CONDITIONAL"),
          _decode_run("while-xla", "1b64", "xla", flags=_BODY + ",WHILE,CONDITIONAL", anchor=True)))


def _grpo_1b(label, *flags):
    argv = ("benchmarks/rl_bench.py", "--model", "llama-3.2-1b", *flags)
    return Run(label, argv, 140, smoke=(*argv, "--tiny"))


DECODE_ATTENTION_RL = Case(
    "decode-attention-rl", "GRPO on the Llama-3.2-1B shape with the decode kernel, then one change at a time: "
    "whole rows in the log-prob passes (no shared prompt pass), XLA's attention, no remat",
    "PyTorch + transformers, the same loop", 9, headline="samples_per_s",
    runs=(_grpo_1b("kernel", "--decode-attention", "kernel"),
          _grpo_1b("whole-rows", "--decode-attention", "kernel", "--whole-rows"),
          _grpo_1b("xla-attention", "--decode-attention", "xla"),
          _grpo_1b("remat-none", "--decode-attention", "kernel", "--remat", "none"),
          Run("torch", ("benchmarks/rl_bench_torch.py", "--model", "llama-3.2-1b"), 150,
              smoke=("benchmarks/rl_bench_torch.py", "--model", "llama-3.2-1b", "--tiny"), anchor=True)))

_TRAIN = ("-m", "zerojax.cli", "train", "--eval-batches", "0")
_RL8B = ("--lora", "16", "--lora-alpha", "32", "--remat", "full", "--method", "grpo", "--data", "arithmetic",
         "--method-option", "group=8", "--summary-json", "{out}/rl-8b-lora-summary.json")
RL_8B_LORA_24GB = Case(
    "rl-8b-lora-24gb", "zerojax train --method grpo on Llama-3.1-8B's shape, LoRA r16 bf16 base, 24 GB cap: "
    "the arithmetic task, group 8 x 4 prompts, 256 new tokens, micro 4 x 8, full remat: samples/s, split, peak",
    "none (PyTorch + PEFT GRPO at 8B does not fit 24 GB)", 8, headline="samples_per_s",
    runs=(Run("grpo", (*_TRAIN, "--model", "llama-3.1-8b", "--seq-len", "262", "--steps", "5", "--micro-batch", "4",
                       "--grad-accum", "8", *_RL8B, "--method-option", "max_new_tokens=256"), 480, env=CAP24,
              smoke=(*_TRAIN, "--model", "tiny-llama", "--seq-len", "24", "--steps", "4", "--micro-batch", "2",
                     "--grad-accum", "4", *_RL8B, "--method-option", "max_new_tokens=8"),
              reader="summary", records_file="{out}/rl-8b-lora-summary.json"),))

_DPO = ("--lora", "16", "--lora-alpha", "32", "--method", "dpo", "--remat", "full",
        "--summary-json", "{out}/dpo-8b-lora-summary.json")
_DPO_TORCH = ("benchmarks/dpo_bench_torch.py",)
DPO_8B_LORA_24GB = Case(
    "dpo-8b-lora-24gb", "LoRA r16 DPO on Llama-3.1-8B's shape under a 24 GB cap: 8 pairs a step (micro 1 x 8) "
    "of 2048-token rows (1024 prompt + 1024 completion, no padding), reference = adapters off, full remat; "
    "tokens/s = pairs x 2 rows x 2048 a second on both", "PyTorch + PEFT (sdpa, gradient checkpointing, "
    "disable_adapter() reference, the same sigmoid loss)", 10, match=("seq_len",),
    prepare=case_steps.dpo_pairs,
    runs=(Run("zerojax", (*_TRAIN, "--model", "llama-3.1-8b", "--data", "{out}/dpo-pairs-2048.jsonl", "--seq-len",
                          "2048", "--micro-batch", "1", "--grad-accum", "8", "--steps", "6", *_DPO), 330, env=CAP24,
              smoke=(*_TRAIN, "--model", "tiny-llama", "--data", "{out}/dpo-pairs-64.jsonl", "--seq-len", "64",
                     "--micro-batch", "2", "--grad-accum", "2", "--steps", "4", *_DPO),
              reader="summary", records_file="{out}/dpo-8b-lora-summary.json"),
          # the anchor caps torch itself (--cap-24gb: torch.cuda.set_per_process_memory_fraction, the same
          # 23.77 GiB); one warm-up step, so STEPS - 1 steps measured on both sides
          Run("torch", (*_DPO_TORCH, "--model", "llama-3.1-8b", "--cap-24gb", "--seq-len", "2048", "--pairs", "8",
                        "--micro", "1", "--steps", "5"), 210, anchor=True, env=(("JAX_PLATFORMS", "cpu"),),
              smoke=(*_DPO_TORCH, "--tiny", "--seq-len", "64", "--pairs", "4", "--micro", "2", "--steps", "3"))))

_REWARD = ("--method", "reward", "--method-option", "pad_token_id=0", "--data", "{out}/reward-pairs.jsonl",
           "--lr", "5e-5", "--micro-batch", "8", "--summary-json", "{out}/reward-1b-summary.json")
REWARD_1B = Case(
    "reward-1b", "a reward model (DeepSpeed-Chat's step 2) on Llama-3.2-1B's shape, full fine-tune, bf16, ZeRO-2, "
    "on a toy preference set it learns in a few dozen steps: tokens/s, first / last loss and accuracy",
    "none", 4, runs=(Run("reward", (*_TRAIN, "--model", "llama-3.2-1b", "--seq-len", "1024", "--steps", "40",
                                    *_REWARD), 300,
                         smoke=(*_TRAIN, "--model", "tiny-llama", "--seq-len", "64", "--steps", "12", *_REWARD),
                         reader="summary", records_file="{out}/reward-1b-summary.json"),),
    prepare=case_steps.reward_pairs)

SERVE = Case(
    "serve", "zerojax serve behind its HTTP server on random-init Llama-3.1-8B bf16 at concurrency 1, 16, 64, 256 "
    "(chat-like lengths) and 64 with 3K-token prompts mixed in", "transformers continuous batching "
    "(paged attention), the same requests", 10, headline="output_tokens_per_s",
    match=("concurrency", "long_prompt_share"),
    runs=pair("serve", "benchmarks/serve_bench.py", 360, "benchmarks/serve_bench_hf.py", 230))

_CURVE = ("benchmarks/rl_curve.py", "--out", "{out}")
RL_CURVE = Case(
    "rl-curve", "GRPO's reward curve on the word-problems task from a pretrained Qwen2.5-0.5B / Llama-3.2-1B "
    "folder (--hf-checkpoint DIR): 200 steps of 16 prompts x 8 completions, up to 256 new tokens, full fine-tune "
    "ZeRO-2 bf16, lr 1e-6, no KL; reward/mean a step in the csv_monitor's CSV and TensorBoard, a PNG, the wall "
    "time", "none (the curve's own first steps)", 20, headline=("reward_last10", "wall_s"), match=("task",),
    runs=(Run("curve", (*_CURVE, "--hf-checkpoint", "{hf_checkpoint}"), 1500, smoke=(*_CURVE, "--tiny")),))


def _rl_generator(generator, anchor=False):
    argv = ("benchmarks/rl_bench.py", "--model", "llama-3.2-1b", "--new", "1024", "--stop-every", "256", "--steps", "3",
            "--generator", generator)
    return Run(generator, argv, 280, anchor=anchor, tag=(("generator", generator),),
               smoke=("benchmarks/rl_bench.py", "--tiny", "--new", "8", "--stop-every", "4", "--steps", "1",
                      "--generator", generator))


RL_SERVING = Case(
    "rl-serving", "GRPO rollouts where completions end at different lengths (random-init Llama-3.2-1B, group 8 x 8 "
    "prompts of 256 tokens, up to 1,024 new, every 256th token id a stop): the serving engine's continuous "
    "batching over the live weights (generator=serving)", "zerojax.generate (each batch decoded to its longest "
    "row's end), the same run", 9, headline="samples_per_s",
    runs=(_rl_generator("generate", anchor=True), _rl_generator("serving")))

def _moe_run(name, rows, timeout_s):
    """moe_bench.py's `rows` (comma-separated) as one run, each row cut at a share of the run's time."""
    out = f"{{out}}/moe-{name}.json"
    argv = ("benchmarks/moe_bench.py", "--rows", rows, "--out", out)
    return Run(name, (*argv, "--row-timeout", str(timeout_s // len(rows.split(",")))), timeout_s,
               smoke=(*argv, "--toy"), reader="moe", records_file=out)


MOE = Case(
    "moe", "MoE models: OLMoE-1B-7B's shape full fine-tune (8 of 16 layers) and Qwen3-30B-A3B QLoRA nf4 r16 "
    "under a 24 GB budget (the adapters' master and moments in host memory), then OLMoE-1B-7B's decode at "
    "batch 1 and 64; one process per row",
    "transformers (+ PEFT), the same batch and tokens; its generate (static cache)", 10,
    match=("kind",), runs=(_moe_run("train", "ft-zerojax,ft-transformers,qlora-zerojax,qlora-zerojax-attention,"
                                             "qlora-transformers", 590),
                           _moe_run("decode", "decode-zerojax,decode-transformers", 300)))


def _profile_run(step, timeout_s, env=()):
    argv = ("benchmarks/step_profile.py", step)
    return Run(step, argv, timeout_s, env=env, smoke=(*argv, "--tiny", "--warmup", "1", "--steps", "2",
                                                       "--profile-steps", "1"))


PROFILE = Case(
    "profile", "where each headline training step's time goes, read by kernel: GPT-2 Large with the example's "
    "fastest flags, Llama-3.2-1B seq 2048 (micro 4, full remat), Llama-3.1-8B LoRA r16 and QLoRA nf4 seq 2048 "
    "under a 24 GB cap; per step matmul (TFLOP/s against the ceiling), attention, norm, rope, elementwise, "
    "loss, optimizer, copies, host transfers, idle, and the top 15 kernels", "none (the matmul ceiling)", 10,
    headline=("step_ms",), match=("step",),
    runs=(_profile_run("gpt2-large", 300), _profile_run("llama-1b", 300),
          # the planner's search (--micro-batch auto) and the 8B compile come before the steps
          _profile_run("llama8b-lora", 480, env=CAP24), _profile_run("llama8b-qlora", 420, env=CAP24)))


def _registry():
    cases = (SPEED, OFFLOAD_24GB, NVME, MODELS, LLAMA8B_24GB, GENERATE, DECODE_HLO, RL, DECODE_ATTENTION,
             DECODE_ATTENTION_RL, RL_8B_LORA_24GB, DPO_8B_LORA_24GB, REWARD_1B, LONG_CONTEXT, LONG_CONTEXT_FULL,
             SERVE, RL_SERVING, RL_CURVE, MOE, PROFILE, X2, X4, BEFORE_AFTER)
    return {case.name: case for case in cases}


CASES: dict[str, Case] = _registry()
