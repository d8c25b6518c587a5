"""`init_distributed()`: join the processes a launcher started into one JAX runtime.

Reading the launcher's environment is the documented interface here (as torchrun's and
DeepSpeed's are), so every such variable zerojax reads is read in this module and nowhere else.
Forms, first complete one wins:

1. JAX's own:      JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (all local devices)
2. torchrun / DeepSpeed's launcher (one process per GPU):
                   MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK -> local_device_ids=[LOCAL_RANK]
3. one process per node:  MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK (all local devices)
4. a cluster JAX detects itself (SLURM, Open MPI, Kubernetes): `jax.distributed.initialize()`
   with no arguments, so JAX's own rules apply (under SLURM / Open MPI: one process per GPU).

The explicit forms come before cluster detection although the cluster is the outer layer: a
launcher started inside a cluster job (`srun torchrun ...`, `srun zerojax launch ...`) sets the
variables of the processes it started, which the job's own variables (one task per node) do not
describe. With none of them, or a count of 1, it does nothing (one process). A form half set is
an error naming what is missing.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from zerojax._jax_compat import backends_started, detected_cluster, distributed_state

logger = logging.getLogger(__name__)

# (name, variables, the variables whose presence means the user meant this form; a form half set
# is an error only when no cluster is detected: JAX_COORDINATOR_ADDRESS alone may name the
# coordinator of a SLURM / Open MPI job, which JAX then reads itself)
FORMS = (
    ("JAX", ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
     ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")),
    ("torchrun/DeepSpeed", ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"),
     ("WORLD_SIZE", "RANK", "LOCAL_RANK")),
    ("per-node", ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"), ("NNODES", "NODE_RANK")),
)


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    """What init_distributed does: `source` names the form (and its values) it came from."""

    source: str
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster: bool = False  # JAX's auto-detection fills in the rest

    @property
    def single(self) -> bool:
        return self.num_processes == 1 and not self.cluster


_DONE: DistributedPlan | None = None


def _int(env, name, low=0) -> int:
    try:
        value = int(env[name])
    except ValueError:
        raise ValueError(f"init_distributed: {name}={env[name]!r} is not an integer; the launcher "
                         f"that started this process sets it (unset it to run one process)") from None
    if value < low:
        raise ValueError(f"init_distributed: {name}={value} must be >= {low}")
    return value


def _from_form(name, variables, env) -> DistributedPlan:
    if name == "JAX":
        addr, count, pid = env["JAX_COORDINATOR_ADDRESS"], "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
    elif name == "per-node":
        addr, count, pid = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT', 1)}", "NNODES", "NODE_RANK"
    else:
        addr, count, pid = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT', 1)}", "WORLD_SIZE", "RANK"
    n, p = _int(env, count, 1), _int(env, pid)
    if p >= n:
        raise ValueError(f"init_distributed: {pid}={p} must be below {count}={n} "
                         f"(ranks count from 0)")
    local = (_int(env, "LOCAL_RANK"),) if name == "torchrun/DeepSpeed" else None
    shown = ", ".join(f"{v}={env[v]}" for v in variables)
    return DistributedPlan(f"{name} variables ({shown})", n, p, addr, local)


def plan_distributed(env: Mapping[str, str] | None = None, *, detect_cluster=detected_cluster) -> DistributedPlan:
    """The plan init_distributed would follow for environment `env` (default os.environ); pure."""
    env = os.environ if env is None else env
    partial = []
    for name, variables, marks in FORMS:
        present = [v for v in variables if env.get(v, "") != ""]
        if len(present) == len(variables):
            return _from_form(name, variables, env)
        if any(v in present for v in marks):
            missing = [v for v in variables if v not in present]
            partial.append(f"{name} form: {', '.join(present)} set but {', '.join(missing)} missing")
    cluster = detect_cluster()
    if cluster is not None:
        count = cluster.get_process_count()
        source = f"{cluster.__name__} (JAX's cluster detection, {count} processes)"
        return DistributedPlan(source, count, cluster=count > 1)
    if partial:
        raise ValueError(
            "init_distributed: the environment names some processes but not all they need; "
            + "; ".join(partial) + ". Set the missing variables (a launcher such as "
            "`zerojax launch`, torchrun or deepspeed sets them all), or unset these to run one process")
    return DistributedPlan("one process (no launcher or cluster variables)")


def init_distributed(*, initialization_timeout: int = 300) -> DistributedPlan:
    """Initialise `jax.distributed` from the launcher's environment; a no-op for one process.

    Call it first, before anything that touches a JAX device. Calling it again returns the first
    call's plan. The returned plan's `source` says which variables it used (also logged).
    """
    global _DONE
    import jax

    if _DONE is not None:
        return _DONE
    plan = plan_distributed()
    if plan.single:
        _DONE = plan
        return plan
    if jax.distributed.is_initialized():  # the user's own initialize() came first
        _DONE = dataclasses.replace(plan, source="jax.distributed was already initialised")
        return _DONE
    if backends_started():
        raise RuntimeError(
            f"init_distributed: this is process {plan.process_id} of {plan.num_processes} "
            f"({plan.source}), but JAX's backend is already running, so it can no longer join "
            f"the others; call zerojax.init_distributed() before anything that touches a device "
            f"(jax.devices(), jnp arrays, jax.jit)")
    # CPU processes talk through gloo (JAX 0.10's default; older JAX had none, and CPU
    # collectives across processes then fail). GPUs ignore the setting, so it is safe to set
    # before the platform is known. A choice the user made (mpi) stays.
    if jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if plan.cluster:
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
    else:
        jax.distributed.initialize(
            coordinator_address=plan.coordinator_address, num_processes=plan.num_processes,
            process_id=plan.process_id,
            local_device_ids=list(plan.local_device_ids) if plan.local_device_ids else None,
            # explicit values: JAX must not fill local_device_ids from a surrounding SLURM job
            cluster_detection_method="deactivate", initialization_timeout=initialization_timeout)
    if plan.cluster:  # JAX chose them; read back without starting the backend
        global_state = distributed_state()
        plan = dataclasses.replace(plan, num_processes=global_state.num_processes,
                                   process_id=global_state.process_id,
                                   coordinator_address=global_state.coordinator_address)
    logger.info("zerojax.init_distributed: process %d of %d, from %s",
                plan.process_id, plan.num_processes, plan.source)
    _DONE = plan
    return plan


__all__ = ["init_distributed", "plan_distributed", "DistributedPlan"]
