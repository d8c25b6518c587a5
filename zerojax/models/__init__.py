"""Plain Flax NNX models; nothing here imports the rest of zerojax."""

from zerojax.models import registry
from zerojax.models.gpt2 import GPT2, GPT2Config, chunked_gpt2_loss, flops_per_token, gpt2_loss, num_params
from zerojax.models.hf import gpt2_from_hf, gpt2_from_params, load_hf, save_hf
from zerojax.models.hub import from_hf, stored_dtype, to_hf
from zerojax.models.llama import Llama, LlamaConfig, chunked_llama_loss, llama_loss
from zerojax.models.moe import MoEConfig, MoELlama, chunked_moe_loss, moe_loss
from zerojax.models.pieces import Geometry, LayerPieces
from zerojax.models.tokenizer import HFTokenizer


def weights_writer(record: dict | None):
    """The writer of consolidated weights for a model's `checkpoint_record()`, or None (no record,
    or no registered family: the checkpoint's flat safetensors). A writer is `writer(params,
    out_dir, dtype=None) -> path of the weights file`: the family's Hugging Face folder
    (config.json + model.safetensors, or shards with model.safetensors.index.json)."""
    family = registry.for_record(record)
    if family is None:
        return None
    config = family.config_from_record(record)

    def write(params, out_dir, dtype=None):
        return family.writer(params, config, out_dir, dtype=dtype)

    return write


def load_tokenizer(path):
    """The tokenizer of a Hugging Face folder (its tokenizer.json, through the `tokenizers`
    library; bos / eos / pad tokens and the chat template from tokenizer_config.json where the
    folder has one), or of a tokenizer.json path: a `zerojax.models.tokenizer.HFTokenizer`."""
    return HFTokenizer(path)


__all__ = ["GPT2", "GPT2Config", "chunked_gpt2_loss", "flops_per_token", "gpt2_loss", "num_params",
           "gpt2_from_hf", "gpt2_from_params", "load_hf", "save_hf", "weights_writer",
           "Llama", "LlamaConfig", "llama_loss", "chunked_llama_loss", "from_hf", "stored_dtype", "to_hf",
           "load_tokenizer", "registry",
           "MoEConfig", "MoELlama", "moe_loss", "chunked_moe_loss", "LayerPieces", "Geometry"]
