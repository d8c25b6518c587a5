"""Hugging Face mixture-of-experts folders in and out: Qwen3-MoE (`qwen3_moe`) and Mixtral.

The attention, norms and embeddings are the Llama family's tensors (`hf_llama.layer_entries`); the
sparse block is HF's per-expert layout, as transformers 5's `save_pretrained` writes it (its
conversion mapping reverts the fused [E, 2m, d] `gate_up_proj` to one tensor per expert on save,
and merges them back on load):

  qwen3_moe: mlp.gate.weight [E, d], mlp.experts.{e}.gate_proj / up_proj / down_proj.weight
  mixtral:   block_sparse_moe.gate.weight [E, d], block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) /
             w2 (down).weight

each [out, in], ours their transposes stacked on the experts axis: gate and up fused as
[E, d, 2, m] (transformers 5's `gate_up_proj` order), down [E, m, d]. Qwen3-MoE's
config.json names the expert width `moe_intermediate_size` (its `intermediate_size` is the width
of dense layers, which a config with every layer sparse has none of).

The mixture-of-experts family's record (`zerojax.models.registry`) is registered here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flax import nnx

from zerojax.models import hf_llama, registry
from zerojax.models.hf import module_from_leaves, read_config_json, storage_dtype
from zerojax.models.llama import LlamaConfig
from zerojax.models.moe import (
    MOE_MODEL_TYPES,
    MoEConfig,
    MoELlama,
    chunked_moe_loss,
    moe_flops_per_token,
    moe_loss,
    moe_num_params,
)
from zerojax.models.pieces import MoEPieces

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# the dense Llama-family type whose attention each one has, and its names for the sparse block
_BASE = {"qwen3_moe": "qwen3", "mixtral": "mistral"}
_BLOCK = {"qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
          "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
# transformers' own defaults for keys a config.json may leave out (Qwen3MoeConfig, MixtralConfig)
_DEFAULTS = {
    "qwen3_moe": dict(num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=32768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=False, router_aux_loss_coef=0.001, rope_theta=10000.0),
    "mixtral": dict(num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, num_experts=8,
                    num_experts_per_tok=2, router_aux_loss_coef=0.001, rope_theta=1e6),
}


def config_from_hf(hf: Mapping, **overrides) -> MoEConfig:
    """MoEConfig from a config.json dict; refuses what the model does not run, naming the key."""
    kind = hf.get("model_type")
    if kind not in MOE_MODEL_TYPES:
        raise ValueError(f"config.json model_type={kind!r}: the mixture-of-experts family reads {MOE_MODEL_TYPES}")
    defaults = _DEFAULTS[kind]
    get = lambda key: hf.get(key, defaults.get(key))  # noqa: E731
    experts = hf.get("num_experts", hf.get("num_local_experts", defaults["num_experts"]))
    problems = []
    if kind == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            problems.append(f"decoder_sparse_step={hf.get('decoder_sparse_step', 1)} / mlp_only_layers="
                            f"{hf.get('mlp_only_layers')} (dense layers among sparse ones: every layer must be "
                            "sparse, decoder_sparse_step 1 and mlp_only_layers [])")
        width = hf.get("moe_intermediate_size", 768)
    else:
        width = hf["intermediate_size"]
    if hf.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time router noise: set it to 0)")
    if hf.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size (a shared expert)")
    if not experts:
        problems.append(f"num_experts={experts} (no experts: read it as a dense model)")
    if problems:
        raise ValueError(f"config.json ({kind}): not supported: " + "; ".join(problems))
    base = {**hf, "model_type": _BASE[kind], "intermediate_size": width, "head_dim": hf.get("head_dim"),
            "sliding_window": hf.get("sliding_window"), "num_key_value_heads": get("num_key_value_heads"),
            "rms_norm_eps": get("rms_norm_eps"), "max_position_embeddings": get("max_position_embeddings")}
    if "rope_theta" not in hf and "rope_parameters" not in hf and "rope_scaling" not in hf:
        base["rope_theta"] = defaults["rope_theta"]
    dense = hf_llama.config_from_hf(base)
    fields = {**dataclasses.asdict(dense), "model_type": kind, "num_experts": experts,
              "num_experts_per_tok": get("num_experts_per_tok"),
              "norm_topk_prob": bool(get("norm_topk_prob")) if kind == "qwen3_moe" else True,
              "router_aux_loss_coef": float(get("router_aux_loss_coef")),
              "router_z_loss_coef": float(hf.get("router_z_loss_coef", 0.0))}
    return MoEConfig(**{**fields, **overrides})


def config_to_hf(config: MoEConfig, dtype: str = "float32") -> dict:
    """config.json for `config`: the dense base type's keys (`hf_llama.config_to_hf`) and the experts'."""
    kind = config.model_type
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(LlamaConfig)}
    out = hf_llama.config_to_hf(LlamaConfig(**{**fields, "model_type": _BASE[kind]}), dtype)
    out.update(architectures=[ARCHITECTURES[kind]], model_type=kind, num_experts_per_tok=config.num_experts_per_tok,
               router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
    if config.router_z_loss_coef:
        out["router_z_loss_coef"] = config.router_z_loss_coef
    if kind == "qwen3_moe":
        out.pop("max_window_layers", None)
        out.update(num_experts=config.num_experts, moe_intermediate_size=config.intermediate_size,
                   norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        if not config.norm_topk_prob:
            raise ValueError("mixtral always renormalises its top-k weights: norm_topk_prob=True")
        out.update(num_local_experts=config.num_experts, router_jitter_noise=0.0)
    return out


def moe_layer_entries(config: MoEConfig):
    """`hf_llama.layer_entries` rows for a sparse layer: the attention's, the router's and the
    experts' (one HF tensor per expert: "{e}")."""
    d, m, E = config.hidden_size, config.intermediate_size, config.num_experts
    block, names = _BLOCK[config.model_type]
    out = hf_llama.layer_entries(config, mlp=False)
    out.append((f"{block}.gate.weight", ("mlp", "router", "kernel"), (d, E), lambda a: a.T, lambda a: a.T))
    experts = f"{block}.experts.{{e}}."
    out.append(((experts + names["gate_proj"] + ".weight", experts + names["up_proj"] + ".weight"),
                ("mlp", "gate_up_proj", "kernel"), (E, d, 2, m), lambda a: a.T, lambda a: a.T))
    out.append((experts + names["down_proj"] + ".weight", ("mlp", "down_proj", "kernel"), (E, m, d),
                lambda a: a.T, lambda a: a.T))
    return out


def load_moe_hf(path: str, dtype=None, **config_overrides) -> tuple[MoEConfig, dict]:
    """(MoEConfig, params pure dict of numpy arrays) of a Hugging Face folder."""
    config, leaves = hf_llama.read_leaves(path, dtype, config_from=config_from_hf, entries=moe_layer_entries,
                                          **config_overrides)
    params: dict = {}
    for ours, a in leaves:
        node = params
        for key in ours[:-1]:
            node = node.setdefault(key, {})
        node[ours[-1]] = a
    return config, params


def save_moe_hf(params, config: MoEConfig, out_dir: str, dtype=None, **kwargs) -> str:
    """Write a Hugging Face folder that `<Family>ForCausalLM.from_pretrained` loads (`save_llama_hf`'s
    keywords) -> the weights path."""
    return hf_llama.save_llama_hf(params, config, out_dir, dtype, entries=moe_layer_entries,
                                  config_json=config_to_hf, **kwargs)


def config_from_record(record: Mapping) -> MoEConfig:
    """The MoEConfig of a checkpoint's `checkpoint_record()` (JSON lists back to tuples)."""
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    return MoEConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in record["config"].items()
                        if k in fields})


def read_moe(path: str, dtype=None, **model_kwargs) -> MoELlama:
    """The family's reader (`from_hf` for qwen3_moe and mixtral)."""
    param_dtype = storage_dtype(dtype)
    config, leaves = hf_llama.read_leaves(path, config_from=config_from_hf, entries=moe_layer_entries)
    make = lambda: MoELlama(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, **model_kwargs)  # noqa: E731
    return module_from_leaves(make, leaves, param_dtype)


_NOT_SHAPE = ("initializer_range", "bos_token_id", "eos_token_id", "router_aux_loss_coef", "router_z_loss_coef")

registry.register(registry.ModelFamily(
    name="moe", label="the mixture-of-experts family", config_class=MoEConfig, model_class=MoELlama,
    shapes={s: s for s in ("qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "tiny-qwen3-moe",
                           "tiny-mixtral")},
    loss=moe_loss, chunked_loss=chunked_moe_loss, hf_model_types=MOE_MODEL_TYPES, from_hf=read_moe,
    writer=save_moe_hf, config_from_record=config_from_record,
    hf_config=lambda path: config_from_hf(read_config_json(path)),
    shape_keys=tuple(f.name for f in dataclasses.fields(MoEConfig) if f.name not in _NOT_SHAPE),
    counts=lambda config, seq_len: (moe_flops_per_token(config, seq_len), moe_num_params(config)),
    # PEFT's names as transformers 5 builds these models (Mixtral's block_sparse_moe renamed mlp on
    # load): experts are 3-D parameters, adapted through PEFT's target_parameters (one lora_A
    # [r * E, in] and lora_B [out, r * E] per parameter), gate and up as one fused gate_up_proj
    peft=registry.PeftTargets(
        stack="layers", prefix="model.layers.{i}.",
        linears={"self_attn.q_proj": (("self_attn", "q_proj"), 1), "self_attn.k_proj": (("self_attn", "k_proj"), 1),
                 "self_attn.v_proj": (("self_attn", "v_proj"), 1), "self_attn.o_proj": (("self_attn", "o_proj"), 2)},
        savable={"embed_tokens": ("embed_tokens", "model.embed_tokens.weight"),
                 "lm_head": ("lm_head", "lm_head.weight")},
        parameters={"mlp.experts.gate_up_proj": (("mlp", "gate_up_proj"), 1, 1),
                    "mlp.experts.down_proj": (("mlp", "down_proj"), 1, 1)}),
    label_of=lambda shape, config: f"{shape} ({config.model_type})",
    pieces=MoEPieces))
