"""Pipeline parallelism: the stacked layers split into stages over the "pipe" mesh axis, inside
the one jitted step (GPipe, after MaxText's `layers/pipeline.py`).

A model whose layers run as one stacked scan (`zerojax.models.gpt2.GPT2`: `layer_scan` hook) is
handed `pipeline_scan(...)` as that scan. It splits the step's batch of hidden states into the
gradient_accumulation_steps micro-batches and runs the schedule below; the embeddings, the final
norm, the head and the loss stay outside, computed once on the whole batch. So the loss_fn is
called once per step on all micro-batches: a loss that is a mean over tokens equals DeepSpeed's
mean of micro-batch means whenever the micro-batches count the same tokens (no -100 labels).

Schedule, S stages, M micro-batches, R circular repeats, L layers: the layer stack [L, ...] is
viewed as [R, S, L / (S R), ...], stage s holding the blocks (r, s) -- contiguous blocks, so with
R = 1 each device keeps exactly its storage shard of the stack. A buffer [S, micro-batch, ...]
sharded over "pipe" holds each stage's input; every iteration all stages run their block at once
(one vmapped scan), then the buffer rolls by one stage (`jnp.roll` over the "pipe"-sharded axis,
which XLA lowers to a collective-permute) and stage 0 takes the next micro-batch, or, with R > 1,
the last stage's output of the previous repeat from a FIFO of M - S + 1 buffers. M R + S - 1
iterations; each stage idles S - 1 of them: the bubble fraction (S - 1) / (M R + S - 1).

Per-iteration remat: each iteration is a `jax.checkpoint` saving only its carry, so the backward
pass keeps one stage input per iteration and recomputes the stage's layers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax.accumulate import split_microbatches
from zerojax.partition import DATA, PIPE


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """The static shape of one pipelined step."""

    stages: int         # pipeline.stages: size of the mesh's "pipe" axis
    microbatches: int   # gradient_accumulation_steps
    repeats: int = 1    # circular repeats (EngineOptions.pipeline_repeats)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of the stage-iterations that compute nothing useful: (S - 1) / (M R + S - 1)."""
        return (self.stages - 1) / self.iterations


def schedule_problems(layers: int, stages: int, microbatches: int, repeats: int) -> list[str]:
    """Why (layers, stages, micro-batches, repeats) cannot be pipelined; [] if they can."""
    problems = []
    if layers % (stages * repeats):
        fits = [s for s in range(2, layers + 1) if layers % (s * repeats) == 0]
        problems.append(
            f"pipeline.stages={stages} x pipeline_repeats={repeats} does not divide the model's "
            f"{layers} stacked layers; stage counts that would work with {repeats} repeat(s): {fits or 'none'}")
    if repeats > 1 and microbatches < stages:
        problems.append(
            f"circular repeats (pipeline_repeats={repeats}) need gradient_accumulation_steps >= "
            f"pipeline.stages, got {microbatches} < {stages}: raise the micro-batch count or use repeats=1")
    return problems


def _merge_microbatches(x, n: int):
    """The inverse of `accumulate.split_microbatches`: [M, n * mb, ...] -> [n * M * mb, ...]."""
    m, rows = x.shape[:2]
    return x.reshape(m, n, rows // n, *x.shape[2:]).swapaxes(0, 1).reshape(m * rows, *x.shape[2:])


def _blocks_at(blocks, rep):
    """Each stage's block of repeat rep[s]: [R, S, per, ...] -> [S, per, ...]. A select per
    repeat rather than a gather, so that every stage reads only its own shard."""
    def pick(a):
        mask = lambda r: (rep == r).reshape(-1, *([1] * (a.ndim - 2)))  # noqa: E731
        out = a[0]
        for r in range(1, a.shape[0]):
            out = jnp.where(mask(r), a[r], out)
        return out

    return jax.tree.map(pick, blocks)


def pipeline_scan(schedule: PipelineSchedule, mesh: Mesh):
    """The model's `layer_scan(body, x, layers, fetch, inputs_to_host=False)` for `schedule`:
    `body(h, layer_params) -> h` on [rows, ...] hidden states, `x` [batch, ...] sharded over
    "data", `layers` the stacked [L, ...] parameters sharded over "pipe"."""
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    n = int(mesh.shape.get(DATA, 1))

    def constrain(tree, *spec):
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, P(*spec[: a.ndim]))), tree)

    def constrain_weights(tree, *spec):
        # the dims after `spec` keep the sharding they have (the "tensor" axis of Megatron's splits,
        # ZeRO-3's "data"): a None there would all-gather every stage's weights
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, P(*spec, *([P.UNCONSTRAINED] * (a.ndim - len(spec)))))), tree)

    def layer_scan(body, x, layers, fetch=None, inputs_to_host=False):
        if fetch is not None or inputs_to_host:
            raise ValueError("pipeline: a per-layer fetch or host-offloaded layer inputs do not "
                             "combine with pipeline stages (zero_optimization.offload_* is refused with "
                             "pipeline.stages > 1)")
        num = jax.tree.leaves(layers)[0].shape[0]
        problems = schedule_problems(num, S, M, R)
        if problems:
            raise ValueError("; ".join(problems))
        per = num // (S * R)
        # [L, ...] -> [R, S, per, ...]: stage s holds blocks (r, s); R = 1 is the storage shard
        blocks = constrain_weights(jax.tree.map(lambda a: a.reshape(R, S, per, *a.shape[1:]), layers), None, PIPE)
        xs = split_microbatches(x, M, mesh)                # [M, n * mb, ...], rows over "data"
        stage_ids = jnp.arange(S)
        first_stage = (stage_ids == 0).reshape(S, *([1] * (x.ndim)))

        def run_stage(h, weights):                         # one stage: its `per` layers in turn
            return jax.lax.scan(lambda h, p: (body(h, p), None), h, weights)[0]

        run_stages = jax.vmap(run_stage)

        def iteration(carry, t):
            buf, fifo = carry
            weights = _blocks_at(blocks, jnp.clip((t - stage_ids) // M, 0, R - 1))
            out = constrain(run_stages(buf, constrain_weights(weights, PIPE)), PIPE, DATA)
            # stage s + 1 takes stage s's output: a collective-permute over "pipe"
            rolled = constrain(jnp.roll(out, 1, axis=0), PIPE, DATA)
            fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t + 1, M - 1), keepdims=False)[None]
            if R > 1:
                # rolled[0] is the last stage's output; stage 0 needs it M - S + 1 iterations later
                fifo = jnp.concatenate([fifo[1:], rolled[None]])
                head = jnp.where(t + 1 < M, fresh, fifo[0])
            else:
                head = fresh
            buf = constrain(jnp.where(first_stage, head, rolled), PIPE, DATA)
            return (buf, fifo), rolled

        iteration = jax.checkpoint(iteration, policy=jax.checkpoint_policies.nothing_saveable,
                                   prevent_cse=False)
        zeros = jnp.zeros((S, *xs.shape[1:]), x.dtype)
        buf = constrain(jnp.where(first_stage, xs[0][None], zeros), PIPE, DATA)
        fifo = constrain(jnp.zeros((M - S + 1 if R > 1 else 0, *zeros.shape), x.dtype), None, PIPE, DATA)
        _, outs = jax.lax.scan(iteration, (buf, fifo), jnp.arange(schedule.iterations))
        # the last repeat's outputs of micro-batches 0..M-1 left the last stage at iterations
        # (R - 1) M + S - 1 + m
        y = outs[(R - 1) * M + S - 1:, 0]
        return constrain(_merge_microbatches(y, n), DATA)

    return layer_scan


__all__ = ["PIPE", "PipelineSchedule", "pipeline_scan", "schedule_problems"]
