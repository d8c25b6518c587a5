"""Serving: continuous batching over a paged KV cache (`LLMEngine`), in-process (`LLM`) or behind
the OpenAI-compatible HTTP server `zerojax serve` (the `serve` extra). docs/serving.md.

Names load on first use, so that `zerojax.serving.cli` (the command's flags) imports no jax."""
import importlib

_NAMES = {"LLM": "llm", "load_model": "llm", "LLMEngine": "engine", "SamplingParams": "params",
          "BadRequestError": "params", "RequestOutput": "output"}


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f"zerojax.serving.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'zerojax.serving' has no attribute {name!r}")


__all__ = list(_NAMES)
