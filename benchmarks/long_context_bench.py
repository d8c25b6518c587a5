"""Long-context training: tokens/s and peak memory at long rows, and the longest row that fits.

    python benchmarks/long_context_bench.py throughput --seq 2048 32768          # Llama-3.2-1B shape
    python benchmarks/long_context_bench.py throughput --seq 2048 32768 --mlp-tile 0 2048
    python benchmarks/long_context_bench.py longest --cap-gib 24                 # Llama-3.1-8B LoRA r16
    python benchmarks/long_context_bench.py longest --cap-gib 23.77 --remat offload full \
        --attention cudnn blockwise --docs 1 --start 65536 --limit 65536
    python benchmarks/long_context_bench.py longest-full                         # Llama-3.1-8B, every weight
    python benchmarks/long_context_bench.py throughput --tiny                    # CPU smoke test
    python benchmarks/long_context_bench.py longest --tiny
    python benchmarks/long_context_bench.py longest-full --tiny

Rows are random ids, --docs packed documents a row (default 4: segment ids, which the blockwise
attention masks by and cuDNN / XLA take as a dense [T, T] mask; 1: one document, no segment ids,
attended causally over the whole row as the PyTorch anchor benchmarks/long_context_torch.py does).

throughput: one row of each --seq length per device (micro 1), bf16 compute, fp32 master, AdamW,
ZeRO-2, --remat (default "full"), the chunked loss, the attention --attention (default "blockwise":
no [T, T] scores; "cudnn": the fused kernel; "xla": the dense path, for the before), --mlp-tile
(ALST's tiled MLP: one value for every length, or one per --seq length, 0 = untiled) and --sp
(sequence_parallel_size over the local devices). Each length runs in this process after the
previous one: tokens/s per device after warm-up, the allocator's peak, and the compiled step's
predicted peak (XLA's memory analysis). Each row also has "flops_per_token": 6N + 12·L·w·P / T,
P the query-key pairs the mask keeps in a row (`kept_pairs`: causal within each packed document,
documents not attending to each other; T(T+1)/2 for one document), no recompute;
"achieved_tflops" = tokens/s x flops_per_token (per device); "flops_per_token_run": that count
plus what this run recomputes (the remat policy's forward, the tiled MLP's extra MLP forward);
and "flops_per_token_dense", the count `zerojax estimate` prints ("GFLOPs per training token at
seq N", `zerojax.planning.estimate.train_flops_per_token`: every token charged all T keys, T^2
pairs a row). The dense count charges a 32K row of 4 documents 8x the attention it computes
(T^2 against ~T^2 / 8), so its achieved FLOP/s flattered long rows: the 32K / 2K comparison
(benchmarks/cases_scale.py) is in tokens/s and in FLOP/s of the kept count.

longest: Llama-3.1-8B's shape with LoRA r16 alpha 32 on every linear layer (bf16 base, frozen),
micro 1. For each configuration, --remat policy x --attention (in that order), the longest row
is the planner's (`zerojax.planning.planner.longest_row`, what `zerojax train --seq-len auto`
runs: compiled peaks against --cap-gib and the host memory, nothing allocated): doubling from
--start (halving first where it does not fit), then bisection, in multiples of --granule (default
the planner's 128), capped only by --limit (default none). Then --real-steps real steps (the
first compiles; the rest timed) at the longest length found (the configuration found first on a
tie), whose allocator peak is printed beside the prediction. Run it with the cap also given to the
allocator (XLA_PYTHON_CLIENT_MEM_FRACTION) so that the real step is held to it.

longest-full: Llama-3.1-8B's shape, every weight trained, on one device: bf16 compute, the fp32
master and AdamW's m and v kept off the device (DeepSpeed's `zero_optimization.offload_optimizer:
{"device": "cpu", "pin_memory": true}`: pinned host memory), ZeRO-2, the tiled MLP (--mlp-tile,
default 2048), the chunked loss, micro 1; configurations --remat (default "full" then "offload":
the "offload" policy keeps each layer's input in pinned host memory instead of on the device) x
--attention, searched by the same doubling and bisection (`zerojax.engine.memory.longest_fitting`;
default --start 65536) with this bench's own judge of each length: it is judged on the
device (`Engine.step_memory`: the compiled step's peak, plus with the "host" loop its chunks on
the device, against --cap-gib, default the allocator's limit) AND on the host (the optimizer
state's bytes in host memory, read off the engine's state, plus the offloaded layer inputs, or
XLA's host temporaries where larger, against --host-gib less --host-reserve-gib); the real steps
run at the longest length that fit both. By default the offload loop is "in_place" (the
optimizer's chunks come to the device inside the step, after the backward, one layer at a time:
they never share the device with the activations; --offload-loop host prefetches chunks before
the step and keeps write-backs in flight: at this shape 21.5 GiB beside the activations, the
embedding + LM head chunk alone 11.7 GiB), the master is fp32 (--split-master: the bf16 compute
copy + a 16-bit remainder, 2 bytes a parameter less) and so is m (--adam-mu-dtype bfloat16: 2
bytes a parameter less).

Expected lengths for longest-full (from the arithmetic below, not measured). Host: the GPU
machine has 128 GiB (137.4 GB) of RAM. 8.03e9 parameters x 12 bytes (fp32 master + m + v) = 96.4 GB
(89.7 GiB) of pinned host memory; the process itself (the JAX runtime and its programs, staging,
Python) is taken as ~16 GB (--host-reserve-gib 15), leaving ~25 GB (23.3 GiB) for host-offloaded
activations. A layer's input is a bf16 residual row: 32 layers x 4096 x 2 bytes = 256 KiB a
token: 16 GiB at 65,536, 32 GiB at 131,072. Device: an 80 GB H100 at XLA_PYTHON_CLIENT_MEM_FRACTION
0.95 gives 75.7 GiB; the bf16 weights take 15.0 GiB and the gradients 29.9 GiB in fp32 (15.0 if
XLA keeps them bf16); the in_place update adds its largest chunk (11.7 GiB) only after the
backward (56.6 GiB then). One layer's recomputation in the backward: with cuDNN's attention on
unpacked rows a few [T, d] arrays, ~4 GiB at 65,536 and ~8 at 131,072; the blockwise attention
adds fp32 [heads, T, block] scores (4 GiB each at 65,536, block 512) and fp32 q / dq / o / do
(1 GiB each): ~14 GiB at 65,536.
  - "full", cuDNN: 65,536 needs 15 + 30 + 16 + 4 = ~65 GiB: fits; 131,072 needs 15 + 30 + 32 + 8 =
    ~85: does not (~70 if the gradients stay bf16). Expected: 65,536, nothing offloaded to the
    host beyond the optimizer. (Blockwise: 15 + 30 + 16 + 14 = ~75 GiB at 65,536, the edge.)
  - "offload": the layer inputs go to the host. 65,536: 89.7 + 16 = 105.7 GiB of the 113 on the
    host, ~49 on the device: fits; 131,072: 89.7 + 32 = 121.7 GiB on the host: does not (25 GB /
    256 KiB = ~95K tokens). Expected: 65,536, set by the host, not the GPU. With --split-master
    --adam-mu-dtype bfloat16 the host state is 8 bytes a parameter (59.8 GiB), and 131,072 (91.8
    GiB on the host, ~53 on the device) is expected to fit.
The 2026-12-05 full fine-tune of this shape (ZeRO-3, parameters and optimizer offloaded, 89.7 GiB
of host state) peaked at 117.5 GiB host RSS (benchmarks/RESULTS.md, "Llama-3.1-8B full fine-tune, 24 GB cap"),
so the process may take more than the 16 GB assumed: the real step's row reports the host's peak
RSS.

Bounded runs: --limit caps the lengths tried (the suite's timed calls give one); --length-timeout
S gives each phase (one length's compile, the build, the real steps) at most S seconds, --deadline
S the whole run; either, when it passes, prints a JSON row {"timed_out": true, "phase": ...,
"seq": ...}, writes --out and exits 124 (the compile or step in flight cannot be interrupted
otherwise). Real steps after the first
are skipped where 1.5 x the first step's time would pass --deadline.

Prints one JSON line per measurement and writes them all to --out (default
long_context_results.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GiB = 2**30
HOST_KINDS = ("pinned_host", "unpinned_host")


def ds_config(*, sp: int, stage: int = 2, lora: bool = False, remat: str = "full",
              offload_optimizer: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "activation_checkpointing": {"remat_policy": remat}, "sequence_parallel_size": sp,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}
    if lora:
        cfg["optimizer"]["params"]["lr"] = 2e-4
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return cfg


def model_factory(name: str, *, attention: str, block: int, mlp_tile: int | None, lora: bool):
    import jax.numpy as jnp
    from flax import nnx

    from zerojax import lora as lora_mod
    from zerojax.models import Llama, LlamaConfig

    cfg = LlamaConfig.named(name)

    def make():
        param_dtype = jnp.bfloat16 if lora else jnp.float32
        m = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=param_dtype, attention_impl=attention,
                  attention_block=block, mlp_tile=mlp_tile)
        if lora:
            m = lora_mod.apply(m, {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
        return m

    return make, cfg


def batch_of(rows: int, seq: int, vocab: int, docs: int = 4, seed: int = 0):
    """Random ids [rows, seq]; `docs` packed documents a row (segment ids), none for 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    if docs <= 1:
        return {"input_ids": ids}
    # packed documents: the segment ids take the blockwise path's masking (a dense mask elsewhere)
    seg = np.repeat(np.arange(1, docs + 1), -(-seq // docs))[:seq][None].repeat(rows, 0).astype(np.int32)
    return {"input_ids": ids, "segment_ids": seg}


def doc_lengths(seq: int, docs: int) -> list[int]:
    """The lengths of the documents `batch_of` packs into a row: `docs` runs of ceil(seq / docs)
    tokens, the last cut short (a row shorter than `docs` holds fewer)."""
    size = -(-seq // max(docs, 1))
    return [min(size, seq - start) for start in range(0, seq, size)]


def kept_pairs(seq: int, docs: int) -> int:
    """The query-key pairs of a row the attention mask keeps: causal within each packed document
    (a query sees itself and the keys before it), none across documents."""
    return sum(n * (n + 1) // 2 for n in doc_lengths(seq, docs))


def masked_flops_per_token(shape, seq: int, docs: int, remat=None, tiled_mlp: bool = False) -> float:
    """Training FLOPs a token with attention counted over the kept pairs only: `zerojax estimate`'s
    count (`train_flops_per_token`, whose attention term charges every token all T keys, T^2 pairs
    a row) with that term scaled to `kept_pairs` / T^2. The term is what the count adds over a
    row of length 0, so remat's recompute of attention scales with it."""
    import dataclasses

    from zerojax.planning.estimate import train_flops_per_token

    at = lambda t: train_flops_per_token(dataclasses.replace(shape, seq_len=t), remat, tiled_mlp)  # noqa: E731
    return at(0) + (at(seq) - at(0)) * kept_pairs(seq, docs) / seq**2


def shapes_of(batch):
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)


def peak_gib():
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / GiB, 3) if "peak_bytes_in_use" in stats else None


def host_rss_peak_gib() -> float:
    """This process's peak resident set (Linux: ru_maxrss in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def host_total_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def first_error_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


class Watchdog:
    """The run's bounds: `total_s` for the whole run, `phase_s` for each phase (`phase()` starts
    one). When either passes, `on_timeout(row)` gets a {"timed_out": true, ...} row and the
    process exits 124 (a compile or a step in flight cannot be interrupted from Python)."""

    def __init__(self, bench: str, total_s: float | None, phase_s: float | None, on_timeout):
        self.bench, self.total_s, self.phase_s, self.on_timeout = bench, total_s, phase_s, on_timeout
        self.t0 = self.phase_t0 = time.perf_counter()
        self.name, self.seq = "start", None
        if total_s or phase_s:
            threading.Thread(target=self._watch, daemon=True).start()

    def phase(self, name: str, seq: int | None = None) -> None:
        self.name, self.seq, self.phase_t0 = name, seq, time.perf_counter()

    def remaining(self) -> float | None:
        return None if not self.total_s else self.total_s - (time.perf_counter() - self.t0)

    def _watch(self):
        while True:
            time.sleep(0.5)
            now = time.perf_counter()
            over_total = self.total_s and now - self.t0 > self.total_s
            over_phase = self.phase_s and now - self.phase_t0 > self.phase_s
            if over_total or over_phase:
                self.on_timeout({"bench": self.bench, "timed_out": True, "phase": self.name, "seq": self.seq,
                                 "limit": "deadline" if over_total else "length-timeout",
                                 "phase_s": round(now - self.phase_t0, 1), "run_s": round(now - self.t0, 1),
                                 "host_rss_peak_gib": host_rss_peak_gib()})
                os._exit(124)


def tiles_for(args) -> list:
    """--mlp-tile per --seq length (None = untiled)."""
    tiles = args.mlp_tile or [0]
    if len(tiles) == 1:
        tiles = tiles * len(args.seq)
    if len(tiles) != len(args.seq):
        raise SystemExit(f"--mlp-tile: one value, or one per --seq length ({len(args.seq)}), not {len(tiles)}")
    return [t or None for t in tiles]


def throughput(args, emit, dog):
    import jax

    import zerojax
    from zerojax.models import chunked_llama_loss
    from zerojax.planning.estimate import train_flops_per_token
    from zerojax.planning.memory import CompiledMemory
    from zerojax.planning.planner import model_shape

    if len(args.remat) != 1 or len(args.attention) != 1:
        raise SystemExit("throughput: one --remat policy and one --attention")
    remat, attention = args.remat[0], args.attention[0]
    name = "tiny" if args.tiny else args.model
    for seq, tile in zip(args.seq, tiles_for(args)):
        dog.phase("throughput", seq)
        make, cfg = model_factory(name, attention=attention, block=args.block, mlp_tile=tile, lora=False)
        shape = model_shape(make, seq)
        dense = train_flops_per_token(shape)  # `zerojax estimate`'s "GFLOPs per training token at seq N"
        flops = masked_flops_per_token(shape, seq, args.docs)  # the pairs the mask keeps
        flops_run = masked_flops_per_token(shape, seq, args.docs, None if remat == "none" else remat,
                                           tiled_mlp=tile is not None)
        eng = zerojax.shard(make, ds_config(sp=args.sp, remat=remat), loss_fn=chunked_llama_loss(args.loss_chunk),
                            options=zerojax.EngineOptions(memory_guard=False))
        rows = eng.layout.cfg.train_batch_size
        batch = batch_of(rows, seq, cfg.vocab_size, args.docs)
        predicted = CompiledMemory.of(eng.compiled_step(shapes_of(batch))).peak
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            eng.train_step(batch)
        eng.synchronize()
        t1 = time.perf_counter()
        for _ in range(args.steps):
            metrics = eng.train_step(batch)
        eng.synchronize()
        dt = (time.perf_counter() - t1) / args.steps
        tps = rows * seq / dt / jax.device_count()
        emit({"bench": "throughput", "model": name, "seq": seq, "rows": rows, "sp": args.sp,
              "attention": attention, "docs": args.docs, "mlp_tile": tile, "remat": remat,
              "step_s": round(dt, 4), "warmup_s": round(t1 - t0, 2), "tokens_per_s_per_device": round(tps, 1),
              "flops_per_token": flops, "achieved_tflops": round(tps * flops / 1e12, 3),
              "flops_per_token_run": flops_run, "flops_per_token_dense": dense,
              "predicted_peak_gib": round(predicted / GiB, 3),
              "peak_gib": peak_gib(), "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind})
        del eng


def search(probe, start: int, limit: int | None, granule: int) -> int | None:
    """The longest length, a multiple of `granule`, that `probe(seq)` passes (True fits; False
    and None, a compile error, do not): the planner's doubling then bisection
    (`zerojax.engine.memory.longest_fitting`) from `start`, halving first where `start` does not
    fit; capped only by `limit` (None: none). None where even one granule does not fit."""
    from zerojax.engine.memory import longest_fitting

    n, _ = longest_fitting(lambda n: bool(probe(n * granule)), max(1, start // granule),
                           None if limit is None else limit // granule)
    return n * granule or None


def search_all(args, longest_of) -> tuple[dict, tuple | None]:
    """`longest_of(remat, attention)` (the longest row of that configuration, or None) for each
    configuration in --remat x --attention order -> ({"remat/attention": longest or None}, the
    configuration of the longest, the first found on a tie; None where nothing fit)."""
    found, best, best_key = {}, None, None
    for remat in args.remat:
        for attention in args.attention:
            seq = longest_of(remat, attention)
            found[f"{remat}/{attention}"] = seq
            if seq is not None and (best is None or seq > best):
                best, best_key = seq, (remat, attention)
    return found, best_key


def real_steps(eng, batch, n: int, dog) -> tuple:
    """n real steps on `batch` (the first compiles, the rest timed; skipped where 1.5 x the first's
    time would pass the deadline) -> (first step's seconds, timed steps' mean or None, last metrics)."""
    import jax

    t0 = time.perf_counter()
    metrics = eng.train_step(batch)
    eng.synchronize()
    jax.block_until_ready(eng.state)
    first = time.perf_counter() - t0
    left = dog.remaining()
    if n < 2 or (left is not None and left < 1.5 * first * (n - 1)):
        return first, None, metrics
    dog.phase("timed steps", dog.seq)
    t1 = time.perf_counter()
    for _ in range(n - 1):
        metrics = eng.train_step(batch)
    eng.synchronize()
    jax.block_until_ready(eng.state)
    return first, (time.perf_counter() - t1) / (n - 1), metrics


def is_oom(e: BaseException) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def run_longest(args, emit, dog, *, bench: str, label: str, seq: int, build, vocab: int) -> tuple:
    """Build the real engine (`build()`) and run --real-steps at `seq`; where that runs out of
    memory (a prediction that fit but a run that did not), a "<bench>-oom" row says so and the
    half length is tried once -> (engine, the length that ran, build seconds, first step's
    seconds, timed mean or None, last metrics)."""
    import gc

    for attempt in (0, 1):
        dog.phase(f"build ({label})", seq)
        eng = None
        try:
            t0 = time.perf_counter()
            eng = build()
            build_s = time.perf_counter() - t0
            batch = batch_of(eng.layout.cfg.train_batch_size, seq, vocab, args.docs)
            dog.phase(f"first step ({label})", seq)
            first, dt, metrics = real_steps(eng, batch, args.real_steps, dog)
            return eng, seq, build_s, first, dt, metrics
        except Exception as e:  # noqa: BLE001 - out of memory: say so, try the half length once
            if not is_oom(e) or attempt or seq // 2 < args.granule:
                raise
            emit({"bench": f"{bench}-oom", "seq": seq, "config": label, "fits": False, "phase": dog.name,
                  "error": first_error_line(e), "peak_gib": peak_gib()})
            del eng
            gc.collect()
            seq //= 2


def longest(args, emit, dog):
    import jax

    import zerojax
    from zerojax.models import chunked_llama_loss
    from zerojax.planning.planner import longest_row

    name = "tiny" if args.tiny else args.lora_model
    tile = (args.mlp_tile or [0])[0] or None
    factory = lambda attention: model_factory(name, attention=attention, block=args.block,  # noqa: E731
                                              mlp_tile=tile, lora=True)
    cap = int(args.cap_gib * GiB)
    loss_fn = chunked_llama_loss(args.loss_chunk)
    options = zerojax.EngineOptions(memory_guard=False)
    vocab = factory(args.attention[0])[1].vocab_size

    batch_fn = lambda rows, seq: shapes_of(batch_of(rows, seq, vocab, args.docs))  # noqa: E731

    def longest_of(remat, attention):
        # the planner's search (compiled peaks, nothing allocated): the same as zerojax train --seq-len auto
        dog.phase(f"search ({remat}/{attention})", args.start)
        row = {"bench": "longest-search", "model": name, "remat": remat, "attention": attention, "docs": args.docs,
               "mlp_tile": tile, "cap_gib": args.cap_gib}
        t0 = time.perf_counter()
        try:
            found = longest_row(factory(attention)[0], ds_config(sp=args.sp, lora=True, remat=remat), cap,
                                start=args.start, cap=args.limit, granule=args.granule, loss_fn=loss_fn,
                                batch_fn=batch_fn, options=options)
        except Exception as e:  # noqa: BLE001 - nothing fits, or a compile that fails: this configuration has none
            emit({**row, "seq": None, "error": first_error_line(e)})
            return None
        emit({**row, **found.to_dict(), "search_s": round(time.perf_counter() - t0, 1)})
        return found.seq_len

    found, key = search_all(args, longest_of)
    if key is None:
        emit({"bench": "longest", "model": name, "seq": None, "cap_gib": args.cap_gib, "found": found})
        return
    (remat, attention), best = key, found[f"{key[0]}/{key[1]}"]
    eng, ran, build_s, first, dt, metrics = run_longest(
        args, emit, dog, bench="longest", label=f"{remat}/{attention}", seq=best, vocab=vocab,
        build=lambda: zerojax.shard(factory(attention)[0], ds_config(sp=args.sp, lora=True, remat=remat),
                                    loss_fn=loss_fn, options=options))
    rows = eng.layout.cfg.train_batch_size
    emit({"bench": "longest", "model": name, "seq": ran, "predicted_longest": best, "remat": remat,
          "attention": attention, "docs": args.docs, "mlp_tile": tile, "found": found, "limit": args.limit,
          "cap_gib": args.cap_gib, "build_s": round(build_s, 1),
          "first_step_s": round(first, 3), "step_s": None if dt is None else round(dt, 3),
          "tokens_per_s_per_device": None if dt is None else round(rows * ran / dt / jax.device_count(), 1),
          "peak_gib": peak_gib(), "host_rss_peak_gib": host_rss_peak_gib(), "loss": float(metrics["loss"]),
          "device": jax.devices()[0].device_kind})


def host_state_bytes(eng) -> int:
    """Bytes of the engine's (abstract) state in host memory kinds: the offloaded master and
    optimizer state."""
    import jax

    total = 0
    for x in jax.tree.leaves(eng.state):
        if getattr(getattr(x, "sharding", None), "memory_kind", None) in HOST_KINDS:
            total += x.size * x.dtype.itemsize
    return total


def longest_full(args, emit, dog):
    import jax

    import zerojax
    from zerojax.engine.engine import abstract_engine
    from zerojax.models import chunked_llama_loss
    from zerojax.planning import memory

    name = "tiny" if args.tiny else args.full_model
    tile = (args.mlp_tile or [0])[0] or None
    factory = lambda attention: model_factory(name, attention=attention, block=args.block,  # noqa: E731
                                              mlp_tile=tile, lora=False)
    cfg = factory(args.attention[0])[1]
    budget = memory.device_budget()
    cap_gib = args.cap_gib if args.cap_gib is not None else (budget / GiB if budget else None)
    cap = float("inf") if cap_gib is None else cap_gib * GiB
    host_gib = args.host_gib if args.host_gib is not None else host_total_gib()
    host_budget = (host_gib - args.host_reserve_gib) * GiB
    loss_fn = chunked_llama_loss(args.loss_chunk)
    options = zerojax.EngineOptions(memory_guard=False, split_master="on" if args.split_master else "off",
                                    adam_mu_dtype=args.adam_mu_dtype, offload_loop=args.offload_loop)
    config = lambda remat: ds_config(sp=1, remat=remat, offload_optimizer=True)  # noqa: E731
    layer_input_bytes = cfg.num_hidden_layers * cfg.hidden_size * 2  # one bf16 residual row a layer, per token
    predicted = {}

    def probe(remat, attention, seq):
        dog.phase(f"compile ({remat}/{attention})", seq)
        row = {"bench": "longest-full-probe", "model": name, "remat": remat, "attention": attention,
               "docs": args.docs, "seq": seq, "mlp_tile": tile}
        t0 = time.perf_counter()
        try:
            eng = abstract_engine(factory(attention)[0], config(remat), loss_fn=loss_fn, options=options)
            rows = eng.layout.cfg.train_batch_size
            state = host_state_bytes(eng)
            formula = layer_input_bytes * seq * rows if remat == "offload" else 0
            if state + formula > host_budget:  # too big for the host whatever the compile says: not compiled
                emit({**row, "predicted_peak_gib": None, "host_state_gib": round(state / GiB, 3),
                      "host_activations_gib": round(formula / GiB, 3), "host_budget_gib": round(host_budget / GiB, 2),
                      "fits_host": False, "fits": False})
                return False
            mem = eng.step_memory(shapes_of(batch_of(rows, seq, cfg.vocab_size, args.docs)))
        except Exception as e:  # noqa: BLE001 - a compile that fails (out of memory included) ends this search
            emit({**row, "fits": False, "error": first_error_line(e)})
            return None
        activations = max(formula, mem.host_temp)  # XLA's host temporaries, where it reports them larger
        fits_device, fits_host = mem.peak <= cap, state + activations <= host_budget
        predicted[(remat, attention, seq)] = (mem.peak, state + activations)
        emit({**row, "predicted_peak_gib": round(mem.peak / GiB, 3),
              "cap_gib": None if cap_gib is None else round(cap_gib, 2), "fits_device": fits_device,
              "host_state_gib": round(state / GiB, 3), "host_activations_gib": round(formula / GiB, 3),
              "compiled_host_temp_gib": round(mem.host_temp / GiB, 3), "host_budget_gib": round(host_budget / GiB, 2),
              "fits_host": fits_host, "fits": fits_device and fits_host,
              "compile_s": round(time.perf_counter() - t0, 1)})
        return fits_device and fits_host

    found, key = search_all(args, lambda remat, attention: search(
        lambda seq: probe(remat, attention, seq), args.start, args.limit, args.granule))
    common = {"model": name, "docs": args.docs, "mlp_tile": tile, "found": found, "limit": args.limit,
              "cap_gib": None if cap_gib is None else round(cap_gib, 2), "host_gib": round(host_gib, 1),
              "host_reserve_gib": args.host_reserve_gib, "offload_loop": args.offload_loop,
              "split_master": args.split_master, "adam_mu_dtype": args.adam_mu_dtype or "float32"}
    if key is None:
        emit({"bench": "longest-full", "seq": None, **common})
        return
    (remat, attention), best = key, found[f"{key[0]}/{key[1]}"]
    eng, ran, build_s, first, dt, metrics = run_longest(
        args, emit, dog, bench="longest-full", label=f"{remat}/{attention}", seq=best, vocab=cfg.vocab_size,
        build=lambda: zerojax.shard(factory(attention)[0], config(remat), loss_fn=loss_fn, options=options))
    rows = eng.layout.cfg.train_batch_size
    device_peak, host_need = predicted.get((remat, attention, ran), (None, None))
    emit({"bench": "longest-full", "seq": ran, "predicted_longest": best, "remat": remat, "attention": attention,
          **common,
          "build_s": round(build_s, 1), "first_step_s": round(first, 3), "step_s": None if dt is None else round(dt, 3),
          "tokens_per_s_per_device": None if dt is None else round(rows * ran / dt, 1),
          "predicted_peak_gib": device_peak and round(device_peak / GiB, 3), "peak_gib": peak_gib(),
          "predicted_host_gib": host_need and round(host_need / GiB, 2), "host_rss_peak_gib": host_rss_peak_gib(),
          "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", choices=("throughput", "longest", "longest-full"))
    p.add_argument("--model", default="llama-3.2-1b", help="throughput's model")
    p.add_argument("--lora-model", default="llama-3.1-8b", help="longest's model")
    p.add_argument("--full-model", default="llama-3.1-8b", help="longest-full's model")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--docs", type=int, default=4, help="packed documents a row (1: no segment ids)")
    p.add_argument("--attention", nargs="+", default=["blockwise"], choices=("blockwise", "flash", "cudnn", "xla"),
                   help="longest / longest-full: each is searched; throughput: one")
    p.add_argument("--block", type=int, default=512, help="keys per step of the blockwise attention")
    p.add_argument("--mlp-tile", type=int, nargs="+", default=None,
                   help="positions per piece of the tiled MLP: one value, or (throughput) one per --seq "
                        "length; 0 = untiled (default: untiled; longest-full: 2048)")
    p.add_argument("--remat", nargs="+", default=None,
                   help="remat policies (default full; longest-full: full offload); longest and "
                        "longest-full search each, throughput takes one")
    p.add_argument("--sp", type=int, default=1, help="sequence_parallel_size")
    p.add_argument("--loss-chunk", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cap-gib", type=float, default=None,
                   help="device budget (longest: default 24; longest-full: default the allocator's limit)")
    p.add_argument("--host-gib", type=float, default=None, help="longest-full: host RAM (default this machine's)")
    p.add_argument("--host-reserve-gib", type=float, default=15.0,
                   help="longest-full: host RAM kept for the process itself (runtime, programs, staging)")
    p.add_argument("--offload-loop", default="in_place", choices=("in_place", "host"),
                   help="longest-full: EngineOptions.offload_loop (in_place: the optimizer's chunks on the "
                        "device after the backward only)")
    p.add_argument("--split-master", action="store_true",
                   help="longest-full: the host master as the bf16 copy + a 16-bit remainder")
    p.add_argument("--adam-mu-dtype", default=None, choices=("bfloat16",), help="longest-full: Adam's m dtype")
    p.add_argument("--start", type=int, default=None, help="first length tried (longest: 4096; longest-full: 65536)")
    p.add_argument("--limit", type=int, default=None,
                   help="longest length tried (default: none; the search ends where a length does not fit)")
    p.add_argument("--granule", type=int, default=None,
                   help="the searches' lengths are multiples of it (default the planner's, 128; --tiny 16)")
    p.add_argument("--real-steps", type=int, default=2,
                   help="longest / longest-full: real steps at the longest length (the first compiles)")
    p.add_argument("--length-timeout", type=float, default=None, help="seconds for each phase (one length, ...)")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny Llama, short rows")
    p.add_argument("--out", default="long_context_results.json")
    args = p.parse_args(argv)
    full = args.bench == "longest-full"
    args.remat = args.remat or (["full", "offload"] if full else ["full"])
    if args.mlp_tile is None and full:
        args.mlp_tile = [2048]
    if args.start is None:
        args.start = 65536 if full else 4096
    if args.granule is None and not args.tiny:
        from zerojax.planning.planner import SEQ_GRANULE

        args.granule = SEQ_GRANULE
    if args.cap_gib is None and not full:
        args.cap_gib = 24.0
    if args.tiny:
        args.seq = [32, 64]
        args.steps, args.warmup, args.block, args.loss_chunk = 2, 1, 16, 16
        args.start, args.limit, args.granule = 32, 128, args.granule or 16
        args.mlp_tile = [t and min(t, 16) for t in args.mlp_tile] if args.mlp_tile else None
        if not full:
            args.cap_gib = min(args.cap_gib, 24.0)
    if args.bench != "throughput" and args.mlp_tile and len(args.mlp_tile) != 1:
        p.error(f"{args.bench}: one --mlp-tile value")
    if args.real_steps < 1:
        p.error("--real-steps must be at least 1")
    results = []
    lock = threading.Lock()

    def write():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    def emit(row):
        with lock:
            print(json.dumps(row), flush=True)
            results.append(row)

    def on_timeout(row):
        emit(row)
        with lock:
            write()

    dog = Watchdog(args.bench, args.deadline, args.length_timeout, on_timeout)
    {"throughput": throughput, "longest": longest, "longest-full": longest_full}[args.bench](args, emit, dog)
    with lock:
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
