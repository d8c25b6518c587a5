"""The benchmark suite (`python -m benchmarks`, benchmarks/cases.py): every case's programs and
configs exist, the listing names every case, benchmarks/README.md documents every case, a
multi-GPU case refuses on fewer GPUs, and the cheapest case runs end to end on the CPU (--smoke)
with its table's figure equal to the JSON line the program itself printed; a failed MoE benchmark row
names its exception."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks.cases import CASES

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHEAPEST = "decode-hlo"  # one process that compiles a tiny decode step from shapes


def _suite(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False, **kwargs)


def _repo_paths(argv):
    """The scripts and repository files a run's command names (placeholders {tree} = this tree)."""
    for i, arg in enumerate(argv):
        arg = arg.replace("{tree}/", "")
        if i == 0 and arg != "-m" or re.fullmatch(r"(benchmarks|configs|examples)/[\w./-]+", arg):
            yield arg


def test_every_case_program_and_config_exists():
    missing = []
    for case in CASES.values():
        for run in case.runs:
            for argv in filter(None, (run.argv, run.smoke)):
                if argv[0] == "-m":
                    module = ROOT / argv[1].replace(".", "/")
                    if not (module.with_suffix(".py").exists() or (module / "__main__.py").exists()):
                        missing.append(f"{case.name}/{run.label}: module {argv[1]}")
                missing += [f"{case.name}/{run.label}: {p}" for p in _repo_paths(argv) if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


def test_listing_and_readme_name_every_case():
    listed = _suite()
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines()[1:]}
    assert names == set(CASES)
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    documented = set(re.findall(r"^\| `([\w-]+)` \|", readme, re.MULTILINE))
    assert documented == set(CASES), f"README cases differ: {documented ^ set(CASES)}"


def test_multi_gpu_case_refuses_on_fewer_gpus():
    needs = next(case for case in CASES.values() if case.gpus > 1)
    # no nvidia-smi on PATH: no GPU, on any machine (a multi-GPU host must not start the case here)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    done = _suite(needs.name, "--out", os.devnull + "-unused", env=env)
    assert done.returncode != 0
    assert f"needs {needs.gpus} GPUs" in done.stderr


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = _suite(CHEAPEST, "--smoke", "--out", str(out), env=env)
    return done, out


def test_smoke_case_prints_the_table_of_its_program_output(smoke_run):
    done, out = smoke_run
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # the program's own JSON line, read from its log independently of the runner's reader
    log = (out / f"{CHEAPEST}-decode-hlo.log").read_text()
    printed = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(printed) == 1
    key = CASES[CHEAPEST].headline[0]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["case", "row", "framework"])
    rows = [line.split() for line in lines[header + 2:] if line.startswith(CHEAPEST)]
    assert len(rows) == 1 and key in rows[0]
    shown = rows[0][rows[0].index(key) + 1]
    assert int(shown.replace(",", "")) == printed[0][key]
    saved = [json.loads(line) for line in (out / f"{CHEAPEST}.jsonl").read_text().splitlines()]
    assert saved[0][key] == printed[0][key]


def test_each_row_is_divided_by_its_own_anchor():
    """The table pairs a row with the anchor row of the same match fields (the case's, or with two
    trees the same run), whatever the order, and divides their headline figures."""
    from benchmarks.table import table_rows

    case = CASES["rl"]
    key = case.headline[0]
    records = [{"row": "rl", "framework": "zerojax", "model": "a", key: 30.0},
               {"row": "rl", "framework": "zerojax", "model": "b", key: 12.0},
               {"row": "rl-anchor", "framework": "torch", "model": "b", key: 8.0, "anchor": True},
               {"row": "rl-anchor", "framework": "torch", "model": "a", key: 6.0, "anchor": True},
               {"row": "rl", "framework": "zerojax", "model": "c", key: 1.0}]  # no anchor of its model
    shown = [row[-1] for row in table_rows(case, records)]
    assert shown == [f"{30.0 / 6.0:.2f}x", f"{12.0 / 8.0:.2f}x", "anchor", "anchor", ""]
    trees = [{"row": "bench", "tree": "before", key: 4.0, "anchor": True, "model": "a"},
             {"row": "other", "tree": "before", key: 1.0, "anchor": True, "model": "a"},
             {"row": "bench", "tree": "after", key: 5.0, "model": "a"}]
    assert table_rows(case, trees)[-1][-1] == f"{5.0 / 4.0:.2f}x"


def test_a_failed_moe_row_names_its_exception(capsys):
    # JAX prints a note about its filtered frames after the exception: the row's error names the
    # exception line, not that note, and the whole output goes on to the log (stderr)
    from benchmarks import moe_bench

    output = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
              "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16.02GiB\n"
              "--------------------\nFor simplicity, JAX has removed its internal frames from the traceback of "
              "the following exception. Set JAX_TRACEBACK_FILTERING=off to include these.\n")
    assert moe_bench.failure_line(output) == ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                                              "trying to allocate 16.02GiB")
    assert output.strip() in capsys.readouterr().err
    assert moe_bench.failure_line("no exception, a last line\n") == "no exception, a last line"
