"""The anchor of benchmarks/serve_bench.py: transformers' continuous batching (the manager behind
`model.generate_batch`, paged attention: its CB-friendly attention, flash where installed) on the
same requests (benchmarks/serve_traffic.py, same seeds), the same random-init Llama-3.1-8B shape
(benchmarks/hf_random_llama.py, bf16), greedy, eos never matched. In-process (no HTTP): requests
are added as others finish so that `concurrency` are in flight, each token's time recorded by
transformers (record_timestamps).

    PYTHONPATH=. python benchmarks/serve_bench_hf.py              # one GPU
    PYTHONPATH=. python benchmarks/serve_bench_hf.py --tiny       # CPU smoke test
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import serve_traffic  # noqa: E402
from serve_bench import shape  # noqa: E402 (one definition of the traffic for both frameworks)

NEVER = -1  # an eos id no token has: every request runs to its max_new_tokens, as ignore_eos


def run_level(manager, reqs, concurrency: int):
    """(per request (start, token times), seconds): `concurrency` requests in flight."""
    pending, started, done = list(reversed(reqs)), {}, {}

    def add():
        prompt, new = pending.pop()
        rid = manager.add_request(prompt, max_new_tokens=new, record_timestamps=True, eos_token_id=NEVER)
        started[rid] = time.perf_counter()

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        add()
    while len(done) < len(reqs):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.is_finished():
            if result.error:
                raise RuntimeError(result.error)
            done[result.request_id] = (started[result.request_id], list(result.timestamps or []))
            if pending:
                add()
    return list(done.values()), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--levels", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                    help="concurrency levels, e.g. 64 (default serve_bench.py's; the last but one again with long "
                         "prompts)")
    args = ap.parse_args(argv)
    import torch
    from hf_random_llama import random_llama
    from transformers import GenerationConfig

    s = shape(args.tiny)
    if args.levels:
        s["levels"] = args.levels
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_llama(s["name"], device, torch.bfloat16).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=s["max_output"], pad_token_id=0, eos_token_id=NEVER)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30) as manager:
        serve_traffic.run_matrix("transformers", s, model.config.vocab_size,
                                 lambda reqs, c: run_level(manager, reqs, c),
                                 lambda: {"device": name, "attention": model.config._attn_implementation})
    return 0


if __name__ == "__main__":
    sys.exit(main())
