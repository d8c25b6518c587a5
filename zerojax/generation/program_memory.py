"""What a `zerojax.generate` call on an engine's weights holds on each device, read from its own
prefill and decode programs compiled from shapes (nothing allocated: `jit(...).lower(...).compile()`
and XLA's memory analysis, as the engine's guard reads its train step, `zerojax.engine.memory`).

    shapes = api.program_shapes(target, rows=64, distinct=8, longest_prompt=100, max_new_tokens=1024, ...)
    need = generate_memory(engine, shapes, sampler=sampler, stops=2)   # bytes beyond the weights

The weights are the programs' arguments but stay resident whether or not a call runs (the engine
holds them), so what a call adds is each program's peak less the weights it reads: the prefill's
ids, its new cache and temporaries; the decode's cache (donated in, written in place) and its
temporaries. The two never run at once, so a call needs the larger.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zerojax.engine.memory import CompiledMemory, quiet_xla, resident_bytes
from zerojax.generation import decoder, sampling
from zerojax.generation.api import ProgramShapes, generation_target, stop_slots


@dataclasses.dataclass(frozen=True)
class GenerateMemory:
    """Per-device bytes a generate call adds beside its weights (`weights`: what its programs read
    of them on this device), the prefill's and the decode's."""

    prefill: CompiledMemory
    decode: CompiledMemory
    weights: int

    @property
    def need(self) -> int:
        return max(self.prefill.peak, self.decode.peak) - self.weights


def _with_shardings(lowered, compiled):
    """A program's outputs as ShapeDtypeStructs in the shardings it gives them: the next program's inputs."""
    return jax.tree.map(lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
                        lowered.out_info, compiled.output_shardings)


def generate_memory(engine, shapes: ProgramShapes, *, sampler, stops: int, weights=None) -> GenerateMemory:
    """The prefill and decode programs of a generate call of `shapes` on `engine`'s weights (or
    `weights`, a copy laid out as the engine's), greedy or sampled as `sampler`, with `stops` stop
    ids: compiled as the call compiles them, their memory analysis read."""
    target = generation_target(engine, weights)
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    values = sampling.settings()[1]  # the values are arguments: any give the program's shapes
    stop, key = S((stop_slots(stops),), i32), jax.random.key(0)
    B, P = shapes.batch, shapes.prompt_len
    with quiet_xla():
        pre_low = decoder.prefill.lower(
            target.weights, S((shapes.prefill_batch, P), i32), S((shapes.prefill_batch,), i32), S((B,), bool), values,
            stop, key, S((B,), i32) if shapes.expand else None, source=target.source, sampler=sampler,
            length=shapes.length, out_len=shapes.out_len, piece=shapes.prefill_piece)
        pre = pre_low.compile()
        dec = decoder.decode.lower(target.weights, _with_shardings(pre_low, pre), S((B,), i32), S((), i32),
                                   S((), i32), values, stop, key, source=target.source, sampler=sampler,
                                   kernel=shapes.kernel).compile()
    return GenerateMemory(CompiledMemory.of(pre), CompiledMemory.of(dec), resident_bytes(target.weights))


__all__ = ["GenerateMemory", "generate_memory"]
