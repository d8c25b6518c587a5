"""Putting XLA flags into effect: XLA reads `XLA_FLAGS` once, when JAX starts its backend.

    cfg = zerojax.load_config("ds.json", world_size=8)      # world_size given: no backend needed yet
    zerojax.apply_xla_flags(zerojax.config.xla_flags_for(cfg))
    jax.devices()                                           # the backend starts with the flags

A flag the user already wrote in `XLA_FLAGS` wins over the same flag given here (the shell is the
user's last word); flags are merged, never dropped. Applying flags after the backend started would
silently do nothing, so it is an error that says so. `zerojax launch` passes its environment, and
so `XLA_FLAGS`, to the processes it starts.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping

from zerojax._jax_compat import backends_started


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0].lstrip("-")


def merged_xla_flags(existing: str, flags: Iterable[str]) -> str:
    """`existing` (an XLA_FLAGS value) with each of `flags` appended unless it names a flag already there."""
    have = {_flag_name(f) for f in existing.split()}
    added = []
    for flag in flags:
        if not isinstance(flag, str) or not flag.startswith("--") or not _flag_name(flag):
            raise ValueError(f"XLA flag {flag!r}: expected '--name=value' (e.g. "
                             "'--xla_gpu_enable_latency_hiding_scheduler=true')")
        if _flag_name(flag) not in have:
            have.add(_flag_name(flag))
            added.append(flag)
    return " ".join([*existing.split(), *added])


def backend_started() -> bool:
    """Whether JAX has started a backend in this process (XLA_FLAGS were read then)."""
    return backends_started(unknown=True)


def apply_xla_flags(flags: Iterable[str], environ: MutableMapping[str, str] | None = None) -> str:
    """Add `flags` to `XLA_FLAGS` (of `environ`, default os.environ) -> the new value.

    Raises RuntimeError if JAX's backend already started in this process (the flags would have no
    effect): call it before the first `jax.devices()`, array or jit -- e.g. before
    `zerojax.init_distributed()` and before `load_config` without `world_size` -- or set XLA_FLAGS in
    the shell that starts Python."""
    flags = list(flags)
    env = os.environ if environ is None else environ
    value = merged_xla_flags(env.get("XLA_FLAGS", ""), flags)
    if environ is None and value != env.get("XLA_FLAGS", "") and backend_started():
        raise RuntimeError(
            f"apply_xla_flags({flags}): JAX's backend already started in this process, and XLA read XLA_FLAGS "
            "then; call it before anything touches a device (jax.devices(), an array, a jit, "
            "zerojax.init_distributed(), load_config without world_size), or export XLA_FLAGS in the shell")
    env["XLA_FLAGS"] = value
    return value


__all__ = ["apply_xla_flags", "backend_started", "merged_xla_flags"]
