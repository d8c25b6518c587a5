"""Test setup: 8 virtual CPU devices, set before jax is imported anywhere."""
import os

# Appended, not set: a user's XLA_FLAGS (e.g. another CPU code path, --xla_cpu_max_isa=AVX) reach
# the tests; the suite must pass under any of them (issue #21).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
