"""`zerojax serve` as a real process on 127.0.0.1, driven by the official `openai` client: concurrent
requests each equal `zerojax.generate` of their prompt alone, streaming equals non-streaming, chat
uses the checkpoint's template, a client gone mid-stream frees its pages, bad input gets OpenAI's
error body with 400 (401 without the key) and the server keeps serving. One server for the module
(its start and its compiles are the expensive part), with a KV cache smaller than the requests'."""
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from zerojax.generation import chat, generate
from zerojax.models import from_hf, load_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("torch")

from generation.test_generate_cli import folder  # noqa: E402,F401 (a fixture: tiny llama3, word tokenizer, template)

KEY = "test-key"
NEW = 8
CACHE_TOKENS = 128  # 32 pages of 4: the 32 concurrent requests below need about 800 slots
NAME = "tiny"


def _request(url, method="GET", path="/health", raw=None, key=KEY):
    """(status, body text) of one plain HTTP request (the stdlib's client: any body, any header)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request(method, path, body=raw, headers=headers)
    r = conn.getresponse()
    out = r.status, r.read().decode()
    conn.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tuned(folder, tmp_path_factory):
    """(a LoRA model over the tiny base, its PEFT folder): served as model "tuned"."""
    from zerojax import lora

    model = lora.apply(from_hf(folder), {"r": 4, "target_modules": "all-linear", "init_lora_weights": False})
    path = tmp_path_factory.mktemp("tuned")
    lora.save_peft(model, path)
    return model, path


@pytest.fixture(scope="module")
def server(folder, tuned):
    """(base URL, the process) of `zerojax serve` over the tiny folder and the adapter."""
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from zerojax.cli import main; sys.exit(main())", "serve",
           "--hf-checkpoint", str(folder), "--served-model-name", NAME, "--port", str(port), "--api-key", KEY,
           "--page-size", "4", "--kv-cache-tokens", str(CACHE_TOKENS), "--max-num-seqs", "8",
           "--max-batched-tokens", "32", "--adapter", f"tuned={tuned[1]}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"zerojax serve exited: {proc.stdout.read()}")
        try:
            if _request(url)[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("zerojax serve did not answer /health in 120 s")
    yield url, proc
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert f"KV cache: {CACHE_TOKENS} tokens" in out  # it said at start what it holds
    assert "warmed up" in out


@pytest.fixture(scope="module")
def reference(folder):
    return from_hf(folder), load_tokenizer(folder)


def _client(url, key=KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _text(n, rng):
    return " ".join(f"w{i}" for i in rng.integers(5, 101, n))


def _metrics(url) -> dict:
    text = _request(url, path="/metrics")[1]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_concurrent_completions_equal_generate_alone(server, reference):
    url, _ = server
    model, tok = reference
    warmed = _metrics(url)["zerojax_step_programs"]
    assert warmed > 0  # compiled before the port opened
    rng = np.random.default_rng(0)
    prompts = [_text(n, rng) for n in rng.integers(2, 30, 32)]
    client = _client(url)

    def ask(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, prompts))
    assert sum(len(tok.encode(p)) + NEW for p in prompts) > CACHE_TOKENS  # more than the pool: some queued
    for prompt, answer in zip(prompts, answers):
        alone = generate(model, prompt, max_new_tokens=NEW, tokenizer=tok)
        assert answer.choices[0].text == alone.texts[0]
        assert answer.choices[0].finish_reason == alone.finish_reasons[0]
        assert answer.usage.completion_tokens == len(alone.tokens[0])
    m = _metrics(url)
    assert m["zerojax_pages_in_use"] == 0 and m["zerojax_running"] == 0 and m["zerojax_waiting"] == 0
    assert m["zerojax_step_programs"] == warmed  # no request paid a compile
    assert m["zerojax_generation_tokens_total"] >= sum(len(a.choices[0].text.split()) for a in answers)


def test_stream_equals_non_stream_chat_template_and_client_gone(server, reference):
    url, _ = server
    model, tok = reference
    client = _client(url)
    prompt = "w11 w12 w40 w7"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
    pieces = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "system", "content": "w9 w3"}, {"role": "user", "content": "w7 w8 w20"}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0)
    expected = chat(model, messages, tokenizer=tok, max_new_tokens=NEW).texts[0]
    assert answer.choices[0].message.content == expected
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected

    # a stop string (a word of the greedy text): cut where generate cuts, streamed or not
    full = generate(model, prompt, max_new_tokens=NEW, tokenizer=tok, ignore_eos=True).texts[0]
    stop = full.split()[2]
    expected = generate(model, prompt, max_new_tokens=NEW, tokenizer=tok, stop=[stop])
    kw = dict(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stop=[stop])
    cut = client.completions.create(**kw).choices[0]
    assert cut.text == expected.texts[0] and cut.finish_reason == expected.finish_reasons[0] == "stop"
    assert "".join(p.choices[0].text for p in client.completions.create(**kw, stream=True)) == cut.text

    # a client gone mid-stream: its request aborted, its pages back. The engine runs in its own thread
    # and may finish a request before the server sees its client gone (then it counts as "length", its
    # pages back all the same): a few tries, each one's pages back, at least one an abort
    aborted = 0
    for _ in range(4):
        before = _metrics(url)
        _leave_mid_stream(url, {"model": NAME, "prompt": "w5 w6 w7", "max_tokens": 60, "temperature": 0,
                                "ignore_eos": True, "stream": True})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = _metrics(url)
            if m["zerojax_running"] == 0 and m["zerojax_pages_in_use"] == 0:
                break
            time.sleep(0.1)
        assert m["zerojax_running"] == 0 and m["zerojax_pages_in_use"] == 0
        ended = {r: m.get(f'zerojax_requests_finished_total{{reason="{r}"}}', 0)
                 - before.get(f'zerojax_requests_finished_total{{reason="{r}"}}', 0) for r in ("abort", "length")}
        assert sum(ended.values()) == 1, ended
        aborted += ended["abort"]
        if aborted:
            break
    assert aborted == 1


def _leave_mid_stream(url, body):
    """Start a streamed request, read its first event, and go away (the socket shut both ways)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")  # the first token came
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def _error(url, body, key=KEY):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, text = _request(url, "POST", "/v1/completions", raw, key)
    return status, json.loads(text)["error"]


BAD = [  # (body, or raw bytes; the param the error names)
    (b'{"model": "tiny", "prompt": ', None),  # malformed JSON
    ({"model": "other", "prompt": "w5"}, "model"),  # an unknown model
    ({"model": NAME, "prompt": " ".join(["w5"] * 70)}, "prompt"),  # past the context (64)
    ({"model": NAME, "prompt": "w5 w6", "max_tokens": 63}, "max_tokens"),  # 2 + 63 past the context
    ({"model": NAME, "prompt": "w5", "temperature": -1}, "temperature"),
    ({"model": NAME, "prompt": "w5", "top_p": 2}, "top_p"),
    ({"model": NAME, "prompt": "w5", "logit_bias": {"7": 100}}, "logit_bias"),  # not served: refused, not ignored
]


def test_bad_input_is_a_400_and_the_next_request_is_served(server):
    url, proc = server
    for body, param in BAD:
        status, error = _error(url, body)
        assert status == 400 and error["message"] and error["type"] == "invalid_request_error", (body, error)
        assert error["param"] == param, (body, error)
        ok = _client(url).completions.create(model=NAME, prompt="w5 w6", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens >= 1 and proc.poll() is None
    # --api-key: every route but /health needs it
    assert _error(url, {"model": NAME, "prompt": "w5"}, key=None)[0] == 401
    assert _error(url, {"model": NAME, "prompt": "w5"}, key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="wrong").models.list()
    assert _request(url, key=None)[0] == 200
    assert [m.id for m in _client(url).models.list().data] == [NAME, "tuned"]


def test_the_request_model_picks_the_adapter(server, tuned, reference):
    url, _ = server
    _, tok = reference
    client = _client(url)
    prompt = "w33 w2 w61 w8 w19"
    answers = {m: client.completions.create(model=m, prompt=prompt, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
               .choices[0].text for m in (NAME, "tuned")}
    expected = generate(tuned[0], prompt, max_new_tokens=NEW, tokenizer=tok, ignore_eos=True).texts[0]
    assert answers["tuned"] == expected != answers[NAME]


def test_logprobs_are_the_models_own(server, folder, reference):
    """logprobs=2: each new token's log-probability and the two likeliest, as transformers' logits
    give them (the token strings as the tokenizer decodes each id)."""
    import torch
    import transformers

    url, _ = server
    _, tok = reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = "w14 w15 w90"
    answer = _client(url).completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                             extra_body={"ignore_eos": True}).choices[0]
    ids = [int(i) for i in tok.encode(prompt)]
    lp = answer.logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens) == 4
    for token_text, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
        best = torch.topk(expected, 2)
        assert token_text == tok.decode([int(best.indices[0])])  # greedy: the likeliest
        assert logprob == pytest.approx(float(best.values[0]), abs=1e-4)
        assert list(top) == [tok.decode([int(i)]) for i in best.indices]
        np.testing.assert_allclose(list(top.values()), best.values.numpy(), atol=1e-4)
        ids.append(int(best.indices[0]))
