"""zerojax generation on random-init weights of a named Llama shape (no hub access needed).

    python benchmarks/generate_bench.py                  # the three cases on one GPU
    python benchmarks/generate_bench.py --case a         # one case: a, b or c
    python benchmarks/generate_bench.py --tiny           # CPU smoke test (tiny shapes)

(a) Llama-3.1-8B bf16, batch 1, 128 prompt + 256 new tokens: decode tokens/s and its share of the
    HBM bound (every decode step reads every weight once, the input embedding aside: those bytes /
    the device copy bandwidth, measured here with a large array copy, is the fastest a step can be).
(b) Llama-3.1-8B bf16, batch 64, 512 prompt + 512 new tokens: new tokens/s (prefill included, as
    benchmarks/hf_generate_bench.py measures transformers).
(c) Llama-3.2-1B: an engine (ZeRO-2, bf16, LoRA r 16) trains 3 steps, generates 64 x 128 new
    tokens from its live weights, trains one more step: tokens/s and peak device memory.

Greedy, eos ignored (every row runs its max_new_tokens). Each case prints its JSON line as soon as it
finishes (a timeout keeps the cases before it); then a table and one JSON line of all.
Decode tokens/s = batch x (new - 1) / (time of the full generate - time of a generate of one new
token: the prefill and its first token).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


def copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """Device memory bandwidth in bytes/s: an elementwise op over an nbytes bf16 array reads and
    writes it once (2 x nbytes of traffic), `reps` times in one program (a loop on the device, so
    that one dispatch's latency does not count against a ~1 ms copy), best of 5."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: jax.lax.fori_loop(0, reps, lambda _, b: b + jnp.bfloat16(1), a))
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes * reps / best


def _build(name: str, tiny: bool):
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models import Llama, LlamaConfig

    config = LlamaConfig.named("tiny" if tiny else name)
    return Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


_model = functools.lru_cache(maxsize=1)(_build)  # cases a and b share one 8B model (16 GB)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).tolist()


def _timed(fn, repeats: int = 2) -> float:
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def generation_speed(target, batch: int, prompt: int, new: int, vocab: int, decode_attention: str = "xla") -> dict:
    """Seconds of a full generate and of its prefill alone -> tokens/s (all new, and decode only)."""
    import zerojax

    prompts = _prompts(batch, prompt, vocab)
    run = lambda n: zerojax.generate(target, prompts, max_new_tokens=n, ignore_eos=True,  # noqa: E731
                                     decode_attention=decode_attention)
    total = _timed(lambda: run(new))
    first = _timed(lambda: run(1))
    return {"batch": batch, "prompt": prompt, "new": new, **rates(batch, new, total, first)}


def rates(batch: int, new: int, total: float, first: float) -> dict:
    """Seconds of a full generate call and of a one-new-token call -> the row's figures (decode:
    the difference; None where timing noise leaves none, as on tiny CPU shapes)."""
    decode = total - first if total > first else None
    return {"seconds": round(total, 4), "prefill_seconds": round(first, 4),
            "tokens_per_s": round(batch * new / total, 1),
            "decode_tokens_per_s": round(batch * (new - 1) / decode, 1) if decode else None,
            "decode_step_ms": round(1e3 * decode / (new - 1), 3) if decode else None}


def weight_bytes(model) -> tuple[int, int]:
    """(all weight bytes, the bytes a decode step reads: all but an untied input embedding, of
    which a step gathers one row per sequence)."""
    import jax
    from flax import nnx

    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    total = nbytes(nnx.state(model, nnx.Param))
    return total, total - (0 if model.config.tie_word_embeddings else nbytes(model.embed_tokens[...]))


def hbm_bound(model, tiny: bool, decode_step_ms, extra_bytes: int = 0) -> tuple[float, float, float | None]:
    """(copy bandwidth bytes/s, the step's HBM bound in ms: the weights a decode step reads plus
    `extra_bytes` at that rate, the bound's share of the measured step or None without one)."""
    bandwidth = copy_bandwidth((1 << 30) if not tiny else (1 << 24))
    _, read = weight_bytes(model)
    bound_ms = 1e3 * (read + extra_bytes) / bandwidth
    return bandwidth, bound_ms, round(bound_ms / decode_step_ms, 3) if decode_step_ms else None


def step_bytes(model, batch: int, length: int) -> dict:
    """XLA's cost analysis of the decode program on this device: "bytes accessed" of one decode
    iteration with the layer loop's body counted once (XLA counts a while body once), and the
    step's estimate: the LM head's bytes + layers x the rest (the embedding row, the norms and
    sampling are small beside a layer)."""
    from zerojax.generation.buckets import length_bucket
    from zerojax.generation.program_cost import bytes_accessed, decode_program

    _, compiled = decode_program(model, batch=batch, length=length, out_len=length_bucket(16))
    one = bytes_accessed(compiled)
    head = model.head_weight().nbytes
    return {"bytes_accessed_one_layer_iteration": int(one),
            "bytes_accessed_per_step": int(head + model.config.num_hidden_layers * (one - head))}


def case_a(tiny: bool) -> dict:
    from zerojax.generation.buckets import length_bucket

    model = _model("llama-3.1-8b", tiny)
    prompt, new = 128, 256 if not tiny else 16
    r = generation_speed(model, 1, prompt, new, model.config.vocab_size)
    bandwidth, bound_ms, share = hbm_bound(model, tiny, r["decode_step_ms"])
    total, read = weight_bytes(model)
    cost = step_bytes(model, 1, length_bucket(prompt) + length_bucket(new))
    return {"case": "a", "model": "llama-3.1-8b", **r, "weight_bytes": total, "weight_bytes_read_per_step": read,
            **cost, "copy_bandwidth_gbs": round(bandwidth / 1e9, 1),
            "hbm_bound_step_ms": round(bound_ms, 3), "hbm_bound_share": share,
            "bytes_accessed_bound_step_ms": round(1e3 * cost["bytes_accessed_per_step"] / bandwidth, 3)}


def case_b(tiny: bool) -> dict:
    """Batch 64, 512 + 512, and its HBM bound: a decode step reads at least the weights and the
    cache slots filled so far (prompt + t at step t; on average prompt + new / 2), at the measured
    copy rate; the bound's tokens/s adds the measured prefill to that many steps at the bound."""
    from zerojax.generation.cache import cache_bytes
    from zerojax.generation.families import geometry_of_config

    model = _model("llama-3.1-8b", tiny)
    batch, prompt, new = (64, 512, 512) if not tiny else (4, 16, 16)
    r = generation_speed(model, batch, prompt, new, model.config.vocab_size)
    kv = cache_bytes(geometry_of_config(model.config), batch, prompt + new // 2, model.dtype)
    bandwidth, bound_ms, share = hbm_bound(model, tiny, r["decode_step_ms"], kv)
    bound_s = r["prefill_seconds"] + (new - 1) * bound_ms / 1e3
    return {"case": "b", "model": "llama-3.1-8b", **r, "copy_bandwidth_gbs": round(bandwidth / 1e9, 1),
            "mean_cache_bytes_read_per_step_at_least": kv, "hbm_bound_step_ms": round(bound_ms, 3),
            "hbm_bound_share": share, "hbm_bound_tokens_per_s": round(batch * new / bound_s, 1)}


def case_c(tiny: bool) -> dict:
    """Train, generate from the live engine, train again (the RL rollout / update shape)."""
    import jax
    import numpy as np

    import zerojax
    from zerojax import lora
    from zerojax.models import llama_loss

    rows, seq = (8, 512) if not tiny else (8, 32)
    cfg = {"train_batch_size": rows, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine = zerojax.shard(lambda: lora.apply(_build("llama-3.2-1b", tiny), {"r": 16, "lora_alpha": 32,
                                                                               "target_modules": "all-linear"}),
                           cfg, loss_fn=llama_loss)
    vocab = engine.model.config.vocab_size if tiny else 128256
    rng = np.random.default_rng(0)
    batch = lambda: {"input_ids": rng.integers(0, vocab, (rows, seq)).astype(np.int32)}  # noqa: E731
    for _ in range(3):
        engine.train_step(batch())
    engine.synchronize()
    n, new = (64, 128) if not tiny else (4, 8)
    prompts = _prompts(n, 128 if not tiny else 8, vocab)
    t = time.perf_counter()
    zerojax.generate(engine, prompts, max_new_tokens=new, ignore_eos=True)
    first = time.perf_counter() - t  # compile included
    t = time.perf_counter()
    zerojax.generate(engine, prompts, max_new_tokens=new, ignore_eos=True)
    warm = time.perf_counter() - t
    loss = float(engine.train_step(batch())["loss"])
    stats = jax.devices()[0].memory_stats() or {}
    return {"case": "c", "model": "llama-3.2-1b", "stage": 2, "lora_r": 16, "batch": n, "new": new,
            "first_call_seconds": round(first, 2), "seconds": round(warm, 4), "tokens_per_s": round(n * new / warm, 1),
            "loss_after": round(loss, 4), "peak_bytes": stats.get("peak_bytes_in_use")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=("a", "b", "c", "all"), default="all")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    args = p.parse_args(argv)
    import jax

    cases = {"a": case_a, "b": case_b, "c": case_c}
    results = []
    for name in (cases if args.case == "all" else [args.case]):
        results.append(cases[name](args.tiny))
        print(json.dumps({"framework": "zerojax", "device": jax.devices()[0].device_kind, **results[-1]}), flush=True)
    print(f"zerojax generate on {jax.devices()[0].device_kind} (JAX {jax.__version__})")
    print(f"{'case':<5}{'model':<14}{'batch':>6}{'new':>6}{'tokens/s':>11}{'decode tok/s':>14}  notes")
    for r in results:
        notes = (f"HBM bound share {r['hbm_bound_share'] or 0:.0%} ({r['copy_bandwidth_gbs']} GB/s copy)"
                 if r["case"] == "a"
                 else f"peak {r['peak_bytes'] / 2**30:.2f} GiB" if r["case"] == "c" and r.get("peak_bytes") else "")
        print(f"{r['case']:<5}{r['model']:<14}{r['batch']:>6}{r['new']:>6}{r['tokens_per_s']:>11}"
              f"{r.get('decode_tokens_per_s') or '':>14}  {notes}")
    print(json.dumps({"framework": "zerojax", "device": jax.devices()[0].device_kind, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
