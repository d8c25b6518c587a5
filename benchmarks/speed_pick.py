"""Reads bench.py result files of a speed run (gpu_x1_speed.sh, gpu_x2_speed.sh): picks the best entry, prints one table.

    python benchmarks/speed_pick.py best --max-gib 16 a.json [b.json ...]   # -> the best entry's spec (JSON)
    python benchmarks/speed_pick.py table --json out.json a.json [...]      # every entry, against the baseline

"best": the zerojax entry with the most tokens/s per device among those whose measured peak is at
most --max-gib (the issue's memory target), else among all (said on stderr); failed entries never.
"table": tokens/s per device, MFU, measured peak, and the ratio to the plain jax.jit entry and to
zerojax's current default (the first zerojax entry of the first file, with per-layer "full" remat).
"""
from __future__ import annotations

import argparse
import json
import sys

GIB = 2**30


def _reports(paths):
    """Each file's entries; a file a crashed bench run never wrote is said on stderr and skipped."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                out += json.load(f)["entries"]
        except FileNotFoundError:
            print(f"{path}: not written (its bench run failed?); skipped", file=sys.stderr)
    return out


def _entries(paths):
    return [r for r in _reports(paths) if "error" not in r["result"]]


def _failed(paths):
    return [r for r in _reports(paths) if "error" in r["result"]]


def best(rows, max_gib):
    zero = [r for r in rows if r["spec"]["stage"] != "plain"]
    fits = [r for r in zero if (r["result"].get("peak_bytes") or 0) <= max_gib * GIB]
    if not fits:
        print(f"no entry peaks at <= {max_gib} GiB; best of all", file=sys.stderr)
    pool = fits or zero
    return max(pool, key=lambda r: r["result"]["tokens_per_s_per_device"]) if pool else None


def table(rows, failed) -> str:
    plain = next((r for r in rows if r["spec"]["stage"] == "plain"), None)
    default = next((r for r in rows if r["spec"]["stage"] != "plain" and r["spec"].get("remat") in (True, "full")
                    and not r["spec"].get("env") and r["spec"].get("unroll", 1) == 1), None)
    tok = lambda r: r["result"]["tokens_per_s_per_device"]  # noqa: E731
    head = f"{'entry':<58}{'tok/s/dev':>10}{'MFU':>7}{'peak GiB':>9}{'/plain':>8}{'/default':>9}"
    out = [head, "-" * len(head)]
    for r in rows:
        res = r["result"]
        mfu = f"{res['mfu']:.1%}" if res.get("mfu") is not None else "-"
        peak = "-" if res.get("peak_bytes") is None else f"{res['peak_bytes'] / GIB:.1f}"
        vs = lambda ref: "-" if ref is None else f"{tok(r) / tok(ref):.3f}"  # noqa: E731
        out.append(f"{r['name'][:57]:<58}{tok(r):>10,.0f}{mfu:>7}{peak:>9}{vs(plain):>8}{vs(default):>9}")
    out += [f"{r['name'][:57]:<58}  FAILED: {r['result']['error'][:120]}" for r in failed]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("best", "table"))
    p.add_argument("files", nargs="+")
    p.add_argument("--max-gib", type=float, default=16.0)
    p.add_argument("--json", default=None, help="table: also write {entries, best} here")
    args = p.parse_args(argv)
    rows = _entries(args.files)
    top = best(rows, args.max_gib)
    if args.what == "best":
        if top is None:
            print("no zerojax entry succeeded", file=sys.stderr)
            return 1
        spec = {k: top["spec"][k] for k in ("remat", "unroll", "micro", "stage") if k in top["spec"]}
        print(json.dumps(spec))
        return 0
    print(table(rows, _failed(args.files)))
    if top is not None:
        print(f"best at <= {args.max_gib:g} GiB (else best of all): {top['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"entries": [{"name": r["name"], "spec": r["spec"], **{k: r["result"].get(k) for k in (
                "tokens_per_s_per_device", "mfu", "peak_bytes", "predicted_peak_bytes", "step_s", "compile_s")}}
                for r in rows], "best": top and top["name"], "max_gib": args.max_gib}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
