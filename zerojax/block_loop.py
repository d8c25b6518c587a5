"""Whether the engine may run a model's list of blocks as one scan: a proof from the model's source.

Stacking a list of blocks into one scan (`zerojax.model.StackedBlocks`) is an optimisation: it
equals the model's own loop only when that loop is `x = layer(x, *args)` with the same `args`
for every layer and blocks that hold nothing but parameters. A loop that hands each layer its
own input (a per-layer cache, `caches[i]`), writes state (a KV cache Variable, an RNG counter),
or works between the blocks computes something else as one scan -- or fails inside it
(flax's `TraceContextError`). The check reads the source of the classes on the path to the list:
every use of the list outside `__init__` must be such a loop; anything it cannot prove (no
source, the list indexed, a call among the arguments) keeps the model as it is.

`why_not(module, path)` returns None where stacking is proven safe, else a `Refusal` naming the
file, line and code that prevents it; the engine logs it, and a feature that needs the stack
(pipeline stages, per-layer parameter offload) puts it in its error.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a list of blocks is not run as one scan: `reason`, and where (`file`, `line`, `code`)."""

    reason: str
    file: str = ""
    line: int = 0
    code: str = ""

    def __str__(self):
        where = f" ({self.file}:{self.line}: `{self.code}`)" if self.file else ""
        return self.reason + where


FIX = ("to have it stacked, loop as `for layer in self.{name}: x = layer(x, *same_args)` with blocks that hold "
       "only parameters, or give the model the `layer_scan` hook (docs/CONTRACTS.md)")


def why_not(module, path: tuple[str, ...]) -> Refusal | None:
    """None where the list of blocks at `path` in `module` may run as one scan, else why not."""
    blocks = _at(module, path)
    state = [p for p, _ in jax.tree_util.tree_flatten_with_path(
        nnx.state(blocks[0], nnx.Not(nnx.Param)), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]]
    if state:
        names = ", ".join(jax.tree_util.keystr(p) for p in state[:3])
        return Refusal(f"its blocks hold state besides their parameters ({names}), which one scan would not "
                       "write back")
    found = False
    for depth in range(len(path)):  # every module on the way to the list may use it
        owner, chain = _at(module, path[:depth]), path[depth:]
        if not all(isinstance(k, str) and k.isidentifier() for k in chain):
            continue  # reached through a list index: not an attribute chain in the source
        for cls in _own_classes(type(owner)):
            refusal, uses = _check_class(cls, chain)
            if refusal is not None:
                return refusal
            found = found or uses
    if not found:
        return Refusal(f"no loop over `self.{'.'.join(path)}` was found in the model's source")
    return None


def _at(module, path):
    node = module
    for key in path:
        node = node[int(key)] if isinstance(node, (list, tuple, nnx.List)) else getattr(node, key)
    return node


def _own_classes(cls):
    """`cls` and its bases that are not flax's or Python's own (their methods are the model's code)."""
    for c in cls.__mro__:
        if c.__module__.split(".")[0] not in ("flax", "builtins", "abc", "typing"):
            yield c


def _check_class(cls, chain) -> tuple[Refusal | None, bool]:
    """(why the methods of `cls` prevent stacking `self.<chain>`, or None; whether they use it)."""
    try:
        lines, first = inspect.getsourcelines(cls)
        file = inspect.getsourcefile(cls) or "?"
    except (OSError, TypeError):
        return Refusal(f"the source of {cls.__name__} is not available to check its loop"), False
    tree = ast.parse(textwrap.dedent("".join(lines)))
    where = lambda node: dict(file=file, line=first + node.lineno - 1,  # noqa: E731
                              code=lines[node.lineno - 1].strip())
    uses = False
    for method in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if method.name == "__init__":
            continue  # builds the list; runs before the engine stacks it
        loops = {}
        for node in ast.walk(method):
            if isinstance(node, ast.For):
                loops[id(node.iter)] = node
                if isinstance(node.iter, ast.Call) and node.iter.args:
                    loops[id(node.iter.args[0])] = node  # enumerate(self.layers), zip(self.layers, ...)
        for node in ast.walk(method):
            if not _is_chain(node, chain):
                continue
            uses = True
            loop = loops.get(id(node))
            problem = "the list is used other than as a loop's sequence" if loop is None else _loop_problem(loop, node)
            if problem:
                return Refusal(f"{cls.__name__}.{method.name}: {problem}", **where(loop or node)), uses
    return None, uses


def _is_chain(node, chain) -> bool:
    """Whether `node` is `self.<chain[0]>.<chain[1]>...` (read)."""
    for name in reversed(chain):
        if not (isinstance(node, ast.Attribute) and node.attr == name):
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def _loop_problem(loop: ast.For, seq) -> str | None:
    """What keeps `loop` (over the list `seq`) from being `x = layer(x, *same args)`, or None."""
    index = None
    if loop.iter is seq:
        layer = loop.target
    elif (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "enumerate"
          and len(loop.iter.args) == 1 and not loop.iter.keywords and isinstance(loop.target, ast.Tuple)
          and len(loop.target.elts) == 2 and isinstance(loop.target.elts[0], ast.Name)):
        index, layer = loop.target.elts[0].id, loop.target.elts[1]
    else:
        return "the loop hands the layers something besides the list itself (zip, a slice, a call)"
    if not isinstance(layer, ast.Name):
        return "the loop unpacks each layer"
    if loop.orelse or len(loop.body) != 1:
        return "the loop does more than `x = layer(x, ...)`"
    stmt = loop.body[0]
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == layer.id and stmt.value.args and isinstance(stmt.value.args[0], ast.Name)
            and stmt.value.args[0].id == stmt.targets[0].id):
        return "the loop's body is not `x = layer(x, ...)`"
    changing = {layer.id, stmt.targets[0].id} | ({index} if index else set())
    for arg in stmt.value.args[1:] + [k.value for k in stmt.value.keywords]:
        if not _same_every_layer(arg, changing):
            return f"the argument `{ast.unparse(arg)}` may differ from layer to layer"
    return None


def _same_every_layer(node, changing: set) -> bool:
    """Whether an argument expression is provably the same object for every layer: names, constants,
    attributes and constant subscripts of names that the loop does not change; no calls."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id not in changing
    if isinstance(node, ast.Attribute):
        return _same_every_layer(node.value, changing)
    if isinstance(node, ast.Starred):
        return _same_every_layer(node.value, changing)
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and _same_every_layer(node.value, changing)
    if isinstance(node, ast.Tuple):  # a new tuple each layer, of the same items (compared item by item)
        return all(_same_every_layer(e, changing) for e in node.elts)
    return False


__all__ = ["why_not", "Refusal", "FIX"]
