"""The PyTorch anchors' model: a random-init Hugging Face causal LM of one of zerojax's named shapes
(`LlamaConfig.named`, turned into Hugging Face's config by `zerojax.models.hf_llama.config_to_hf`: the
same hyperparameters as `zerojax train --model NAME`; no hub access), sdpa attention, made on `device`
in `dtype` (bf16 as the default dtype while it is built: an 8B model never exists in fp32, 32 GB)."""
from __future__ import annotations


def random_llama(name: str, device, dtype, *, use_cache: bool = True):
    import torch
    import transformers

    from zerojax.models import LlamaConfig
    from zerojax.models.hf_llama import config_to_hf

    config = transformers.AutoConfig.for_model(**config_to_hf(LlamaConfig.named(name),
                                                              str(dtype).removeprefix("torch.")))
    config._attn_implementation = "sdpa"
    config.use_cache = use_cache
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(before)
