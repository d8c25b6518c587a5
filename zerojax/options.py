"""`EngineOptions`: every engine knob beyond DeepSpeed's JSON config, typed and validated once.

DeepSpeed's config says *what* to train (stage, precision, offload device); these say *how* zerojax
lays it out where DeepSpeed has no key (the offload's chunk layout, the stage-3 gather, ...). The
defaults are the measured winners (README, "Measured"); change them to measure, not to tune.

    engine = zerojax.shard(model, cfg, loss_fn=loss_fn,
                           options=zerojax.EngineOptions(offload_prefetch=False))

Benchmarks that sweep a knob from a shell script read the `ZEROJAX_*` environment variables through
`EngineOptions.from_env()`, the one place in zerojax that reads them; the engine never does.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

STAGE3_GATHER_MODES = ("layer", "auto")
ADAM_MU_DTYPES = (None, "bfloat16")
PIPELINE_STAGE_LOOPS = ("unrolled", "unrolled_sliced", "scan")
OFFLOAD_LOOPS = ("in_place", "paired", "host")   # zerojax.offload.update.streamed_update's `loop`


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine knobs with no DeepSpeed key. Fields (defaults in brackets):

    offload_chunks [None]: the offloaded layers are updated K groups at a time (`zerojax.offload`);
        None = one layer a group (measured fastest for "in_place", and the least device memory),
        under offload_loop="host" groups of offload_host_chunk_bytes. K must divide the layer count.
    offload_host_chunk_bytes [256 MiB]: with offload_loop="host" and offload_chunks None, each
        chunk is the fewest layers whose fp32 master holds at least this many bytes per device
        (`offload.groups_of_at_least`; a divisor of the layer count): one transfer each way and
        one jitted update per chunk, so fewer, larger chunks dispatch less. GPT-2 Large on one
        GPU: 4 layers a chunk (315 MB), 29,131 tokens/s against one layer's 24,199 (session 10);
        3 / 4 / 6 layers with the split master and bf16 first moment 35,905 / 36,216 / 36,946 at
        8.02 / 8.81 / 10.08 GiB (session 11). Device memory grows with the chunk (each prefetched
        or in-flight chunk holds its state): lower it if the memory guard says the step does not fit.
    offload_unroll [1]: unroll of the model's layer scan under offload_param (2 hit an XLA layout
        error on GPU, jax 0.11.2).
    offload_prefetch [True]: under offload_param, fetch layer i+1 while layer i computes (the
        model's `layer_scan`).
    offload_write_pieces [0]: optimizer offload: the non-layer chunk (embeddings, final norm),
        updated whole, is written back as a new host array (0) or into its donated host buffer
        by dynamic_update_slice in this many pieces (>= 2). Why: device->host into a fresh pinned
        output measured 4.1 GB/s on an H200, into a donated buffer 55 GB/s (issue #18). Inside
        the step's jit only: with offload_loop="host" it is an error (the runtime writes whole).
    offload_streams [1]: optimizer offload: the offloaded layer groups are stored as this many
        host chunks of consecutive groups, updated side by side by the one update loop (a group
        of each per iteration), so one chunk's write-back need not wait for another's read. Must
        divide the group count (offload_chunks, or the layer count).
    offload_loop ["in_place"]: optimizer offload: how the layers' state streams through the
        device. "in_place": one stacked host buffer per leaf, a fori_loop reading each layer
        group's slice and writing it back by dynamic_update_slice (slice reads and writes of
        host buffers ran one after the other on an H200, 27 GB/s each way); "paired": one host
        array per layer group, updated in an unrolled loop that issues group j+1's whole-array
        read beside group j's write-back (`offload.update._paired_update`). Optimizer offload
        alone (not with offload_param or NVMe); offload_streams is then implied (one per group).
        Measured on one H200 (GPT-2 Large, ZeRO-2, 24 GB cap): "paired" 16,677 tokens/s (with
        the bf16 first moment 19,003) against "in_place" 18,398 (22,305) in session 5, although
        the same pairing moved 48 GB/s each way in isolation (docs/offload-transfers.md).
        "host": the layout of "paired", its chunks updated after the step's jit, from Python
        (`offload.host_loop.HostLoop`: one `device_put` of each chunk's state each way, the
        runtime's transfers running both ways at once): 21,098 / 20,847 tokens/s against
        "in_place" 18,034 side by side (+16%), peak 6.04-6.15 GiB against 5.54; with
        offload_chunks=9 (4 layers a chunk: fewer transfers) and adam_mu_dtype="bfloat16"
        24,659-25,101 at 6.5-6.8 GiB (session 9, docs/offload-transfers.md); since session 10
        (reads prefetched during the jit, write-backs overlapping the next one) 31,655-32,379 at
        9.45-9.61 GiB, one layer a chunk with the fp32 moment 23,914-24,199 at 6.55-7.00 GiB
        (in_place beside it: 18,366 / 5.52); since session 11 (offload_host_chunk_bytes groups,
        the split master by default) 32,207 at 9.60 GiB with the fp32 moment, 36,261 at 8.47 with
        adam_mu_dtype="bfloat16" (in_place 18,372 / 5.54; GPT-2 XL 15,238 / 18,111 against 9,940).
        The same restrictions as "paired".
    offload_host_window [3]: with offload_loop="host", the chunks whose state may be on the device
        at once while the host loop runs (`offload.host_loop.HostLoop`); 0 = no limit. The last
        `window` chunks' write-backs run during the next step's jit.
    offload_host_prefetch [2]: with offload_loop="host", the chunks whose state is
        brought to the device before the step's jit is dispatched, so that their reads overlap the
        forward / backward (the runtime starts a transfer dispatched after a program only when the
        program is done); each sits on the device beside the jit's buffers. Measured on GPT-2
        Large (offload_chunks=9, adam_mu_dtype="bfloat16", 24 GB cap): prefetch 0 / window 2
        24,699 tokens/s at 6.88 GiB, prefetch 2 / window 3 31,655-32,379 at 9.45-9.61 GiB.
    offload_host_prefetch_last [0]: with offload_loop="host", chunks at the end of the loop read in
        before the step's jit as well, kept on the device through the loop and updated last, so
        the next step's jit does not wait for their reads (held back by the window otherwise).
        Alone instead of offload_host_prefetch (session 10): 32,157 tokens/s at 10.56 GiB, no
        faster; 1 beside it (session 11, split master, bf16 moment): 36,555-37,595 against
        36,144-36,261, for 0.4-1.1 GiB more; left at 0.
    offload_master_split [None]: with offload_loop="host" and bf16 compute, the offloaded master
        is kept as the bf16 compute copy (on the device anyway) plus a 16-bit remainder in host
        memory (`offload.split_master`): 2 bytes a parameter less each way over PCIe every step
        (8 instead of 10 with adam_mu_dtype="bfloat16") and in host memory. Exact but for exact
        ties (one fp32 ulp, probability 2^-16 per weight and step); checkpoints store the fp32
        master as without it. None: on wherever it applies (bf16 and "host"); True: required (an
        error elsewhere); False: the whole fp32 master on the host. Measured (GPT-2 Large, 4
        layers a chunk, bf16 first moment, 24 GB cap, session 11): 36,144 / 36,216 tokens/s at
        8.71 / 8.81 GiB against 31,495 / 9.54 without; fp32 moment 31,262 / 9.44 (session 10
        without: 29,131 / 10.54).
    master_split [False]: without optimizer offload, with bf16 compute, the fp32 master kept on
        the device as the bf16 compute params (which the device holds anyway) plus an int16
        remainder (`offload.split_master`, as offload_master_split does for host memory): 2 bytes
        a parameter less of the model states (the master's share of the devices holding it: all of
        it on one GPU, 1 / data-parallel size with ZeRO 1-3), 1.44 GiB for GPT-2 Large on one GPU.
        The update rebuilds the fp32 master, updates it and splits it again in the same pass. Exact
        but for exact ties (one fp32 ulp, probability 2^-16 per weight and step); checkpoints and
        `master_params` hold the fp32 master as without it. True with fp16 / fp32 compute or with
        offload (offload_optimizer or offload_param) is an error.
    adam_mu_dtype [None]: Adam/AdamW's first moment stored in this dtype ("bfloat16"), updated
        and used in fp32 within the step: 2 bytes less per parameter in memory (and, under
        optimizer offload, each way over PCIe: 10 bytes instead of 12). Changes training slightly
        (the moment is rounded to 8 bits of mantissa each step); DeepSpeed has no such key. None:
        the master's dtype (fp32), as DeepSpeed.
    stage3_gather ["layer"]: ZeRO-3's all-gather on use, one layer at a time inside the layer scan;
        "auto" leaves the placement to GSPMD.
    init_group_bytes [None]: offload init builds the fp32 weights in groups of at most this many
        bytes; None = a quarter of the device's memory (no limit on CPU).
    pipeline_repeats [1]: with pipeline.stages > 1, circular repeats R: each stage holds R blocks of
        layers / (stages x R) layers and every micro-batch passes the stages R times, shrinking the
        bubble from (S - 1) / (M + S - 1) to (S - 1) / (M R + S - 1) (`zerojax.sharding.pipeline`).
    pipeline_stage_loop ["unrolled"]: how a stage runs its layers inside each pipeline iteration:
        "unrolled" (one copy of the layer per layer in the compiled step: each layer's saved
        activations go straight into the step's stacked buffers) or "scan" (a loop over them,
        compiled once: its stacked activations are copied into the step's buffers and out again
        every iteration, issue #15). Trades compile time for step time: GPT-2 Large's schedule
        (2 stages, 8 micro-batches of 2 x 1024 tokens, one H200) ran 425 ms a step unrolled vs
        436 scanned, peak 71.3 vs 77.7 GiB, compiled in 16 vs 4 s (session 6, when "unrolled"
        still sliced each layer's weights out of the stage's stack in every iteration: that form
        is kept as "unrolled_sliced" for A/B runs; "unrolled" cuts them once, before the loop).
    memory_guard [True]: before the first step of each batch shape, compare XLA's predicted peak
        with the device's memory and raise WillNotFitError instead of running out mid-step.
    plans_for [None]: `plans_for(engine, batch_shapes, budget) -> plans` called when the guard
        fails, so the WillNotFitError lists plans that fit (`zerojax.shard` sets the planner's).
    """

    offload_chunks: int | None = None
    offload_unroll: int = 1
    offload_prefetch: bool = True
    offload_write_pieces: int = 0
    offload_streams: int = 1
    offload_loop: str = "in_place"
    offload_host_window: int = 3
    offload_host_prefetch: int = 2
    offload_host_prefetch_last: int = 0
    offload_master_split: bool | None = None
    master_split: bool = False
    offload_host_chunk_bytes: int = 256 * 2**20
    adam_mu_dtype: str | None = None
    stage3_gather: str = "layer"
    init_group_bytes: int | None = None
    pipeline_repeats: int = 1
    pipeline_stage_loop: str = "unrolled"
    memory_guard: bool = True
    plans_for: Callable[[Any, Any, int], Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        problems = []
        if self.stage3_gather not in STAGE3_GATHER_MODES:
            problems.append(f"stage3_gather={self.stage3_gather!r}: choose one of {STAGE3_GATHER_MODES}")
        for name, least, optional in (("offload_chunks", 1, True),
                                      ("offload_unroll", 1, False), ("init_group_bytes", 1, True),
                                      ("offload_write_pieces", 0, False), ("offload_streams", 1, False),
                                      ("offload_host_window", 0, False), ("offload_host_prefetch", 0, False),
                                      ("offload_host_prefetch_last", 0, False),
                                      ("offload_host_chunk_bytes", 1, False),
                                      ("pipeline_repeats", 1, False)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{name}={value!r}: an int >= {least}" + (" or None" if optional else ""))
        for name in ("offload_prefetch", "memory_guard"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r}: True or False")
        if not isinstance(self.master_split, bool):
            problems.append(f"master_split={self.master_split!r}: True or False")
        if not isinstance(self.offload_master_split, (bool, type(None))):
            problems.append(f"offload_master_split={self.offload_master_split!r}: None (where it applies), "
                            "True or False")
        if self.pipeline_stage_loop not in PIPELINE_STAGE_LOOPS:
            problems.append(f"pipeline_stage_loop={self.pipeline_stage_loop!r}: one of {PIPELINE_STAGE_LOOPS}")
        if self.offload_loop not in OFFLOAD_LOOPS:
            problems.append(f"offload_loop={self.offload_loop!r}: one of {OFFLOAD_LOOPS}")
        if self.offload_loop in ("paired", "host") and self.offload_streams > 1:
            problems.append(f"offload_loop={self.offload_loop!r} with offload_streams={self.offload_streams}: "
                            f"{self.offload_loop!r} stores one chunk per layer group already; leave offload_streams at 1")
        if self.adam_mu_dtype not in ADAM_MU_DTYPES:
            problems.append(f"adam_mu_dtype={self.adam_mu_dtype!r}: one of {ADAM_MU_DTYPES}")
        if self.offload_loop == "host" and self.offload_write_pieces:
            problems.append(f"offload_write_pieces={self.offload_write_pieces} with offload_loop='host': the "
                            "host loop writes each chunk back whole with the runtime's own transfer (it "
                            "would do nothing); leave offload_write_pieces at 0")
        if self.offload_write_pieces == 1:
            problems.append("offload_write_pieces=1: 0 (write back whole) or >= 2 (one full-size piece "
                            "is what XLA turns back into a fresh output)")
        if self.plans_for is not None and not callable(self.plans_for):
            problems.append(f"plans_for={self.plans_for!r}: a callable (engine, batch_shapes, budget) -> plans, or None")
        if problems:
            raise ValueError("EngineOptions: " + "; ".join(problems))

    def replace(self, **changes) -> "EngineOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "EngineOptions":
        """Options from the ZEROJAX_* environment variables (benchmark scripts), then `overrides`.

        ZEROJAX_OFFLOAD_CHUNKS, _OFFLOAD_UNROLL, _OFFLOAD_PREFETCH, _OFFLOAD_WRITE_PIECES,
        _OFFLOAD_STREAMS, _OFFLOAD_LOOP, _OFFLOAD_HOST_WINDOW, _ADAM_MU_DTYPE, _MASTER_SPLIT, _STAGE3_GATHER, _INIT_GROUP_BYTES,
        _PIPELINE_STAGE_LOOP, _MEMORY_GUARD.
        Booleans accept 1/0, true/false, yes/no, on/off; anything else is an error naming the
        variable and the values it takes.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        problems = []
        for name, (var, parse) in _ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                values[name] = parse(raw)
            except ValueError as e:
                problems.append(f"{var}={raw!r}: {e}")
        if problems:
            raise ValueError("EngineOptions.from_env: " + "; ".join(problems))
        return cls(**{**values, **overrides})


def _int_or_none(raw: str) -> int | None:
    if raw.lower() == "none":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError("an integer or none") from None


def _positive_or_none(raw: str) -> int | None:
    # the variables' old meaning: 0 or "none" = the default
    value = _int_or_none(raw)
    return value or None


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("an integer") from None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"one of {_TRUE + _FALSE}")


def _choice(choices):
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"one of {choices}")
        return raw
    return parse


# field -> (environment variable, parser)
_ENV = {
    "offload_chunks": ("ZEROJAX_OFFLOAD_CHUNKS", _positive_or_none),
    "offload_unroll": ("ZEROJAX_OFFLOAD_UNROLL", _int),
    "offload_prefetch": ("ZEROJAX_OFFLOAD_PREFETCH", _bool),
    "offload_write_pieces": ("ZEROJAX_OFFLOAD_WRITE_PIECES", _int),
    "offload_streams": ("ZEROJAX_OFFLOAD_STREAMS", _int),
    "offload_loop": ("ZEROJAX_OFFLOAD_LOOP", _choice(OFFLOAD_LOOPS)),
    "offload_host_window": ("ZEROJAX_OFFLOAD_HOST_WINDOW", _int),
    "offload_host_prefetch": ("ZEROJAX_OFFLOAD_HOST_PREFETCH", _int),
    "offload_host_prefetch_last": ("ZEROJAX_OFFLOAD_HOST_PREFETCH_LAST", _int),
    "offload_master_split": ("ZEROJAX_OFFLOAD_MASTER_SPLIT", _bool),
    "master_split": ("ZEROJAX_MASTER_SPLIT", _bool),
    "offload_host_chunk_bytes": ("ZEROJAX_OFFLOAD_HOST_CHUNK_BYTES", _int),
    "adam_mu_dtype": ("ZEROJAX_ADAM_MU_DTYPE", _choice(("bfloat16",))),
    "stage3_gather": ("ZEROJAX_STAGE3_GATHER", _choice(STAGE3_GATHER_MODES)),
    "init_group_bytes": ("ZEROJAX_INIT_GROUP_BYTES", _positive_or_none),
    "pipeline_stage_loop": ("ZEROJAX_PIPELINE_STAGE_LOOP", _choice(PIPELINE_STAGE_LOOPS)),
    "memory_guard": ("ZEROJAX_MEMORY_GUARD", _bool),
}

__all__ = ["EngineOptions", "STAGE3_GATHER_MODES"]
