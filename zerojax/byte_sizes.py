"""Byte sizes and the host's free memory: GB / GiB, "24GB" <-> bytes, and MemAvailable.

No jax and nothing of zerojax here: the estimate, the memory guard, checkpoints and the CLI all read
these, so they sit below every package.
"""
from __future__ import annotations

import os
import re

GiB = 2**30
GB = 10**9


def host_free_bytes() -> int:
    """Host memory available now (Linux: MemAvailable; else free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": GB, "gb": GB,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text) -> int:
    """"24GB" -> 24e9, "24GiB" -> 24 * 2**30, "1.5e9" -> 1500000000, 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 24GB, 22.5GiB or 2.4e10")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.2f} MiB"


__all__ = ["GB", "GiB", "parse_bytes", "fmt_bytes", "host_free_bytes"]
