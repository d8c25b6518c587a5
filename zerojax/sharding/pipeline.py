"""Pipeline parallelism: the stacked layers split into stages over the "pipe" mesh axis, inside
the one jitted step (GPipe, after MaxText's `layers/pipeline.py`).

A model whose layers run as one stacked scan (`zerojax.models.gpt2.GPT2`: `layer_scan` hook) is
handed `pipeline_scan(...)` as that scan. It splits the step's batch of hidden states into the
gradient_accumulation_steps micro-batches and runs the schedule below; the embeddings, the final
norm, the head and the loss stay outside, computed once on the whole batch (below: split over
the stages' devices). So the loss_fn is
called once per step on all micro-batches: a loss that is a mean over tokens equals DeepSpeed's
mean of micro-batch means whenever the micro-batches count the same tokens (no -100 labels).

Schedule, S stages, M micro-batches, R circular repeats, L layers: the layer stack [L, ...] is
viewed as [R, S, L / (S R), ...], stage s holding the blocks (r, s) -- contiguous blocks, so with
R = 1 each device keeps exactly its storage shard of the stack. A buffer [S, micro-batch, ...]
sharded over "pipe" holds each stage's input; every iteration all stages run their block at once
(vmapped; a stage's layers unrolled, see `_stage_pieces`), then the buffer rolls by one stage
(`jnp.roll` over the "pipe"-sharded axis,
which XLA lowers to a collective-permute) and stage 0 takes the next micro-batch, or, with R > 1,
the last stage's output of the previous repeat from a ring of M - S + 1 buffers. M R + S - 1
iterations; each stage idles S - 1 of them: the bubble fraction (S - 1) / (M R + S - 1).

Work outside the stages is not repeated on every stage: the embedded micro-batches enter through
a "pipe"-sharded buffer that only stage 0 reads (so the backward pass sums their gradients over
"pipe" once, not once per iteration), and the pipeline's output rows are split over "pipe" as
well as "data", so the final norm, the head and the loss each run on 1 / S of the rows per device
(replicated, GPT-2 Large's head cost each of 2 stages 16% of its layers' FLOPs again).

Activation checkpointing is DeepSpeed's `pipeline.activation_checkpoint_interval` N: 0 (its
default) keeps every activation the layers save (the model's own remat_policy decides, as without
pipelining); N > 0 runs each
stage's layers in groups of N, each group a `jax.checkpoint` saving only its input, recomputed in
the backward pass (N >= the layers a stage runs per iteration: one checkpoint per iteration).
With the model's remat_policy also set, a group is recomputed, then each layer again: use one.

Memory: with no checkpoints each device keeps its layers' saved activations for all M R + S - 1
iterations (GPipe's cost: about M R + S - 1 micro-batches of a stage's activations; the model's
remat_policy or an interval shrinks it). With circular repeats the weights an iteration selects
(per stage, repeat r = (t - s) // M) are saved too, one stage block per iteration: about
(M R + S - 1) / (S R) times the stacked layers in the compute dtype (a name-based remat policy
did not keep them out; per-iteration remat would, at a recomputed forward's cost).

Each stage's weights receive one gradient per micro-batch inside the loop; they are summed in the
engine's gradient accumulation dtype (data_types.grad_accum_dtype, fp32 by default), as the
unpipelined step sums its micro-batches, not in the compute dtype: the loop reads an fp32 copy of
the stacked weights and casts each iteration's stage back to the compute dtype. (That costs
nothing: XLA's algebraic simplifier folds the bf16 -> fp32 -> bf16 round trip, so the compiled loop
reads the compute-dtype weights and adds each iteration's gradient into fp32 accumulators -- checked
on the CPU-compiled step.)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.accumulate import split_microbatches
from zerojax.models.layer_stack import WithFrozen
from zerojax.sharding.partition import DATA, PIPE


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """The static shape of one pipelined step."""

    stages: int         # pipeline.stages: size of the mesh's "pipe" axis
    microbatches: int   # gradient_accumulation_steps
    repeats: int = 1    # circular repeats (EngineOptions.pipeline_repeats)
    checkpoint_interval: int = 0  # pipeline.activation_checkpoint_interval (0: no checkpoints)
    grad_accum_dtype: str | None = None  # the stages' weight gradients summed over micro-batches in it

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of the stage-iterations that compute nothing useful: (S - 1) / (M R + S - 1)."""
        return (self.stages - 1) / self.iterations


def schedule_problems(layers: int, stages: int, microbatches: int, repeats: int,
                      checkpoint_interval: int = 0) -> list[str]:
    """Why (layers, stages, micro-batches, repeats, checkpoint interval) cannot be pipelined; []
    if they can."""
    problems = []
    if layers % (stages * repeats):
        fits = [s for s in range(2, layers + 1) if layers % (s * repeats) == 0]
        problems.append(
            f"pipeline.stages={stages} x pipeline_repeats={repeats} does not divide the model's "
            f"{layers} stacked layers; stage counts that would work with {repeats} repeat(s): {fits or 'none'}")
    elif 0 < checkpoint_interval < layers // (stages * repeats) and (
            (layers // (stages * repeats)) % checkpoint_interval):
        per = layers // (stages * repeats)
        problems.append(
            f"pipeline.activation_checkpoint_interval={checkpoint_interval} does not divide the {per} layers "
            f"each stage runs per iteration ({layers} layers / (stages {stages} x repeats {repeats})); use "
            f"one of {[n for n in range(1, per + 1) if per % n == 0]}, or 0 for no checkpoints")
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


def _stage_pieces(body, per: int, interval: int):
    """(`cut(block) -> pieces`, `run(h, pieces) -> h`): one stage's `per` layers in turn, their
    weights cut into the pieces each iteration reads. With interval N > 0 the layers run in
    checkpointed groups of min(N, per) (each group saves only its input). A block's leaves are
    [R, S, per, ...]; `_blocks_at` picks a piece's [S, ...] out of its [R, S, ...].

    The stage's layers (or groups) run as straight-line code, each layer's (group's) weights cut
    out of the stacked block once, before the pipeline's loop. Why unrolled: the pipeline's
    iterations are a scan, and a scan nested in a scan saves its activations twice over (the inner
    loop stacks them in a buffer of its own, which the outer loop copies into its stack each
    iteration, and back out in the backward pass); unrolled, each layer's activations go straight
    into the outer stack. Why cut before the loop: a slice is a copy in XLA, so slicing inside the
    loop wrote every stage's weights once an iteration, forward and in the checkpointed recompute."""
    def layers(h, weights):
        return jax.lax.scan(lambda h, p: (body(h, p), None), h, weights)[0]

    group = min(interval, per) if interval else 1
    # a group is recomputed in the backward pass, its activations transient: its loop stays a loop
    step = jax.checkpoint(layers, policy=jax.checkpoint_policies.nothing_saveable,
                          prevent_cse=False) if interval else body  # a piece: one checkpointed group, or one layer

    def cut(block):
        if not interval:  # single layers: [R, S, ...]
            return [jax.tree.map(lambda a: a[:, :, i], block) for i in range(per)]  # noqa: B023 - called within this iteration
        return [jax.tree.map(lambda a: a[:, :, i:i + group], block) for i in range(0, per, group)]  # noqa: B023 - called within this iteration

    def run(h, pieces):
        for piece in pieces:
            h = step(h, piece)
        return h

    return cut, run


def pipeline_scan(schedule: PipelineSchedule, mesh: Mesh):
    """The model's `layer_scan(body, x, layers, fetch, inputs_to_host=False)` for `schedule`:
    `body(h, layer_params) -> h` on [rows, ...] hidden states, `x` [batch, ...] sharded over
    "data", `layers` the stacked [L, ...] parameters sharded over "pipe". Returns [batch, ...]
    with the rows split over "data" and "pipe" (what follows the layers runs on 1 / S of them).
    `x` may be a pair (hidden states, per-row side inputs such as positions or segment ids, a
    pytree of [batch, ...] arrays): the side inputs travel with their micro-batch through the
    stages, `body((h, side), layer_params) -> h`, and the hidden states alone are returned."""
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    n = int(mesh.shape.get(DATA, 1))

    def constrain(tree, *spec, rest=None):
        # the dims after `spec` are replicated (rest=None), or keep the sharding they have
        # (rest=P.UNCONSTRAINED: the weights' "tensor" axis of Megatron's splits, ZeRO-3's "data";
        # a None there would all-gather every stage's weights)
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, P(*spec[: a.ndim], *([rest] * (a.ndim - len(spec)))))), tree)

    def layer_scan(body, x, layers, fetch=None, inputs_to_host=False):
        if fetch is not None or inputs_to_host:
            raise ValueError("pipeline: a per-layer fetch or host-offloaded layer inputs do not "
                             "combine with pipeline stages (zero_optimization.offload_* is refused with "
                             "pipeline.stages > 1)")
        side = isinstance(x, tuple)
        if side:  # the side inputs ride along, unchanged by every layer
            inner = body
            body = lambda hs, p: (inner(hs, p), hs[1])  # noqa: E731
        num = jax.tree.leaves(layers)[0].shape[0]
        problems = schedule_problems(num, S, M, R, schedule.checkpoint_interval)
        if problems:
            raise ValueError("; ".join(problems))
        per = num // (S * R)
        compute = jax.tree.map(lambda a: a.dtype, layers)
        if schedule.grad_accum_dtype is not None:
            # the loop's weight-gradient accumulators take the dtype of the weights it reads; a
            # frozen part (a LoRA's base) has no gradient and keeps its own
            acc = lambda t: jax.tree.map(lambda a: a.astype(jnp.promote_types(a.dtype, schedule.grad_accum_dtype)), t)  # noqa: E731
            layers = layers._replace(params=acc(layers.params)) if isinstance(layers, WithFrozen) else acc(layers)
        # [L, ...] -> [R, S, per, ...]: stage s holds blocks (r, s); R = 1 is the storage shard
        blocks = constrain(jax.tree.map(lambda a: a.reshape(R, S, per, *a.shape[1:]), layers), None, PIPE,
                           rest=P.UNCONSTRAINED)
        stage_ids = jnp.arange(S)
        first_stage = lambda a: (stage_ids == 0).reshape(S, *([1] * a.ndim))  # noqa: E731
        # the micro-batches [M, n * mb, ...] as stage 0's slice of a "pipe"-sharded [S, M, ...]
        # (zeros elsewhere): reading the next one is local to every stage, and the backward pass
        # sums the embeddings' gradients over "pipe" once, after the loop -- a buffer replicated
        # over "pipe" made XLA all-reduce each iteration's micro-batch gradient inside the loop
        xs = split_microbatches(x, M, mesh)
        xs = constrain(jax.tree.map(lambda a: jnp.where(first_stage(a[0])[:, None], a[None], jnp.zeros((), a.dtype)),
                                    xs),
                       PIPE, None, DATA)
        cut, run = _stage_pieces(body, per, schedule.checkpoint_interval)
        pieces = cut(blocks)
        run_stages = jax.vmap(run)
        ring = M - S + 1 if R > 1 else 0   # stage 0 takes the last stage's output this many iterations later

        def iteration(carry, t):
            buf, fifo = carry
            rep = jnp.clip((t - stage_ids) // M, 0, R - 1)
            weights = [jax.tree.map(lambda a, dtype: a.astype(dtype), _blocks_at(piece, rep), compute)
                       for piece in pieces]
            out = constrain(run_stages(buf, constrain(weights, PIPE, rest=P.UNCONSTRAINED)), PIPE, DATA)
            # stage s + 1 takes stage s's output: a collective-permute over "pipe"
            rolled = constrain(jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), out), PIPE, DATA)
            head = constrain(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
                a, jnp.minimum(t + 1, M - 1), axis=1, keepdims=False), xs), PIPE, DATA)
            if R > 1:
                # a ring, not a shifted queue: one slot written per iteration instead of all moved
                fifo = jax.tree.map(lambda f, r: jax.lax.dynamic_update_index_in_dim(f, r, t % ring, axis=0),
                                    fifo, rolled)
                head = jax.tree.map(lambda h, f: jnp.where(t + 1 < M, h, jax.lax.dynamic_index_in_dim(
                    f, (t + 1) % ring, axis=0, keepdims=False)), head, fifo)
            buf = constrain(jax.tree.map(lambda h, r: jnp.where(first_stage(h[0]), h, r), head, rolled), PIPE, DATA)
            return (buf, fifo), (rolled[0] if side else rolled)

        buf = jax.tree.map(lambda a: a[:, 0], xs)
        fifo = constrain(jax.tree.map(lambda b: jnp.zeros((ring, *b.shape), b.dtype), buf), None, PIPE, DATA)
        _, outs = jax.lax.scan(iteration, (buf, fifo), jnp.arange(schedule.iterations))
        # the last repeat's outputs of micro-batches 0..M-1 left the last stage at iterations
        # (R - 1) M + S - 1 + m
        y = outs[(R - 1) * M + S - 1:, 0]
        return constrain(_merge_microbatches(y, n), (DATA, PIPE))

    return layer_scan


__all__ = ["PIPE", "PipelineSchedule", "pipeline_scan", "schedule_problems"]
