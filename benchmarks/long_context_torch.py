"""The PyTorch + PEFT anchor of long_context_bench.py's `longest`: the longest row one LoRA training step fits.

    python benchmarks/long_context_torch.py longest                     # Llama-3.1-8B LoRA r16, 24 GB cap
    python benchmarks/long_context_torch.py longest --seq 8192 16384    # these lengths only
    python benchmarks/long_context_torch.py longest --tiny              # CPU smoke test
    python benchmarks/long_context_torch.py longest --tiny --seq 16 48

The same work as `long_context_bench.py longest`: Llama-3.1-8B's shape (zerojax's
`LlamaConfig.named("llama-3.1-8b")`, converted by `zerojax.models.hf_llama.config_to_hf` into a
`transformers.LlamaConfig`: vocabulary 128256, 32 layers, GQA 32:8, llama3 rope), random init, no
hub; `LlamaForCausalLM(config)` built on the GPU under `torch.device("cuda")` with bf16 as the
default dtype (the 16 GB of weights are never made in fp32), frozen; PEFT LoRA r 16, alpha 32,
dropout 0 on every linear layer of the blocks (`target_modules="all-linear"`: q, k, v, o, gate, up,
down; not the LM head), as zerojax's `--lora 16 --lora-alpha 32`; gradient checkpointing on every
block (`gradient_checkpointing_enable`, or `activation_checkpointing_enable` where transformers has
it, use_reentrant=False: zerojax's "full" remat); sdpa attention held to the flash /
memory-efficient kernels (the math kernel, which makes the [T, T] scores, is not allowed); the
forward under bf16 autocast (the Hugging Face Trainer's bf16=True: PEFT keeps the adapters in fp32,
their matmuls run in bf16); micro-batch 1; AdamW on the adapters (lr 2e-4, no weight decay,
gradients clipped at 1.0: long_context_bench.py's `ds_config(lora=True)`).

One step = forward with labels = the input ids, Hugging Face's loss, backward, the clip, the
optimizer step. Hugging Face's causal-LM loss makes the full [T, vocab] logits and upcasts them to
fp32 before the cross-entropy (2 GiB of fp32 logits, and as much again for their gradient, every
4096 positions at this vocabulary): that is what the anchor does in practice and it is kept; zerojax
computes its loss in chunks (`chunked_llama_loss`). Rows are random ids attended causally over the
whole row; long_context_bench.py packs four documents a row (segment ids), which sdpa's flash
kernel cannot take without a [T, T] mask, so the anchor's attention does the full causal row (at
least the work of the packed row).

`longest`: --cap-gib (default 23.77 GiB, the figure the suite's 24 GB cap leaves to JAX) is given to
the caching allocator (`torch.cuda.set_per_process_memory_fraction(cap / the card's memory)`); one
untimed step at --warmup-seq sets up the optimizer state and the kernels; then the row length
doubles from --start (default 4096) up to --limit, one step at each (--steps > 1: their mean), until
a step runs out of memory (`torch.cuda.OutOfMemoryError`), which ends the doubling; --seq N ... tries
the lengths given instead, every one of them. peak_gib: `torch.cuda.max_memory_allocated()` over that
length's step(s), the peak statistics reset just before (so it counts the resident weights,
adapters and optimizer state as well as the step's transients, like JAX's peak_bytes_in_use);
peak_reserved_gib: the allocator's reserved peak, which is what the cap limits. An out-of-memory
row has fits false and the peak reached before it failed.

Prints one JSON line per length tried, {"framework": "torch+peft", "model", "seq", "fits",
"seconds", "tokens_per_s", "peak_gib", ...}, then one {"framework": "torch+peft", "longest_seq": N,
...} (the longest length that fit, null if none did); --out also writes them all as a JSON list.
--tiny: zerojax's "tiny" Llama shape, fp32, on the CPU, no cap, rows of 32 to 128 (no CUDA needed).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
# zerojax is imported for its named shapes only: keep JAX off the GPU this process measures
os.environ.setdefault("JAX_PLATFORMS", "cpu")

FRAMEWORK = "torch+peft"
CAP_GIB, LR = 23.77, 2e-4


def build(name: str, device: str, dtype):
    """A random-init LlamaForCausalLM of zerojax's named shape `name`, made on `device` in `dtype`,
    gradient checkpointing on, PEFT LoRA r 16 / alpha 32 on every linear layer of the blocks."""
    import peft
    from hf_random_llama import random_llama

    model = random_llama(name, device, dtype, use_cache=False)
    # transformers 5 names it activation_checkpointing_enable (gradient_checkpointing_enable, its
    # deprecated alias, warns); either also calls enable_input_require_grads, as PEFT needs
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", bias="none",
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    model.train()
    return model


def is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class Trainer:
    """One LoRA training step at a time on rows of random ids, micro-batch 1."""

    def __init__(self, args):
        import torch

        self.cuda = not args.tiny
        self.device = "cuda" if self.cuda else "cpu"
        self.name = "tiny" if args.tiny else args.model
        torch.manual_seed(0)
        self.model = build(self.name, self.device, torch.bfloat16 if self.cuda else torch.float32)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.trained, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def contexts(self):
        """(around the whole step, around the forward): sdpa held to flash / memory-efficient (the
        backward's recomputation included), bf16 autocast; nothing on the CPU."""
        import torch

        if not self.cuda:
            return contextlib.nullcontext(), contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return (sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
                torch.autocast("cuda", dtype=torch.bfloat16))

    def sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def step(self, seq: int) -> float:
        """One training step on a [1, seq] row: forward (labels = the ids), loss, backward, clip,
        AdamW. Returns the loss."""
        import torch

        ids = torch.randint(0, self.vocab, (1, seq), generator=self.gen).to(self.device)
        around, forward = self.contexts()
        with around:
            with forward:
                out = self.model(input_ids=ids, labels=ids)
            loss = out.loss
            del out  # the logits are not kept past the forward (as the Trainer drops its outputs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trained, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def free(self):
        import torch

        self.opt.zero_grad(set_to_none=True)
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def measure(self, seq: int, steps: int) -> dict:
        """`steps` steps at `seq`: seconds per step, tokens/s, the allocator's peaks; fits false on an
        out-of-memory error."""
        import torch

        row = {"framework": FRAMEWORK, "model": self.name, "seq": seq}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.sync()
        error = loss = None
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                loss = self.step(seq)
            self.sync()
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is a result
            if not is_oom(e):
                raise
            error = (str(e).splitlines() or [type(e).__name__])[0][:200]
        dt = (time.perf_counter() - t0) / steps
        if error is not None:
            self.free()  # the failed step's tensors went with the exception
        row.update(fits=error is None, seconds=None if error else round(dt, 3),
                   tokens_per_s=None if error else round(seq / dt, 1), peak_gib=None, peak_reserved_gib=None,
                   loss=None if error else round(loss, 4))
        if self.cuda:
            row.update(peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                       peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))
        if error:
            row["error"] = error
        return row


def longest(args, emit) -> None:
    import peft
    import torch
    import transformers

    cap = None
    if not args.tiny and args.cap_gib > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(1.0, args.cap_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(cap)
    t0 = time.perf_counter()
    tr = Trainer(args)
    build_s = time.perf_counter() - t0
    if args.warmup_seq:
        warm = tr.measure(args.warmup_seq, 1)
        if not warm["fits"]:
            raise SystemExit(f"long_context_torch.py: the warm-up step at seq {args.warmup_seq} ran out of memory: "
                             f"{warm.get('error')}")
    lengths = args.seq or []
    if not lengths:
        seq = args.start
        while seq <= args.limit:
            lengths.append(seq)
            seq *= 2
    best, failed = None, None
    for seq in lengths:
        row = tr.measure(seq, args.steps)
        row["cap_gib"] = args.cap_gib if cap is not None else None
        emit(row)
        if row["fits"]:
            if best is None or seq > best["seq"]:
                best = row
        else:
            failed = seq if failed is None else min(failed, seq)
            if not args.seq:
                break
    final = {"framework": FRAMEWORK, "model": tr.name, "longest_seq": best["seq"] if best else None,
             "first_oom_seq": failed, "limit": None if args.seq else args.limit,
             "seconds": best["seconds"] if best else None, "tokens_per_s": best["tokens_per_s"] if best else None,
             "peak_gib": best["peak_gib"] if best else None, "cap_gib": args.cap_gib if cap is not None else None,
             "memory_fraction": round(cap, 4) if cap is not None else None, "build_s": round(build_s, 2),
             "trainable_params": sum(p.numel() for p in tr.trained),
             "device": torch.cuda.get_device_name() if tr.cuda else "cpu", "torch": torch.__version__,
             "transformers": transformers.__version__, "peft": peft.__version__}
    emit(final)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=("longest",))
    p.add_argument("--model", default="llama-3.1-8b", help="a zerojax LlamaConfig.named shape")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="try these lengths instead of doubling")
    p.add_argument("--start", type=int, default=4096)
    p.add_argument("--limit", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=1, help="timed steps at each length (their mean)")
    p.add_argument("--warmup-seq", type=int, default=512, help="one untimed step first at this length (0: none)")
    p.add_argument("--cap-gib", type=float, default=CAP_GIB, help="allocator cap in GiB (0: none)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny Llama, short rows, no cap")
    p.add_argument("--out", default=None, help="also write every JSON line here as a list")
    args = p.parse_args(argv)
    if args.tiny:
        args.start, args.limit, args.warmup_seq = 32, 128, min(args.warmup_seq, 16)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    try:
        for module in ("peft", "transformers", "torch"):
            importlib.import_module(module)
    except ImportError as e:
        print(f"long_context_torch.py: needs torch, transformers and peft ({e})", file=sys.stderr)
        return 2
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(f"long_context_torch.py: no CUDA device (torch {torch.__version__}); run it on a GPU, "
              f"or pass --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    results = []

    def emit(row):
        print(json.dumps(row), flush=True)
        results.append(row)

    longest(args, emit)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
