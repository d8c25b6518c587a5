"""`zerojax estimate`: help text, JSON for scripts, and the README's planning example on CPU."""
import json
import os
import subprocess
import sys

import pytest

from zerojax.cli import build_parser, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_estimate_help_names_the_flags_not_a_placeholder(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["estimate", "--cpu", "--help"])
    out = capsys.readouterr().out
    assert "{gpus}" not in out and "--gpus x --nodes virtual CPU devices" in out


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("value", ["abc", "0", "-2", "8.5"])
def test_a_bad_micro_batch_is_a_flag_error(command, value, capsys):
    """--micro-batch is 'auto' or a whole number >= 1, checked when the flags are parsed: the error
    names the flag and what it takes (it was an int() traceback from inside the command)."""
    extra = ["--devices", "2", "--budget", "1GB"] if command == "plan" else []
    with pytest.raises(SystemExit) as e:
        main([command, "--micro-batch", value, *extra])
    assert e.value.code == 2
    assert f"argument --micro-batch: '{value}': 'auto' or a whole number >= 1" in capsys.readouterr().err


def test_estimate_json_on_stdout_for_formulas(capsys):
    """--json without a file: JSON alone on stdout (the table goes to stderr), carrying
    DeepSpeed's estimator (zero-3, offload both, zero_init: 71.69GB per CPU, as its docs print)."""
    assert main(["estimate", "--params", "2851e6", "--largest-layer", "32e6", "--gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "71.69GB" in captured.err
    row = next(r for r in result["formulas"] if r["source"] == "deepspeed" and r["stage"] == 3
               and r["options"].endswith("offload_param=cpu, zero_init=1"))
    assert f"{row['cpu_bytes'] / 2**30:.2f}" == "71.69"


def test_estimate_module_imports_no_jax():
    code = "import sys, zerojax.planning.estimate, zerojax.cli; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": REPO})


def test_readme_planning_example_on_cpu():
    """The README's `zerojax estimate --model tiny --gpus 2 --aot --cpu --budget 12MB --micro-batch
    auto`, with --json: plans under the budget, fastest predicted first, each with its compiled
    peak, predicted tokens/s and config patch. (Its time is reported, never asserted.)"""
    cmd = [sys.executable, "-m", "zerojax.cli", "estimate", "--model", "tiny", "--gpus", "2", "--aot",
           "--cpu", "--budget", "12MB", "--micro-batch", "auto", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                         env={**env, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    plans = result["plans"]
    assert plans and result["budget_bytes"] == 12 * 10**6
    assert all(p["peak_bytes"] <= 12 * 10**6 for p in plans)
    speeds = [p["tokens_per_s"] for p in plans]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    for p in plans:  # the global batch is kept: micro-batch x accumulation = 8 rows per device
        patch = p["config_patch"]
        assert patch["train_micro_batch_size_per_gpu"] * patch["gradient_accumulation_steps"] == 8
    # a candidate that was compiled and did not fit is faster (predicted) than the chosen one
    misses = [t for t in result["tried"] if t["outcome"] == "does not fit"]
    assert all(t["plan"]["peak_bytes"] > 12 * 10**6 for t in misses)


def test_estimate_aot_compiles_with_the_engine_options_asked(tmp_path, capsys):
    """`zerojax estimate --aot --master-split --adam-mu-dtype bfloat16`: the compiled peaks are those
    of the step run with EngineOptions(split_master="on", adam_mu_dtype="bfloat16"): its arguments
    hold 4 bytes a parameter less / 8 devices (ZeRO-2) than the default's (2 for the int16 remainder
    instead of the fp32 master, 2 for the bf16 first moment); without --aot the flags are refused."""
    from flax import nnx

    from zerojax import cli

    from zerojax.planning import planner
    from zerojax.models.gpt2 import GPT2, GPT2Config

    def compiled(*flags):
        out = tmp_path / "e.json"
        assert cli.main(["estimate", "--model", "tiny", "--gpus", "8", "--aot", "--no-plan", "--stage", "2",
                         "--remat", "on", "--micro-batch", "2", "--seq", "32", "--json", str(out), *flags]) == 0
        (row,) = json.loads(out.read_text())["compiled"]
        return row

    lean, plain = compiled("--master-split", "--adam-mu-dtype", "bfloat16"), compiled()
    params = planner.model_shape(lambda: GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0)), 32).params
    assert plain["argument"] - lean["argument"] == 4 * params // 8
    assert cli.main(["estimate", "--model", "tiny", "--master-split"]) == 2
    assert "add --aot" in capsys.readouterr().err
    # a config that fixes fp16 or fp32: the split cannot act; refused (estimate and plan), not planned without it
    for precision in ({"fp16": {"enabled": True}}, {"bf16": {"enabled": False}}):
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **precision}))
        for argv in (["estimate", "--model", "tiny", "--gpus", "8", "--aot", "--no-plan"],
                     ["plan", "--model", "tiny", "--devices", "8", "--budget", "1GiB"]):
            with pytest.raises(SystemExit, match="--master-split needs bf16(.|\n)*fp16.enabled"):
                cli.main([*argv, "--config", str(path), "--master-split"])
