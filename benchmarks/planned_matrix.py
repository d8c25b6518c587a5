"""bench.py matrix entries for the four-GPU layouts of the `x4` case (benchmarks/cases_scale.py), with the
micro-batch x accumulation (and pipeline checkpoints) the planner's mesh search chose
(`zerojax plan --search-mesh --json`).

    python benchmarks/planned_matrix.py plan_xl.json plan_large.json > matrix.json

A layout the model does not allow (GPT-2 XL's 25 heads and a tensor axis) or for which nothing fit
is named on stderr and left out. Prints the JSON list bench.py's --matrix reads.
"""
from __future__ import annotations

import json
import sys

# (data, tensor, pipe, ZeRO stage) on 4 GPUs: ZeRO-2 and ZeRO-3 over 4, TP 2 x data 2 with ZeRO-1 and
# ZeRO-3, pipe 2 x data 2 (ZeRO-1), TP 2 x pipe 2 (one data rank: any stage, nothing to partition)
LAYOUTS = [(4, 1, 1, 2), (4, 1, 1, 3), (2, 2, 1, 1), (2, 2, 1, 3), (2, 1, 2, 1), (1, 2, 2, None)]


def entries(plan_json: dict) -> list[dict]:
    out = []
    for data, tensor, pipe, stage in LAYOUTS:
        mine = [p for p in plan_json["plans"] if (p["data"], p["tensor"], p["pipe"]) == (data, tensor, pipe)
                and (stage is None or p["stage"] == stage)]
        zero = "any ZeRO stage" if stage is None else f"ZeRO-{stage}"
        name = f"{plan_json['model']} data {data} x tensor {tensor} x pipe {pipe}, {zero}"
        if not mine:
            why = [r["why"] for r in plan_json["refused"]
                   if (r["data"], r["tensor"], r["pipe"]) == (data, tensor, pipe)]
            print(f"not run: {name}: {why[0] if why else 'nothing fits the budget'}", file=sys.stderr)
            continue
        p = mine[0]  # plans are fastest first
        spec = {"size": plan_json["model"], "stage": p["stage"], "micro": p["micro_batch"],
                "accum": p["grad_accum"], "remat": False}
        spec.update({"tp": tensor} if tensor > 1 else {})
        spec.update({"pipe": pipe, "ckpt": p["checkpoint_interval"]} if pipe > 1 else {})
        print(f"planned: {name}: {p['describe']}", file=sys.stderr)
        out.append(spec)
    return out


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    specs = [e for path in paths for e in entries(json.load(open(path)))]
    print(json.dumps(specs))
    return 0 if specs else 1


if __name__ == "__main__":
    sys.exit(main())
