"""Serving: continuous batching over a paged KV cache (`LLMEngine`), in-process (`LLM`) or behind
the OpenAI-compatible HTTP server `zerojax serve` (the `serve` extra). docs/serving.md."""
from zerojax.serving.engine import LLMEngine
from zerojax.serving.llm import LLM
from zerojax.serving.output import RequestOutput
from zerojax.serving.params import BadRequestError, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "BadRequestError"]
