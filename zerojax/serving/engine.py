"""`LLMEngine`: requests in at any time, one `step()` at a time: the scheduler picks each running
request's next tokens and admits waiting prompts, the compiled step (`zerojax.serving.step`) runs
them over the paged cache, the sampled tokens are appended, checked for stops, and finished
requests give their pages back at once. Single-threaded: the server's engine thread owns it
(`zerojax.serving.async_engine`), `LLM` calls it in a loop.

A step is at most two program calls per adapter: the rows feeding one token (decodes) as [R, 1]
and the rows feeding a prompt chunk as [R, C], each shape from `zerojax.serving.shapes`, so the
programs compiled stay few whatever the requests' lengths.

Steps overlap (`overlap=True`, vLLM's async scheduling): step t+1 is dispatched before step t's
sampled tokens are read, so the device never waits on the host's scheduling, input building and
output handling between steps. A decode row of t+1 feeds the token t sampled straight from the
device (the token board: each step writes its rows' tokens at their slots, the next reads them);
the host reads t's tokens while t+1 runs and handles stops and streaming one step behind. A
request that stopped at t has computed one more token at t+1: it is dropped unread, and its pages
went back when t was read. A step whose rows need a token still in flight on the host (a
preempted request fed again, penalties counting it) reads it first.
"""
from __future__ import annotations

import itertools
import logging

import jax
import numpy as np
from flax import nnx

from zerojax.generation import decoder
from zerojax.generation.buckets import length_bucket
from zerojax.generation.families import family_class, geometry_of_config
from zerojax.serving import shapes
from zerojax.serving import step as step_mod
from zerojax.serving.adapters import stack_adapters
from zerojax.serving.output import Detokenizer, RequestOutput, make_output
from zerojax.serving.pages import SCRATCH_PAGE, PagePool
from zerojax.serving.params import BadRequestError, SamplingParams
from zerojax.serving.planning import plan_pages
from zerojax.serving.scheduler import Request, Scheduler

log = logging.getLogger("zerojax.serving")


def eos_ids(model, tokenizer) -> frozenset:
    """The model config's eos_token_id(s) and the tokenizer's eos id."""
    out = set()
    for v in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_id", None)):
        out.update(int(i) for i in (v if isinstance(v, (list, tuple)) else [v]) if i is not None)
    return frozenset(out)


def model_len_limit(config) -> int | None:
    """The positions a model can take: GPT-2's learned rows, a rotary model's max_position_embeddings."""
    return geometry_of_config(config).max_positions or getattr(config, "max_position_embeddings", None)




class HashedSource:
    """A weights source whose hash is computed once: the step's compiled-program cache hashes its
    static arguments at every call, and a model's graph hashed anew cost ~0.7 ms a call."""

    def __init__(self, source):
        self.source, self._hash = source, hash(source)

    def model(self, weights):
        return self.source.model(weights)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, HashedSource) and self.source == other.source)


class LLMEngine:
    """The serving engine over `model` (a zerojax Llama / GPT2, LoRA applied or not) and its
    `adapters` ({name: a LoRA model over the same base}: the request's adapter picks one).

    page_size: slots per KV page. kv_cache_tokens: the pool's size in tokens (None: planned from the
    device's free memory, `zerojax.serving.planning`). max_num_seqs: requests running at once.
    max_batched_tokens: tokens one step feeds (decodes + prompt chunks). max_model_len: prompt +
    new tokens of one request (default: the model's positions, at most the pool). buckets: the
    floors of the compiled shapes (`zerojax.serving.shapes.Buckets`). decode_attention: how a step
    (decodes and prompt chunks) reads the pages: "kernel", the fused kernel through each row's page
    table; "xla", the rows' pages gathered for XLA's products; "auto", the kernel on one GPU where it
    takes the shapes.
    overlap: dispatch each step before reading the one before's tokens (the module's docstring)."""

    def __init__(self, model, tokenizer=None, *, adapters=None, page_size: int = 16, kv_cache_tokens: int | None = None,
                 max_num_seqs: int = 64, max_batched_tokens: int = 512, max_model_len: int | None = None,
                 prefix_caching: bool = True, memory_fraction: float = 0.9, buckets: shapes.Buckets = shapes.Buckets(),
                 decode_attention: str = "auto", overlap: bool = True):
        for name, v in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_batched_tokens", max_batched_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: an int >= 1")
        self.tokenizer = tokenizer
        self.dtype = model.dtype
        self.geometry = geometry_of_config(model.config)
        # whether steps read the pages with the fused kernels (else XLA's products over a gather)
        self.decode_kernel = self._decode_kernel(decode_attention, self.geometry, page_size)
        self.vocab_size = int(model.config.vocab_size)
        self.eos = eos_ids(model, tokenizer)
        self._models = {None: self._split(model)}
        for name, m in (adapters or {}).items():
            self._models[name] = self._split(m)
        # adapters of one configuration: one stacked model for every request, base included
        stacked = stack_adapters(adapters, family_class(model).stack) if adapters else None
        self._stacked = None if stacked is None else (self._split(stacked[0]), {None: 0, **stacked[1]})
        self.page_size = page_size
        plan = plan_pages(self.geometry, self.dtype, page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                          max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                          max_model_len=max_model_len, model_len_limit=model_len_limit(model.config),
                          vocab=model.config.padded_vocab_size,
                          device=self._device(model), memory_fraction=memory_fraction,
                          gather_rows=self._gather_rows(buckets, max_num_seqs, max_batched_tokens))
        self.plan = plan
        self.max_model_len = plan.max_model_len
        self.pool = PagePool(plan.num_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                                   prefix_caching=prefix_caching, buckets=buckets)
        self.buckets = buckets
        self._pool_sharding = None  # where the KV pool lies: the default device, or the weights' (use_weights)
        self.keys, self.values = self._fresh_pool()
        self.board = self._fresh_board()
        self.overlap = overlap
        self._pending = None  # the step dispatched and not read yet: (plan, launched groups, rows that sample)
        self.detok = Detokenizer(tokenizer)
        self._requests: dict[str, Request] = {}
        self._sent: dict[str, tuple[int, str]] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng()
        self.prompt_tokens = self.generation_tokens = 0
        self._programs: set = set()  # the step programs run (shapes and variants), each compiled once

    def _fresh_pool(self):
        pool = step_mod.empty_pool(self.geometry, self.pool.num_pages, self.page_size, self.dtype)
        return pool if self._pool_sharding is None else jax.device_put(pool, self._pool_sharding)

    def _fresh_board(self):
        """The token board: an entry per running request's slot, and the padding rows' last."""
        board = np.zeros(self.scheduler.max_num_seqs + 1, np.int32)
        return jax.device_put(board, self._pool_sharding) if self._pool_sharding is not None else jax.device_put(board)

    def use_weights(self, weights, source=None) -> None:
        """Serve the base from `weights` from the next step on, without a copy (a training engine's
        live arrays after each optimizer step: `zerojax.serving.live`); `source` makes the model of
        them (default: the base's own). Between requests only: the cached prompt pages, computed
        with the old weights, are forgotten; the KV pool moves to the weights' devices (replicated
        over their mesh) where they lie elsewhere."""
        if self.adapters:
            raise ValueError("use_weights: this engine serves adapters over its base; it takes new weights only "
                             "for a base served alone")
        if self.has_unfinished():
            raise RuntimeError("use_weights: requests are running on the current weights; finish or abort them first")
        _, base_source = self._models[None]
        self._models[None] = (weights, base_source if source is None else HashedSource(source))
        self.pool.forget_prefixes()
        leaf = next((x for x in jax.tree.leaves(weights) if isinstance(x, jax.Array)), None)
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            # replicated over the weights' mesh, as the step returns it: the first call compiles once, not
            # once for a pool placed otherwise and again for the one it returns
            self._pool_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        elif leaf is not None and leaf.sharding.device_set != self.keys.sharding.device_set:
            self._pool_sharding = jax.sharding.SingleDeviceSharding(next(iter(leaf.devices())))
        if self._pool_sharding is not None and self.keys.sharding != self._pool_sharding:
            self.keys, self.values, self.board = jax.device_put((self.keys, self.values, self.board),
                                                                self._pool_sharding)

    @staticmethod
    def _decode_kernel(choice: str, geometry, page_size: int) -> bool:
        """Whether steps read the pages with the fused kernels (`decode_attention`, `chunk_attention`)."""
        from zerojax.generation.decode_attention import paged_attention_supported

        decoder.check_decode_attention_choice(choice)
        if choice == "xla":
            return False
        # the table's width is a power of two whatever the requests (`shapes.Buckets.span_pages`)
        supported = paged_attention_supported(geometry.head_dim, geometry.heads, geometry.kv_heads, page_size, 1)
        if choice == "auto":
            return supported and jax.default_backend() == "gpu"
        if not supported:
            raise ValueError(f"decode_attention='kernel': the kernel takes a power-of-two head_dim in 16..256 (this "
                             f"model's is {geometry.head_dim}) and pages of a power of two >= 16 slots (page_size="
                             f"{page_size}); use decode_attention='xla'")
        return True

    def _gather_rows(self, buckets: shapes.Buckets, max_num_seqs: int, max_batched_tokens: int) -> int:
        """The most rows one step gathers the pages of: none where the kernels read them (decodes
        and prompt chunks), else the decodes' or the shortest chunk program's rows."""
        if self.decode_kernel:
            return 0
        return max(buckets.chunk_rows(buckets.chunk_length(2, max_batched_tokens), max_batched_tokens), max_num_seqs)

    @staticmethod
    def _split(model):
        graphdef, state = nnx.split(model)
        return state, HashedSource(decoder.ModuleSource(graphdef))

    @staticmethod
    def _device(model):
        arrays = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)]
        return next(iter(arrays[0].devices())) if arrays else None

    @property
    def adapters(self) -> list[str]:
        return [name for name in self._models if name is not None]

    @property
    def stacked_adapters(self) -> list[str]:
        """The adapters served by one stacked model (every request in one call a step), or []."""
        return [name for name in self._stacked[1] if name is not None] if self._stacked else []

    # ---- requests in and out -----------------------------------------------------------------

    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequestError("a text prompt needs the engine's tokenizer; give token ids", param="prompt")
            return [int(i) for i in self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
        ids = [int(i) for i in np.ravel(np.asarray(prompt))]
        if any(i < 0 or i >= self.vocab_size for i in ids):
            raise BadRequestError(f"prompt token ids must lie in 0 .. {self.vocab_size - 1}", param="prompt")
        return ids

    def make_request(self, prompt, params: SamplingParams, *, adapter: str | None = None,
                     request_id: str | None = None, add_special_tokens: bool = True) -> Request:
        """A checked request (BadRequestError: an empty prompt or one past the context, max_tokens
        past it, an unknown adapter); `add` queues it. Thread-safe (touches no engine state)."""
        if adapter not in self._models:
            raise BadRequestError(f"adapter {adapter!r} is not served; served: {self.adapters}", param="model")
        if params.stop and self.tokenizer is None:
            raise BadRequestError("stop strings need the engine's tokenizer; give stop_token_ids", param="stop")
        ids = self.encode(prompt, add_special_tokens)
        if not ids:
            raise BadRequestError("the prompt is empty: give at least one token", param="prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise BadRequestError(f"the prompt has {len(ids)} tokens; this server's context (max_model_len) is "
                                  f"{self.max_model_len} including at least one new token", param="prompt")
        if params.max_tokens is not None and params.max_tokens > room:
            raise BadRequestError(f"max_tokens={params.max_tokens}: the prompt's {len(ids)} tokens leave room for "
                                  f"{room} new tokens in this server's context of {self.max_model_len}",
                                  param="max_tokens")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        return Request(request_id or f"req-{next(self._ids)}", ids, params, seed % 2**32, frozenset(stop),
                       params.max_tokens or room, adapter=adapter)

    def add(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise BadRequestError(f"request id {req.request_id!r} is already running", param="request_id")
        self._requests[req.request_id] = req
        self._sent[req.request_id] = (0, "")
        self.scheduler.add(req)

    def add_request(self, prompt, params: SamplingParams | None = None, **kwargs) -> str:
        req = self.make_request(prompt, params or SamplingParams(), **kwargs)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """The request out of the engine, its pages back to the pool at once (None: not here)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        req.finish_reason = req.finish_reason or "abort"
        return self._finish(req)

    def fail(self, requests, error: str) -> list[RequestOutput]:
        out = []
        for req in requests:
            req.finish_reason = "error"
            out.append(self._finish(req, error))
        return out

    def _finish(self, req: Request, error: str | None = None) -> RequestOutput:
        self.scheduler.finish(req)
        self._requests.pop(req.request_id, None)
        sent_tokens, sent_text = self._sent.pop(req.request_id, (0, ""))
        return make_output(req, self.detok.final_text(req), sent_tokens, sent_text, error)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def stats(self) -> dict:
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "pages_total": self.pool.capacity, "pages_in_use": self.pool.in_use,
                "pages_available": self.pool.available, "prefix_cache_hits": self.pool.prefix_hits,
                "preemptions": self.scheduler.preemptions, "step_programs": len(self._programs)}

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step -> an update for each request that got a token or finished. With
        overlap, the tokens are the step before's: this step is dispatched first, then they are read."""
        plan = self.scheduler.schedule()
        outputs = []
        if any(req.in_flight and (n > 1 or req.params.penalized) for req, n in plan):
            # a row feeds (or counts) a token the host has not read: read it first; rows that stopped there go
            outputs = self._read_pending()
            plan = [(req, n) for req, n in plan if req.finish_reason is None]
        launched = None
        if plan:
            try:
                launched = self._dispatch(plan)
            except Exception as e:
                return outputs + self._read_pending() + self._recover(plan, e)
        outputs += self._read_pending()
        self._pending = launched
        if not self.overlap:
            outputs += self._read_pending()
        return outputs

    def _dispatch(self, plan) -> tuple:
        """The plan's rows through the compiled step, grouped by adapter and by one token / a chunk,
        every call dispatched before any result is read -> the pending step (plan, [(rows, StepOut)],
        the requests that sample a token)."""
        groups: dict = {}
        for req, n in plan:
            groups.setdefault((None if self._stacked else req.adapter, n > 1), []).append((req, n))
        launched = [(rows, self._launch(self._stacked[0] if self._stacked else self._models[adapter], rows))
                    for (adapter, _), rows in groups.items()]
        for _, out in launched:
            out.tokens.copy_to_host_async()  # on its way to the host as soon as the step ends
        sampling = set()
        for req, n in plan:
            if req.num_computed < len(req.prompt):
                self.prompt_tokens += min(n, len(req.prompt) - req.num_computed)
            self.scheduler.computed(req, n)
            if req.remaining == 0:  # past its prompt: the step samples its next token
                req.in_flight += 1
                sampling.add(req)
        return plan, launched, sampling

    def _read_pending(self) -> list[RequestOutput]:
        """The pending step's tokens read (waiting for it to end), appended, checked for stops ->
        the updates; a request finished or aborted since it was dispatched gets none."""
        if self._pending is None:
            return []
        (plan, launched, sampling), self._pending = self._pending, None
        sampled = {}
        try:
            for rows, out in launched:
                sampled.update(self._collect(rows, out))
        except Exception as e:  # the step failed on the device: raised where its results are read
            for req in sampling:
                req.in_flight -= 1
            return self._recover(plan, e)
        outputs = []
        for req, _ in plan:
            if req not in sampling:  # mid-prompt: no token yet
                continue
            req.in_flight -= 1
            if req.finish_reason is not None:  # stopped at the step before, or aborted: its token is dropped
                continue
            token, logprob, top = sampled[req]
            if req.params.logprobs is not None:
                req.logprobs.append((logprob, top))
            self.generation_tokens += 1
            self.detok.add_token(req, token, self.max_model_len)
            outputs.append(self._finish(req) if req.finish_reason else self._update(req))
        return outputs

    def _update(self, req: Request) -> RequestOutput:
        text = self.detok.sendable_text(req)
        sent_tokens, sent_text = self._sent[req.request_id]
        out = make_output(req, text, sent_tokens, sent_text)
        self._sent[req.request_id] = (len(req.output), text)
        return out

    def _recover(self, plan, error: Exception) -> list[RequestOutput]:
        """A step that raised: its requests fail (a 500 for their clients); where the pool it was
        given is gone (donated to the failed call) a fresh one is made, the cached prompt pages
        forgotten, and every other running request is preempted, to be recomputed: the engine keeps
        serving."""
        log.exception("serving step failed")
        # not those that finished meanwhile (the step before's tokens, read after this one was dispatched)
        failed = {req for req, _ in plan if req.finish_reason is None}
        out = self.fail(list(failed), f"{type(error).__name__}: {error}")
        if self.board.is_deleted():
            self.board = self._fresh_board()
        if self.keys.is_deleted() or self.values.is_deleted():
            self.keys, self.values = self._fresh_pool()
            for req in list(self.scheduler.running):
                self.scheduler.preempt(req)
            self.pool.forget_prefixes()
        return out

    def _launch(self, model, rows) -> step_mod.StepOut:
        """One group's rows through the step (the pool updated in place) -> its outputs, on the device."""
        ps = self.page_size
        budget, longest = self.scheduler.max_batched_tokens, max(n for _, n in rows)
        if longest == 1:
            R, C = self.buckets.decode_rows(len(rows), self.scheduler.max_num_seqs), 1
        else:
            C = self.buckets.chunk_length(longest, budget)
            R = self.buckets.chunk_rows_for(len(rows), C, budget)
        P = self.buckets.span_pages(max(len(req.pages) for req, _ in rows), ps, -(-self.max_model_len // ps))
        tokens = np.zeros((R, C), np.int32)
        start, count = np.zeros(R, np.int32), np.zeros(R, np.int32)
        pages = np.full((R, P), SCRATCH_PAGE, np.int32)
        slot, chained = np.full(R, self.scheduler.max_num_seqs, np.int32), np.zeros(R, bool)
        temperature, top_p = np.zeros(R, np.float32), np.ones(R, np.float32)
        top_k, seed, index = np.zeros(R, np.int32), np.zeros(R, np.uint32), np.zeros(R, np.int32)
        for r, (req, n) in enumerate(rows):
            if req.in_flight:  # a decode of the token the step before sampled: read from the board
                chained[r] = True
            else:
                tokens[r, :n] = req.feed(n)
            start[r], count[r], slot[r] = req.num_computed, n, req.slot
            pages[r, :len(req.pages)] = req.pages
            p = req.params
            temperature[r], top_p[r], top_k[r] = p.temperature, p.top_p, p.top_k
            seed[r], index[r] = req.seed, len(req.output) + req.in_flight
        adapter = None
        if self._stacked:
            adapter = np.zeros(R, np.int32)
            adapter[:len(rows)] = [self._stacked[1][req.adapter] for req, _ in rows]
        want_top = max((req.params.logprobs or 0) for req, _ in rows)
        return self._call(model, step_mod.Rows(tokens, start, count, pages, adapter, slot, chained),
                          step_mod.RowSampling(temperature, top_p, top_k, seed, index), self._penalties(rows, R),
                          SamplingParams.MAX_LOGPROBS if want_top else 0,
                          any(req.params.filtered for req, _ in rows))

    def _call(self, model, rows: step_mod.Rows, sampling: step_mod.RowSampling, penalties, top: int,
              filtered: bool):
        """One compiled step over `rows` (the pool and the board updated in place) -> its StepOut on the
        device. filtered: a row asks for top_k / top_p (the step's variant that sorts the vocabulary)."""
        weights, source = model
        R, C = rows.tokens.shape
        self._programs.add((id(source), R, C, rows.pages.shape[1], penalties is not None, top, filtered))
        run = step_mod.step if C == 1 else step_mod.chunk_step
        self.keys, self.values, self.board, out = run(
            weights, self.keys, self.values, rows, sampling, penalties, self.board, source=source,
            page_size=self.page_size, top_logprobs=top, kernel=self.decode_kernel, filtered=filtered)
        return out

    def warm_up(self, max_chunk: int | None = None) -> int:
        """Compile (and run once, on padding rows that write only the scratch page) the step program
        of every shape bucket for every model a step calls, so that no request pays a compile ->
        the programs run. max_chunk: the longest prompt chunk to expect (default max_model_len: a
        preempted request's prompt and tokens read again). Each shape's two sampling variants are
        compiled: with top_k / top_p, and without (no sort of the vocabulary). Requests asking for
        penalties or logprobs still compile theirs on first use."""
        models = [self._stacked[0]] if self._stacked else list(self._models.values())
        shapes_ = self.buckets.programs(self.scheduler.max_num_seqs, self.scheduler.max_batched_tokens,
                                        self.page_size, -(-self.max_model_len // self.page_size),
                                        max_chunk or self.max_model_len)
        outs = []
        for model in models:
            for R, C, P in shapes_:
                z = np.zeros(R, np.int32)
                adapter = z if self._stacked else None
                # padding rows: the board's padding entry
                rows = step_mod.Rows(np.zeros((R, C), np.int32), z, z, np.full((R, P), SCRATCH_PAGE, np.int32), adapter,
                                     np.full(R, self.scheduler.max_num_seqs, np.int32), np.zeros(R, bool))
                sampling = step_mod.RowSampling(np.zeros(R, np.float32), np.ones(R, np.float32), z,
                                                np.zeros(R, np.uint32), z)
                outs += [self._call(model, rows, sampling, None, 0, filtered) for filtered in (False, True)]
        jax.block_until_ready(outs)
        return len(outs)

    @staticmethod
    def _collect(rows, out: step_mod.StepOut) -> dict:
        """{request: (token, logprob, {top id: logprob})} of a group's rows; the log-probabilities
        cross to the host only where a row asked for them (a step's one wait is for its tokens)."""
        tokens = np.asarray(out.tokens).tolist()
        if not any(req.params.logprobs is not None for req, _ in rows):
            return {req: (tokens[r], None, {}) for r, (req, _) in enumerate(rows)}
        out = jax.device_get(out)
        logprobs = out.logprob.tolist()
        result = {}
        for r, (req, _) in enumerate(rows):
            k = req.params.logprobs or 0
            top = {int(i): float(v) for i, v in zip(out.top_ids[r, :k], out.top_logprobs[r, :k])}
            result[req] = (tokens[r], logprobs[r], top)
        return result

    @staticmethod
    def _penalties(rows, R: int):
        """The penalties' token lists where a row asks for one (None: the program without them)."""
        if not any(req.params.penalized for req, _ in rows):
            return None
        H = length_bucket(max(len(req.prompt) + len(req.output) for req, _ in rows))
        ids, generated = np.full((R, H), -1, np.int32), np.zeros((R, H), bool)
        rep, presence, frequency = np.ones(R, np.float32), np.zeros(R, np.float32), np.zeros(R, np.float32)
        for r, (req, _) in enumerate(rows):
            toks = req.prompt + req.output
            ids[r, :len(toks)] = toks
            generated[r, len(req.prompt):len(toks)] = True
            p = req.params
            rep[r], presence[r], frequency[r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        return step_mod.Penalties(ids, generated, rep, presence, frequency)


__all__ = ["LLMEngine", "eos_ids"]
