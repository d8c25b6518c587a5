"""Matmul FLOPs per device of a compiled (SPMD-partitioned) XLA step, loops counted in full.

`compiled.cost_analysis()["flops"]` counts a while loop's body once, whatever its trip count
(checked on jax 0.10 CPU: a 10-step scan of a matmul reports a tenth of its FLOPs), so for a step
whose work sits in scans (gradient accumulation, the layer scan, the pipeline's iterations) it
says little. This walks the optimized HLO text instead: every `dot`, and every
cuBLAS gemm custom-call (GPU), costs 2 x (output elements) x (contracted elements); a while
loop's body counts `known_trip_count` times (XLA records it for scans), and fusions / calls /
conditionals (the largest branch) count what they call. The text is one device's program, so
the result is per device. Attention kernels that are custom-calls (cuDNN flash attention) are
not matmuls here and are left out.

    from hlo_text import matmul_flops
    flops = matmul_flops(engine.compiled_step(shapes).as_text())
"""
from __future__ import annotations

import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_PARAM = re.compile(r"%?([\w.\-]+): ([a-z]\w*\[[\d,]*\])")
_GEMM_TARGETS = ("gemm", "matmul")


def _dims(shape: str) -> list[int] | None:
    m = _ARRAY.match(shape.strip().lstrip("("))
    return [int(d) for d in m.group(1).split(",") if d] if m else None


def _operands(args: str) -> list[str]:
    """Names of the operands in `op(%a, %b), attrs...` (the text after the opening parenthesis)."""
    depth, end = 0, len(args)
    for i, ch in enumerate(args):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
    return re.findall(r"%([\w.\-]+)", args[:end])


def _attr_dims(text: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([\d,]*)\}", text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def parse(hlo: str) -> dict[str, list[tuple]]:
    """computation name -> [(instruction name, result shape text, opcode, rest of line)], plus
    "__entry__" naming the entry computation and "__shapes__" per computation."""
    comps: dict[str, list[tuple]] = {}
    shapes: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current], shapes[current] = [], dict(_PARAM.findall(m.group(2)))
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, op, rest = m.groups()
            comps[current].append((name, shape, op, rest))
            shapes[current][name] = shape
    return {"computations": comps, "shapes": shapes, "entry": entry}


def _dot_flops(shape: str, rest: str, table: dict[str, str], contracting: list[int]) -> float:
    out, ops = _dims(shape), _operands(rest)
    lhs = _dims(table.get(ops[0], "")) if ops else None
    if out is None or lhs is None:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _gemm_contracting(rest: str) -> list[int] | None:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
    return [int(d) for d in re.findall(r"\d+", m.group(1))] if m else None


def matmul_flops(hlo: str) -> float:
    """Per-device matmul FLOPs of one run of the module in `hlo` (optimized HLO text)."""
    module = parse(hlo)
    comps, shapes = module["computations"], module["shapes"]
    memo: dict[str, float] = {}

    def called(rest: str, key: str) -> list[str]:
        m = re.search(key + r"=\{?([%\w.\-, ]+)\}?", rest)
        return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []

    def total(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        memo[comp] = 0.0  # guards against a cycle in malformed text
        flops, table = 0.0, shapes.get(comp, {})
        for _, shape, op, rest in comps.get(comp, []):
            if op == "dot":
                flops += _dot_flops(shape, rest, table, _attr_dims(rest, "lhs_contracting_dims"))
            elif op == "custom-call" and any(t in _target(rest) for t in _GEMM_TARGETS):
                contracting = _gemm_contracting(rest)
                if contracting is not None:
                    flops += _dot_flops(shape, rest, table, contracting)
            elif op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                body = called(rest, "body")
                flops += (int(trips.group(1)) if trips else 1) * sum(total(b) for b in body)
            elif op == "conditional":
                flops += max((total(b) for b in called(rest, "branch_computations")), default=0.0)
            elif op in ("fusion", "call", "async-start", "custom-call"):
                flops += sum(total(c) for c in called(rest, "calls") + called(rest, "to_apply"))
        memo[comp] = flops
        return flops

    return total(module["entry"]) if module["entry"] else 0.0


def _target(rest: str) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', rest)
    return m.group(1).lower() if m else ""
