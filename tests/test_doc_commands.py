"""Every `zerojax ...` command in a fenced block of README.md and docs/*.md runs as written, or is
in SKIPPED below with the reason; docs/flow.md's commands are the whole flow (SFT -> reward model
-> DPO -> GRPO -> generate -> export), whose folders transformers and peft load.

All commands run in this one process through `zerojax.cli.main` (no subprocess each), in order, in
one scratch folder, after docs/flow.md's (whose outputs the other pages' placeholders name).
How a documented command becomes the one that runs:
- continuation lines joined, `# ...` comments dropped, `[optional parts]` left out;
- `--steps N` lowered to STEPS (FLOW_STEPS in docs/flow.md), and added to a `zerojax train`
  without one;
- placeholders: `DIR` and `BASE` -> one tiny fp32 Llama folder (tests/tiny_llama_folder.py: a
  byte-level BPE tokenizer, a chat template), `REWARD_MODEL_DIR` -> the flow's reward model
  (runs/rm); the files a page names (chat.jsonl, pairs.jsonl, prompts.jsonl, notes.txt, hostfile,
  the reward function mypkg/rewards.py:score, the method module my_method.py that
  docs/extending.md shows) are written into the scratch folder first; `chat` reads one turn.

References: peft's `merge_and_unload` on the folder a step started from (the merged folders'
weights), transformers' greedy `generate` from the merged folder and peft's from the base with the
adapter (the `zerojax generate` texts), transformers' loaders (each folder loads, in the dtype the
base stores).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shlex
import sys

import pytest

from zerojax import cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# --steps lowered to: 3 in docs/flow.md, whose outputs must have trained (DeepSpeed's warmup
# schedules run the first two steps at warmup_min_lr, 0), 1 elsewhere (the command runs)
FLOW_STEPS, STEPS = 3, 1
USER_MODULES = ("my_method", "mypkg")  # written into the scratch folder by _write_inputs
TINY_BASE = "<the tiny Llama folder>"
PLACEHOLDERS = {"DIR": TINY_BASE, "BASE": TINY_BASE, "REWARD_MODEL_DIR": "runs/rm"}
# the start of a documented command -> why it does not run here
SKIPPED = {
    "zerojax serve": "starts a server that runs until stopped (tests/serving/ serve over HTTP in-process)",
    "zerojax estimate --model tiny --gpus 2 --aot --cpu --budget 12MB --micro-batch auto":
        "README.md's: run as written (with --json) by tests/test_cli.py, which checks its plans (20 s of compiles)",
    "zerojax train --hf-checkpoint DIR --lora 16 --method grpo --data prompts.jsonl --seq-len 512":
        "512-token rollouts, 8 a prompt: 145 s on 2 CPU cores; docs/flow.md's GRPO command runs these flags at "
        "--seq-len 64, and tests/rl/ the module:function reward spec",
    "zerojax launch --num_procs 2 examples/gpt2_large.py": "two processes training GPT-2 Large "
                                                            "(tests/launch/ run the launcher on tiny scripts)",
    "zerojax launch --proc_per_gpu": "a process per GPU; its '...' stands for the script's flags",
    "zerojax launch --hostfile hostfile --include": "pdsh to the hostfile's machines",
    "zerojax launch --hostfile hostfile --launcher ssh": "ssh to the hostfile's machines",
    "zerojax launch --hostfile hostfile --no_ssh": "runs the user's train.py as node 1 of 2, waiting for node 0",
}


def documented_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each `zerojax ...` line of the page's fenced bash / shell blocks
    (or blocks without a language), continuation lines joined and comments dropped."""
    found, lines, i, shell = [], text.split("\n"), 0, None
    while i < len(lines):
        fence = re.match(r"\s*```(\w*)", lines[i])
        if fence:  # an opening fence says whether the block is shell, a closing one ends it
            shell = None if shell is not None else fence.group(1) in ("bash", "sh", "shell", "console", "")
        elif shell and lines[i].lstrip().startswith("zerojax "):
            start, command = i, lines[i]
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            found.append((start + 1, shlex.join(shlex.split(command, comments=True))))
        i += 1
    return found


def runnable(command: str, base, steps: int = STEPS) -> list[str]:
    """The command's argv as it runs here (see the module docstring)."""
    argv, depth = [], 0
    for word in shlex.split(command)[1:]:
        depth += len(word) - len(word.lstrip("["))  # [optional] words, nested [--a [--b]] too
        if depth == 0:
            key, eq, value = word.rpartition("=")  # --method-option critic=REWARD_MODEL_DIR too
            value = PLACEHOLDERS.get(value, value)
            argv.append(key + eq + (str(base) if value == TINY_BASE else value))
        depth -= len(word) - len(word.rstrip("]"))
    if argv[:1] == ["train"]:
        if "--steps" in argv:
            at = argv.index("--steps") + 1
            argv[at] = str(min(int(argv[at]), steps))
        else:
            argv += ["--steps", str(steps)]
    return argv


def pages() -> list[pathlib.Path]:
    """docs/flow.md first (the others name its outputs), then README.md and the other pages."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "docs" / "flow.md", ROOT / "README.md", *(p for p in docs if p.name != "flow.md")]


def test_commands_are_read_as_written():
    page = ("x\n```bash\nzerojax train --model tiny \\\n    --steps 900 --lr 1e-3   # a comment\necho no\n```\n"
            "```python\nzerojax = 1\n```\n"
            "```bash\nzerojax generate --hf-checkpoint DIR [--adapter X] --prompt \"a b\"\n```\n")
    found = documented_commands(page)
    assert found == [(3, "zerojax train --model tiny --steps 900 --lr 1e-3"),
                     (11, "zerojax generate --hf-checkpoint DIR '[--adapter' 'X]' --prompt 'a b'")]
    assert runnable(found[0][1], "/b") == ["train", "--model", "tiny", "--steps", str(STEPS), "--lr", "1e-3"]
    assert runnable(found[1][1], "/b") == ["generate", "--hf-checkpoint", "/b", "--prompt", "a b"]


def _write_inputs(folder: pathlib.Path):
    """The files the pages' commands name, as a user would have them."""
    sums = [(a, b) for a in range(1, 9) for b in range(1, 5)]
    with open(folder / "chat.jsonl", "w") as f:
        for a, b in sums:
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")
    with open(folder / "pairs.jsonl", "w") as f:
        for a, b in sums:
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": str(a + b),
                                "rejected": str(a + b + 1)}) + "\n")
    with open(folder / "prompts.jsonl", "w") as f:
        for a, b in sums:
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    (folder / "notes.txt").write_text("Notes on training small models on a laptop.\n" * 400)
    (folder / "hostfile").write_text("worker-0 slots=8\nworker-1 slots=8\n")  # docs/distributed.md's
    (folder / "mypkg").mkdir()
    (folder / "mypkg" / "__init__.py").write_text("")
    (folder / "mypkg" / "rewards.py").write_text(
        "def score(prompts, completions, **fields):\n    return [float(c.count('5')) for c in completions]\n")
    # docs/extending.md: "Save this as `my_method.py` in the folder you run `zerojax train` from:"
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text[text.index("Save this as `my_method.py`"):]
    (folder / "my_method.py").write_text(re.search(r"```python\n(.*?)```", after, re.S).group(1))


@pytest.fixture(scope="module")
def ran(tiny_llama_dir, tmp_path_factory):
    """Every documented command run in order in one scratch folder: {(page, line): (command, argv,
    exit status, stdout)}; the folder is `ran["folder"]`."""
    folder = tmp_path_factory.mktemp("doc-commands")
    _write_inputs(folder)
    results = {}
    here = os.getcwd()
    os.chdir(folder)
    _forget_user_modules()  # another test's my_method.py, imported first, would stand in for this folder's
    try:
        for page in pages():
            for line, command in documented_commands(page.read_text()):
                if any(command.startswith(skip) for skip in SKIPPED):
                    continue
                argv = runnable(command, tiny_llama_dir, FLOW_STEPS if page.name == "flow.md" else STEPS)
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                        _stdin("What is 2 + 3?\n"):
                    try:
                        status = cli.main(argv)
                    except (Exception, SystemExit) as e:  # a bug's traceback, argparse's exit: reported below
                        status = f"raised {e!r}"
                results[(page.relative_to(ROOT).as_posix(), line)] = (command, argv, status, out.getvalue(),
                                                                      err.getvalue())
    finally:
        os.chdir(here)
        _forget_user_modules()
    return {"folder": folder, "base": tiny_llama_dir, "results": results}


def _forget_user_modules():
    """The user's modules the commands import from the working folder, dropped from sys.modules."""
    for name in [n for n in sys.modules if n.split(".")[0] in USER_MODULES]:
        del sys.modules[name]


@contextlib.contextmanager
def _stdin(text):
    saved, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


@pytest.mark.slow
def test_documented_commands_run_and_the_flow_gives_what_transformers_and_peft_load(ran):
    """One test over the one run of every command (under xdist's work stealing, a second test using
    `ran` could run it again in another worker)."""
    _every_documented_command_ran_or_is_skipped_for_a_reason(ran)
    _the_flow_writes_folders_transformers_and_peft_load(ran)
    _the_flow_generates_what_transformers_and_peft_generate(ran)


def _every_documented_command_ran_or_is_skipped_for_a_reason(ran):
    failed = [f"{page}:{line}: {' '.join(argv)} -> exit {status}\n{err[-2000:]}"
              for (page, line), (_, argv, status, _, err) in ran["results"].items() if status != 0]
    assert not failed, "\n\n".join(failed)
    silent = [f"{page}:{line}" for (page, line), (command, _, _, out, _) in ran["results"].items()
              if command.split()[1] in ("generate", "chat") and not out.strip()]
    assert not silent, f"generate / chat printed no text: {silent}"
    every = [c for p in pages() for _, c in documented_commands(p.read_text())]
    unused = [s for s in SKIPPED if not any(c.startswith(s) for c in every)]
    assert not unused, f"SKIPPED entries that match no documented command: {unused}"
    assert len(ran["results"]) >= 10  # the extraction found the pages' commands


def _generated(ran, marker):
    """The text `zerojax generate` printed for the flow's command containing `marker`."""
    for (page, _), (command, _, _, out, _) in ran["results"].items():
        if page == "docs/flow.md" and command.startswith("zerojax generate") and marker in command:
            return out.strip()
    raise AssertionError(f"no docs/flow.md generate command with {marker!r}")


def _merged_equals_peft(merged, base, adapter):
    """The merged folder against peft's merge_and_unload of `adapter` on its base (the folder its
    adapter_config.json names, `base`, loaded by peft's Auto class as docs/flow.md says): dtype and
    weights."""
    ours = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype="auto")
    start = transformers.AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    assert ours.dtype == start.dtype == torch.float32  # the tiny base is stored fp32; training ran in bf16
    assert ours.config.pad_token_id == start.config.pad_token_id is not None  # from the tokenizer, as export's
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(adapter, dtype="auto").merge_and_unload().state_dict()
    before = start.state_dict()
    assert any(not torch.equal(theirs[k], before[k]) for k in before)  # the adapters trained
    for name, w in ours.state_dict().items():
        torch.testing.assert_close(w, theirs[name], rtol=0, atol=1e-6, msg=name)


def _the_flow_writes_folders_transformers_and_peft_load(ran):
    runs = ran["folder"] / "runs"
    # export: the SFT run's checkpoint as a folder, trained weights (not the base's) in fp32
    sft = transformers.AutoModelForCausalLM.from_pretrained(runs / "sft-hf", dtype="auto")
    base = transformers.AutoModelForCausalLM.from_pretrained(ran["base"], dtype="auto").state_dict()
    assert sft.dtype == torch.float32 and any(not torch.equal(w, base[k]) for k, w in sft.state_dict().items())
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(runs / "rm")
    assert rm.config.num_labels == 1
    # the merged DPO and GRPO folders are peft's merge of the adapter on the step's own base
    _merged_equals_peft(runs / "dpo", runs / "sft-hf", runs / "dpo" / "adapter")
    _merged_equals_peft(runs / "grpo-hf", runs / "dpo", runs / "grpo-hf" / "adapter")


def _the_flow_generates_what_transformers_and_peft_generate(ran):
    runs = ran["folder"] / "runs"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(runs / "grpo-hf" / "tokenizer.json"))
    ids = torch.tensor([tok.encode("What is 2 + 3?")])
    end = transformers.AutoConfig.from_pretrained(ran["base"]).eos_token_id

    def greedy(model):
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=end)[0, ids.shape[1]:].tolist()
        return tok.decode(new[:new.index(end)] if end in new else new)  # the end token ends it, unprinted

    merged = transformers.AutoModelForCausalLM.from_pretrained(runs / "grpo-hf", dtype=torch.float32).eval()
    assert _generated(ran, "runs/grpo-hf --prompt") == greedy(merged)
    dpo = transformers.AutoModelForCausalLM.from_pretrained(runs / "dpo", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(dpo, runs / "grpo-hf" / "adapter")
    assert _generated(ran, "--adapter runs/grpo-hf/adapter") == greedy(adapted.eval())
