"""Expert parallelism's sharding (DeepSpeed-MoE's `ep_size`, `EngineOptions.ep_size`): the
data-parallel devices as a ("data", "expert") grid of (dp / ep, ep) (`partition.with_expert_axis`),
a mixture of experts' expert leaves split over "expert" on their logical "experts" axis at every
ZeRO stage (replicated over "data", across the expert-parallel groups, where ZeRO partitions them
on another dim), and the models' `expert_parallel` hook that makes their sparse layers send tokens
to the experts' devices within their group (`zerojax.models.expert_parallel`).
"""
from __future__ import annotations

from typing import Any

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from zerojax.config import ConfigError
from zerojax.sharding.partition import (
    EXPERT,
    data_axes,
    data_size,
    logical_axes,
    pipe_size,
    seq_size,
    tensor_size,
    with_expert_axis,
)

EXPERTS = "experts"  # the logical name of a mixture of experts' experts axis


def split_experts(state, specs, axis: str = EXPERT) -> Any:
    """`specs` (a pure dict, as `tensor_specs` returns) with each leaf's logical "experts" axis on
    mesh `axis`: expert parallelism (`EngineOptions.ep_size`), at every ZeRO stage. `state`: the
    nnx.State the specs are of (its Variables carry the logical names)."""
    def put(spec, variable):
        names = tuple(logical_axes(variable) or ())
        if EXPERTS not in names:
            return spec
        out = list(spec) + [None] * (len(names) - len(spec))
        out[names.index(EXPERTS)] = axis
        return P(*out)

    def walk(specs, state):
        return {k: walk(v, state[k]) if isinstance(v, dict) else put(v, state[k]) for k, v in specs.items()}

    return walk(specs, state)


def expert_parallel_hook(module, mesh: Mesh, ep: int, modules_with) -> tuple[tuple | None, Mesh]:
    """(the models' `expert_parallel` hook value, the mesh to run on) for EngineOptions.ep_size = ep:
    (None, mesh) for ep 1; else ((mesh, "expert", the rows' axes), mesh with its "data" axis split
    into ("data", "expert")), or a ConfigError where it cannot apply. modules_with(module, name):
    the modules having the hook."""
    if ep == 1:
        return None, mesh
    if not modules_with(module, "expert_parallel"):
        raise ConfigError([f"EngineOptions.ep_size = {ep}: {type(module).__name__} has no experts (no module with "
                           "the expert_parallel hook, e.g. zerojax.models.MoELlama); use ep_size 1"])
    others = {"tensor_parallel.autotp_size": tensor_size(mesh), "pipeline.stages": pipe_size(mesh),
              "sequence_parallel_size": seq_size(mesh)}
    busy = [f"{k} = {v}" for k, v in others.items() if v > 1]
    if busy:
        raise ConfigError([f"EngineOptions.ep_size = {ep} with {', '.join(busy)}: expert parallelism runs on the "
                           "data-parallel devices alone; set those to 1"])
    grid = with_expert_axis(mesh, ep)  # first: ep must divide the data-parallel size
    experts = getattr(getattr(module, "config", None), "num_experts", None)
    if experts is not None and experts % ep:
        n = data_size(mesh)
        fits = [e for e in range(1, n + 1) if experts % e == 0 and n % e == 0]
        raise ConfigError([f"EngineOptions.ep_size = {ep} must divide the model's num_experts = {experts} (each "
                           f"device of a group holds num_experts / ep_size of them); sizes that would work: {fits}"])
    return (grid, EXPERT, data_axes(grid)), grid


__all__ = ["EXPERTS", "split_experts", "expert_parallel_hook"]
