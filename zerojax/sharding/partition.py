"""The device mesh, and each ZeRO stage as a choice of `NamedSharding`s.

A ZeRO stage decides which of three trees is split over the "data" axis (the ZeRO paper's stage table):

| stage | compute params | gradients / accumulator | fp32 master + optimizer state |
|-------|----------------|-------------------------|-------------------------------|
| 0     | replicated     | replicated              | replicated                    |
| 1     | replicated     | replicated              | sharded                       |
| 2     | replicated     | sharded                 | sharded                       |
| 3     | sharded        | sharded                 | sharded                       |

"Replicated" here means replicated over "data": a parameter may still be split over "tensor"
through its logical axis names (flax's `nnx.with_partitioning`) mapped by ordered rules.
Everything here is a pure function of shapes, metadata and a mesh; nothing touches arrays.
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax._jax_compat import variable_value
from zerojax.config import ConfigError
from zerojax.sharding import autotp

DATA = "data"
TENSOR = "tensor"
PIPE = "pipe"
# Ulysses sequence parallelism (DeepSpeed's `sequence_parallel_size`): activations split on their
# sequence between the attentions, on their heads inside them (`SEQ_RULES`)
SEQ = "seq"
# expert parallelism inside data parallelism (DeepSpeed-MoE's ep_size): the data-parallel devices
# as a (DATA, EXPERT) grid, each row of EXPERT devices one expert-parallel group. Data parallelism
# (batch rows, ZeRO) spans both axes; expert leaves split over EXPERT and are ZeRO-partitioned over
# DATA, the expert-data-parallel group (`zerojax.sharding.experts`)
EXPERT = "expert"
AXES = (DATA, TENSOR)

# Logical axis name -> mesh axis (flax's logical_axis_rules), used only when the mesh's "tensor"
# axis is larger than 1; earlier rules win a mesh axis first (`logical_to_mesh`). Megatron's split:
# attention column-parallel on its heads (q/k/v weights and biases), its output projection
# row-parallel (heads is its input axis); MLP up column-parallel, down row-parallel (both on "mlp");
# the token embedding / LM head vocab-parallel (Megatron's VocabParallelEmbedding: each rank holds
# vocab / T rows, the loss's logsumexp a reduction over the split vocabulary). The fused q/k/v axis
# ("qkv", size 3) is never split.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("heads", TENSOR),
    ("kv_heads", TENSOR),   # GQA's key / value heads: split where the tensor size divides them
    ("mlp", TENSOR),
    ("vocab", TENSOR),
)
# Logical names that may stay whole when the tensor size does not divide them (a warning, not an
# error): a vocabulary is whatever the tokenizer made it (GPT-2's 50257 is odd); padding it
# (GPT2Config.make_vocab_size_divisible_by, 128 by default) is the fix the warning names.
SPLIT_IF_DIVISIBLE = frozenset({"vocab", "kv_heads"})
# ... of which these stay whole without a warning: fewer kv heads than tensor ranks is GQA's design
# (each rank then holds every kv head; Megatron replicates them the same way)
WHOLE_BY_DESIGN = frozenset({"kv_heads"})
# Logical names that stay whole on purpose under tensor parallelism (no "unknown name" warning).
# Position embeddings ("pos") are small and read by every token; norms and biases are per-feature.
REPLICATED_NAMES = frozenset({"embed", "layers", "pos", "qkv", "head_dim", "batch", "seq",
                              "norm", "kv", "gate_up"})
# Activations. Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022): between the blocks
# the residual stream ("batch", "seq", "embed") is split over "tensor" on its sequence axis, so
# layer norms, residual adds and the saved block inputs cost 1/T per device; GSPMD then all-gathers
# the sequence before each column-parallel matmul and reduce-scatters after each row-parallel one
# (the all-reduce of plain TP, split in its two halves). Inside a sublayer heads / mlp / vocab win
# the tensor axis (they come first), so "seq" is split only where nothing else is. Rows go over
# "data" and nothing else: a tensor group works on the same rows.
ACTIVATION_RULES = DEFAULT_RULES + (("seq", TENSOR), ("batch", DATA))
# Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses / ALST): the residual stream, norms and MLP run
# on T / sp positions of every row; q / k / v are pinned split on their heads instead, so GSPMD
# emits an all-to-all (sequence-split -> head-split) into each attention and one back out of it
# (the output projection reads the heads split and writes the sequence split). Each device then
# attends over whole rows for H / sp heads: packed rows and the blockwise attention need nothing
# more. Weights stay whole over "seq" (ZeRO shards them over "data" only).
SEQ_RULES = (("heads", SEQ), ("kv_heads", SEQ), ("seq", SEQ), ("batch", DATA))


def make_mesh(data: int | None = None, tensor: int = 1, devices: Sequence[Any] | None = None,
              pipe: int = 1, seq: int = 1) -> Mesh:
    """A ("data", "tensor") mesh over `devices` (default: all devices of all processes); with
    `pipe` > 1 (pipeline.stages) a ("data", "pipe", "tensor") mesh; with `seq` > 1
    (sequence_parallel_size) a ("data", "seq", "tensor") mesh.

    Axes are `AxisType.Auto` (GSPMD propagation): with explicit axes ordinary ops such as an
    embedding gather would need an `out_sharding` argument.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tensor < 1 or len(devices) % tensor:
        fits = [t for t in range(1, len(devices) + 1) if len(devices) % t == 0]
        raise ConfigError([f"tensor_parallel.autotp_size = {tensor}: the tensor axis must divide the "
                           f"{len(devices)} devices of the mesh; sizes that would work: {fits}"])
    if seq != 1:
        check_sequence_parallel(seq, len(devices), tensor=tensor, pipe=pipe)
    if pipe < 1 or len(devices) % (pipe * tensor):
        raise ValueError(f"pipe={pipe} (pipeline.stages) x tensor={tensor} must divide the {len(devices)} "
                         f"devices; stage counts that would: "
                         f"{[s for s in range(1, len(devices) + 1) if len(devices) % (s * tensor) == 0]}")
    inner = tensor * pipe * seq
    if data is None:
        data = len(devices) // inner
    if data * inner != len(devices):
        if data * inner > len(devices):
            raise ValueError(f"mesh data={data} x pipe={pipe} x seq={seq} x tensor={tensor} needs "
                             f"{data * inner} devices; "
                             f"only {len(devices)} are available")
        devices = devices[: data * inner]
    shape, names = ((data, pipe, tensor), (DATA, PIPE, TENSOR)) if pipe > 1 else ((data, tensor), AXES)
    if seq > 1:
        shape, names = (data, seq, tensor), (DATA, SEQ, TENSOR)
    axis_types = (AxisType.Auto,) * len(shape)
    if len(devices) == len(jax.devices()) and devices == list(jax.devices()):
        # jax.make_mesh picks a physical device order that keeps "tensor" neighbours close.
        return jax.make_mesh(shape, names, axis_types=axis_types)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names, axis_types=axis_types)


def check_sequence_parallel(sp, n_devices: int, *, tensor: int = 1, pipe: int = 1, heads: int | None = None,
                            kv_heads: int | None = None) -> None:
    """ConfigError (one line) unless `sequence_parallel_size` = sp can split `n_devices` and, where
    given, the model's query and key / value heads (each "seq" rank attends over whole rows for
    heads / sp of them)."""
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ConfigError([f"sequence_parallel_size = {sp!r}: an int >= 1 (1 = no sequence parallelism)"])
    if sp == 1:
        return
    if tensor > 1 or pipe > 1:
        raise ConfigError([f"sequence_parallel_size = {sp} with tensor_parallel.autotp_size = {tensor} and "
                           f"pipeline.stages = {pipe}: sequence parallelism runs beside the data axis only; "
                           "set the others to 1"])
    if n_devices % sp:
        fits = [s for s in range(1, n_devices + 1) if n_devices % s == 0]
        raise ConfigError([f"sequence_parallel_size = {sp} must divide the {n_devices} devices; sizes that "
                           f"would work: {fits}"])
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n is not None and n % sp:
            fits = [s for s in range(1, n_devices + 1) if n_devices % s == 0 and heads % s == 0
                    and (kv_heads or heads) % s == 0]
            raise ConfigError([f"sequence_parallel_size = {sp} must divide the model's {what} = {n} (each "
                               f"rank attends with heads / sequence_parallel_size heads); sizes that would "
                               f"work: {fits}"])


def seq_size(mesh: Mesh) -> int:
    return int(mesh.shape.get(SEQ, 1))


def pipe_size(mesh: Mesh) -> int:
    return int(mesh.shape.get(PIPE, 1))


def data_size(mesh: Mesh) -> int:
    """The data-parallel size: the "data" axis times the "expert" axis it may be split into."""
    return int(mesh.shape.get(DATA, 1)) * int(mesh.shape.get(EXPERT, 1))


def data_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The mesh axes rows are split over (a PartitionSpec entry): "data", or ("data", "expert")
    where expert parallelism split it."""
    return (DATA, EXPERT) if EXPERT in mesh.axis_names else DATA


def zero_axes(mesh: Mesh) -> dict[str, int]:
    """The axes ZeRO partitions over and their sizes (`zero_spec`'s n_data): the data-parallel ones."""
    return {DATA: int(mesh.shape.get(DATA, 1)), **({EXPERT: int(mesh.shape[EXPERT])} if EXPERT in mesh.axis_names
                                                   else {})}


def with_expert_axis(mesh: Mesh, ep: int) -> Mesh:
    """`mesh` with its "data" axis split into ("data", "expert") of sizes (data / ep, ep): each run of
    ep neighbouring data-parallel devices one expert-parallel group (DeepSpeed-MoE's layout)."""
    if EXPERT in mesh.axis_names:
        if mesh.shape[EXPERT] != ep:
            raise ConfigError([f"EngineOptions.ep_size = {ep} but the mesh's \"expert\" axis has "
                               f"{mesh.shape[EXPERT]} devices; make them equal (or pass a mesh without it)"])
        return mesh
    n = data_size(mesh)
    if ep < 1 or n % ep:
        raise ConfigError([f"EngineOptions.ep_size = {ep} must divide the data-parallel size {n} (expert-parallel "
                           f"groups of ep_size devices inside it); sizes that would work: "
                           f"{[e for e in range(1, n + 1) if n % e == 0]}"])
    i = mesh.axis_names.index(DATA)
    shape = mesh.devices.shape[:i] + (n // ep, ep) + mesh.devices.shape[i + 1:]
    names = mesh.axis_names[:i] + (DATA, EXPERT) + mesh.axis_names[i + 1:]
    return Mesh(mesh.devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def tensor_size(mesh: Mesh) -> int:
    return int(mesh.shape.get(TENSOR, 1))


def batch_world_size(mesh: Mesh) -> int:
    """The world size of DeepSpeed's batch rule: every rank of the data x tensor mesh.

    DeepSpeed 0.19.8 counts tensor ranks too (train_batch_size = micro x accumulation x all
    ranks), so a config filled for it loads unchanged. The global batch is split over "data"
    only: a tensor group of T devices works on micro x T rows together, which is micro rows'
    worth of FLOPs per device, and every row is trained on once.
    """
    return data_size(mesh) * tensor_size(mesh)


# ---------------------------------------------------------------------------------------------
# Logical axes -> mesh axes


def logical_axes(variable) -> tuple | None:
    """Logical axis names a flax Variable was annotated with, across flax versions."""
    get = getattr(variable, "get_metadata", None)
    meta = get() if get is not None else getattr(variable, "metadata", {}) or {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names:
            if isinstance(names, NamedSharding):
                names = names.spec
            return tuple(names)
    return None


def tensor_specs(state, mesh: Mesh, rules=None, *, tp=None, model_type: str | None = None,
                 stacked_prefixes: tuple[tuple[str, ...], ...] = ()) -> Any:
    """PartitionSpecs (tensor axes only) for every Variable of an `nnx.State`, as a pure dict.

    The result has the structure of `state.to_pure_dict()`; leaves without logical axes get P().
    `tp`: the config's `tensor_parallel` section; its `partition_config.layer_specs` (DeepSpeed's
    AutoTP patterns, matched against the dotted parameter path) come first, then the logical-axis
    rules unless `use_default_specs` is false. Checked: every split axis divides by the tensor
    size (ConfigError naming the parameter, its sizes and the tensor sizes that would work);
    logical names neither split nor known to stay whole are replicated with a warning.
    Parameters with no logical names get AutoTP's splits inferred from their names and shapes
    (`zerojax.sharding.autotp`); `stacked_prefixes`: the key paths of stacked block groups (their
    leaves lead with a layer axis, never split). With a tensor axis and nothing split at all, a
    ConfigError lists the parameters (half the devices would repeat the same work).
    """
    from flax import nnx

    layer_specs, use_defaults = _autotp_specs(tp)
    n_tensor = tensor_size(mesh)
    unknown: set[str] = set()
    bad: list[tuple[str, int, Any]] = []
    kept_whole: list[tuple[str, str, int]] = []

    # a model that names its axes is taken at its word (an unnamed leaf stays whole); AutoTP's
    # inference from parameter names is for a model that names none (a "layers" axis aside)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    named = any(n not in (None, "layers") for v in jax.tree.leaves(state, is_leaf=is_var)
                for n in (logical_axes(v) or ()))

    def spec_of(path, v):
        names = logical_axes(v)
        shape = tuple(getattr(v, "shape", ()) or getattr(getattr(v, "value", None), "shape", ()))
        if names is None and shape and any(dotted_keys(path)[:len(p)] == tuple(p) for p in stacked_prefixes):
            # a found stack's unnamed leaf (an nnx.vmap-built stack): its leading axis is the layers'
            # (pipeline stages split it as they split a named one)
            names = ("layers",) + (None,) * (len(shape) - 1)
        dotted = ".".join(dotted_keys(path))
        spec = None
        if n_tensor > 1:
            for entry in layer_specs:
                if entry.matches(dotted, model_type):
                    spec = entry.spec(shape, names)
                    break
        from_specs = spec is not None  # an explicit layer_specs split must divide (an error if not)
        if spec is None and n_tensor > 1 and use_defaults and not named:
            spec = _inferred_spec(dotted_keys(path), shape, names, stacked_prefixes, n_tensor, kept_whole)
        if spec is None:
            spec = logical_to_mesh(names, mesh, rules) if use_defaults else P()
            if n_tensor > 1 and use_defaults and names:
                known = {n for n, _ in (rules or DEFAULT_RULES)} | REPLICATED_NAMES | set(mesh.axis_names)
                unknown.update(str(n) for n in names if n is not None and n not in known)
        for i, axis in enumerate(spec):
            if axis == TENSOR and shape and shape[i] % n_tensor:
                logical = names[i] if names and i < len(names) else None
                if logical in SPLIT_IF_DIVISIBLE and not from_specs:
                    kept_whole.append((dotted, logical, shape[i]))
                    spec = P(*(None if j == i else a for j, a in enumerate(spec)))
                else:
                    bad.append((dotted, i, shape[i], logical))
        return spec

    specs = jax.tree_util.tree_map_with_path(spec_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if n_tensor > 1 and not named and not any(TENSOR in s
                                              for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        names = [".".join(dotted_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]]
        raise ConfigError([
            f"tensor_parallel.autotp_size = {n_tensor}: no parameter of this model is split over the tensor "
            f"axis (no logical axis names, no layer_specs match, and no name AutoTP knows among "
            f"{names[:12]}{' ...' if len(names) > 12 else ''}); name the projections as Hugging Face does "
            "(q_proj / k_proj / v_proj / o_proj, gate_proj / up_proj / down_proj), add "
            "tensor_parallel.partition_config.layer_specs, or set autotp_size 1"])
    if bad:
        n_dev = mesh.devices.size
        fits = [t for t in range(1, n_dev + 1)
                if n_dev % t == 0 and all(size % t == 0 for _, _, size, _ in bad)]
        raise ConfigError([
            f"tensor_parallel.autotp_size = {n_tensor}: {name} splits its axis {i}"
            + (f" ({logical!r})" if logical else "") + f" of size {size} over the tensor axis, and "
            f"{size} is not divisible by {n_tensor}; tensor sizes that would work on {n_dev} devices: {fits}"
            for name, i, size, logical in bad])
    kept_whole = [k for k in kept_whole if k[1] not in WHOLE_BY_DESIGN]
    if kept_whole:
        warnings.warn("tensor parallelism: " + "; ".join(
            f"{name}'s {logical!r} axis of size {size} is not divisible by tensor_parallel.autotp_size = "
            f"{n_tensor}, so it stays whole (replicated on every tensor rank)" for name, logical, size in kept_whole)
            + "; pad it to a multiple of the tensor size to split it (GPT-2: GPT2Config.make_vocab_size_divisible_by)",
            UserWarning, stacklevel=2)
    if unknown:
        warnings.warn(f"tensor parallelism: logical axis names {sorted(unknown)} have no tensor rule; "
                      "those axes stay replicated (add a tensor_parallel.partition_config.layer_specs "
                      "entry to split them)", UserWarning, stacklevel=2)
    return _pure(specs)


def dotted_keys(path) -> tuple[str, ...]:
    """A jax key path as plain string keys."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _inferred_spec(keys, shape, names, stacked_prefixes, n_tensor: int, kept_whole: list) -> P | None:
    """AutoTP's split of one unnamed parameter (`autotp.infer`) as a PartitionSpec; an axis the
    tensor size does not divide (a GQA kv-head count, an odd vocabulary) stays whole, noted in
    `kept_whole`."""
    stacked = bool(names and names[0] == "layers") or any(keys[:len(p)] == tuple(p) for p in stacked_prefixes)
    found = autotp.infer(keys, shape, stacked=stacked)
    if found is None or found.axis is None:
        return P(*([None] * len(shape))) if found is not None else None
    axis = found.axis + (1 if stacked else 0)
    if shape[axis] % n_tensor:
        if found.role == "vocab":
            kept_whole.append((".".join(keys), "vocab", shape[axis]))
        return P(*([None] * len(shape)))
    return P(*(TENSOR if i == axis else None for i in range(len(shape))))


class _LayerSpec(NamedTuple):
    """One `partition_config.layer_specs` entry (DeepSpeed's TPLayerSpec) applied to NNX params."""

    patterns: tuple
    partition_type: str
    partition_dim: int | None
    model_types: tuple | None

    def matches(self, dotted: str, model_type) -> bool:
        if self.model_types and str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
            return False
        return any(re.match(p, dotted) for p in self.patterns)

    def spec(self, shape, names) -> P:
        """column: a kernel's output (last) axis, a bias's only axis; row: a kernel's input (first)
        axis, a bias stays whole (added after the all-reduce); skip: whole. A leading "layers"
        axis (stacked blocks) is never split. `partition_dim` indexes the per-layer shape."""
        out = [None] * len(shape)
        start = 1 if names and names[0] == "layers" else 0
        own = len(shape) - start
        if self.partition_type == "skip" or own < 1:
            return P(*out)
        if self.partition_dim is not None:
            dim = self.partition_dim % own
        elif self.partition_type == "column":
            dim = own - 1
        elif own >= 2:
            dim = 0
        else:
            return P(*out)
        out[start + dim] = TENSOR
        return P(*out)


def _autotp_specs(tp) -> tuple[list[_LayerSpec], bool]:
    pc = getattr(tp, "partition_config", None) or {}
    specs = [_LayerSpec(tuple(e["patterns"]), str(e.get("partition_type", "column")).lower(),
                        e.get("partition_dim"), tuple(e["model_types"]) if e.get("model_types") else None)
             for e in pc.get("layer_specs") or ()]
    return specs, bool(pc.get("use_default_specs", True))


def _pure(state):
    # nnx.State.to_pure_dict() without requiring array leaves
    out = {}
    for key, value in state.items():
        if hasattr(value, "items"):
            out[key] = _pure(value)
        else:
            out[key] = variable_value(value)
    return out


def logical_to_mesh(names: Iterable | None, mesh: Mesh, rules=None) -> P:
    """Translate logical axis names with ordered rules; keep names that are mesh axes already.

    Rules are applied in order, each mesh axis to the first rule that claims it (not to the first
    name, as flax does): with ("heads", "tensor") before ("seq", "tensor") the q/k/v activation
    ("batch", "seq", "qkv", "heads", "head_dim") splits its heads, the residual stream its sequence.
    """
    if not names:
        return P()
    names = tuple(names)
    if rules is None:
        rules = DEFAULT_RULES if mesh.shape.get(TENSOR, 1) > 1 else ()
        if pipe_size(mesh) > 1:  # the stacked layers split into pipeline stages
            rules = (*rules, ("layers", PIPE))
    out: list = [None] * len(names)
    used = set()
    for i, name in enumerate(names):
        if name in mesh.axis_names and name not in used:
            used.add(name)
            out[i] = name if mesh.shape[name] > 1 else None
    for logical, mesh_axis in rules:
        if mesh_axis is None or mesh_axis in used or logical not in names:
            continue
        i = names.index(logical)
        if out[i] is None:
            used.add(mesh_axis)
            out[i] = mesh_axis if mesh.shape[mesh_axis] > 1 else None
    return P(*out)


def activation_constraint(mesh: Mesh, rules=None):
    """A model's activation hook, `constrain(x, logical_names) -> x`, or None without a tensor or
    a "seq" axis (rules: `SEQ_RULES` on a "seq" mesh, else `ACTIVATION_RULES`).

    Pins each named activation to the mesh axes its names map to (`ACTIVATION_RULES`: batch over
    "data", heads / mlp / vocab over "tensor", the residual stream's sequence over "tensor" where
    nothing else is), so GSPMD keeps Megatron's layout -- an all-gather before each column-parallel
    matmul, a reduce-scatter after each row-parallel one -- instead of choosing its own. An axis
    whose size the mesh axis does not divide (an odd vocabulary, a short sequence) stays whole.
    Without a tensor axis nothing is pinned (GSPMD's own choices are kept as they were).
    """
    if rules is None:
        rules = SEQ_RULES if seq_size(mesh) > 1 else ACTIVATION_RULES
    if tensor_size(mesh) <= 1 and seq_size(mesh) <= 1:
        return None

    def constrain(x, names):
        spec = [a if a is None or x.shape[i] % mesh.shape[a] == 0 else None
                for i, a in enumerate(logical_to_mesh(names, mesh, rules))]
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    return constrain


# ---------------------------------------------------------------------------------------------
# The ZeRO leaf rule


def zero_spec(shape: Sequence[int], base: P, n_data: int | dict, *, min_elements: int = 0) -> P:
    """Add the data-parallel axes to `base` on the largest dim divisible by their size not used by
    another axis. n_data: the "data" size, or {axis: size} (`zero_axes(mesh)`); axes `base` already
    uses are left out (an expert leaf split over "expert" is ZeRO-partitioned over "data" alone).

    Leaves with fewer than `min_elements` elements, or with no such dim, keep `base`.
    """
    shape = tuple(shape)
    spec = list(base) + [None] * (len(shape) - len(base))
    used = {a for s in spec for a in (s if isinstance(s, tuple) else (s,))}
    axes = {a: n for a, n in (n_data.items() if isinstance(n_data, dict) else ((DATA, n_data),))
            if a not in used and n > 1}
    n = math.prod(axes.values())
    if n <= 1 or not shape or math.prod(shape) < min_elements:
        return P(*spec)
    if DATA in used:
        return P(*spec)
    free = [i for i, d in enumerate(shape) if spec[i] is None and d % n == 0 and d > 0]
    if not free:
        return P(*spec)
    i = max(free, key=lambda i: (shape[i], -i))  # largest; the first of equals
    spec[i] = tuple(axes) if len(axes) > 1 else next(iter(axes))
    return P(*spec)


class StageShardings(NamedTuple):
    """Sharding trees (same structure as the params) for one ZeRO stage."""

    params: Any   # compute-dtype params
    grads: Any    # gradients and the accumulation buffer
    master: Any   # fp32 master weights (optimizer-state leaves with a param's shape follow these)


def _shapes(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def stage_specs(shapes, base_specs, stage: int, n_data: int | dict, *, persistence_threshold: int = 0):
    """PartitionSpec trees (params, grads, master) for `stage` from shapes and tensor-only specs."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage={stage!r}; accepted: 0, 1, 2, 3")
    def tree(on: bool, min_elements: int = 0):
        return jax.tree.map(
            lambda b, s: zero_spec(s, b, n_data if on else 1, min_elements=min_elements),
            base_specs, shapes, is_leaf=lambda x: isinstance(x, P),
        )

    return StageShardings(
        params=tree(stage >= 3, persistence_threshold),
        grads=tree(stage >= 2),
        master=tree(stage >= 1),
    )


def stage_shardings(
    abstract_params,
    mesh: Mesh,
    stage: int,
    *,
    base_specs=None,
    persistence_threshold: int = 0,
    memory_kind: str | None = None,
) -> StageShardings:
    """NamedSharding trees for params / grads / master of one stage.

    `abstract_params`: a tree of arrays or ShapeDtypeStructs. `base_specs`: a matching tree of
    PartitionSpecs over the non-"data" axes (e.g. `tensor_specs(nnx_state, mesh)`), or None.
    `memory_kind` applies to the master tree (and so to optimizer moments), e.g. "pinned_host".
    """
    shapes = _shapes(abstract_params)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    base = base_specs if base_specs is not None else jax.tree.map(lambda s: P(), shapes, is_leaf=is_shape)
    specs = stage_specs(shapes, base, stage, zero_axes(mesh), persistence_threshold=persistence_threshold)
    named = lambda tree, kind=None: jax.tree.map(  # noqa: E731
        lambda p: NamedSharding(mesh, p, memory_kind=kind), tree, is_leaf=lambda x: isinstance(x, P)
    )
    return StageShardings(named(specs.params), named(specs.grads), named(specs.master, memory_kind))


# ---------------------------------------------------------------------------------------------
# Optimizer state


def opt_state_shardings(
    tx, abstract_master, master_shardings, mesh: Mesh, *, memory_kind: str | None = None
):
    """Shardings for `tx.init(master)`: leaves shaped like a param take that param's sharding.

    Non-param leaves (step counts, loss scale, ...) are replicated on device. Uses
    `optax.tree_map_params` to find which state leaves mirror params; if a transform defeats that,
    falls back to matching by shape (the leaf rule applied to the leaf itself).
    """
    import optax

    abstract_state = jax.eval_shape(tx.init, abstract_master)
    replicated = NamedSharding(mesh, P())
    kind = lambda s: s if memory_kind is None else s.with_memory_kind(memory_kind)  # noqa: E731
    try:
        out = optax.tree_map_params(
            tx,
            lambda _, s: kind(s),
            abstract_state,
            master_shardings,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        if jax.tree.structure(out, is_leaf=lambda x: isinstance(x, NamedSharding)) == jax.tree.structure(
            abstract_state
        ):
            return _fix_mismatches(out, abstract_state, mesh, kind)
    except Exception:  # noqa: BLE001 - fall back to shape matching below
        pass
    return _by_shape(abstract_state, abstract_master, master_shardings, mesh, kind)


def _fix_mismatches(shardings, abstract_state, mesh, kind):
    # A sharding must divide its leaf; if a transform stored something else under a param's slot
    # (e.g. a factored second moment), re-derive from the leaf's own shape.
    def fix(s, x):
        try:
            s.shard_shape(tuple(x.shape))
            return s
        except Exception:  # noqa: BLE001
            return kind(NamedSharding(mesh, zero_spec(x.shape, P(), zero_axes(mesh))))

    return jax.tree.map(fix, shardings, abstract_state, is_leaf=lambda x: isinstance(x, NamedSharding))


def _by_shape(abstract_state, abstract_master, master_shardings, mesh, kind):
    by_shape: dict = {}
    for x, s in zip(jax.tree.leaves(abstract_master), jax.tree.leaves(master_shardings)):
        by_shape.setdefault((tuple(x.shape), x.dtype), s)
    n = zero_axes(mesh)

    def pick(x):
        if not getattr(x, "shape", ()):
            return NamedSharding(mesh, P())
        s = by_shape.get((tuple(x.shape), x.dtype))
        if s is None:
            s = NamedSharding(mesh, zero_spec(x.shape, P(), n))
        return kind(s)

    return jax.tree.map(pick, abstract_state)


def replicated(mesh: Mesh, tree) -> Any:
    """A replicated NamedSharding for every leaf of `tree`."""
    s = NamedSharding(mesh, P())
    return jax.tree.map(lambda _: s, tree)


def shard_nbytes(shape, dtype, sharding) -> int:
    """Bytes of one shard of an array of `shape` and `dtype` laid out by `sharding`."""
    return math.prod(sharding.shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def per_device_bytes(shapes_dtypes, shardings) -> int:
    """Bytes one device holds for a tree of (ShapeDtypeStruct-like, NamedSharding) pairs."""
    return sum(shard_nbytes(x.shape, x.dtype, s)
               for x, s in zip(jax.tree.leaves(shapes_dtypes), jax.tree.leaves(shardings)))


def held_bytes(tree, devices) -> int:
    """Bytes `devices` hold of the arrays (or abstract arrays with a sharding) in `tree`: one shard
    on each of them that an array's sharding names."""
    devices = set(devices)
    total = 0
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if sh is not None:
            total += len(sh.device_set & devices) * shard_nbytes(x.shape, x.dtype, sh)
    return total


__all__ = [
    "DATA", "TENSOR", "PIPE", "SEQ", "EXPERT", "data_axes", "zero_axes", "with_expert_axis", "SEQ_RULES",
    "DEFAULT_RULES", "ACTIVATION_RULES", "REPLICATED_NAMES",
    "SPLIT_IF_DIVISIBLE",
    "make_mesh",
    "data_size", "pipe_size", "seq_size", "check_sequence_parallel", "tensor_size", "batch_world_size",
    "tensor_specs", "activation_constraint",
    "logical_to_mesh", "zero_spec", "StageShardings", "stage_specs", "stage_shardings",
    "opt_state_shardings", "replicated", "shard_nbytes", "per_device_bytes", "held_bytes",
]
