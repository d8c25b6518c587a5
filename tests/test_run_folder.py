"""A training checkpoint folder as a model: `zerojax export` writes a Hugging Face folder that
transformers loads offline (weights, the run's tokenizer files, pad_token_id), and `zerojax generate`
takes the checkpoint folder itself.

References: transformers' greedy generation from the exported folder, the `tokenizers` library's
ids and decoding, and the base folder's own weights (the checkpoint's differ: it trained).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from zerojax import cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from safetensors.numpy import load_file  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama folder with a word-level tokenizer (w0 .. w100; pad w2, end w100) and generation config."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=100)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(101)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w100", "pad_token": "w2"}))
    return path


def test_a_training_checkpoint_exports_and_generates_as_transformers_does(base, tmp_path, capsys):
    data, config, ck, out = (tmp_path / n for n in ("sft.jsonl", "fp32.json", "ck", "out"))
    data.write_text("".join(json.dumps({"prompt": f"w{i % 50 + 3} w{i % 7 + 3}", "completion": f" w{i % 9 + 3}"}) + "\n"
                            for i in range(64)))
    config.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto",
                                  "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    assert cli.main(["train", "--hf-checkpoint", str(base), "--data", str(data), "--config", str(config),
                     "--seq-len", "16", "--micro-batch", "1", "--lr", "1e-2", "--steps", "1", "--eval-batches", "0",
                     "--save", str(ck)]) == 0
    assert cli.main(["export", str(ck), str(out)]) == 0
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == tok.token_to_id("w2")
    assert (out / "generation_config.json").exists()
    trained, start = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # the checkpoint's weights, not the base's

    capsys.readouterr()
    assert cli.main(["generate", "--hf-checkpoint", str(ck), "--prompt", "w5 w9", "--max-new-tokens", "5"]) == 0
    ours = capsys.readouterr().out.strip()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("w5 w9").ids])
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
    theirs = theirs[:theirs.index(100)] if 100 in theirs else theirs  # both end at the end token, unprinted
    assert len(theirs) > 1 and ours == tok.decode(theirs)
