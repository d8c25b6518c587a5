"""Where a decode step's time goes: zerojax generation on random-init weights, timed, then one
generate call under `jax.profiler.trace` with the device's kernels summed by name, and the compiled
decode program's HLO written out.

    python benchmarks/decode_profile.py 8b1            # Llama-3.1-8B bf16, batch 1, 128 + 129 new
    python benchmarks/decode_profile.py 1b64           # Llama-3.2-1B bf16, batch 64, 256 + 129 new
    python benchmarks/decode_profile.py 8b64           # Llama-3.1-8B bf16, batch 64, 512 + 129 new
    python benchmarks/decode_profile.py 8b1 --lean     # the timing line only
    python benchmarks/decode_profile.py 1b64 --decode-attention kernel   # the step's attention as the
                                                       # fused kernel, not XLA's products (generate's option)
    python benchmarks/decode_profile.py 8b1 --tiny     # CPU smoke test (tiny shapes)

Before / after a change, run it from two trees back to back in one call, e.g. `git archive <commit>
zerojax benchmarks | tar -x -C .after` and `(cd .after && PYTHONPATH=. python
benchmarks/decode_profile.py 8b1 --lean)` beside the same in this tree.

Prints one JSON line (decode ms a step and its share of the HBM bound, as generate_bench.py's case a
counts them), then per profiled line ("XLA Ops" and each stream) the kernels by total time with
their count and mean; the optimized HLO goes to $OUT/decode_<shape>.hlo.txt.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

SHAPES = {"8b1": ("llama-3.1-8b", 1, 128, 129), "1b64": ("llama-3.2-1b", 64, 256, 129),
          "8b64": ("llama-3.1-8b", 64, 512, 129)}


def main(argv=None) -> int:
    import argparse

    from zerojax.generation.decoder import DECODE_ATTENTIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", nargs="?", default="8b1", choices=SHAPES)
    p.add_argument("--lean", action="store_true", help="the timing line only")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, for a CPU smoke test")
    p.add_argument("--decode-attention", default="xla", choices=DECODE_ATTENTIONS, help="generate's option")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    shape, tiny, lean, attention = args.shape, args.tiny, args.lean, args.decode_attention
    import generate_bench as gb
    import jax
    from trace_kernels import kernel_table, xplane_file

    import zerojax
    from zerojax.generation.program_cost import decode_program

    name, batch, prompt, new = SHAPES[shape]
    if tiny:
        batch, prompt, new = min(batch, 4), 8, 9
    model = gb._build(name, tiny)
    r = gb.generation_speed(model, batch, prompt, new, model.config.vocab_size, decode_attention=attention)
    bandwidth, bound_ms, share = gb.hbm_bound(model, tiny, r["decode_step_ms"])
    print(json.dumps({"shape": shape, "model": name, "decode_attention": attention,
                      "device": jax.devices()[0].device_kind, **r,
                      "copy_gbs": round(bandwidth / 1e9, 1), "hbm_bound_step_ms": round(bound_ms, 3),
                      "hbm_bound_share": share}),
          flush=True)
    if lean:
        return 0

    prompts = gb._prompts(batch, prompt, model.config.vocab_size)
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        zerojax.generate(model, prompts, max_new_tokens=new, ignore_eos=True, decode_attention=attention)
    for line, rows in kernel_table(xplane_file(trace_dir), tiny).items():
        print(f"{line}: {sum(ms for _, _, ms in rows):.1f} ms in its top {len(rows)} kernels "
              f"(one generate: the prefill and {new - 1} decode steps)")
        for kernel, n, ms in rows:
            print(f"  {ms:9.2f} ms {n:6d}x {1e3 * ms / n:9.1f} us  {kernel[:110]}")
    out = os.environ.get("OUT") or tempfile.mkdtemp()
    _, compiled = decode_program(model, batch=batch, length=prompt + new + 127, decode_attention=attention)
    path = os.path.join(out, f"decode_{shape}.hlo.txt")
    with open(path, "w") as f:
        f.write(compiled.as_text())
    print(f"optimized decode HLO: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
