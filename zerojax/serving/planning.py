"""How many KV pages the engine holds: asked for in tokens, or planned from the device's free
memory (`zerojax.engine.memory.device_free_bytes`, as generate's cache guard reads it) less the
step's transients, with the same guard: a pool that cannot hold one request of max_model_len is
refused with the numbers and the fix, before anything is allocated."""
from __future__ import annotations

import dataclasses

import numpy as np

from zerojax.generation.families import Geometry
from zerojax.planning.memory import device_free_bytes

# Without memory statistics (CPU), a pool of this many tokens unless asked otherwise (at least one
# request of max_model_len).
CPU_DEFAULT_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class PagePlan:
    num_pages: int  # including the scratch page
    page_size: int
    max_model_len: int
    page_bytes: int
    free_bytes: int | None  # the device's free memory where it reports it
    reserved_bytes: int  # kept for the step's transients

    @property
    def cache_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def describe(self) -> str:
        where = (f"planned from {self.free_bytes / 2**30:.2f} GiB free, {self.reserved_bytes / 2**30:.2f} GiB kept "
                 "for the step" if self.free_bytes is not None else "as asked (no device memory statistics)")
        return (f"KV cache: {self.cache_tokens:,} tokens in {self.num_pages - 1:,} pages of {self.page_size} "
                f"({(self.num_pages - 1) * self.page_bytes / 2**30:.3f} GiB, {where}); max_model_len "
                f"{self.max_model_len:,}")


def step_transient_bytes(geometry: Geometry, dtype, *, max_num_seqs: int, max_batched_tokens: int,
                         max_model_len: int, vocab: int, gather_rows: int | None = None) -> int:
    """What the largest step holds beside the pool and the weights, by count: one layer's gathered
    keys and values of `gather_rows` rows (default max_num_seqs: decodes gathered too; three
    copies: the gather, its attention layout, one more that XLA may keep) and the chunk's fp32
    attention scores (both none at gather_rows 0: the kernels read every row's pages where they
    lie, the scores on chip), and the rows' fp32 logits through sampling (a sort, a softmax, a
    cumulative sum)."""
    item = np.dtype(dtype).itemsize
    rows = max_num_seqs if gather_rows is None else gather_rows
    gathered = 2 * 3 * rows * max_model_len * geometry.kv_heads * geometry.head_dim * item
    scores = 2 * max_batched_tokens * geometry.heads * max_model_len * 4 if rows else 0
    logits = 6 * max_num_seqs * vocab * 4
    return gathered + scores + logits


def plan_pages(geometry: Geometry, dtype, *, page_size: int, kv_cache_tokens: int | None, max_num_seqs: int,
               max_batched_tokens: int, max_model_len: int | None, model_len_limit: int | None, vocab: int,
               device=None, memory_fraction: float = 0.9, gather_rows: int | None = None) -> PagePlan:
    """The pool for these limits (ValueError: a limit that cannot hold, with the fix)."""
    from zerojax.serving.step import pool_bytes_per_page

    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                      or max_model_len < 2):
        raise ValueError(f"max_model_len={max_model_len!r}: an int >= 2")
    if max_model_len is not None and model_len_limit is not None and max_model_len > model_len_limit:
        raise ValueError(f"max_model_len={max_model_len}: this model has {model_len_limit} positions; "
                         f"use at most {model_len_limit}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction!r}: a number in (0, 1]")
    asked_len = max_model_len
    max_model_len = max_model_len or model_len_limit or 4096
    page_bytes = pool_bytes_per_page(geometry, page_size, dtype)
    free, reserved = None, 0
    if kv_cache_tokens is not None:
        if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < page_size:
            raise ValueError(f"kv_cache_tokens={kv_cache_tokens!r}: an int >= page_size ({page_size})")
        pages = -(-kv_cache_tokens // page_size)
    else:
        free = device_free_bytes(device)
        if free is None:
            pages = -(-max(max_model_len, min(CPU_DEFAULT_TOKENS, max_num_seqs * max_model_len)) // page_size)
        else:
            reserved = step_transient_bytes(geometry, dtype, max_num_seqs=max_num_seqs,
                                            max_batched_tokens=max_batched_tokens, max_model_len=max_model_len,
                                            vocab=vocab, gather_rows=gather_rows)
            pages = max(0, int(free * memory_fraction) - reserved) // page_bytes
    if pages * page_size < max_model_len:
        if asked_len is None and pages >= 1:  # the model's own length does not fit: serve what does
            max_model_len = pages * page_size
        else:
            raise ValueError(
                f"the KV cache holds {pages * page_size:,} tokens ({pages:,} pages of {page_size}; "
                + (f"{free / 2**30:.2f} GiB free, {reserved / 2**30:.2f} GiB kept for the step's transients; "
                   if free is not None else "")
                + f"{page_bytes:,} bytes a page), less than one request of max_model_len {max_model_len:,}: lower "
                "max_model_len or max_num_seqs, or give kv_cache_tokens")
    return PagePlan(pages + 1, page_size, max_model_len, page_bytes, free, reserved)


__all__ = ["PagePlan", "plan_pages", "step_transient_bytes", "CPU_DEFAULT_TOKENS"]
