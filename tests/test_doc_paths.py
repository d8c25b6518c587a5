"""Code and docs cite only repository paths that exist: a docstring or page naming a benchmark,
doc or test file that was moved or deleted sends a reader nowhere.

Every `benchmarks/`, `configs/`, `docs/`, `examples/`, `tests/` or `zerojax/` path in the
project's .py / .md / .sh / .toml files must exist (a module path may leave out `.py`). Left out:
CHANGELOG.md (history: it names what was removed), benchmarks/measured/ (raw logs of their day),
and what .gitignore lists (outputs made at run time, e.g. benchmarks/results/). A path in another
repository is written with its repository in front (`github.com/owner/name/blob/commit/tests/...`),
which this test does not read as one of ours."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w./-])((?:benchmarks|configs|docs|examples|tests|zerojax)/[\w./-]*\w)(?![\w{*<$])")
SKIP_FILES = {"CHANGELOG.md"}


def _ignored() -> list[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [line.strip("/") for line in lines if line.strip() and not line.startswith("#")]


def _sources():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if (path.suffix in (".py", ".md", ".sh", ".toml") and path.is_file() and rel not in SKIP_FILES
                and not rel.startswith(("benchmarks/measured/", ".")) and "/." not in rel):
            yield rel, path


def test_every_cited_repository_path_exists():
    ignored = _ignored()
    missing = []
    for rel, path in _sources():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in PATH.finditer(line):
                cited = match.group(1).rstrip(".")
                if any(cited == i or cited.startswith(i + "/") for i in ignored):
                    continue
                if not ((ROOT / cited).exists() or (ROOT / (cited + ".py")).exists()):
                    missing.append(f"{rel}:{number}: {cited}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_no_file_keeps_a_merge_conflicts_marks():
    """A merge resolved in haste can leave git's conflict marks in a page (ruff finds them only in
    .py files); CHANGELOG.md is read here too, since its newest section is where two branches meet."""
    marks = re.compile(r"^(<{7} |>{7} |={7}$)")
    files = [*_sources(), ("CHANGELOG.md", ROOT / "CHANGELOG.md")]
    found = [f"{rel}:{n}" for rel, path in files
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if marks.match(line)]
    assert not found, "conflict marks left in:\n" + "\n".join(found)
