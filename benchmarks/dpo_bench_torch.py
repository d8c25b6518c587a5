"""The PyTorch + PEFT anchor of the `dpo-8b-lora-24gb` case (benchmarks/cases.py): LoRA DPO as TRL's `DPOTrainer`
runs it with a PEFT model and no reference model, written as a plain loop.

    python benchmarks/dpo_bench_torch.py --cap-24gb          # llama-3.1-8b, seq 2048, 8 pairs a step
    python benchmarks/dpo_bench_torch.py --tiny              # CPU smoke test (tiny shape, fp32)

Random-init `LlamaForCausalLM` of a zerojax named shape (`LlamaConfig.named`, converted by
`zerojax.models.hf_llama.config_to_hf`: the same hyperparameters as `zerojax train --model NAME`; no
hub access), bf16 weights on a GPU (fp32 on CPU), sdpa attention, gradient checkpointing
(`gradient_checkpointing_enable` + `enable_input_require_grads`, as PEFT needs), PEFT LoRA r 16,
alpha 32, dropout 0 on q, k, v, o, gate, up and down (zerojax's "all-linear"), the forward under
bf16 autocast on a GPU (the Hugging Face Trainer's bf16=True: the fp32 adapters' matmuls in bf16),
AdamW on the adapters (lr 3e-4, betas 0.9 / 0.999, eps 1e-8, no weight decay, gradients clipped at
1.0: `zerojax train`'s settings).

Each step trains --pairs preference pairs of --seq-len tokens a row (random ids; a pair's chosen and
rejected rows share their prompt, the first half of the row; the completion, the second half, is
the only part scored), --micro pairs at a time with accumulation. Per micro-batch, as zerojax's
`make_dpo_loss` (and TRL's `concatenated_forward`): chosen and rejected rows in one batch [2m, T],
chosen first; the reference's summed completion log-probs with the adapters disabled
(`with model.disable_adapter()`, no gradient); the policy's; the sigmoid DPO loss
-logsigmoid(beta ((pc - rc) - (pr - rr))), beta 0.1, averaged over the pairs; one optimizer step
per --pairs.

Timing: one warm-up step, then --steps measured. tokens/s = pairs x 2 rows (chosen + rejected) x
seq_len per step / seconds, the count zerojax's trainer uses for a DPO run (its SpeedMeter:
train_batch_size pairs x the chosen and rejected rows' tokens). peak_gib: torch.cuda.max_memory_allocated
over the whole run, building included. --cap-24gb: torch.cuda.set_per_process_memory_fraction(23.77 GiB
/ the card's memory), as the suite's 24 GB cases cap JAX (benchmarks/runner.py). first_loss: the warm-up step's first
micro-batch, before any update: ln 2, since LoRA's B starts at 0 (policy = reference); --tiny
checks it. Prints one JSON line {"framework": "torch", ...}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

BETA, LR, CAP_GIB = 0.1, 3e-4, 23.77
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(name: str, device, dtype):
    """A random-init LlamaForCausalLM of zerojax's named shape `name`, LoRA r 16 / alpha 32 applied,
    gradient checkpointing on."""
    import peft
    from hf_random_llama import random_llama

    model = random_llama(name, device, dtype, use_cache=False)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                           task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora)


def completion_logps(model, ids, plen: int):
    """Summed log-probs [rows] (fp32) of each row's completion (positions plen..T-1)."""
    import torch

    logits = model(input_ids=ids).logits[:, plen - 1:-1].float()
    return torch.gather(torch.log_softmax(logits, -1), 2, ids[:, plen:, None])[..., 0].sum(-1)


def dpo_loss(pc, pr, rc, rr, beta: float = BETA):
    """TRL's sigmoid DPO loss per pair (zerojax.methods.dpo.dpo_loss, loss_type "sigmoid")."""
    import torch.nn.functional as F

    return -F.logsigmoid(beta * ((pc - pr) - (rc - rr)))


def pairs_batch(gen, pairs: int, seq_len: int, vocab: int, device):
    """(chosen [pairs, T], rejected [pairs, T]) random ids; each pair's rows share the prompt half."""
    import torch

    plen = seq_len // 2
    prompt = torch.randint(0, vocab, (pairs, plen), generator=gen)
    chosen, rejected = (torch.randint(0, vocab, (pairs, seq_len - plen), generator=gen) for _ in range(2))
    return torch.cat([prompt, chosen], 1).to(device), torch.cat([prompt, rejected], 1).to(device)


def run(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.cap_24gb and cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / total))
    name = "tiny" if args.tiny else args.model
    torch.manual_seed(0)
    model = build(name, device, torch.bfloat16 if cuda else torch.float32)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pairs, micro, T = args.pairs, args.micro, args.seq_len
    if pairs % micro:
        raise SystemExit(f"--pairs {pairs} is not a multiple of --micro {micro}")
    plen = T // 2
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first_loss = began = None
    for step in range(1 + args.steps):
        chosen, rejected = pairs_batch(gen, pairs, T, vocab, device)
        total = 0.0
        for i in range(0, pairs, micro):
            ids = torch.cat([chosen[i:i + micro], rejected[i:i + micro]])  # chosen first, as TRL / zerojax
            with autocast():
                with torch.no_grad(), model.disable_adapter():
                    ref = completion_logps(model, ids, plen)
                pol = completion_logps(model, ids, plen)
                loss = dpo_loss(pol[:micro], pol[micro:], ref[:micro], ref[micro:]).mean()
            (loss / (pairs // micro)).backward()
            if first_loss is None:
                first_loss = loss.item()
            total += loss.detach() / (pairs // micro)
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step == 0:
            began = time.perf_counter()
    wall = time.perf_counter() - began
    tokens = args.steps * pairs * 2 * T
    return {"framework": "torch", "model": name, "seq_len": T, "pairs_per_step": pairs, "micro_pairs": micro,
            "steps": args.steps, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "loss": round(float(total), 6), "first_loss": round(first_loss, 6),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main(argv=None):
    import peft
    import torch
    import transformers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a zerojax LlamaConfig.named shape")
    p.add_argument("--tiny", action="store_true", help="the \"tiny\" shape (CPU smoke test)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a row (default 2048; --tiny 64)")
    p.add_argument("--pairs", type=int, default=8, help="preference pairs a step (zerojax's train_batch_size)")
    p.add_argument("--micro", type=int, default=1, help="pairs a micro-batch (2 rows each)")
    p.add_argument("--steps", type=int, default=3, help="measured steps, after one warm-up step")
    p.add_argument("--cap-24gb", action="store_true", help="cap this process at 23.77 GiB of the GPU")
    args = p.parse_args(argv)
    if args.seq_len is None:
        args.seq_len = 64 if args.tiny else 2048
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, sdpa, "
          f"{'bf16' if torch.cuda.is_available() else 'fp32'}", flush=True)
    r = run(args)
    if args.tiny:  # B = 0: policy = reference, h = 0, loss = -log sigmoid(0)
        ok = abs(r["first_loss"] - math.log(2)) < 1e-5
        print(f"sanity: step-0 DPO loss {r['first_loss']:.6f} {'=' if ok else '!='} ln 2 = {math.log(2):.6f} "
              f"(LoRA B = 0: policy = reference)", flush=True)
        if not ok:
            raise SystemExit(1)
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
