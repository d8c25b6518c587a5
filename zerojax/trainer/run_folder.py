"""A training run's checkpoint folder (`zerojax train --save DIR`) as a model: `zerojax export` writes
it as a complete Hugging Face folder (the weights, the tokenizer and generation files of the folders
its run read, pad_token_id), and `zerojax generate` / `chat` read it through such a folder.

A LoRA checkpoint holds the adapters and their optimizer state, not its frozen base: it is refused
in one line naming the command that writes its PEFT adapter (the run resumed at its own step,
`--export-hf`), which generate / chat then take with the base (`--adapter`).
"""
from __future__ import annotations

import os

RUN_KEY = "gpt2_large_example"  # where the trainer keeps its run's settings in client_state


def is_run_folder(path) -> bool:
    """Whether `path` is a checkpoint folder (the `latest` file save_checkpoint writes names its newest
    tag), not a Hugging Face folder. Reads nothing else (no jax)."""
    return os.path.isfile(os.path.join(os.fspath(path), "latest"))


def run_record(path, tag=None) -> tuple[dict, dict]:
    """(the checkpoint's metadata, the run settings the trainer saved with it; {} for another program's)."""
    from zerojax.checkpoint.state import read_meta

    meta = read_meta(os.fspath(path), tag)
    return meta, (meta.get("client_state") or {}).get(RUN_KEY) or {}


def _refuse_lora(path, meta, record, out) -> None:
    if not record.get("lora"):
        return
    again = " ".join(f"--{flag} {record[key]}" for flag, key in (("hf-checkpoint", "hf_checkpoint"),
                                                                  ("method", "method"))
                     if record.get(key) and record.get(key) != "sft")
    raise ValueError(f"{path}: a LoRA checkpoint (its adapters, not the frozen base): write its PEFT adapter with "
                     f"zerojax train --resume --save {path} --steps {meta.get('global_steps')} {again} --export-hf "
                     f"{out} (+ --merge for a whole model), then generate with the base and --adapter")


def export_run(path, out, tag=None, dtype: str = "fp32") -> str:
    """The checkpoint's model written to `out` as a Hugging Face folder transformers loads offline:
    the consolidated master weights in `dtype` (`zerojax.checkpoint.state.export`), the tokenizer
    and generation files of the run's tokenizer folder, and config.json's pad_token_id where the
    tokenizer names a pad token. -> the weights file's path."""
    from zerojax.checkpoint.state import export
    from zerojax.models import weights_writer
    from zerojax.trainer.export import copy_tokenizer

    meta, record = run_record(path, tag)
    _refuse_lora(path, meta, record, out)
    written = export(path, out, tag=tag, dtype=dtype, writer_for=weights_writer)
    tokenizer = record.get("tokenizer")
    if tokenizer and os.path.isdir(tokenizer):
        copy_tokenizer(tokenizer, out)
    return written


def model_folder_of(path) -> str:
    """`path` where it is a Hugging Face folder; a checkpoint folder exported first (fp32) to a
    temporary folder removed when the process ends: -> the folder to read the model from."""
    if not is_run_folder(path):
        return path
    import atexit
    import shutil
    import tempfile

    out = tempfile.mkdtemp(prefix="zerojax-run-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    export_run(path, out)
    return out


__all__ = ["RUN_KEY", "is_run_folder", "run_record", "export_run", "model_folder_of"]
