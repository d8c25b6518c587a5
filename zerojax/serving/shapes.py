"""The shapes the serving step compiles for, few whatever the requests: rows, prompt-chunk length
and page-table width, each a power of two above a floor. A step's prompt chunks share one
program of at most max_batched_tokens token slots (rows x chunk length); its rows are a power of
4 (or the most that fit), so the chunk programs number a few per chunk length, and a step with
one prompt does not compute the budget's worth of padding rows."""
from __future__ import annotations

import dataclasses


def pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The floors of the shape buckets. Defaults: a decode step's rows padded to at least 8
    (padding rows cost little where a step reads all the weights anyway), a row's pages gathered
    over at least 256 slots, a prompt chunk at least 16 tokens. Higher floors compile fewer
    programs (a large model's compile is seconds each) for more padding per step."""

    min_rows: int = 8
    min_span: int = 256
    min_chunk: int = 16

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"Buckets.{f.name}={v!r}: a power of two >= 1")

    def decode_rows(self, n: int, max_num_seqs: int) -> int:
        return min(pow2(n, self.min_rows), pow2(max_num_seqs))

    def chunk_length(self, n: int, max_batched_tokens: int) -> int:
        """The chunk program's length for a longest chunk of n tokens (n <= max_batched_tokens)."""
        return min(pow2(n, self.min_chunk), pow2(max_batched_tokens))

    @staticmethod
    def chunk_rows(length: int, max_batched_tokens: int) -> int:
        """Prompt chunks one step takes at this length: rows x length <= max_batched_tokens (one at least)."""
        return max(1, max_batched_tokens // length)

    def chunk_row_buckets(self, length: int, max_batched_tokens: int) -> list[int]:
        """The row counts a chunk program of this length compiles for: powers of 4 below
        `chunk_rows`, and it. A step computes every row of its program: with one row count (the
        most), a lone prompt of 512 tokens paid for max_batched_tokens (2048: four times its work,
        and so its time to first token); with these, a step computes at most 4x the rows it has."""
        most = self.chunk_rows(length, max_batched_tokens)
        return sorted({min(4 ** i, most) for i in range(most.bit_length())} | {most})

    def chunk_rows_for(self, rows: int, length: int, max_batched_tokens: int) -> int:
        """The chunk program's rows for a step with `rows` prompt chunks of at most `length` tokens."""
        return next(r for r in self.chunk_row_buckets(length, max_batched_tokens) if r >= rows)

    def span_pages(self, pages: int, page_size: int, max_pages: int) -> int:
        """Page-table width for rows holding at most `pages` pages."""
        return min(pow2(pages, -(-self.min_span // page_size)), pow2(max_pages))

    def programs(self, max_num_seqs: int, max_batched_tokens: int, page_size: int, max_pages: int,
                 max_chunk: int) -> list[tuple[int, int, int]]:
        """Every (rows, chunk length, page-table width) a step can take, prompt chunks of at most
        max_chunk tokens: the decodes' [R, 1] and the prompt chunks' [R, C], each at every width;
        what the engine's warm-up compiles."""
        spans = sorted({self.span_pages(p, page_size, max_pages) for p in range(1, max_pages + 1)})
        decodes = sorted({self.decode_rows(n, max_num_seqs) for n in range(1, max_num_seqs + 1)})
        longest = min(max_batched_tokens, max_chunk)
        lengths = sorted({self.chunk_length(n, max_batched_tokens) for n in range(2, longest + 1)})
        shapes = [(rows, 1) for rows in decodes] + [(rows, c) for c in lengths
                                                    for rows in self.chunk_row_buckets(c, max_batched_tokens)]
        return [(rows, length, span) for rows, length in shapes for span in spans]


class ChunkSlots:
    """One step's prompt chunks: the first fixes the chunk length, the others fit in it, as many
    as `Buckets.chunk_rows` allows."""

    def __init__(self, buckets: Buckets, max_batched_tokens: int):
        self.buckets, self.budget, self.length, self.count = buckets, max_batched_tokens, None, 0

    def fit(self, n: int) -> int:
        """How many of a prompt's next n tokens a chunk row takes (0: no row left)."""
        if self.length is None:
            return n
        return 0 if self.count >= self.buckets.chunk_rows(self.length, self.budget) else min(n, self.length)

    def take(self, n: int) -> None:
        if self.length is None:
            self.length = self.buckets.chunk_length(n, self.budget)
        self.count += 1


__all__ = ["Buckets", "ChunkSlots", "pow2"]
