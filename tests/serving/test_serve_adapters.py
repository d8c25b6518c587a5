"""Several LoRA adapters over one base in one engine (each request's adapter picks its weights):
two PEFT adapters answer differently, each as peft's greedy `generate`; the penalties and the
log-probabilities against transformers (its repetition penalty, its logits' log-softmax) and
OpenAI's presence / frequency formula applied to transformers' logits."""
import numpy as np
import pytest

from zerojax.serving import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from generation.test_generate_hf import _hf_greedy  # noqa: E402 (tests/ on sys.path)
from models.test_llama import _hf_model  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the base's folder (transformers' tiny llama3), {name: (peft model, its folder)})."""
    base = tmp_path_factory.mktemp("serve_base")
    _hf_model("llama3").save_pretrained(base)
    tuned = {}
    for seed, name in enumerate(("a", "b")):  # one LoraConfig, as adapters trained for one base often share
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "o_proj"])
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0, 0.5)
        folder = tmp_path_factory.mktemp(f"adapter_{name}")
        model.save_pretrained(folder)
        tuned[name] = (model, folder)
    return base, tuned


@pytest.fixture(scope="module")
def served(folders):
    """(transformers' base, {name: peft model}, an LLM serving the base and both adapters)."""
    base, tuned = folders
    llm = LLM(str(base), adapters={n: str(f) for n, (_, f) in tuned.items()}, page_size=4, kv_cache_tokens=256,
              max_num_seqs=8)
    return transformers.AutoModelForCausalLM.from_pretrained(base).eval(), {n: m for n, (m, _) in tuned.items()}, llm


def _prompts(n=3):
    rng = np.random.default_rng(12)
    return [rng.integers(2, 101, k).tolist() for k in (6, 11, 3)[:n]]


def test_two_adapters_each_equal_peft_greedy(served):
    """Both adapters and the base in one batch (their LoRA terms stacked: one program call a step)."""
    hf, tuned, llm = served
    assert llm.engine.stacked_adapters == ["a", "b"]
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=NEW)
    for p in prompts:  # one request per adapter and the base, in one batch
        for name in (*tuned, None):
            llm.engine.add_request(p, greedy, adapter=name, request_id=f"{name}-{p}")
    answers = {}
    while llm.engine.has_unfinished():
        answers.update((o.request_id, o.token_ids) for o in llm.engine.step() if o.finished)
    for p in prompts:
        a, b = answers[f"a-{p}"], answers[f"b-{p}"]
        assert a != b
        assert a == _hf_greedy(tuned["a"], p, NEW) and b == _hf_greedy(tuned["b"], p, NEW)
        assert answers[f"None-{p}"] == _hf_greedy(hf, p, NEW)


def test_penalties_and_logprobs_against_transformers(served):
    """Greedy under Hugging Face's repetition penalty (prompt and generated tokens) then OpenAI's
    presence / frequency penalties (generated tokens), each step checked on transformers' logits."""
    hf, _, llm = served
    prompt = _prompts(1)[0]
    params = SamplingParams(max_tokens=NEW, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=0.7,
                            logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    ids = list(prompt)
    for token, (logprob, top) in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        raw = torch.log_softmax(logits, -1)  # logprobs are the model's own distribution's
        assert logprob == pytest.approx(raw[token].item(), abs=2e-5)
        best = torch.topk(raw, 3)
        assert list(top) == best.indices.tolist()
        np.testing.assert_allclose(list(top.values()), best.values.numpy(), atol=2e-5)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        penalized = torch.where(seen, torch.where(logits < 0, logits * 1.8, logits / 1.8), logits)  # HF's
        generated = torch.zeros_like(logits)
        for t in ids[len(prompt):]:
            generated[t] += 1
        penalized = penalized - 1.5 * (generated > 0) - 0.7 * generated  # OpenAI's
        assert token == int(torch.argmax(penalized))
        ids.append(token)


def test_quantized_base_and_adapter_equal_generate_on_the_same_quantized_model(folders):
    """quantize="nf4": the base stored as QLoRA stores it, the adapter over the same codes; each
    request's greedy tokens equal `zerojax.generate` on a QLoRA model built by `zerojax.lora` from
    the same folders (its own quantization, its adapters zero for the base)."""
    import jax
    from flax import nnx

    import zerojax
    from zerojax import lora
    from zerojax.models import from_hf
    from zerojax.serving.llm import load_model

    base, tuned = folders
    model, tok, adapters = load_model(str(base), adapters={"a": str(tuned["a"][1])}, quantize="nf4")
    codes = [x for x in jax.tree.leaves(nnx.state(model)) if x.dtype == np.uint8]
    assert codes and all(any(c is x for x in jax.tree.leaves(nnx.state(adapters["a"]))) for c in codes)  # shared
    llm = LLM(model, tok, adapters=adapters, page_size=4, kv_cache_tokens=256, max_num_seqs=8)
    reference = {None: lora.apply(from_hf(base), {"r": 4, "target_modules": "all-linear", "quantize": "nf4"}),
                 "a": lora.load_peft(from_hf(base), tuned["a"][1], quantize="nf4")}
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    for p in _prompts(2):  # one prompt bucket of generate's
        for name, ref in reference.items():
            served = llm.generate([p], greedy, adapter=name)[0].token_ids
            assert served == zerojax.generate(ref, p, max_new_tokens=NEW, ignore_eos=True).tokens[0], (name, p)
