"""`SamplingParams`: one request's sampling and stopping, checked when made (the server answers a
bad value with a 400 naming the field, the engine never sees it)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


class BadRequestError(ValueError):
    """A request the engine refuses: a bad sampling value, a prompt past the context, an unknown
    adapter. One line naming the field and what would be accepted; the server's 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _number(name, value, ok: bool, accepts: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        raise BadRequestError(f"{name}={value!r}: {accepts}", param=name)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and stops (Hugging Face's / OpenAI's meanings).

    temperature 0: greedy (the default); else sampled after top_k (0: off) and top_p (1: off).
    max_tokens: new tokens at most (None: up to the context). stop: strings that end the text
    (cut before them); stop_token_ids: ids that end it (kept in the tokens, as generate keeps
    the eos); the model's and tokenizer's eos ids stop too unless ignore_eos. seed: the request's
    own random stream (None: a fresh one), so a seeded request samples the same tokens whatever
    else is in the batch. repetition_penalty: Hugging Face's; presence / frequency_penalty:
    OpenAI's, subtracted from the logits of the tokens generated so far. logprobs: None, or
    how many top alternatives (0 .. 20) to return beside each new token's own log-probability.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self):
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        _number("temperature", self.temperature, self.temperature is not None and self.temperature >= 0,
                "0 (greedy) or a number > 0")
        _number("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadRequestError(f"top_k={self.top_k!r}: an int >= 1, or 0 (or -1) for none", param="top_k")
        mt = self.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise BadRequestError(f"max_tokens={mt!r}: an int >= 1", param="max_tokens")
        _number("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "a number > 0 (1: none)")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), -2 <= getattr(self, name) <= 2, "a number in [-2, 2]")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= self.MAX_LOGPROBS):
            raise BadRequestError(f"logprobs={lp!r}: an int in 0 .. {self.MAX_LOGPROBS}", param="logprobs")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise BadRequestError(f"stop={self.stop!r}: non-empty strings", param="stop")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_token_ids):
            raise BadRequestError(f"stop_token_ids={self.stop_token_ids!r}: ints >= 0", param="stop_token_ids")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise BadRequestError(f"seed={self.seed!r}: an int", param="seed")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def filtered(self) -> bool:
        """Whether sampling asks for top_k or top_p (the step variant that sorts the vocabulary)."""
        return self.temperature > 0 and (bool(self.top_k) or self.top_p < 1)


__all__ = ["SamplingParams", "BadRequestError"]
