"""LoRA (`zerojax.lora`) on GPT-2, against PEFT on Hugging Face's GPT2LMHeadModel (Conv1D layers,
fan_in_fan_out): our adapter folder loaded by `peft.PeftModel` gives our logits, a PEFT-made folder
read by `load_peft` gives PEFT's, one SGD step moves the adapters as PyTorch's does, the merged
export equals `merge_and_unload`; ZeRO-3 over 8 devices trains the adapters as stage 0 does with no
optimizer state for the frozen base. fp32."""
import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

# the Llama LoRA tests' tolerances and engine settings (tests/models is on sys.path)
from test_lora import ATOL, ROWS, RTOL, SEQ, WEIGHT_ATOL, _ids, _torch_logits, ds_config, host

import zerojax
from zerojax import lora
from zerojax.models import GPT2, GPT2Config, Llama, LlamaConfig, from_hf, gpt2_loss, to_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 101  # odd: padded to 128 rows on our side (test_lora's `_ids` draw below it)
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"], "init_lora_weights": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random tiny GPT2LMHeadModel (perturbed layer norms and biases, which HF starts at 1 / 0)."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    off_init = [p for name, p in hf.named_parameters() if "ln_" in name or name.endswith("bias")]
    with torch.no_grad():
        torch._foreach_add_(off_init, [0.2 * torch.randn_like(p) for p in off_init])
    path = tmp_path_factory.mktemp("hf_gpt2")
    hf.save_pretrained(path)
    return path


def _hf(folder):
    return transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()


def check_against_peft(model, plain, hf_base, out, ids):
    """`model`'s PEFT folder (save_peft to out/adapter) on the transformers base (`hf_base()`, a fresh
    copy per call): peft.PeftModel's logits are ours; the merged export (merge + to_hf to out/merged)
    is peft's merge_and_unload; load_peft reads the folder onto our plain base (`plain()`) with the
    same adapters, bit for bit. PEFT's adapted modules are our targets (PEFT's target_modules match
    by name suffix: GPT-2's bare "c_proj" would take both c_proj modules)."""
    ours = np.asarray(model(ids))
    lora.save_peft(model, out / "adapter")
    peft_model = peft.PeftModel.from_pretrained(hf_base(), out / "adapter").eval()
    theirs = _torch_logits(peft_model, ids)
    assert np.abs(theirs - _torch_logits(hf_base(), ids)).max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)
    layer0 = lora.PEFT_PREFIX + model.adapter.family_parts.prefix.format(i=0)
    adapted = {n.removeprefix(layer0).removesuffix(".lora_A") for n, _ in peft_model.named_modules()
               if n.startswith(layer0) and n.endswith(".lora_A")}
    assert adapted == set(model.adapter.targets)
    merged = lora.merge(model)
    assert type(merged) is type(model) and getattr(merged, "adapter", None) is None
    to_hf(merged, out / "merged")
    reread = _torch_logits(type(hf_base()).from_pretrained(out / "merged", dtype=torch.float32).eval(), ids)
    np.testing.assert_allclose(reread, _torch_logits(peft_model.merge_and_unload(), ids), rtol=RTOL, atol=ATOL)
    back = lora.load_peft(plain(), out / "adapter")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(back, nnx.Param), nnx.state(model, nnx.Param))


def sgd_step_against_peft(model, loss_fn, hf_base, out, ids, lr):
    """One SGD step of `lr` on `ids`, ours (jax.grad of loss_fn) and PEFT's (PyTorch on the folder
    save_peft wrote to `out`, Hugging Face's mean next-token cross entropy) -> (our adapter tensors
    after it, PEFT's, ours before), PEFT's names."""
    lora.save_peft(model, out)
    before = lora.peft_tensors(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), {"input_ids": ids})[0])(params)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))

    peft_model = peft.PeftModel.from_pretrained(hf_base(), out, is_trainable=True)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == lora.trainable_count(model)
    x = torch.from_numpy(ids.astype(np.int64))
    peft_model(input_ids=x, labels=x).loss.backward()
    torch.optim.SGD(trainable, lr=lr).step()
    theirs = {k: v.detach().numpy() for k, v in peft.get_peft_model_state_dict(peft_model).items()}
    return lora.peft_tensors(model), theirs, before


@pytest.mark.parametrize("settings", [LORA, dict(LORA, target_modules=["attn.c_proj", "c_fc"], use_rslora=True)],
                         ids=["c_attn+c_proj+c_fc", "attn.c_proj+c_fc-rslora"])
def test_peft_files_and_merged_export_match_peft(folder, tmp_path, settings):
    model = lora.apply(from_hf(folder), settings)
    assert np.abs(np.asarray(model.h.mlp.c_fc.lora_B[...])).min() > 0  # nonzero adapters
    check_against_peft(model, functools.partial(from_hf, folder), functools.partial(_hf, folder), tmp_path, _ids())


@pytest.mark.parametrize("targets", [["c_attn", "c_proj", "c_fc"], r".*\.(c_attn|mlp\.c_proj)"],
                         ids=["names", "regex"])
def test_adapter_made_by_peft_loads(folder, tmp_path, targets):
    """get_peft_model on GPT2LMHeadModel (PEFT sets fan_in_fan_out for Conv1D) with random B,
    save_pretrained, `load_peft` onto our plain GPT-2: PEFT's logits."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(_hf(folder), config).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(tmp_path / "peft")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    ids = _ids(seed=2)
    model = lora.load_peft(from_hf(folder), tmp_path / "peft")
    assert len(model.adapter.targets) == (4 if isinstance(targets, list) else 2)
    np.testing.assert_allclose(np.asarray(model(ids)), _torch_logits(peft_model, ids), rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_one_sgd_step_equals_pytorch(folder, tmp_path):
    model = lora.apply(from_hf(folder), dict(LORA, target_modules="all-linear"))
    ours, theirs, before = sgd_step_against_peft(model, gpt2_loss, functools.partial(_hf, folder), tmp_path / "a",
                                                 _ids(batch=4, seq=10, seed=1), lr=0.5)
    assert set(ours) == set(theirs)
    # as the Llama test: weights ~0.2, gradients ~1e-2 summed in another order (a few ulps of their
    # terms); lr 0.5 keeps that far under 1e-6 of a weight
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=0, atol=1e-6, err_msg=k)
    assert max(np.abs(ours[k] - v).max() for k, v in before.items()) > 1e-4  # the step did something


# ------------------------------------------------------------------------ the engine

MODEL = GPT2Config.named("tiny", vocab_size=64, n_positions=SEQ, n_embd=32, n_head=4)


@functools.cache
def _trained(stage, offload_param=False):
    """(engine, losses, adapters, the base as built) after 3 SGD steps; one engine per setting
    (tests read it, none trains it further)."""
    make = lambda: lora.apply(GPT2(MODEL, rngs=nnx.Rngs(0)), LORA)  # noqa: E731
    cfg = ds_config(stage)
    if offload_param:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    eng = zerojax.shard(make, cfg, loss_fn=gpt2_loss)
    rest0 = host(eng.state.rest)
    rng = np.random.default_rng(0)
    losses = [float(eng.train_step({"input_ids": rng.integers(0, 64, (ROWS, SEQ)).astype(np.int32)})["loss"])
              for _ in range(3)]
    eng.synchronize()
    return eng, np.asarray(losses), host(eng.master_params), rest0


@pytest.mark.slow
def test_zero3_trains_adapters_as_stage0_with_no_state_for_the_base():
    ref_eng, ref_losses, ref, _ = _trained(0)
    eng, losses, master, rest0 = _trained(3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL, err_msg=jax.tree_util.keystr(path))
    for e, m in ((ref_eng, ref), (eng, master)):
        # the trained tree: the adapters alone; SGD's momentum one fp32 per adapter element, nothing more
        assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(m)} == {"lora_A", "lora_B"}
        opt = [x for x in jax.tree.leaves(e.state.opt_state) if getattr(x, "ndim", 0) > 0]
        assert sorted(x.shape for x in opt) == sorted(x.shape for x in jax.tree.leaves(m))
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(
        host(nnx.state(lora.apply(GPT2(MODEL, rngs=nnx.Rngs(0)), LORA), nnx.Param))), strict=True)]
    assert min(moved) > 0  # every adapter trained
    jax.tree.map(np.testing.assert_array_equal, host(eng.state.rest), rest0)  # the base: unchanged
    assert eng.layout.stage3_gather == "layer"
    a = eng.state.params["h"]["attn"]["c_attn"]["lora_A"]
    base = eng.state.rest["h"]["mlp"]["c_fc"]["kernel"]
    assert a.addressable_shards[0].data.size == a.size // 8  # ZeRO-3 over 8 devices
    assert base.addressable_shards[0].data.size == base.size // 8  # the frozen base too


@pytest.mark.slow
def test_offload_param_trains_adapters_as_stage0_with_the_base_in_host_memory():
    """offload_param (ZeRO-3): the layers' frozen base in host memory, fetched a layer ahead with the
    layer's adapters (offload.prefetch_scan); the adapters train as at stage 0, the base unchanged."""
    _, ref_losses, ref, _ = _trained(0)
    eng, losses, master, rest0 = _trained(3, offload_param=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL, err_msg=jax.tree_util.keystr(path))
    jax.tree.map(np.testing.assert_array_equal, host(eng.state.rest), rest0)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(eng.state.rest["h"])} == {"pinned_host"}
    assert eng.state.rest["wte"].sharding.memory_kind == "device"


# ------------------------------------------------------------------------ settings


TINY_LLAMA = LlamaConfig.named("tiny", hidden_size=32, intermediate_size=64)


@pytest.mark.parametrize("family,bad,words", [
    ("gpt2", {"target_modules": ["q_proj"]}, ["lora.target_modules", "'c_attn'", "transformer.h.0.attn.c_attn"]),
    ("gpt2", {"modules_to_save": ["wte"]}, ["lora.modules_to_save", "tied", "leave modules_to_save out"]),
    ("gpt2", {"modules_to_save": ["lm_head"]}, ["lora.modules_to_save", "tied", "leave modules_to_save out"]),
    ("gpt2", {"fan_in_fan_out": "yes"}, ["lora.fan_in_fan_out", "true or false"]),
    ("llama", {"fan_in_fan_out": True}, ["lora.fan_in_fan_out", "Conv1D", "nn.Linear", "remove it"]),
])
def test_config_errors_name_key_and_fix(family, bad, words):
    """One line naming the key and the fix; fan_in_fan_out true (Hugging Face's Conv1D layout) is
    GPT-2's alone."""
    model = GPT2(MODEL, rngs=nnx.Rngs(0)) if family == "gpt2" else Llama(TINY_LLAMA, rngs=nnx.Rngs(0))
    with pytest.raises(zerojax.ConfigError) as e:
        lora.apply(model, {**LORA, "target_modules": "all-linear", **bad})
    (problem,) = e.value.problems
    assert "\n" not in problem and all(w in problem for w in words), (words, problem)


def test_fan_in_fan_out_either_way_on_gpt2():
    """PEFT turns fan_in_fan_out on for Conv1D itself (warning when it was false): both are GPT-2's."""
    for value in (True, False):
        model = lora.apply(GPT2(MODEL, rngs=nnx.Rngs(0)), dict(LORA, fan_in_fan_out=value))
        assert model.adapter.targets == tuple(lora.family_named("gpt2").linears)


@pytest.mark.slow
def test_quantized_base_and_the_4bit_block_rule():
    """int8 / nf4 / int4 bases stay near the unquantized adapted model (the logits' error relative
    to their spread, the Llama test's bounds; measured 0.4%, 9%, 7% here); nf4 on a GPT-2 whose layer
    weights are not whole 64-element blocks is refused, naming int8."""
    ids = _ids(seq=SEQ) % 64
    ref = np.asarray(lora.apply(GPT2(MODEL, rngs=nnx.Rngs(0)), LORA)(ids))
    for kind, rel in (("int8", 0.02), ("nf4", 0.2), ("int4", 0.3)):
        out = np.asarray(lora.apply(GPT2(MODEL, rngs=nnx.Rngs(0)), dict(LORA, quantize=kind))(ids))
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref - ref.mean()) < rel, kind
    odd = GPT2(GPT2Config.named("tiny", n_embd=20, n_head=4), rngs=nnx.Rngs(0))  # c_attn 20 x 60: 1200
    with pytest.raises(ValueError, match="multiple of 64 elements.*int8"):
        lora.apply(odd, dict(LORA, quantize="nf4"))
