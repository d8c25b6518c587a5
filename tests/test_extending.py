"""docs/extending.md's code, run as the doc gives it (its code blocks are read from the file, so the
doc cannot drift): the toy model family registered from this test file decodes through its
`LayerPieces` (`zerojax.generate`, checked against greedy decoding by the model's own whole forward
pass); the toy training method, saved as my_method.py in the working folder, trains the toy family
through `zerojax train --method my_method:SMOOTHED` (its first loss checked against the
label-smoothed cross entropy written out in float64 on the same model and rows); `--method` of
something that is not a Method is refused in one line."""
from __future__ import annotations

import json
import pathlib
import re
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

import zerojax
from zerojax import cli
from zerojax.models import registry

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def doc_code(section: str) -> str:
    """The python code blocks of the doc's `## {section}`, joined."""
    text = DOC.read_text()
    part = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, re.S)
    assert blocks, f"docs/extending.md: no python block under '## {section}'"
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def toy():
    module = types.ModuleType("doc_toy_family")
    sys.modules[module.__name__] = module
    exec(compile(doc_code("Adding a model family"), str(DOC), "exec"), module.__dict__)
    yield module
    registry.unregister(module.TOY_FAMILY.name)
    sys.modules.pop(module.__name__, None)


def test_the_doc_family_decodes_through_its_pieces(toy):
    assert registry.for_shape("toylm-tiny") is toy.TOY_FAMILY
    model = toy.ToyLM(toy.ToyConfig.named("tiny"), rngs=nnx.Rngs(1))
    prompts, new = [[72, 101, 108, 108, 111], [87, 111]], 6
    out = zerojax.generate(model, prompts, max_new_tokens=new)
    # the reference: greedy tokens of the model's whole forward pass (no cache, no pieces), each row
    # padded after its tokens (causal: the padding changes no earlier position), one compiled program
    forward = jax.jit(lambda ids: model(ids))
    rows = [list(p) for p in prompts]
    for _ in range(new):
        ids = np.zeros((len(rows), max(map(len, prompts)) + new), np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        logits = np.asarray(forward(ids))
        for i, r in enumerate(rows):
            r.append(int(np.argmax(logits[i, len(r) - 1])))
    assert [list(t) for t in out.tokens] == [r[len(p):] for r, p in zip(rows, prompts, strict=True)]


def test_the_doc_family_and_method_train_through_zerojax_train(toy, tmp_path, monkeypatch):
    """The method from the working folder (my_method.py, `--method module:object`) on the family
    registered here, in fp32: its first loss is the label-smoothed cross entropy, written out in
    float64, of the seed's model on the reader's first rows; the loss falls."""
    (tmp_path / "my_method.py").write_text(doc_code("Adding a training method"))
    data = tmp_path / "notes.txt"
    # 9 rows of 32 bytes: 8 to train on (every step the same 8: the loss must fall), 1 held out
    data.write_text("".join(f"row {i}: the quick brown fox jumps.\n"[:31] + "\n" for i in range(9)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_method", raising=False)
    summary_path, config = tmp_path / "summary.json", tmp_path / "fp32.json"
    ds_config = json.loads((pathlib.Path(cli.__file__).parent.parent / "configs" / "zero2_bf16.json").read_text())
    del ds_config["scheduler"]  # a constant learning rate (no warmup from 0)
    config.write_text(json.dumps({**ds_config, "bf16": {"enabled": False}}))
    assert cli.main(["train", "--model", "toylm-tiny", "--method", "my_method:SMOOTHED", "--method-option",
                     "smoothing=0.2", "--data", str(data), "--config", str(config), "--lr", "3e-2", "--steps", "3",
                     "--seq-len",
                     "32", "--micro-batch", "1", "--eval-batches", "0", "--summary-json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["family"] == "toylm" and summary["method"] == "my_method:SMOOTHED"
    assert summary["method_options"] == {"smoothing": 0.2} and summary["precision"] == "fp32"
    losses = summary["losses"]
    assert losses[2] < losses[1] < losses[0], losses

    # step 0 trains on the first train_batch_size rows (ByteRows), one per device at micro-batch 1
    tokens = np.frombuffer(data.read_bytes(), np.uint8).astype(np.int64)
    rows = tokens[:len(tokens) // 32 * 32].reshape(-1, 32)[:summary["train_batch_size"]]
    model = toy.ToyLM(toy.ToyConfig.named("tiny"), rngs=nnx.Rngs(0))
    logits = np.asarray(model(rows.astype(np.int32)), np.float64)[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
    expected = (0.8 * nll - 0.2 * logp.mean(-1)).mean()
    np.testing.assert_allclose(losses[0], expected, rtol=1e-5)


@pytest.mark.parametrize("spec, says", [
    ("numpy:pi", "numpy.pi is a float, not a zerojax.methods.Method"),
    ("my_method:smoothed_loss", "calling my_method.smoothed_loss() failed: TypeError"),
    ("my_method:NOPE", "cannot import 'NOPE' from module 'my_method'"),
])
def test_a_method_spec_that_is_not_a_method_is_one_line(spec, says, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_method.py").write_text(doc_code("Adding a training method"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_method", raising=False)
    assert cli.main(["train", "--model", "tiny", "--method", spec, "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: --method {spec}: ") and says in err, err
