"""One process of the multi-process test (tests/launch/test_multiprocess.py), also importable in-process.

Usage: RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. python multiprocess_worker.py OUT.npz
(the variables DeepSpeed's launcher sets; zerojax.init_distributed reads them). Each process owns
4 virtual CPU devices and feeds only its own rows of every global batch.
"""
import os
import sys

CASES = [  # (stage, precision, gradient_accumulation_steps, optimizer offload loop or None)
    (3, "fp32", 2, None),
    (2, "bf16", 1, None),
    (2, "fp32", 1, "host"),  # offload_optimizer cpu, its update driven from Python (EngineOptions)
    (2, "bf16", 1, "host_split"),  # the same, the host master as remainders (split_master)
]
ROWS, STEPS, LOCAL_DEVICES = 32, 3, 4


def train(stage, prec, ga, rows_of, offload_loop=None):
    """Train the tiny MLP; `rows_of(global_batch)` picks this process's rows; offload_loop: the
    optimizer offloaded to cpu with that EngineOptions.offload_loop ("host_split": "host" with
    split_master="on"). Returns fp32 master."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from tiny_mlp import MLP, loss_fn  # after XLA_FLAGS: it imports jax

    from zerojax.api import shard
    from zerojax.options import EngineOptions

    n = jax.device_count()
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS // n // ga, "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 0.1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu" if offload_loop else "none"}},
        "bf16": {"enabled": prec == "bf16"},
    }
    eng = shard(MLP(nnx.Rngs(0)), cfg, loss_fn=loss_fn,
                options=EngineOptions(offload_loop=(offload_loop or "in_place").removesuffix("_split"),
                                      split_master="on" if offload_loop and offload_loop.endswith("_split") else "off",
                                      offload_host_chunk_bytes=1))  # "host": one layer a chunk
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        batch = {"x": rng.normal(size=(ROWS, 16)).astype(np.float32),
                 "y": rng.normal(size=(ROWS, 16)).astype(np.float32)}
        eng.train_step(jax.tree.map(rows_of, batch))
    eng.synchronize()
    gathered = multihost_utils.process_allgather(eng.master_params, tiled=True)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), gathered)


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def main(out):
    # after the parent's flags (conftest's, with any user flags): XLA keeps the last device count
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={LOCAL_DEVICES}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from zerojax.launch.distributed import init_distributed

    # the launcher's variables (RANK, WORLD_SIZE, ... as DeepSpeed's launcher sets them)
    plan = init_distributed(initialization_timeout=120)
    assert plan.source.startswith("torchrun/DeepSpeed"), plan
    assert jax.config.jax_cpu_collectives_implementation == "gloo"
    process_id, num_processes = jax.process_index(), jax.process_count()
    assert (process_id, num_processes) == (plan.process_id, plan.num_processes)
    assert jax.device_count() == LOCAL_DEVICES * num_processes, jax.devices()
    share = ROWS // num_processes
    rows_of = lambda x: x[process_id * share:(process_id + 1) * share]  # noqa: E731
    results = {}
    for stage, prec, ga, off in CASES:
        for name, value in flat(train(stage, prec, ga, rows_of, off)).items():
            results[f"{stage}-{prec}-{ga}-{off}/{name}"] = value
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
