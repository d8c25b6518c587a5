"""`zerojax.shard`: the user's entry point -- a model and a DeepSpeed config -> a training Engine.

It builds the engine (`zerojax.engine.engine.Engine`) and hands it the planner, so that a step that will
not fit lists the plans that do. The engine itself only runs the memory check; the planner builds
abstract engines, so it imports the engine and the engine never imports it.
"""
from __future__ import annotations

from collections.abc import Callable

from jax.sharding import Mesh

from zerojax.engine.engine import Engine
from zerojax.options import EngineOptions
from zerojax.planning.planner import engine_plans  # the planner imports the engine, never the reverse


def shard(model, cfg, *, loss_fn: Callable, mesh: Mesh | None = None,
          options: EngineOptions | None = None, **unknown) -> Engine:
    """Wrap `model` (an nnx.Module, or a zero-argument callable returning one) for training.

    A callable's model is initialised in one sharded program (each device makes only its shards);
    one returning weights that exist already (`lambda: model`, or weights read from files) is
    placed leaf by leaf as a built model is. The engine keeps copies: the model's arrays stay the caller's.

    cfg: a Config, or anything `load_config` accepts (path, JSON text, dict).
    loss_fn(model, batch) -> loss, or (loss, metrics dict of scalars).
    mesh: a ("data", "tensor") mesh; default all devices, "tensor" = tensor_parallel.autotp_size.
    options: `zerojax.EngineOptions`, the knobs beyond the DeepSpeed config (offload loop, split
        master, memory guard, ...). A step that will not fit raises WillNotFitError listing the
        planner's plans for this model.
    """
    if unknown:
        fields = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
        raise TypeError(f"shard() got unexpected keyword arguments {sorted(unknown)}; engine knobs are "
                        f"fields of EngineOptions: shard(..., options=zerojax.EngineOptions({fields}))")
    return Engine(model, cfg, loss_fn=loss_fn, mesh=mesh, options=options, plans_for=engine_plans)


__all__ = ["shard"]
