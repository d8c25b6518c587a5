"""Serving what `zerojax train --save` wrote: a whole model's checkpoint (`zerojax serve
--checkpoint SAVE_DIR`: its weights exported to a Hugging Face folder and read), or a LoRA run's
adapters over the served base (`--adapter NAME=SAVE_DIR`: the run's LoRA settings and its trained
lora_A / lora_B, read from the checkpoint's master weights)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax import lora
from zerojax.checkpoint.state import list_tags, read_master, read_meta

# where `zerojax train` keeps its run's settings (the LoRA settings among them) in a checkpoint's client_state
TRAIN_SETTINGS = "gpt2_large_example"


def is_checkpoint(folder) -> bool:
    """A zerojax checkpoint folder (--save's: finalized tags), not a PEFT or Hugging Face folder."""
    return bool(list_tags(folder))


def run_lora_settings(save_dir) -> dict | None:
    """The LoRA settings the training run of `save_dir` saved (None: a whole-model run)."""
    return ((read_meta(save_dir).get("client_state") or {}).get(TRAIN_SETTINGS) or {}).get("lora")


def load_trained_adapter(model, save_dir, quantize: str | None = None):
    """`model` (a plain base; changed in place, as `zerojax.lora.apply` does) with the adapters of a
    `zerojax train --lora R --save` folder, over the base as served (its dtype; `quantize`: stored
    quantized) -> the LoRA model. Refused in one line where the run trained no adapters or trained
    them on a model of other shapes."""
    settings = run_lora_settings(save_dir)
    if settings is None:
        raise ValueError(f"--adapter {save_dir}: a checkpoint of a run without LoRA; an adapter is the --save "
                         "folder of `zerojax train --lora R` or a PEFT folder (serve a whole model with --checkpoint)")
    tuned = lora.apply(model, {**settings, "quantize": quantize, "base_dtype": None})
    _, trained = read_master(save_dir)
    live = nnx.state(tuned, nnx.Param)
    want = dict(jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(live))[0])
    got = dict(jax.tree_util.tree_flatten_with_path(trained)[0])
    for path in sorted(set(want) | set(got), key=str):
        have, saved = want.get(path), got.get(path)
        if have is None or saved is None or have.shape != np.shape(saved):
            raise ValueError(f"--adapter {save_dir}: its adapters were trained on another model: "
                             f"{jax.tree_util.keystr(path)} is {None if saved is None else np.shape(saved)} there, "
                             f"{None if have is None else have.shape} over this base")
    nnx.replace_by_pure_dict(live, jax.tree.map(lambda x, ref: jnp.asarray(x, ref.dtype), trained,
                                                nnx.to_pure_dict(live)))
    nnx.update(tuned, live)
    return tuned


__all__ = ["TRAIN_SETTINGS", "is_checkpoint", "run_lora_settings", "load_trained_adapter"]
