"""Two-level activation checkpointing's names and segment length, in one place for the layer stack
(`zerojax.models.layer_stack.run_segments`, which runs it), the config (which validates the names)
and the estimate (which counts what it keeps).

"segments" keeps every k-th layer input on the device, "offload_segments" in pinned host memory;
"<name>_<k>" names k, the bare name leaves it to `auto_segment`. No jax and nothing of zerojax
here: the estimate and the config read it before jax is imported.
"""
from __future__ import annotations

SEGMENT_POLICIES = ("segments", "offload_segments")


def segment_policy(name) -> tuple[str, int | None] | None:
    """(outer, k) of a two-level remat name: outer one of SEGMENT_POLICIES, k its layers a segment
    ("segments_4" -> ("segments", 4); None where the name leaves it to `auto_segment`); None for
    any other name. A malformed k ("segments_x", "segments_0") is an error, not another policy."""
    if not isinstance(name, str):
        return None
    for outer in SEGMENT_POLICIES:
        if name == outer:
            return outer, None
        if name.startswith(outer + "_"):
            k = name[len(outer) + 1:]
            if not k.isdigit() or int(k) < 1:
                raise ValueError(f"remat_policy={name!r}: {outer}_<k> takes k, the layers a segment, an int >= 1")
            return outer, int(k)
    return None


def segment_length(name, n_layer: int) -> int:
    """The layers a segment of two-level remat policy `name` over `n_layer` layers: its k (1 ..
    n_layer; one that does not divide n_layer leaves a shorter last segment), else `auto_segment`."""
    outer, k = segment_policy(name)
    if k is None:
        return auto_segment(n_layer)
    if k > n_layer:
        raise ValueError(f"remat_policy={name!r}: segments of {k} layers, but the stack has {n_layer}; "
                         f"k must be 1 .. {n_layer} (or {outer!r}: k chosen for the stack)")
    return k


def auto_segment(n_layer: int) -> int:
    """The k that keeps the fewest layer inputs live, ceil(L / k) segment inputs plus the k of the
    segment being rebuilt (about sqrt(L)); a k that does not divide L counts one more, since the
    weights of the layers before the shorter last segment are then sliced apart (a copy), and of
    equals the one nearest sqrt(L). L = 32: 4 (8 + 4 live, not 32); L = 28: 4; L = 7: 3."""
    def cost(k):
        return -(-n_layer // k) + k + (n_layer % k != 0), abs(k - n_layer ** 0.5)

    return min(range(1, n_layer + 1), key=cost)


def kept_inputs(name, n_layer: int) -> tuple[int, int]:
    """(layer inputs a two-level policy keeps on the device at its peak, in host memory): the
    ceil(L / k) segment inputs (host memory under "offload_segments") and the k layer inputs of the
    segment its backward pass rebuilds."""
    outer, _ = segment_policy(name)
    k = segment_length(name, n_layer)
    segments = -(-n_layer // k)
    return (k, segments) if outer == "offload_segments" else (segments + k, 0)


__all__ = ["SEGMENT_POLICIES", "segment_policy", "segment_length", "auto_segment", "kept_inputs"]
