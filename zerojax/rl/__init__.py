"""RL fine-tuning with a hybrid engine (DeepSpeed-Chat's step 3): the engine that trains also
generates, on the same arrays. docs/rl.md.

- `rewards`: reward functions and specs (module:function, exact_match, regex, a reward model folder);
- `tasks`: built-in verifiable tasks (arithmetic, digit, word-problems);
- `prompts`: the prompt reader (`load_prompts`, `PromptData`: fixed shapes);
- `advantages`: group-relative advantages;
- `policy`: old-policy and reference log-probs on the live weights;
- `rollouts`: `RolloutBatches`, the training batches of each step;
- `gae`: PPO's per-token rewards and GAE advantages;
- `ppo_rollouts`: `PPORollouts`, PPO's batches with the critic engine's step inside;
- the losses are methods: `zerojax.methods.grpo` ("grpo"), `zerojax.methods.ppo` ("ppo").
"""
from zerojax.rl.prompts import PromptData, load_prompts
from zerojax.rl.rollouts import RolloutBatches, RolloutOptions


def train(engine, rollouts: RolloutBatches, *, on_step=None) -> list[dict]:
    """Run `rollouts` to its end on `engine`: one train_step per batch. -> one dict a step: the
    rollout's metrics and the step's (floats). on_step(row): called after each step."""
    import numpy as np

    history = []
    for batch in rollouts:
        metrics = engine.train_step(batch)
        row = {**rollouts.metrics, **{k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}}
        history.append(row)
        if on_step is not None:
            on_step(row)
    return history


__all__ = ["PromptData", "load_prompts", "RolloutBatches", "RolloutOptions", "train"]
