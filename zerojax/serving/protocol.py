"""Pydantic models of the OpenAI API's requests (the fields zerojax serves, plus vLLM's top_k,
repetition_penalty, stop_token_ids, ignore_eos) and the response bodies, as the official clients
read them. A field zerojax cannot honour (n > 1, echo, best_of) is refused, never ignored."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zerojax.serving.params import BadRequestError, SamplingParams

# OpenAI fields that would change the answer and that zerojax does not honour: refused, not ignored
# (other unknown fields, e.g. user or metadata, change nothing and pass)
UNSERVED = ("logit_bias", "suffix", "tools", "tool_choice", "functions", "function_call", "response_format",
            "prediction", "audio", "modalities")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields zerojax has no use for (user, metadata)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    def _params(self, max_tokens, logprobs) -> SamplingParams:
        extra = self.model_extra or {}
        for name in UNSERVED:
            if extra.get(name) not in (None, [], {}, "", "none", "auto"):
                raise BadRequestError(f"{name} is not served by zerojax serve: leave it out", param=name)
        if self.n != 1:
            raise BadRequestError(f"n={self.n}: zerojax serve returns one choice per prompt (n=1)", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, max_tokens=max_tokens,
            stop=stop, stop_token_ids=list(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, seed=self.seed,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise BadRequestError("echo=true is not served by zerojax serve", param="echo")
        if self.best_of not in (None, 1):
            raise BadRequestError(f"best_of={self.best_of}: zerojax serve takes 1", param="best_of")
        return self._params(self.max_tokens, self.logprobs)

    def prompts(self) -> list:
        """The prompts: a string or a token list is one, a list of either several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadRequestError("prompt is empty", param="prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]: the text parts joined
            if any(part.get("type") != "text" for part in content):
                raise BadRequestError("message content parts: only {\"type\": \"text\"} parts are served",
                                      param="messages")
            content = "".join(part.get("text", "") for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs and not self.logprobs:
            raise BadRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return self._params(self.max_completion_tokens or self.max_tokens, logprobs)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries, tokenizer) -> dict | None:
    """The completions API's logprobs object of [(logprob, {id: logprob})] per token (text by token)."""
    if entries is None:
        return None
    text = (lambda i: tokenizer.decode([i])) if tokenizer is not None else str
    return {"tokens": [text(t) for t, _ in entries], "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{text(i): v for i, v in top.items()} for _, (_, top) in entries], "text_offset": []}


def chat_logprobs(entries, tokenizer) -> dict | None:
    if entries is None:
        return None
    text = (lambda i: tokenizer.decode([i])) if tokenizer is not None else str
    return {"content": [{"token": text(t), "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": text(i), "logprob": v, "bytes": None} for i, v in top.items()]}
                        for t, (lp, top) in entries]}


def completion_body(rid: str, model: str, choices: list[dict], usage_: dict | None,
                    kind: Literal["text_completion", "chat.completion", "chat.completion.chunk"]) -> dict:
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "error_body", "new_id", "usage",
           "completion_body", "completion_logprobs", "chat_logprobs"]
