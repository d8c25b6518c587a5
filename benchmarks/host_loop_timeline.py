"""When does each piece of an offload_loop="host" step finish? A timeline without the profiler.

The profiler slowed the host-offload step from ~0.39 to 0.67 s (session 9), so this probe instead
wraps `HostLoop` for a few steps: every array it dispatches (each chunk's state read in, its
update, its write-back, the step's gradients) is handed to a thread that polls `is_ready()` every
~0.1 ms and records when it turned ready, and each dispatch's wall time is recorded too. Prints,
per step: the jit's end (gradients ready), then per chunk the ms (from the step's start) at which
its read was dispatched / done (nan: donated to its update before the poller saw it ready), its update done, its write-back done; and the step's length.

    PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.17 python3 benchmarks/host_loop_timeline.py \
        '{"stage": 2, "offload": "optimizer"}' [--steps 3]     (ZEROJAX_OFFLOAD_* env as bench.py)
JSON to $OUT/host_loop_timeline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


class Poller:
    """Records the first time each registered array is ready (perf_counter seconds)."""

    def __init__(self):
        self.pending, self.done, self.lock = [], {}, threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def add(self, label, tree):
        import jax
        leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "is_ready")]
        with self.lock:
            self.pending.append((label, leaves))

    def _run(self):
        while not self.stop:
            with self.lock:
                items = list(self.pending)
            for label, leaves in items:
                try:
                    ready = all(x.is_ready() for x in leaves)
                except Exception:  # noqa: BLE001 - donated to a program since: its readiness is lost
                    ready = None
                if ready is not False:
                    if ready:
                        self.done[label] = time.perf_counter()
                    with self.lock:
                        self.pending.remove((label, leaves))
            time.sleep(1e-4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--pipelined", action="store_true",
                    help="no wait between the steps (as bench.py times them): one timeline over all")
    args = ap.parse_args()
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import bench
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zerojax.offload import host_loop as HL

    spec = dict(seq=1024, steps=0, warmup=0, size="large", dtype="bf16", accum=1, micro=8,
                stage=2, offload="optimizer", remat=True, attention=None, pipe=1, tp=1)
    spec.update(json.loads(args.spec))
    config = bench.model_config(spec)
    seq = min(spec["seq"], config.n_positions)
    gb = spec["micro"] * spec["accum"] * jax.device_count()
    batch = {"input_ids": np.random.default_rng(0).integers(0, config.vocab_size, (gb, seq), dtype=np.int32)}
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[spec["dtype"]]
    runner = bench.ZeroRunner(config, spec, dtype, batch, jax.device_count())
    hl = runner.engine._host_loop
    if hl is None:
        raise SystemExit("not an offload_loop='host' engine: set ZEROJAX_OFFLOAD_LOOP=host")
    for _ in range(args.warmup):
        runner.step()
    runner.block()

    poll = Poller()
    marks: list[tuple[str, float]] = []  # dispatch times
    orig_bring, orig_call, orig_put = hl._bring, HL.HostLoop.__call__, jax.device_put
    state = {"chunk": None, "tag": ""}  # tag: the step's prefix of every label (--pipelined)

    def bring(n, master, opt_state, **kw):
        marks.append((f"{state['tag']}read{n} dispatch", time.perf_counter()))
        out = orig_bring(n, master, opt_state, **kw)
        poll.add(f"{state['tag']}read{n}", out)
        return out

    def program(chunk):
        fn = HL.HostLoop._program(hl, chunk)

        def run(*a):
            n = hl.loops.index(hl.off.layout.chunks.index(chunk))
            out = fn(*a)
            marks.append((f"{state['tag']}update{n} dispatch", time.perf_counter()))
            poll.add(f"{state['tag']}update{n}", out[:2])
            state["chunk"] = n
            return out
        return run

    def put(x, s=None, **kw):
        out = orig_put(x, s, **kw)
        kinds = {getattr(x, "memory_kind", None) for x in jax.tree.leaves(s)}
        if state["chunk"] is not None and kinds - {None, "device"}:
            poll.add(f"{state['tag']}write{state['chunk']} {len(marks)}", out)
        return out

    def call(self, master, opt_state, compute, grads, *rest, **kw):
        poll.add(f"{state['tag']}grads", grads)
        marks.append((f"{state['tag']}loop start", time.perf_counter()))
        out = orig_call(self, master, opt_state, compute, grads, *rest, **kw)
        marks.append((f"{state['tag']}loop end", time.perf_counter()))
        state["chunk"] = None
        return out

    hl._bring, hl._program = bring, program
    HL.HostLoop.__call__ = call
    jax.device_put = put
    def run(tags):
        """One step per tag (each label prefixed by its step's tag), then wait for all ->
        (ms, {label: ms from the first step's start})."""
        t0 = time.perf_counter()
        for tag in tags:
            state["tag"] = tag
            runner.step()
        runner.block()
        t1 = time.perf_counter()
        time.sleep(0.01)  # the poller's last look
        ev = {k: (v - t0) * 1e3 for k, v in poll.done.items()}
        ev.update({k: (v - t0) * 1e3 for k, v in marks})
        return (t1 - t0) * 1e3, ev

    steps = []
    if args.pipelined:  # one timeline: each step's labels prefixed "s<k> "
        ms, ev = run([f"s{k} " for k in range(args.steps)])
        print(f"{args.steps} steps in {ms:.1f} ms")
        for k, v in sorted(ev.items(), key=lambda kv: kv[1]):
            print(f"{v:9.1f}  {k}")
        steps.append({"step_ms": ms / args.steps, "events": ev})
    for _ in range(0 if args.pipelined else args.steps):
        marks.clear()
        poll.done.clear()
        ms, ev = run([""])
        steps.append({"step_ms": ms, "events": ev})
    poll.stop = True
    jax.device_put = orig_put

    for s in steps if not args.pipelined else []:
        ev = s["events"]
        print(f"step {s['step_ms']:.1f} ms: grads ready {ev.get('grads', float('nan')):.1f}, "
              f"loop dispatched {ev.get('loop start', 0):.1f}-{ev.get('loop end', 0):.1f}")
        print(f"{'chunk':>5s} {'read disp':>9s} {'read done':>9s} {'upd disp':>9s} {'upd done':>9s} {'write done':>10s}")
        for n in range(len(hl.loops)):
            w = [v for k, v in ev.items() if k.startswith(f"write{n} ")]
            print(f"{n:5d} {ev.get(f'read{n} dispatch', float('nan')):9.1f} {ev.get(f'read{n}', float('nan')):9.1f} "
                  f"{ev.get(f'update{n} dispatch', float('nan')):9.1f} {ev.get(f'update{n}', float('nan')):9.1f} "
                  f"{max(w) if w else float('nan'):10.1f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "host_loop_timeline.json"), "w") as f:
            json.dump({"spec": spec, "env": {k: v for k, v in os.environ.items() if k.startswith("ZEROJAX_")},
                       "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
