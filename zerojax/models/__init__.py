"""Plain Flax NNX models; nothing here imports the rest of zerojax."""
import os

from zerojax.models.gpt2 import GPT2, GPT2Config, chunked_gpt2_loss, flops_per_token, gpt2_loss, num_params
from zerojax.models.hf import gpt2_from_hf, gpt2_from_params, load_hf, save_hf


def weights_writer(record: dict | None):
    """The writer of consolidated weights for a model's `checkpoint_record()`, or None (unknown
    model: the checkpoint's flat safetensors). A writer is `writer(params, out_dir, dtype=None)
    -> path of the weights file`; GPT-2's writes a Hugging Face folder (config.json +
    model.safetensors)."""
    if not record or record.get("type") != "gpt2":
        return None
    config = GPT2Config(**record["config"])

    def write(params, out_dir, dtype=None):
        save_hf(params, config, out_dir, dtype=dtype)
        return os.path.join(out_dir, "model.safetensors")

    return write


__all__ = ["GPT2", "GPT2Config", "chunked_gpt2_loss", "flops_per_token", "gpt2_loss", "num_params",
           "gpt2_from_hf", "gpt2_from_params", "load_hf", "save_hf", "weights_writer"]
