"""`zerojax.serving.LLM`: the serving engine in-process, for batch jobs: every prompt queued at once,
steps run until all are done (a finished row's pages go to the rows still waiting)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from zerojax.serving.engine import LLMEngine
from zerojax.serving.output import RequestOutput
from zerojax.serving.params import SamplingParams


def load_model(path, dtype=None, adapters: dict | None = None, quantize: str | None = None):
    """(model, tokenizer or None, {name: LoRA model}) of a Hugging Face folder, computing in `dtype`
    (default float32), with adapter folders (PEFT's or `zerojax train --lora --save`'s,
    `load_adapter`) applied to copies sharing the base's arrays; with
    `quantize` ("int8" / "nf4" / "int4") the base stored quantized (`quantize_base`)."""
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models import from_hf, load_tokenizer

    dtype = jnp.dtype(dtype or jnp.float32)
    model = from_hf(path, dtype)
    model.dtype = dtype  # compute in the weights' dtype
    tokenizer = load_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    if quantize:
        base, loaded = quantize_base(model, quantize, adapters or {})
        return base, tokenizer, loaded
    graphdef, state = nnx.split(model)
    loaded = {name: load_adapter(nnx.merge(graphdef, state), folder) for name, folder in (adapters or {}).items()}
    return model, tokenizer, loaded


def load_adapter(model, folder, quantize: str | None = None):
    """`model` (a plain base, changed in place) with the adapters of `folder`: a PEFT folder or a
    `zerojax train --lora R --save` folder; the base stored `quantize`d where given."""
    from zerojax import lora
    from zerojax.serving.checkpoints import is_checkpoint, load_trained_adapter

    if is_checkpoint(folder):
        return load_trained_adapter(model, folder, quantize)
    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        raise FileNotFoundError(f"--adapter {folder}: neither a PEFT folder (adapter_config.json) nor a zerojax "
                                "checkpoint (a `zerojax train --lora R --save` folder)")
    return lora.load_peft(model, folder, quantize=quantize)


def load_checkpoint_model(save_dir, dtype=None, adapters: dict | None = None, quantize: str | None = None):
    """(model, None: no tokenizer, {name: LoRA model}) of a whole-model `zerojax train --save`
    folder: its weights exported to a temporary Hugging Face folder (as `zerojax export` does),
    read as `load_model` reads one, the folder removed."""
    import tempfile

    import jax.numpy as jnp

    from zerojax.checkpoint.state import export
    from zerojax.models import weights_writer
    from zerojax.serving.checkpoints import run_lora_settings

    if run_lora_settings(save_dir) is not None:
        raise ValueError(f"--checkpoint {save_dir}: a LoRA run's checkpoint holds its adapters only; serve its "
                         f"base with --hf-checkpoint DIR and this folder as --adapter NAME={save_dir}")
    with tempfile.TemporaryDirectory(prefix="zerojax-serve-") as folder:
        export(save_dir, folder, dtype="bf16" if jnp.dtype(dtype or jnp.float32) == jnp.bfloat16 else "fp32",
               writer_for=weights_writer)
        model, _, loaded = load_model(folder, dtype, adapters, quantize)
    return model, None, loaded


def quantize_base(model, kind: str, adapters: dict):
    """(the base stored quantized as QLoRA stores it (`zerojax.lora.apply(..., quantize=kind)`: the
    kernels dequantized on use), {name: its PEFT folder's adapters over that base}). The base is a
    LoRA model with its adapters disabled (a LoRA model is what carries a quantized base); the
    adapters (`load_adapter`'s folders) share its quantized arrays, but for one with modules_to_save."""
    import dataclasses

    from flax import nnx

    from zerojax import lora

    if kind not in lora.QUANTIZE[1:]:
        raise ValueError(f"quantize={kind!r}: one of {list(lora.QUANTIZE[1:])}")
    graphdef, state = nnx.split(model)
    base = lora.apply(nnx.merge(graphdef, state), {"r": 1, "target_modules": "all-linear", "quantize": kind})
    base.adapter = dataclasses.replace(base.adapter, enabled=False)  # the frozen base alone
    frozen = nnx.state(base, lora.FrozenWeight)
    loaded = {}
    for name, folder in adapters.items():
        tuned = load_adapter(nnx.merge(graphdef, state), folder, kind)
        if not tuned.adapter.savable:  # the same quantized arrays as the base's: kept once
            nnx.update(tuned, frozen)
        loaded[name] = tuned
    return base, loaded


class LLM:
    """The engine over `model_or_dir` (a zerojax model, or a Hugging Face folder read with
    `dtype`, its base stored `quantize`d: "int8" / "nf4"); `engine_kwargs` go to `LLMEngine`
    (page_size, kv_cache_tokens, max_num_seqs, max_batched_tokens, max_model_len, prefix_caching,
    decode_attention; adapters: {name: PEFT folder or LoRA model})."""

    def __init__(self, model_or_dir, tokenizer=None, *, dtype=None, adapters: dict | None = None,
                 quantize: str | None = None, **engine_kwargs):
        if isinstance(model_or_dir, (str, os.PathLike)):
            folders = {k: v for k, v in (adapters or {}).items() if isinstance(v, (str, os.PathLike))}
            model, tok, loaded = load_model(os.fspath(model_or_dir), dtype, folders, quantize)
            adapters = {**(adapters or {}), **loaded}
            tokenizer = tokenizer or tok
        elif quantize:
            raise ValueError("LLM(model, quantize=...): quantize applies to a folder read here; give a model "
                             "quantized already (zerojax.serving.llm.quantize_base)")
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
        return run_all(self.engine, prompts, per, adapter=adapter)


def run_all(engine: LLMEngine, prompts, params: Sequence[SamplingParams], *,
            adapter: str | None = None) -> list[RequestOutput]:
    """Every prompt (with its own SamplingParams) queued at once, steps run until all are done: a
    finished row's pages go to the rows still waiting -> the finished outputs, in order."""
    ids = [engine.add_request(p, sp, adapter=adapter) for p, sp in zip(prompts, params)]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


__all__ = ["LLM", "run_all", "load_model", "load_adapter", "load_checkpoint_model", "quantize_base"]
