"""The serving engine (continuous batching over a paged KV cache): requests of different lengths
arriving at different steps, in a pool too small for all of them at once, each give the greedy
tokens of `zerojax.generate` on that prompt alone and of transformers' `generate`; aborting frees
pages at once; a shared prompt prefix reuses cached pages; per-request sampling keeps to its own
random stream whatever shares the batch."""
import numpy as np
import pytest

import zerojax
from zerojax.models import from_hf
from zerojax.serving import LLMEngine, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from generation.test_generate_hf import _hf_greedy  # noqa: E402 (tests/ on sys.path)
from models.test_llama import _hf_model  # noqa: E402

NEW = 8
PAGE = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' tiny llama3, ours read from its folder)."""
    hf = _hf_model("llama3")
    path = tmp_path_factory.mktemp("serve_llama")
    hf.save_pretrained(path)
    return hf, from_hf(path)


def _engine(model, **kw):
    # 12 pages of 4 slots: the requests below need more at once, so some wait and some are preempted
    return LLMEngine(model, page_size=PAGE, kv_cache_tokens=48, max_num_seqs=4, max_batched_tokens=16, **kw)


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, n).tolist() for n in lengths]


def _drain(engine, arrivals):
    """Step until done, adding arrivals[k] (a list of (name, prompt, params)) before step k ->
    ({name: finished output}, the most requests seen waiting at once)."""
    done, waited, k, names = {}, 0, 0, {}
    while k < len(arrivals) or engine.has_unfinished():
        for name, prompt, params in (arrivals[k] if k < len(arrivals) else []):
            names[engine.add_request(prompt, params)] = name
        waited = max(waited, engine.stats["waiting"])
        for out in engine.step():
            if out.finished:
                done[names[out.request_id]] = out
        k += 1
    return done, waited


def test_continuous_batching_equals_generate_alone_and_transformers(pair):
    hf, model = pair
    engine = _engine(model)
    prompts = _prompts(hf.config.vocab_size, (5, 17, 3, 30, 9, 12, 2, 21), seed=4)
    greedy = SamplingParams(max_tokens=NEW)
    arrivals = [[(0, prompts[0], greedy), (1, prompts[1], greedy)], [], [(2, prompts[2], greedy)],
                [(i, prompts[i], greedy) for i in (3, 4, 5)], [], [],
                [(6, prompts[6], greedy), (7, prompts[7], greedy)]]
    done, waited = _drain(engine, arrivals)
    assert sorted(done) == list(range(len(prompts)))  # none dropped
    assert waited > 0 and engine.stats["preemptions"] > 0  # the pool was too small: queued and preempted
    for i, prompt in enumerate(prompts):
        alone = zerojax.generate(model, prompt, max_new_tokens=NEW)
        assert done[i].token_ids == alone.tokens[0] == _hf_greedy(hf, prompt, NEW), i
        assert done[i].finish_reason == alone.finish_reasons[0]
    assert engine.stats["pages_available"] == engine.pool.capacity  # every page back


def test_decode_kernel_reads_the_pages_and_equals_transformers(tmp_path):
    """decode_attention="kernel": the decode steps read each row's pages through its page table in
    the fused kernel (Pallas' interpreter here), the prompt chunks gather them; rows spanning
    pages, a shared prompt page, a sliding window shorter than a page: transformers' greedy tokens
    (a Mistral of head_dim 16, the kernel's smallest, window 6, GQA 4:2)."""
    from models.test_llama import _common

    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(**_common(sliding_window=6, head_dim=16))).eval()
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    engine = LLMEngine(model, page_size=16, kv_cache_tokens=160, max_num_seqs=4, max_batched_tokens=32,
                       decode_attention="kernel")
    prompts = _prompts(hf.config.vocab_size, (3, 20, 40), seed=6)
    prompts.append(prompts[2][:32] + [5, 6])  # its first two pages cached from the third's
    greedy = SamplingParams(max_tokens=NEW)
    done, _ = _drain(engine, [[(i, p, greedy) for i, p in enumerate(prompts[:3])], [], [], [(3, prompts[3], greedy)]])
    assert engine.stats["prefix_cache_hits"] > 0
    for i, prompt in enumerate(prompts):
        assert done[i].token_ids == _hf_greedy(hf, prompt, NEW), i


def test_abort_frees_pages_at_once(pair):
    _, model = pair
    engine = _engine(model, prefix_caching=False)
    prompts = _prompts(model.config.vocab_size, (9, 6), seed=5)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    for _ in range(3):
        engine.step()
    held = engine.stats["pages_in_use"]
    assert held == 3 + 2  # both prompts' pages, and their first new tokens'
    out = engine.abort(ids[0])
    assert out.finished and out.finish_reason == "abort"
    assert engine.stats["pages_in_use"] == held - 3  # 9 prompt + 2 new tokens: 3 pages of 4, back at once
    engine.abort(ids[1])
    assert engine.stats["pages_available"] == engine.pool.capacity and not engine.has_unfinished()


def test_shared_prefix_reuses_pages_and_equals_generate(pair):
    hf, model = pair
    engine = _engine(model)
    system = _prompts(hf.config.vocab_size, (13,), seed=6)[0]  # 3 full pages shared
    first, second = system + [7, 8], system + [9]
    _drain(engine, [[(0, first, SamplingParams(max_tokens=NEW))]])
    hits = engine.stats["prefix_cache_hits"]
    done, _ = _drain(engine, [[(1, second, SamplingParams(max_tokens=NEW))]])
    assert engine.stats["prefix_cache_hits"] - hits == 3
    assert done[1].token_ids == zerojax.generate(model, second, max_new_tokens=NEW).tokens[0]


def test_sampling_is_per_request_and_stops(pair):
    """A seeded sampled request gives the same tokens alone and beside others (one with top_p, one
    without, alone in the step variant without the filter and in the crowd's with it); top_k 1 is
    greedy; a stop id ends a row where generate's does (the id kept)."""
    _, model = pair
    engine = _engine(model)
    p = _prompts(model.config.vocab_size, (6, 11, 4), seed=7)
    sampled = SamplingParams(temperature=1.3, top_p=0.9, seed=11, max_tokens=NEW, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True)
    alone, _ = _drain(engine, [[("s", p[0], sampled)]])
    alone.update(_drain(engine, [[("x", p[2], plain)]])[0])
    greedy_ref = zerojax.generate(model, p[1], max_new_tokens=NEW, ignore_eos=True).tokens[0]
    stop_id = greedy_ref[3]
    crowd, _ = _drain(engine, [[("g", p[1], SamplingParams(temperature=0.7, top_k=1, max_tokens=NEW,
                                                           ignore_eos=True)),
                                ("s", p[0], sampled), ("x", p[2], plain),
                                ("stop", p[1],
                                 SamplingParams(max_tokens=NEW, stop_token_ids=[stop_id], ignore_eos=True))]])
    assert crowd["s"].token_ids == alone["s"].token_ids
    assert crowd["x"].token_ids == alone["x"].token_ids
    assert crowd["g"].token_ids == greedy_ref
    stopped = zerojax.generate(model, p[1], max_new_tokens=NEW, stop=[stop_id], ignore_eos=True)
    assert crowd["stop"].token_ids == stopped.tokens[0] and crowd["stop"].finish_reason == "stop"


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(pair, monkeypatch):
    from zerojax.serving import step as step_mod

    _, model = pair
    engine = _engine(model)
    prompt = _prompts(model.config.vocab_size, (7,), seed=8)[0]
    real = {name: getattr(step_mod, name) for name in ("step", "chunk_step")}

    def broken(run):
        def call(*args, **kwargs):
            run(*args, **kwargs)  # the pool was donated to it: the engine must make a new one
            raise RuntimeError("injected failure")
        return call

    for name, run in real.items():
        monkeypatch.setattr(step_mod, name, broken(run))
    engine.add_request(prompt, SamplingParams(max_tokens=NEW))
    (failed,) = engine.step()
    assert failed.finished and failed.finish_reason == "error" and "injected failure" in failed.error
    assert engine.stats["pages_available"] == engine.pool.capacity
    for name, run in real.items():
        monkeypatch.setattr(step_mod, name, run)
    done, _ = _drain(engine, [[(0, prompt, SamplingParams(max_tokens=NEW))]])
    assert done[0].token_ids == zerojax.generate(model, prompt, max_new_tokens=NEW).tokens[0]


def test_gpt2_continuous_batching_equals_generate_alone(tmp_path):
    from models.test_gpt2 import CFG
    from models.test_gpt2 import _hf_model as hf_gpt2

    hf = hf_gpt2(CFG)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    engine = _engine(model)
    prompts = _prompts(hf.config.vocab_size, (5, 14, 3, 11), seed=9)  # one prompt bucket of generate
    greedy = SamplingParams(max_tokens=NEW)
    done, _ = _drain(engine, [[(0, prompts[0], greedy), (1, prompts[1], greedy)], [(2, prompts[2], greedy)], [],
                              [(3, prompts[3], greedy)]])
    for i, prompt in enumerate(prompts):
        assert done[i].token_ids == zerojax.generate(model, prompt, max_new_tokens=NEW).tokens[0] == \
            _hf_greedy(hf, prompt, NEW), i


def test_warm_up_compiles_every_bucket_before_the_first_request(pair):
    """After `warm_up` no request compiles anything (jax's own cache of the step's programs does not
    grow), whatever the lengths: the warm-up ran every shape bucket the scheduler can pick."""
    from zerojax.serving import step as step_mod
    from zerojax.serving.shapes import Buckets

    _, model = pair
    # a page size of its own: these shapes are compiled by no other test
    engine = LLMEngine(model, page_size=8, kv_cache_tokens=64, max_num_seqs=4, max_batched_tokens=16,
                       max_model_len=64, buckets=Buckets(min_rows=2, min_span=64, min_chunk=8))
    compiled = lambda: step_mod.step._cache_size() + step_mod.chunk_step._cache_size()  # noqa: E731
    before = compiled()
    programs = engine.warm_up()
    # decode rows 2, 4; chunks of 8 tokens on 1 or 2 rows, of 16 on 1 (one span: 8 pages); each without
    # and with the top_k / top_p filter
    assert programs == 2 * (2 + 3) == engine.stats["step_programs"]
    assert compiled() - before == programs
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    nucleus = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
    prompts = _prompts(model.config.vocab_size, (3, 20, 9, 40, 1), seed=10)
    done, _ = _drain(engine, [[(0, prompts[0], greedy)], [(1, prompts[1], nucleus), (2, prompts[2], greedy),
                                                          (3, prompts[3], greedy)], [], [(4, prompts[4], nucleus)]])
    assert sorted(done) == list(range(len(prompts)))
    assert compiled() - before == programs == engine.stats["step_programs"]
