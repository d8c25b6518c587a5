"""The NVMe tier inside the engine's state and step: which leaves of the offloaded "loop" chunk live in
swap files (`NvmeTier`), moving them between files and arrays (`spill` / `fill`: init, `master_params`;
`SwappedLeaf`: checkpoints, a layer group at a time),
and the loop update that reads and writes them a layer group at a time through host callbacks
(`nvme_loop_update`, the NVMe twin of `update._loop_update, through the same chunk API`).

In the engine's state the loop chunk keeps `None` where a leaf lives in the files and its scalar
optimizer counters as arrays; everything else of the offload (the rest chunk, the compute copy) is
unchanged, in pinned host memory. See zerojax/offload/nvme/swapper.py for the files and the pipeline.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from zerojax._jax_compat import is_tracer
from zerojax.offload.chunks import OffloadLayout, chunk_templates, group, is_none, put_group, slice_sharding
from zerojax.offload.memory_kinds import DEVICE, is_sharding
from zerojax.offload.nvme.swapper import NvmeSwapper, SwapLeaf, check_swap_path
from zerojax.offload.update import apply_chunk, grads_in
from zerojax.streamed import StreamedLeaf


def _flat(tree):
    return jax.tree.flatten(tree, is_leaf=is_none)


@dataclasses.dataclass(eq=False)
class NvmeTier:
    """The loop chunk `chunk` of `off` kept in swap files. Built with the layout (no files yet);
    `open()` creates the swapper (engine init: the path checks run there, before the first step)."""

    off: OffloadLayout
    chunk: int
    m_template: Any            # the chunk's abstract master tree (None where absent)
    s_template: Any            # the chunk's abstract optimizer state
    m_files: tuple             # flat indices (None-aware) of master leaves in files
    s_files: tuple             # flat indices of optimizer-state leaves in files (the stacked ones)
    settings: dict             # NvmeSwapper keyword arguments (nvme_path, buffer_count, ...)
    host_layers: int = 0       # the chunk's first layers, whose state the swapper keeps in host memory
    swapper: NvmeSwapper | None = None
    closed: bool = False

    @classmethod
    def build(cls, tx, abstract_master, off: OffloadLayout, settings: dict, *,
              host_layers: int = 0) -> NvmeTier | None:
        """The tier of the host loop chunk; its first `host_layers` layers (the host / disk split) stay in
        host memory inside the swapper, so the chunk -- and the gradients and compute copy it is cut
        from -- stays one [L, ...] stack (two chunks would join their compute copies, and slice the
        host-resident gradients, into whole new stacks: 27 GiB on the device for a 7.46B GPT)."""
        loops = [i for i, c in enumerate(off.layout.chunks) if c.loop and c.host]
        if not loops:
            return None
        i = loops[0]
        c = off.layout.chunks[i]
        m_tmpl, s_tmpl = chunk_templates(tx, abstract_master, off.layout)
        n = c.hi - c.lo
        per = n // c.loop
        if host_layers >= n:
            raise ValueError(f"{HOST_LAYERS_KEY} = {host_layers} keeps all {n} offloaded layers in host memory and "
                             "leaves nothing for the swap files; use \"device\": \"cpu\", or at most "
                             f"{n - per} host layers")
        m_leaves, _ = _flat(m_tmpl[i])
        s_leaves, _ = _flat(s_tmpl[i])
        m_files = tuple(j for j, x in enumerate(m_leaves) if x is not None)
        s_files = tuple(j for j, x in enumerate(s_leaves) if x is not None and x.ndim >= 1 and x.shape[0] == n)
        return cls(off, i, m_tmpl[i], s_tmpl[i], m_files, s_files, dict(settings), int(host_layers))

    # ------------------------------------------------------------------ shapes

    @property
    def _c(self):
        return self.off.layout.chunks[self.chunk]

    @property
    def per(self) -> int:
        return (self._c.hi - self._c.lo) // self._c.loop

    def swap_leaves(self) -> list[SwapLeaf]:
        m, _ = _flat(self.m_template)
        s, _ = _flat(self.s_template)
        out = [SwapLeaf(f"master{j}", (self.per,) + tuple(m[j].shape[1:]), np.dtype(m[j].dtype)) for j in self.m_files]
        out += [SwapLeaf(f"state{j}", (self.per,) + tuple(s[j].shape[1:]), np.dtype(s[j].dtype)) for j in self.s_files]
        return out

    def disk_bytes(self) -> int:
        """Bytes of the swap files (before block padding)."""
        return sum(leaf.group_bytes for leaf in self.swap_leaves()) * (self._c.loop - self.host_groups)

    @property
    def host_groups(self) -> int:
        return self.host_layers // self.per

    def host_tier_bytes(self) -> int:
        """Bytes of the same leaves kept in host memory for the split's `host_layers` layers."""
        return sum(leaf.group_bytes for leaf in self.swap_leaves()) * self.host_groups

    # ------------------------------------------------------------------ the live (placeholder) form

    def live(self, chunks: list, which: str) -> list:
        """Per-chunk trees (master / state / their shardings) with the file leaves of the NVMe chunk set to None."""
        files = self.m_files if which == "master" else self.s_files
        leaves, treedef = _flat(chunks[self.chunk])
        out = list(chunks)
        out[self.chunk] = treedef.unflatten([None if j in files else x for j, x in enumerate(leaves)])
        return out

    def loop_update(self, tx, g, s_live, cp, **kw):
        """`nvme_loop_update` for this tier (what `update.streamed_update` calls)."""
        return nvme_loop_update(self, tx, g, s_live, cp, **kw)

    # ------------------------------------------------------------------ files <-> arrays

    def open(self) -> NvmeSwapper:
        if self.closed:
            raise RuntimeError("the NVMe swap files were removed by engine.close(); the engine's optimizer state "
                               "is gone with them (save a checkpoint before close)")
        if self.swapper is None:
            self.swapper = NvmeSwapper(leaves=self.swap_leaves(), groups=self._c.loop, host_groups=self.host_groups,
                                       **self.settings)
        return self.swapper

    def close(self) -> None:
        if self.swapper is not None:
            self.swapper.close()
            self.swapper = None
            self.closed = True

    def spill(self, master: list, state: list) -> tuple[list, list]:
        """Write the NVMe chunk's file leaves (whole arrays) to the files; -> the live form. Under
        tracing (an abstract engine: `jax.eval_shape`) nothing is written and no file is made."""
        if any(is_tracer(x) for x in jax.tree.leaves((master, state))):
            return self.live(master, "master"), self.live(state, "state")
        sw = self.open()
        m, _ = _flat(master[self.chunk])
        s, _ = _flat(state[self.chunk])
        sw.write_all([np.asarray(jax.device_get(m[j])) for j in self.m_files]
                     + [np.asarray(jax.device_get(s[j])) for j in self.s_files])
        return self.live(master, "master"), self.live(state, "state")

    def leaf_state_files(self, tx) -> dict | None:
        """{master flat index i: the flat indices of the state leaves `tx.init` makes for leaf i alone}, from
        `tx.init` on a chunk holding leaf i only; None when such a state does not line up with the chunk's
        (an optimizer whose state is not one tree per parameter tree): `init_files` needs it."""
        m_tmpl, m_def = _flat(self.m_template)
        s_def = _flat(self.s_template)[1]
        out = {}
        for i in self.m_files:
            one = m_def.unflatten([m_tmpl[k] if k == i else None for k in range(len(m_tmpl))])
            st, st_def = _flat(jax.eval_shape(tx.init, one))
            if st_def != s_def:
                return None
            out[i] = [k for k in self.s_files if st[k] is not None]
        return out

    def init_files(self, tx, leaf_fn, limit_bytes: int = 0) -> None:
        """Fill the files with the initial state a few layer groups at a time, never the whole swapped state
        in host memory (what `spill` of a state built in host memory needs: it killed a 7.06B run). Per
        file leaf i, a jitted function computes `leaf_fn(i)` (leaf i's fp32 initial value, whole, on the
        device: a model's initialiser draws a stacked leaf at once), slices out as many layer groups as
        fit `limit_bytes` (with their `tx.init` states; 0: every group in one call) and runs `tx.init`
        on each; the slices and moments go to the files. A moment that is all zeros (Adam's) is not
        written: the files were reserved with posix_fallocate, whose blocks read as zeros."""
        sw = self.open()
        c, per, nm = self._c, self.per, len(self.m_files)
        owners = self.leaf_state_files(tx)
        m_sh, _ = _flat(self.off.master_shardings[self.chunk])
        m_tmpl, m_def = _flat(self.m_template)
        for slot, i in enumerate(self.m_files):
            dev = slice_sharding(m_sh[i], per).with_memory_kind(DEVICE)
            ks = owners[i]
            made = sw.leaves[slot].group_bytes * (1 + len(ks))   # device bytes one group's outputs take
            n = max((d for d in range(1, c.loop + 1) if c.loop % d == 0
                     and (not limit_bytes or d * made <= limit_bytes)),
                    default=1)   # groups per call: a divisor of the group count, so one program serves

            def build(g0, i=i, ks=ks, n=n):
                whole, outs = leaf_fn(i), []
                for g in range(n):
                    x = jax.lax.dynamic_slice_in_dim(whole, c.lo + (g0 + g) * per, per, axis=0)
                    st, _ = _flat(tx.init(m_def.unflatten([x if k == i else None for k in range(len(m_tmpl))])))
                    ys = [st[k] for k in ks]
                    outs.append((x, ys, [jnp.any(y != 0) for y in ys]))
                return outs

            fn = jax.jit(build, out_shardings=[(dev, [dev] * len(ks), None)] * n)
            for g0 in range(0, c.loop, n):
                outs = fn(g0)
                for g in range(n):
                    (x, ys, nonzero), outs[g] = outs[g], None   # each group's arrays freed once written
                    keep = [(nm + self.s_files.index(k), y) for k, y, nz in zip(ks, ys, nonzero) if bool(nz)]
                    sw.write_leaves(g0 + g, [slot] + [j for j, _ in keep],
                                    [np.asarray(jax.device_get(x))] + [np.asarray(jax.device_get(y)) for _, y in keep])
                    del x, ys, keep
        sw.flush()

    def spill_master(self, master: list) -> list:
        """Only the master's file leaves into the files (a checkpoint restored without its optimizer state)."""
        sw = self.open()
        whole = sw.read_all()
        m, _ = _flat(master[self.chunk])
        sw.write_all([np.asarray(jax.device_get(m[j])) for j in self.m_files] + whole[len(self.m_files):])
        return self.live(master, "master")

    def fill(self, master: list, state: list | None) -> tuple[list, list | None]:
        """The live form with the file leaves read back whole and placed as the offload keeps them (host
        memory then holds the chunk whole: `master_params`, a checkpoint when `streams` is False, tests)."""
        whole = self.open().read_all()
        nm = len(self.m_files)
        m_sh, _ = _flat(self.off.master_shardings[self.chunk])
        s_sh, _ = _flat(self.off.state_shardings[self.chunk])
        return self._with(master, state, [jax.device_put(v, m_sh[j]) for j, v in zip(self.m_files, whole[:nm])],
                          [jax.device_put(v, s_sh[j]) for j, v in zip(self.s_files, whole[nm:])])

    def _with(self, master: list, state: list | None, m_values, s_values):
        """Per-chunk (master, state) with the tier chunk's file leaves set to `m_values` / `s_values`."""
        master = list(master)
        master[self.chunk] = _put(master[self.chunk], self.m_files, m_values)
        if state is not None:
            state = list(state)
            state[self.chunk] = _put(state[self.chunk], self.s_files, s_values)
        return master, state

    # ------------------------------------------------------------------ checkpoints, a group at a time

    @property
    def streams(self) -> bool:
        """Whether checkpoints stream the file leaves (`SwappedLeaf`): when the tier's chunk is the whole
        layer stack, so a stored leaf is the file leaf (the default; offload_optimizer.ratio < 1 puts the
        last layers in a device chunk and a stored leaf joins both: read whole, `fill`)."""
        return self._c.lo == 0 and self._c.hi == self.off.layout.num_layers

    def swapped_leaves(self) -> tuple[list, list]:
        """(master, state) `SwappedLeaf`s, one per file leaf, in the order of `m_files` / `s_files`."""
        m, _ = _flat(self.m_template)
        s, _ = _flat(self.s_template)
        nm = len(self.m_files)
        return ([SwappedLeaf(self, k, tuple(m[j].shape), np.dtype(m[j].dtype)) for k, j in enumerate(self.m_files)],
                [SwappedLeaf(self, nm + k, tuple(s[j].shape), np.dtype(s[j].dtype))
                 for k, j in enumerate(self.s_files)])

    def swapped(self, master: list, state: list | None) -> tuple[list, list | None]:
        """The live form with a `SwappedLeaf` at each file leaf: a checkpoint's save reads them a group at a time."""
        return self._with(master, state, *self.swapped_leaves())

    def sinks(self, master, state):
        """The stored (unchunked) master / optimizer state (abstract) with a `SwappedLeaf` at each file leaf:
        a restore writes them into the files a group at a time. Needs `streams` (the chunk's leaves are the
        stacked leaves whole, at the same flat positions)."""
        m_vals, s_vals = self.swapped_leaves()
        return _put(master, self.m_files, m_vals), _put(state, self.s_files, s_vals)


def _put(tree, files, values):
    """`tree` with its (None-aware) flat leaves `files` set to `values`."""
    leaves, treedef = _flat(tree)
    for j, v in zip(files, values):
        leaves[j] = v
    return treedef.unflatten(leaves)


@dataclasses.dataclass(eq=False)
class SwappedLeaf(StreamedLeaf):
    """Swap leaf `slot` of `tier` (a stacked [L, ...] master or moment leaf in the files) as a checkpoint sees
    it: saved and restored a layer group at a time through the swapper, never whole in host memory."""

    tier: NvmeTier
    slot: int
    shape: tuple
    dtype: np.dtype

    def blocks(self):
        sw, per = self.tier.open(), self.tier.per
        for g in range(sw.groups):
            yield g * per, (g + 1) * per, sw.read_leaf(g, self.slot)

    def fill(self, read):
        per = self.tier.per
        self.tier.open().write_leaf_groups(self.slot, lambda g: read(g * per, (g + 1) * per))


HOST_LAYERS_KEY = "zero_optimization.offload_optimizer.host_layers"


def nvme_tier(cfg, tx, abstract_master, off: OffloadLayout) -> NvmeTier:
    """The tier for `zero_optimization.offload_optimizer: {device: "nvme"}`, its swapper's settings from
    the offload section and the `aio` section (DeepSpeed 0.19.8's keys and defaults)."""
    opt, aio = cfg.zero_optimization.offload_optimizer, cfg.aio
    if jax.process_count() > 1:
        raise ValueError("zero_optimization.offload_optimizer.device = \"nvme\" with several processes is not "
                         "supported yet (each process would need its own shards' files); use one process per "
                         "host with all its devices, or \"device\": \"cpu\"")
    settings = dict(nvme_path=str(opt.nvme_path), buffer_count=int(opt.buffer_count), block_size=int(aio.block_size),
                    threads=int(aio.queue_depth) * int(aio.intra_op_parallelism),
                    pipeline_read=bool(opt.pipeline_read), pipeline_write=bool(opt.pipeline_write),
                    rank=jax.process_index())
    tier = NvmeTier.build(tx, abstract_master, off, settings, host_layers=int(opt.host_layers))
    if tier is None:
        raise ValueError("zero_optimization.offload_optimizer.device = \"nvme\": the model has no stacked (scanned) "
                         "layer parameters to swap a layer group at a time (or offload_optimizer.ratio leaves "
                         "no layer in host memory); use \"device\": \"cpu\" for it")
    # the path's checks now, before the model is built (the swapper checks again with block padding)
    check_swap_path(settings["nvme_path"], tier.disk_bytes())
    return tier


def check_params_in_cpu(param_cfg, abstract_master) -> None:
    """`offload_param: {device: "nvme"}`: DeepSpeed keeps up to `max_in_cpu` parameter elements in CPU
    memory; zerojax keeps the compute parameters in host memory and refuses a model above that."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_master))
    if n > int(param_cfg.max_in_cpu):
        raise ValueError(f"zero_optimization.offload_param.device = \"nvme\": the model has {n:,} parameter "
                         f"elements, more than offload_param.max_in_cpu = {int(param_cfg.max_in_cpu):,}; zerojax "
                         "keeps the parameters in host memory (streaming them from files is not supported yet): "
                         f"raise max_in_cpu to at least {n:,} (host memory: 2 bytes each in bf16), or use "
                         "\"device\": \"cpu\"")


def nvme_loop_update(tier: NvmeTier, tx, g, s_live, cp, *, compute_dtype, skip, grad_scale, compute_kind):
    """The loop chunk's update with its master and moments in files: a fori_loop over the layer
    groups, each reading its group through `io_callback` (read ahead by the swapper), updating it
    on the device and writing it back through `io_callback` (written behind). -> (the state's live
    form, the compute copy `cp` with every group written in place)."""
    c, per = tier._c, tier.per
    m_sh = tier.off.master_shardings[tier.chunk]
    s_sh_leaves, _ = _flat(tier.off.state_shardings[tier.chunk])
    m_tmpl, m_def = _flat(tier.m_template)
    s_tmpl, s_def = _flat(tier.s_template)
    s_in, _ = _flat(s_live)   # counters, None at the file leaves
    s_in = [None if k in tier.s_files else x for k, x in enumerate(s_in)]
    shapes = [jax.ShapeDtypeStruct(leaf.group_shape, leaf.dtype) for leaf in tier.swap_leaves()]
    nm = len(tier.m_files)
    m_dev = jax.tree.map(lambda x: None if x is None else slice_sharding(x, per).with_memory_kind(DEVICE), m_sh,
                         is_leaf=lambda x: x is None or is_sharding(x))
    m_dev_leaves, _ = _flat(m_dev)
    s_dev = {j: slice_sharding(s_sh_leaves[j], per).with_memory_kind(DEVICE) for j in tier.s_files}
    read = lambda j: tier.swapper.read(j)  # noqa: E731 - looked up at run time: the swapper opens after tracing
    write = lambda j, *xs: tier.swapper.write(j, *xs)  # noqa: E731

    def body(j, carry):
        counters, cp = carry
        vals = io_callback(read, shapes, j)
        mm = [None] * len(m_tmpl)
        for k, v in zip(tier.m_files, vals[:nm]):
            mm[k] = jax.device_put(v, m_dev_leaves[k])
        ss = [None if x is None else jax.device_put(x, s_sh_leaves[k].with_memory_kind(DEVICE))
              for k, x in enumerate(s_in)]   # every group reads the step's counters, as the in-jit loop
        for k, v in zip(tier.s_files, vals[nm:]):
            ss[k] = jax.device_put(v, s_dev[k])
        gg = grads_in(group(g, j, per), m_dev)
        mm, ss, cc = apply_chunk(tx, gg, s_def.unflatten(ss), m_def.unflatten(mm), compute_dtype, skip, grad_scale)
        mm, _ = _flat(mm)
        ss, _ = _flat(ss)
        io_callback(write, None, j, *[mm[k] for k in tier.m_files], *[ss[k] for k in tier.s_files])
        if compute_kind is not None:
            cc = jax.device_put(cc, jax.tree.map(lambda s: None if s is None else s.with_memory_kind(compute_kind),
                                                 m_dev, is_leaf=lambda x: x is None or is_sharding(x)))
        cp = put_group(cp, cc, j, per)
        # the counters (same in every group): this group's new ones, as the in-jit loop keeps them
        counters = [None if x is None else jax.device_put(ss[k], s_sh_leaves[k]) for k, x in enumerate(s_in)]
        return counters, cp

    counters, cp = jax.lax.fori_loop(0, c.loop, body, (s_in, cp))
    return s_def.unflatten(counters), cp


__all__ = ["NvmeTier", "SwappedLeaf", "nvme_loop_update", "nvme_tier", "check_params_in_cpu"]
