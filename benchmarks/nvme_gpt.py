"""One GPT training run with the optimizer state offloaded to "cpu" or "nvme" (ZeRO-3, bf16, AdamW,
full remat): tokens/s, the swap traffic per step and its achieved bandwidth, host memory (peak RSS),
device peak. One JSON line on stdout ("NVME {...}") and appended to --json.

    python benchmarks/nvme_gpt.py --size large --micro 8 --offload nvme --nvme-path /local_nvme
    python benchmarks/nvme_gpt.py --n-embd 4096 --n-layer 36 --n-head 32 --micro 1 --accum 16 ...

Run under a device cap with XLA_PYTHON_CLIENT_MEM_FRACTION (0.17 of an H200 = 24 GB).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def _vm(key: str) -> int:
    """/proc/self/status's `key` (VmRSS, VmHWM: the peak so far) in bytes (0 off Linux)."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="large")
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--offload", default="nvme", choices=("cpu", "nvme", "nvme-param"),
                    help="cpu: optimizer to host; nvme: optimizer to files; nvme-param: + params (host tier)")
    ap.add_argument("--param", action="store_true", help="offload_param too (host memory)")
    ap.add_argument("--nvme-path", default="/tmp")
    ap.add_argument("--host-layers", type=int, default=0,
                    help="offload_optimizer.host_layers: the first layers' state in host memory, the rest on NVMe")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--loss-chunk", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    import zerojax
    from zerojax.models import gpt2

    over = {k: v for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer), ("n_head", args.n_head)) if v}
    cfg = gpt2.GPT2Config.named(args.size, **over)
    dev = "nvme" if args.offload.startswith("nvme") else "cpu"
    param = args.param or args.offload == "nvme-param"
    nv = {"nvme_path": args.nvme_path, "buffer_count": args.buffer_count,
          "pipeline_read": True, "pipeline_write": True} if dev == "nvme" else {}
    if dev == "nvme" and args.host_layers:
        nv["host_layers"] = args.host_layers
    ds = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.accum,
          "gradient_clipping": 1.0, "steps_per_print": 10**9, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
          "aio": {"queue_depth": args.queue_depth},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": dev, "pin_memory": True, **nv},
                                "offload_param": {"device": "cpu" if param else "none", "pin_memory": True}}}
    n = jax.device_count()
    make = lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(0), dtype=jax.numpy.bfloat16, remat_policy="full")  # noqa: E731
    loss_fn = gpt2.chunked_gpt2_loss(args.loss_chunk) if args.loss_chunk else gpt2.gpt2_loss
    t0 = time.perf_counter()
    eng = zerojax.shard(make, ds, loss_fn=loss_fn)
    init_s = time.perf_counter() - t0
    init_hwm = _vm("VmHWM")
    # progress lines, so a run stopped by its time limit still tells how far it got
    print(f"NVME-progress init {init_s:.0f} s, host RSS peak {init_hwm / 2**30:.1f} GiB", flush=True)
    B, T = args.micro * args.accum * n, args.seq
    batch = {"input_ids": np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)}
    # JAX reports each trace / lowering / backend compile's duration: their sum over the warm-up is
    # subtracted from it, which leaves the first step's own time (a run too long for a second step)
    compile_s = [0.0]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (compile_s.__setitem__(0, compile_s[0] + secs)
                                  if event.startswith("/jax/core/compile/") else None))
    sw = eng.layout.nvme.swapper if eng.layout.nvme is not None else None
    io_w = (sw.bytes_read, sw.bytes_written, sw.stall_s, len(sw.pass_s)) if sw else (0, 0, 0.0, 0)
    t1 = time.perf_counter()
    for _ in range(args.warmup):
        loss = eng.train_step(batch)["loss"]
    jax.block_until_ready(loss)
    warm_s = time.perf_counter() - t1
    first_step_s = (warm_s - compile_s[0]) / max(args.warmup, 1)
    print(f"NVME-progress warm-up (compile + {args.warmup} steps) {warm_s:.0f} s, of it compiling {compile_s[0]:.0f} s "
          f"(a step without it: {first_step_s:.1f} s, {B * T / first_step_s / n:.0f} tokens/s), host RSS peak "
          f"{_vm('VmHWM') / 2**30:.1f} GiB, loss {float(loss):.3f}", flush=True)
    sw = eng.layout.nvme.swapper if eng.layout.nvme is not None else None
    io0 = (sw.bytes_read, sw.bytes_written, sw.stall_s) if sw else (0, 0, 0.0)
    passes0 = len(sw.pass_s) if sw else 0
    t0 = time.perf_counter()
    for k in range(args.steps):
        loss = eng.train_step(batch)["loss"]
        if args.steps > 1:
            jax.block_until_ready(loss)
            io_now = (f", swap read {(sw.bytes_read - io0[0]) / 2**30:.1f} GiB "
                      f"written {(sw.bytes_written - io0[1]) / 2**30:.1f} "
                      f"GiB, update I/O windows {[round(x, 1) for x in sw.pass_s[passes0:]]} s") if sw else ""
            print(f"NVME-progress step {k + 1}: {time.perf_counter() - t0:.1f} s since the timed steps began, "
                  "host RSS peak "
                  f"{_vm('VmHWM') / 2**30:.1f} GiB{io_now}", flush=True)
    jax.block_until_ready((eng.state, loss))
    # --steps 0: the warm-up's step net of compilation stands in for the timed steps
    dt = (time.perf_counter() - t0) / args.steps if args.steps else first_step_s
    if not args.steps:  # the warm-up's traffic (it ran one step per warm-up)
        io0, passes0 = io_w[:3], io_w[3]
    k = args.steps or max(args.warmup, 1)
    io = (((sw.bytes_read - io0[0]) / k, (sw.bytes_written - io0[1]) / k, (sw.stall_s - io0[2]) / k) if sw
          else (0, 0, 0.0))
    if sw:   # the last group's write-back finishes behind the step (seconds with O_DIRECT): its window closes then
        sw.flush()
        time.sleep(0.1)   # a future's done-callbacks (which record the window) run just after its waiters wake
    passes = sw.pass_s[passes0:] if sw else []
    update_s = sum(passes) / len(passes) if passes else 0.0
    stats = jax.devices()[0].memory_stats() or {}
    rep = eng.memory_report()
    out = {
        "offload": args.offload, "param": param, "model": f"L{cfg.n_layer}/d{cfg.n_embd}/h{cfg.n_head}",
        "n_params": int(sum(x.size for x in jax.tree.leaves(eng.state.params))),
        "micro": args.micro, "accum": args.accum, "seq": T, "step_s": dt, "tokens_per_s": B * T / dt / n,
        "init_s": init_s, "compile_s": compile_s[0], "timed_steps": args.steps, "loss": float(loss),
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "host_state_gib": rep["host"] / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "init_peak_rss_gib": init_hwm / 2**30,
        "host_layers": args.host_layers if dev == "nvme" else None,
        "disk_gib": (eng.layout.offload_settings or {}).get("nvme_disk_bytes", 0) / 2**30,
        "nvme_host_gib": (eng.layout.offload_settings or {}).get("nvme_host_bytes", 0) / 2**30,
        "swap_read_gib_per_step": io[0] / 2**30, "swap_write_gib_per_step": io[1] / 2**30,
        "swap_stall_s_per_step": io[2],
        # the swap traffic over the whole step: a lower bound of the update's achieved disk bandwidth
        "swap_GBps_over_step": (io[0] + io[1]) / dt / 1e9,
        # over the update's window (read of group 0 to the last write on disk), read + write together
        "update_io_s": update_s, "swap_GBps_in_update": (io[0] + io[1]) / update_s / 1e9 if update_s else 0.0,
        "backend": jax.default_backend(),
    }
    print("NVME " + json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(out) + "\n")
    eng.close()
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
