"""The scheduler alone (no model): random arrivals into a pool far smaller than the demand. At every
step no page belongs to two requests, each scheduled request holds the pages its tokens need, the
step keeps to its token budget and row limit, decodes are never left out for a prompt chunk; in
the end every request finished with all its tokens and every page is back."""
import numpy as np
import pytest

from zerojax.serving.pages import PagePool
from zerojax.serving.params import SamplingParams
from zerojax.serving.scheduler import Request, Scheduler


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_arrivals_keep_the_invariants(prefix_caching):
    rng = np.random.default_rng(0)
    page, budget, rows = 4, 64, 6
    pool = PagePool(24, page)  # 23 pages: 92 slots for ~40 requests of up to 88 tokens
    sched = Scheduler(pool, max_num_seqs=rows, max_batched_tokens=budget, prefix_caching=prefix_caching)
    shared = rng.integers(0, 50, 8).tolist()  # a common prefix: two full pages
    want, done = {}, []
    for step in range(2000):
        if step < 120 and rng.random() < 0.35:
            prompt = (shared if rng.random() < 0.5 else []) + rng.integers(0, 50, rng.integers(1, 60)).tolist()
            req = Request(f"r{step}", prompt, SamplingParams(), 0, frozenset(), int(rng.integers(1, 20)))
            want[req.request_id] = req.max_tokens
            sched.add(req)
        plan = sched.schedule()
        assert sum(n for _, n in plan) <= budget and len(sched.running) <= rows
        decodes_left = [r for r in sched.running if r.remaining == 1 and r not in {q for q, _ in plan}]
        assert not decodes_left or all(n == 1 for _, n in plan)  # a chunk never takes a decode's turn
        owners = {}
        for req in sched.running:
            for i, p in enumerate(req.pages):
                shared_page = prefix_caching and i < req.registered
                assert p not in owners or (shared_page and owners[p][1]), (p, req.request_id, owners.get(p))
                owners[p] = (req.request_id, shared_page)
        for req, n in plan:
            assert req in sched.running and len(req.pages) * page >= req.num_computed + n
            sched.computed(req, n)
            if req.remaining == 0:
                req.output.append(7)
                if len(req.output) >= req.max_tokens:
                    sched.finish(req)
                    done.append(req)
        if step > 120 and not sched.running and not sched.waiting:
            break
    assert not sched.running and not sched.waiting  # no deadlock: all served in the steps given
    assert {r.request_id: len(r.output) for r in done} == want  # none dropped, each with all its tokens
    assert pool.available == pool.capacity
    assert sched.preemptions > 0  # the pool was too small for all at once
