"""`zerojax.serving.LLM`: the serving engine in-process, for batch jobs: every prompt queued at once,
steps run until all are done (a finished row's pages go to the rows still waiting)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from zerojax.serving.engine import LLMEngine
from zerojax.serving.output import RequestOutput
from zerojax.serving.params import SamplingParams


def load_model(path, dtype=None, adapters: dict | None = None):
    """(model, tokenizer or None, {name: LoRA model}) of a Hugging Face folder, computing in `dtype`
    (default float32), with PEFT adapter folders applied to copies sharing the base's arrays."""
    import jax.numpy as jnp
    from flax import nnx

    from zerojax import lora
    from zerojax.models import from_hf, load_tokenizer

    dtype = jnp.dtype(dtype or jnp.float32)
    model = from_hf(path, dtype)
    model.dtype = dtype  # compute in the weights' dtype
    tokenizer = load_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    graphdef, state = nnx.split(model)
    loaded = {name: lora.load_peft(nnx.merge(graphdef, state), folder) for name, folder in (adapters or {}).items()}
    return model, tokenizer, loaded


class LLM:
    """The engine over `model_or_dir` (a zerojax model, or a Hugging Face folder read with
    `dtype`); `engine_kwargs` go to `LLMEngine` (page_size, kv_cache_tokens, max_num_seqs,
    max_batched_tokens, max_model_len, prefix_caching; adapters: {name: PEFT folder or LoRA model})."""

    def __init__(self, model_or_dir, tokenizer=None, *, dtype=None, adapters: dict | None = None, **engine_kwargs):
        if isinstance(model_or_dir, (str, os.PathLike)):
            folders = {k: v for k, v in (adapters or {}).items() if isinstance(v, (str, os.PathLike))}
            model, tok, loaded = load_model(os.fspath(model_or_dir), dtype, folders)
            adapters = {**(adapters or {}), **loaded}
            tokenizer = tokenizer or tok
        else:
            model = model_or_dir
        self.engine = LLMEngine(model, tokenizer, adapters=adapters, **engine_kwargs)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 adapter: str | None = None) -> list[RequestOutput]:
        """A finished RequestOutput per prompt (text, or a list of token ids), in order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        ids = [self.engine.add_request(p, sp, adapter=adapter) for p, sp in zip(prompts, per)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            done.update((o.request_id, o) for o in self.engine.step() if o.finished)
        return [done[i] for i in ids]


__all__ = ["LLM", "load_model"]
