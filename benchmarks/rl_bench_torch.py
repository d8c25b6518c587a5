"""The PyTorch + transformers anchor of benchmarks/rl_bench.py: the same GRPO loop, written as a
plain TRL-style loop.

    python benchmarks/rl_bench_torch.py                  # qwen2.5-0.5b and llama-3.2-1b on one GPU
    python benchmarks/rl_bench_torch.py --tiny           # CPU smoke test (tiny shapes)

Random-init `<Family>ForCausalLM` from the zerojax named shape's Hugging Face config (no hub
access), bf16 weights, sdpa attention, a frozen bf16 copy as the reference. Each step: the same
random prompts (8 x 256 tokens) x group 8 sampled by `generate` (temperature 1, top_k 0, top_p 1,
min_new_tokens = max_new_tokens = 256: every row runs all 256), the same reward and advantages,
the reference's log-probs, then one AdamW step (torch.optim.AdamW on the bf16 weights, as a
bf16 TRL run; micro-batch 16 x 4 accumulation) of the same loss (zerojax.methods.grpo's
formula in torch: per-token clipped ratio, k3 KL 0.04, per-sequence mean). Timing as
rl_bench.py: one warm-up step, then --steps measured; prints a table and one JSON line per shape.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from rl_bench import GROUP, KL, LR, MICRO, even_fraction, prompt_ids, shape, table  # noqa: E402 (one setup for both)


def build(name: str, tiny: bool, device):
    import torch
    from hf_random_llama import random_llama

    return random_llama("tiny" if tiny else name, device, torch.bfloat16)


def completion_logps(model, ids, plen):
    """Per-token log-probs [B, new] of the completion tokens (positions plen..), fp32."""
    import torch

    logits = model(input_ids=ids).logits[:, plen - 1:-1].float()
    return torch.gather(torch.log_softmax(logits, -1), 2, ids[:, plen:, None])[..., 0]


def grpo_loss(logps, ref, adv, eps=0.2):
    import torch

    ratio = torch.exp(logps - logps.detach())
    per = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - eps, 1 + eps) * adv[:, None])
    delta = ref - logps
    per = per + KL * (torch.exp(delta) - delta - 1)
    return per.mean(-1).mean()  # every completion runs its full length: the per-sequence mean


def run(name: str, args) -> dict:
    import numpy as np
    import torch

    from zerojax.rl.advantages import group_advantages

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, plen, new, micro = shape(args, name)
    model = build(name, args.tiny, device)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    prompts = torch.tensor(prompt_ids(64, plen, model.config.vocab_size), device=device)
    rows = n * GROUP
    gen_s = train_s = 0.0
    began = None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for step in range(1 + args.steps):
        t0 = time.perf_counter()
        batch_prompts = prompts[(step * n) % 64:(step * n) % 64 + n].repeat_interleave(GROUP, 0)
        model.eval()
        with torch.no_grad():
            ids = model.generate(batch_prompts, attention_mask=torch.ones_like(batch_prompts), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0)
            rewards = even_fraction(None, None, completion_ids=ids[:, plen:].tolist())
            adv = torch.tensor(group_advantages(np.asarray(rewards), GROUP), device=device)
            ref_logps = torch.cat([completion_logps(ref, ids[i:i + micro], plen) for i in range(0, rows, micro)])
        sync()
        t1 = time.perf_counter()
        model.train()
        for i in range(0, rows, micro):
            loss = grpo_loss(completion_logps(model, ids[i:i + micro], plen), ref_logps[i:i + micro], adv[i:i + micro])
            (loss / (rows // micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if step == 0:
            began = t2
        else:
            gen_s, train_s = gen_s + t1 - t0, train_s + t2 - t1
    wall = time.perf_counter() - began
    return {"framework": "torch", "model": "tiny" if args.tiny else name, "group": GROUP, "prompts": n,
            "prompt_len": plen, "new_tokens": new, "steps": args.steps, "seconds": round(wall, 3),
            "samples_per_s": round(rows * args.steps / wall, 2), "generate_s": round(gen_s, 3),
            "train_s": round(train_s, 3), "generate_share": round(gen_s / wall, 3),
            "reward_mean": round(float(np.mean(rewards)), 4), "loss": loss.item(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}


def main(argv=None):
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", help="a LlamaConfig.named shape (default: qwen2.5-0.5b, llama-3.2-1b)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=MICRO, help=f"rows per micro-batch (default {MICRO})")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, sdpa, bf16")
    results = [run(name, args) for name in (args.model or ["qwen2.5-0.5b", "llama-3.2-1b"])]
    table(results)
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
