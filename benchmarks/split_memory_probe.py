"""Session 13: device memory of the split-master engine on GPT-2 Large under a cap, stage by stage
(bytes_in_use, the largest free block where the allocator reports it): after the engine is built,
after gc.collect(), after steps 1-3, beside the same engine without the split master. Why: with
master_split the example's plans OOMed under a cap at the first step though their compiled peaks fit.
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.09 python benchmarks/split_memory_probe.py [split|plain] REMAT"""
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zerojax
from zerojax.models.gpt2 import GPT2, GPT2Config, chunked_gpt2_loss

mode, remat = sys.argv[1], sys.argv[2]
GiB = 2**30


def stats(what):
    s = jax.local_devices()[0].memory_stats() or {}
    print(f"{mode:5} {what:18} in use {s.get('bytes_in_use', 0) / GiB:6.2f}  peak {s.get('peak_bytes_in_use', 0) / GiB:6.2f}"
          f"  largest free {s.get('largest_free_block_bytes', 0) / GiB:6.2f}  limit {s.get('bytes_limit', 0) / GiB:6.2f}",
          flush=True)


cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2},
       "activation_checkpointing": {"partition_activations": False, "remat_policy": remat}}
stats("start")
opts = zerojax.EngineOptions(adam_mu_dtype="bfloat16", master_split=mode == "split", memory_guard=False)
eng = zerojax.shard(lambda: GPT2(GPT2Config.named(sys.argv[3] if len(sys.argv) > 3 else "large"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16, remat_policy=remat),
                    cfg, loss_fn=chunked_gpt2_loss(256), options=opts)
jax.block_until_ready(eng.state)
stats("built")
gc.collect()
stats("after gc")
rows = np.random.default_rng(0).integers(0, 50257, (8, 1024)).astype(np.int32)
for i in range(3):
    try:
        float(eng.train_step({"input_ids": rows})["loss"])
    except Exception as e:  # noqa: BLE001
        print(f"{mode:5} step {i + 1}: {type(e).__name__}: {str(e)[:160]}")
        stats(f"after failure")
        break
    stats(f"step {i + 1}")
