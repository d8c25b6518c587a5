"""`zerojax.models.stored_dtype`: the dtype a Hugging Face folder stores its weights in, which
`zerojax train --lora R --export-hf DIR --merge` writes the merged model in (that run, an fp32 base
trained under bf16 and merged, is docs/flow.md's DPO and GRPO steps: tests/test_doc_commands.py
compares them with peft's merge_and_unload).

Reference: transformers' own `from_pretrained(dtype="auto")`.
"""
from __future__ import annotations

import json

import pytest

from zerojax.models import stored_dtype

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


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
