"""Files from outside: a PEFT adapter_model.bin is read with torch's weights_only=True whatever the
torch version's default (a pickle that runs code is refused, unread), and a sharded index may name
only files inside its folder.

References: torch.load(weights_only=False) of the same adapter file, which does create the file
(the payload is real), and safetensors' reader on the shards the index names.
"""
from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from zerojax import lora
from zerojax.models.hf import TensorReader
from zerojax.trainer.choice import named_model

torch = pytest.importorskip("torch")


class _CreatesAFile:
    """Unpickled, it creates the file `path`: what a hostile adapter_model.bin could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_a_pickled_adapter_that_would_create_a_file_is_refused_unread(tmp_path, monkeypatch):
    adapter, marker = tmp_path / "adapter", tmp_path / "created_by_the_adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _CreatesAFile(marker)},
               adapter / "adapter_model.bin")
    # torch before 2.6 read a pickle whole unless told weights_only=True; this variable restores that
    # default for a call that does not say, as pinning no torch version allows
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model = named_model("tiny-llama").build(0, jnp.float32, None)
    with pytest.raises(ValueError) as e:
        lora.load_peft(model, adapter)
    assert not marker.exists()
    said = str(e.value)
    assert "\n" not in said and "adapter_model.bin: refused" in said and "adapter_model.safetensors" in said

    # the reference: the payload is real (torch reading the whole pickle creates the file)
    torch.load(adapter / "adapter_model.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("escape", ["../outside.safetensors", "ABSOLUTE"], ids=["dotdot", "absolute"])
def test_a_sharded_index_naming_a_file_outside_its_folder_is_refused(tmp_path, escape):
    folder = tmp_path / "model"
    folder.mkdir()
    outside = tmp_path / "outside.safetensors"
    save_file({"w": np.arange(4, dtype=np.float32)}, outside)
    name = str(outside) if escape == "ABSOLUTE" else escape
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": name}}))
    with pytest.raises(ValueError) as e:
        TensorReader(str(folder))
    said = str(e.value)
    assert "\n" not in said and repr(name) in said and "outside" in said and str(index) in said

    # the reference: the same shard inside the folder is read, as safetensors stores it
    os.replace(outside, folder / "inside.safetensors")
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "inside.safetensors"}}))
    with TensorReader(str(folder)) as reader:
        np.testing.assert_array_equal(reader.get("w"), np.arange(4, dtype=np.float32))
