"""A rollout's device memory, checked before the first rollout, and the rows generated at once.

The training planner (`--micro-batch auto`) sizes the train step from its compiled peak; a
rollout runs other programs beside the same resident states: generate's prefill and decode (a KV
cache of rows x (prompt + new tokens) x layers x kv heads x head_dim x 2, and their temporaries),
the log-prob passes, and with off_policy=1 a compute-dtype copy of the weights, live while the
step trains (the next rollout generates from it on a thread during that step, so its programs run
beside the step's own peak). Each is read from the program compiled from shapes (nothing
allocated; `zerojax.generation.program_memory`, the engine's guard's `CompiledMemory`), the
serving engine's page pool by count (`zerojax.serving.planning`, as it plans its own pool).

`rollout_chunk` (RolloutOptions): rows generated per generate call; "auto" the most that fit,
tried from all rows down by batch buckets (a power of two of rows, the shapes generate compiles),
so a chunk is chosen with one compile where all rows fit. A rollout that cannot fit even one row
at a time, or whose log-prob pass cannot, is refused in one line (`RolloutWillNotFitError`).
Without a device memory limit (CPU) nothing is compiled and all rows generate at once.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from zerojax.byte_sizes import fmt_bytes
from zerojax.engine import memory

CHUNK_AUTO = "auto"


class RolloutWillNotFitError(MemoryError):
    """A rollout's programs need more device memory than the budget leaves beside the resident states."""


def check_chunk_option(chunk) -> None:
    """rollout_chunk "auto" or an int >= 1, else a ValueError in one line."""
    if chunk != CHUNK_AUTO and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"rollout_chunk={chunk!r}: rows generated at once, an int >= 1 or \"auto\" (the most that "
                         "fit the device beside the training states)")


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """rows per rollout generation, generated `chunk` at a time; `need`: the chosen chunk's bytes
    beyond `held` (what stays resident while it runs), against `budget` (None: no limit known);
    `tried`: {chunk: need} of every chunk compiled; `logps`: the log-prob pass's need."""

    rows: int
    chunk: int
    why: str
    prompts: str  # "8 prompts x group 8, prompt 64 + 1024 new tokens"
    need: int | None = None
    held: int | None = None
    budget: int | None = None
    logps: int | None = None
    tried: dict = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        at_once = "all at once" if self.chunk >= self.rows else f"{self.chunk} rows at a time"
        line = f"rollouts: {self.rows} rows ({self.prompts}), generated {at_once} ({self.why})"
        if self.budget is not None:
            line += (f"; predicted peak {fmt_bytes(self.held + max(self.need, self.logps or 0))} of "
                     f"{fmt_bytes(self.budget)} ({fmt_bytes(self.held)} held beside the rollout)")
        return line

    def to_dict(self) -> dict:
        return {"rows": self.rows, "chunk": self.chunk, "why": self.why, "need_bytes": self.need,
                "held_bytes": self.held, "budget_bytes": self.budget, "logps_bytes": self.logps}


def chunk_candidates(rows: int) -> list[int]:
    """Chunks to try, largest first: all rows, then the powers of two below (each a batch bucket of
    its own: a chunk between two powers compiles the larger's program)."""
    return [rows] + [1 << k for k in range(max(rows - 1, 1).bit_length() - 1, -1, -1) if 1 << k < rows]


def distinct_prompts(rows: int, chunk: int, group: int) -> int:
    """The most groups (prompts) one chunk of consecutive rows touches: what its prefill runs."""
    return max((min(s + chunk, rows) - 1) // group - s // group + 1 for s in range(0, rows, chunk))


def _held(rollouts, weights_copy: int) -> tuple[int, list[str]]:
    """(bytes resident on a device while a rollout runs, what they are): the engine's states, a
    "copy" reference's weights; off_policy: the step's compiled peak (its states included) and the
    weights' copy the rollout ahead reads during it."""
    engine = rollouts.engine
    frozen = memory.resident_bytes(rollouts.policy.frozen) if rollouts.policy.frozen is not None else 0
    parts = [f"the reference's copy {fmt_bytes(frozen)}"] if frozen else []
    if not rollouts.options.off_policy:
        states = memory.resident_bytes(engine.state)
        return states + frozen, [f"the engine's states {fmt_bytes(states)}", *parts]
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rollouts.data.example_batch(rollouts.rows))
    step = engine.step_memory(shapes).peak
    return step + weights_copy + frozen, [f"the training step's peak {fmt_bytes(step)}",
                                          f"off_policy's weight copy {fmt_bytes(weights_copy)}", *parts]


def logps_need(rollouts) -> int:
    """Bytes the log-prob pass over a rollout's rows adds beside its weights (its compiled peak less them)."""
    peak = rollouts.policy.logps_memory(rollouts.data.example_batch(rollouts.rows)).peak
    return peak - memory.resident_bytes((rollouts.engine.state.params, rollouts.engine.state.rest))


def generate_need(rollouts, chunk: int) -> int:
    """Bytes one generate call of `chunk` rollout rows adds beside the weights, from its programs."""
    from zerojax.generation import api, sampling
    from zerojax.generation.program_memory import generate_memory

    o = rollouts.options
    shapes = api.program_shapes(api.generation_target(rollouts.engine), rows=chunk,
                                distinct=distinct_prompts(rollouts.rows, chunk, o.group),
                                longest_prompt=rollouts.data.prompt_len, max_new_tokens=rollouts.max_new_tokens,
                                decode_attention=o.decode_attention)
    sampler = sampling.settings(o.temperature, o.top_k, o.top_p)[0]
    # the model's eos ids come on top of the asked stop ids; the array is padded to 8 slots, so two stand in
    stops = sum(not isinstance(s, str) for s in o.stop) + (0 if o.ignore_eos else 2)
    return generate_memory(rollouts.engine, shapes, sampler=sampler, stops=stops).need


def serving_need(rollouts) -> int:
    """The serving generator's page pool (every row of a rollout at once) and its step's transients,
    by count as the serving engine plans them."""
    from zerojax.generation.api import generation_target
    from zerojax.generation.families import geometry_of_config
    from zerojax.rl.serving_rollouts import PAGE_SIZE
    from zerojax.serving.planning import step_transient_bytes
    from zerojax.serving.shapes import pow2
    from zerojax.serving.step import pool_bytes_per_page

    model = generation_target(rollouts.engine).model
    g, rows, P = geometry_of_config(model.config), rollouts.rows, rollouts.data.prompt_len
    length = P + rollouts.max_new_tokens
    pages = rows * -(-length // PAGE_SIZE) + 1  # one scratch page
    return pages * pool_bytes_per_page(g, PAGE_SIZE, model.dtype) + step_transient_bytes(
        g, model.dtype, max_num_seqs=rows, max_batched_tokens=rows * pow2(P), max_model_len=length,
        vocab=model.config.padded_vocab_size)


def _prompts(rollouts) -> str:
    o, rows = rollouts.options, rollouts.rows
    return (f"{rows // o.group} prompts x group {o.group}, prompt {rollouts.data.prompt_len} + "
            f"{rollouts.max_new_tokens} new tokens")


def _refuse(rollouts, what: str, need: int, available: int, budget: int, held: int, parts, fix: str):
    raise RolloutWillNotFitError(
        f"rollouts of {_prompts(rollouts)} ({rollouts.rows} rows): {what} needs {fmt_bytes(need)} per device "
        f"({need:,} bytes) but {fmt_bytes(available)} is available ({fmt_bytes(budget)} budget less "
        f"{fmt_bytes(held)} held: {', '.join(parts)}); {fix}")


def _fix(rollouts) -> str:
    o = rollouts.options
    fixes = ["fewer rows per rollout chunk (rollout_chunk)" if o.generator == "generate" else None,
             "a shorter max_new_tokens", "generator \"serving\"" if o.generator == "generate" else None,
             "off_policy=0" if o.off_policy else None]
    return "fix: " + ", ".join(f for f in fixes if f)


def _pick_chunk(rollouts, available: int, refuse) -> tuple[int, int, dict, str]:
    """(chunk, its need, {chunk: need} tried, why): the asked chunk where it fits, else the largest
    candidate that does; `refuse(what, need)` where none does."""
    asked, rows = rollouts.options.rollout_chunk, rollouts.rows
    if asked != CHUNK_AUTO:
        chunk = min(asked, rows)
        need = generate_need(rollouts, chunk)
        if need > available:
            refuse(f"generating {chunk} rows at once (rollout_chunk={asked})", need)
        return chunk, need, {chunk: need}, f"rollout_chunk={asked}"
    tried = {}
    for chunk in chunk_candidates(rows):
        tried[chunk] = generate_need(rollouts, chunk)
        if tried[chunk] <= available:
            why = ("rollout_chunk auto: all rows fit" if chunk == rows else
                   f"rollout_chunk auto: the most that fit; {min(c for c in tried if c > chunk)} rows at once do not")
            return chunk, tried[chunk], tried, why
    refuse("generating even 1 row at a time", tried[1])


def plan_rollouts(rollouts, budget: int | None = None) -> RolloutPlan:
    """The plan of a `RolloutBatches`' generation (budget: default the device's limit; none known:
    all rows at once, nothing compiled); RolloutWillNotFitError (one line) where it cannot fit."""
    o, rows = rollouts.options, rollouts.rows
    budget = memory.device_budget() if budget is None else budget
    if budget is None:
        chunk = rows if o.rollout_chunk == CHUNK_AUTO or o.generator == "serving" else min(o.rollout_chunk, rows)
        return RolloutPlan(rows, chunk, "no device memory limit to plan against" if chunk == rows
                           else f"rollout_chunk={o.rollout_chunk}", _prompts(rollouts))
    weights = (rollouts.engine.state.params, rollouts.engine.state.rest)
    held, parts = _held(rollouts, memory.resident_bytes(weights) if o.off_policy else 0)
    available = budget - held

    def refuse(what, need, fix=None):
        _refuse(rollouts, what, need, available, budget, held, parts, fix or _fix(rollouts))

    logps = logps_need(rollouts)
    if logps > available:
        refuse(f"the log-prob pass over {rows} rows of {rollouts.data.seq_len} tokens", logps,
               "fix: a smaller train_batch_size or seq_len" + (", off_policy=0" if o.off_policy else ""))
    if o.generator == "serving":
        need = serving_need(rollouts)
        if need > available:
            refuse("the serving engine's page pool and step", need)
        return RolloutPlan(rows, rows, "the serving engine's pool holds every row", _prompts(rollouts), need, held,
                           budget, logps)
    chunk, need, tried, why = _pick_chunk(rollouts, available, refuse)
    return RolloutPlan(rows, chunk, why, _prompts(rollouts), need, held, budget, logps, tried)


def chunks(prompts: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Consecutive slices of `chunk` rows (the last may be shorter)."""
    return [prompts[s:s + chunk] for s in range(0, len(prompts), chunk)]


__all__ = ["RolloutPlan", "RolloutWillNotFitError", "plan_rollouts", "check_chunk_option", "chunk_candidates",
           "distinct_prompts", "generate_need", "logps_need", "serving_need", "chunks", "CHUNK_AUTO"]
