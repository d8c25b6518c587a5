"""LoRA and QLoRA for GPT-2 and the Llama family, with PEFT's settings and PEFT's file format.

    model = zerojax.models.from_hf(path)
    model = zerojax.lora.apply(model, {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
    engine = zerojax.shard(lambda: model, ds_config, loss_fn=zerojax.models.llama_loss)
    ...
    zerojax.lora.save_peft(engine.model, "adapter/")     # peft.PeftModel.from_pretrained loads it
    zerojax.models.to_hf(zerojax.lora.merge(engine.model), "merged/")

The frozen base is stored as `FrozenWeight` variables (not `nnx.Param`), so the engine's
`nnx.split(model, nnx.Param, ...)` trains only the adapters (`lora_A`, `lora_B` and the
`modules_to_save` copies, `nnx.Param` in fp32): no gradient, fp32 master or optimizer state for the
base; the engine shards it as parameters are (its logical names: tensor parallel; stage 3: ZeRO).
The base is kept in its dtype (or `base_dtype`), or quantized
(`quantize`): "int8" (per output channel absmax), "nf4" / "int4" (QLoRA: 64-element blocks of each
layer's weight, one absmax per block, two 4-bit codes per byte), dequantized on use inside the
layer scan. Adapters are stacked on the base's leading "layers" axis (lora_A [L, *in, r],
lora_B [L, r, *out]) and carry the kernel's logical axis names, so tensor parallelism splits them
as it splits their kernel (a column-parallel kernel's lora_B, a row-parallel kernel's lora_A).

What differs between model families is one `Family` each (the registry's `PeftTargets`): the PEFT (Hugging Face)
module names, where those modules sit in our stacked layers, the savable modules, PEFT's
fan_in_fan_out for them. GPT-2's projections are Hugging Face `Conv1D`s ([in, out] weights), for
which PEFT sets fan_in_fan_out; its files hold lora_A [r, in] and lora_B [out, r] all the same.

Why not `qwix` (installable from PyPI): its LoRA / PTQ providers intercept the calls of per-layer
`nnx.Linear` / `nnx.Einsum` modules by module path and create their own parameters at call time;
our layers run as one `lax.scan` over stacked pure dicts (the engine's hooks need that), with no
module calls to intercept, and its QArray is not a Variable type the engine's split would leave
untrained. Its NF4 numerics are private (`qwix._src`). The dequantize-on-use code (`zerojax.models.quantize`) is
~60 lines.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax._jax_compat import no_eager_sharding
from zerojax.config import ConfigError
from zerojax.models import registry
from zerojax.models.grouped_matmul import grouped_product
from zerojax.models.quantize import (  # noqa: F401
    BLOCK,
    NF4,
    QUANTIZE,
    dequantize_4bit,
    kernel_of,
    quantization_bound,
    quantize_4bit,
    quantize_int8,
)

PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class Family:
    """What LoRA needs to know of a model family (`zerojax.models.registry`: its `PeftTargets`)."""

    name: str  # the registered family's name (LoraAdapter.family)
    label: str  # for messages
    model: type  # the model class (`merge` builds a plain one)
    stack: str  # the model's attribute holding the stacked layers
    prefix: str  # PEFT's (Hugging Face's) name of layer {i}, before a module name
    # PEFT's module name (after the prefix) -> (our path under the stack, how many leading axes of
    # a layer's kernel are its input)
    linears: dict
    # modules_to_save: PEFT's name -> (our attribute, HF tensor name). (PEFT matches modules_to_save
    # by name suffix: "norm" would take every layer's norms too, which the stacked layers cannot
    # train apart from the rest of their layer: not offered)
    savable: dict
    fan_in_fan_out: bool  # PEFT's for these modules: True for Conv1D ([in, out] weights)
    # PEFT's target_parameters name -> (our path, input axes, leading expert axes): 3-D expert weights
    parameters: dict = dataclasses.field(default_factory=dict)

    @property
    def kernels(self) -> dict:
        """Every adaptable kernel: PEFT name -> (our path, input axes, leading axes)."""
        return {**{k: (*v, 0) for k, v in self.linears.items()}, **self.parameters}


def _family(f) -> Family:
    return Family(f.name, f.label, f.model_class, **dataclasses.asdict(f.peft))


def family_named(name: str) -> Family:
    """The LoRA view of the registered family `name`."""
    return _family(registry.get(name))


def family_of(model) -> Family:
    f = registry.for_model(model)
    if f is None or f.peft is None:
        able = [f"{f.label} ({f.model_class.__name__})" for f in registry.families().values() if f.peft]
        raise TypeError(f"zerojax.lora: {type(model).__name__}; LoRA runs on the families that name their "
                        f"PEFT modules: {', '.join(able)}")
    return _family(f)


def _tied(model) -> bool:
    """The input embedding is the LM head (GPT-2 always; a Llama by its config)."""
    return getattr(model.config, "tie_word_embeddings", True)


def _n_layer(model) -> int:
    return model.config.n_layer  # (LlamaConfig has GPT-2's name too)

class FrozenWeight(nnx.Variable):
    """A base weight that is not trained: the engine's split puts it in the "rest" (no gradient,
    no fp32 master, no optimizer state), sharded as its parameter would be (tensor parallel by its
    logical names, ZeRO-3 over "data"). Quantized kernels are FrozenWeights too."""


# --------------------------------------------------------------------------- settings

# PEFT's LoraConfig keys this module acts on, with their defaults
DEFAULTS = dict(r=8, lora_alpha=8, target_modules=None, lora_dropout=0.0, bias="none", use_rslora=False,
                modules_to_save=None, init_lora_weights=True, exclude_modules=None, target_parameters=None)
# zerojax's additions: the base's storage
EXTRAS = dict(quantize=None, base_dtype=None, seed=0)
# PEFT keys accepted only at their default (a feature not implemented here: a clear error otherwise)
FIXED = dict(layers_to_transform=None, layers_pattern=None, rank_pattern={},
             alpha_pattern={}, use_dora=False, loftq_config={}, layer_replication=None, lora_bias=False,
             trainable_token_indices=None, use_qalora=False, megatron_config=None,
             eva_config=None, corda_config=None, lora_ga_config=None, alora_invocation_tokens=None,
             arrow_config=None, velora_config=None, monteclora_config=None, kasa_config=None, use_bdlora=None,
             astra_config=None)
# PEFT keys that describe Hugging Face's weight layout, which the model's family fixes: checked
# against it (with a model), not kept. fan_in_fan_out: true for GPT-2's Conv1D, false otherwise
LAYOUT = dict(fan_in_fan_out=False)
# PEFT keys that do not change training (bookkeeping): accepted, ignored
IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
           "inference_mode", "megatron_core", "runtime_config", "qalora_group_size", "ensure_weight_tying")


def _problem(key, message):
    return ConfigError([f"lora.{key}: {message}"])


def from_config_dict(d, model=None) -> dict:
    """The `"lora"` section of a DeepSpeed JSON (PEFT's LoraConfig keys, plus `quantize`,
    `base_dtype`, `seed`) checked -> the full settings dict. Errors are `zerojax.ConfigError`s
    naming the key and the fix. With `model`, target_modules / modules_to_save are checked against
    its module names."""
    if not isinstance(d, dict):
        raise ConfigError([f"lora: a dict of LoRA settings, got {type(d).__name__}"])
    known = {**DEFAULTS, **EXTRAS, **FIXED, **LAYOUT}
    for key in d:
        if key not in known and key not in IGNORED:
            if "peft_type" in d:  # written by PEFT: a key of a newer PEFT than this list knows
                if d[key] in (None, False, {}, []):  # (0 and 0.0 equal False: off too)
                    continue  # its feature left off (PEFT's default): nothing to act on
                raise _problem(key, f"{d[key]!r}: a PEFT feature zerojax.lora does not implement; remove it "
                                    "(or set it to null)")
            near = difflib.get_close_matches(key, list(known) + list(IGNORED), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {sorted({**DEFAULTS, **EXTRAS})}"
            raise _problem(key, f"unknown key{hint}")
    for key, default in FIXED.items():
        if key in d and d[key] not in (default, None) and not (default == {} and not d[key]):
            raise _problem(key, f"{d[key]!r} is not supported by zerojax.lora; remove it (default {default!r})")
    if not isinstance(d.get("fan_in_fan_out", False), bool):
        raise _problem("fan_in_fan_out", f"{d['fan_in_fan_out']!r}: true or false")
    s = {**DEFAULTS, **EXTRAS, **{k: v for k, v in d.items() if k in DEFAULTS or k in EXTRAS}}
    r = s["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _problem("r", f"{r!r}: the adapter rank, an int >= 1 (e.g. 8 or 16)")
    alpha = s["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise _problem("lora_alpha", f"{alpha!r}: the scale numerator, a number > 0 (PEFT's default: r)")
    p = s["lora_dropout"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise _problem("lora_dropout", f"{p!r}: a probability in [0, 1)")
    if s["bias"] != "none":
        raise _problem("bias", f"{s['bias']!r}: only \"none\" (biases stay frozen); \"all\" / \"lora_only\" "
                               "are not implemented")
    if not isinstance(s["use_rslora"], bool):
        raise _problem("use_rslora", f"{s['use_rslora']!r}: true or false")
    if s["init_lora_weights"] not in (True, False, "gaussian"):
        raise _problem("init_lora_weights", f"{s['init_lora_weights']!r}: true (PEFT's: B = 0), \"gaussian\" "
                                            "or false (random B, for tests); other schemes are not implemented")
    tp = s["target_parameters"]
    if tp is not None and not (isinstance(tp, (list, tuple)) and tp and all(isinstance(x, str) for x in tp)):
        raise _problem("target_parameters", f"{tp!r}: a non-empty list of parameter names such as "
                                            "[\"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"] (or null)")
    if tp and p:
        raise _problem("lora_dropout", f"{p!r} with target_parameters: PEFT's parameter adapters take no dropout "
                                       "(dropout of x cannot be factored out of an expert's product); set it to 0")
    s["target_parameters"] = list(tp) if tp else None
    t = s["target_modules"]
    if t is None and tp:
        s["target_modules"] = t = []
    if t is None:
        raise _problem("target_modules", "required: a list of module names such as [\"q_proj\", \"v_proj\"], "
                                         "\"all-linear\", or a regular expression")
    if isinstance(t, (list, tuple, set)):
        if (not t and not tp) or not all(isinstance(x, str) for x in t):
            raise _problem("target_modules", f"{t!r}: a non-empty list of module names")
        s["target_modules"] = sorted(set(t))
    elif not isinstance(t, str):
        raise _problem("target_modules", f"{t!r}: a list of names, \"all-linear\", or a regular expression")
    for key in ("modules_to_save", "exclude_modules"):
        v = s[key]
        if v is not None and not (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)):
            raise _problem(key, f"{v!r}: a list of module names (or null)")
        s[key] = None if not v else sorted(set(v))
    if s["quantize"] not in QUANTIZE:
        raise _problem("quantize", f"{s['quantize']!r}: one of null, \"int8\", \"nf4\", \"int4\"")
    if s["base_dtype"] is not None:
        try:
            jnp.dtype(s["base_dtype"])
        except TypeError:
            raise _problem("base_dtype", f"{s['base_dtype']!r}: a dtype name (\"bfloat16\", \"float32\")") from None
    if model is not None:
        fam = family_of(model)
        if d.get("fan_in_fan_out") and not fam.fan_in_fan_out:
            raise _problem("fan_in_fan_out", f"true is for Hugging Face Conv1D weights stored [in, out] (GPT-2); "
                                             f"{fam.label}'s projections are nn.Linear: remove it (default false)")
        _targets(model, s)
        _savable(model, s)
    return s


def _matches(full: str, pattern) -> bool:
    if isinstance(pattern, str):
        return re.fullmatch(pattern, full) is not None
    return any(full == p or full.endswith("." + p) for p in pattern)


def _targets(model, s) -> tuple[str, ...]:
    """The targeted linear modules (keys of the family's `linears`), PEFT's matching rules."""
    fam = family_of(model)
    t, names = s["target_modules"], list(fam.linears)
    L = _n_layer(model)
    if t == "all-linear":  # PEFT: every linear layer (nn.Linear, Conv1D) but the output head
        chosen = names
    elif not t:  # target_parameters alone
        chosen = []
    else:
        chosen = []
        for name in names:
            hits = [_matches(fam.prefix.format(i=i) + name, t) for i in range(L)]
            if any(hits) and not all(hits):
                raise _problem("target_modules", f"{t!r} matches {name} in some layers only; the layers are "
                                                 "stacked: target a module in every layer (layers_to_transform "
                                                 "is not supported)")
            if all(hits):
                chosen.append(name)
        if not chosen and not s.get("target_parameters"):
            short = sorted({n.split(".")[-1] for n in names})
            raise _problem("target_modules", f"{t!r} matches no linear module of this model; its linear "
                                             f"modules are {short} (full names like "
                                             f"{fam.prefix.format(i=0)}{names[0]}), or use \"all-linear\"")
    ex = s.get("exclude_modules")
    if ex:
        chosen = [n for n in chosen if not _matches(fam.prefix.format(i=0) + n, ex)]
        if not chosen and not s.get("target_parameters"):
            raise _problem("exclude_modules", f"{ex!r} excludes every targeted module")
    return tuple(chosen) + _target_parameters(fam, s)


def _target_parameters(fam: Family, s) -> tuple[str, ...]:
    """The targeted expert parameters (keys of the family's `parameters`), matched as PEFT matches
    target_parameters: a name equal to, or a suffix of, the full parameter name."""
    tp = s.get("target_parameters") or []
    chosen = [name for name in fam.parameters if _matches(fam.prefix.format(i=0) + name, tp)]
    unknown = [x for x in tp if not any(_matches(fam.prefix.format(i=0) + n, [x]) for n in fam.parameters)]
    if unknown:
        have = list(fam.parameters) or "none (no expert weights)"
        raise _problem("target_parameters", f"{unknown[0]!r} matches no parameter of this model; its adaptable "
                                            f"parameters are {have}")
    return tuple(chosen)


def _savable(model, s) -> tuple[str, ...]:
    fam, tied, out = family_of(model), _tied(model), []
    for name in s["modules_to_save"] or ():
        key = name.split(".")[-1]
        if key in fam.savable and tied:
            raise _problem("modules_to_save", f"{name!r}: this model's input embedding is its LM head (tied "
                                              "embeddings); training it whole is not supported (PEFT's "
                                              "ensure_weight_tying): leave modules_to_save out")
        if key not in fam.savable:
            have = "this model (tied embeddings) has none: leave modules_to_save out" if tied else \
                f"choose from {list(fam.savable)}"
            raise _problem("modules_to_save", f"{name!r}: not a module this model can train whole; {have}")
        out.append(key)
    return tuple(out)


# --------------------------------------------------------------------------- the adapter


class LoraDropout(nnx.Module):
    """lora_dropout's state: applied in training mode only (`model.train()`; `model.eval()` turns it
    off, as PyTorch's module modes do), with keys drawn from `rngs` (the engine carries its counter)."""

    def __init__(self, rate: float, seed: int):
        self.rate = rate
        self.deterministic = True  # Hugging Face's from_pretrained models start in eval mode
        self.rngs = nnx.Rngs(dropout=seed)


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """The settings a LoRA model carries (`model.adapter`, a static attribute the model's layer
    scan calls): PEFT's scale, the targets, the settings dict to export, the model's family (a
    registered family name)."""

    scale: float
    targets: tuple
    savable: tuple
    quantize: str | None
    settings: tuple  # sorted (key, value) pairs of the settings dict (hashable)
    family: str = "llama"
    enabled: bool = True  # False: the frozen base alone (`adapters_disabled`), the LoRA terms left out
    zeroed: bool = False  # True: the frozen base's values, the LoRA terms run at scale 0 (`adapters_zeroed`)

    @property
    def family_parts(self) -> Family:
        return family_named(self.family)

    @property
    def config(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.settings}

    @property
    def term_scale(self) -> float:
        """What the LoRA terms are multiplied by: PEFT's scale, or 0.0 when zeroed (an exact zero
        for finite terms; XLA keeps a float product by 0, whose NaN / inf semantics it may not fold)."""
        return 0.0 if self.zeroed else self.scale

    def linear(self, eq, h, entry, dtype):
        """base(h) + scale * B(A(dropout(h))), the base dequantized on use."""
        y = jnp.einsum(eq, h, kernel_of(entry, dtype))
        if "lora_A" not in entry or not self.enabled:
            return y
        a, b = entry["lora_A"].astype(dtype), entry["lora_B"].astype(dtype)
        if "dropout_key" in entry:
            rate = dict(self.settings)["lora_dropout"]
            keep = jax.random.bernoulli(jax.random.wrap_key_data(entry["dropout_key"]), 1 - rate, h.shape)
            h = jnp.where(keep, h / (1 - rate), 0).astype(dtype)
        u = jnp.tensordot(h, a, axes=a.ndim - 1)
        return y + self.term_scale * jnp.tensordot(u, b, axes=1)

    def ragged(self, x, entry, group_sizes, dtype):
        """An expert projection (`zerojax.models.moe.grouped_experts`): x [M, in] grouped by expert
        times the kernel [E, in, *out] (dequantized on use), plus scale * B_e(A_e(x)) with each
        row's own expert's adapters (lora_A [E, in, r], lora_B [E, r, *out]), as grouped products."""
        y = grouped_product(x, kernel_of(entry, dtype), group_sizes)
        if "lora_A" not in entry or not self.enabled:
            return y
        u = grouped_product(x, entry["lora_A"].astype(dtype), group_sizes)
        return y + self.term_scale * grouped_product(u, entry["lora_B"].astype(dtype), group_sizes)

    def layer_inputs(self, model):
        """The stacked untrained per-layer inputs: the frozen base and (training, dropout > 0)
        one dropout key per layer and targeted module."""
        fam = self.family_parts
        side = nnx.to_pure_dict(nnx.state(getattr(model, fam.stack), FrozenWeight))
        drop = getattr(model, "lora_dropout", None)
        if self.enabled and not self.zeroed and drop is not None and not drop.deterministic and drop.rate > 0:
            key, L = drop.rngs.dropout(), _n_layer(model)
            for i, name in enumerate(self.targets):
                keys = jax.random.key_data(jax.random.split(jax.random.fold_in(key, i), L))
                _at(side, fam.kernels[name][0])["dropout_key"] = keys
        return side

    @staticmethod
    def merge(params, side):
        return _deep_merge(params, side)


def _deep_merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _at(tree, path):
    for k in path:
        tree = tree.setdefault(k, {})
    return tree


def _module(model, path):
    m = getattr(model, family_of(model).stack)
    for k in path:
        m = getattr(m, k)
    return m


def _names(var):
    names = var.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * var[...].ndim


def _var(cls, value, names):
    return cls(value, out_sharding=tuple(names), eager_sharding=False)


def apply(model, config, *, rngs: nnx.Rngs | None = None, device=None):
    """`model` (a `zerojax.models.Llama` or `zerojax.models.GPT2`) with LoRA adapters on
    `config["target_modules"]` and its other weights frozen (`FrozenWeight`; `quantize`: int8 /
    nf4 / int4) -> the same model, changed in place. `config`: PEFT's LoraConfig keys (r,
    lora_alpha, target_modules, lora_dropout, bias, modules_to_save, use_rslora, init_lora_weights,
    exclude_modules, fan_in_fan_out) plus `quantize`, `base_dtype`, `seed`. lora_A is drawn as
    PEFT's (Kaiming-uniform, bound 1/sqrt(fan in)), lora_B zero.

    device: with `quantize`, where each stacked kernel is quantized and its codes kept, one kernel
    moved there at a time: a base built on the host (`jax.default_device(jax.devices("cpu")[0])`)
    reaches an accelerator only quantized (Llama-3.1-8B: 15 GiB in bf16, 4.6 GiB as nf4)."""
    fam = family_of(model)
    if getattr(model, "adapter", None) is not None:
        raise ValueError("zerojax.lora.apply: this model already has LoRA adapters (merge() gives a plain model)")
    s = from_config_dict(dict(config), model)
    targets, savable = _targets(model, s), _savable(model, s)
    rngs = rngs or nnx.Rngs(s["seed"])
    L = _n_layer(model)
    base_dtype = jnp.dtype(s["base_dtype"]) if s["base_dtype"] else None

    # the base: every Param frozen (modules_to_save: trainable fp32 copies instead)
    keep = {id(getattr(model, fam.savable[k][0])) for k in savable}
    for _path, m in list(nnx.iter_graph(model)):
        if not isinstance(m, nnx.Module) or id(m) in keep:
            continue
        for name, v in list(vars(m).items()):
            if type(v) is nnx.Param:
                if id(v) in keep:
                    setattr(m, name, _var(nnx.Param, v[...].astype(jnp.float32), _names(v)))
                    continue
                value = v[...] if base_dtype is None else v[...].astype(base_dtype)
                setattr(m, name, _var(FrozenWeight, value, _names(v)))
    for k in savable:
        m = getattr(model, fam.savable[k][0])
        if isinstance(m, nnx.Module):
            for name, v in list(vars(m).items()):
                if isinstance(v, nnx.Variable):
                    setattr(m, name, _var(nnx.Param, v[...].astype(jnp.float32), _names(v)))

    for name, (path, n_in, lead) in fam.kernels.items():
        lin = _module(model, path)
        k = lin.kernel
        names, w = _names(k), k[...]
        shape = w.shape
        if s["quantize"] == "int8":
            codes, scale = quantize_int8(w, n_in, lead, device)
            del lin.kernel
            lin.kernel_int8 = _var(FrozenWeight, codes, names)
            # (its reduced input axes are 1 long: named None, never split)
            lin.kernel_scale = _var(FrozenWeight, scale, tuple(None if scale.shape[i] != shape[i] else n
                                                               for i, n in enumerate(names)))
        elif s["quantize"] in ("nf4", "int4"):
            codes, absmax = quantize_4bit(w, s["quantize"], device)
            del lin.kernel
            setattr(lin, f"kernel_{s['quantize']}", _var(FrozenWeight, codes, names))
            lin.kernel_absmax = _var(FrozenWeight, absmax, ("layers", None))
        if name not in targets:
            continue
        # [L, *lead (experts), *in, *out]: one adapter per expert, on its leading axes
        heads, ins, outs = shape[1:1 + lead], shape[1 + lead:1 + lead + n_in], shape[1 + lead + n_in:]
        fan_in, r = math.prod(ins), s["r"]
        bound = 1.0 / math.sqrt(fan_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) on [r, in]
        if s["init_lora_weights"] == "gaussian":
            a = jax.random.normal(rngs.params(), (L, *heads, *ins, r), jnp.float32) / r
        else:
            a = jax.random.uniform(rngs.params(), (L, *heads, *ins, r), jnp.float32, -bound, bound)
        b = (jax.random.uniform(rngs.params(), (L, *heads, r, *outs), jnp.float32, -bound, bound)
             if s["init_lora_weights"] is False else jnp.zeros((L, *heads, r, *outs), jnp.float32))
        lead_names = names[1:1 + lead]
        lin.lora_A = _var(nnx.Param, a, ("layers", *lead_names, *names[1 + lead:1 + lead + n_in], None))
        lin.lora_B = _var(nnx.Param, b, ("layers", *lead_names, None, *names[1 + lead + n_in:]))

    if s["lora_dropout"] > 0:
        model.lora_dropout = LoraDropout(float(s["lora_dropout"]), int(s["seed"]))
    scale = s["lora_alpha"] / (math.sqrt(s["r"]) if s["use_rslora"] else s["r"])
    settings = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in s.items()))
    model.adapter = LoraAdapter(scale=float(scale), targets=targets, savable=savable, quantize=s["quantize"],
                                settings=settings, family=fam.name)
    return model


def adapter_of(model) -> LoraAdapter:
    adapter = getattr(model, "adapter", None)
    if not isinstance(adapter, LoraAdapter):
        raise ValueError("this model has no LoRA adapters; zerojax.lora.apply(model, config) adds them")
    return adapter


@contextlib.contextmanager
def _adapter_replaced(model, name: str, **changes):
    """Within it, `model.adapter` has `changes` (a static attribute: usable inside a loss_fn on the
    engine's traced model), restored on exit. The trained copies of `modules_to_save` have no
    frozen copy to run instead: refused, naming the caller `name`."""
    ad = adapter_of(model)
    if ad.savable:
        raise ValueError(f"{name}: modules_to_save {list(ad.savable)} are trained whole, with no "
                         "frozen copy to run instead; leave modules_to_save out")
    model.adapter = dataclasses.replace(ad, **changes)
    try:
        yield model
    finally:
        model.adapter = ad


def adapters_disabled(model):
    """Within it, `model` (a LoRA model) runs as its frozen base: the same arrays, the LoRA terms
    left out (PEFT's `disable_adapter()`; e.g. the RL reference pass, `zerojax.rl.policy`)."""
    return _adapter_replaced(model, "adapters_disabled", enabled=False)


def adapters_zeroed(model):
    """Within it, `model` (a LoRA model) computes its frozen base's values through the policy's own
    program: the LoRA terms run, multiplied by 0 (no dropout). Why not `adapters_disabled`: a pass
    that reads no trained weight is not differentiated, and on a GPU an undifferentiated pass takes
    other kernels (cuDNN attention's inference forward, the flash kernel's primal, other matmul
    fusions) than the differentiated policy pass, so at step 0 (B = 0) a DPO reference scored the
    same rows differently from the policy. Zeroed terms keep a tangent flowing in, so both passes
    compile alike (`zerojax.methods.dpo`'s reference). Costs the adapters' two small products."""
    return _adapter_replaced(model, "adapters_zeroed", zeroed=True)


# --------------------------------------------------------------------------- PEFT's files


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model))


def _peft_name(fam: Family, targets, name: str, i: int) -> str:
    """PEFT's name of target `name`'s adapters in layer i, before ".lora_A.weight": the module's
    name; a parameter's (`target_parameters`) is its module's, with ".base_layer" once for each
    targeted parameter of the same module wrapped around it (PEFT nests their wrappers in the
    family's order, the first innermost)."""
    pre = f"{PEFT_PREFIX}{fam.prefix.format(i=i)}"
    if name not in fam.parameters:
        return pre + name
    module = name.rsplit(".", 1)[0]
    same = [n for n in fam.parameters if n in targets and n.rsplit(".", 1)[0] == module]
    return pre + module + ".base_layer" * (len(same) - 1 - same.index(name))


def _to_peft(a, b, lead: int):
    """One layer's lora_A [*lead, *in, r] / lora_B [*lead, r, *out] -> PEFT's lora_A [r, in] /
    lora_B [out, r] weights (nn.Linear's layout; PEFT's for Conv1D too); with an experts axis
    (lead 1), PEFT's parameter adapters: lora_A [E * r, in] (expert-major), lora_B [out, r * E]
    (rank-major)."""
    r = a.shape[-1]
    if not lead:
        return a.reshape(-1, r).T, b.reshape(r, -1).T
    E = a.shape[0]
    A = a.reshape(E, -1, r).transpose(0, 2, 1).reshape(E * r, -1)
    B = b.reshape(E, r, -1).transpose(2, 1, 0).reshape(-1, r * E)
    return A, B


def _from_peft(A, B, a_shape, b_shape, lead: int):
    """`_to_peft`'s inverse: PEFT's weights -> one layer's lora_A of a_shape, lora_B of b_shape."""
    if not lead:
        return A.T.reshape(a_shape), B.T.reshape(b_shape)
    E, r = a_shape[0], a_shape[-1]
    a = A.reshape(E, r, -1).transpose(0, 2, 1).reshape(a_shape)
    b = B.reshape(-1, r, E).transpose(2, 1, 0).reshape(b_shape)
    return a, b


def peft_tensors(model) -> dict[str, np.ndarray]:
    """PEFT's adapter_model tensors (name -> fp32 numpy) of a LoRA model."""
    ad = adapter_of(model)
    fam, tree = ad.family_parts, _pure(model)
    out = {}
    for name in ad.targets:
        e = tree[fam.stack]
        path, _, lead = fam.kernels[name]
        for k in path:
            e = e[k]
        a, b = np.asarray(e["lora_A"], np.float32), np.asarray(e["lora_B"], np.float32)
        for i in range(_n_layer(model)):
            pre = _peft_name(fam, ad.targets, name, i)
            A, B = _to_peft(a[i], b[i], lead)
            out[f"{pre}.lora_A.weight"] = np.ascontiguousarray(A)
            out[f"{pre}.lora_B.weight"] = np.ascontiguousarray(B)
    for k in ad.savable:
        attr, hf = fam.savable[k]
        out[PEFT_PREFIX + hf] = np.asarray(tree[attr], np.float32)[:model.config.vocab_size]
    return out


def _peft_target_names(ad) -> list[str]:
    """target_modules as PEFT matches them: each target's last name ("c_fc"), or its longer name
    ("attn.c_proj") where the last name would take an untargeted module too (PEFT matches by suffix)."""
    out = []
    for name in ad.targets:
        if name in ad.family_parts.parameters:  # written as target_parameters
            continue
        last = name.split(".")[-1]
        taken = [n for n in ad.family_parts.linears if n.split(".")[-1] == last]
        short = last if all(n in ad.targets for n in taken) else name
        if short not in out:
            out.append(short)
    return out


def save_peft(model, out_dir, *, base_model_name_or_path=None) -> str:
    """Write PEFT's adapter folder (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(hf_base, out_dir)` loads -> the safetensors path.

    base_model_name_or_path: the base model's folder or hub id, written as given (as PEFT writes
    what its user passed to from_pretrained); `peft.AutoPeftModelForCausalLM.from_pretrained(out_dir)`
    loads the base from it, so give a folder as an absolute path where the adapter is read from
    elsewhere. None (a base no one can load by name, e.g. randomly initialised): PEFT's loaders then
    need the base handed to them."""
    from safetensors.numpy import save_file

    ad = adapter_of(model)
    s = ad.config
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    base = None if base_model_name_or_path is None else os.fspath(base_model_name_or_path)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
              "inference_mode": True, "r": s["r"], "lora_alpha": s["lora_alpha"],
              "target_modules": _peft_target_names(ad), "exclude_modules": None,
              "lora_dropout": s["lora_dropout"], "bias": "none", "use_rslora": s["use_rslora"],
              "modules_to_save": list(ad.savable) or None, "init_lora_weights": True,
              "fan_in_fan_out": ad.family_parts.fan_in_fan_out,
              "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
              "use_dora": False, "lora_bias": False, "megatron_config": None, "megatron_core": "megatron.core",
              "loftq_config": {}, "layer_replication": None,
              "target_parameters": [n for n in ad.targets if n in ad.family_parts.parameters] or None,
              "trainable_token_indices": None}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    save_file(peft_tensors(model), path, metadata={"format": "pt"})
    return path


def _read_torch_tensors(path: str) -> dict:
    """A torch `.bin` of tensors (PEFT's older adapter_model.bin) as fp32 numpy arrays, read with
    weights_only=True whatever the torch version's default (it became True in torch 2.6): a pickle
    that would build anything but tensors, run code or create a file included, is refused unread."""
    import pickle

    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused: not a plain file of tensors (torch.load(weights_only=True): {why}); a .bin "
                         "is a pickle that may run code when read; give adapter_model.safetensors instead") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a {{name: tensor}} file of adapter weights; give adapter_model.safetensors")
    return {k: v.float().numpy() for k, v in state.items()}


def load_peft(model, adapter_dir, **extras):
    """`model` with the adapters of PEFT's folder `adapter_dir` (adapter_config.json +
    adapter_model.safetensors, or adapter_model.bin): a plain model gets `apply`'d with the
    folder's settings first (`extras`: quantize / base_dtype for its base) -> the model."""
    from safetensors.numpy import load_file

    adapter_dir = os.fspath(adapter_dir)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        saved = json.load(f)
    if saved.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {saved.get('peft_type')!r}; zerojax.lora reads LORA adapters")
    # checked whole, as PEFT's dict (a newer PEFT's key passes at its off value, a clear error
    # otherwise; how the adapters were initialised does not matter to trained weights), then its settings
    from_config_dict({"peft_type": "LORA", **saved, "init_lora_weights": True})
    config = {k: v for k, v in saved.items() if k in {**DEFAULTS, **FIXED, **LAYOUT}}
    if getattr(model, "adapter", None) is None:
        model = apply(model, {**config, **extras, "init_lora_weights": True})
    ad = adapter_of(model)
    fam = ad.family_parts
    st = os.path.join(adapter_dir, "adapter_model.safetensors")
    if os.path.exists(st):
        tensors = load_file(st)
    else:
        tensors = _read_torch_tensors(os.path.join(adapter_dir, "adapter_model.bin"))
    tensors = {re.sub(r"\.(lora_[AB])\.default\.", r".\1.", k): v for k, v in tensors.items()}
    L = _n_layer(model)
    used = set()
    for name in ad.targets:
        path, _, lead = fam.kernels[name]
        lin = _module(model, path)
        a_var, b_var = lin.lora_A, lin.lora_B
        a_rows, b_rows = [], []
        for i in range(L):
            pair = []
            for which, var in (("lora_A", a_var), ("lora_B", b_var)):
                key = f"{_peft_name(fam, ad.targets, name, i)}.{which}.weight"
                if key not in tensors:
                    raise ValueError(f"{adapter_dir}: no {key} (the adapter's target_modules / target_parameters "
                                     "and this model differ)")
                used.add(key)
                t = np.asarray(tensors[key], np.float32)
                if t.size != math.prod(var[...].shape[1:]):
                    raise ValueError(f"{key}: shape {t.shape} does not fit {var[...].shape[1:]}")
                pair.append(t)
            a, b = _from_peft(*pair, a_var[...].shape[1:], b_var[...].shape[1:], lead)
            a_rows.append(a)
            b_rows.append(b)
        a_var[...] = jnp.asarray(np.stack(a_rows), a_var[...].dtype)
        b_var[...] = jnp.asarray(np.stack(b_rows), b_var[...].dtype)
    for k in ad.savable:
        attr, hf = fam.savable[k]
        key = PEFT_PREFIX + hf
        if key not in tensors:
            raise ValueError(f"{adapter_dir}: no {key} for modules_to_save {k!r}")
        used.add(key)
        var = getattr(model, attr)
        have, t = var[...], np.asarray(tensors[key], np.float32)
        if t.shape[0] < have.shape[0]:
            t = np.concatenate([t, np.zeros((have.shape[0] - t.shape[0], *t.shape[1:]), t.dtype)])
        var[...] = jnp.asarray(t, have.dtype)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{adapter_dir}: tensors this model's adapters do not have: {extra[:6]}")
    return model


# --------------------------------------------------------------------------- merged export


def merge(model, dtype=None):
    """A plain model of the adapted one's class (`Llama`, `GPT2`; no adapters) with scale * B A
    folded into each targeted kernel and the base dequantized: what `zerojax.models.to_hf` writes.
    dtype: its parameters' (default: the model's param_dtype)."""
    ad = adapter_of(model)
    fam = ad.family_parts
    dtype = jnp.dtype(dtype or model.param_dtype)
    tree = _pure(model)
    make = lambda: fam.model(model.config, rngs=nnx.Rngs(0), dtype=model.dtype, param_dtype=dtype,  # noqa: E731
                             remat_policy=model.remat_policy, attention_impl=model.attention_impl,
                             scan_unroll=model.scan_unroll)
    with no_eager_sharding():
        graphdef, state = nnx.split(nnx.eval_shape(make))
    linears = {(fam.stack, *path): lead for path, _, lead in fam.kernels.values()}

    def fill(p, t, at=()):
        """p (the plain model's pure dict) filled from t (the adapted model's), in fp32: norms,
        biases and embeddings as stored, each projection's kernel dequantized + scale * B A."""
        for k in p:
            if (*at, k) in linears:
                entry = t[k]
                w = jax.vmap(lambda e: kernel_of(e, jnp.float32))(
                    {key: val for key, val in entry.items() if key.startswith("kernel")})
                if "lora_A" in entry:
                    w = w + ad.scale * _ab(entry["lora_A"], entry["lora_B"], linears[(*at, k)])
                p[k] = {**{key: jnp.asarray(entry[key], jnp.float32) for key in p[k] if key != "kernel"}, "kernel": w}
            elif isinstance(p[k], dict):
                fill(p[k], t[k], (*at, k))
            else:
                p[k] = jnp.asarray(t[k], jnp.float32)

    shaped = nnx.to_pure_dict(state)
    fill(shaped, tree)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x.astype(dtype), shaped))
    return nnx.merge(graphdef, state)


def _ab(a, b, lead: int = 0):
    """sum_r A[l, *lead, *in, r] B[l, *lead, r, *out] -> [l, *lead, *in, *out] in fp32 (lead: the
    experts axes, one product per expert)."""
    n, r = math.prod(a.shape[:1 + lead]), a.shape[-1]
    out = jnp.einsum("lir,lro->lio", a.reshape(n, -1, r).astype(jnp.float32),
                     b.reshape(n, r, -1).astype(jnp.float32), precision="highest")
    return out.reshape(*a.shape[:-1], *b.shape[2 + lead:])


def trainable_count(model) -> int:
    """The trained parameters' count (the adapters and modules_to_save copies)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["apply", "adapters_disabled", "adapters_zeroed", "save_peft", "load_peft", "merge", "from_config_dict",
           "FrozenWeight", "LoraAdapter",
           "quantize_int8", "quantize_4bit", "dequantize_4bit", "quantization_bound", "kernel_of",
           "peft_tensors", "trainable_count", "Family", "family_of", "family_named"]
