"""zerojax/ stays in small single-purpose pieces (docs/CONTRACTS.md, STYLE): no module over 800
lines, no function over 120, read from the source with `ast` (nothing is imported). A module that
grows past the limit splits along a seam (what it does for whom), not at an arbitrary line."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "zerojax"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 120


def _sources():
    return [(p.relative_to(PKG.parent).as_posix(), p.read_text()) for p in sorted(PKG.rglob("*.py"))]


def long_modules(sources, limit=MAX_MODULE_LINES) -> list[str]:
    return [f"{path}: {n} lines" for path, text in sources if (n := len(text.splitlines())) > limit]


def long_functions(sources, limit=MAX_FUNCTION_LINES) -> list[str]:
    """Every def (methods and nested functions too) whose lines, decorators to last line, pass `limit`."""
    out = []
    for path, text in sources:
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                if n > limit:
                    out.append(f"{path}:{node.lineno}: {node.name} has {n} lines")
    return out


def test_the_readers_find_what_passes_the_limits():
    """The readers on made-up sources at a limit of 3: they would fail a module or function that
    grows, so an empty list below means something."""
    body = "def f(x):\n    y = x\n    z = y\n    return z\n"
    assert long_modules([("m.py", body)], limit=3) == ["m.py: 4 lines"]
    assert long_functions([("m.py", "@dec\n" + body)], limit=3) == ["m.py:2: f has 5 lines"]
    assert long_functions([("m.py", "def g():\n    return 1\n")], limit=3) == []


def test_no_module_over_800_lines_and_no_function_over_120():
    sources = _sources()
    assert len(sources) > 100, "the reader finds zerojax's modules"
    too_long = long_modules(sources) + long_functions(sources)
    assert not too_long, "split these along a seam:\n" + "\n".join(too_long)
