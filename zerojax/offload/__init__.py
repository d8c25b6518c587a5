"""Host offload through memory kinds: optimizer state streamed in chunks, params per layer.

One module an idea: `memory_kinds` (where an array lives, the per-layer fetch and the prefetching
layer scan), `chunks` (the chunk layout, its shardings, and the codec to the layout-free form a
checkpoint stores), `update` (the one update family and its chunk API), `host_loop` (its "host"
driver), `split_master` (the master as compute copy + remainder), `nvme/` (the swap-file tier).

DeepSpeed's `offload_optimizer: {device: cpu}` keeps the fp32 master weights and optimizer moments
in host memory and runs the update on the CPU. Here they stay in host memory too (a sharding whose
`memory_kind` is "pinned_host"), but the update runs on the accelerator: inside the jitted step each
chunk of (master, state) is copied to the device (`jax.device_put` to a "device" sharding), updated,
cast to the compute dtype, and copied back. Device memory then holds a few chunks, never the whole
optimizer state.

Chunk layout. The tree's leaves are either *stacked* (a leading "layers" axis of size L, scanned by
the model) or *rest* (embeddings, final norm). Pieces are `[rest, layers group 1, ..., group K]`
(groups: `np.array_split(range(L), K)`; the rest piece only if there are rest leaves). With
`ratio` (ZeRO-Offload++'s fraction of the optimizer state offloaded) the first ceil(ratio * pieces)
pieces live in host memory; the others form one device chunk updated in place, with no transfer.
The host pieces are stored as the rest chunk and one [L, ...] chunk of the host layers, updated by
a `fori_loop` over K groups of L/K layers (needs K | L) that carries the stored arrays themselves:
each iteration slices its group out of host memory, updates it on the device and writes it back
into the same host buffer (dynamic_update_slice), and writes the new compute copy into the
previous step's compute params (`compute_init`). Everything is updated in place: no
concatenation of the layers' new weights on the device and no second host copy of the state.
Device memory holds one group's state (EngineOptions.offload_loop="in_place", K = L). The "host"
loop keeps one host chunk per layer group instead (`chunk_layout(per_group=True)`), moved whole.

A chunk is a tree of the original structure with `None` in place of the leaves it lacks (so optax
masks written as functions of the params tree keep working); its stacked leaves are slices
`leaf[lo:hi]`.

Parameter offload (stage 3 `offload_param`) is `fetch` called on a layer's slice inside the
model's layer scan (or `scan_layers`, which also prefetches the next layer). JAX's typing rule
makes the gradient of a host-resident input host-resident: the backward pass sends each layer's
gradient to host as it is computed. `streamed_update` accepts host-resident gradients and streams
them in with their chunk.

On CPU the host memory kinds exist (device, pinned_host, unpinned_host) but are one address
space: `device_put` between them inside jit lowers to nothing; only the entry computation's layout
marks host buffers (`S(5)`). On GPU/TPU each such `device_put` lowers to an
`annotate_device_placement` custom call, which XLA's host-offload passes turn into copies between
memory spaces (async copy-start/copy-done on GPU).
"""

from zerojax.offload import host_loop, split_master  # noqa: E402 (after update, which host_loop imports)
from zerojax.offload.chunks import (
                                    Chunk,
                                    ChunkLayout,
                                    OffloadLayout,
                                    OffloadState,
                                    chunk_layout,
                                    chunk_templates,
                                    device_chunk,
                                    from_chunks,
                                    group,
                                    group_shardings,
                                    groups_of_at_least,
                                    init_offloaded,
                                    layer_pieces,
                                    merge_chunks,
                                    offload_layout,
                                    offload_master,
                                    piece,
                                    put_group,
                                    slice_sharding,
                                    split_chunks,
                                    to_chunks,
                                    to_kind,
)
from zerojax.offload.memory_kinds import (
                                    DEVICE,
                                    PINNED_HOST,
                                    UNPINNED_HOST,
                                    fetch,
                                    host_memory_kind,
                                    is_host,
                                    layer_shardings,
                                    memory_kinds,
                                    prefetch_scan,
                                    scan_layers,
                                    with_memory_kind,
)
from zerojax.offload.update import (
                                    accumulate_chunks,
                                    apply_chunk,
                                    deferred_update,
                                    grad_stats,
                                    grads_in,
                                    streamed_update,
)

__all__ = [
    "DEVICE", "PINNED_HOST", "UNPINNED_HOST", "memory_kinds", "host_memory_kind",
    "with_memory_kind", "is_host", "fetch", "layer_shardings", "scan_layers", "prefetch_scan", "Chunk", "ChunkLayout",
    "chunk_layout", "groups_of_at_least", "to_chunks", "from_chunks", "OffloadState", "OffloadLayout",
    "offload_layout",
    "init_offloaded", "offload_master", "layer_pieces", "device_chunk", "piece", "merge_chunks", "split_chunks",
    "chunk_templates",
    "streamed_update", "deferred_update", "grad_stats", "accumulate_chunks", "host_loop", "split_master",
    "apply_chunk", "grads_in", "group", "group_shardings", "put_group", "slice_sharding", "to_kind",
]
