"""The planner's mesh-search model against measured bench.py runs: predicted vs measured ranking.

For every entry of the given bench.py JSON files (default: the 2-GPU runs of session 5,
benchmarks/measured/2026-12-01-s5/x2/), the step-time model of `zerojax.mesh_plan.predict`
(estimate.predict_mesh_step_time: FLOPs at the matmul ceiling and micro-batch efficiency, ZeRO and
tensor-parallel collectives, the pipeline's bubble and per-iteration costs) and the formula peak
(estimate.mesh_peak_bytes), next to the measured tokens/s per GPU and peak. Prints both rankings,
Kendall's tau between them, and (--markdown) a block for benchmarks/RESULTS.md. No fitting: the
model's constants are estimate.Hardware's defaults.

    python benchmarks/rank_check.py                       # the session-5 2-GPU rows
    python benchmarks/rank_check.py $OUT/x4.json --out $OUT/rank_x4.json --markdown
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zerojax import estimate as est  # noqa: E402
from zerojax import mesh_plan  # noqa: E402

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured", "2026-12-01-s5", "x2")
GiB = 2**30
# bench.py spec keys (with their defaults) the step-time model has no input for: grad_accum (the dtype
# of the weight-gradient sums), repeats (circular pipeline), attention (the kernel)
UNMODELLED = {"grad_accum": None, "repeats": 1, "attention": None}


def plan_of(spec: dict, n_devices: int) -> mesh_plan.MeshPlan:
    """The mesh plan a bench.py entry ran: data = devices / (tensor x pipe)."""
    tp, pipe = int(spec.get("tp", 1)), int(spec.get("pipe", 1))
    return mesh_plan.MeshPlan(n_devices // (tp * pipe), tp, pipe, int(spec["stage"]), int(spec["micro"]),
                              int(spec["accum"]), int(spec.get("ckpt", 0)) if pipe > 1 else 0)


def rows_of(paths: list[str]) -> list[dict]:
    from zerojax.models.gpt2 import GPT2Config

    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for e in data.get("entries", []):
            r, spec = e["result"], e["spec"]
            if "error" in r or spec.get("offload", "none") != "none" or spec.get("kind", "entry") != "entry":
                continue
            unmodelled = [k for k, default in UNMODELLED.items() if spec.get(k, default) != default]
            if unmodelled:  # a variant the model cannot tell from its base entry: a tie, not a rank
                print(f"left out {e['name']}: the model does not see {', '.join(unmodelled)}", file=sys.stderr)
                continue
            model = mesh_plan.gpt2_mesh_model(GPT2Config.named(spec["size"]), int(spec["seq"]))
            remat = "full" if spec.get("remat") else None
            p = mesh_plan.predict(model, plan_of(spec, int(r["n_devices"])), precision=spec["dtype"], remat=remat)
            rows.append({"name": e["name"], "file": os.path.basename(path), "layout": p.layout(),
                         "group": f"{spec['size']} on {r['n_devices']} GPUs",
                         "stage": p.stage, "micro": p.micro_batch, "accum": p.grad_accum,
                         "predicted_tokens_per_s": p.tokens_per_s, "measured_tokens_per_s": r["tokens_per_s_per_device"],
                         "formula_peak_bytes": p.peak_bytes, "compiled_peak_bytes": r.get("predicted_peak_bytes"),
                         "measured_peak_bytes": r.get("peak_bytes"), "bubble": p.bubble, "mfu": r.get("mfu")})
    # ranked within a (model, device count) group: tokens/s per GPU compare only on the same model
    for group in {x["group"] for x in rows}:
        mine = [x for x in rows if x["group"] == group]
        ranks = mesh_plan.rank_table([(i, x["predicted_tokens_per_s"], x["measured_tokens_per_s"])
                                      for i, x in enumerate(mine)])
        for (_, pr, mr), x in zip(ranks, mine):
            x["predicted_rank"], x["measured_rank"] = pr, mr
    return rows


def groups(rows: list[dict]) -> dict:
    """{group: (its rows fastest measured first, Kendall's tau of its two rankings)}."""
    out = {}
    for group in sorted({x["group"] for x in rows}):
        mine = sorted((x for x in rows if x["group"] == group), key=lambda x: x["measured_rank"])
        out[group] = (mine, mesh_plan.kendall_tau([x["predicted_rank"] for x in mine],
                                                  [x["measured_rank"] for x in mine]))
    return out


def table(rows: list[dict]) -> str:
    g = lambda b: "-" if b is None else f"{b / GiB:.2f}"  # noqa: E731
    lines = [f"{'entry':<40}{'pred tok/s':>11}{'meas tok/s':>11}{'pred/meas':>10}{'rank p/m':>9}"
             f"{'formula GiB':>12}{'compiled':>9}{'measured':>9}"]
    for x in rows:
        lines.append(f"{x['name'][:39]:<40}{x['predicted_tokens_per_s']:>11,.0f}{x['measured_tokens_per_s']:>11,.0f}"
                     f"{x['predicted_tokens_per_s'] / x['measured_tokens_per_s']:>10.2f}"
                     f"{x['predicted_rank']:>5}/{x['measured_rank']:<3}"
                     f"{g(x['formula_peak_bytes']):>12}{g(x['compiled_peak_bytes']):>9}{g(x['measured_peak_bytes']):>9}")
    return "\n".join(lines)


def markdown(rows: list[dict], tau: float) -> str:
    g = lambda b: "-" if b is None else f"{b / GiB:.2f}"  # noqa: E731
    out = ["| layout | ZeRO | micro x accum | tokens/s/GPU predicted | measured | rank predicted | measured | "
           "peak GiB formula | compiled | measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        out.append(f"| {x['layout']}{' ckpt' if 'ckpt' in x['name'] else ''} | {x['stage']} | {x['micro']} x {x['accum']} | "
                   f"{x['predicted_tokens_per_s']:,.0f} | {x['measured_tokens_per_s']:,.0f} | {x['predicted_rank']} | "
                   f"{x['measured_rank']} | {g(x['formula_peak_bytes'])} | {g(x['compiled_peak_bytes'])} | "
                   f"{g(x['measured_peak_bytes'])} |")
    out.append(f"\nKendall's tau between the predicted and measured rankings: {tau:.2f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="bench.py JSON files (default: the session-5 2-GPU runs)")
    ap.add_argument("--out", help="write the rows and both rankings to this JSON file")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table for benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    paths = args.paths or sorted(glob.glob(os.path.join(DEFAULT_DIR, "x2_*.json")))
    rows = rows_of(paths)
    if not rows:
        print(f"no measured entries in {paths}", file=sys.stderr)
        return 1
    found = groups(rows)
    for group, (mine, tau) in found.items():
        print(f"\n{group}: predicted vs measured ranking (rank 1 = fastest)")
        print(table(mine))
        print(f"Kendall's tau: {tau:.2f} over {len(mine)} entries (1 = the same order, -1 = reversed)")
    print(f"\nformula GiB: estimate.mesh_peak_bytes, its ACTIVATION_FACTOR {est.ACTIVATION_FACTOR} calibrated on "
          "the session-5 row 'large zero2 bf16 mb8x1' (2 x H200); compiled: the engine's compiled step on the "
          "GPU; measured: the device's peak. Tokens/s: estimate.predict_mesh_step_time, nothing fitted.")
    if args.markdown:
        for group, (mine, tau) in found.items():
            print(f"\n<!-- paste into benchmarks/RESULTS.md: {group} -->\n" + markdown(mine, tau))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"groups": {g: {"rows": m, "kendall_tau": t} for g, (m, t) in found.items()},
                       "sources": paths}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
