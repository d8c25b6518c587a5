"""Running a stack of layers the way an engine's hooks ask: one piece of plain JAX that GPT-2, the
Llama family and the engine's own stand-ins (`zerojax.model.StackedBlocks`, the swapped block
class of an `nnx.vmap` stack) all run their layers through, so that fetching, remat and the
engine's layer scans behave the same for every model. It imports nothing of zerojax's runtime:
the engine hands in `fetch` and `layer_scan` (docs/CONTRACTS.md, "models -> engine: the per-layer
hook").
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name

# two-level checkpointing's names and segment length (jax-free: the config and the estimate read them too)
from zerojax.remat_segments import SEGMENT_POLICIES, auto_segment, segment_length, segment_policy

# the names a layer's input and its fetched weights carry inside the stack (remat policies read them)
LAYER_INPUT = "layer_input"
# a layer's weights after `fetch` (host -> device, or ZeRO-3's gather): never saved for the
# backward pass, so a full copy of every layer's weights is not kept for it
FETCHED_PARAMS = "fetched_layer_params"
# a segment's input under two-level checkpointing (`run_segments`): the only value "offload_segments" moves
# to host memory (the layer inputs inside a segment are rebuilt on the device in its backward)
SEGMENT_INPUT = "segment_input"
# the remat policies any layer stack takes; a model with tags of its own (GPT-2's "save_*") adds more
GENERIC_REMAT_POLICIES = (None, "full", "dots", "offload") + SEGMENT_POLICIES


class WithFrozen(NamedTuple):
    """A layer stack's per-layer inputs when part of them is never trained: `params` (the trained
    layers, [L, ...] leaves) and `frozen` (e.g. a LoRA's base, stacked alike, no gradient). A runner
    that prepares the layers for their gradients (the pipeline's accumulators) does so for `params`
    alone."""

    params: Any
    frozen: Any


def remat_policy(name):
    """The `jax.checkpoint` policy of a generic remat policy name, or None for any other name:
    "full" keeps each layer's input only, "dots" every matmul output without batch dimensions,
    "offload" the layer input in pinned host memory, "except_fetched" (the engine's, under a
    fetch with no remat asked for) everything but the fetched weights."""
    cp = jax.checkpoint_policies
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_with_no_batch_dims_saveable
    if name == "except_fetched":
        return cp.save_anything_except_these_names(FETCHED_PARAMS)
    if name == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device", offload_dst="pinned_host")
    return None


def segment_remat_policy(outer: str):
    """The `jax.checkpoint` policy around a whole segment: nothing saved but its input ("segments"),
    or its input in pinned host memory ("offload_segments")."""
    if outer == "offload_segments":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[SEGMENT_INPUT],
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.nothing_saveable


def layer_step(body, *, policy, fetch, policy_fn):
    """One layer's `body(h, layer_params)` as a stack runs it: `fetch` applied to the layer's
    params inside, named so that no remat policy saves the fetched weights, and the remat
    `policy` around it (with a fetch and no policy: "except_fetched", the weights fetched again in
    the backward pass rather than a copy of every layer's kept for it)."""
    if fetch is not None:
        block, policy = body, policy or "except_fetched"
        body = lambda x, p: block(x, jax.tree.map(  # noqa: E731
            lambda a: checkpoint_name(a, FETCHED_PARAMS), fetch(p)))
    # a layer runs inside a scan, which keeps iterations apart: CSE prevention is not needed
    return body if policy is None else jax.checkpoint(body, policy=policy_fn(policy), prevent_cse=False)


def run_layers(body, x, layers, *, policy, fetch, layer_scan, policy_fn, pieces=None, unroll=1):
    """`x` through `body(x, layer_params)` for each layer of the stacked `layers` ([L, ...] leaves):
    `layer_scan` with `fetch` is offload_param's prefetching scan; else each layer runs as
    `layer_step` makes it, one scan per piece of the remat policy, or the engine's `layer_scan`
    (pipeline stages) over all of them.

    policy_fn(name) -> a `jax.checkpoint` policy; pieces(policy, L) -> [(policy, layers), ...] in
    layer order (a model's split policies, GPT-2's "dots_<k>"), by default one piece; unroll:
    layers per iteration of the plain scan."""
    if segment_policy(policy) is not None:
        if layer_scan is not None:
            raise ValueError(f"remat_policy={policy!r} runs its own two-level scan; the engine's layer scan "
                             "(pipeline stages, offload_param's prefetch) takes one layer at a time: use \"full\" "
                             "or \"offload\" there (pipelines: pipeline.activation_checkpoint_interval)")
        return run_segments(body, x, layers, policy=policy, fetch=fetch, policy_fn=policy_fn, unroll=unroll)
    if fetch is not None and layer_scan is not None:
        return layer_scan(body, x, layers, fetch, inputs_to_host=policy == "offload")
    if fetch is not None:
        policy = policy or "except_fetched"
    n_layer = jax.tree.leaves(layers)[0].shape[0]
    parts = pieces(policy, n_layer) if pieces is not None else [(policy, n_layer)]
    if layer_scan is not None and len(parts) > 1:
        raise ValueError(f"remat_policy={policy!r} runs two layer scans; the engine's own layer scan "
                         "(pipeline stages) takes one policy: use \"dots\" or \"full\"")
    start = 0
    for name, n in parts:  # one scan per policy, each over its layers
        step = layer_step(body, policy=name, fetch=fetch, policy_fn=policy_fn)
        part = layers if n == n_layer else jax.tree.map(lambda a: a[start:start + n], layers)  # noqa: B023 - called within this iteration
        if layer_scan is not None:  # no fetch: e.g. pipeline stages over the "pipe" mesh axis
            x = layer_scan(step, x, part, None)
        else:
            x, _ = jax.lax.scan(lambda x, p, step=step: (step(x, p), None), x, part, unroll=unroll)
        start += n
    return x


def run_segments(body, x, layers, *, policy, fetch, policy_fn, unroll=1):
    """Two-level checkpointing of the stacked `layers`: segments of k layers (`segment_length`),
    each one `jax.checkpoint` that keeps only its input (on the device, or in host memory under
    "offload_segments"), run by an outer scan; inside, a scan of its layers, each checkpointed
    "full". The backward pass rebuilds one segment at a time, keeping its k layer inputs, then
    reruns each layer from its input: about L / k + k layer inputs live instead of L, for a second
    recompute of the forward. A last segment of L mod k layers runs after the scan (its weights and
    the others' are then slices of the stack: XLA copies them, which a k dividing L avoids)."""
    n_layer = jax.tree.leaves(layers)[0].shape[0]
    outer, _ = segment_policy(policy)
    k = segment_length(policy, n_layer)
    segment = _segment(body, fetch=fetch, policy_fn=policy_fn, unroll=min(unroll, k))
    # inside the scan, which keeps iterations apart, CSE prevention is not needed (as `layer_step`)
    checkpointed = jax.checkpoint(segment, policy=segment_remat_policy(outer), prevent_cse=False)
    n_seg, rest = divmod(n_layer, k)
    whole = jax.tree.map(lambda a: a[:n_seg * k].reshape((n_seg, k) + a.shape[1:]), layers)
    x, _ = jax.lax.scan(lambda h, p: (checkpointed(h, p), None), x, whole)
    if rest:  # outside a loop: CSE prevented, or XLA may merge the rebuild into the forward pass
        last = jax.checkpoint(segment, policy=segment_remat_policy(outer))
        x = last(x, jax.tree.map(lambda a: a[n_seg * k:], layers))
    return x


def _segment(body, *, fetch, policy_fn, unroll):
    """One segment: its input named SEGMENT_INPUT (what "offload_segments" moves to the host), then
    its layers in a scan, each as `layer_step` makes it with "full" (its input kept for the
    segment's backward, everything else rebuilt from it)."""
    step = layer_step(body, policy="full", fetch=fetch, policy_fn=policy_fn)

    def segment(h, seg_layers):
        h = checkpoint_name(h, SEGMENT_INPUT)
        h, _ = jax.lax.scan(lambda c, p: (step(c, p), None), h, seg_layers, unroll=unroll)
        return h

    return segment


__all__ = ["LAYER_INPUT", "SEGMENT_INPUT", "SEGMENT_POLICIES", "FETCHED_PARAMS", "GENERIC_REMAT_POLICIES", "WithFrozen",
           "remat_policy", "segment_policy", "segment_length", "auto_segment", "segment_remat_policy", "layer_step",
           "run_layers", "run_segments"]
