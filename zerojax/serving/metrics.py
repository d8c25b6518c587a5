"""The server's Prometheus metrics (prometheus-client, its own registry): requests waiting and
running, KV pages in use and total, prompt and generated tokens, time to first token and the time
between tokens, finished requests by reason. The gauges read the engine's counters when scraped."""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a millisecond (a decode step of a small model) to a minute (a long queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class ServingMetrics:
    """stats: a callable returning `LLMEngine.stats` (read at scrape time)."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        for key, doc in (("waiting", "requests queued for pages or a row"), ("running", "requests in the batch"),
                         ("pages_in_use", "KV cache pages held by requests"),
                         ("pages_total", "KV cache pages in the pool"),
                         ("prefix_cache_hits", "prompt pages found in the prefix cache, since start"),
                         ("preemptions", "requests preempted for pages (recomputed), since start"),
                         ("step_programs", "step programs compiled (shape buckets and variants), since start: "
                                           "growing after the warm-up means requests paid a compile")):
            Gauge(f"zerojax_{key}", doc, registry=r).set_function(lambda key=key: stats()[key])
        self.prompt_tokens = Counter("zerojax_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("zerojax_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("zerojax_requests_finished", "finished requests by reason", ["reason"], registry=r)
        self.ttft = Histogram("zerojax_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("zerojax_inter_token_latency_seconds", "time between a request's tokens", registry=r,
                             buckets=LATENCY_BUCKETS)

    def on_output(self, out, arrival: float, last_token_time: float | None) -> None:
        now, n = time.monotonic(), len(out.delta_token_ids)
        if n:
            self.generation_tokens.inc(n)
            if last_token_time is None:
                self.ttft.observe(now - arrival)
            else:
                for _ in range(n):
                    self.itl.observe((now - last_token_time) / n)
        if out.finished:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.finished.labels(out.finish_reason).inc()

    def on_abort(self) -> None:
        self.finished.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServingMetrics", "LATENCY_BUCKETS"]
