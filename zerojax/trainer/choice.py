"""The model a training run trains: a registered family (`zerojax.models.registry`), its config,
the name it was asked by, and what a checkpoint's record says of it."""
from __future__ import annotations

import dataclasses
import json
import os

from zerojax._moved import renamed
from zerojax.model_arg import ModelChoice as _ModelChoice
from zerojax.model_arg import tile_options  # noqa: F401 - read from here by the trainer

# the trainer's own ModelChoice became zerojax.model_arg's, which the commands use too
__getattr__ = renamed(__name__, {"ModelChoice": "zerojax.model_arg.ModelChoice"})


def named_model(size: str) -> _ModelChoice:
    """--model's name -> its ModelChoice (a registered family's named shape)."""
    from zerojax.models import registry

    family = registry.for_shape(size)
    if family is None:
        raise ValueError(f"--model {size}: no registered family has this shape; choose one of "
                         f"{', '.join(registry.shape_names())}")
    config = family.config(size)
    return _ModelChoice.of_family(family, config, size)


def hf_model_type(path: str) -> str:
    """config.json's model_type of a Hugging Face folder (GPT-2's when absent, as from_hf reads it)."""
    from zerojax.local_files import model_folder_problem
    from zerojax.models import registry

    problem = model_folder_problem(path, lambda base: f"give its base model to --hf-checkpoint ({base}); --lora R "
                                                      "trains new adapters on it")
    if problem:
        raise FileNotFoundError(problem)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"--hf-checkpoint {path}: no config.json (a Hugging Face model folder has "
                                f"config.json and model.safetensors)")
    with open(cfg_file) as f:
        kind = json.load(f).get("model_type", "gpt2")
    if registry.for_hf_type(kind) is None:
        from zerojax.checkpoint.state import CheckpointError

        raise CheckpointError(f"--hf-checkpoint {path}: model_type {kind!r}; zerojax trains "
                              f"{', '.join(registry.hf_model_types())}")
    return kind


def _record_shape(family, config: dict, saved: dict) -> dict:
    """The parts of a model config (as a dict) that decide the model a checkpoint holds."""
    return json.loads(json.dumps({k: config.get(k) for k in family.shape_keys if k in saved}))


def checkpoint_model(meta, args, choice: _ModelChoice) -> _ModelChoice:
    """--resume: the model the checkpoint holds (its `checkpoint_record`, in the metadata) against
    the one this run asks for, before anything is built; --model auto takes the checkpoint's model
    where it is a named one. A checkpoint without a record is left to the load's own shape check."""
    from zerojax.checkpoint.state import CheckpointError
    from zerojax.models import registry

    record = meta.get("model") or {}
    saved = record.get("config")
    family = registry.for_record(record)
    if record and family is None:
        raise CheckpointError(f"{args.save}: this checkpoint is a {record.get('type')!r} model, of no registered "
                              f"family; resume it with the script that trained it")
    if not isinstance(saved, dict):
        return choice

    def shape(c):
        return _record_shape(family, c, saved)

    if choice.family == family.name and shape(dataclasses.asdict(choice.config)) == shape(saved):
        return choice
    named = next((n for n in family.shapes if shape(dataclasses.asdict(family.config(n))) == shape(saved)), None)
    if named and args.model == "auto" and not args.hf_checkpoint:
        return named_model(named)
    if named:
        what = named_model(named).label
    else:
        c = family.config_from_record(record)
        what = (f"a {record.get('type')} model of n_layer {c.n_layer}, n_embd {c.n_embd}, n_head {c.n_head}, "
                f"vocab_size {c.vocab_size}")
    fix = (f"use --model {named}" + (" without --hf-checkpoint" if args.hf_checkpoint else "") if named
           else "resume with the --hf-checkpoint it was trained from")
    asked = f"the model in {args.hf_checkpoint}" if args.hf_checkpoint else choice.label
    raise CheckpointError(f"{args.save}: this checkpoint is {what}; {fix} (this run asks for {asked}; "
                          f"another --save folder starts it afresh)")
