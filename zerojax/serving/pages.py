"""The page pool of the paged KV cache: fixed-size pages of `page_size` token slots, a free list,
a reference count per page, and the prefix cache (full prompt pages found again by the hash of
their tokens and of every token before them, as vLLM v1's kv_cache_manager hashes blocks).

Page 0 is never handed out: it is the scratch page that the step's padding tokens write to and
that unused page-table entries point at (masked, never read).

A page whose last reference goes keeps its contents while nothing needs its memory: a hashed page
moves to the evictable list (oldest first) instead of the free list, and a later request with the
same prefix takes it back. `available` counts free + evictable pages: what admission can use.
"""
from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

SCRATCH_PAGE = 0


def chain_hashes(tokens: Sequence[int], page_size: int, salt: Hashable = None) -> list[int]:
    """The hash of each full page of `tokens`: its tokens and its parent page's hash (so a page
    matches only after the same whole prefix), salted (an adapter's name: its cache differs)."""
    out, parent = [], hash(("zerojax-prefix", salt))
    for end in range(page_size, len(tokens) + 1, page_size):
        parent = hash((parent, tuple(tokens[end - page_size:end])))
        out.append(parent)
    return out


class PagePool:
    """Pages 1 .. num_pages - 1 of the cache (page 0: `SCRATCH_PAGE`), each with a reference count."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: at least 2 (page 0 is the scratch page)")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # hashed, unreferenced
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}
        self.prefix_hits = 0  # pages taken from the prefix cache (for /metrics and tests)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def available(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def in_use(self) -> int:
        return self.capacity - self.available

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (reference 1), or None (nothing taken) where fewer are available."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:  # the oldest unreferenced cached page gives up its prefix
                page, _ = self._evictable.popitem(last=False)
                del self._page_of_hash[self._hash_of_page.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference of each page; a page left unreferenced is free (or evictable, hashed)."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise RuntimeError(f"page {page} released more often than taken")
            if self._refs[page] == 0:
                if page in self._hash_of_page:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The pages holding the longest cached run of `hashes` (a prefix), each referenced once more."""
        pages = []
        for h in hashes:
            page = self._page_of_hash.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
            pages.append(page)
        self.prefix_hits += len(pages)
        return pages

    def register(self, page: int, h: int) -> None:
        """`page` (full, its slots written) holds the prefix of hash `h`: later requests may share it."""
        if h in self._page_of_hash or page in self._hash_of_page:
            return  # another request cached this prefix first (its own page is kept), or already known
        self._page_of_hash[h] = page
        self._hash_of_page[page] = h

    def forget_prefixes(self) -> None:
        """No page is a cached prefix any more (their contents were computed with weights that
        changed): the unreferenced ones are free again."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of_hash.clear()
        self._hash_of_page.clear()


__all__ = ["PagePool", "chain_hashes", "SCRATCH_PAGE"]
