"""Plain Flax NNX models; nothing here imports the rest of zerojax."""
from zerojax.models.gpt2 import GPT2, GPT2Config, chunked_gpt2_loss, flops_per_token, gpt2_loss, num_params
from zerojax.models.hf import gpt2_from_hf, gpt2_from_params, load_hf, save_hf

__all__ = ["GPT2", "GPT2Config", "chunked_gpt2_loss", "flops_per_token", "gpt2_loss", "num_params",
           "gpt2_from_hf", "gpt2_from_params", "load_hf", "save_hf"]
