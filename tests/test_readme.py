"""The README's "Use" snippet runs as written: a new user's first copy-and-paste.

The first ```python block under the "## Use" heading of README.md, run as a script in a fresh
interpreter on CPU (JAX_PLATFORMS=cpu; the test suite's XLA_FLAGS, from conftest, are passed on as
to any subprocess), must exit with status 0 in under a minute.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_snippet(text: str) -> str:
    """The first ```python block after the "## Use" heading (before the next "## " heading)."""
    heading = re.search(r"^## Use[ \t]*$", text, re.M)
    assert heading, 'README.md has no "## Use" heading'
    section = text[heading.end():]
    following = re.search(r"^## ", section, re.M)
    section = section[:following.start()] if following else section
    block = re.search(r"^```python[ \t]*\n(.*?)^```", section, re.M | re.S)
    assert block, 'no ```python block under "## Use" in README.md'
    return block.group(1)


def test_the_snippet_is_found_as_written():
    text = "# x\n## Use\n\nSome words.\n\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n## Next\n"
    assert use_snippet(text) == "print(1)\n"


@pytest.mark.slow
def test_readme_use_snippet_runs_on_cpu(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        code = use_snippet(f.read())
    script = tmp_path / "readme_use.py"
    script.write_text(code)
    # run where a user would paste it: a fresh folder, zerojax importable as installed
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, f"README.md's Use snippet failed (exit {p.returncode}):\n{code}\n{p.stdout}\n{p.stderr}"
