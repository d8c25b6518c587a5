"""Overlapped steps (the engine dispatches step t+1 before it reads step t's tokens, a decode's
token fed from the device): the same tokens, texts, log-probabilities and finish reasons as steps
read at once, for every way a request ends (max_tokens, a stop id, a stop string) and through
preemption and penalties (a token in flight read first); no token past the end is ever emitted,
an abort mid-stream frees the pages at once, and no new program is compiled."""
import numpy as np
import pytest

from zerojax.models import from_hf, load_tokenizer
from zerojax.serving import LLMEngine, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

from generation.test_generate_cli import folder  # noqa: E402,F401 (a fixture: tiny llama3, word tokenizer)

NEW = 10


@pytest.fixture(scope="module")
def served(folder):  # noqa: F811
    return from_hf(folder), load_tokenizer(folder)


def _engine(served, overlap: bool):
    # 12 pages of 4 slots for the requests below: some wait, some are preempted (fed again)
    model, tok = served
    return LLMEngine(model, tok, page_size=4, kv_cache_tokens=48, max_num_seqs=4, max_batched_tokens=16,
                     overlap=overlap)


def _run(engine, requests: dict) -> dict:
    """Every request queued, steps until done -> {name: its updates, in order}."""
    names = {engine.add_request(prompt, params): name for name, (prompt, params) in requests.items()}
    updates = {name: [] for name in requests}
    while engine.has_unfinished():
        for out in engine.step():
            updates[names[out.request_id]].append(out)
    return updates


def _rows_dispatched(engine) -> dict:
    """{request id: rows the engine ran for it}, counted as the steps are dispatched."""
    counts: dict = {}
    launch = engine._launch

    def counted(model, rows):
        for req, _ in rows:
            counts[req.request_id] = counts.get(req.request_id, 0) + 1
        return launch(model, rows)

    engine._launch = counted
    return counts


def _requests(served) -> dict:
    model, tok = served
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, model.config.vocab_size, n).tolist() for n in (6, 19, 3, 27, 11, 9)]
    greedy = _run(_engine(served, False), {0: (prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True))})[0][-1]
    # a stop id first met at the 4th new token, a stop string that is the 3rd word of the text
    k = next(i for i in range(3, NEW) if greedy.token_ids[i] not in greedy.token_ids[:i])
    stop_word = greedy.text.split()[2]
    return {
        "length": (prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True)),
        "stop_id": (prompts[0], SamplingParams(max_tokens=NEW, stop_token_ids=[greedy.token_ids[k]], ignore_eos=True)),
        "stop_string": (prompts[0], SamplingParams(max_tokens=NEW, stop=[stop_word], ignore_eos=True)),
        "long": (prompts[1], SamplingParams(max_tokens=NEW, logprobs=2, ignore_eos=True)),
        "sampled": (prompts[2], SamplingParams(max_tokens=NEW, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)),
        "penalized": (prompts[3], SamplingParams(max_tokens=NEW, repetition_penalty=1.5, ignore_eos=True)),
        "eos": (prompts[4], SamplingParams(max_tokens=NEW)),
        "one": (prompts[5], SamplingParams(max_tokens=1, ignore_eos=True)),
    }


def test_overlapped_steps_give_what_steps_read_at_once_give(served):
    requests = _requests(served)
    at_once, overlapped = _engine(served, False), _engine(served, True)
    want, got = _run(at_once, requests), _run(overlapped, requests)
    assert overlapped.stats["preemptions"] > 0  # a request with a token in flight was fed again
    for name, updates in got.items():
        final, expected = updates[-1], want[name][-1]
        assert (final.token_ids, final.text, final.finish_reason, final.logprobs) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.logprobs), name
        # streamed: each token once, none past the end, one finished update (the last)
        assert sum((u.delta_token_ids for u in updates), []) == final.token_ids, name
        assert "".join(u.delta_text for u in updates) == final.text, name
        assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True], name
        assert len(final.token_ids) <= requests[name][1].max_tokens
    assert got["stop_id"][-1].finish_reason == got["stop_string"][-1].finish_reason == "stop"
    assert got["length"][-1].finish_reason == "length" and len(got["one"][-1].token_ids) == 1
    assert overlapped.generation_tokens == at_once.generation_tokens
    for engine in (at_once, overlapped):
        assert engine.stats["pages_available"] == engine.pool.capacity  # every page back
    assert overlapped.stats["step_programs"] == at_once.stats["step_programs"]  # no program of its own


def test_a_request_at_max_tokens_is_not_run_again_and_a_stopped_one_once(served):
    """max_tokens is known before the tokens are read: no row past it. A stop id is known only once
    read: the step dispatched meanwhile ran one more row for it, whose token is dropped."""
    requests = _requests(served)
    engine = _engine(served, True)
    rows = _rows_dispatched(engine)
    names = {engine.add_request(*requests[name]): name for name in ("length", "stop_id")}
    done = {}
    while engine.has_unfinished():
        done.update((names[o.request_id], o) for o in engine.step() if o.finished)
    ran = {names[i]: n for i, n in rows.items()}
    assert ran["length"] == NEW  # its prompt in one chunk, then NEW - 1 decodes
    assert ran["stop_id"] == len(done["stop_id"].token_ids) + 1


def test_abort_mid_stream_frees_the_pages_and_emits_nothing_more(served):
    requests = _requests(served)
    engine = _engine(served, True)
    alone = _run(_engine(served, True), {"length": requests["length"]})["length"][-1]
    gone = engine.add_request(requests["long"][0], SamplingParams(max_tokens=NEW, ignore_eos=True))
    kept = engine.add_request(*requests["length"])
    seen = []
    for _ in range(4):
        seen += engine.step()
    assert any(o.request_id == gone for o in seen) and engine._pending is not None  # mid-stream, a step in flight
    aborted = engine.abort(gone)
    assert aborted.finished and aborted.finish_reason == "abort"
    assert engine.stats["pages_in_use"] == len(engine._requests[kept].pages)  # its pages back at once
    after = []
    while engine.has_unfinished():
        after += engine.step()
    assert all(o.request_id == kept for o in after)  # nothing more for the aborted request
    assert after[-1].token_ids == alone.token_ids
    assert engine.stats["pages_available"] == engine.pool.capacity


def test_a_step_failing_behind_a_pending_one(served, monkeypatch):
    """The step before's tokens still reach their request, then the failed step's requests end in an
    error, once; the pool remade forgets its cached prompt pages: the same prompt again (its pages
    were cached) gives the tokens of a run alone."""
    from zerojax.serving import step as step_mod

    requests = _requests(served)
    prompt, params = requests["long"][0], SamplingParams(max_tokens=NEW, ignore_eos=True)
    alone = _run(_engine(served, True), {"a": (prompt, params)})["a"][-1]
    engine = _engine(served, True)
    rid = engine.add_request(prompt, params)
    updates = engine.step() + engine.step() + engine.step()
    real = step_mod.step

    def broken(*args, **kwargs):
        real(*args, **kwargs)  # the pool was donated to it
        raise RuntimeError("injected failure")

    monkeypatch.setattr(step_mod, "step", broken)
    updates += engine.step()
    monkeypatch.setattr(step_mod, "step", real)
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].finish_reason == "error" and updates[-1].request_id == rid
    assert updates[-1].token_ids == alone.token_ids[:len(updates[-1].token_ids)] and updates[-1].token_ids
    assert engine.stats["pages_available"] == engine.pool.capacity and not engine.has_unfinished()
    assert _run(engine, {"a": (prompt, params)})["a"][-1].token_ids == alone.token_ids
