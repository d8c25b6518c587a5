"""`EngineOptions`: the engine knobs beyond DeepSpeed's JSON config, typed and validated once.

DeepSpeed's config says *what* to train (stage, precision, offload device); these say *how*
zerojax lays it out where DeepSpeed has no key. The defaults are the measured winners.

    engine = zerojax.shard(model, cfg, loss_fn=loss_fn,
                           options=zerojax.EngineOptions(adam_mu_dtype="bfloat16"))
"""
from __future__ import annotations

import dataclasses

OFFLOAD_LOOPS = ("auto", "in_place", "host")
ADAM_MU_DTYPES = (None, "bfloat16")
SPLIT_MASTER = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine knobs with no DeepSpeed key (defaults in brackets).

    offload_loop ["auto"]: how an offloaded optimizer state streams through the device.
        "in_place": inside the step's jit, one layer group at a time read from and written back
        into stacked host buffers (`offload.update.streamed_update`; the least device memory).
        "host": after the step's jit, one chunk at a time from Python (`offload.host_loop`), the
        runtime's transfers running both ways at once: faster, a few chunks more on the device.
        Needs optimizer offload to cpu alone (no offload_param, no NVMe). "auto": "host" wherever
        it applies, else "in_place".
    offload_host_chunk_bytes [256 MiB]: "host" loop: each chunk is the fewest layers whose fp32
        master holds at least this many bytes per device (fewer, larger transfers). Lower it if
        the memory guard says the step does not fit.
    offload_host_window [3]: "host" loop: chunks whose state may be on the device at once
        (0 = no limit); the last `window` write-backs overlap the next step's jit.
    offload_host_prefetch [2]: "host" loop: chunks read to the device before the step's jit is
        dispatched, so their reads overlap the forward / backward.
    adam_mu_dtype [None]: Adam/AdamW's first moment stored in this dtype ("bfloat16"): 2 bytes a
        parameter less (and over PCIe under offload). Changes training slightly; None = fp32.
    split_master ["auto"]: with bf16 compute, the fp32 master kept as the bf16 compute copy plus
        a 16-bit remainder (`offload.split_master`): 2 bytes a parameter less. Exact but for exact
        ties (one fp32 ulp, probability 2^-16 per weight and step); checkpoints hold the fp32
        master. It applies in host memory where the optimizer is offloaded to cpu (either offload
        loop; the in_place loop rebuilds each group's master on the device from its compute copy)
        and on the device without offload. "auto": the host split under offload_loop="host" only;
        "on": split wherever it applies (an error where none does); "off": never.
    pipeline_repeats [1]: pipeline.stages > 1: circular repeats R (bubble (S-1) / (M R + S - 1)).
    memory_guard [True]: before the first step of a batch shape, compare XLA's predicted peak with
        the device's memory and raise WillNotFitError (listing plans that fit) instead of an
        out-of-memory error mid-step.
    init_group_bytes [None]: offload init builds the fp32 weights in groups of at most this many
        bytes; None = a quarter of the device's memory (no limit on CPU).
    ep_size [1]: expert parallelism (DeepSpeed-MoE's `ep_size`, an argument of its MoE layer, not a
        config key): a mixture-of-experts model's experts split over this many devices, tokens sent
        to their experts' devices and back by all-to-alls (`zerojax.models.expert_parallel`).
        1 = off; else it must divide the data-parallel size and the model's num_experts: the
        data-parallel devices form dp / ep_size groups of ep_size (mesh axes ("data", "expert")),
        each holding every expert once; no tensor, pipeline or sequence axis.
    """

    offload_loop: str = "auto"
    offload_host_chunk_bytes: int = 256 * 2**20
    offload_host_window: int = 3
    offload_host_prefetch: int = 2
    adam_mu_dtype: str | None = None
    split_master: str = "auto"
    pipeline_repeats: int = 1
    memory_guard: bool = True
    init_group_bytes: int | None = None
    ep_size: int = 1

    def __post_init__(self):
        problems = []
        for name, choices in (("offload_loop", OFFLOAD_LOOPS), ("adam_mu_dtype", ADAM_MU_DTYPES),
                              ("split_master", SPLIT_MASTER)):
            if getattr(self, name) not in choices:
                problems.append(f"{name}={getattr(self, name)!r}: use one of {choices}")
        for name, least, optional in (("offload_host_chunk_bytes", 1, False), ("offload_host_window", 0, False),
                                      ("offload_host_prefetch", 0, False), ("pipeline_repeats", 1, False),
                                      ("init_group_bytes", 1, True), ("ep_size", 1, False)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                problems.append(f"{name}={value!r}: use an int >= {least}" + (" or None" if optional else ""))
        if not isinstance(self.memory_guard, bool):
            problems.append(f"memory_guard={self.memory_guard!r}: use True or False")
        if problems:
            raise ValueError("EngineOptions: " + "; ".join(problems))

    def replace(self, **changes) -> EngineOptions:
        return dataclasses.replace(self, **changes)


__all__ = ["EngineOptions", "OFFLOAD_LOOPS", "SPLIT_MASTER"]
