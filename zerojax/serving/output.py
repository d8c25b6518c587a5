"""A request's new tokens turned into what a client sees: text decoded incrementally (only the
last few tokens decoded per step, as vLLM's detokenizer does, not the whole output), the stop
checks (stop ids, stop strings, max_tokens, the context), and a `RequestOutput` per update with
the text that may be sent so far (text that could still turn into a stop string is held back).

The finished result matches `zerojax.generate`'s row: tokens include a stop id that ended it, are
cut after the token that completed a stop string; the text has no stop id and ends before a stop
string."""
from __future__ import annotations

import dataclasses

from zerojax.serving.scheduler import Request


@dataclasses.dataclass
class RequestOutput:
    """One request's state after a step: all its new tokens and text so far, what is new since the
    last update (delta_*), and finish_reason ("stop", "length", "abort", "error") once finished."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    logprobs: list | None  # per new token: (its logprob, {top id: logprob}), where asked for
    delta_logprobs: list | None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # finish_reason "error": what went wrong


def _held_back(text: str, stops) -> int:
    """How many trailing characters of `text` could be the start of a stop string."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class Detokenizer:
    """Per-request text state over a tokenizer (None: token ids only, no text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _append(self, req: Request) -> None:
        """vLLM's incremental detokenization: the new text is what the last few tokens decode to
        beyond what they decoded to before; an incomplete character (U+FFFD) waits for more."""
        ids = req.output
        before = self.tokenizer.decode(ids[req.prefix_offset:req.read_offset])
        after = self.tokenizer.decode(ids[req.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            req.text += after[len(before):]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)

    def add_token(self, req: Request, token: int, max_model_len: int) -> None:
        """`token` appended to the request's output; its finish_reason set where it now stops."""
        req.output.append(token)
        if token in req.stop_ids:
            req.finish_reason = "stop"
            return
        if self.tokenizer is not None:
            before = len(req.text)
            self._append(req)
            if req.params.stop:
                longest = max(len(s) for s in req.params.stop)
                region = req.text[max(0, before - longest + 1):]
                hits = [i for s in req.params.stop if (i := region.find(s)) >= 0]
                if hits:
                    req.text = req.text[:max(0, before - longest + 1) + min(hits)]
                    req.finish_reason = "stop"
                    req.stop_string_cut = True
                    return
        if len(req.output) >= req.max_tokens or len(req.prompt) + len(req.output) >= max_model_len:
            req.finish_reason = "length"

    def final_text(self, req: Request) -> str:
        """The finished text: the output decoded whole (no stop id; a stop string's cut kept)."""
        if self.tokenizer is None:
            return ""
        if req.stop_string_cut:
            return req.text
        ids = req.output[:-1] if req.output and req.output[-1] in req.stop_ids else req.output
        return self.tokenizer.decode(ids)

    def sendable_text(self, req: Request) -> str:
        if req.finish_reason is not None:
            return self.final_text(req)
        return req.text[:len(req.text) - _held_back(req.text, req.params.stop)] if req.params.stop else req.text


def make_output(req: Request, text: str, sent_tokens: int, sent_text: str, error: str | None = None) -> RequestOutput:
    """The update a client gets: everything so far and what is new since `sent_tokens` / `sent_text`."""
    want = req.params.logprobs is not None
    return RequestOutput(
        req.request_id, req.prompt, list(req.output), text, req.output[sent_tokens:],
        text[len(sent_text):] if text.startswith(sent_text) else text,
        list(req.logprobs) if want else None, req.logprobs[sent_tokens:] if want else None,
        finished=req.finish_reason is not None, finish_reason=req.finish_reason, error=error)


__all__ = ["RequestOutput", "Detokenizer", "make_output"]
