"""Mixture-of-experts training speed: zerojax beside transformers (+ PEFT), one table.

    python benchmarks/moe_bench.py                 # GPU: the whole matrix, one process per row
    python benchmarks/moe_bench.py --toy           # CPU smoke run at tiny shapes (a minute)

Rows (random weights, the same batch and tokens on both sides):
  ft-zerojax / ft-transformers: full fine-tune of OLMoE-1B-7B's shape (64 experts, top 8, width 2048)
      with --ft-layers of its 16 layers (fp32 master + AdamW states are 16 bytes a parameter: all 16
      layers, 110 GB, fit no single card; both sides run the same cut), bf16 compute, fp32 weights,
      AdamW, micro-batch --ft-batch x --ft-seq. transformers: torch.autocast(bf16) over fp32
      weights (HF Trainer's bf16=True), fused AdamW, its grouped_mm experts, sdpa attention.
  qlora-zerojax / qlora-zerojax-attention: Qwen3-30B-A3B's shape, nf4 base (`zerojax.lora`,
      quantized a layer at a time on the card), LoRA r 16 on attention + every expert's gate_up /
      down (PEFT's target_parameters), or on attention only; batch 1 x --seq 2048, remat full,
      the adapters' master and AdamW moments in host memory (--qlora-offload), under a 24 GB
      budget: XLA_PYTHON_CLIENT_MEM_FRACTION = 23.77 GiB / the card's memory
      (nvidia-smi). A plan that does not fit is a row saying so (the engine's memory guard).
  qlora-transformers: transformers + PEFT with the same adapters on a bf16 base (no
      bitsandbytes here: 61 GB of weights, so uncapped), gradient checkpointing.
  decode-zerojax / decode-transformers: all 16 layers of OLMoE-1B-7B in bf16, greedy, batch 1 and
      64, --decode-prompt + --decode-new tokens (eos ignored): decode tokens/s as
      benchmarks/generate_bench.py and hf_generate_bench.py measure them (transformers: its static
      cache, as there).

tokens/s after --warmup steps; MFU on the active parameters (6 N_active + attention FLOPs per
token, `zerojax.models.moe.moe_flops_per_token`) against --peak-tflops; peak device memory. Each
row runs in its own process (a clean card, its own memory fraction); results also go to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from zerojax.models import grouped_matmul  # noqa: E402  (no device work at import)

ROWS = ("ft-zerojax", "ft-transformers", "qlora-zerojax", "qlora-zerojax-attention", "qlora-transformers",
        "decode-zerojax", "decode-transformers")
DECODE_BATCHES = (1, 64)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BUDGET_GIB = 23.77


def shapes(args, row: str):
    """(MoEConfig, batch, seq) of a row."""
    from zerojax.models import MoEConfig

    if args.toy and row.startswith("decode"):
        return MoEConfig.named("tiny-qwen3-moe", vocab_size=512), None, None
    if args.toy:
        return MoEConfig.named("tiny-qwen3-moe", vocab_size=512), 2, 64
    if row.startswith("ft"):
        return MoEConfig.named("olmoe-1b-7b", num_hidden_layers=args.ft_layers), args.ft_batch, args.ft_seq
    if row.startswith("decode"):
        return MoEConfig.named("olmoe-1b-7b"), None, None
    return MoEConfig.named("qwen3-30b-a3b"), 1, args.seq


def run_decode(args, row):
    """decode-zerojax / decode-transformers: {"decode": [generate_bench's figures per batch]}."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    cfg, _, _ = shapes(args, row)
    prompt, new = (16, 8) if args.toy else (args.decode_prompt, args.decode_new)
    if row == "decode-zerojax":
        import jax
        from flax import nnx
        from generate_bench import generation_speed

        model = host_model(cfg, remat=None)
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
        out = [generation_speed(model, b, prompt, new, cfg.vocab_size) for b in DECODE_BATCHES]
    else:
        import torch
        from hf_generate_bench import speed

        device = "cpu" if args.toy else "cuda"
        model = hf_model(cfg, torch.bfloat16, device).eval()
        out = [speed(model, b, prompt, new, device) for b in DECODE_BATCHES]
    return {"decode": out}


def batches(cfg, batch, seq, n):
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)} for _ in range(n)]


def host_model(cfg, remat):
    """A MoELlama with bf16 random weights on the host, each stacked leaf one random layer repeated
    (a read-only broadcast view: a 30B model without 61 GB of host memory or minutes of sampling)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from zerojax.models import MoELlama

    make = lambda: MoELlama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,  # noqa: E731
                            remat_policy=remat)
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(0)

    def fill(tree, at=()):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = fill(v, (*at, k))
                continue
            stacked = at[:1] == ("layers",)
            one = v.shape[1:] if stacked else v.shape
            if k == "scale":
                x = np.ones(one, np.float32)
            else:
                std = 1.0 if "router" in at else 0.02  # a spread router: every expert gets tokens
                x = rng.standard_normal(one, np.float32) * std
            x = x.astype(jnp.bfloat16)
            out[k] = np.broadcast_to(x, v.shape) if stacked else x
        return out

    nnx.replace_by_pure_dict(state, fill(nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def timed(step, data, warmup):
    """(tokens/s, seconds per step) over the steps after `warmup`; step(batch) blocks until done."""
    for b in data[:warmup]:
        step(b)
    t = time.perf_counter()
    for b in data[warmup:]:
        step(b)
    dt = (time.perf_counter() - t) / max(1, len(data) - warmup)
    tokens = data[0]["input_ids"].size
    return tokens / dt, dt


def run_zerojax(args, row):
    import jax

    import zerojax
    from zerojax import lora
    from zerojax.models import chunked_moe_loss

    cfg, batch, seq = shapes(args, row)
    ds = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": not args.toy}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 2 if row.startswith("ft") or args.qlora_offload else 0}}
    if row.startswith("qlora") and args.qlora_offload:
        # the adapters on every expert are 629M parameters at Qwen3-30B-A3B's shape: with their fp32 master,
        # gradients and AdamW moments (9.4 GiB) the 16.4 GiB nf4 base passes a 24 GB card, so the master and
        # moments live in host memory
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if row.startswith("ft"):
        model = host_model(cfg, remat="full")
    else:
        targets = {"target_modules": ATTENTION, "target_parameters": None if row.endswith("attention") else EXPERTS}
        model = lora.apply(host_model(cfg, remat="full"),
                           {"r": 16, "lora_alpha": 32, "quantize": "nf4", **targets}, device=jax.devices()[0])
    try:
        engine = zerojax.shard(model, ds, loss_fn=chunked_moe_loss(512))  # a built model: placed leaf by leaf
    except Exception as e:  # the memory guard's refusal is this row's result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    step = lambda b: jax.block_until_ready(engine.train_step(b)["loss"])  # noqa: E731
    tps, dt = timed(step, batches(cfg, batch, seq, args.warmup + args.steps), args.warmup)
    stats = jax.devices()[0].memory_stats() or {}
    return {"tokens_per_s": tps, "step_s": dt, "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
            "flops_per_token": _flops(cfg, seq), "batch": batch, "seq": seq}


def _flops(cfg, seq):
    from zerojax.models.moe import moe_flops_per_token

    return moe_flops_per_token(cfg, seq)


def hf_model(cfg, dtype, device):
    """transformers' model of `cfg` (its config.json as zerojax writes it), random weights on `device`."""
    import torch
    import transformers

    from zerojax.models.hf_moe import config_to_hf

    hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type")}
    cls = transformers.Qwen3MoeConfig if cfg.model_type == "qwen3_moe" else transformers.MixtralConfig
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cls(**hf), dtype=dtype)
    return model


def run_transformers(args, row):
    import torch

    cfg, batch, seq = shapes(args, row)
    device = "cpu" if args.toy else "cuda"
    amp = torch.bfloat16 if not args.toy else torch.float32
    if row.startswith("ft"):
        model = hf_model(cfg, torch.float32, device)
        model.gradient_checkpointing_enable()
    else:
        import peft

        model = hf_model(cfg, amp, device)
        model.gradient_checkpointing_enable()
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=ATTENTION,
                                                           target_parameters=EXPERTS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=not args.toy)

    def step(b):
        ids = torch.from_numpy(b["input_ids"].astype("int64")).to(device)
        with torch.autocast(device, dtype=amp, enabled=not args.toy):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tps, dt = timed(step, batches(cfg, batch, seq, args.warmup + args.steps), args.warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    return {"tokens_per_s": tps, "step_s": dt, "peak_gib": peak, "flops_per_token": _flops(cfg, seq),
            "batch": batch, "seq": seq}


def mem_fraction() -> str | None:
    """XLA_PYTHON_CLIENT_MEM_FRACTION leaving BUDGET_GIB of this card to JAX (None: no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{BUDGET_GIB * 1024 / float(out.split()[0]):.3f}"


def failure_line(output: str) -> str:
    """The exception line of a failed row's output (JAX prints a note after it), else its last line;
    the whole output goes to stderr so that a log keeps the traceback."""
    print(output, file=sys.stderr)
    lines = [x.strip() for x in output.strip().splitlines() if x.strip()]
    raised = [x for x in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", x)]
    return ((raised or lines or ["no output"])[-1])[:300]


def run_row(args, row) -> dict:
    """Row `row` in a fresh process (its own card memory and memory fraction) -> its result."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fraction = mem_fraction()
    if row.startswith("qlora-zerojax") and fraction and not args.toy:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
    cmd = [sys.executable, os.path.abspath(__file__), "--row", row, *args.passthrough]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "error": f"over --row-timeout {args.row_timeout} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"row": row, "error": f"exit {proc.returncode}: {failure_line(proc.stderr or proc.stdout)}"}
    return {"row": row, **json.loads(lines[-1][len("RESULT "):]),
            "mem_fraction": env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}


def table(results, peak_tflops):
    head = f"{'row':<26}{'batch x seq':>12}{'tokens/s':>11}{'MFU (active)':>14}{'peak GiB':>10}  note"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']:<26}{'':>12}{'-':>11}{'-':>14}{'-':>10}  {r['error']}")
            continue
        if "decode" in r:  # tokens/s: decode only (prefill apart); note: all new tokens a second
            for d in r["decode"]:
                lines.append(f"{r['row']:<26}{str(d['batch']) + ' x ' + str(d['new']):>12}"
                             f"{d['decode_tokens_per_s'] or 0:>11,.0f}{'-':>14}{'-':>10}  "
                             f"decode; {d['tokens_per_s']:,.0f} new tokens/s with prefill")
            continue
        mfu = (f"{100 * r['tokens_per_s'] * r['flops_per_token'] / (peak_tflops * 1e12):.1f}%"
               if peak_tflops else "-")
        notes = [f"mem fraction {r['mem_fraction']}"] if r.get("mem_fraction") else []
        notes += [f"grouped products: {r['grouped_matmul']}"] if r.get("grouped_matmul") else []
        note = "; ".join(notes)
        lines.append(f"{r['row']:<26}{str(r['batch']) + ' x ' + str(r['seq']):>12}{r['tokens_per_s']:>11,.0f}"
                     f"{mfu:>14}{r['peak_gib']:>10.2f}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toy", action="store_true", help="tiny shapes on CPU (a smoke run)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {ROWS}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    p.add_argument("--seq", type=int, default=2048, help="QLoRA rows' sequence length")
    p.add_argument("--ft-layers", type=int, default=8, help="full fine-tune rows: OLMoE's layers kept")
    p.add_argument("--ft-batch", type=int, default=4)
    p.add_argument("--decode-prompt", type=int, default=128, help="decode rows: prompt tokens")
    p.add_argument("--decode-new", type=int, default=128, help="decode rows: new tokens")
    p.add_argument("--ft-seq", type=int, default=2048)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the card's dense bf16 peak for MFU (H100 SXM: 989; default: none on CPU, else 989)")
    p.add_argument("--row-timeout", type=float, default=None,
                   help="seconds a row may take (a row past it is a row saying so)")
    p.add_argument("--grouped-matmul", default="auto", choices=grouped_matmul.CHOICES,
                   help="zerojax rows' grouped expert products (zerojax.models.grouped_matmul; auto: JAX's Mosaic "
                        "GPU kernels on a Hopper GPU, else XLA's)")
    p.add_argument("--qlora-offload", action=argparse.BooleanOptionalAction, default=True,
                   help="QLoRA rows: the adapters' fp32 master and AdamW moments in host memory (ZeRO-2's "
                        "offload_optimizer cpu; default on: on every expert they do not fit a 24 GB card beside "
                        "the base)")
    p.add_argument("--out", default="moe_bench.json")
    p.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.passthrough = [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--seq={args.seq}",
                        f"--ft-layers={args.ft_layers}", f"--ft-batch={args.ft_batch}", f"--ft-seq={args.ft_seq}",
                        f"--decode-prompt={args.decode_prompt}", f"--decode-new={args.decode_new}",
                        f"--grouped-matmul={args.grouped_matmul}",
                        "--qlora-offload" if args.qlora_offload else "--no-qlora-offload"]
    args.passthrough += ["--toy"] if args.toy else []
    if args.row:  # one row, in this process
        run = (run_decode if args.row.startswith("decode") else
               run_transformers if args.row.endswith("transformers") else run_zerojax)
        if args.row.endswith("transformers"):
            out = run(args, args.row)
        else:
            with grouped_matmul.use(args.grouped_matmul):  # read as the row's programs trace
                out = {**run(args, args.row), "grouped_matmul": grouped_matmul.resolved()}
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        p.error(f"--rows: {bad} unknown; choose from {ROWS}")
    peak = args.peak_tflops if args.peak_tflops is not None else (None if args.toy else 989.0)
    results = []
    for r in rows:  # each row printed and saved as it ends: a run cut short keeps the rows it finished
        results.append(run_row(args, r))
        print(json.dumps(results[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(table(results, peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
