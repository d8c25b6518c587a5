"""`zerojax serve`: its flags and its main. Nothing here imports jax or the serve extra until the
command runs (zerojax.cli builds every subcommand's parser at start)."""
from __future__ import annotations

import os
import sys
import time

SERVE_EXTRA = 'zerojax serve needs the serve extra: pip install -e ".[serve]" (fastapi, uvicorn, prometheus-client)'


def _adapter(value: str) -> tuple[str, str]:
    import argparse

    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--adapter {value!r}: NAME=DIR (a PEFT LoRA folder or a `zerojax train "
                                         "--lora R --save` folder, served as model NAME)")
    return name, folder


def add_serve_flags(p) -> None:
    from zerojax.arg_types import number

    positive_int = number(int, 1)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-checkpoint", metavar="DIR", help="a Hugging Face folder (safetensors + tokenizer.json)")
    src.add_argument("--checkpoint", metavar="SAVE_DIR",
                     help="a zerojax checkpoint (its weights exported, as `zerojax export` does); the tokenizer from "
                          "--tokenizer (without one: token-id prompts only, no chat)")
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer folder (default: --hf-checkpoint)")
    p.add_argument("--adapter", action="append", type=_adapter, default=[], metavar="NAME=DIR",
                   help="LoRA adapters served as model NAME over the same base: a PEFT folder or a `zerojax "
                        "train --lora R --save` folder (repeatable)")
    p.add_argument("--served-model-name", metavar="NAME", help="the base model's name in requests (default: the "
                                                                   "folder's name)")
    p.add_argument("--quantize", choices=("int8", "nf4", "int4"),
                   help="store the frozen base quantized, as QLoRA does (int8: per output channel; nf4 / int4: "
                        "blocks of 64), dequantized on use; adapters share it")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="weights, compute and KV cache (auto: bf16 on a GPU, else fp32)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=number(int, 0), default=8000)
    p.add_argument("--api-key", metavar="KEY", help="every route but /health then needs Authorization: Bearer KEY")
    p.add_argument("--max-model-len", type=positive_int, metavar="N",
                   help="prompt + new tokens of one request (default: the model's positions, at most the cache)")
    p.add_argument("--page-size", type=positive_int, default=16, metavar="N", help="token slots per KV page")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N", help="requests running at once")
    p.add_argument("--max-batched-tokens", type=positive_int, default=512, metavar="N",
                   help="tokens one engine step feeds: the running decodes plus chunks of waiting prompts")
    p.add_argument("--kv-cache-tokens", type=positive_int, metavar="N",
                   help="the KV cache's size in tokens (default: planned from the device's free memory; on a CPU "
                        "64K tokens)")
    p.add_argument("--memory-fraction", type=number(float, 0, above=True), default=0.9, metavar="F",
                   help="of the device's free memory, the share the cache plan may use (default 0.9)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share cached prompt pages")
    p.add_argument("--decode-attention", choices=("auto", "xla", "kernel"), default="auto",
                   help="how a step (decodes, prompt chunks) reads its rows' pages: the fused Pallas kernel through "
                        "each page table, XLA's products over the pages gathered, or auto (the kernel on a GPU where "
                        "it takes the model's shape; docs/serving.md)")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step's tokens before dispatching the next (default: the next step is dispatched "
                        "first, so the device does not wait on the host between steps)")
    floors = p.add_argument_group("compiled shapes", "the floors of the step's shape buckets (powers of two): "
                                  "higher floors compile fewer programs (seconds each for a large model) for more "
                                  "padding per step")
    floors.add_argument("--min-rows", type=_power_of_two, default=8, metavar="N",
                        help="rows of a decode step, at least (default 8)")
    floors.add_argument("--min-span", type=_power_of_two, default=256, metavar="N",
                        help="KV slots of a row's page table, at least (default 256)")
    floors.add_argument("--min-chunk", type=_power_of_two, default=16, metavar="N",
                        help="tokens of a prompt-chunk row, at least (default 16)")
    p.add_argument("--no-warmup", action="store_true",
                   help="open the port at once; each shape bucket compiles at its first request (default: every "
                        "bucket's step program compiled before the port opens)")


def _power_of_two(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a power of two >= 1 (1, 2, 4, ..., 256, ...)")
    return value


def _load(args):
    import jax
    import jax.numpy as jnp

    from zerojax.serving.llm import load_checkpoint_model, load_model

    dtype = args.dtype if args.dtype != "auto" else ("bf16" if jax.default_backend() == "gpu" else "fp32")
    dtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    if args.checkpoint:  # its weights exported to a Hugging Face folder, read, and the folder removed
        model, tokenizer, adapters = load_checkpoint_model(args.checkpoint, dtype, dict(args.adapter), args.quantize)
    else:
        model, tokenizer, adapters = load_model(args.hf_checkpoint, dtype, dict(args.adapter), args.quantize)
    if args.tokenizer:
        from zerojax.models import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    return model, tokenizer, adapters


def main(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError:
        print(f"error: {SERVE_EXTRA}", file=sys.stderr)
        return 1
    from zerojax.serving.app import build_app
    from zerojax.serving.async_engine import AsyncEngine
    from zerojax.serving.engine import LLMEngine
    from zerojax.serving.metrics import ServingMetrics
    from zerojax.serving.shapes import Buckets

    try:
        model, tokenizer, adapters = _load(args)
        engine = LLMEngine(model, tokenizer, adapters=adapters, page_size=args.page_size,
                           kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
                           max_batched_tokens=args.max_batched_tokens, max_model_len=args.max_model_len,
                           prefix_caching=not args.no_prefix_caching, memory_fraction=args.memory_fraction,
                           buckets=Buckets(args.min_rows, args.min_span, args.min_chunk),
                           decode_attention=args.decode_attention, overlap=not args.no_overlap)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # as `zerojax export` reports a checkpoint's
        print(f"error: {e}", file=sys.stderr)
        return 1
    name = args.served_model_name or os.path.basename(os.path.normpath(args.hf_checkpoint or args.checkpoint))
    metrics = ServingMetrics(lambda: engine.stats)
    aengine = AsyncEngine(engine, metrics)
    app = build_app(aengine, model_name=name, api_key=args.api_key, metrics=metrics)
    print(f"zerojax serve: {engine.plan.describe()}", file=sys.stderr, flush=True)
    if not args.no_warmup:  # before the port opens: the first requests never pay a compile
        start = time.perf_counter()
        programs = engine.warm_up()
        print(f"zerojax serve: warmed up {programs} step programs in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
    print(f"zerojax serve: model {name!r}" + (f", adapters {engine.adapters}" if engine.adapters else "")
          + f" on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    aengine.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        aengine.stop()
    return 0


__all__ = ["add_serve_flags", "main", "SERVE_EXTRA"]
