"""The serving engine over a training engine's live weights, no copy: the compute-dtype arrays the
engine trains (`engine.state`, any ZeRO stage, as sharded), merged by the engine's own step
settings as `zerojax.generate(engine, ...)` merges them. RL rollouts use it where rows finish at
different lengths (`zerojax.rl.RolloutOptions(generator="serving")`): a finished row's pages and
row go to the rows still running, where `zerojax.generate` keeps every row to the longest's end.

    llm = live_engine(engine, tokenizer, kv_cache_tokens=..., max_num_seqs=rows)
    follow(llm, engine)                       # after each optimizer step, before generating
    outs = zerojax.serving.llm.run_all(llm, prompts, params)
"""
from __future__ import annotations

from flax import nnx

from zerojax.generation.decoder import EngineSource
from zerojax.serving.engine import LLMEngine


def live_engine(engine, tokenizer=None, **engine_kwargs) -> LLMEngine:
    """An `LLMEngine` (engine_kwargs: its page_size, kv_cache_tokens, max_num_seqs, ...) serving
    the training `engine`'s weights as they are now (`follow` moves it to later ones)."""
    settings = engine.step_settings
    template = nnx.merge(settings.graphdef, settings.param_template, settings.rest_template)  # shapes only
    llm = LLMEngine(template, tokenizer, **engine_kwargs)
    follow(llm, engine)
    return llm


def follow(llm: LLMEngine, engine, weights=None) -> None:
    """`llm` serves the training engine's current weights (after its last step; no copy), or
    `weights`: (params, rest) laid out as `engine.state` holds them (a copy from before a step)."""
    if weights is None:  # given weights are a copy: no step of the engine's to wait for
        engine.synchronize()
        weights = (engine.state.params, engine.state.rest)
    llm.use_weights(weights, EngineSource(engine.step_settings))


__all__ = ["live_engine", "follow"]
