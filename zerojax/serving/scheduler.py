"""Which tokens each engine step computes: the running requests first (a decode's one token, the
next chunk of a prompt still being read), then waiting prompts, first come first served, while the
step's token budget and the row limit last (SplitFuse: a long prompt is read a chunk per step
beside the running decodes, so it never stalls their token streams).

Admission is by free pages: a request enters only when its next chunk's pages can be had, else it
waits in the queue (never an out-of-memory). Pages are taken as tokens need them; when a running
request needs a page and none is left, the youngest running request is preempted: its pages go
back, and it waits at the head of the queue to be recomputed from its prompt and the tokens it
already has (its output so far is kept, so its greedy tokens are unchanged).

A request's last token may be in flight: sampled by a step the engine dispatched but has not read
yet (`zerojax.serving.engine`: the next step is dispatched first). It counts as fed-to-come
(`Request.remaining`), and a request whose in-flight tokens reach its max_tokens is not scheduled
again. Each running request holds a slot of the engine's token board, where the step writes its
sampled token for the next step to read on the device.
"""
from __future__ import annotations

import collections
import dataclasses
import time

from zerojax.serving.pages import PagePool, chain_hashes
from zerojax.serving.params import SamplingParams
from zerojax.serving.shapes import Buckets, ChunkSlots


@dataclasses.dataclass(eq=False)
class Request:
    """One request's state in the engine (the engine thread's; the server never touches it)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # its random stream (params.seed, or drawn when it arrived)
    stop_ids: frozenset
    max_tokens: int  # resolved: params.max_tokens, or up to the context
    adapter: str | None = None
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # per new token: (logprob, {id: logprob})
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in its pages
    hashes: list[int] = dataclasses.field(default_factory=list)  # its prompt's full pages (prefix cache)
    registered: int = 0  # how many of its pages are in the prefix cache
    finish_reason: str | None = None
    stop_string_cut: bool = False  # its text ends before a stop string (not the whole output decoded)
    text: str = ""  # the new text so far (incremental detokenization below)
    prefix_offset: int = 0
    read_offset: int = 0
    in_flight: int = 0  # tokens sampled by a dispatched step, not read yet (not in `output`)
    slot: int = -1  # its entry of the engine's token board while running

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def feed(self, n: int) -> list[int]:
        """Its next n tokens to feed (from the prompt, then its own output: after a preemption)."""
        start, P = self.num_computed, len(self.prompt)
        if start >= P:
            return self.output[start - P:start - P + n]
        return self.prompt[start:start + n] + self.output[:max(0, start + n - P)]

    @property
    def remaining(self) -> int:
        """Tokens to feed before its next token can be sampled (an in-flight one included)."""
        return len(self.prompt) + len(self.output) + self.in_flight - self.num_computed

    @property
    def length_reached(self) -> bool:
        """Its tokens, the in-flight ones counted, reach max_tokens: it finishes once they are read."""
        return len(self.output) + self.in_flight >= self.max_tokens


class Scheduler:
    """The waiting queue and the running set over one `PagePool`."""

    def __init__(self, pool: PagePool, *, max_num_seqs: int, max_batched_tokens: int, prefix_caching: bool = True,
                 buckets: Buckets = Buckets()):
        self.pool, self.buckets = pool, buckets
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.prefix_caching = prefix_caching
        self.waiting: collections.deque[Request] = collections.deque()
        # oldest first; a dict for its order and O(1) membership (a step asks of every row)
        self.running: dict[Request, None] = {}
        self.preemptions = 0
        # the token board's entries (`Request.slot`), one per running request; entry max_num_seqs is the padding's
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add(self, req: Request) -> None:
        if self.prefix_caching:
            req.hashes = chain_hashes(req.prompt, self.pool.page_size, salt=req.adapter)
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """[(request, tokens it feeds this step)]: running decodes, running prompts' next chunks,
        then newly admitted prompts; the prompt chunks within one chunk program's shape
        (`zerojax.serving.shapes.ChunkSlots`)."""
        budget, plan, chunks = self.max_batched_tokens, [], ChunkSlots(self.buckets, self.max_batched_tokens)
        planned: set[Request] = set()
        # decodes first, then the prompts being read: a long prompt's chunk never takes a decode's turn
        for req in sorted(self.running, key=lambda r: r.remaining > 1):
            if req not in self.running or req.length_reached:  # preempted below for an older request; done
                continue
            n = min(req.remaining, budget)
            if n > 1:
                n = chunks.fit(n)
            if n <= 0:
                continue
            if self._make_room(req, req.num_computed + n, planned):
                plan.append((req, n))
                planned.add(req)
                budget -= n
                if n > 1:
                    chunks.take(n)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.pages and self.prefix_caching:
                self._take_cached_prefix(req)
            n = min(req.remaining, budget)
            if n > 1:
                n = chunks.fit(n)
            if n <= 0 or not self._pages_for(req, req.num_computed + n):
                # it waits (first come, first served) for a chunk row or for pages, holding none: the
                # cached pages it took stay cached, and another request's preemption may put it
                # behind others, who must not wait on pages it sits on
                self._release(req)
                break
            self.waiting.popleft()
            self._run(req)
            plan.append((req, n))
            budget -= n
            if n > 1:
                chunks.take(n)
        return plan

    def _run(self, req: Request) -> None:
        req.slot = self._free_slots.pop()
        self.running[req] = None

    def _stop_running(self, req: Request) -> None:
        del self.running[req]
        self._free_slots.append(req.slot)
        req.slot = -1

    def _take_cached_prefix(self, req: Request) -> None:
        """Its prompt's longest cached run of full pages; one prompt token is always left to feed
        (the step samples from the last fed token)."""
        usable = req.hashes[:(len(req.prompt) - 1) // self.pool.page_size]
        req.pages = self.pool.cached_prefix(usable)
        req.registered = len(req.pages)
        req.num_computed = len(req.pages) * self.pool.page_size

    def _pages_for(self, req: Request, upto: int) -> bool:
        """Pages for its first `upto` tokens (taken where missing); False where not enough are free."""
        need = -(-upto // self.pool.page_size) - len(req.pages)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _make_room(self, req: Request, upto: int, planned: set) -> bool:
        """Pages for a running request, preempting the youngest running requests not already in
        this step (`planned`) until they come; False where `req` itself was the youngest (it was
        preempted)."""
        while not self._pages_for(req, upto):
            victim = next(r for r in reversed(self.running) if r not in planned)
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Its pages back to the pool; it waits at the head of the queue to be recomputed."""
        self._stop_running(req)
        self._release(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _release(self, req: Request) -> None:
        self.pool.release(req.pages)
        req.pages, req.num_computed, req.registered = [], 0, 0

    def finish(self, req: Request) -> None:
        """A request done (finished or aborted): out of the queue or the running set, its pages
        back to the pool at once."""
        if req in self.running:
            self._stop_running(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def computed(self, req: Request, n: int) -> None:
        """n more of its tokens are in its pages: full prompt pages go to the prefix cache."""
        req.num_computed += n
        if not self.prefix_caching:
            return
        full = min(req.num_computed, len(req.prompt)) // self.pool.page_size
        for i in range(req.registered, full):
            self.pool.register(req.pages[i], req.hashes[i])
        req.registered = max(req.registered, full)


__all__ = ["Request", "Scheduler"]
