"""The model contract: what the engine may ask of a model, and what it finds out for itself.

The engine knows no model by name. A model may tell it (docs/CONTRACTS.md, "The model contract"):
- `model_dims() -> ModelDims`: layers, width, heads, kv heads, head width, vocabulary, parameter
  counts, FLOPs per token (attention included), for the planner, the estimate and MFU;
- the block stack's hooks (`layer_scan`, `layer_fetch`, `remat_policy` attributes on the module
  that scans its stacked layers: zerojax.models' GPT-2 and Llama have them);
- logical axis names on its parameters (tensor rules); else AutoTP infers splits from names
  (`zerojax.sharding.autotp`);
- `count_tokens(batch)`: else the tokens of a batch are its `input_ids` (or first leaf) elements.

A model with none of it still gets what can be had, never a silent no-op (`find_blocks`):
- a Python list / `nnx.List` of blocks with one structure is stacked by the engine into a
  `StackedBlocks` (its leaves lead with a "layers" axis) that runs the blocks as one scan with
  the same hooks, so pipeline stages, parameter offload, stage-3 per-layer gathering and remat
  hang on it as on GPT-2's;
- an `nnx.vmap`-stacked block module run by the model's own `nnx.scan` gets the hooks through its
  block's class, swapped on the graph the engine traces (`hooked_block_class`): each layer's call
  fetched (parameter offload, stage-3 gathering) and rematted; for pipeline stages the model's scan
  is handed the whole stack as its one item and the swapped call runs every layer in stages, after
  a check on the traced program that the scan body only calls the block (`scans_block_alone`;
  else an error naming the `layer_scan` hook);
- dims come from the parameter tree (`infer_dims`).

Every stack runs its layers through `zerojax.models.layer_stack` (fetch, remat, the engine's layer
scans), the runner GPT-2 and the Llama family use too.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zerojax import block_loop
from zerojax._jax_compat import is_tracer, jaxpr_core, variable_metadata

# the one layer-stack runner and remat vocabulary GPT-2 and the Llama family use too
from zerojax.models.layer_stack import (
    GENERIC_REMAT_POLICIES,
    LAYER_INPUT,
    layer_step,
    remat_policy,
    run_layers,
    segment_length,
    segment_policy,
)

jex = jaxpr_core()  # jax.extend.core: Jaxpr, Var, jaxprs_in_params

logger = logging.getLogger("zerojax")

LAYERS = "layers"   # the logical name of a stacked layer axis
HOOKS = ("layer_scan", "layer_fetch")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the planner and MFU need of a decoder-only language model (0 where unknown)."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int          # every parameter
    layer_params: int    # one block's
    mlp: int = 0         # the MLP's hidden width (each expert's, for a mixture of experts)
    experts: int = 0     # a mixture of experts' experts a layer (0: a dense MLP)
    top_k: int = 0       # ... and the experts each token runs

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N (forward 2N, backward 4N) plus causal-agnostic attention
        scores and values, 12 x layers x (heads x head_dim) x seq_len (Kaplan / PaLM's count)."""
        width = self.heads * self.head_dim or self.d_model
        return 6.0 * self.params + 12.0 * self.layers * width * seq_len


@dataclasses.dataclass(frozen=True)
class BlockStack:
    """Where a model's repeated blocks are. kind: "hooked" (the model scans its own stacked layers
    and has the hooks), "list" (same-structure modules in a list: the engine stacks them),
    "stacked" (an `nnx.vmap`-built module whose leaves lead with the layer axis, no hooks)."""

    path: tuple[str, ...]
    kind: str
    layers: int


# ------------------------------------------------------------------------------ finding the blocks


def _param_shapes(module) -> list[tuple[tuple, tuple]]:
    state = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    return [(tuple(str(getattr(k, "key", k)) for k in path), tuple(v.shape))
            for path, v in jax.tree_util.tree_flatten_with_path(state)[0]]


def _names(v) -> tuple | None:
    meta = variable_metadata(v)
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(names) if names else None


def _modules(module):
    """(key path, submodule) of every module in `module`'s graph, the root first."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            yield tuple(str(k) for k in path), node


def _is_block_list(value) -> bool:
    if not isinstance(value, (list, tuple, nnx.List)) or len(value) < 2:
        return False
    if not all(isinstance(b, nnx.Module) for b in value):
        return False
    first = _param_shapes(value[0])
    return bool(first) and all(type(b) is type(value[0]) and _param_shapes(b) == first for b in value[1:])


# flax layers whose unstacked parameter shapes are known from their attributes
def _expected_shapes(m) -> dict[str, tuple] | None:
    if isinstance(m, nnx.Linear):
        return {"kernel": (m.in_features, m.out_features)}
    if isinstance(m, (nnx.LayerNorm, nnx.RMSNorm)):
        return {"scale": (m.num_features,)}
    if isinstance(m, nnx.Embed):
        return {"embedding": (m.num_embeddings, m.features)}
    return None


def _vmapped_layers(module) -> int:
    """L if every parameter of `module` leads with an extra axis of size L beyond what its flax
    layers (Linear, LayerNorm, RMSNorm, Embed) would create, else 0: an `nnx.vmap`-built stack."""
    found = 0
    for _, m in _modules(module):
        expected = _expected_shapes(m)
        if not expected:
            continue
        for name, shape in expected.items():
            v = getattr(m, name, None)
            if v is None:
                continue
            actual = tuple(v.shape)
            if len(actual) != len(shape) + 1 or actual[1:] != shape:
                return 0
            if found and actual[0] != found:
                return 0
            found = actual[0]
    if not found:
        return 0
    return found if all(s[:1] == (found,) for _, s in _param_shapes(module)) else 0


def find_blocks(module) -> BlockStack | None:
    """The model's block stack, or None (see the module docstring for the kinds)."""
    for path, m in _modules(module):
        if any(h in vars(m) for h in HOOKS):
            layers = [v.shape[0] for v in jax.tree.leaves(nnx.state(m, nnx.Param),
                                                          is_leaf=lambda x: isinstance(x, nnx.Variable))
                      if (_names_of_leaf(v) or (None,))[0] == LAYERS]
            if layers:
                return BlockStack(path, "hooked", int(layers[0]))
        if isinstance(m, StackedBlocks):
            return BlockStack(path, "hooked", m.layers)
    for path, m in _modules(module):
        for name, value in vars(m).items():
            if _is_block_list(value):
                return BlockStack(path + (name,), "list", len(value))
    stacked = [(len(path), path, n) for path, m in _modules(module) if path and (n := _vmapped_layers(m)) >= 2]
    if stacked:  # the outermost such module
        _, path, n = min(stacked)
        return BlockStack(path, "stacked", n)
    return None


def _names_of_leaf(v):
    return _names(v) if isinstance(v, nnx.Variable) else None


def stacked_prefixes(module) -> tuple[tuple[str, ...], ...]:
    """Key paths of the parameter groups that lead with a layer axis (for the offload layout and
    AutoTP): every Param named with a leading "layers" axis, else the found stack."""
    named = []
    state = nnx.state(module, nnx.Param)
    for path, v in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        if (_names_of_leaf(v) or (None,))[0] == LAYERS:
            named.append(tuple(str(getattr(k, "key", k)) for k in path))
    if named:
        return tuple(named)
    stack = find_blocks(module)
    return (stack.path,) if stack is not None and stack.kind == "stacked" else ()


def stacked_flags(abstract_params: dict, prefixes) -> Any:
    """A tree of bools like the pure-dict `abstract_params`: True where a leaf's path starts with
    one of `prefixes`."""
    def flag(path, _):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        return any(keys[:len(p)] == tuple(p) for p in prefixes)
    return jax.tree_util.tree_map_with_path(flag, abstract_params)


# ------------------------------------------------------------------------------ stacking a list


def remat_policy_fn(name):
    """The `jax.checkpoint` policy of a generic remat policy name (`GENERIC_REMAT_POLICIES`, and
    the engine's "except_fetched"), else the error naming them."""
    policy = remat_policy(name)
    if policy is None:
        raise ValueError(f"remat_policy={name!r}: a block stack found by zerojax takes one of "
                         f"{GENERIC_REMAT_POLICIES[1:]} (\"segments_<k>\" too; the \"save_*\" policies need the "
                         "model's own tags)")
    return policy


# a forward pass in progress through a StackedBlocks (by id): (next index, result, args, kwargs);
# outside the module's graph, since it holds traced values
_PENDING: dict[int, tuple] = {}


class StackedBlocks(nnx.Module):
    """Same-structure blocks as one module whose variables lead with a "layers" axis, run as one
    `jax.lax.scan`. It stands in for the model's list: the model's own loop
    `for layer in self.layers: x = layer(x, *args)` calls the first item, which runs every layer
    (through `layer_scan` / `layer_fetch` / `remat_policy` as the engine set them, as GPT-2 does),
    and the other items hand that result on. Each checks that it was called with the result of
    the one before and the same other arguments, so a model that works between its blocks gets an
    error, never a wrong result. State a block changes while running (an RNG counter) is not
    written back."""

    # layers per iteration of the plain scan (no hook set); None: every layer unrolled, as the
    # model's own Python loop ran them, without remat (measured on one H200, Qwen3-0.6B's shape
    # as 28 listed blocks, micro 4 x 1024: 49,925 tokens/s unrolled, 37,817 one block a loop
    # iteration, the model's own loop under plain jax.jit 47,109), and one a loop iteration with
    # remat (unrolled, XLA merges the recomputation back into the forward and the peak stays)
    scan_unroll = None

    def __init__(self, blocks):
        graphdef, *_ = nnx.split(blocks[0])
        states = [nnx.split(b)[1] for b in blocks]

        def stack(*vs):
            names = _names(vs[0]) or (None,) * jnp.ndim(vs[0].get_value())
            return vs[0].replace(jnp.stack([v.get_value() for v in vs]), out_sharding=(LAYERS,) + tuple(names),
                                 eager_sharding=False)

        self.block = nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))
        self.layers = len(blocks)
        self.layer_fetch = None    # set by the engine: each layer's params moved where they are used
        self.layer_scan = None     # set by the engine: pipeline stages / offload's prefetching scan
        self.remat_policy = None   # set by the engine from activation_checkpointing

    def __len__(self):
        return self.layers

    def __iter__(self):
        return (self[i] for i in range(self.layers))

    def __getitem__(self, i):
        if isinstance(i, slice):
            raise TypeError("the engine runs this model's blocks as one scan (zerojax.model.StackedBlocks); "
                            "a slice of them cannot run alone: loop over all of them")
        return functools.partial(self._call, range(self.layers)[i])

    def _call(self, i, x, *args, **kwargs):
        if i == 0:
            out = self._run(x, args, kwargs)
            _PENDING[id(self)] = (1, out, args, kwargs)
            return out
        pending = _PENDING.pop(id(self), None)
        carried = None if pending is None else (pending[1][0] if isinstance(pending[1], tuple) else pending[1])
        if pending is None or pending[0] != i or x is not carried or not (
                _same(args, pending[2]) and _same(kwargs, pending[3])):
            raise ValueError(
                f"{type(self.block).__name__} block {i} was not called with block {i - 1}'s output and the "
                "same other arguments: zerojax runs a list of blocks as one scan (x = layer(x, *args) for "
                "each in turn, nothing in between). Give the model the layer_scan hook instead "
                "(docs/CONTRACTS.md, \"The model contract\")")
        if i + 1 < self.layers:
            _PENDING[id(self)] = (i + 1,) + pending[1:]
        return pending[1]

    def _run(self, x, args, kwargs):
        graphdef, params, rest = nnx.split(self.block, nnx.Param, ...)
        fetch = self.layer_fetch
        if fetch is not None:  # the engine's hooks see this module's stacked subtree as {"block": params}
            fetch = lambda p, f=fetch: f({"block": p})["block"]  # noqa: E731
        unroll = self.scan_unroll
        if unroll is None:  # see scan_unroll
            unroll = 1 if self.remat_policy is not None or fetch is not None else self.layers
        return _run_stack(graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest), x, args, kwargs,
                          policy=self.remat_policy, fetch=fetch, layer_scan=self.layer_scan, unroll=unroll)


def _run_stack(graphdef, params, rest, x, args, kwargs, *, policy, fetch, layer_scan, unroll=1,
               call=lambda block, *a, **k: block(*a, **k)):
    """`x` through every layer of a stacked block (`params` and its other state `rest`, leaves
    [L, ...]) as the engine's hooks ask (`layer_stack.run_layers`), each layer called as
    `call(block, h, *args, **kwargs)`. A block that returns a tuple carries its first element, and
    the result is then (h, None, ...)."""
    # the block's output structure, from one layer's shapes (no memory kind: host-resident
    # layers are fetched only inside the scan)
    one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)  # noqa: E731
    shape = jax.eval_shape(lambda p, r: call(nnx.merge(graphdef, p, r), x, *args, **kwargs), one(params), one(rest))
    tupled = isinstance(shape, tuple)
    if layer_scan is None and jax.tree.leaves(rest):
        # the plain scan hands each layer its own other state (an RNG key); the engine's layer
        # scans take the parameters alone, and every layer sees layer 0's
        layers, parts = (params, rest), lambda pr: pr  # noqa: E731
        if fetch is not None:
            fetch = lambda pr, f=fetch: (f(pr[0]), pr[1])  # noqa: E731
    else:
        layers, first = params, jax.tree.map(lambda a: a[0], rest)
        parts = lambda p: (p, first)  # noqa: E731

    def run(h, layer, a, k):
        out = call(nnx.merge(graphdef, *parts(layer)), h, *a, **k)
        return out[0] if tupled else out

    body, x = _layer_body(run, x, args, kwargs, rows=layer_scan is not None and fetch is None)
    h = run_layers(body, x, layers, policy=policy, fetch=fetch, layer_scan=layer_scan, policy_fn=remat_policy_fn,
                   unroll=unroll)
    return (h,) + (None,) * (len(shape) - 1) if tupled else h


def _layer_body(run, x, args, kwargs, *, rows: bool):
    """(body(h, layer) -> h, the layer scan's input) for a block called as `run(h, layer, args,
    kwargs)`, its input named LAYER_INPUT (the "offload" remat policy moves it to host memory).
    rows (pipeline stages): the arguments that are arrays with x's leading (row) axis -- positions,
    segment ids -- travel with their micro-batch through the stages: the input is then (x, those
    arrays) and body takes that pair; the other arguments are the same for every row."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    per_row = [rows and isinstance(a, jax.Array) and a.ndim >= 1 and a.shape[0] == x.shape[0] for a in leaves]
    if not any(per_row):
        return (lambda h, p: run(checkpoint_name(h, LAYER_INPUT), p, args, kwargs)), x

    def body(hs, p):
        it = iter(hs[1])
        a, k = treedef.unflatten([next(it) if r else a for a, r in zip(leaves, per_row)])
        return run(checkpoint_name(hs[0], LAYER_INPUT), p, a, k)

    return body, (x, tuple(a for a, r in zip(leaves, per_row) if r))


def _same(a, b) -> bool:
    """Whether two call arguments are the same: arrays by identity, Python values by equality."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, jax.Array) or is_tracer(a) or isinstance(b, jax.Array) or is_tracer(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object whose equality is not a bool
        return False


def stack_blocks(module) -> nnx.Module:
    """`module` with a found list of blocks replaced by a `StackedBlocks` (a new module object
    sharing the other variables; `module` itself is left as it was). Unchanged without a list, and
    where the model's loop is not provably `x = layer(x, *same args)` over blocks holding only
    parameters (`zerojax.block_loop`): stacking is an optimisation, the model then runs as written
    (one log line says why; features that need the stack name the line in their error)."""
    stack = find_blocks(module)
    if stack is None or stack.kind != "list":
        return module
    refusal = block_loop.why_not(module, stack.path)
    if refusal is not None:
        _log_unstacked(type(module).__name__, stack, refusal)
        return module
    graphdef, state = nnx.split(module)
    module = nnx.merge(graphdef, state)
    parent = module
    for key in stack.path[:-1]:
        parent = parent[int(key)] if isinstance(parent, (list, nnx.List)) else getattr(parent, key)
    blocks = getattr(parent, stack.path[-1])
    setattr(parent, stack.path[-1], StackedBlocks(list(blocks)))
    return module


_LOGGED: set = set()


def _log_unstacked(model: str, stack: BlockStack, refusal) -> None:
    key = (model, stack.path, str(refusal))
    if key not in _LOGGED:  # once a model: planners and abstract engines build it again
        _LOGGED.add(key)
        logger.warning("zerojax runs %s's %d blocks (%s) as the model's own loop, not as one scan: %s",
                       model, stack.layers, ".".join(stack.path), refusal)


def unstacked_list_note(module) -> str:
    """For an error of a feature that needs the block stack: why a found list of blocks was left as
    the model's own loop, and the fix; "" where there is no such list."""
    stack = find_blocks(module)
    if stack is None or stack.kind != "list":
        return ""
    refusal = block_loop.why_not(module, stack.path)
    if refusal is None:
        return ""
    return f" zerojax left its list of blocks `{'.'.join(stack.path)}` unstacked: {refusal}; " + \
        block_loop.FIX.format(name=".".join(stack.path))


def remat_block_class(cls, policy):
    """A subclass of a listed block's class `cls` whose call is rematerialised with `policy`
    through `nnx.remat`, which carries Variables the block is handed or holds (a cache it writes)
    in and out of the checkpointed function, as the block's own call would."""
    base = getattr(cls, "_zerojax_block", cls)
    checkpointed = nnx.remat(lambda block, *a, **k: base.__call__(block, *a, **k), policy=remat_policy_fn(policy))

    def __call__(self, *args, **kwargs):
        return checkpointed(self, *args, **kwargs)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__, "_zerojax_block": base,
                                         "_zerojax_policy": policy})


def hooked_block_class(cls, *, policy=None, fetch=None, layer_scan=None, whole_ndim=None):
    """A subclass of the block class `cls` of an `nnx.vmap`-built stack (run by the model's own
    `nnx.scan`, one layer's slice per call) whose call applies the engine's hooks to that slice:
    `fetch` to its params (offload_param's host -> device copy, ZeRO-3's gather), inside a remat
    with `policy` (`layer_stack.layer_step`). With `layer_scan` (pipeline stages), a call that
    gets the whole stack -- params of `whole_ndim` dims, which the engine hands the model's scan
    as its one item -- runs every layer through it instead. One class per engine: the graph the
    engine traces carries it, the user's module never does."""
    base = getattr(cls, "_zerojax_block", cls)
    call = base.__call__

    def __call__(self, *args, **kwargs):
        graphdef, params, rest = nnx.split(self, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        if args and layer_scan is not None and jax.tree.leaves(params)[0].ndim == whole_ndim:
            return _run_stack(graphdef, params, rest, args[0], args[1:], kwargs, policy=policy, fetch=None,
                              layer_scan=layer_scan, call=call)

        def body(a, p):  # the block's input (its first argument) named inside the remat: "offload" moves it
            a = (checkpoint_name(a[0], LAYER_INPUT), *a[1:]) if a else a
            return call(nnx.merge(graphdef, p, rest), *a, **kwargs)

        return layer_step(body, policy=policy, fetch=fetch, policy_fn=remat_policy_fn)(args, params)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__, "_zerojax_block": base,
                                         "_zerojax_policy": policy})


def scans_block_alone(forward, model, path, whole_ndim) -> bool:
    """Whether `forward(model)` runs the `nnx.vmap`-stacked block at `path`, handed whole (params
    of `whole_ndim` dims, as the engine hands it for pipeline stages), as the whole body of a
    one-item scan: carry in, `block(carry, ...)`, carry out, nothing else around it (remat or jit
    wrappers aside). Only then does running every layer in that one call equal the model's own
    loop. Read off the traced program (nothing runs), the block's call replaced by a marker: what a
    model's scan does around its block shows nowhere else."""
    graphdef, state = nnx.split(model)

    def marker(body, x, layers, fetch):  # the stages' stand-in: the hidden states, marked
        return jax.lax.optimization_barrier(x[0] if isinstance(x, tuple) else x)

    def probe(state):  # the model built inside the trace: nnx refuses variables of an outer one
        module = nnx.merge(graphdef, state)
        block = at(module, path)
        marked = hooked_block_class(type(block), layer_scan=marker, whole_ndim=whole_ndim)
        object.__setattr__(block, "__class__", marked)
        return forward(module)

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), nnx.to_pure_dict(state))
    return _scans_marker_alone(jax.make_jaxpr(probe)(shapes).jaxpr)


def _scans_marker_alone(jaxpr) -> bool:
    """Whether some one-item scan in `jaxpr` (or in a program it calls) maps a carry to itself
    through the marker alone (`_marker_links`)."""
    for e in jaxpr.eqns:
        if e.primitive.name == "scan" and e.params["length"] == 1:
            consts, carry = e.params["num_consts"], e.params["num_carry"]
            if any((consts + k, k) in _marker_links(e.params["jaxpr"].jaxpr) for k in range(carry)):
                return True
        if any(_scans_marker_alone(sub) for sub in jex.jaxprs_in_params(e.params)):
            return True
    return False


def _marker_links(jaxpr) -> set[tuple[int, int]]:
    """(input i, output j) of `jaxpr` where output j is the marker (an optimization_barrier) of
    input i, directly or through calls that hand their operands on as they are (jit, remat)."""
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    is_input = lambda v: isinstance(v, jex.Var) and v in inputs  # noqa: E731
    marked = {}  # var -> the input it marks
    for e in jaxpr.eqns:
        sub = e.params.get("jaxpr")
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's program
        if e.primitive.name == "optimization_barrier" and len(e.invars) == 1 and is_input(e.invars[0]):
            marked[e.outvars[0]] = inputs[e.invars[0]]
        elif e.primitive.name != "scan" and isinstance(sub, jex.Jaxpr) and len(sub.invars) == len(e.invars):
            for i, j in _marker_links(sub):
                if is_input(e.invars[i]):
                    marked[e.outvars[j]] = inputs[e.invars[i]]
    return {(marked[v], j) for j, v in enumerate(jaxpr.outvars) if isinstance(v, jex.Var) and v in marked}


def remat_modules(module, policy) -> list[tuple[Any, str, Any]]:
    """(module, attribute, value) settings that apply the remat `policy` to `module`'s block stack
    (the engine sets them on its own copy of the graph): a `remat_policy` attribute where a module
    has one (GPT-2, Llama, `StackedBlocks`), else the stacked block's class swapped for one whose
    call is rematerialised (an `nnx.vmap`-built stack). Raises where there is no stack."""
    owners = [m for _, m in _modules(module) if "remat_policy" in vars(m)]
    for m in owners:
        if isinstance(m, StackedBlocks):  # a generic name, or the error naming them (now, not when traced)
            _check_stack_policy(policy, m.layers)
    if owners:
        return [(m, "remat_policy", policy) for m in owners]
    stack = find_blocks(module)
    if stack is None:
        raise ValueError(
            f"activation_checkpointing: remat_policy {policy!r} needs the model's repeated blocks, and "
            f"{type(module).__name__} shows none (no list of same-structure blocks, no nnx.vmap-stacked "
            "layer, no `remat_policy` attribute); add a `remat_policy` attribute its block scan reads "
            "(docs/CONTRACTS.md) or remove the activation_checkpointing section")
    if segment_policy(policy) is not None:
        raise ValueError(
            f"activation_checkpointing: remat_policy {policy!r} (two-level: segments of layers) needs the layer scan "
            f"zerojax runs, and {type(module).__name__} runs its blocks itself ({stack.kind}: one layer a call); "
            "use \"full\" or \"offload\", or give the model the layer_scan hook (docs/CONTRACTS.md)")
    remat_policy_fn(policy)  # a generic name, or the error naming them
    target = at(module, stack.path)
    if stack.kind == "list":  # left as the model's own loop (`stack_blocks`): each block rematted as it is called
        swapped = remat_block_class(type(target[0]), policy)
        return [(block, "__class__", swapped) for block in target]
    return [(target, "__class__", hooked_block_class(type(target), policy=policy))]


def _check_stack_policy(policy, layers: int) -> None:
    """A policy a `StackedBlocks` of `layers` blocks runs: a two-level one whose segments fit, or a
    generic name; else the error naming them."""
    if segment_policy(policy) is not None:
        segment_length(policy, layers)
    else:
        remat_policy_fn(policy)


def at(module, path):
    """The submodule of `module` at the key `path`."""
    node = module
    for key in path:
        node = node[int(key)] if isinstance(node, (list, nnx.List)) else getattr(node, key)
    return node


# ------------------------------------------------------------------------------ dims


def model_dims(module) -> ModelDims:
    """The model's `model_dims()` if it has one, else `infer_dims`."""
    own = getattr(module, "model_dims", None)
    return own() if callable(own) else infer_dims(module)


def _axis_sizes(module) -> dict[str, int]:
    """Logical axis name -> size, from every named Param."""
    sizes: dict[str, int] = {}
    for v in jax.tree.leaves(nnx.state(module, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        for name, size in zip(_names_of_leaf(v) or (), v.shape):
            if name is not None:
                sizes.setdefault(str(name), int(size))
    return sizes


_MLP_UP = ("gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "fc_in", "gate", "up")
_HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "heads", "n_heads")
_KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_heads", "n_kv_head")


def infer_dims(module) -> ModelDims:
    """Dims read off the parameter tree: layers from the block stack, width and vocabulary from
    the token embedding, heads from logical names ("heads", "head_dim", "kv_heads"), from
    [d, heads, head_dim] q / k kernels, or from a heads attribute; 0 where nothing says."""
    from zerojax.sharding import autotp

    shapes = _param_shapes(module)
    params = sum(math.prod(s) for _, s in shapes)
    stack = find_blocks(module)
    layers = stack.layers if stack else 0
    in_stack = [s for p, s in shapes if stack and p[:len(stack.path)] == stack.path]
    if stack and stack.kind == "list":
        in_stack = [s for p, s in shapes if p[:len(stack.path)] == stack.path]
        layer_params = sum(math.prod(s) for s in in_stack) // max(layers, 1)
    elif stack and stack.kind == "hooked":
        named = [v for v in jax.tree.leaves(nnx.state(module, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
                 if (_names_of_leaf(v) or (None,))[0] == LAYERS]
        layer_params = sum(math.prod(v.shape) for v in named) // max(layers, 1)
    else:
        layer_params = sum(math.prod(s) for s in in_stack) // max(layers, 1)
    sizes = _axis_sizes(module)
    vocab, d = sizes.get("vocab", 0), sizes.get("embed", 0)
    if not vocab:
        emb = [s for p, s in shapes if len(s) == 2 and p and (p[-1] in ("embedding", "wte", "embed_tokens") or (
            len(p) > 1 and p[-2] in autotp.EMBEDDING_NAMES))]
        if emb:
            vocab, d = max(emb)
    heads, head_dim = sizes.get("heads", 0), sizes.get("head_dim", 0)
    kv = sizes.get("kv_heads", 0) or sizes.get("kv", 0)
    for path, s in shapes:
        own = s[1:] if stack and stack.kind != "list" and path[:len(stack.path)] == stack.path else s
        if len(path) > 1 and len(own) == 3 and path[-1] == "kernel":
            if path[-2] in ("q_proj", "q", "query", "wq") and not heads:
                heads, head_dim = own[1], own[2]
            if path[-2] in ("k_proj", "k", "key", "wk") and not kv:
                kv = own[1]
    if not heads:
        for _, m in _modules(module):
            found = next((getattr(m, a) for a in _HEAD_ATTRS if isinstance(getattr(m, a, None), int)), 0)
            if found:
                heads = found
                kv = kv or next((getattr(m, a) for a in _KV_ATTRS if isinstance(getattr(m, a, None), int)), 0)
                break
    if heads and not head_dim and d:
        head_dim = d // heads
    mlp = sizes.get("mlp", 0)
    for path, s in shapes if not mlp else ():
        own = s[1:] if stack and stack.kind != "list" and path[:len(stack.path)] == stack.path else s
        if len(path) > 1 and path[-1] == "kernel" and len(own) == 2 and path[-2] in _MLP_UP:
            mlp = own[1]
            break
    experts, top_k = _experts_of(module, sizes)
    return ModelDims(layers=layers, d_model=d, heads=heads, kv_heads=kv or heads, head_dim=head_dim,
                     vocab=vocab, params=params, layer_params=layer_params, mlp=mlp, experts=experts, top_k=top_k)


_TOP_K_ATTRS = ("num_experts_per_tok", "top_k", "moe_top_k", "num_selected_experts")


def _experts_of(module, sizes: dict) -> tuple[int, int]:
    """(experts a layer, experts a token runs) of a mixture of experts: the size of the logical
    "experts" axis and a top-k attribute of the model, its config or a module (Hugging Face's
    `num_experts_per_tok`); (0, 0) for a dense model."""
    experts = sizes.get("experts", 0)
    if not experts:
        return 0, 0
    owners = [module, getattr(module, "config", None)] + [m for _, m in _modules(module)]
    top_k = next((getattr(o, a) for o in owners for a in _TOP_K_ATTRS if isinstance(getattr(o, a, None), int)), 0)
    return experts, top_k or experts


def count_tokens(module, batch) -> int:
    """Tokens in `batch`: the model's `count_tokens(batch)` if it has one, else the elements of
    `input_ids` (or of the batch's first leaf)."""
    own = getattr(module, "count_tokens", None) if module is not None else None
    if callable(own):
        return int(own(batch))
    if isinstance(batch, dict) and "input_ids" in batch:
        return math.prod(batch["input_ids"].shape)
    leaf = jax.tree.leaves(batch)[0]
    return math.prod(leaf.shape[:2]) if leaf.ndim >= 2 else leaf.shape[0]


__all__ = ["ModelDims", "BlockStack", "StackedBlocks", "find_blocks", "stack_blocks", "stacked_prefixes",
           "stacked_flags", "remat_modules", "hooked_block_class", "remat_block_class", "unstacked_list_note",
           "scans_block_alone", "at", "remat_policy_fn", "model_dims", "infer_dims", "count_tokens",
           "GENERIC_REMAT_POLICIES"]
