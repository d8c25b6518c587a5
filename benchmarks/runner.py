"""Runs a case's programs one after the other (benchmarks/case_types.py: `Case`, `Run`): each in its own
process group under its timeout, its output logged to --out, its records collected."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

from benchmarks.case_types import Case, Run

RECORD_LINE = re.compile(r"^(?:\[\d+\] )?(?:[A-Z][A-Z_-]* )?(\{.*\})\s*$")
RSS_LINE = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")
CAP_GIB = 23.77  # what a 24 GB card leaves to JAX


@dataclasses.dataclass
class Settings:
    """The command line's choices, shared by every run of every case."""
    out: str
    smoke: bool = False
    before: str | None = None
    nvme: str = "/tmp"
    hf_checkpoint: str = ""         # a pretrained model's folder, for cases whose runs name {hf_checkpoint}
    python: str = sys.executable
    quiet: bool = False
    only: tuple[str, ...] = ()      # run labels to run (empty: all)
    _gpu_values: dict = dataclasses.field(default_factory=dict)


def gpu_query(field: str) -> list[str]:
    """One line per GPU of `nvidia-smi --query-gpu=FIELD`; an empty list where there is none."""
    if shutil.which("nvidia-smi") is None:
        return []
    done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def cap24_fraction() -> str:
    """XLA_PYTHON_CLIENT_MEM_FRACTION that leaves 23.77 GiB of this GPU to JAX."""
    total = gpu_query("memory.total")
    if not total:
        raise SystemExit("the 24 GB cap is computed from nvidia-smi's memory.total, and nvidia-smi found no GPU "
                         "(--smoke runs the CPU variants without the cap)")
    return f"{CAP_GIB * 1024 / float(total[0]):.3f}"


def matmul_ceiling(settings: Settings) -> str:
    """The bf16 matmul ceiling of this GPU in TFLOP/s (models_bench.py's MFU is against it)."""
    code = "from zerojax.planning.ceiling import measure_matmul_ceiling as m; print(m(8192)['ceiling_tflops'])"
    done = subprocess.run([settings.python, "-c", code], capture_output=True, text=True, check=False)
    lines = done.stdout.split()
    if done.returncode or not lines:
        raise SystemExit(f"measuring the matmul ceiling failed: {done.stderr.strip()[-300:]}")
    return lines[-1]


def fill(text: str, values: dict, settings: Settings) -> str:
    """The placeholders of benchmarks/case_types.py's docstring filled in; the GPU's are measured on
    first use only."""
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    for key, measure in (("cap24", cap24_fraction), ("peak_tflops", lambda: matmul_ceiling(settings))):
        if "{" + key + "}" in text:
            if key not in settings._gpu_values:
                settings._gpu_values[key] = "1" if settings.smoke else measure()
            text = text.replace("{" + key + "}", settings._gpu_values[key])
    return text


def command(argv: tuple[str, ...], tree: str, settings: Settings, host_rss: bool) -> list[str]:
    """The process to start: {py} SCRIPT (under the tree) or {py} -m MODULE, under GNU time -v
    where the run records the host's peak RSS and GNU time is there."""
    first, rest = argv[0], list(argv[1:])
    cmd = [settings.python, "-m", *rest] if first == "-m" else [settings.python, os.path.join(tree, first), *rest]
    if host_rss and os.path.exists("/usr/bin/time"):
        cmd = ["/usr/bin/time", "-v", *cmd]
    return cmd


def run_env(run: Run, tree: str, values: dict, settings: Settings) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH", "")) if p)
    for key, template in run.env:
        if settings.smoke and "{cap24}" in template:
            continue  # no cap on the CPU
        env[key] = fill(template, values, settings)
    if settings.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def execute(cmd: list[str], env: dict, timeout_s: int, log_path: str, stdout_path: str = "") -> str | None:
    """Runs cmd in its own process group (a benchmark's children die with it on a timeout), output in
    log_path (stdout in stdout_path where given). Returns None, or what went wrong in one line."""
    with open(log_path, "w") as log, open(stdout_path or os.devnull, "w") as stdout_file:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout_file if stdout_path else log, stderr=log,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return f"timed out after {timeout_s} s"
    return f"exit {code}" if code else None


def flatten(record: dict) -> list[dict]:
    """A record that holds a "results" list becomes one record per result, with its other fields."""
    results = record.get("results")
    if isinstance(results, list) and all(isinstance(r, dict) for r in results):
        parent = {k: v for k, v in record.items() if k != "results"}
        return [{**parent, **r} for r in results]
    return [record]


def stdout_records(text: str) -> list[dict]:
    found, seen = [], set()
    for line in text.splitlines():
        match = RECORD_LINE.match(line)
        if not match:
            continue
        try:
            parsed = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        for record in flatten(parsed) if isinstance(parsed, dict) else ():
            key = json.dumps(record, sort_keys=True, default=str)
            if key not in seen:  # a program that prints each row, then all of them
                seen.add(key)
                found.append(record)
    return found


def bench_records(path: str) -> list[dict]:
    """bench.py's report: one record per matrix entry; its plain jax.jit entries are the anchor."""
    with open(path) as f:
        report = json.load(f)
    records = []
    for entry in report.get("entries", []):
        spec, result = entry.get("spec", {}), entry.get("result") or {}
        scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
        plain = spec.get("stage") == "plain"
        records.append({"framework": "jax.jit" if plain else "zerojax", "anchor": plain, "row": entry.get("name"),
                        "size": spec.get("size"), **scalars, **({"error": entry["error"]} if "error" in entry else {})})
    return records


def moe_records(path: str) -> list[dict]:
    """moe_bench.py's list: its transformers rows are the anchor; rows pair by kind (ft / qlora, and
    decode-<batch>: a decode row's batches, each a record of its own, tokens/s its decode rate)."""
    with open(path) as f:
        rows = json.load(f)
    records = []
    for r in rows:
        anchor = r.get("row", "").endswith("transformers")
        base = {"framework": "transformers" if anchor else "zerojax", "anchor": anchor}
        for d in r.get("decode", []):
            records.append({**base, "kind": f"decode-{d['batch']}", "row": r["row"], **d,
                            "tokens_per_s": d.get("decode_tokens_per_s")})
        if "decode" not in r:
            records.append({**base, "kind": r.get("row", "").split("-")[0], **r})
    return records


def summary_record(path: str) -> list[dict]:
    """The trainer's --summary-json: speed, memory, losses and the method's metrics and rollouts."""
    with open(path) as f:
        s = json.load(f)
    keep = ("model", "seq_len", "train_batch_size", "steps", "tokens_per_s_per_device", "peak_gib_device0",
            "first_loss", "last_loss")
    return [{"framework": "zerojax", **{k: s.get(k) for k in keep}, **s.get("rollouts", {}),
             **{k.replace("/", "_"): v for k, v in s.get("method_metrics", {}).items()}}]


READERS = {"bench": bench_records, "moe": moe_records, "summary": summary_record}


def normalize(record: dict, run_label: str, anchor: bool, extra: dict) -> dict:
    """Common names for the figures the table shows, whichever program printed them."""
    r = {"row": run_label, **record, **extra}
    r.setdefault("framework", "zerojax")
    if r.get("tokens_per_s") is None and r.get("tokens_per_s_per_device") is not None:
        r["tokens_per_s"] = r["tokens_per_s_per_device"]
    if r.get("peak_gib") is None:
        if r.get("peak_gib_device0") is not None:
            r["peak_gib"] = r["peak_gib_device0"]
        elif isinstance(r.get("peak_bytes"), (int, float)):
            r["peak_gib"] = round(r["peak_bytes"] / 2**30, 2)
    r["anchor"] = bool(anchor or r.get("anchor"))
    return r


def run_once(case: Case, run: Run, argv: tuple[str, ...], tree: tuple[str, str], settings: Settings) -> list[dict]:
    """One run of one tree: started, logged, its records read, tagged and saved beside its log."""
    path, tree_name = tree
    values = {"py": settings.python, "out": settings.out, "tree": path, "tree_name": tree_name or "this",
              "nvme": settings.nvme, "hf_checkpoint": settings.hf_checkpoint,
              "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    name = f"{case.name}-{run.label}" + (f"-{tree_name}" if tree_name else "")
    log_path = os.path.join(settings.out, f"{name}.log")
    filled = tuple(fill(a, values, settings) for a in argv)
    cmd = command(filled, path, settings, run.host_rss)
    if not settings.quiet:
        print(f"== {name}: {' '.join(cmd)[:300]}", flush=True)
    records_file = fill(run.records_file, values, settings)
    if records_file and os.path.exists(records_file):
        os.remove(records_file)  # an earlier run's file is not this run's result
    failed = execute(cmd, run_env(run, path, values, settings), settings_timeout(run, settings), log_path,
                     fill(run.stdout_to, values, settings))
    with open(log_path, errors="replace") as f:
        log = f.read()
    if run.reader == "stdout":
        records = stdout_records(log)
    elif os.path.exists(records_file):
        records = READERS[run.reader](records_file)
    else:
        records = []
    extra = dict(run.tag, **({"tree": tree_name} if tree_name else {}))
    if run.host_rss and RSS_LINE.search(log):
        extra["host_rss_gib"] = round(int(RSS_LINE.findall(log)[-1]) / 2**20, 2)
    anchor = run.anchor or tree_name == "before"
    records = [normalize(r, run.label, anchor, extra) for r in records]
    if failed:
        tail = [line for line in log.splitlines() if line.strip()][-1:] or [""]
        framework = "anchor" if anchor else "zerojax"
        records.append(normalize({"framework": framework, "error": f"{failed}: {tail[0][:200]}"}, run.label, anchor,
                                 extra))
    with open(os.path.join(settings.out, f"{name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)
    if not settings.quiet:
        for r in records:
            print("   ", json.dumps(r, default=str)[:300], flush=True)
    return records


def settings_timeout(run: Run, settings: Settings) -> int:
    """A tiny CPU run's time is its compiles': at least 10 minutes under --smoke."""
    return max(run.timeout_s, 600) if settings.smoke else run.timeout_s


def check_case(case: Case, settings: Settings) -> None:
    """One clear line for a case that cannot run here."""
    if case.needs_before and not settings.before:
        raise SystemExit(f"case {case.name}: needs --before DIR, an earlier tree "
                         "(`git archive <commit> zerojax examples configs benchmarks | tar -x -C .before`)")
    if settings.before and not os.path.isdir(settings.before):
        raise SystemExit(f"--before {settings.before}: no such directory")
    needs_weights = any("{hf_checkpoint}" in a for run in case.runs for a in run.argv)
    if needs_weights and not settings.smoke and not os.path.isdir(settings.hf_checkpoint or ""):
        raise SystemExit(f"case {case.name}: needs --hf-checkpoint DIR, a local Hugging Face folder of a pretrained "
                         f"model (given: {settings.hf_checkpoint or 'none'}; a random init learns nothing in its "
                         "steps; --smoke runs its CPU variant)")
    if case.gpus > 1 and not settings.smoke:
        found = len(gpu_query("name"))
        if found < case.gpus:
            raise SystemExit(f"case {case.name}: needs {case.gpus} GPUs, nvidia-smi found {found} "
                             f"(--smoke runs its CPU variants)")


def run_case(case: Case, settings: Settings) -> list[dict]:
    """Every run of the case in order (with --before: each run for the earlier tree, then this one),
    then its comparisons; all its records also in {out}/{case}.jsonl."""
    check_case(case, settings)
    os.makedirs(settings.out, exist_ok=True)
    if case.prepare:
        case.prepare(settings.out, settings.smoke)
    trees = [(settings.before, "before"), (".", "after")] if settings.before else [(".", "")]
    records = []
    for run in case.runs:
        if settings.only and run.label not in settings.only:
            continue
        argv = run.smoke if settings.smoke else run.argv
        if argv is None:
            if not settings.quiet:
                print(f"== {case.name}-{run.label}: no CPU variant, skipped under --smoke", flush=True)
            continue
        for tree in trees:
            records += run_once(case, run, argv, tree, settings)
    if case.post:
        records += [normalize(r, "comparison", False, {}) for r in case.post(settings.out)]
    with open(os.path.join(settings.out, f"{case.name}.jsonl"), "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in records)
    return records
