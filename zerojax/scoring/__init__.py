"""What a model says of a sequence, shared by the training methods (`zerojax.methods`) and the RL
rollouts (`zerojax.rl`), below both: per-token and per-sequence log-probs (`logprobs`; a group's
prompt run once, `shared_prompt`), a model with a scalar head as a reward model (`reward_model`)
and as PPO's critic (`critic`). Plain functions of a model and a batch: nothing here trains.
"""
