"""XLA's pinned host pool cap (zerojax/pinned_pool.py): raised at import where the user left it unset
and no backend read it yet; counted by the planner on GPU with CPU offload."""
import json
import os
import subprocess
import sys

import jax

from zerojax import pinned_pool
from zerojax.planning import estimate as est
from zerojax.planning import planner

_PROBE = ("import os, sys, json\n"
          "if sys.argv[1] == 'jax first':\n"
          "    import jax; jax.devices()\n"
          "import zerojax\n"
          "print(json.dumps(os.environ.get(zerojax.pinned_pool.ENV)))\n")


def _cap_after_import(order: str, env_value=None):
    env = {k: v for k, v in os.environ.items() if k != pinned_pool.ENV}
    if env_value is not None:
        env[pinned_pool.ENV] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE, order], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_raises_the_cap_only_where_unset_and_unread():
    # 90% of the host's physical memory in GiB, as /proc/meminfo's MemTotal says (kB), floored
    with open("/proc/meminfo", encoding="utf-8") as f:
        total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    want = max(int(total_kb // 2**20 * 0.9), pinned_pool.XLA_DEFAULT_GIB)
    assert _cap_after_import("zerojax first") == str(want)
    assert _cap_after_import("zerojax first", "7") == "7"   # the user's value stands
    assert _cap_after_import("jax first") is None           # a started client already read the default


def test_planner_counts_the_pool_on_gpu_with_cpu_offload(monkeypatch):
    # CPU offload always holds its states in pinned_host memory, whatever pin_memory says
    pinned = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}}
    unpinned = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    monkeypatch.setattr(est, "host_free_bytes", lambda: 100 * 2**30)
    monkeypatch.setenv(pinned_pool.ENV, "64")
    assert planner._host_budget(pinned) == (100 * 2**30, "available")   # CPU: no pinned pool
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    budget, why = planner._host_budget(pinned)
    assert budget == 64 * 2**30 and pinned_pool.ENV in why
    assert planner._host_budget(unpinned) == (100 * 2**30, "available")
    monkeypatch.setenv(pinned_pool.ENV, "200")
    assert planner._host_budget(pinned) == (100 * 2**30, "available")
