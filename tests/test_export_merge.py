"""`zerojax train --lora R --export-hf DIR --merge` writes the merged model in the dtype the base
folder stores (transformers' dtype="auto" rule), not the compute dtype the frozen base trained in.

References: peft's `PeftModel.from_pretrained(base).merge_and_unload()` on the base folder read by
transformers (the merged weights and logits), and transformers' own `from_pretrained(dtype="auto")`
for the dtype a folder is stored in.
"""
from __future__ import annotations

import json

import pytest

from zerojax import cli
from zerojax.models import stored_dtype

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_merge_of_a_bf16_trained_lora_run_keeps_the_fp32_base_and_equals_peft_merge(tiny_llama_dir, tmp_path):
    data, out = tmp_path / "sft.jsonl", tmp_path / "merged"
    data.write_text("".join(json.dumps({"prompt": f"{i % 7} + {i % 5} =", "completion": f" {i % 7 + i % 5}"}) + "\n"
                            for i in range(32)))
    # the shipped default config computes in bf16: the frozen base is held in bf16 while training
    assert cli.main(["train", "--hf-checkpoint", str(tiny_llama_dir), "--data", str(data), "--seq-len", "16",
                     "--micro-batch", "1", "--steps", "3", "--lr", "1e-2", "--eval-batches", "0", "--lora", "4",
                     "--export-hf", str(out), "--merge"]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="auto")
    assert ours.dtype == base.dtype == torch.float32
    ref = peft.PeftModel.from_pretrained(base, out / "adapter").merge_and_unload().eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="auto").state_dict()
    theirs = ref.state_dict()
    # the adapters trained (B moved off its zero start), so the merge changed the projections
    assert (theirs["model.layers.0.self_attn.q_proj.weight"] - start["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-4
    for name, w in ours.state_dict().items():
        torch.testing.assert_close(w, theirs[name], rtol=0, atol=1e-6, msg=name)  # fp32 sums: an ulp or so
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_stored_dtype_reads_a_folder_as_transformers_auto_does(tiny_llama_dir, tmp_path):
    assert stored_dtype(tiny_llama_dir) == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):  # no dtype named: the safetensors header decides
        config.pop(key, None)
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto").dtype
    assert stored_dtype(tmp_path / "bf16") == str(auto).removeprefix("torch.") == "bfloat16"
