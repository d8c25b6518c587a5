"""A plan and the choices the planner searches, apart from the search (`zerojax.planning.planner`):
`Plan` (one configuration: stage, micro-batch, remat, offload, precision, MLP tile, with its
predicted speed and compiled peak), the candidates' dominance order (a choice that keeps at least
what a choice too big keeps is not compiled), the config patch a plan makes. Pure: no engine, no
compile; `zerojax.planning.planner` re-exports these names.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable

import jax.numpy as jnp

from zerojax.planning import estimate as est
from zerojax.planning.memory import fmt_bytes

AS_BUILT = "as built"  # remat of a model the planner cannot rebuild (a built engine's graph)


REMAT_CHOICES = (None, "full", "offload")  # DeepSpeed's activation_checkpointing can say these


DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


DEFAULT_OFFLOADS = ("none", "optimizer:0.5", "optimizer", "param")


MLP_TILE = 2048


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to run, with its compiled peak and predicted speed.

    remat: None (no activation checkpointing), "full", "offload" (block inputs kept in host
    memory), or AS_BUILT. precision: "bf16" | "fp16" | "fp32", None = as the config says.
    grad_accum: gradient_accumulation_steps (None = as the config says). step_s / tokens_per_s:
    predicted seconds per optimizer step and tokens per second per device. mlp_tile: positions
    per piece of the tiled MLP, None (untiled) or AS_BUILT (a model without `mlp_tile`); a
    model-build keyword, as remat is for the trainer, so not in `config_patch`.
    """

    stage: int
    micro_batch: int
    offload_optimizer: bool = False
    offload_param: bool = False
    remat: str | None = AS_BUILT
    peak_bytes: int | None = None
    host_bytes: int | None = None
    offload_ratio: float = 1.0  # offload_optimizer.ratio: the fraction offloaded (stage 3)
    precision: str | None = None
    grad_accum: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    mlp_tile: int | str | None = AS_BUILT

    def speed_key(self):
        """Smaller is faster: the predicted step time; without one (a plan built by hand), a
        fixed order: param offload, optimizer offload (by offloaded fraction), remat, a tiled MLP,
        then a larger micro-batch first, lower stage first."""
        # a tile reruns the MLP's forward, a part of what a remat policy reruns: after remat.
        # Ahead of the micro-batch: on the long rows a tile is tried on, a smaller micro-batch
        # costs the step-time model almost nothing (its efficiency term is saturated), while
        # the tile's recompute stays
        order = (self.offload_param, self.offload_ratio if self.offload_optimizer else 0.0,
                 self.remat not in (None, AS_BUILT), self.tiled, -self.micro_batch, self.stage)
        return (math.inf if self.step_s is None else self.step_s, *order)

    @property
    def tiled(self) -> bool:
        """Whether this plan runs a tiled MLP."""
        return is_tiled(self.mlp_tile)

    def config_patch(self) -> dict:
        """The DeepSpeed config keys this plan sets (merge with `apply`; None removes a section).
        The MLP tile is no DeepSpeed key: the model is built with it (`mlp_tile`)."""
        opt = {"device": "cpu" if self.offload_optimizer else "none"}
        if self.offload_optimizer and self.offload_ratio < 1.0:
            opt["ratio"] = self.offload_ratio
        zero = {"stage": self.stage, "offload_optimizer": opt}
        if self.stage == 3:
            zero["offload_param"] = {"device": "cpu" if self.offload_param else "none"}
        patch = {"train_micro_batch_size_per_gpu": self.micro_batch}
        if self.grad_accum is not None:
            patch["gradient_accumulation_steps"] = self.grad_accum
        patch["zero_optimization"] = zero
        if self.precision is not None:
            patch["bf16"] = {"enabled": self.precision == "bf16"}
            patch["fp16"] = {"enabled": self.precision == "fp16"}
        if self.remat != AS_BUILT:
            patch["activation_checkpointing"] = (
                None if self.remat is None else
                {"partition_activations": False, "cpu_checkpointing": self.remat == "offload"})
            if self.remat not in (None, "full", "offload"):  # zerojax's extension key: "dots", "dots_<k>", ...
                patch["activation_checkpointing"]["remat_policy"] = self.remat
        return patch

    def apply(self, cfg_dict: dict) -> dict:
        """`cfg_dict` with this plan's keys merged in (sections merged key by key, so a section's
        other keys, e.g. fp16.loss_scale_window or offload pin_memory, are kept)."""
        return merge_config(cfg_dict, self.config_patch())

    def describe(self) -> str:
        off = ("param+optimizer" if self.offload_param else
               "optimizer" if self.offload_optimizer else "none")
        if self.offload_optimizer and self.offload_ratio < 1.0:
            off += f" (ratio {self.offload_ratio:g})"
        parts = [] if self.precision is None else [self.precision]
        if self.remat != AS_BUILT:
            parts.append(f"remat {self.remat or 'none'}")
        if self.tiled:
            parts.append(f"MLP tile {self.mlp_tile}")
        mb = f"micro-batch {self.micro_batch}"
        if self.grad_accum is not None:
            mb += f" x {self.grad_accum} accumulation"
        parts += [mb, f"stage {self.stage}", f"offload {off}"]
        text = ", ".join(parts)
        if self.peak_bytes is not None:
            text += f": peak {fmt_bytes(self.peak_bytes)}"
        if self.tokens_per_s is not None:
            text += f", predicted {self.tokens_per_s:,.0f} tokens/s"
        if self.host_bytes and (self.offload_optimizer or self.offload_param):
            # host memory is the next wall after device memory: offer the NVMe tier (at most the
            # offloaded optimizer bytes go to disk, so host_bytes bounds the swap files)
            tip = est.nvme_suggestion(self.host_bytes, est.host_free_bytes(), disk_bytes=self.host_bytes)
            text += f" ({tip})" if tip else ""
        return text

    __str__ = describe

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "config_patch": self.config_patch(),
                "describe": self.describe()}


def is_tiled(mlp_tile) -> bool:
    """Whether `mlp_tile` (a Plan's) tiles the MLP: not None (untiled) nor AS_BUILT."""
    return mlp_tile not in (None, AS_BUILT)


def rank_plans(plans: Iterable[Plan]) -> list[Plan]:
    return sorted(plans, key=Plan.speed_key)


def merge_config(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(dict(base))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def offload_kind(offload: str) -> tuple[str, float]:
    """"none" | "optimizer" | "optimizer:R" | "param" -> (kind, offload_optimizer.ratio)."""
    kind, _, ratio = offload.partition(":")
    if kind not in ("none", "optimizer", "param") or (ratio and kind != "optimizer"):
        raise ValueError(f"offload choice {offload!r}: use none, optimizer, optimizer:RATIO or param")
    return kind, float(ratio) if ratio else 1.0


def zero_choice(cfg_dict, stage, kind, ratio):
    """cfg_dict with zero_optimization set to `stage` and the offload choice (other keys of the
    offload sections, e.g. pin_memory, kept)."""
    cfg = copy.deepcopy(dict(cfg_dict))
    zero = cfg["zero_optimization"] = dict(cfg.get("zero_optimization") or {}, stage=stage)
    for section, on in (("offload_optimizer", kind in ("optimizer", "param")),
                        ("offload_param", kind == "param")):
        if on:
            zero[section] = dict(zero.get(section) or {}, device="cpu")
        elif section in zero:
            zero[section] = dict(zero[section] or {}, device="none")
    if "offload_optimizer" in zero:
        zero["offload_optimizer"]["ratio"] = ratio
    return cfg


def valid_stage(kind, ratio, stage):
    if kind == "param" or ratio < 1.0:
        return stage == 3  # DeepSpeed: offload_param and offload_optimizer.ratio are ZeRO-3's
    return kind == "none" or stage >= 1  # DeepSpeed offloads the optimizer only under ZeRO


@dataclasses.dataclass(frozen=True)
class Candidate:
    precision: str | None
    remat: str | None
    micro_batch: int
    grad_accum: int
    stage: int
    kind: str
    ratio: float
    mlp_tile: int | str | None = AS_BUILT

    def plan(self, **kw) -> Plan:
        return Plan(self.stage, self.micro_batch, self.kind != "none", self.kind == "param",
                    self.remat, offload_ratio=self.ratio, precision=self.precision,
                    grad_accum=self.grad_accum, mlp_tile=self.mlp_tile, **kw)

    def holds_at_least(self, other: Candidate) -> bool:
        """True when this choice keeps at least as much on the device as `other` in every
        dimension (same precision; micro-batch, remat, MLP tile, offload and stage no leaner)."""
        return (self.precision == other.precision and self.micro_batch >= other.micro_batch
                and remat_keeps_at_least(self.remat, other.remat)
                and tile_keeps_at_least(self.mlp_tile, other.mlp_tile)
                and offload_rank(self) >= offload_rank(other) and self.stage <= other.stage)


def tile_keeps_at_least(a, b) -> bool:
    """Whether MLP tiling `a` holds at least the MLP activations tiling `b` holds: untiled (None)
    holds the whole row's, a tile one piece's, a larger piece more. AS_BUILT compares only to itself."""
    if a == b or a is None:
        return True
    if b is None or AS_BUILT in (a, b):
        return False
    return a >= b


_REMAT_INCLUDES = {"full": {"offload"}, "save_attention": {"full"}, "save_qkv": {"full"},
                   "save_qkv_attention": {"save_attention", "save_qkv"}, "dots": {"save_qkv"},
                   "save_attention_block": {"save_qkv_attention"}}


def remat_keeps_at_least(a, b) -> bool:
    """Whether remat policy `a` keeps on the device everything policy `b` keeps (a partial order:
    False where neither includes the other, e.g. "dots" and "save_attention"). None (no remat)
    keeps everything; "dots_<k>" includes "full" and "dots_<j>" for j <= k, "dots" includes it.
    The planner skips compiling a candidate that keeps at least as much as one already too big."""
    if a == b or a is None:
        return True
    if b is None or AS_BUILT in (a, b):
        return False
    ka, kb = est.partial_dots_layers(a), est.partial_dots_layers(b)
    if ka is not None or kb is not None:
        if ka is not None and kb is not None:
            return ka >= kb
        if kb is not None:  # a is a named policy
            return a == "dots"
        return remat_keeps_at_least("full", b)  # dots_<k> keeps what "full" keeps
    seen, todo = set(), [a]
    while todo:
        x = todo.pop()
        if x == b:
            return True
        if x not in seen:
            seen.add(x)
            todo += _REMAT_INCLUDES.get(x, ())
    return False


def offload_rank(c) -> float:
    return {"param": 0.0, "optimizer": 2.0 - c.ratio, "none": 3.0}[c.kind]


@dataclasses.dataclass
class Search:
    """What a planning run tried: `plans` (fitting, fastest first) and `tried`: (plan, outcome)
    in the order tried, outcome "fits", "does not fit", "pruned: ..." or "failed: ..."."""

    plans: list
    tried: list
    budget: int

    def explain(self, chosen: Plan | None = None) -> str:
        """One or two lines: what was chosen and why."""
        chosen = chosen or (self.plans[0] if self.plans else None)
        if chosen is None:
            return f"nothing fits {fmt_bytes(self.budget)} per device"
        text = (f"{chosen.describe()} -- the fastest predicted of the choices whose compiled step "
                f"fits {fmt_bytes(self.budget)}")
        faster = [(p, outcome) for p, outcome in self.tried if outcome != "fits" and p.step_s is not None
                  and p.step_s < (chosen.step_s or math.inf)]
        if faster:
            p, outcome = faster[0]
            why = ("over the budget" if p.peak_bytes is None else outcome.removeprefix("does not fit ")
                   if "host memory" in outcome else f"peak {fmt_bytes(p.peak_bytes)}")
            text += f"\n  (faster but too big: {p.describe().split(':')[0]}, {why})"
        return text


__all__ = ["AS_BUILT", "REMAT_CHOICES", "DTYPES", "DEFAULT_OFFLOADS", "MLP_TILE", "Plan", "is_tiled", "rank_plans",
           "merge_config", "offload_kind", "zero_choice", "valid_stage", "Candidate", "tile_keeps_at_least",
           "remat_keeps_at_least", "offload_rank", "Search"]
