"""zerojax GRPO on random-init weights of a named shape (no hub access): the hybrid engine's
samples/s and its split between generation and training.

    python benchmarks/rl_bench.py                         # qwen2.5-0.5b and llama-3.2-1b on one GPU
    python benchmarks/rl_bench.py --model llama-3.2-1b    # one shape
    python benchmarks/rl_bench.py --tiny                  # CPU smoke test (tiny shapes)
    python benchmarks/rl_bench.py --model llama-3.2-1b --new 1024 --stop-every 256 --generator serving
                                                          # rows ending at different lengths, on the serving engine

Each step: 8 prompts of 256 random token ids x group 8 = 64 completions of 256 new tokens
(sampled at temperature 1, eos ignored: every row runs all 256), a cheap reward (the fraction of
even token ids), group advantages, the reference's log-probs (a frozen bf16 copy, kl_coef 0.04),
then one optimizer step (bf16, ZeRO-2, AdamW, full fine-tuning, micro-batch 16 x 4 accumulation,
full remat).
One warm-up step (compiles), then --steps measured steps. samples/s = completions trained / wall
time; generation time covers generate + rewards + reference log-probs, training time the
train_step (`RolloutBatches`' own split). Prints a table and one JSON line per shape
({"framework": "zerojax", ...}); benchmarks/rl_bench_torch.py is the PyTorch anchor.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

GROUP, PROMPTS, PROMPT_LEN, NEW, MICRO, LR, KL = 8, 8, 256, 256, 16, 1e-6, 0.04
# "full": each layer recomputed in the backward pass; without it the step does not fit one 80 GB GPU
# (XLA's memory analysis: 85 GiB at Llama-3.2-1B's shape, the attention weights of every layer kept)
REMAT = "full"


def shape(args, name):
    """(prompts per step, prompt length, new tokens, micro-batch) for this run."""
    return (2, 8, args.new or 8, 8) if args.tiny else (PROMPTS, PROMPT_LEN, args.new or NEW, args.micro)


def stop_ids(vocab: int, every: int | None) -> tuple:
    """Every `every`-th token id ends a completion (None: none): on random weights, whose tokens are
    near uniform, lengths spread geometrically with mean about `every` (capped by the new tokens),
    as rollouts of a trained policy end at different lengths."""
    return tuple(range(every - 1, vocab, every)) if every else ()


def prompt_ids(n: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (n, length)).tolist()


def even_fraction(prompts, completions, completion_ids=None, **fields):
    """The cheap reward: the fraction of a completion's token ids that are even."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class IdTokenizer:
    """Prompts given as token ids written out ("12 7 ..."): encode parses them back."""

    def __init__(self, vocab_size):
        self.vocab_size, self.eos_id = vocab_size, None

    def encode(self, text, add_special_tokens=False):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


def run(name: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import zerojax
    from zerojax.methods.grpo import make_grpo_loss
    from zerojax.models import Llama, LlamaConfig
    from zerojax.rl import PromptData, RolloutBatches, RolloutOptions

    n, plen, new, micro = shape(args, name)
    config = LlamaConfig.named("tiny" if args.tiny else name)
    rows = n * GROUP
    records = [{"prompt": " ".join(map(str, p))} for p in prompt_ids(64, plen, config.vocab_size)]
    data = PromptData(records, IdTokenizer(config.vocab_size), plen + new)
    cfg = {"train_batch_size": rows, "train_micro_batch_size_per_gpu": max(1, micro // len(jax.devices())),
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    # bf16 compute, as the config (and the PyTorch anchor): the module computes in its own dtype
    engine = zerojax.shard(lambda: Llama(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                         remat_policy=None if args.remat == "none" else args.remat),
                           cfg, loss_fn=make_grpo_loss(kl_coef=KL, group=None if args.whole_rows else GROUP))
    options = RolloutOptions(group=GROUP, temperature=1.0, kl_coef=KL, reference="copy", ignore_eos=True,
                             decode_attention=args.decode_attention, shared_prompt=not args.whole_rows,
                             generator=args.generator, stop=stop_ids(config.vocab_size, args.stop_every))
    rollouts = RolloutBatches(engine, data, even_fraction, options, seed=0, num_steps=1 + args.steps)
    t = time.perf_counter()
    programs = rollouts.warm_up()  # the serving engine's shape buckets (rows end at different lengths)
    if programs:
        print(f"serving engine: {programs} step programs compiled in {time.perf_counter() - t:.0f} s", flush=True)
    began = None
    for i, batch in enumerate(rollouts):
        metrics = engine.train_step(batch)
        if i == 0:  # the warm-up step: compiles
            jax.block_until_ready(metrics["loss"])
            began = time.perf_counter()
    jax.block_until_ready(engine.state.params)
    wall = time.perf_counter() - began
    # the generate call alone (the generation time above also holds the rewards and both log-prob
    # passes), on one step's prompts
    t = time.perf_counter()
    rollouts.generate(np.repeat(data.indices(n, seed=0, step=0, refill=0), GROUP), seed=1)
    generate_call = time.perf_counter() - t
    measured = rollouts.history[1:]
    gen = sum(h["time/generate_s"] for h in measured)
    # the last step's training is not in the history (no next batch asked for): the rest of the wall
    train = wall - gen
    return {"framework": "zerojax", "model": "tiny" if args.tiny else name, "group": GROUP, "prompts": n,
            "prompt_len": plen, "new_tokens": new, "steps": args.steps,
            "micro": micro, "remat": args.remat, "decode_attention": args.decode_attention,
            "shared_prompt": not args.whole_rows, "generator": args.generator, "stop_every": args.stop_every,
            "completion_mean": round(float(np.mean([h["completion/length"] for h in measured])), 1),
            "seconds": round(wall, 3),
            "samples_per_s": round(rows * args.steps / wall, 2), "generate_s": round(gen, 3),
            "train_s": round(train, 3), "generate_call_s": round(generate_call, 3),
            "generate_share": round(gen / wall, 3),
            "reward_mean": round(float(measured[-1]["reward/mean"]), 4), "loss": float(metrics["loss"]),
            "device": jax.devices()[0].device_kind}


def table(results):
    cols = ("framework", "model", "generator", "completion_mean", "samples_per_s", "seconds", "generate_s", "train_s",
            "generate_share")
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r[c]) for c in cols))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", help="a LlamaConfig.named shape (default: qwen2.5-0.5b, llama-3.2-1b)")
    p.add_argument("--steps", type=int, default=3, help="measured steps after the warm-up (default 3)")
    p.add_argument("--micro", type=int, default=MICRO, help=f"rows per micro-batch (default {MICRO}; the step's "
                   "rows stay group x prompts: fewer rows a micro-batch, more accumulation)")
    p.add_argument("--remat", default=REMAT, help=f"the model's remat_policy (default {REMAT!r}; 'none': keep "
                   "every activation)")
    from zerojax.generation.decoder import DECODE_ATTENTIONS

    p.add_argument("--decode-attention", default="auto", choices=DECODE_ATTENTIONS, help="generate's option "
                   "(default auto, the RL methods' default)")
    p.add_argument("--whole-rows", action="store_true", help="run every row's prompt through the model (the "
                   "rollouts' shared_prompt off, the loss without group=)")
    p.add_argument("--generator", default="generate", choices=("generate", "serving"),
                   help="what generates the rollouts (RolloutOptions.generator; default generate)")
    p.add_argument("--new", type=int, help=f"new tokens per completion at most (default {NEW}; --tiny 8)")
    p.add_argument("--stop-every", type=int, metavar="K", help="every K-th token id ends a completion: lengths "
                   "spread about K (default: none, every row runs all the new tokens)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, for a CPU smoke test")
    args = p.parse_args(argv)
    results = []
    for name in args.model or ["qwen2.5-0.5b", "llama-3.2-1b"]:
        results.append(run(name, args))
        print(json.dumps(results[-1]), flush=True)  # at once: a later shape's failure keeps this one
    table(results)
    return results


if __name__ == "__main__":
    main()
