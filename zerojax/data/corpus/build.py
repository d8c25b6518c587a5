"""Writes zerojax's embedded corpus, stdlib_docstrings.txt.gz beside this file.

Run it in a clean interpreter, so that no other package's imports change the modules it reads
(transformers adds documented methods to logging.Logger; torch wraps inspect.getfile):

    python -I -S zerojax/data/corpus/build.py

It imports the standard library only (never zerojax, whose import brings in jax). The text is
the docstrings of the modules below, their public classes, functions and methods, in sorted
order; names and docstrings only, so no memory address or file path leaks in. Docstrings change
between Python versions: the snapshot was written by the version in BUILT_WITH.
"""
import gzip
import importlib
import inspect
import os
import sys
import warnings

BUILT_WITH = (3, 11, 7)  # docstrings may change even in a patch release
SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stdlib_docstrings.txt.gz")

# pure-Python modules mostly; one missing here (turtle without tkinter) is skipped
MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "enum",
    "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
    "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar",
    "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "logging.handlers", "lzma", "mailbox", "math", "mimetypes", "multiprocessing.pool",
    "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pickletools",
    "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile", "pydoc", "queue",
    "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "signal", "smtplib", "socket", "socketserver", "statistics", "string",
    "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "types", "typing", "unittest", "unittest.mock", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zipimport",
)


def docstrings(module_names) -> list[str]:
    parts = []
    for mod_name in module_names:
        try:
            module = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - e.g. turtle without tkinter
            continue
        doc = inspect.getdoc(module)
        if doc:
            parts.append(f"Module {mod_name}\n\n{doc}")
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj):
                if obj.__doc__:
                    parts.append(f"class {mod_name}.{name}\n\n{inspect.cleandoc(obj.__doc__)}")
                for meth, fn in sorted(vars(obj).items()):
                    fn = getattr(fn, "__func__", fn)  # classmethod / staticmethod
                    if (meth.startswith("_") and meth != "__init__") or not inspect.isroutine(fn):
                        continue
                    if fn.__doc__:
                        parts.append(f"{mod_name}.{name}.{meth}\n\n{inspect.cleandoc(fn.__doc__)}")
            elif inspect.isroutine(obj) and obj.__doc__:
                parts.append(f"{mod_name}.{name}\n\n{inspect.cleandoc(obj.__doc__)}")
    return parts


def build() -> str:
    with warnings.catch_warnings():  # touching deprecated names (typing.io) warns
        warnings.simplefilter("ignore")
        return "\n\n\n".join(docstrings(MODULES))


def main(path=SNAPSHOT):
    if sys.version_info[:3] != BUILT_WITH:  # the test that rebuilds the snapshot reads BUILT_WITH
        sys.exit(f"build.py: BUILT_WITH = {BUILT_WITH} but this is Python {sys.version.split()[0]}; "
                 "set BUILT_WITH to this version first, then rebuild")
    data = build().encode("utf-8")
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=9, mtime=0))  # mtime 0: the same bytes each time
    print(f"{path}: {len(data):,} bytes of text (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main(*sys.argv[1:])
