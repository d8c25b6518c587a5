"""zerojax/'s import structure, read from the source with `ast` (nothing is imported to read it):

- packages in layers (`LAYERS`, lowest first; docs/CONTRACTS.md, "Package order"): a module imports
  only modules of its own layer or of layers below. Every import counts, those inside functions
  too: a deferred import still runs the module it names, so an upward one would hide the very
  cycle this forbids. None goes upward today, so no exception is needed;
- no cycle among modules, function-local imports included (DESIGN.md, "Imports flow one way");
- `models/` imports nothing of zerojax's runtime (only `zerojax._jax_compat`);
- no module imports, or reads through a module attribute, another module's private (`_name`) name
  (a module whose own name is private, such as `zerojax._jax_compat`, is zerojax's to import: its
  public names are the ones meant for the rest of zerojax);
- private and version-dependent JAX / Flax APIs are used in `zerojax/_jax_compat.py` only;
- the old paths of moved modules and names keep working.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "zerojax"

# Lowest first. A unit is a top-level module or a subpackage of zerojax (`zerojax.engine.engine` is
# unit "engine"); units of one layer may import each other (the cycle test still applies).
LAYERS = (
    ("_jax_compat", "version", "byte_sizes", "arg_types", "local_files", "options", "_moved", "streamed",
     "train_state", "user_code", "remat_segments"),  # leaves
    ("pinned_pool", "xla_flags", "launch"),   # process setup, before a backend starts
    ("config",),
    ("models",),                               # plain Flax: the model families, layer_stack
    ("data", "lora", "model_arg"),             # readers and tokenizers; adapters; the --model value
    ("optim", "precision", "accumulate"),      # optax transforms, usable without the engine
    ("sharding",),                             # mesh; ZeRO / tensor / pipe rules -> sharding trees
    ("block_loop", "model", "user_tree"),      # the model contract; the user's tree in and out
    ("offload",),
    ("checkpoint",),
    ("engine",),                               # layout, step, memory guard, engine
    ("planning",),                             # estimate, planner, mesh search (builds on train)
    ("api", "planner", "estimate", "train"),   # shard(); the moved-module shims
    ("generation",),
    ("serving",),                              # continuous batching over a paged cache; the HTTP server
    ("scoring",),                              # log-probs, reward model, critic: read by rl and methods
    ("rl",),                                   # rollouts: generation, rewards, advantages
    ("methods",),                              # training methods (their losses over rl's rollouts)
    ("trainer",),
    ("cli",),
    ("",),                                     # zerojax/__init__.py: the public names, read lazily
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set) -> str | None:
    """The zerojax module an import of `name` loads (a name inside a module maps to the module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_lines():
    """(module, zerojax module it imports, "file:line") for each import of a zerojax module
    in zerojax/, at module level or inside a function."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    for mod, path in sorted(files.items()):
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from zerojax import offload` imports the module zerojax.offload
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            deps = {_resolve(t, modules) for t in targets} - {None, mod}
            # a submodule's import of its own package runs that package's __init__ first anyway
            for dep in sorted(d for d in deps if not mod.startswith(d + ".")):
                yield mod, dep, f"{path.relative_to(PKG.parent)}:{node.lineno}"


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {_module_name(p): set() for p in PKG.rglob("*.py")}
    for mod, dep, _ in import_lines():
        graph[mod].add(dep)
    return graph


def unit(module: str) -> str:
    """A module's layer unit: its top-level module or subpackage of zerojax ("" for zerojax itself)."""
    return module.split(".")[1] if "." in module else ""


def upward_imports(lines, rank=RANK) -> list[str]:
    """One line for each import of a module in a higher layer, naming the file and line."""
    return [f"{where}: {mod} imports {dep}: {unit(dep)} (layer {rank[unit(dep)]}) is above "
            f"{unit(mod) or 'zerojax'} (layer {rank[unit(mod)]}) in tests/test_imports.py's LAYERS"
            for mod, dep, where in lines if rank[unit(dep)] > rank[unit(mod)]]


def find_cycle(graph, ignore=frozenset()):
    """One cycle as a list of modules, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if (m, d) in ignore:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_reader_sees_function_local_imports_and_cycles():
    # the reader itself, on a graph with a known cycle: a test that could never fail proves nothing
    g = import_graph()
    assert "zerojax.engine.layout" in g["zerojax.engine.engine"] and "zerojax.engine.engine" in g["zerojax.api"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_package_has_a_layer():
    units = {unit(m) for m in import_graph()}
    missing = sorted(units - set(RANK))
    assert not missing, f"add {missing} to LAYERS in tests/test_imports.py (and docs/CONTRACTS.md, Package order)"


def test_the_layer_check_names_the_file_and_line_of_an_upward_import():
    lines = [("zerojax.engine.engine", "zerojax.planning.memory", "zerojax/engine/engine.py:42"),
             ("zerojax.planning.planner", "zerojax.engine.engine", "zerojax/planning/planner.py:30")]
    assert upward_imports(lines) == [
        "zerojax/engine/engine.py:42: zerojax.engine.engine imports zerojax.planning.memory: planning "
        f"(layer {RANK['planning']}) is above engine (layer {RANK['engine']}) in tests/test_imports.py's LAYERS"]


def test_no_package_imports_a_package_above_it():
    bad = upward_imports(import_lines())
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_models_import_nothing_of_the_runtime():
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("zerojax.models"):
            # leaves with nothing of the runtime: JAX's API, local paths, two-level remat's names
            outside = {d for d in deps if not d.startswith("zerojax.models")
                       and d not in ("zerojax._jax_compat", "zerojax.local_files", "zerojax.remat_segments")}
            assert not outside, f"{mod} imports {outside}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_uses(text: str, module: str, modules: set, where: str = "") -> list[str]:
    """Lines of the module `module` (source `text`) that take another zerojax module's private name:
    `from zerojax.x import _name`, or `alias._name` / `getattr(alias, "_name")` where `alias` is a
    zerojax module (`import zerojax.x as alias`, `from zerojax import x`, `zerojax.x` written out),
    at module level or inside a function."""
    tree = ast.parse(text, where or module)
    package = module if where.endswith("__init__.py") else module.rpartition(".")[0]
    aliases, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base not in modules:
                continue
            for a in node.names:
                if f"{base}.{a.name}" in modules:  # a module (a private module is zerojax's to import)
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif _private(a.name) and base != module:
                    out.append(f"{where}:{node.lineno}: imports {a.name} from {base}")

    def module_of(expr):
        """The zerojax module an expression names (`alias`, `zerojax.x.y`), or None."""
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            parent = module_of(expr.value) or (expr.value.id if isinstance(expr.value, ast.Name) else None)
            name = f"{parent}.{expr.attr}" if parent else None
            return name if name in modules else None
        return None

    for node in ast.walk(tree):
        target = name = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target, name = module_of(node.value), node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            target, name = module_of(node.args[0]), node.args[1].value
        if target is not None and target != module:
            out.append(f"{where}:{node.lineno}: reads {target}.{name}")
    return out


def test_the_private_name_reader_finds_imports_and_module_attributes():
    modules = {"zerojax", "zerojax.models", "zerojax.models.gpt2", "zerojax.config", "zerojax.config._values"}
    text = ("from zerojax.models import gpt2 as g\nfrom zerojax.models.gpt2 import _linear, embed\n"
            "import zerojax.models.gpt2\nfrom zerojax.config import _values\n"
            "def f():\n    from zerojax.models import gpt2\n    return gpt2._block, g._attention_inputs, "
            "zerojax.models.gpt2._ce, getattr(g, '_x'), g.__name__, _values.ok, _values._hidden\n")
    assert sorted(private_name_uses(text, "zerojax.methods.x", modules, "x.py")) == [
        "x.py:2: imports _linear from zerojax.models.gpt2", "x.py:7: reads zerojax.config._values._hidden",
        "x.py:7: reads zerojax.models.gpt2._attention_inputs", "x.py:7: reads zerojax.models.gpt2._block",
        "x.py:7: reads zerojax.models.gpt2._ce", "x.py:7: reads zerojax.models.gpt2._x"]
    assert private_name_uses(text, "zerojax.models.gpt2", modules, "gpt2.py") == [
        "gpt2.py:7: reads zerojax.config._values._hidden"]  # its own names are its own


def test_no_module_takes_another_modules_private_names():
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    bad = [line for mod, path in sorted(files.items())
           for line in private_name_uses(path.read_text(), mod, set(files), str(path.relative_to(PKG.parent)))]
    assert not bad, "make a public name for each of these:\n" + "\n".join(bad)


def test_checkpoint_knows_pytrees_not_engines():
    deps = import_graph()["zerojax.checkpoint.state"]
    assert not {d for d in deps if d.split(".")[1] in ("models", "engine")}


# private JAX modules, and the JAX / Flax modules whose attributes differ between releases
PRIVATE_MODULES = ("jax._src", "jax.interpreters", "jax.extend", "jaxlib", "jax.lib")
VERSIONED_ROOTS = {"jax", "nnx", "flax"}


def private_api_uses(path: pathlib.Path) -> list[str]:
    """Lines of `path` that import a private JAX module, read `jax.core` / `jax._src`, or probe
    jax / nnx / flax with hasattr / getattr (a release check)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == p or n.startswith(p + ".") for n in names for p in PRIVATE_MODULES):
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: imports {names[0]}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax"
                and node.attr in ("core", "_src", "interpreters", "extend", "lib")):
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: reads jax.{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in VERSIONED_ROOTS):
            out.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {node.func.id}({node.args[0].id}, ...)")
    return out


def test_private_and_version_dependent_jax_apis_live_in_jax_compat_only():
    assert private_api_uses(PKG / "_jax_compat.py"), "the reader finds nothing: it would pass any module"
    bad = [line for p in sorted(PKG.rglob("*.py")) if p.name != "_jax_compat.py" for line in private_api_uses(p)]
    assert not bad, "move these into zerojax/_jax_compat.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("old, new", [
    ("zerojax.planning.memory", "zerojax.engine.memory"),
    ("zerojax.engine.step.TrainState", "zerojax.train_state.TrainState"),
    ("zerojax.engine.step.pure_dict", "zerojax._jax_compat.to_pure_dict"),
    ("zerojax.engine.layout.no_eager_sharding", "zerojax._jax_compat.no_eager_sharding"),
    ("zerojax.checkpoint.stream.StreamedLeaf", "zerojax.streamed.StreamedLeaf"),
    ("zerojax.checkpoint.stream.is_streamed", "zerojax.streamed.is_streamed"),
    ("zerojax.planning.estimate.fmt_bytes", "zerojax.byte_sizes.fmt_bytes"),
    ("zerojax.planning.estimate.host_free_bytes", "zerojax.byte_sizes.host_free_bytes"),
    ("zerojax.planning.memory.parse_bytes", "zerojax.byte_sizes.parse_bytes"),
    ("zerojax.models.gpt2.CUDNN_ATTENTION_FORWARD", "zerojax._jax_compat.CUDNN_ATTENTION_FORWARD"),
])
def test_old_paths_of_moved_modules_and_names_are_the_same_objects(old, new):
    import importlib

    def load(path):
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError:
            module, _, name = path.rpartition(".")
            return getattr(importlib.import_module(module), name)

    assert load(old) is load(new)


def test_moved_modules_keep_working_with_a_warning_naming_the_new_path():
    import importlib
    import sys
    import warnings

    for old, new in (("zerojax.planner", "zerojax.planning.planner"),
                     ("zerojax.estimate", "zerojax.planning.estimate"),
                     ("zerojax.methods.logprobs", "zerojax.scoring.logprobs"),
                     ("zerojax.methods.shared_prompt", "zerojax.scoring.shared_prompt"),
                     ("zerojax.train.engine", "zerojax.engine.engine"),
                     ("zerojax.train.layout", "zerojax.engine.layout")):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            shim = importlib.import_module(old)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moved = importlib.import_module(new)
        assert shim.__getattr__("__doc__") is moved.__doc__
        name = {"zerojax.planner": "plan", "zerojax.estimate": "H200", "zerojax.methods.logprobs": "completion_logps",
                "zerojax.methods.shared_prompt": "completion_logps_shared", "zerojax.train.engine": "Engine",
                "zerojax.train.layout": "build_layout"}[old]
        assert getattr(shim, name) is getattr(moved, name)


@pytest.mark.parametrize("old", ["zerojax.cli.ModelChoice", "zerojax.trainer.choice.ModelChoice"])
def test_the_two_model_choices_are_one_class_with_a_warning_on_the_old_paths(old):
    import importlib

    from zerojax.model_arg import ModelChoice

    module, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=f"{old} moved to zerojax.model_arg.ModelChoice"):
        assert getattr(importlib.import_module(module), name) is ModelChoice


def test_each_rl_package_imports_first_in_a_fresh_process():
    """Each package imports on its own in a new interpreter (when `zerojax.rl` and `zerojax.methods`
    read each other, a registration that ran the other's half-loaded module broke `import zerojax.rl`)."""
    import os
    import subprocess
    import sys

    root = str(PKG.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {name: subprocess.Popen([sys.executable, "-c", f"import {name}"], env=env, cwd=root,
                                    stderr=subprocess.PIPE, text=True)
             for name in ("zerojax.rl", "zerojax.methods", "zerojax.serving", "zerojax.trainer")}
    failed = {name: p.communicate(timeout=240)[1][-600:] for name, p in procs.items() if p.wait(timeout=240)}
    assert not failed, failed


def test_the_decoders_old_family_classes_are_the_public_pieces_with_a_warning():
    from zerojax.generation import families
    from zerojax.models import pieces

    for old, new in (("LlamaFamily", "LlamaPieces"), ("MoEFamily", "MoEPieces"), ("GPT2Family", "GPT2Pieces"),
                     ("Family", "LayerPieces")):
        with pytest.warns(DeprecationWarning, match=f"{old} is zerojax.models.pieces.{new}"):
            assert getattr(families, old) is getattr(pieces, new)
