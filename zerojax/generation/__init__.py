"""Generation on zerojax's training weights: a KV-cache decoder for the Llama family and GPT-2
(prefill + decode programs compiled per shape bucket), Hugging Face's sampling, stop ids and
strings, on a plain model or an engine's live, sharded weights. docs/generation.md."""
from zerojax.generation.api import Generation, chat, generate
from zerojax.generation.cache import CacheTooLargeError

__all__ = ["generate", "chat", "Generation", "CacheTooLargeError"]
