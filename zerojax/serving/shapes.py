"""The shapes the serving step compiles for, few whatever the requests: rows, prompt-chunk length
and page-table width, each a power of two above a floor. A step's prompt chunks share one
program of at most max_batched_tokens token slots (rows x chunk length), so the chunk programs
number one per chunk length, not one per (rows, length) pair."""
from __future__ import annotations

# The floors: a decode step's rows padded to at least MIN_ROWS (padding rows cost little where a
# step reads all the weights anyway), a row's pages gathered over at least MIN_SPAN slots, a
# prompt chunk at least MIN_CHUNK tokens.
MIN_ROWS = 8
MIN_SPAN = 256
MIN_CHUNK = 16


def pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def decode_rows(n: int, max_num_seqs: int) -> int:
    return min(pow2(n, MIN_ROWS), pow2(max_num_seqs))


def chunk_length(n: int, max_batched_tokens: int) -> int:
    """The chunk program's length for a longest chunk of n tokens (n <= max_batched_tokens)."""
    return min(pow2(n, MIN_CHUNK), pow2(max_batched_tokens))


def chunk_rows(length: int, max_batched_tokens: int) -> int:
    """Prompt chunks one step takes at this chunk length: rows x length <= max_batched_tokens (one at least)."""
    return max(1, max_batched_tokens // length)


class ChunkSlots:
    """One step's prompt chunks: the first fixes the chunk length, the others fit in it, as many
    as `chunk_rows` allows."""

    def __init__(self, max_batched_tokens: int):
        self.budget, self.length, self.count = max_batched_tokens, None, 0

    def fit(self, n: int) -> int:
        """How many of a prompt's next n tokens a chunk row takes (0: no row left)."""
        if self.length is None:
            return n
        return 0 if self.count >= chunk_rows(self.length, self.budget) else min(n, self.length)

    def take(self, n: int) -> None:
        if self.length is None:
            self.length = chunk_length(n, self.budget)
        self.count += 1


def span_pages(pages: int, page_size: int, max_pages: int) -> int:
    """Page-table width for rows holding at most `pages` pages."""
    return min(pow2(pages, -(-MIN_SPAN // page_size)), pow2(max_pages))


__all__ = ["MIN_ROWS", "MIN_SPAN", "MIN_CHUNK", "pow2", "decode_rows", "chunk_length", "chunk_rows", "ChunkSlots", "span_pages"]
