"""Per-token log-probs of rollouts on an engine's live weights: the policy that generated them
(the "old" policy of a clipped ratio) and the reference of the KL term.

The programs merge the model inside the trace from `engine.state.params` / `state.rest` as the
engine's step and `zerojax.generate` do (`decoder.EngineSource`: ZeRO-3's gather on use, tensor
splits, offloaded layers fetched): no copy, no re-partition. The reference:

- "adapters_off": a LoRA model's frozen base, the same arrays with the LoRA terms left out
  (`lora.adapters_disabled`), as DPO's reference;
- "copy": a copy of the weights as they were when the policy was made (full fine-tuning; one more
  compute-dtype copy of the parameters, in their sharding);
- "none": no reference (kl_coef 0).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.scoring.logprobs import completion_logps

REFERENCES = ("auto", "adapters_off", "copy", "none")


def is_lora(engine) -> bool:
    """Whether the engine's model is a LoRA model (its adapters can be switched off)."""
    s = engine.step_settings
    return getattr(nnx.merge(s.graphdef, s.param_template, s.rest_template), "adapter", None) is not None


def pick_reference(engine, reference: str, kl_coef: float) -> str:
    """"auto" -> "none" without a KL term, "adapters_off" for LoRA, else "copy"."""
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r}; choose one of {REFERENCES}")
    if reference == "auto":
        return "none" if not kl_coef else "adapters_off" if is_lora(engine) else "copy"
    if reference == "adapters_off" and not is_lora(engine):
        raise ValueError("reference=\"adapters_off\" is a LoRA model's frozen base: apply LoRA (zerojax.lora.apply), "
                         "or give reference=\"copy\" (a frozen copy of the starting weights)")
    if reference == "none" and kl_coef:
        raise ValueError(f"kl_coef={kl_coef} needs a reference model: reference=\"auto\", \"adapters_off\" or \"copy\"")
    return reference


class EnginePolicy:
    """`logps(batch)` / `ref_logps(batch)` -> fp32 numpy [B, C] (`completion_logps` on the
    engine's current weights, or a `snapshot` of earlier ones / on the reference; group: rows in
    groups sharing a prompt, each prompt run once per group)."""

    def __init__(self, engine, *, temperature: float = 1.0, reference: str = "none", group: int | None = None):
        from zerojax.generation.decoder import EngineSource
        from zerojax.sharding import partition

        self.engine, self.reference = engine, reference
        self._rows = NamedSharding(engine.mesh, P(partition.data_axes(engine.mesh)))
        source = EngineSource(engine.step_settings)
        self._run = jax.jit(functools.partial(_logps, source, temperature, group, False))
        self._run_ref = jax.jit(functools.partial(_logps, source, temperature, group, reference == "adapters_off"))
        self._frozen = self.snapshot() if reference == "copy" else None  # the starting weights

    @property
    def frozen(self):
        """The "copy" reference's weights (a copy of the starting ones), else None."""
        return self._frozen

    def logps_memory(self, batch):
        """The log-prob pass over rows shaped as `batch`'s, compiled from shapes on the live
        weights (nothing run) -> its `CompiledMemory` (the rollout planner's figure)."""
        from zerojax.engine.memory import CompiledMemory, quiet_xla

        weights = (self.engine.state.params, self.engine.state.rest)
        shapes = {k: jax.ShapeDtypeStruct(np.shape(batch[k]), np.asarray(batch[k]).dtype, sharding=self._rows)
                  for k in ("input_ids", "prompt_lengths", "completion_mask")}
        with quiet_xla():
            return CompiledMemory.of(self._run.lower(weights, shapes).compile())

    def _place(self, batch):
        keys = ("input_ids", "prompt_lengths", "completion_mask")
        return {k: jax.device_put(np.asarray(batch[k]), self._rows) for k in keys}

    def snapshot(self):
        """A copy of the engine's (params, rest) as they are now, where they live (one more
        compute-dtype copy of the weights): the engine's next step donates the live arrays."""
        self.engine.synchronize()
        return copy_weights((self.engine.state.params, self.engine.state.rest))

    def _weights(self, weights):
        """The given weights (a snapshot: nothing of the engine's to wait for), else the live ones."""
        if weights is not None:
            return weights
        self.engine.synchronize()
        return self.engine.state.params, self.engine.state.rest

    def logps(self, batch, weights=None) -> np.ndarray:
        """On `weights` ((params, rest) as `snapshot` gives them) where given, else the live weights."""
        return np.asarray(self._run(self._weights(weights), self._place(batch)), np.float32)

    def ref_logps(self, batch, weights=None) -> np.ndarray:
        """weights: as `logps`' (read by "adapters_off" only: the frozen base is in them)."""
        if self.reference == "none":
            raise ValueError("this policy has no reference (reference=\"none\")")
        if self._frozen is not None:
            weights = self._frozen
        elif weights is None:
            weights = (self.engine.state.params, self.engine.state.rest)
        return np.asarray(self._run_ref(weights, self._place(batch)), np.float32)


def copy_weights(weights):
    """A copy of a tree of arrays in their shardings and memory kinds (not aliased: a later step that
    donates the originals leaves it intact)."""
    return jax.jit(lambda w: w, out_shardings=jax.tree.map(lambda x: x.sharding, weights))(weights)


def _logps(source, temperature, group, adapters_off, weights, batch):
    from zerojax import lora

    model = source.model(weights)
    with lora.adapters_disabled(model) if adapters_off else contextlib.nullcontext():
        return completion_logps(model, batch, temperature=temperature, group=group)


__all__ = ["EnginePolicy", "pick_reference", "is_lora", "copy_weights", "REFERENCES"]
