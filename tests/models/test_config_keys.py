"""Every key docs/config-keys.md marks "acted on" acts on models written without zerojax in mind
(tests/foreign_models.py: a Python list of blocks, and an `nnx.vmap` stack run by its own
`nnx.scan`): set, it changes the compiled step or the train state, or else the key's row says what
the model needs for it (or that it needs nothing, acting outside the step). The page is walked as
written, so a key added to the schema as "acted on" is held to it here.

The step is lowered, not compiled: the lowered program shows every difference these keys make
(shapes, shardings, memory kinds, constants, loops) at a fraction of compile time, and the engines
are abstract (nothing allocated). The train state is its structure with each leaf's shape, dtype
and sharding, plus the optimizer state's initial values (where fp16's initial loss scale lives).
"""
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from foreign_models import ListQwen, QwenShape, ScanLM, ScanShape, lm_loss  # noqa: E402 (tests/ on sys.path)

import zerojax
from zerojax.config.docs import MODEL_NEEDS
from zerojax.engine.engine import abstract_engine

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config-keys.md"
ROWS, SEQ = 16, 9
MODELS = {"list": lambda: ListQwen(QwenShape(layers=2), rngs=nnx.Rngs(0)),
          "scan": lambda: ScanLM(ScanShape(layers=2), rngs=nnx.Rngs(0))}
BASE = {"train_batch_size": ROWS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}

FP16 = {"fp16": {"enabled": True}}
ACCUM = {"gradient_accumulation_steps": 2}
PIPE = {"pipeline": {"stages": 2}, **ACCUM}
ZERO3 = {"zero_optimization": {"stage": 3}}
OFFLOAD_OPT3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
AUTOTP = {"tensor_parallel": {"autotp_size": 2}}
SCHEDULE = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}

# key -> (sections added to BASE for the reference run, sections added on top of those for the
# run with the key set); a section given replaces the reference's whole
PROBES = {
    "train_batch_size": ({}, {"train_batch_size": 2 * ROWS}),
    "train_micro_batch_size_per_gpu": ({}, {"train_micro_batch_size_per_gpu": 1}),
    "gradient_accumulation_steps": ({}, ACCUM),
    "gradient_clipping": ({}, {"gradient_clipping": 1.0}),
    "data_types.grad_accum_dtype": (ACCUM, {"data_types": {"grad_accum_dtype": "bf16"}}),
    "fp16.enabled": ({}, FP16),
    "fp16.loss_scale": (FP16, {"fp16": {"enabled": True, "loss_scale": 128.0}}),
    "fp16.initial_scale_power": (FP16, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "fp16.loss_scale_window": (FP16, {"fp16": {"enabled": True, "loss_scale_window": 100}}),
    "fp16.hysteresis": (FP16, {"fp16": {"enabled": True, "hysteresis": 5}}),
    "fp16.consecutive_hysteresis": (FP16, {"fp16": {"enabled": True, "consecutive_hysteresis": True}}),
    "fp16.min_loss_scale": (FP16, {"fp16": {"enabled": True, "min_loss_scale": 0.25}}),
    "bf16.enabled": ({}, {"bf16": {"enabled": True}}),
    "optimizer": ({}, {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}),
    "optimizer.type": ({}, {"optimizer": {"type": "Lion", "params": {"lr": 0.1}}}),
    "optimizer.params": ({}, {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}),
    "scheduler": ({}, SCHEDULE),
    "scheduler.type": (SCHEDULE, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 10, "total_num_steps": 100}}}),
    "scheduler.params": (SCHEDULE, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}}}),
    "zero_optimization.stage": ({}, ZERO3),
    "zero_optimization.offload_param.device": (ZERO3, {"zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}}),
    "zero_optimization.offload_optimizer.device": ({}, OFFLOAD_OPT3),
    "zero_optimization.offload_optimizer.ratio": (OFFLOAD_OPT3, {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}),
    # the default threshold (1e5 elements) leaves every leaf of these tiny models whole
    "zero_optimization.stage3_param_persistence_threshold": (ZERO3, {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}),
    "activation_checkpointing": ({}, {"activation_checkpointing": {}}),
    "activation_checkpointing.cpu_checkpointing": ({"activation_checkpointing": {}}, {
        "activation_checkpointing": {"cpu_checkpointing": True}}),
    "activation_checkpointing.remat_policy": ({"activation_checkpointing": {}}, {
        "activation_checkpointing": {"remat_policy": "dots"}}),
    "pipeline": (ACCUM, PIPE),
    "pipeline.stages": (ACCUM, PIPE),
    "pipeline.activation_checkpoint_interval": (PIPE, {"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}),
    "tensor_parallel.autotp_size": ({}, AUTOTP),
    # the q projection (ListQwen's q_proj, ScanLM's wq) kept whole
    "tensor_parallel.partition_config": (AUTOTP, {"tensor_parallel": {"autotp_size": 2, "partition_config": {
        "layer_specs": [{"patterns": [r".*(q_proj|wq)\."], "partition_type": "skip"}]}}}),
}


def acted_on_rows() -> dict[str, str]:
    """{key: its zerojax cell} for every row of the page's key table marked "acted on", other than a
    section's "see its keys" (its keys are rows of their own)."""
    text = PAGE.read_text(encoding="utf-8")
    table = text[text.index("## Keys"):text.index("## Refused keys")]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells[3]
    return {k: z for k, z in rows.items()
            if z.startswith("**acted on**") and not z.startswith("**acted on**: see its keys")}


def config(*sections) -> str:
    cfg = dict(BASE)
    for s in sections:
        cfg.update(s)
    return json.dumps(cfg, sort_keys=True)  # hashable, for the cache


@functools.cache
def evidence(kind, cfg):
    """(the lowered step's text, the train state's leaves with their shardings, the optimizer
    state's initial values) of `kind` under the config `cfg` (JSON)."""
    eng = abstract_engine(MODELS[kind](), json.loads(cfg), loss_fn=lm_loss,
                          options=zerojax.EngineOptions(memory_guard=False))
    rows = eng.layout.cfg.train_batch_size
    step = eng.lower_step({"input_ids": jax.ShapeDtypeStruct((rows, SEQ), np.int32)}).as_text()
    state = [(jax.tree_util.keystr(p), s.shape, str(s.dtype), str(s.sharding))
             for p, s in jax.tree_util.tree_leaves_with_path(eng.state)]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), eng.layout.abstract_master)
    init = [np.asarray(v).tolist() for v in jax.tree.leaves(eng.layout.tx.init(zeros)) if np.ndim(v) == 0]
    return step, state, init


def test_every_acted_on_key_is_probed_or_says_what_the_model_needs():
    rows = acted_on_rows()
    unaccounted = sorted(k for k, z in rows.items() if k not in PROBES and MODEL_NEEDS not in z)
    assert not unaccounted, (f"acted-on keys with no probe here and no '{MODEL_NEEDS}' on the page "
                             f"(add one to the schema's string, zerojax/config/_schema*.py): {unaccounted}")
    stale = sorted(set(PROBES) - set(rows))
    assert not stale, f"probes for keys the page does not mark acted on: {stale}"


@pytest.mark.slow
def test_the_same_config_twice_gives_the_same_evidence():
    # the control: two engines built from one config lower the same program (else every probe passes)
    cfg = config()
    first = evidence("scan", cfg)
    evidence.cache_clear()
    assert evidence("scan", cfg) == first


# The keys under these sections reach into the model (its layer stack, its parameter names, its
# shardings): both models. The others (batch, precision, optimizer, schedule) are the engine's, one
# code path for any model: the scan model alone.
MODEL_SECTIONS = ("activation_checkpointing", "pipeline", "tensor_parallel", "zero_optimization")
CASES = [(key, kind) for key in sorted(PROBES)
         for kind in (sorted(MODELS) if key.startswith(MODEL_SECTIONS) else ["scan"])]


@pytest.mark.parametrize("key,kind", CASES)
@pytest.mark.slow
def test_an_acted_on_key_changes_the_step_or_the_state(key, kind):
    reference, setting = PROBES[key]
    before, after = evidence(kind, config(reference)), evidence(kind, config(reference, setting))
    assert before != after, f"{key}: setting it changed neither the lowered step nor the train state of {kind}"
