"""`StreamedLeaf`: a stacked [L, ...] leaf that stands in a checkpoint's tree where an array would be,
written and read a block of rows at a time (zerojax/checkpoint/stream.py does the I/O).

A leaf module (numpy only): the offload tiers and `zerojax.user_tree` define their streamed leaves on
it, and `zerojax.checkpoint` reads them, without either importing the other.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np


class StreamedLeaf:
    """A stacked [L, ...] leaf held outside host memory (the NVMe tier's `SwappedLeaf`), in a checkpoint's tree
    where an array would be. `shape` / `dtype` as the array's. Save: `blocks()` yields (lo, hi, rows lo:hi as
    numpy) covering [0, L) in order. Restore: `fill(read)` stores rows read with `read(lo, hi)`."""

    shape: tuple
    dtype: np.dtype
    alone = True   # a restore from orbax's arrays reads this leaf in an orbax call of its own (host memory)
    chunk_rows = 1   # rows per file chunk: a layer (a reader takes any layer range alone), or a block of a
                     # leaf without layers (an embedding: one file a row would be ~100k files)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def blocks(self) -> Iterator[tuple[int, int, np.ndarray]]:
        raise NotImplementedError

    def fill(self, read: Callable[[int, int], np.ndarray]) -> None:
        raise NotImplementedError


def is_streamed(x) -> bool:
    return isinstance(x, StreamedLeaf)
