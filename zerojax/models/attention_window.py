"""The sliding-window argument both attentions take (`attention.blockwise_attention` and
`flash_attention.flash_attention`), validated in one place. Its own module so that the flash kernel,
which `attention.causal_attention` imports lazily, need not import `attention` back (a cycle)."""
from __future__ import annotations


def check_window(window) -> None:
    """A sliding window validated: the positions a query sees, an int >= 1 (None: all)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention window={window!r}: the positions a query sees, an int >= 1 (None: all)")


__all__ = ["check_window"]
