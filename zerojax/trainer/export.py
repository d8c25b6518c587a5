"""What a finished run writes out: Hugging Face folders, PEFT adapters, the tokenizer beside them."""
from __future__ import annotations

import os
import sys


def copy_tokenizer(src, out_dir):
    """The tokenizer files of a Hugging Face folder copied into an exported one (what
    AutoTokenizer.from_pretrained reads), and config.json's pad_token_id set from them where the
    folder has a config without one."""
    import shutil

    if not src or not os.path.isdir(src):
        return
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    set_pad_token_id(out_dir)


def set_pad_token_id(folder) -> None:
    """config.json's pad_token_id from the folder's tokenizer (its pad token's id), where it names one
    and config.json has none: what generation with padding and `AutoModel...` read."""
    import json

    config_file = os.path.join(folder, "config.json")
    if not os.path.exists(config_file) or not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return
    from zerojax.models import load_tokenizer

    tokenizer = load_tokenizer(folder)
    pad = tokenizer.special_tokens.get("pad_token")
    pad_id = tokenizer.token_id(pad) if pad else None
    with open(config_file) as f:
        config = json.load(f)
    if pad_id is None or config.get("pad_token_id") is not None:
        return
    with open(config_file, "w") as f:
        json.dump({**config, "pad_token_id": pad_id}, f, indent=2, sort_keys=True)


def host_peak_rss() -> int | None:
    """This process's peak resident memory in bytes (getrusage: KiB on Linux, bytes on macOS);
    None where the platform has no `resource` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def merged_model(model, base_dir, adapter_dir):
    """(the plain model with the trained adapters folded in, its dtype's name) for --merge.

    From a base folder: its own weights in the dtype they are stored in (transformers'
    dtype="auto"), with the adapter folder just written (`adapter_dir`) folded in, as peft's
    merge_and_unload does on that base. Not the training model's frozen base: LoRA stores it in
    the compute dtype (or quantized), so an fp32 folder merged from it would come out rounded to
    bf16. Built on the host CPU: beside the engine's training state a second copy of the weights
    need not fit on the accelerator. Without a base folder (a randomly initialised --model): the
    training model merged in its parameter dtype."""
    import jax

    import zerojax.models
    from zerojax import lora

    if base_dir is None:
        merged = lora.merge(model)
        return merged, jax.numpy.dtype(merged.param_dtype).name
    dtype = zerojax.models.stored_dtype(base_dir)
    with jax.default_device(jax.devices("cpu")[0]):
        plain = zerojax.models.from_hf(base_dir, dtype=dtype)
        return lora.merge(lora.load_peft(plain, adapter_dir), dtype=dtype), dtype


def export_hf(args, engine, choice, settings, method=None):
    """--export-hf: the family's Hugging Face folder; with LoRA the PEFT adapter folder and
    (--merge) the merged model beside it; a reward model (--method reward) as the family's
    sequence-classification folder."""
    import zerojax.models

    out, tok = args.export_hf, args.tokenizer if args.tokenizer and os.path.isdir(args.tokenizer) else None
    if method is not None and method.name == "reward":
        from zerojax.scoring.reward_model import save_reward_hf

        save_reward_hf(engine.model, out)
        copy_tokenizer(tok, out)
        print(f"reward model written to {out} (transformers.AutoModelForSequenceClassification.from_pretrained)")
        return
    if settings is not None:
        from zerojax import lora

        model = engine.model
        adapter_dir = os.path.join(out, "adapter") if args.merge else out
        # the base as an absolute path: AutoPeftModelForCausalLM reads it from the adapter's
        # config, and a path relative to this run's directory would not load from anywhere else;
        # a randomly initialised --model has no folder to name (None, as PEFT writes for none)
        base = os.path.abspath(args.hf_checkpoint) if args.hf_checkpoint else None
        lora.save_peft(model, adapter_dir, base_model_name_or_path=base)
        copy_tokenizer(tok, adapter_dir)
        print(f"PEFT adapter written to {adapter_dir} (" + (
            f"peft.AutoPeftModelForCausalLM.from_pretrained({adapter_dir!r}): its base is {base}" if base
            else f"peft.PeftModel.from_pretrained(base, {adapter_dir!r})") + ")")
        if args.merge:
            merged, dtype = merged_model(model, base, adapter_dir)
            zerojax.models.to_hf(merged, out)
            copy_tokenizer(tok, out)
            print(f"merged model (base + adapters, {dtype}) written to {out}")
        return
    # the master as written out, not `engine.master_params`: under offload that merges the whole
    # fp32 master on the device (32 GB at 8B); this reads the host's layers a group at a time
    choice.family_spec.writer(engine.consolidated_master(), choice.config, out)
    copy_tokenizer(tok, out)
    print(f"Hugging Face weights written to {out}")
