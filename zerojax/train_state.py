"""`TrainState`: the engine's state as a pytree (params, master, optimizer state, counters).

A leaf module: the step (zerojax/engine/step.py) computes on it, and checkpoints
(zerojax/checkpoint/) save and restore it, without either importing the other.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax


class TrainState(NamedTuple):
    """Everything that changes during training; all leaves are jax arrays (pure dicts for params).

    params:   compute-dtype weights (bf16 / fp16 / fp32) in the stage's param sharding.
    master:   fp32 master weights in the optimizer sharding, or None when the compute dtype is
              fp32: then `params` is the master (one copy; a stage 1-2 update slices it locally).
    opt_state: the optax state in the optimizer sharding (fp16: the loss-scale wrapper's state,
              `opt_state.loss_scale`, around the optimizer's).
    rest:     the model's non-Param state (rng counters, batch statistics), replicated.
    step:     int32, optimizer steps taken, applied + skipped (DeepSpeed's global_steps).
    skipped_steps: int32, steps skipped for fp16 overflow or a non-finite loss.
    global_samples: int32, training samples consumed.
    grad_accumulator: offload_param with gradient accumulation: the fp32 (accum dtype) gradient
              sum in host memory, params-shaped, overwritten by each step's first micro-batch
              (`offload.accumulate_chunks`); scratch donated every step, never checkpointed. Else None.
    """

    params: Any
    master: Any
    opt_state: Any
    rest: Any
    step: jax.Array
    skipped_steps: jax.Array
    global_samples: jax.Array
    grad_accumulator: Any = None
