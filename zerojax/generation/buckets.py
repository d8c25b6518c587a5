"""Length and batch buckets, and left padding: the shapes the prefill and decode programs are
compiled for. A new prompt length, batch size or max_new_tokens reuses a compiled program unless
it crosses a bucket edge.

Why left padding: every row then writes its next token to the same cache slot, so a decode step's
cache write is one `dynamic_update_slice` at a scalar index and the last prompt position is the
same column for every row; right padding would need a per-row scatter into the cache and a per-row
gather of the prefill's last logits. Each row's own positions (slot - padding) keep the rotary
angles and GPT-2's position rows exact; the mask hides the padding (`cache.attention_mask`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BUCKET = 16
STEP = 64  # beyond 64, lengths round up to a multiple of 64 ... up to 1024, then of 512


def length_bucket(n: int) -> int:
    """n rounded up: powers of two to 64 (16, 32, 64), then multiples of 64 to 1024, then of 512.
    The step grows with n so that padding stays under ~1/16 of a long prompt and a short one
    compiles few shapes."""
    if n <= STEP:
        return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())
    step = STEP if n <= 1024 else 512
    return -(-n // step) * step


def batch_bucket(n: int, multiple: int = 1) -> int:
    """Rows rounded up to a power of two, then to a multiple of `multiple` (the data-parallel size,
    so a batch-split activation divides)."""
    b = 1 << max(0, n - 1).bit_length()
    return -(-b // multiple) * multiple


def left_pad(prompts: Sequence[Sequence[int]], length: int, rows: int, pad_id: int = 0):
    """(ids int32 [rows, length], pad int32 [rows]): each prompt right-aligned in its row; the rows
    past len(prompts) are a one-token dummy prompt (their output is dropped)."""
    ids = np.full((rows, length), pad_id, np.int32)
    pad = np.full((rows,), length - 1, np.int32)
    for r, p in enumerate(prompts):
        p = np.asarray(p, np.int32).reshape(-1)
        if p.size == 0:
            raise ValueError(f"prompt {r} is empty: give at least one token (e.g. the BOS token)")
        ids[r, length - p.size:] = p
        pad[r] = length - p.size
    return ids, pad


__all__ = ["length_bucket", "batch_bucket", "left_pad"]
