"""zerojax serve under load: the OpenAI-compatible server (uvicorn, in this process, on 127.0.0.1)
over random-init Llama-3.1-8B (bf16, no hub access), and an async load generator (aiohttp) holding
1, 16, 64 and 256 streamed requests in flight; prompt / output lengths drawn like chat traffic
(mean 512 / 256, benchmarks/serve_traffic.py), eos ignored, greedy; the load generator runs in its
own process (`--in-process-client`: in the server's, sharing its interpreter). Per level: output tokens/s,
time to first token and inter-token latency p50 / p99, from each streamed chunk's arrival (a
chunk per token). Then concurrency 64 again with a tenth of the prompts 3,072 tokens long (the
chunked prefill's test: TTFT p99 beside the run without them). Each level runs once untimed first
with other prompts and 8 new tokens (its programs compile there).

    PYTHONPATH=. python benchmarks/serve_bench.py                 # one GPU: the table + JSON lines
    PYTHONPATH=. python benchmarks/serve_bench.py --tiny          # CPU smoke test: tiny shapes
    PYTHONPATH=. python benchmarks/serve_bench_hf.py              # the anchor: transformers' continuous batching
    PYTHONPATH=. python benchmarks/serve_bench.py --adapters 8 --levels 64   # 8 LoRA adapters over the base
    PYTHONPATH=. python benchmarks/serve_bench.py --profile 1,64             # then where a served step's time goes

--profile C1,C2: before the matrix, each concurrency once under `jax.profiler.trace`: the engine's steps
in the window, wall ms a step beside the card's busy ms a step (the union of its kernels; the rest is
the card waiting on the host or the network) and the kernels by ms a step.

Needs fastapi, uvicorn, prometheus-client (the serve extra), pydantic, starlette and aiohttp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import serve_traffic  # noqa: E402

LONG_PROMPT = 3072


def shape(tiny: bool, host_bound: bool = False) -> dict:
    if host_bound:  # 128 short streams of a tiny model: the server's own host work per token dominates
        return dict(name="tiny", levels=(128,), prompt_mean=16, output_mean=64, max_prompt=32, max_output=90,
                    max_model_len=128, long_prompt=64, max_num_seqs=128, max_batched_tokens=512,
                    requests=lambda c: 2 * c)
    if tiny:
        return dict(name="tiny", levels=(1, 4), prompt_mean=24, output_mean=12, max_prompt=48, max_output=24,
                    max_model_len=128, long_prompt=64, max_num_seqs=8, max_batched_tokens=64, requests=lambda c: 6)
    return dict(name="llama-3.1-8b", levels=serve_traffic.LEVELS, prompt_mean=512, output_mean=256, max_prompt=2048,
                max_output=1024, max_model_len=4096, long_prompt=LONG_PROMPT, max_num_seqs=256,
                max_batched_tokens=2048, requests=lambda c: min(max(8, 4 * c), 1024))


def lora_copies(model, n: int) -> dict:
    """n LoRA adapters (r 16 on every linear) over `model`'s arrays, not copies: made with one
    seed (their programs are the same: the seed is part of the adapter's static settings), then
    each shifted by its own offset, so that each has its own weights."""
    import jax
    from flax import nnx

    from zerojax import lora

    graphdef, state = nnx.split(model)
    out = {}
    for i in range(n):
        m = lora.apply(nnx.merge(graphdef, state), {"r": 16, "target_modules": "all-linear",
                                                     "init_lora_weights": "gaussian", "seed": 0})
        nnx.update(m, jax.tree.map(lambda x, i=i: x + 0.01 * i, nnx.state(m, nnx.Param)))
        out[f"lora{i}"] = m
    return out


def build_engine(s: dict, tiny: bool, adapters: int = 0, decode_attention: str = "auto", overlap: bool = True):
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models import Llama, LlamaConfig
    from zerojax.serving import LLMEngine
    from zerojax.serving.shapes import Buckets

    model = Llama(LlamaConfig.named(s["name"]), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    # an 8B program compiles in tens of seconds: high floors keep the programs few. The decode
    # kernel reads only each row's own pages, so a decode's page table may be as wide as the context
    # at no cost (one width: decode rows 32, 64, 128, 256; chunks of 512, 1024, 2048 tokens: 7
    # programs); XLA's decodes gather the whole table, so they keep two widths (2048, 4096 slots: 14)
    span = 2048 if decode_attention == "xla" else s["max_model_len"]
    buckets = Buckets() if tiny else Buckets(min_rows=32, min_span=span, min_chunk=512)
    return model, LLMEngine(model, None, adapters=lora_copies(model, adapters), max_num_seqs=s["max_num_seqs"],
                            max_batched_tokens=s["max_batched_tokens"], max_model_len=s["max_model_len"],
                            buckets=buckets, decode_attention=decode_attention, overlap=overlap)


def start_server(engine) -> tuple[str, object]:
    import uvicorn

    from zerojax.serving.app import build_app
    from zerojax.serving.async_engine import AsyncEngine
    from zerojax.serving.metrics import ServingMetrics

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    metrics = ServingMetrics(lambda: engine.stats)
    aengine = AsyncEngine(engine, metrics)
    aengine.start()
    server = uvicorn.Server(uvicorn.Config(build_app(aengine, model_name="bench", metrics=metrics), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_keep_alive=600))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def profile_level(engine, s: dict, vocab: int, concurrency: int, run) -> dict:
    """A pass of `concurrency` under the profiler: {steps, wall / busy / idle ms a step, the engine
    thread's ms a step, top kernels}. run(requests, concurrency) serves them (as the matrix's levels do)."""
    import tempfile

    import jax
    from kernel_categories import union_length
    from trace_kernels import kernels, xplane_file

    # the engine thread's time a step: in _dispatch (building rows, launching), in _read_pending
    # (mostly waiting for the device), all of step(), and between steps (requests in, outputs out)
    clock = {"steps": 0, "dispatch": 0.0, "read": 0.0, "step": 0.0, "between": 0.0, "last_end": None}
    originals = {name: getattr(engine, name) for name in ("step", "_dispatch", "_read_pending")}

    def timed(name, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return originals[name](*a, **k)
            finally:
                clock[key] += time.perf_counter() - t
        return call

    def counted():
        t = time.perf_counter()
        if clock["last_end"] is not None:
            clock["between"] += t - clock["last_end"]
        clock["steps"] += 1
        try:
            return originals["step"]()
        finally:
            clock["last_end"] = time.perf_counter()
            clock["step"] += clock["last_end"] - t

    warm, reqs = (serve_traffic.requests(max(2, concurrency), seed=seed, long_share=0.0, prompt_mean=s["prompt_mean"],
                                         output_mean=min(s["output_mean"], 64), max_prompt=s["max_prompt"],
                                         max_output=64, vocab=vocab, long_prompt=s["long_prompt"]) for seed in (8, 7))
    # untimed first, as the matrix's levels (other prompts: no prefix cache hit in the profiled pass)
    run([(prompt, 8) for prompt, _ in warm], concurrency)
    engine.step, engine._dispatch = counted, timed("_dispatch", "dispatch")
    engine._read_pending = timed("_read_pending", "read")
    trace_dir = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(trace_dir):
            _, wall = run(reqs, concurrency)  # the load generator's clock: not its process's start
    finally:
        for name in originals:  # the instance attributes dropped: the class's methods again
            delattr(engine, name)
    found = kernels(xplane_file(trace_dir), jax.default_backend() != "gpu")
    n = max(clock["steps"], 1)
    busy = union_length((k.start_ns, k.end_ns) for k in found) / 1e6 / n
    sums: dict[str, list] = {}
    for k in found:
        row = sums.setdefault(k.name, [0.0, 0])
        row[0] += (k.end_ns - k.start_ns) / 1e6 / n
        row[1] += 1
    top = sorted(((ms, c, name) for name, (ms, c) in sums.items()), reverse=True)[:15]
    host = {f"{key}_ms_per_step": round(1e3 * clock[key] / n, 3) for key in ("dispatch", "read", "step", "between")}
    return {"concurrency": concurrency, "steps": clock["steps"], "wall_ms_per_step": round(1e3 * wall / n, 3),
            "busy_ms_per_step": round(busy, 3), "idle_ms_per_step": round(1e3 * wall / n - busy, 3), **host,
            "top": [(round(ms, 4), c, name[:100]) for ms, c, name in top]}


async def _one(session, url, prompt, new, model):
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, times = time.perf_counter(), []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                if json.loads(line[6:]).get("choices"):
                    times.append(time.perf_counter())
    return start, times


def level_in_subprocess(url, reqs, concurrency: int, models=("bench",)):
    """`level` run by a load generator in its own process, as clients are: its parsing of every
    streamed chunk does not take the server's interpreter (its GIL) from the engine thread."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"url": url, "requests": reqs, "concurrency": concurrency, "models": list(models)}, f)
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--client", f.name], capture_output=True,
                              text=True)
    finally:
        os.unlink(f.name)
    if done.returncode:
        raise RuntimeError(f"the load generator failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return [(start, times) for start, times in result["runs"]], result["seconds"]


def client_main(path: str) -> int:
    """--client: the load generator's process: the level in `path` (JSON), its runs as one JSON line."""
    with open(path) as f:
        job = json.load(f)
    runs, seconds = asyncio.run(level(job["url"], [tuple(r) for r in job["requests"]], job["concurrency"],
                                      tuple(job["models"])))
    print(json.dumps({"runs": runs, "seconds": seconds}))
    return 0


async def level(url, reqs, concurrency: int, models=("bench",)):
    """The requests streamed `concurrency` at a time, the i-th to models[i % len(models)]."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def run(prompt, new, model):
            async with gate:
                return await _one(session, url, prompt, new, model)

        start = time.perf_counter()
        runs = await asyncio.gather(*(run(p, n, models[i % len(models)]) for i, (p, n) in enumerate(reqs)))
    return runs, time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny Llama shape, levels 1 and 4")
    ap.add_argument("--host-bound", action="store_true",
                    help="CPU: a tiny Llama at 128 streams (256 requests of ~64 tokens), where the HTTP layer's and "
                         "the engine thread's work per token, not the model, sets the rate")
    ap.add_argument("--levels", type=lambda t: tuple(int(x) for x in t.split(",")), default=None,
                    help="concurrency levels, e.g. 64 (default 1,16,64,256; the last but one again with long prompts)")
    ap.add_argument("--adapters", type=int, default=0, metavar="N",
                    help="serve N LoRA adapters (r 16, all linears) over the base and send the requests round-robin "
                         "to them: the multi-adapter case, beside a run without")
    ap.add_argument("--decode-attention", choices=("auto", "xla", "kernel"), default="auto",
                    help="how decode steps read the pages (the engine's option; auto: the kernel on a GPU)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each step's tokens before dispatching the next (the engine's overlap=False): the "
                         "comparison with overlapped steps")
    ap.add_argument("--no-long-prompts", action="store_true",
                    help="leave out the closing level with a tenth of the prompts long (the chunked prefill's test)")
    ap.add_argument("--in-process-client", action="store_true",
                    help="run the load generator in the server's process (as before: its parsing shares the "
                         "engine thread's interpreter), not in its own")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # the load generator's own process: a level's JSON
    ap.add_argument("--profile", type=lambda t: tuple(int(x) for x in t.split(",")), default=(), metavar="LEVELS",
                    help="before the matrix, these concurrency levels (e.g. 1,64) under the profiler: wall vs "
                         "the card's busy time a step, the kernels by time")
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args.client)
    import jax

    # a second run of this benchmark reuses the compiled programs
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/zerojax-serve-bench"))

    tiny = args.tiny or args.host_bound
    s = shape(args.tiny, args.host_bound)
    if args.levels:
        s["levels"] = args.levels
    model, engine = build_engine(s, tiny, args.adapters, args.decode_attention, not args.no_overlap)
    models = engine.adapters or ["bench"]
    print(engine.plan.describe(), flush=True)
    start = time.perf_counter()
    print(f"warmed up {engine.warm_up()} step programs in {time.perf_counter() - start:.0f} s", flush=True)
    url, server = start_server(engine)
    device = str(jax.devices()[0].device_kind)
    if args.in_process_client:
        run = lambda reqs, c: asyncio.run(level(url, reqs, c, models))  # noqa: E731
    else:
        run = lambda reqs, c: level_in_subprocess(url, reqs, c, models)  # noqa: E731
    for concurrency in args.profile:
        p = profile_level(engine, s, model.config.vocab_size, concurrency, run)
        print(f"profile at concurrency {p['concurrency']}: {p['steps']} steps, {p['wall_ms_per_step']} ms a step "
              f"wall, the card busy {p['busy_ms_per_step']} ms, idle {p['idle_ms_per_step']} ms; the engine thread: "
              f"in step() {p['step_ms_per_step']} ms (dispatch {p['dispatch_ms_per_step']}, reading tokens "
              f"{p['read_ms_per_step']}), between steps {p['between_ms_per_step']} ms")
        for ms, c, name in p["top"]:
            print(f"  {ms:8.3f} ms/step {c:6d}x  {name}")
        print(json.dumps({"profile": p}), flush=True)
    serve_traffic.run_matrix("zerojax", s, model.config.vocab_size, run,
                             lambda: {"device": device, "preemptions": engine.stats["preemptions"],
                                      "adapters": len(engine.adapters),
                                      "decode_attention": "kernel" if engine.decode_kernel else "xla",
                                      "overlap": engine.overlap},
                             long_prompts=not args.no_long_prompts)
    server.should_exit = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
