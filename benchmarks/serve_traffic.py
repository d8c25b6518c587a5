"""The requests both serving benchmarks send (benchmarks/serve_bench.py over HTTP, serve_bench_hf.py
to transformers' continuous batching): token-id prompts and output lengths drawn like chat traffic
(log-normal, right-skewed, sigma 0.8, scaled to the means), the same for one seed, and the figures
each run reports from per-request token times."""
from __future__ import annotations

import math

import numpy as np

SIGMA = 0.8
LEVELS = (1, 16, 64, 256)


def requests(n: int, *, prompt_mean: int, output_mean: int, max_prompt: int, max_output: int, vocab: int,
             seed: int = 0, long_share: float = 0.0, long_prompt: int = 4096) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length): a `long_share` of them with a `long_prompt`-token prompt."""
    rng = np.random.default_rng(seed)

    def draw(mean, hi):
        x = rng.lognormal(0.0, SIGMA, n) * mean / math.exp(SIGMA ** 2 / 2)  # the log-normal's mean is exp(s^2/2)
        return np.clip(np.rint(x), 8, hi).astype(int)

    prompts, outputs = draw(prompt_mean, max_prompt), draw(output_mean, max_output)
    longs = rng.choice(n, int(round(n * long_share)), replace=False) if long_share else []
    prompts[longs] = long_prompt
    return [(rng.integers(10, vocab - 10, p).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def steady_rate(concurrency: int, runs: list[tuple[float, list[float]]]) -> float | None:
    """Output tokens/s while `concurrency` requests are in flight: from the moment every one of the
    first `concurrency` requests has its first token (the opening prefills done) to the last
    request's start (a closed loop starts one as another ends; after the last start the load thins
    out, and a whole run's rate mixes in that tail, which its longest output sets). None where the
    window is empty (too few requests)."""
    if len(runs) <= concurrency:
        return None
    ordered = sorted(runs, key=lambda r: r[0])
    opened = [times[0] for _, times in ordered[:concurrency] if times]
    if len(opened) < concurrency:
        return None
    w0, w1 = max(opened), ordered[-1][0]
    if w1 <= w0:
        return None
    tokens = sum(1 for _, times in runs for t in times if w0 <= t <= w1)
    return round(tokens / (w1 - w0), 1)


def figures(framework: str, concurrency: int, runs: list[tuple[float, list[float]]], seconds: float, **extra) -> dict:
    """runs: per request (its start, its token arrival times) -> the reported line: output tokens/s
    (the whole run's and the steady state's, `steady_rate`), time to first token and inter-token
    latency (p50 / p99, ms)."""
    ttft = [times[0] - start for start, times in runs if times]
    itl = [b - a for _, times in runs for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for _, times in runs)

    def pct(xs, q):
        return round(1e3 * float(np.percentile(xs, q)), 2) if xs else None

    return {"framework": framework, "concurrency": concurrency, "requests": len(runs), "output_tokens": tokens,
            "seconds": round(seconds, 3), "output_tokens_per_s": round(tokens / seconds, 1),
            "steady_tokens_per_s": steady_rate(concurrency, runs),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), **extra}


def run_matrix(framework: str, s: dict, vocab: int, run_level, extra, long_prompts: bool = True) -> list[dict]:
    """Each level of `s` (serve_bench.shape), then (long_prompts) the one before last with a tenth long prompts:
    an untimed pass (other prompts, 8 new tokens: the programs compile), then the timed one.
    run_level(requests, concurrency) -> (per request (start, token times), seconds); extra() -> more
    keys for the line. Prints a JSON line per level and the table."""
    import json

    draw = dict(prompt_mean=s["prompt_mean"], output_mean=s["output_mean"], max_prompt=s["max_prompt"],
                max_output=s["max_output"], vocab=vocab, long_prompt=s["long_prompt"])
    levels = s["levels"]
    rows = []
    long_level = [(levels[-2 if len(levels) > 2 else -1], 0.1)] if long_prompts else []
    for i, (c, long_share) in enumerate([(c, 0.0) for c in levels] + long_level):
        n = s["requests"](c)
        warm = requests(n, seed=1000 + i, long_share=long_share, **draw)
        run_level([(p, min(o, 8)) for p, o in warm], c)
        runs, seconds = run_level(requests(n, seed=i, long_share=long_share, **draw), c)
        rows.append(figures(framework, c, runs, seconds, model=s["name"], long_prompt_share=long_share, **extra()))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return rows


def table(rows: list[dict]) -> str:
    cols = ["framework", "concurrency", "long_prompt_share", "requests", "output_tokens_per_s", "steady_tokens_per_s",
            "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms",
            "itl_p99_ms"]
    lines = [" | ".join(cols)] + [" | ".join(str(r.get(c)) for c in cols) for r in rows]
    return "\n".join(lines)


__all__ = ["requests", "figures", "table", "run_matrix", "LEVELS"]
