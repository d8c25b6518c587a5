"""`zerojax generate` and `zerojax chat` on a tiny Hugging Face folder with a word-level tokenizer."""
import json

import pytest

from zerojax.cli import main
from zerojax.generation import generate
from zerojax.models import from_hf, load_tokenizer

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from models.test_llama import _hf_model  # noqa: E402 (tests/ on sys.path)

TEMPLATE = ("{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}w1 {% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The llama3 tiny model (vocab 101) with a tokenizer of the words w0 .. w100 and a chat template."""
    path = tmp_path_factory.mktemp("hf_cli")
    hf = _hf_model("llama3")
    hf.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(hf.config.vocab_size)}
    vocab.update({"user": 2, "system": 3, ":": 4})  # (their w-words are then unknown: fine for a test)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({**vocab}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "chat_template": TEMPLATE}))
    return path


def test_generate_prints_the_libraries_text(folder, capsys):
    args = ["generate", "--hf-checkpoint", str(folder), "--prompt", "w5 w9 w33", "--max-new-tokens", "6"]
    assert main(args) == 0
    expected = generate(from_hf(folder), "w5 w9 w33", max_new_tokens=6, tokenizer=load_tokenizer(folder)).texts[0]
    assert capsys.readouterr().out == expected + "\n"


def test_bad_input_is_one_error_line(folder, tmp_path, capsys):
    """--decode-attention reaches generate (this model's head_dim 8 is one the kernel refuses); a
    folder without a checkpoint: one `error:` line each, exit status 1."""
    args = ["generate", "--hf-checkpoint", str(folder), "--prompt", "w5", "--decode-attention", "kernel"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: decode_attention='kernel': the kernel takes a power-of-two head_dim") and \
        err.count("\n") == 1, err
    assert main(["generate", "--hf-checkpoint", str(tmp_path), "--prompt", "w5"]) == 1
    assert capsys.readouterr().err == f"error: no config.json in {str(tmp_path)!r}\n"


def test_chat_keeps_the_conversation_and_exits(folder, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("w7 w8\nw9\n/exit\nw10\n"))
    assert main(["chat", "--hf-checkpoint", str(folder), "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2  # two turns, none after /exit


def test_generate_with_a_peft_adapter(folder, tmp_path, capsys):
    from zerojax import lora

    model = lora.apply(from_hf(folder), {"r": 4, "target_modules": "all-linear", "init_lora_weights": False})
    lora.save_peft(model, tmp_path / "adapter")
    args = ["generate", "--hf-checkpoint", str(folder), "--adapter", str(tmp_path / "adapter"), "--prompt", "w5 w9",
            "--max-new-tokens", "5"]
    assert main(args) == 0
    expected = generate(model, "w5 w9", max_new_tokens=5, tokenizer=load_tokenizer(folder)).texts[0]
    assert capsys.readouterr().out == expected + "\n"
