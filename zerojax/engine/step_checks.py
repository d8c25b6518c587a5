"""What the engine reads of each step's flags, one step behind, and the errors that stop a run.

Kept off the device: the step computes `nonfinite`, `skipped` and (fp16) `overflow_at_min` anyway;
the host reads them after dispatching the next step. A check of the weights every step cost 2% of
Llama-3.2-1B's step on an H200 (benchmarks/RESULTS.md), so the weights are read only on the way to an
error: a non-finite weight shows in the next step's loss, and a save checks the whole state
(`zerojax.checkpoint.finite`).
"""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from zerojax.checkpoint.finite import first_nonfinite
from zerojax.precision import MIN_SCALE_ERROR

# fp16 with a static loss scale: this many overflow-skipped steps in a row stop the run (the scale
# never lowers, so every later step would be skipped too, without a word)
STATIC_SCALE_PATIENCE = 10


class StepChecks:
    """check(step, metrics): FloatingPointError where step `step` ends the run. `params()` gives the
    weights the next step reads (on the error path only); `static_scale`: fp16.loss_scale (0: dynamic)."""

    def __init__(self, compute_dtype, fp16: bool, static_scale: float, params: Callable):
        self.dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(jnp.dtype(compute_dtype).name, "fp32")
        self.fp16, self.static_scale, self.params = fp16, float(static_scale or 0), params
        self.overflow_run = 0     # fp16: consecutive overflow-skipped steps
        self.last = None          # (step, metrics) of the last step whose flags were read

    def reset(self) -> None:
        """A checkpoint was loaded: the steps read before belong to another state."""
        self.last = None

    def check(self, step: int, metrics: dict) -> None:
        self._check(step, metrics)
        self.last = (step, metrics)

    def _check(self, step: int, metrics: dict) -> None:
        if self.fp16:
            if bool(metrics["overflow_at_min"]):
                self.raise_if_weights_nonfinite(step)
                raise FloatingPointError(f"step {step}: {MIN_SCALE_ERROR}")
            skipped = bool(metrics["skipped"])
            self.overflow_run = self.overflow_run + 1 if skipped else 0
            if self.static_scale > 0 and self.overflow_run >= STATIC_SCALE_PATIENCE:
                self.raise_if_weights_nonfinite(step)
                raise FloatingPointError(
                    f"step {step}: fp16 with the static loss scale {self.static_scale:g} (fp16.loss_scale): the last "
                    f"{self.overflow_run} steps all overflowed and were skipped, so the weights have not changed "
                    f"since step {step - self.overflow_run}; lower fp16.loss_scale, or set it to 0 for the "
                    f"dynamic scale, or train in bf16")
            if not bool(metrics["nonfinite"]) or skipped:  # an overflow the loss scale handled
                return
        if bool(metrics["nonfinite"]):
            self.raise_if_weights_nonfinite(step)
            raise FloatingPointError(
                f"step {step}: the loss or gradients are not finite (loss={float(metrics['loss'])}, "
                f"grad_norm={float(metrics['grad_norm'])}) under {self.dtype}; the update was skipped, so "
                f"the weights are those after step {step - 1}. Usual causes: the learning rate is too "
                f"high (lr={float(metrics['lr']):g}; add warmup or lower it), no gradient_clipping, "
                f"inf/NaN in the batch, or values beyond the compute dtype's range (fp16 tops out at "
                f"65504: prefer bf16)")

    def raise_if_weights_nonfinite(self, step: int) -> None:
        """Step `step`'s loss was not finite: where the weights it read already were (an update made them
        so from a finite loss and gradients: an lr beyond fp32's range, Adam's eps 0), the true cause,
        the step before's: its number, the first non-finite leaf, its loss, gradient norm, lr and scale."""
        leaf = first_nonfinite(self.params())  # a skipped step left them as the step read them
        if leaf is None:
            return
        at, before = self.last if self.last else (step - 1, None)
        said = "" if before is None else (
            f" from a finite loss ({float(before['loss']):.4g}) and gradient norm ({float(before['grad_norm']):.4g}) "
            f"at lr={float(before['lr']):g}, loss scale {float(before['loss_scale']):g}")
        raise FloatingPointError(
            f"step {at}: the update made the weights non-finite ({leaf} first){said}, so step {step}'s loss is not "
            f"finite. Usual causes: a learning rate beyond float32's range or far too high, Adam's eps 0 (0/0 where "
            f"a gradient is 0). Non-finite weights are never checkpointed")


__all__ = ["StepChecks", "STATIC_SCALE_PATIENCE"]
