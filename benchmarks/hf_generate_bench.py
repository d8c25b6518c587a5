"""transformers' `generate` on the shapes of benchmarks/generate_bench.py, for comparison.

    python benchmarks/hf_generate_bench.py              # cases a and b on one GPU
    python benchmarks/hf_generate_bench.py --tiny       # CPU smoke test (tiny shapes)

Random-init weights from a config built from zerojax's named shape (`LlamaConfig.named`, written
as Hugging Face's config.json by `zerojax.models.hf_llama.config_to_hf`; no hub access), bf16, sdpa
attention, `cache_implementation="static"`, greedy, eos ignored (min_new_tokens = max_new_tokens).
(a) Llama-3.1-8B, batch 1, 128 prompt + 256 new; (b) batch 64, 512 prompt + 512 new. Tokens/s =
batch x new / seconds of a generate call (prefill included), one call after a warm-up (case b
first; a JSON line as each case ends, so a timeout keeps what finished); decode
tokens/s as generate_bench.py's (the full call less a one-new-token call). Prints a table and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from generate_bench import rates  # noqa: E402 (one definition of the figures for both frameworks)


def build(name: str, tiny: bool, device):
    import torch
    from hf_random_llama import random_llama

    return random_llama("tiny" if tiny else name, device, torch.bfloat16).eval()


def speed(model, batch: int, prompt: int, new: int, device) -> dict:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device, generator=None)
    mask = torch.ones_like(ids)

    def run(n):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(n):  # one warm-up call (a static cache compiles once per max length), one timed
        run(n)
        t = time.perf_counter()
        run(n)
        return time.perf_counter() - t

    return {"batch": batch, "prompt": prompt, "new": new, **rates(batch, new, timed(new), timed(1))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("a", "b", "all"), default="all")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = p.parse_args(argv)
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build("llama-3.1-8b", args.tiny, device)
    shapes = {"a": (1, 128, 256), "b": (64, 512, 512)} if not args.tiny else {"a": (1, 16, 16), "b": (4, 16, 16)}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"transformers {transformers.__version__} generate on {name} (torch {torch.__version__}, sdpa, static cache)")
    results = []
    for c in ("b", "a") if args.case == "all" else [args.case]:  # b first: the comparison that matters most
        results.append({"case": c, "model": "llama-3.1-8b", **speed(model, *shapes[c], device)})
        print(json.dumps({"framework": "transformers", "device": name, "results": results[-1:]}), flush=True)
    print(f"{'case':<5}{'model':<14}{'batch':>6}{'new':>6}{'tokens/s':>11}{'decode tok/s':>14}")
    for r in results:
        print(f"{r['case']:<5}{r['model']:<14}{r['batch']:>6}{r['new']:>6}{r['tokens_per_s']:>11}{r['decode_tokens_per_s']:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
