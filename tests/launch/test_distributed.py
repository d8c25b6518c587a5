"""init_distributed's reading of the launchers' environments (zerojax.launch.distributed).

References: the variables DeepSpeed's node launcher sets for each process
(deepspeed/launcher/launch.py v0.19.6: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK),
torchrun's same set, and JAX's own SLURM detection (jax._src.clusters.SlurmCluster: SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID). The two-process run through
the torchrun/DeepSpeed variables is tests/launch/test_multiprocess.py.
"""
import jax
import pytest

from zerojax.launch import distributed
from zerojax.launch.distributed import init_distributed, plan_distributed

NO_CLUSTER = dict(detect_cluster=lambda: None)
TORCHRUN = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5",
            "LOCAL_RANK": "1"}


def test_no_variables_is_one_process():
    plan = plan_distributed({}, **NO_CLUSTER)
    assert plan.single and plan.num_processes == 1 and "one process" in plan.source


def test_deepspeed_torchrun_variables_one_process_per_gpu():
    plan = plan_distributed(TORCHRUN, **NO_CLUSTER)
    assert (plan.num_processes, plan.process_id) == (8, 5)
    assert plan.coordinator_address == "10.0.0.1:29500"
    assert plan.local_device_ids == (1,)  # LOCAL_RANK: this process's GPU
    assert plan.source.startswith("torchrun/DeepSpeed") and "RANK=5" in plan.source


def test_jax_variables_win_and_keep_all_local_devices():
    env = {**TORCHRUN, "JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    plan = plan_distributed(env, **NO_CLUSTER)
    assert (plan.num_processes, plan.process_id, plan.coordinator_address) == (2, 1, "h0:1234")
    assert plan.local_device_ids is None and plan.source.startswith("JAX")


def test_per_node_variables():
    env = {"MASTER_ADDR": "n0", "MASTER_PORT": "7000", "NNODES": "4", "NODE_RANK": "3"}
    plan = plan_distributed(env, **NO_CLUSTER)
    assert (plan.num_processes, plan.process_id, plan.coordinator_address) == (4, 3, "n0:7000")
    assert plan.local_device_ids is None


def test_world_of_one_is_one_process():
    assert plan_distributed({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}, **NO_CLUSTER).single


@pytest.mark.parametrize("drop, missing", [
    (("MASTER_ADDR",), "MASTER_ADDR"),
    (("MASTER_PORT", "LOCAL_RANK"), "MASTER_PORT, LOCAL_RANK"),
])
def test_half_set_environment_names_what_is_missing(drop, missing):
    env = {k: v for k, v in TORCHRUN.items() if k not in drop}
    with pytest.raises(ValueError, match=f"torchrun/DeepSpeed form: .* but {missing} missing"):
        plan_distributed(env, **NO_CLUSTER)
    with pytest.raises(ValueError, match="JAX form: JAX_PROCESS_ID set but JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES"):
        plan_distributed({"JAX_PROCESS_ID": "0"}, **NO_CLUSTER)
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS set but JAX_NUM_PROCESSES, JAX_PROCESS_ID"):
        plan_distributed({"JAX_COORDINATOR_ADDRESS": "h0:1234"}, **NO_CLUSTER)


@pytest.mark.parametrize("change, message", [
    ({"RANK": "8"}, "RANK=8 must be below WORLD_SIZE=8"),
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
])
def test_bad_values_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        plan_distributed({**TORCHRUN, **change}, **NO_CLUSTER)


def test_slurm_is_detected_through_jax(monkeypatch):
    for k, v in {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "4",
                 "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(k, v)
    plan = plan_distributed({})
    assert plan.cluster and plan.num_processes == 4 and "SlurmCluster" in plan.source
    # the coordinator's address alone is for JAX's cluster detection, not a half-set JAX form
    assert plan_distributed({"JAX_COORDINATOR_ADDRESS": "node001:1234"}).cluster
    # a launcher started inside the job (srun torchrun ...) describes its own processes
    assert plan_distributed(TORCHRUN).source.startswith("torchrun/DeepSpeed")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert plan_distributed({}).single  # a one-task job (salloc shell) is one process


def test_init_is_a_noop_for_one_process_and_idempotent(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", *TORCHRUN, "NNODES",
              "NODE_RANK", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(distributed, "_DONE", None)
    first = init_distributed()
    assert first.single and not jax.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "oops")  # read once: a second call does not look again
    assert init_distributed() is first


def test_init_after_the_backend_started_says_call_it_first(monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed, "_DONE", None)
    jax.devices()  # the backend is running
    with pytest.raises(RuntimeError, match="process 5 of 8 .* call zerojax.init_distributed\\(\\) before"):
        init_distributed()
    assert not jax.distributed.is_initialized()
