"""`zerojax estimate`: help text, JSON for scripts, and the README's planning example on CPU."""
import json
import os
import re
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_estimate_aot_compiles_with_the_engine_options_asked(tmp_path, capsys):
    """`zerojax estimate --aot --master-split --adam-mu-dtype bfloat16`: the compiled peaks are those
    of the step run with EngineOptions(split_master="on", adam_mu_dtype="bfloat16"): its arguments
    hold 4 bytes a parameter less / 8 devices (ZeRO-2) than the default's (2 for the int16 remainder
    instead of the fp32 master, 2 for the bf16 first moment); without --aot the flags are refused."""
    from flax import nnx

    from zerojax import cli
    from zerojax.models.gpt2 import GPT2, GPT2Config
    from zerojax.planning import planner

    def compiled(*flags):
        out = tmp_path / "e.json"
        assert cli.main(["estimate", "--model", "tiny", "--gpus", "8", "--aot", "--no-plan", "--stage", "2",
                         "--remat", "on", "--micro-batch", "2", "--seq", "32", "--json", str(out), *flags]) == 0
        (row,) = json.loads(out.read_text())["compiled"]
        return row

    lean, plain = compiled("--master-split", "--adam-mu-dtype", "bfloat16"), compiled()
    params = planner.model_shape(lambda: GPT2(GPT2Config.named("tiny"), rngs=nnx.Rngs(0)), 32).params
    assert plain["argument"] - lean["argument"] == 4 * params // 8
    assert cli.main(["estimate", "--model", "tiny", "--master-split"]) == 1
    assert "add --aot" in capsys.readouterr().err
    # a config that fixes fp16 or fp32: the split cannot act; refused (estimate and plan), not planned without it
    for precision in ({"fp16": {"enabled": True}}, {"bf16": {"enabled": False}}):
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, **precision}))
        for argv in (["estimate", "--model", "tiny", "--gpus", "8", "--aot", "--no-plan"],
                     ["plan", "--model", "tiny", "--devices", "8", "--budget", "1GiB"]):
            assert cli.main([*argv, "--config", str(path), "--master-split"]) == 1
            assert re.search("^error: --master-split needs bf16(.|\n)*fp16.enabled", capsys.readouterr().err)


def _qwen3_06b_params():
    """Qwen3-0.6B's parameters, written out from Hugging Face's config (d 1024, 28 layers, 16 heads
    x 128, 8 kv heads, MLP 3072, vocabulary 151936, tied embedding, q / k norms of 128)."""
    d, L, H, K, Dh, m, V = 1024, 28, 16, 8, 128, 3072, 151936
    block = 2 * d + d * H * Dh + 2 * d * K * Dh + H * Dh * d + 2 * Dh + 3 * d * m
    return V * d + L * block + d, V * d


def test_estimate_takes_a_llama_family_shape(capsys):
    """`zerojax estimate --model qwen3-0.6b`: the formulas for its parameter count (596,049,920, as
    written out from its config), the embedding as the largest layer, the model's 40,960 positions
    as the default sequence, and FLOPs with the attention width 16 x 128 (not d = 1024)."""
    assert main(["estimate", "--model", "qwen3-0.6b", "--gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    total, embedding = _qwen3_06b_params()
    assert total == 596_049_920
    assert (result["total_params"], result["largest_layer_params"]) == (total, embedding)
    assert (result["layers"], result["d_model"], result["heads"], result["head_dim"]) == (28, 1024, 16, 128)
    assert result["seq_len"] == 40960
    assert result["flops_per_token"] == 6 * total + 12 * 28 * 16 * 128 * 40960
    assert "Model states for 596.05M params" in captured.err and "zero-paper" in captured.err
    assert main(["estimate", "--model", "qwen3-0.6b", "--seq", "2048", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["flops_per_token"] == 6 * total + 12 * 28 * 16 * 128 * 2048


@pytest.mark.slow
def test_estimate_and_plan_take_a_module_factory(capsys):
    """`--model tests.planning.model_factories:qwen_like` (tests/foreign_models.py's Qwen3-style list
    of blocks: no zerojax names, no maximum positions): a table for its parameter count as written
    out here, the default sequence 1024; `zerojax plan` ranks its mesh shapes from its dims (4 heads
    refuse tensor 8, 4 layers pipe 8). The nnx.vmap-stacked one too, in a subprocess (the command
    as a user types it, from the repository root)."""
    d, H, K, Dh, m, L, V = 64, 4, 2, 32, 96, 4, 128
    block = 2 * d + d * H * Dh + 2 * d * K * Dh + H * Dh * d + 2 * Dh + 3 * d * m
    total = V * d + L * block + d
    assert main(["estimate", "--model", "tests.planning.model_factories:qwen_like", "--gpus", "2", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["total_params"] == total and result["seq_len"] == 1024 and result["layers"] == L
    assert result["flops_per_token"] == 6 * total + 12 * L * H * Dh * 1024
    assert f"Model states for {total / 1e6:.2f}M params" in captured.err
    assert main(["plan", "--model", "tests.planning.model_factories:qwen_like", "--devices", "8", "--search-mesh",
                 "--budget", "1GiB", "--global-batch", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plans"] and plan["seq_len"] == 1024
    why = {(r["data"], r["tensor"], r["pipe"]): r["why"] for r in plan["refused"]}
    assert why[(1, 8, 1)] == "tensor 8 does not divide the 4 attention heads"
    assert why[(1, 1, 8)] == "pipe 8 does not divide the 4 layers"
    # a factory without remat_policy= cannot plan --remat on: one line saying so
    assert main(["plan", "--model", "tests.planning.model_factories:qwen_like", "--devices", "2",
                 "--budget", "1GiB", "--remat", "on"]) == 1
    assert "--remat on needs a model factory taking remat_policy=" in capsys.readouterr().err
    # the nnx.vmap stack: DeepSpeed's largest layer is a module's own parameters, one layer's slice of
    # the stacked w1 (d x mlp + mlp = 6,240), so the embedding (V x d = 8,192) and not 4 x 6,240
    d, m = 64, 96
    scan_block = 2 * 2 * d + 4 * (d * d + d) + 2 * (d * m + m) + (m * d + d)
    run = subprocess.run([sys.executable, "-m", "zerojax.cli", "estimate", "--model",
                          "tests.planning.model_factories:scan_lm", "--stage", "3", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert (result["total_params"], result["largest_layer_params"]) == (V * d + L * scan_block + 2 * d + d * V, V * d)
    assert "ScanLM" in run.stderr and "4 layers, width 64, 4 heads x 16" in run.stderr


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("model, says", [
    ("gpt-5", "not a model zerojax knows; --model takes a registered shape (tiny, small, medium, large, xl, "
              "llama-3.2-1b"),
    ("no_such_module_here:build", "cannot import no_such_module_here"),
    ("tests.planning.model_factories:missing", "tests.planning.model_factories has no missing"),
    ("tests.planning.model_factories:QWEN", "QWEN is a QwenShape, not a callable"),
])
def test_a_bad_model_is_one_line_naming_the_flag(command, model, says, capsys):
    extra = ["--devices", "2", "--budget", "1GB"] if command == "plan" else []
    assert main([command, "--model", model, *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: --model {model!r}: ") and says in err


def test_estimate_and_plan_consider_the_tiled_mlp_on_long_rows(capsys):
    """A Llama-family shape on rows longer than 2048: `zerojax estimate` lists, beside the untiled
    MLP's activations, the default tile's (the figures `estimate.mesh_peak_bytes` gives for the
    model's shape, smaller); --mlp-tile 1024 lists that tile instead; rows of 2048 list none.
    `zerojax plan` at a budget between the tiled and the untiled formula peaks picks the tile and
    says how to build it. --mlp-tile is checked as `zerojax train` checks it, and N on GPT-2 is
    one line naming the flag and the fix."""
    from flax import nnx

    from zerojax.cli import default_config, resolve_model
    from zerojax.model import model_dims
    from zerojax.planning import estimate as E
    from zerojax.planning import mesh_search as MP
    from zerojax.planning import planner as PL

    T = 8192
    tile = PL.default_mlp_tile(T)
    factory = resolve_model("tiny-llama", default_config()).factory
    shape, dims = PL.model_shape(factory, T), model_dims(nnx.eval_shape(factory))

    def listed(*flags):
        assert main(["estimate", "--model", "tiny-llama", "--gpus", "8", "--micro-batch", "2", "--json", *flags]) == 0
        acts = json.loads(capsys.readouterr().out).get("activations", [])
        return {(a["remat"], a["mlp_tile"]): a["bytes"] for a in acts}

    def formula(remat, t):
        return E.mesh_peak_bytes(shape, heads=dims.heads, vocab=dims.vocab, micro_batch=2, n_data=8, precision="bf16",
                                 remat=remat, mlp_tile=t)["activations"]

    got = listed("--seq", str(T))
    assert got == {(r, t): formula(r, t) for r in (None, "full") for t in (None, tile)}
    assert got[(None, tile)] < got[(None, None)]
    assert set(listed("--seq", str(T), "--mlp-tile", "1024", "--remat", "off")) == {(None, None), (None, 1024)}
    assert listed("--seq", str(PL.MLP_TILE)) == {}

    model = MP.mesh_model_of(factory, T)
    peak = {t: MP.predict(model, MP.MeshPlan(8, 1, 1, 3, 1, 1, mlp_tile=t)).peak_bytes for t in (None, tile)}
    budget = (peak[tile] + peak[None]) // 2
    assert main(["plan", "--model", "tiny-llama", "--seq", str(T), "--devices", "8", "--stage", "3",
                 "--global-batch", "8", "--budget", str(budget), "--json"]) == 0
    captured = capsys.readouterr()
    (best,) = json.loads(captured.out)["plans"]
    assert (best["mlp_tile"], best["peak_bytes"], best["micro_batch"]) == (tile, peak[tile], 1)
    assert "mlp_tile" not in json.dumps(best["config_patch"]) and f"--mlp-tile {tile}" in captured.err

    for command, extra in (("estimate", []), ("plan", ["--devices", "2", "--budget", "1GB"])):
        with pytest.raises(SystemExit):
            main([command, "--mlp-tile", "0", *extra])
        assert "argument --mlp-tile: 0 must be >= 1 (positions per piece, or auto)" in capsys.readouterr().err
        assert main([command, "--model", "tiny", "--mlp-tile", "4", *extra]) == 1
        err = capsys.readouterr().err.strip()
        assert err == ("error: --mlp-tile 4: GPT-2 tiny has no tiled MLP (its model takes no mlp_tile); "
                       "drop --mlp-tile, or plan a Llama-family model")


@pytest.mark.slow
def test_estimate_aot_compiles_the_tiled_mlp_beside_the_untiled(tmp_path):
    """`zerojax estimate --aot --no-plan` on a Llama-family shape's long row: the compiled table has
    the untiled step and the default tile's (the CLI's model factory takes mlp_tile), and the
    tiled step's peak is the smaller."""
    from zerojax.planning import planner as PL

    T, out = 2 * PL.MLP_TILE, tmp_path / "e.json"
    assert main(["estimate", "--model", "tiny-llama", "--gpus", "8", "--aot", "--no-plan", "--stage", "2",
                 "--remat", "off", "--micro-batch", "1", "--seq", str(T), "--json", str(out)]) == 0
    peak = {row["mlp_tile"]: row["peak"] for row in json.loads(out.read_text())["compiled"]}
    assert set(peak) == {None, PL.default_mlp_tile(T)} and peak[PL.default_mlp_tile(T)] < peak[None]
