"""Train GPT-2 with every DeepSpeed config in configs/ through examples/gpt2_large.py.

    python benchmarks/configs_sweep.py --steps 30                 # GPU: GPT-2 Large, all configs
    python benchmarks/configs_sweep.py --model tiny --steps 5     # CPU: does every config run?

Each config runs in its own process (peak memory is a process-lifetime maximum). Prints a table
(tokens/s per device, MFU, peak GiB on device 0, first/last loss) and writes JSON (--out, and
$OUT/configs_sweep.json when OUT is set).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_one(config: str, args) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "gpt2_large.py"), "--config", config,
           "--steps", str(args.steps), "--eval-batches", "1"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.extra
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": os.path.basename(config), "error": f"timeout after {args.timeout}s"}
    out = {"config": os.path.basename(config), "wall_s": round(time.perf_counter() - t, 1)}
    for line in proc.stdout.splitlines():
        if line.startswith("SUMMARY "):
            out.update(json.loads(line[len("SUMMARY "):]))
    if proc.returncode != 0 or "first_loss" not in out:
        out["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=os.path.join(ROOT, "configs", "*.json"))
    p.add_argument("--model", default=None, help="GPT-2 size (default: the example's: large on GPU)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more flags for the example (after --)")
    args = p.parse_args(argv)
    rows = []
    for config in sorted(glob.glob(args.configs)):
        r = run_one(config, args)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'config':36} {'stage':>5} {'tok/s/dev':>10} {'MFU':>6} {'peak GiB':>8} {'loss first->last':>18}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:36} ERROR {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        print(f"{r['config']:36} {r['stage']:>5} {r.get('tokens_per_s_per_device', 0):>10,} {mfu:>6} "
              f"{r.get('peak_gib_device0', '-'):>8} {r['first_loss']:>8.3f} -> {r['last_loss']:.3f}")
    paths = [args.out] if args.out else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], "configs_sweep.json"))
    for path in paths:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
