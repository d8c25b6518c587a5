"""Config values: ConfigError, field specs, the checks and conversions every section shares."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import warnings
from collections.abc import Mapping
from dataclasses import field, fields

AUTO = "auto"


class ConfigError(ValueError):
    """Every problem found in a config; `.problems` holds one line per problem."""

    def __init__(self, problems, source=None):
        self.problems = list(problems)
        self.source = source  # the file the config came from, where known: named in the message
        lines = "\n".join(f"  - {p}" for p in self.problems)
        where = f" {source}" if source else ""
        super().__init__(f"{len(self.problems)} problem(s) in the DeepSpeed config{where}:\n{lines}")


class ConfigWarning(UserWarning):
    """A config note that does not stop the load (an unknown top-level key, a key without effect)."""


def _one_line_config_warnings(previous):
    """warnings' formatter with ConfigWarning as one `warning: <note>` line: the note names its
    key, and the default's zerojax source path and line in front of it only hid it."""
    def formatwarning(message, category, filename, lineno, line=None):
        if issubclass(category, ConfigWarning):
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)
    formatwarning.zerojax_config = True
    return formatwarning


if not getattr(warnings.formatwarning, "zerojax_config", False):  # once, whatever reloads this module
    warnings.formatwarning = _one_line_config_warnings(warnings.formatwarning)


def one_edit_apart(a: str, b: str) -> bool:
    """At most one letter added, dropped, changed, or two neighbours swapped (case aside)."""
    a, b = a.casefold(), b.casefold()
    if a == b:
        return True
    if len(a) > len(b):
        a, b = b, a
    if len(b) - len(a) > 1:
        return False
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if len(a) < len(b):  # one letter more in b, at i
        return a[i:] == b[i + 1:]
    return a[i + 1:] == b[i + 1:] or (a[i:i + 2] == b[i:i + 2][::-1] and a[i + 2:] == b[i + 2:])


# Field specs: a dataclass field carries its JSON kind and range in metadata ("cls" for a section).
def config_field(default=None, kind="any", *, factory=None, **checks):
    meta = {"kind": kind, **checks}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def empty():
    return types.MappingProxyType({})


DEVICES = ("none", "cpu", "nvme")
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
           "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
           "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16"}


def plain(x):
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def is_auto(v):
    return isinstance(v, str) and v == AUTO


def freeze(x):
    if isinstance(x, Mapping):
        return types.MappingProxyType({k: freeze(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return tuple(freeze(v) for v in x)
    return x


def thaw(x):
    if isinstance(x, Mapping):
        return {k: thaw(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [thaw(v) for v in x]
    return x


def suggest(key, known, cutoff=0.6):
    match = difflib.get_close_matches(str(key), list(known), n=1, cutoff=cutoff)
    return f"; did you mean {match[0]!r}?" if match else ""


def unknown(path, key, known, problems):
    hint = suggest(key, known)
    accepted = f" (accepted: {', '.join(sorted(known))})" if not hint else ""
    where = f"{path}.{key}" if path else str(key)
    problems.append(f"{where}: unknown key{hint}{accepted}")


def convert(value, meta, path, problems):
    """Check one value against its field spec; returns (ok, converted)."""
    kind, given = meta["kind"], value
    if (value is None and meta.get("optional")) or (value is False and meta.get("false_is_none")):
        return True, None

    def bad(expected):
        problems.append(f"{path} = {json.dumps(given) if _jsonable(given) else repr(given)}: expected {expected}")
        return False, None

    if kind == "bool":
        if not isinstance(value, bool):
            return bad("true or false")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()):
            return bad("an integer")
        value = int(value)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return bad("a finite number")
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            return bad("a string" + (f", one of {list(meta['choices'])}" if "choices" in meta else ""))
        value = value.lower() if meta.get("lower") else value.upper() if meta.get("upper") else value
    elif kind == "dtype":
        if not isinstance(value, str) or value.lower() not in _DTYPES:
            return bad('one of "fp32", "bf16", "fp16"')
        value = _DTYPES[value.lower()]
    elif kind == "mapping":
        if not isinstance(value, Mapping):
            return bad("an object {...}")
        value = freeze(value)
    elif kind == "int_or_auto":
        if is_auto(value):
            return True, value
        return convert(value, {"kind": "int", "ge": 1}, path, problems)
    else:
        value = freeze(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return bad(f"one of {list(choices)}")
    for op, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                         ("le", lambda a, b: a <= b, "<=")):
        if op in meta and not ok(value, meta[op]):
            return bad(f"a value {word} {meta[op]}")
    return True, value


def _jsonable(v):
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def to_json(obj):
    out = {}
    for f in fields(obj):
        if f.name == "world_size":
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_json(v)
        elif v is None and f.metadata.get("kind") in ("section", "special", "mapping"):
            continue  # absent section
        elif f.metadata.get("extension") and v == f.default:
            continue  # a zerojax-only key left unset: the dict stays one DeepSpeed accepts
        else:
            out[f.name] = thaw(v)
    return out
