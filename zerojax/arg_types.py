"""argparse types the commands share: `zerojax train`'s flags (zerojax.trainer.flags) and `zerojax
estimate` / `plan` (zerojax.cli) check a value the same way, when the flags are parsed.

Nothing here imports jax: `zerojax estimate` parses its flags before it picks the backend.
"""
from __future__ import annotations

import argparse
import math


def number(kind, lo=None, *, above=False, note=""):
    """An argparse type: a finite int / float, >= lo (> lo with above=True); `note` says why."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if lo is not None and (value <= lo if above else value < lo):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if above else '>='} {lo}{note}")
        return value
    return parse


def mlp_tile(text):
    """--mlp-tile's value: "auto" or the positions per piece of the tiled MLP, an int >= 1."""
    return "auto" if text == "auto" else number(int, 1, note=" (positions per piece, or auto)")(text)


__all__ = ["number", "mlp_tile"]
