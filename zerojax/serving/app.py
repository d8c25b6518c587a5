"""The OpenAI-compatible HTTP layer (FastAPI): /v1/completions, /v1/chat/completions (the
checkpoint's chat template), /v1/models, /health, /metrics; streaming by server-sent events. It
checks and tokenizes requests, hands them to the engine thread (`AsyncEngine`) and turns updates
into OpenAI's bodies: it never touches an array. Every error is OpenAI's error object: 400 for bad
input (malformed JSON, an unknown model, a prompt or max_tokens past the context, a bad sampling
value), 401 without the API key, 500 where the engine failed the request."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from zerojax.serving import protocol as P
from zerojax.serving.async_engine import AsyncEngine
from zerojax.serving.params import BadRequestError

log = logging.getLogger("zerojax.serving")
DISCONNECT_CHECK_S = 0.5  # how often a waiting non-streamed request asks whether its client is still there


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg')}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""), where


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Server:
    """The routes' shared state: the engine thread, the served names, the tokenizer."""

    def __init__(self, aengine: AsyncEngine, model_name: str):
        self.aengine, self.engine, self.model_name = aengine, aengine.engine, model_name

    def adapter_of(self, model: str):
        if model == self.model_name:
            return None
        if model in self.engine.adapters:
            return model
        raise BadRequestError(f"model {model!r} is not served here; served: {[self.model_name] + self.engine.adapters}",
                              param="model")

    def models(self) -> dict:
        names = [self.model_name] + self.engine.adapters
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "zerojax",
                                            "root": self.model_name} for n in names]}

    def requests(self, prompts, params, adapter, add_special_tokens: bool, prefix: str):
        return [self.engine.make_request(p, params, adapter=adapter, request_id=P.new_id(prefix),
                                         add_special_tokens=add_special_tokens) for p in prompts]

    async def _final(self, req):
        async with contextlib.aclosing(self.aengine.generate(req)) as updates:
            async for out in updates:
                if out.finished:
                    return out

    async def merged(self, reqs):
        """(index, update) of several requests as they come; leaving early aborts them all."""
        if len(reqs) == 1:  # the usual case: its updates as they are, no task and queue between
            async with contextlib.aclosing(self.aengine.generate(reqs[0])) as updates:
                async for out in updates:
                    yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, req):
            async with contextlib.aclosing(self.aengine.generate(req)) as updates:
                async for out in updates:
                    await q.put((i, out))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            for _ in range(sum(1 for _ in reqs)):
                while True:
                    i, out = await q.get()
                    yield i, out
                    if out.finished:
                        break
        finally:
            for t in tasks:
                t.cancel()

    async def complete(self, reqs, model: str, chat: bool, http: HTTPRequest):
        """The whole answer; a client gone before it (checked twice a second) aborts its requests."""
        answer = asyncio.ensure_future(asyncio.gather(*(self._final(r) for r in reqs)))
        while not (await asyncio.wait({answer}, timeout=DISCONNECT_CHECK_S))[0]:
            if await http.is_disconnected():
                answer.cancel()  # each request's updates closed: the engine aborts it, its pages back
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
                return Response(status_code=499)
        outs = answer.result()
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            return JSONResponse(P.error_body(f"the engine failed this request: {failed[0].error}", "server_error",
                                             code=500), 500)
        choices = []
        for i, o in enumerate(outs):
            entries = list(zip(o.token_ids, o.logprobs)) if o.logprobs is not None else None
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": o.text},
                                "logprobs": P.chat_logprobs(entries, self.engine.tokenizer),
                                "finish_reason": o.finish_reason})
            else:
                choices.append({"index": i, "text": o.text,
                                "logprobs": P.completion_logprobs(entries, self.engine.tokenizer),
                                "finish_reason": o.finish_reason})
        use = P.usage(sum(len(o.prompt_token_ids) for o in outs), sum(len(o.token_ids) for o in outs))
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse(P.completion_body(rid, model, choices, use, kind))

    def stream(self, reqs, model: str, chat: bool, include_usage: bool) -> StreamingResponse:
        rid, kind = P.new_id("chatcmpl" if chat else "cmpl"), "chat.completion.chunk" if chat else "text_completion"
        tok = self.engine.tokenizer

        def chunk(i, delta, finish, entries):
            if chat:
                choice = {"index": i, "delta": delta, "logprobs": P.chat_logprobs(entries, tok),
                          "finish_reason": finish}
            else:
                choice = {"index": i, "text": delta, "logprobs": P.completion_logprobs(entries, tok),
                          "finish_reason": finish}
            return P.completion_body(rid, model, [choice], None, kind)

        async def events():
            prompt_tokens = completion_tokens = 0
            if chat:
                for i in range(len(reqs)):
                    yield _sse(chunk(i, {"role": "assistant", "content": ""}, None, None))
            async with contextlib.aclosing(self.merged(reqs)) as updates:
                async for i, out in updates:
                    if out.finish_reason == "error":
                        yield _sse(P.error_body(f"the engine failed this request: {out.error}", "server_error",
                                                code=500))
                        return
                    entries = (list(zip(out.delta_token_ids, out.delta_logprobs)) if out.delta_logprobs is not None
                               else None)
                    # a chunk per token (no tokenizer: no text)
                    if out.delta_text or out.delta_token_ids or out.finished:
                        delta = {"content": out.delta_text} if chat else out.delta_text
                        yield _sse(chunk(i, delta, out.finish_reason if out.finished else None, entries))
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
                        completion_tokens += len(out.token_ids)
            if include_usage:
                yield _sse(P.completion_body(rid, model, [], P.usage(prompt_tokens, completion_tokens), kind))
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")


class _RequireKey:
    """The bearer token on every route but /health (401 with OpenAI's error object without it), as
    a plain ASGI middleware: it looks at a request's headers once and passes the response through
    untouched (starlette's `@app.middleware("http")` relays every streamed chunk through a memory
    stream and a task of its own: the most time of the server's thread in a profile of 128 streams)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = JSONResponse(P.error_body("a valid API key is needed: the header Authorization: Bearer KEY",
                                                    "authentication_error", code="invalid_api_key"), 401)
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def _include_usage(body) -> bool:
    """Whether a streamed request asked for a last chunk with the usage (stream_options)."""
    return bool(body.stream_options and body.stream_options.include_usage)


def build_app(aengine: AsyncEngine, *, model_name: str, api_key: str | None = None, metrics=None) -> FastAPI:
    """The ASGI app over a started (or to be started) engine thread."""
    app = FastAPI(title="zerojax serve", docs_url=None, redoc_url=None)
    server = _Server(aengine, model_name)

    if api_key:
        app.add_middleware(_RequireKey, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(P.error_body(message, param=param, code=400), 400)

    @app.exception_handler(BadRequestError)
    async def bad(request, exc: BadRequestError):
        return JSONResponse(P.error_body(str(exc), param=exc.param, code=400), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return JSONResponse(P.error_body(str(exc.detail), code=exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(P.error_body(f"{type(exc).__name__}: {exc}", "server_error", code=500), 500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response(status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, http: HTTPRequest):
        adapter, params = server.adapter_of(body.model), body.sampling_params()
        reqs = server.requests(body.prompts(), params, adapter, True, "cmpl")
        if body.stream:
            return server.stream(reqs, body.model, False, _include_usage(body))
        return await server.complete(reqs, body.model, False, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, http: HTTPRequest):
        from zerojax.data.finetune import render_chat

        adapter, params = server.adapter_of(body.model), body.sampling_params()
        if server.engine.tokenizer is None:
            raise BadRequestError("this server has no tokenizer: chat needs one (--tokenizer)", param="messages")
        try:
            text = render_chat(server.engine.tokenizer, [m.as_dict() for m in body.messages],
                               add_generation_prompt=True)
        except Exception as e:  # no template, or the template refused the messages (raise_exception)
            raise BadRequestError(f"the chat template: {e}", param="messages") from e
        reqs = server.requests([text], params, adapter, False, "chatcmpl")  # the template writes BOS itself
        if body.stream:
            return server.stream(reqs, body.model, True, _include_usage(body))
        return await server.complete(reqs, body.model, True, http)

    return app


__all__ = ["build_app"]
