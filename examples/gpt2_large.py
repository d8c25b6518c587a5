"""Fine-tune GPT-2 or a Llama-family model (Llama 3, Qwen2 / Qwen3, Mistral) with any DeepSpeed config.

    python examples/gpt2_large.py --config configs/zero2_bf16.json            # GPU: GPT-2 Large
    python examples/gpt2_large.py --model tiny --steps 200                     # CPU: a tiny GPT-2
    python examples/gpt2_large.py --hf-checkpoint ./gpt2-large --data corpus.jsonl --save runs/ft
    python examples/gpt2_large.py --hf-checkpoint ./Llama-3.2-1B-Instruct --data chat.jsonl \
        --seq-len 2048 --lora 16 --lora-alpha 32 --export-hf runs/adapter    # LoRA on chat data

--model names a GPT-2 size or a Llama-family shape (random init); --hf-checkpoint reads a local
Hugging Face folder of either family (config.json's model_type) with its tokenizer. Without --data
it trains on an embedded corpus (Python's own documentation), so it runs on a fresh machine with no
download. --data takes .txt, or .jsonl fine-tuning records: {"text"} (streamed and cut into blocks,
as .txt), {"prompt", "completion"} and {"messages"} (the checkpoint's chat template): the loss on the
completion / assistant turns only, examples packed into rows (segment ids) or one a row (--pad).
--lora R (or the config's "lora" section, PEFT's LoraConfig keys) freezes the base and trains
adapters; --export-hf then writes PEFT's adapter folder (and with --merge the merged model).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

# `python examples/gpt2_large.py` from a checkout works without installing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))



def _number(kind, lo=None, *, above=False, note=""):
    """An argparse type: a finite int / float, >= lo (> lo with above=True); `note` says why."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if lo is not None and (value <= lo if above else value < lo):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if above else '>='} {lo}{note}")
        return value
    return parse


def _micro_batch(text):
    return "auto" if text == "auto" else _number(int, 1, note=" (or auto)")(text)


# Flags whose value may be negative: argparse reads "-1e-3" as an option (its negative-number rule
# misses exponents), so "--lr -1e-3" is rewritten "--lr=-1e-3" and the type checks then say why
# a negative value is refused, instead of "expected one argument".
_VALUE_FLAGS = ("--steps", "--schedule-steps", "--seq-len", "--grad-accum", "--lr", "--loss-chunk",
                "--eval-batches", "--seed", "--peak-tflops", "--keep", "--micro-batch", "--lora", "--lora-alpha")

GPT2_SIZES = ("tiny", "small", "medium", "large", "xl")
# --model's Llama-family names -> zerojax.models.LlamaConfig.named's shapes (its test shapes renamed
# so that "tiny" stays GPT-2's); tests/test_example.py checks that every shape it offers is here
LLAMA_SHAPES = {"llama-3.2-1b": "llama-3.2-1b", "llama-3.2-3b": "llama-3.2-3b", "llama-3.1-8b": "llama-3.1-8b",
                "qwen2.5-0.5b": "qwen2.5-0.5b", "qwen3-0.6b": "qwen3-0.6b", "mistral-7b": "mistral-7b",
                "mistral-7b-v0.3": "mistral-7b-v0.3", "tiny-llama": "tiny", "tiny-qwen2": "tiny-qwen2",
                "tiny-qwen3": "tiny-qwen3"}
MODEL_CHOICES = ("auto", *GPT2_SIZES, *LLAMA_SHAPES)
QUANTIZE = ("int8", "nf4", "int4")


def _join_negative_values(argv):
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _VALUE_FLAGS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            try:
                float(argv[i + 1])
            except ValueError:
                pass
            else:
                out.append(f"{argv[i]}={argv[i + 1]}")
                i += 2
                continue
        out.append(argv[i])
        i += 1
    return out


def parse_args(argv=None):
    from zerojax.config import REMAT_POLICY_NAMES  # no jax: zerojax.config imports none
    from zerojax.options import OFFLOAD_LOOPS  # nor zerojax.options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "zero2_bf16.json"),
                   help="a DeepSpeed JSON config (its \"auto\" values are filled from the flags below)")
    p.add_argument("--model", default="auto", choices=MODEL_CHOICES, metavar="NAME",
                   help="the model, randomly initialised: a GPT-2 size (" + ", ".join(GPT2_SIZES) + ") or a "
                        "Llama-family shape (" + ", ".join(LLAMA_SHAPES) + "; tiny-*: test shapes with a byte "
                        "vocabulary); auto = GPT-2 large on a GPU, tiny on CPU (on --resume the checkpoint's)")
    p.add_argument("--hf-checkpoint", metavar="DIR",
                   help="local Hugging Face folder (config.json, model.safetensors or its shards) of GPT-2, "
                        "Llama, Mistral, Qwen2 or Qwen3 (config.json's model_type); its tokenizer is used")
    p.add_argument("--data", help=".txt / .jsonl file or folder; .jsonl fine-tuning records {\"prompt\", "
                                  "\"completion\"} or {\"messages\"} train on the completion / assistant "
                                  "turns only; {\"text\"} records are cut into --seq-len blocks as .txt is; "
                                  "default: the embedded corpus")
    p.add_argument("--pad", action="store_true",
                   help="fine-tuning .jsonl: one example a row, padded (default: examples packed into rows, "
                        "kept apart by segment ids; GPT-2, which has none, is always padded)")
    p.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json, tokenizer_config.json with the chat "
                                       "template) or tokenizer.json (default: the checkpoint's, else byte-level)")
    p.add_argument("--steps", type=_number(int, 0, note=" (0 = no training, evaluation only)"), default=None,
                   help="train until this global optimizer step (default 300 on CPU, 100 on GPU); with "
                        "--resume the run continues from the checkpoint's step up to it")
    p.add_argument("--schedule-steps", type=_number(int, 1), default=None,
                   help="length of the lr schedule (fills scheduler total_num_steps \"auto\"; warmup "
                        "is 10%% of it); default: --steps, or on --resume the length saved with the "
                        "checkpoint")
    p.add_argument("--seq-len", type=_number(int, 2, note=" (a row of T tokens gives T-1 predictions)"),
                   default=None, help="tokens per row (default 1024; tiny: 128)")
    p.add_argument("--micro-batch", type=_micro_batch, default=None,
                   help="fills train_micro_batch_size_per_gpu \"auto\": a number, or auto = the largest "
                        "that fits the device (XLA's compiled peak, found before anything is allocated); "
                        "default 8 on a GPU, 4 on CPU")
    p.add_argument("--grad-accum", type=_number(int, 1), default=1, help="fills gradient_accumulation_steps \"auto\"")
    p.add_argument("--lr", type=_number(float, 0.0, note=" (as torch.optim.AdamW; 0 keeps the weights fixed)"),
                   default=None, help="fills optimizer/scheduler lr \"auto\" (default 1e-3 tiny, 3e-4 "
                                      "others, 1e-4 from --hf-checkpoint; on --resume the checkpoint's)")
    # said once for the three flags: what decides the precision (resolve_precision, default_precision)
    precision = p.add_argument_group(
        "precision", "The config decides where it sets fp16 / bf16 enabled: true (a flag asking for another\n"
        "precision is then an error): the default config, configs/zero2_bf16.json, sets bf16, so a run\n"
        "without --config trains in bf16, on CPU too. Where the config leaves it open (enabled \"auto\",\n"
        "or no fp16 / bf16 section) a flag picks; without one: bf16 on a GPU that has it, fp32 on CPU."
    ).add_mutually_exclusive_group()
    for name in ("bf16", "fp16", "fp32"):
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help=f"train in {name} where the config leaves precision open")
    p.add_argument("--remat", choices=list(REMAT_POLICY_NAMES), default=None,
                   help="activation checkpointing per layer (default: from the config's "
                        "activation_checkpointing section: its remat_policy, else cpu_checkpointing -> "
                        "offload, else full)")
    p.add_argument("--save", help="checkpoint folder (orbax); saved at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    p.add_argument("--keep", type=_number(int, 1), default=None,
                   help="after saving, delete all but the newest N checkpoints in --save, never the "
                        "one `latest` names (Hugging Face's save_total_limit); default: keep all")
    p.add_argument("--export-hf", metavar="DIR",
                   help="write the trained model as a Hugging Face folder (transformers' from_pretrained "
                        "loads it; the checkpoint's tokenizer files copied in); with LoRA: PEFT's adapter "
                        "folder naming --hf-checkpoint as its base (peft.AutoPeftModelForCausalLM.from_pretrained), see --merge")
    p.add_argument("--lora", type=_number(int, 1), default=None, metavar="R",
                   help="train LoRA adapters of rank R on a frozen base (GPT-2 or the Llama family; zerojax.lora, "
                        "PEFT's settings); overrides the config's \"lora\" section's r")
    p.add_argument("--lora-alpha", type=_number(float, 0.0, above=True), default=None,
                   help="LoRA scale numerator (scale = alpha / r); default: the \"lora\" section's, else "
                        "PEFT's 8")
    p.add_argument("--lora-targets", default=None,
                   help="modules that get adapters: \"all-linear\" (every projection but the LM head) or "
                        "comma-separated names such as q_proj,v_proj (GPT-2: c_attn,c_proj,c_fc); default: the "
                        "\"lora\" section's "
                        "target_modules, else all-linear")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="with LoRA: store the frozen base quantized (int8 per channel; nf4 / int4 in "
                        "64-element blocks: QLoRA), dequantized layer by layer on use")
    p.add_argument("--merge", action="store_true",
                   help="with LoRA and --export-hf DIR: DIR gets the merged model (base + scale x B A, a "
                        "plain Hugging Face folder) and DIR/adapter the PEFT adapter")
    p.add_argument("--loss-chunk", type=_number(int, 0), default=0,
                   help="cross entropy N positions at a time (zerojax.models.chunked_gpt2_loss / "
                        "chunked_llama_loss): the "
                        "full batch x seq x vocab fp32 logits are never held; 0 = full logits")
    p.add_argument("--offload-loop", choices=list(OFFLOAD_LOOPS), default=None,
                   help="with zero_optimization.offload_optimizer.device cpu: how the optimizer state "
                        "streams through the GPU (zerojax.EngineOptions.offload_loop; \"host\": its "
                        "update driven from Python, beside the forward / backward: GPT-2 Large on an "
                        "H200 ~1.7x in_place, +4 GiB; default: host where its step fits the device's "
                        "memory (checked before anything is allocated), else in_place)")
    p.add_argument("--adam-mu-dtype", choices=["bfloat16"], default=None,
                   help="store Adam's first moment in bf16 (zerojax.EngineOptions.adam_mu_dtype): 2 bytes "
                        "a parameter less, and under optimizer offload less to move over PCIe; changes "
                        "training slightly (DeepSpeed keeps it fp32); default: the master's dtype")
    p.add_argument("--master-split", action="store_true",
                   help="keep the fp32 master as the bf16 params + an int16 remainder on the device "
                        "(zerojax.EngineOptions(split_master=\"on\")): 2 bytes a parameter less, the same "
                        "training but for exact ties (one fp32 ulp); needs bf16; under optimizer offload to cpu "
                        "it splits the host copy (the host loop does by default), not with NVMe)")
    p.add_argument("--summary-json", metavar="PATH",
                   help="also write the run's SUMMARY (the JSON of the `SUMMARY {...}` line: settings, every "
                        "loss, speed, memory) to PATH")
    p.add_argument("--eval-batches", type=_number(int, 0), default=8,
                   help="validation batches (of train_batch_size rows, from the held-out part of the "
                        "data) evaluated after training; 0 = no validation")
    p.add_argument("--seed", type=_number(int, 0), default=None,
                   help="init and data-order seed (default 0; on --resume the checkpoint's)")
    p.add_argument("--peak-tflops", type=_number(float, 0.0, above=True), default=None,
                   help="per-device TFLOP/s that MFU is reported against (default on a GPU / TPU: the "
                        "matmul ceiling in the run's precision, measured at start, zerojax.planning.ceiling; "
                        "a datasheet peak is never reached; on CPU no MFU is reported without this flag)")
    args = p.parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    if args.keep is not None and not args.save:
        p.error("--keep needs --save DIR (the checkpoint folder to prune)")
    if args.resume and not args.save:
        p.error("--resume needs --save DIR (the checkpoint folder to continue from)")
    if args.merge and not args.export_hf:
        p.error("--merge needs --export-hf DIR (where the merged model is written)")
    return args


def _loss_fn(loss_chunk: int, family: str = "gpt2"):
    from zerojax.models import chunked_gpt2_loss, chunked_llama_loss, gpt2_loss, llama_loss

    if family == "llama":
        return chunked_llama_loss(loss_chunk) if loss_chunk else llama_loss
    return chunked_gpt2_loss(loss_chunk) if loss_chunk else gpt2_loss


def _plan_micro_batch(cfg, build, dtype, remat, explore_remat, seq_len, loss_fn, options, lora=False):
    """train_micro_batch_size_per_gpu "auto": the planner's fastest choice that fits the device
    (zerojax.planning.planner: remat, micro-batch x accumulation keeping the global batch, stage, offload;
    compiled before anything is allocated, with the run's EngineOptions: --master-split and
    --adam-mu-dtype hold less). Unless --remat or the config names a policy, the remat choices are
    none and the planner's measured ladder (dots ... full). `build(remat_policy)` -> the model
    (GPT-2 or Llama; with LoRA its adapters applied). -> (config, remat)."""
    import zerojax
    from zerojax.planning import planner
    from zerojax.planning.memory import device_budget

    budget = device_budget()
    if budget is None:
        print(f"micro-batch auto: this device reports no memory limit; using "
              f"{cfg.train_micro_batch_size_per_gpu}")
        return cfg, remat
    if explore_remat:  # the planner varies activation checkpointing
        def factory(remat_policy=None):
            return build(remat_policy)
    else:  # --remat given: kept
        def factory():
            return build(remat)
    # LoRA: the frozen base is in what the planner compiles; parameter offload is not among its
    # choices (its time estimate prices the trained parameters' transfers, not a frozen base moved
    # a layer at a time); a config that asks for offload_param gets it
    offloads = tuple(o for o in planner.DEFAULT_OFFLOADS if not lora or o != "param")
    found = planner.search(factory, cfg.to_dict(), budget, seq_len, loss_fn=loss_fn, max_plans=1, offloads=offloads,
                           remat=(None, *planner.REMAT_LADDER) if explore_remat else None, options=options)
    host = [o for p, o in found.tried if o.startswith("does not fit host memory")]
    if not found.plans and host:
        raise NoPlanFits(f"micro-batch auto: the plans that fit the device {host[0].removeprefix('does not fit ')} "
                          "(offloaded states, and with accumulation offload_param's gradient accumulator); try "
                          "--grad-accum 1, data_types.grad_accum_dtype \"bf16\", --adam-mu-dtype bfloat16, or "
                          "offload_optimizer device \"nvme\" (docs/nvme.md)")
    if not found.plans:
        raise zerojax.WillNotFitError(min((p.peak_bytes for p, _ in found.tried if p.peak_bytes), default=0),
                                      budget, (), what="every plan tried")
    best = found.plans[0]
    print(f"micro-batch auto: {found.explain(best)}")
    hint = _offload_hint(best, planner.model_shape(factory, seq_len).params, cfg.world_size, options, dtype)
    if hint:
        print(hint)
    cfg = zerojax.load_config(best.apply(cfg.to_dict()), world_size=cfg.world_size)
    return cfg, (best.remat if explore_remat else remat)


def _offload_hint(plan, params: int, n_data: int, options, dtype) -> str | None:
    """Where the planner's choice offloads a bf16 run and --master-split / --adam-mu-dtype bfloat16
    are not given: the model state each would keep off every device (the estimate's floor), as a
    line that says to try them. Not applied unasked: the split master moves a weight by one fp32 ulp
    at exact ties, the bf16 first moment rounds Adam's state. (GPT-2 XL on an H200 capped at 23.8
    GiB: the planner offloads half the optimizer at ZeRO-3, 15.1-15.5k tokens/s; --master-split
    alone fits it without offload, 39.3k; benchmarks/RESULTS.md.)"""
    import jax.numpy as jnp

    from zerojax.planning import estimate

    if not (plan.offload_optimizer or plan.offload_param) or jnp.dtype(dtype) != jnp.bfloat16:
        return None
    floor = functools.partial(estimate.model_state_floor, params, stage=plan.stage, n_data=n_data, precision="bf16")
    split = options.split_master == "on"
    now = floor(master_split=split, adam_mu_dtype=options.adam_mu_dtype)
    said = []
    if not split:
        saved = now - floor(master_split=True, adam_mu_dtype=options.adam_mu_dtype)
        said.append(f"--master-split {saved / 2**30:.2f} GiB (the fp32 master as its bf16 copy and an int16 "
                    f"remainder: the same training but for exact ties)")
    if options.adam_mu_dtype != "bfloat16":
        saved = now - floor(master_split=split, adam_mu_dtype="bfloat16")
        said.append(f"--adam-mu-dtype bfloat16 {saved / 2**30:.2f} GiB (Adam's first moment rounded to bf16)")
    if not said:
        return None
    return ("micro-batch auto: this plan offloads; model state these flags keep off each device, which may "
            "let a plan without offload fit: " + "; ".join(said))


def default_precision(device) -> tuple[str, str]:
    """What a user expects when nothing says: bf16 on a GPU that runs it natively (compute
    capability >= 8.0, Hugging Face's `is_torch_bf16_gpu_available` rule) and on TPU, else fp32."""
    if device.platform == "cpu":
        return "fp32", "default on CPU"
    cc = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and cc is not None and float(cc) < 8.0:
        return "fp32", f"default on {device.device_kind}: compute capability {cc} has no fast bf16"
    return "bf16", f"default on {device.device_kind}"


def resolve_precision(raw: dict, flag: str | None, device) -> tuple[dict, str, str]:
    """The config's fp16 / bf16 `enabled` resolved as Hugging Face's Trainer fills them.

    A config that sets `enabled: true` decides (a contradicting flag is an error, as the Trainer's
    "mismatch" check); otherwise, where `enabled` is "auto" or the section is absent, the flag
    (--bf16 / --fp16 / --fp32) or `default_precision` picks, never a mode the config sets false.
    Returns (config dict with both `enabled` set, precision, why).
    """
    raw = json.loads(json.dumps(raw))
    keys = {"fp16": "fp16", "bf16": "bfloat16" if "bfloat16" in raw and "bf16" not in raw else "bf16"}
    enabled = {m: (raw[k].get("enabled", False) if isinstance(raw.get(k), dict) else None)
               for m, k in keys.items()}
    chosen = [m for m in ("bf16", "fp16") if enabled[m] is True]
    if chosen:
        mode, why = chosen[0], f"the config's {keys[chosen[0]]}.enabled: true"
        if flag is not None and flag != mode:
            raise ConfigMismatch(f"--{flag} asks for {flag}, but the config sets {keys[mode]}.enabled: "
                                 f"true; drop the flag, or set {keys[mode]}.enabled to \"auto\" so the flag decides")
    else:
        mode, why = (flag, f"--{flag}") if flag else default_precision(device)
        if mode != "fp32" and enabled[mode] is False:
            if flag:
                raise ConfigMismatch(f"--{flag} asks for {flag}, but the config sets {keys[mode]}.enabled: "
                                     f"false; drop the flag, or set it to \"auto\" so the flag decides")
            mode, why = "fp32", f"the config sets {keys['bf16']}.enabled: false"
    for m, k in keys.items():
        if enabled[m] is not None or m == mode:
            raw[k] = {**raw.get(k, {}), "enabled": m == mode}
    return raw, mode, why


class ConfigMismatch(ValueError):
    """A flag that contradicts what the config sets explicitly."""


class NoPlanFits(ValueError):
    """--micro-batch auto found no plan whose step fits both the device and the host memory."""


def _offload_loop_auto(cfg, make_model, seq_len, loss_fn) -> tuple[str, str | None]:
    """No --offload-loop: where the config offloads the optimizer to cpu alone and the device
    reports its memory, "host" if its step fits (compiled first on an abstract engine, holding no
    memory), else "in_place" (the library's default: 3-6 GiB less on GPT-2 Large / XL, ~1.75x
    slower; benchmarks/RESULTS.md). -> (loop, why; None where no choice was made)."""
    import jax
    import jax.numpy as jnp

    from zerojax import EngineOptions
    from zerojax.train.engine import abstract_engine
    from zerojax.train.layout import chunk_loops_apply, offloads
    from zerojax.planning.memory import device_budget, fmt_bytes

    if not chunk_loops_apply(cfg.zero_optimization, *offloads(cfg)):
        return "in_place", None
    if cfg.fp16.enabled:  # fp16 matmuls do not run on CPU, so the host loop's loss-scale skips are untested
        return "in_place", "default; the host loop is not yet tested with fp16 loss scaling (--offload-loop host to try)"
    budget = device_budget()
    if budget is None:
        return "in_place", "default; this device reports no memory limit to check \"host\" against"
    probe = abstract_engine(make_model, cfg, loss_fn=loss_fn, options=EngineOptions(offload_loop="host"))
    peak = probe.step_memory({"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, seq_len), jnp.int32)}).peak
    fits = peak <= budget
    if jax.process_count() > 1:  # every process must build the same layout: "host" only where it fits on all
        import numpy as np
        from jax.experimental import multihost_utils

        fits = bool(np.all(multihost_utils.process_allgather(np.asarray([fits]))))
    if fits:
        return "host", (f"auto: its step needs {fmt_bytes(peak)} of the device's {fmt_bytes(budget)}; "
                        f"--offload-loop in_place holds less, slower")
    if peak <= budget:
        return "in_place", "auto: \"host\" fits here but not on every process"
    return "in_place", f"auto: \"host\" would need {fmt_bytes(peak)} of the device's {fmt_bytes(budget)}"


def _requested_options(args, loop=None):
    """The EngineOptions the flags ask for (--offload-loop, else `loop`; --adam-mu-dtype; --master-split)."""
    from zerojax import EngineOptions

    return EngineOptions(offload_loop=args.offload_loop or loop or "auto", adam_mu_dtype=args.adam_mu_dtype,
                         split_master="on" if args.master_split else "auto")


def _engine_options(args, cfg, loop=None, planned=False):
    """--offload-loop (else `loop`) and --master-split, checked against the config before the engine is built ->
    zerojax.EngineOptions. `planned`: the planner chose the config's offload (micro-batch auto), so
    --master-split gives way where that plan offloads (the host loop splits the master itself)."""
    from zerojax.train.layout import offloads, options_for_config, resolve_offload_loop, resolve_split_master

    options = _requested_options(args, loop)
    zero = cfg.zero_optimization
    if planned:  # what the planner's layout cannot take gives way (as it did when the plan was compiled)
        adapted = options_for_config(options, cfg)
        if adapted.split_master != options.split_master:
            off = offloads(cfg)
            if resolve_offload_loop(adapted, zero, *off) == "host":
                print("--master-split: the planner's choice offloads, and the device then holds no master to "
                      "split (the host loop splits its host copy by itself)")
            else:  # the master in NVMe files, or on the device beside offloaded parameters
                print("--master-split: the planner's choice keeps the fp32 master where it is not split (in "
                      "NVMe files, or on the device with only the parameters offloaded); the split applies "
                      "without offload or with the optimizer offloaded to cpu")
        if adapted.offload_loop != options.offload_loop:
            print(f"--offload-loop {options.offload_loop}: the planner's choice does not offload the optimizer "
                  "to cpu alone; no offload loop runs")
        options = adapted
    offloaded = any(offloads(cfg))
    try:
        loop_ = resolve_offload_loop(options, zero, *offloads(cfg)) if offloaded else None
    except ValueError:  # refused below
        loop_ = None
    try:
        resolve_split_master(options, cfg, loop_, offloaded)
    except ValueError:
        raise ConfigMismatch(
            f"--master-split needs bf16 and no offload (or the host offload loop); {args.config} has "
            f"bf16.enabled {cfg.bf16.enabled}, "
            f"offload_optimizer.device {zero.offload_optimizer.device!r}, offload_param.device "
            f"{zero.offload_param.device!r} "
            "(configs/zero2_bf16.json is one that fits; under optimizer offload the host loop splits "
            "the master by itself)") from None
    try:  # the engine's own rule, before anything is built
        resolve_offload_loop(options, zero, *offloads(cfg))
    except ValueError:
        raise ConfigMismatch(
            f"--offload-loop {args.offload_loop} needs zero_optimization.offload_optimizer.device \"cpu\" "
            f"(stage >= 1) and no offload_param; {args.config} has stage {zero.stage}, offload_optimizer.device "
            f"{zero.offload_optimizer.device!r}, offload_param.device {zero.offload_param.device!r} "
            "(configs/zero2_offload_optimizer.json is one that fits)") from None
    return options


# the GPT2Config fields that decide the parameters' shapes
_SHAPE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "make_vocab_size_divisible_by")
# LlamaConfig fields that do not change the model a checkpoint holds
_LLAMA_RECORD_SKIP = ("initializer_range", "bos_token_id", "eos_token_id")


class ModelChoice:
    """The model a run trains: `family` "gpt2" (zerojax.models.GPT2) or "llama" (zerojax.models.Llama:
    Llama, Mistral, Qwen2, Qwen3), its config, --model's name (`size`; "hf" for a checkpoint's) and
    the words the run prints for it."""

    def __init__(self, family: str, config, size: str, label: str):
        self.family, self.config, self.size, self.label = family, config, size, label

    @property
    def max_positions(self) -> int:
        return self.config.n_positions if self.family == "gpt2" else self.config.max_position_embeddings

    def build(self, seed: int, dtype, remat, param_dtype=None):
        """A randomly initialised model of this config (compute dtype, remat policy; parameters in
        param_dtype, default fp32)."""
        import jax.numpy as jnp
        from flax import nnx

        from zerojax.models import GPT2, Llama

        cls = GPT2 if self.family == "gpt2" else Llama
        return cls(self.config, rngs=nnx.Rngs(seed), dtype=dtype, remat_policy=remat,
                   param_dtype=param_dtype or jnp.float32)


def named_model(size: str) -> ModelChoice:
    """--model's name -> its ModelChoice (GPT-2 size or Llama-family shape)."""
    from zerojax.models import GPT2Config, LlamaConfig

    if size in GPT2_SIZES:
        return ModelChoice("gpt2", GPT2Config.named(size), size, f"GPT-2 {size}")
    config = LlamaConfig.named(LLAMA_SHAPES[size])
    return ModelChoice("llama", config, size, f"{size} ({config.model_type})")


def hf_model_type(path: str) -> str:
    """config.json's model_type of a Hugging Face folder (GPT-2's when absent, as from_hf reads it)."""
    from zerojax.models.llama import MODEL_TYPES

    if not os.path.isdir(path):  # a mistyped path: say that, not what a folder would lack
        raise FileNotFoundError(f"--hf-checkpoint {path}: " + ("a file, not a folder" if os.path.exists(path) else
                                f"no such folder ({os.path.abspath(path)})") + "; give the folder holding "
                                "config.json and model.safetensors")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise FileNotFoundError(f"--hf-checkpoint {path}: no config.json (a Hugging Face model folder has "
                                f"config.json and model.safetensors)")
    with open(cfg_file) as f:
        kind = json.load(f).get("model_type", "gpt2")
    if kind != "gpt2" and kind not in MODEL_TYPES:
        from zerojax.checkpoint.state import CheckpointError

        raise CheckpointError(f"--hf-checkpoint {path}: model_type {kind!r}; this example trains gpt2 and "
                              f"the Llama family ({', '.join(MODEL_TYPES)})")
    return kind


def _record_shape(family, config: dict, saved: dict) -> dict:
    """The parts of a model config (as a dict) that decide the model a checkpoint holds."""
    keys = _SHAPE_KEYS if family == "gpt2" else [k for k in saved if k not in _LLAMA_RECORD_SKIP]
    return json.loads(json.dumps({k: config.get(k) for k in keys if k in saved}))


def _checkpoint_model(meta, args, choice: ModelChoice) -> ModelChoice:
    """--resume: the model the checkpoint holds (its `checkpoint_record`, in the metadata) against
    the one this run asks for, before anything is built; --model auto takes the checkpoint's model
    where it is a named one. A checkpoint without a record is left to the load's own shape check."""
    from zerojax.checkpoint.state import CheckpointError

    record = meta.get("model") or {}
    saved = record.get("config")
    family = "gpt2" if record.get("type") == "gpt2" else record.get("family")
    if record and family not in ("gpt2", "llama"):
        raise CheckpointError(f"{args.save}: this checkpoint is a {record.get('type')!r} model, which this "
                              f"example does not train; resume it with the script that trained it")
    if not isinstance(saved, dict):
        return choice

    def shape(c):
        return _record_shape(family, c, saved)

    if choice.family == family and shape(dataclasses.asdict(choice.config)) == shape(saved):
        return choice
    names = GPT2_SIZES if family == "gpt2" else tuple(LLAMA_SHAPES)
    named = next((n for n in names if shape(dataclasses.asdict(named_model(n).config)) == shape(saved)), None)
    if named and args.model == "auto" and not args.hf_checkpoint:
        return named_model(named)
    if named:
        what = named_model(named).label
    elif family == "gpt2":
        what = "a GPT-2 of " + ", ".join(
            f"{k} {saved[k]}" for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions") if k in saved)
    else:
        what = f"a {record.get('type')} model of " + ", ".join(
            f"{k} {saved[k]}" for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
            if k in saved)
    fix = (f"use --model {named}" + (" without --hf-checkpoint" if args.hf_checkpoint else "") if named
           else "resume with the --hf-checkpoint it was trained from")
    asked = f"the model in {args.hf_checkpoint}" if args.hf_checkpoint else choice.label
    raise CheckpointError(f"{args.save}: this checkpoint is {what}; {fix} (this run asks for {asked}; "
                          f"another --save folder starts it afresh)")


# --------------------------------------------------------------------------- data


class ByteTokens:
    """UTF-8 bytes as tokens (zerojax.data.text.ByteTokenizer: vocab 256, no special tokens) with
    what zerojax.data.finetune reads of a tokenizer (no chat template)."""

    vocab_size, eos_id, chat_template = 256, None, None
    special_tokens: dict = {}
    path = "the byte-level tokenizer (no --tokenizer, no --hf-checkpoint)"

    def encode(self, text: str, add_special_tokens: bool = False):
        import numpy as np

        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False):
        import numpy as np

        pieces = [(b, i) for i, ch in enumerate(text) for b in ch.encode("utf-8")]
        ids = np.asarray([b for b, _ in pieces], np.int32)
        return ids, np.asarray([(i, i + 1) for _, i in pieces], np.int64).reshape(-1, 2)

    def token_id(self, token):
        return None


def jsonl_format(path) -> str | None:
    """What a .jsonl file (or a folder whose first .jsonl file) holds, from its first record:
    "text", "prompt_completion", "messages", or "other" (a JSON object of other keys: the
    fine-tuning reader names the formats); None for other data, or a first line that is not JSON
    (the text reader then names the file and the line)."""
    from zerojax.data.finetune import record_format

    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(r, n) for r, _, names in os.walk(path) for n in names
                       if n.endswith((".jsonl", ".txt")))
    else:
        files = [path]
    if not files or not files[0].endswith(".jsonl") or not os.path.isfile(files[0]):
        return None
    with open(files[0], "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return None
            if not isinstance(record, dict):
                return None
            return record_format(record) or "other"
    return None


class TextRows:
    """Blocks of a token stream (zerojax.data.text): every token a target."""

    def __init__(self, data):
        self.data, self.vocab_size = data, data.vocab_size
        self.n_train, self.n_val = len(data.train), len(data.val)
        self.what = "training rows"

    def train_batches(self, batch_size, *, seed, start_step, num_steps):
        batches = self.data.train_batches(batch_size, seed=seed, start_step=start_step, num_steps=num_steps)
        self.steps_per_epoch = batches.steps_per_epoch
        return ({"input_ids": rows} for rows in batches)

    def val_batches(self, batch_size):
        return ({"input_ids": rows} for rows in self.data.val_batches(batch_size))


class FinetuneRows:
    """Fine-tuning rows (zerojax.data.finetune: input_ids, labels, and packed, segment_ids and
    positions); the last ~5% of the rows held out for validation, in whole batches."""

    def __init__(self, data, batch_size: int, packed: bool):
        n = len(data)
        n_val = min(max(1, round(0.05 * n)) if n >= 2 else 0, n - batch_size)
        n_val = n_val // batch_size * batch_size  # validation draws whole batches
        split = lambda lo, hi: dataclasses.replace(data, arrays={k: v[lo:hi] for k, v in data.arrays.items()})  # noqa: E731
        self.train, self.val = split(0, n - n_val), split(n - n_val, n)
        self.vocab_size = data.tokenizer.vocab_size
        self.n_train, self.n_val = n - n_val, n_val
        self.what = (f"{'packed' if packed else 'padded'} rows of {data.format.replace('_', ' / ')} examples, "
                     f"{self.train.target_tokens:,} target tokens")
        self.steps_per_epoch = max(1, self.n_train // batch_size)

    def train_batches(self, batch_size, *, seed, start_step, num_steps):
        return self.train.batches(batch_size, seed=seed, start_step=start_step, num_steps=num_steps)

    def val_batches(self, batch_size):
        import jax

        local = batch_size // jax.process_count()
        for k in range(self.n_val // batch_size):
            lo = k * batch_size + jax.process_index() * local
            yield self.val.batch(slice(lo, lo + local))


def load_data(args, choice: ModelChoice, seq_len: int, batch_size: int, notes: list):
    """--data (or the embedded corpus) read, tokenized and checked against the model and one batch
    before anything is compiled -> TextRows or FinetuneRows."""
    from zerojax.data.finetune import load_finetune_data
    from zerojax.data.text import DataError, load_text_data

    fmt = jsonl_format(args.data) if args.data else None
    if fmt in (None, "text"):
        if args.pad:
            notes.append("--pad: no effect on this data (text is cut into --seq-len blocks; --pad is for "
                         "{\"prompt\", \"completion\"} / {\"messages\"} .jsonl records)")
        data = TextRows(load_text_data(args.data, seq_len=seq_len, tokenizer=args.tokenizer,
                                       min_train_rows=batch_size))
    else:
        packed = not args.pad
        if packed and choice.family == "gpt2":
            packed = False
            notes.append("GPT-2 has no segment ids to keep packed examples apart: one example a row, padded")
        from zerojax.models import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else ByteTokens()
        data = FinetuneRows(load_finetune_data(args.data, tokenizer, seq_len=seq_len, packed=packed),
                            batch_size, packed)
        if data.n_train < batch_size:
            raise DataError(f"{args.data}: {data.n_train} rows of {seq_len} tokens, fewer than one batch of "
                            f"{batch_size}: give more examples, a smaller batch or (packed) a longer --seq-len")
    if data.vocab_size > choice.config.vocab_size:
        raise DataError(f"the tokenizer has {data.vocab_size} tokens but the model's vocab is "
                        f"{choice.config.vocab_size}; give the model's own tokenizer (--tokenizer DIR)")
    return data


# --------------------------------------------------------------------------- LoRA


def lora_settings(args, cfg, dtype, saved=None) -> dict | None:
    """The LoRA settings of this run: the config's "lora" section (else, on --resume, the ones
    `saved` with the checkpoint) with --lora / --lora-alpha / --lora-targets / --quantize over it,
    checked by zerojax.lora.from_config_dict; what LoRA cannot run with refused in one line before
    anything is built. None: no LoRA."""
    section = cfg.to_dict().get("lora")
    flags = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
                            ("--quantize", args.quantize), ("--merge", args.merge or None)) if v is not None]
    if args.lora is None and section is None and saved is None:
        if flags:
            raise ConfigMismatch(f"{flags[0]} is a LoRA setting: add --lora R (the adapter rank), or a \"lora\" "
                                 f"section to {args.config}")
        return None
    from zerojax import lora

    # a resumed run continues the checkpoint's adapters: what the flags and the config leave out
    # is the checkpoint's, not PEFT's defaults (--lora 8 alone keeps its lora_alpha 16)
    settings = dict(section or saved or {})
    if args.lora is not None:
        settings["r"] = args.lora
    if args.lora_alpha is not None:
        settings["lora_alpha"] = args.lora_alpha
    elif "lora_alpha" not in settings:
        settings["lora_alpha"] = lora.DEFAULTS["lora_alpha"]
    if args.lora_targets is not None:
        t = args.lora_targets.strip()
        settings["target_modules"] = t if t == "all-linear" else [x.strip() for x in t.split(",") if x.strip()]
    settings.setdefault("target_modules", "all-linear")
    if args.quantize is not None:
        settings["quantize"] = args.quantize
    if settings.get("base_dtype") is None and settings.get("quantize") is None:
        import numpy as np

        settings["base_dtype"] = np.dtype(dtype).name  # the frozen base is only read in the compute dtype
    settings = lora.from_config_dict(settings)
    from zerojax.config import pipeline_stages

    zero = cfg.zero_optimization
    refused = (f"pipeline.stages {pipeline_stages(cfg.pipeline)}" if pipeline_stages(cfg.pipeline) > 1 else
               f"zero_optimization.offload_param.device {zero.offload_param.device!r}"
               if zero.offload_param.device != "none" else None)
    if refused:
        raise ConfigMismatch(f"LoRA with {refused} ({args.config}): the engine's layer scan there carries the "
                             f"trained parameters only, not the frozen base (zerojax.lora); use ZeRO 0-3 (optimizer "
                             f"offload included) without pipelining or offload_param")
    return settings


def _check_lora_resume(args, was: dict | None, now: dict | None, notes: list):
    """--resume: this run's LoRA settings against the checkpoint's; a difference is refused naming
    each differing setting with both values, before anything is built."""
    from zerojax.checkpoint.state import CheckpointError

    now = json.loads(json.dumps(now))  # as the checkpoint's JSON holds it (tuples as lists)
    if was == now:
        if was and not (args.lora or args.lora_alpha or args.lora_targets or args.quantize):
            notes.append("lora: the checkpoint's settings (no LoRA flag given)")
        return
    start_afresh = "; another --save folder starts afresh"
    if not was:
        raise CheckpointError(f"{args.save}: this checkpoint trained the whole model, this run asks for LoRA; "
                              f"resume with no --lora and no \"lora\" section{start_afresh}")
    differ = ", ".join(f"{k} {json.dumps(now.get(k))} (the checkpoint's: {json.dumps(was.get(k))})"
                       for k in sorted({*was, *now}) if was.get(k) != now.get(k))
    raise CheckpointError(f"{args.save}: this run's LoRA settings differ from the checkpoint's adapters: {differ}; "
                          f"resume without --lora / --lora-alpha / --lora-targets / --quantize (and without a "
                          f"\"lora\" section in {args.config}) to take the checkpoint's{start_afresh}")


def _copy_tokenizer(src, out_dir):
    """The tokenizer files of a Hugging Face folder copied into an exported one (what
    AutoTokenizer.from_pretrained reads)."""
    import shutil

    if not src or not os.path.isdir(src):
        return
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "generation_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))


def _host_peak_rss() -> int | None:
    """This process's peak resident memory in bytes (getrusage: KiB on Linux, bytes on macOS);
    None where the platform has no `resource` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def export_hf(args, engine, choice: ModelChoice, settings):
    """--export-hf: GPT-2 / Llama as a Hugging Face folder; with LoRA the PEFT adapter folder and
    (--merge) the merged model beside it."""
    import zerojax.models

    out, tok = args.export_hf, args.tokenizer if args.tokenizer and os.path.isdir(args.tokenizer) else None
    if settings is not None:
        from zerojax import lora

        model = engine.model
        adapter_dir = os.path.join(out, "adapter") if args.merge else out
        # the base as an absolute path: AutoPeftModelForCausalLM reads it from the adapter's
        # config, and a path relative to this run's directory would not load from anywhere else;
        # a randomly initialised --model has no folder to name (None, as PEFT writes for none)
        base = os.path.abspath(args.hf_checkpoint) if args.hf_checkpoint else None
        lora.save_peft(model, adapter_dir, base_model_name_or_path=base)
        _copy_tokenizer(tok, adapter_dir)
        print(f"PEFT adapter written to {adapter_dir} (" + (
            f"peft.AutoPeftModelForCausalLM.from_pretrained({adapter_dir!r}): its base is {base}" if base
            else f"peft.PeftModel.from_pretrained(base, {adapter_dir!r})") + ")")
        if args.merge:
            zerojax.models.to_hf(lora.merge(model), out)
            _copy_tokenizer(tok, out)
            print(f"merged model (base + adapters) written to {out}")
        return
    # the master as written out, not `engine.master_params`: under offload that merges the whole
    # fp32 master on the device (32 GB at 8B); this reads the host's layers a group at a time
    if choice.family == "gpt2":
        zerojax.models.save_hf(engine.consolidated_master(), choice.config, out)
    else:
        from zerojax.models.hf_llama import save_llama_hf
        save_llama_hf(engine.consolidated_master(), choice.config, out)
    _copy_tokenizer(tok, out)
    print(f"Hugging Face weights written to {out}")


def _filled_autos(raw, fill, cfg) -> list[str]:
    """Every "auto" of the config and the value it took ("key=value"), in file order: from the
    flags / model (fill, hidden size), DeepSpeed's batch rule, or DeepSpeed's default."""
    from zerojax.config import auto_keys, hidden_size_fill

    by_width = hidden_size_fill(1, cfg.zero_optimization.stage == 3)  # which keys the width fills
    resolved, out = cfg.to_dict(), []
    for key in auto_keys(raw):
        node = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        how = ("" if key in fill else " (model width)" if key in by_width else
               " (batch rule)" if "." not in key else " (DeepSpeed's default)")
        out.append(f"{key}={json.dumps(node)}{how}")
    return out


def _batch_note(meta, cfg):
    """--resume with another global batch (fewer devices or processes, another micro-batch or
    accumulation) than the checkpoint trained with: a line that says so, or None."""
    old = (meta.get("config") or {})
    tb = old.get("train_batch_size")
    if not isinstance(tb, int) or tb == cfg.train_batch_size:
        return None
    mb, ga = old.get("train_micro_batch_size_per_gpu"), old.get("gradient_accumulation_steps")
    world = tb // (mb * ga) if isinstance(mb, int) and isinstance(ga, int) and mb * ga else None
    was = f"{tb}" + (f" = {mb} x {ga} x {world} data-parallel" if world else "")
    now = (f"{cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x {cfg.gradient_accumulation_steps} "
           f"x {cfg.world_size} data-parallel")
    unit = cfg.train_micro_batch_size_per_gpu * cfg.world_size
    keep = (f"; --grad-accum {tb // unit} keeps {tb} (where the config leaves gradient_accumulation_steps "
            f"to \"auto\")" if tb % unit == 0 else "")
    return (f"the global batch changes from the checkpoint's {was} to {now}: each step now takes "
            f"{cfg.train_batch_size} rows, and the data continues at step {meta.get('global_steps', '?')} "
            f"in batches of the new size{keep}")


def _from_checkpoint(name, flag, value, saved, default, notes):
    """A run setting: the flag's value, else the one saved with the checkpoint, else default.
    A flag that changes the saved value adds a line to `notes`."""
    if value is None:
        return saved.get(name, default)
    if name in saved and saved[name] != value:
        notes.append(f"{flag} {value} replaces the checkpoint's {saved[name]}")
    return value


def _warn_replicated(engine, cfg):
    """Stage 3 keeps leaves under stage3_param_persistence_threshold elements whole on every
    device (DeepSpeed's rule): a small model then is barely partitioned, so say so once."""
    import jax

    zero = cfg.zero_optimization
    if zero.stage != 3 or engine.mesh.shape.get("data", 1) < 2:
        return
    threshold = int(zero.stage3_param_persistence_threshold or 0)
    leaves = [x for x in jax.tree.leaves(engine.state.params) if hasattr(x, "sharding")]
    total = sum(x.size for x in leaves)
    kept = sum(x.size for x in leaves if x.size < threshold and x.sharding.is_fully_replicated)
    if total and kept > total / 2:
        print(f"warning: ZeRO stage 3 leaves {kept / total:.0%} of the parameters ({kept:,} of {total:,} "
              f"elements) replicated on every device: tensors under "
              f"zero_optimization.stage3_param_persistence_threshold = {threshold:,} elements are not "
              f"partitioned; set it lower in the config (e.g. 0) to partition them")


def main(argv=None):
    args = parse_args(argv)
    from zerojax.launch.distributed import init_distributed

    init_distributed()  # several processes (zerojax launch, srun, ...): before any device use
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    # Each process feeds only its rows: the data loader splits every global batch by
    # jax.process_index(). Progress and prints come from process 0 only.
    quiet = jax.process_index() != 0
    if quiet:
        sys.stdout = open(os.devnull, "w")
    import zerojax
    from zerojax.checkpoint import files as checkpoint_files
    from zerojax.planning.ceiling import ceiling_is_stable, measure_matmul_ceiling
    from zerojax.train.monitor import SpeedMeter
    from zerojax.config import read_source as read_config
    from zerojax.train.monitor import check_monitors
    from zerojax.models.gpt2 import flops_per_token
    from zerojax.precision import compute_dtype

    gpu = jax.default_backend() == "gpu"
    size = args.model if args.model != "auto" else ("large" if gpu else "tiny")
    steps = args.steps if args.steps is not None else (100 if gpu else 300)

    # the checkpoint folder first: leftovers of a killed save, and what a resumed run continues
    saved, notes, meta = {}, [], None
    if args.save:
        for path in checkpoint_files.remove_interrupted_saves(args.save):
            print(f"removed {path}: left by an interrupted save (the checkpoint it was writing never "
                  f"finished; `latest` still names the one before)")
    if args.resume:
        from zerojax.checkpoint.state import read_meta

        meta = read_meta(args.save)
        saved = ((meta.get("client_state") or {}).get("gpt2_large_example") or {})
        if not saved:
            notes.append("the checkpoint records no run settings (not saved by this example): "
                         "schedule, lr and seed come from the flags")
    schedule_steps = _from_checkpoint("schedule_steps", "--schedule-steps", args.schedule_steps, saved,
                                      max(steps, 1), notes)  # steps 0: the schedule is never used
    seed = _from_checkpoint("seed", "--seed", args.seed, saved, 0, notes)

    hf = None  # GPT-2's checkpoint tensors; a Llama-family checkpoint is read once the model's settings are known
    if args.hf_checkpoint:
        kind = hf_model_type(args.hf_checkpoint)
        if kind == "gpt2":
            from zerojax.models.hf import load_hf
            config, hf = load_hf(args.hf_checkpoint)
            choice = ModelChoice("gpt2", config, "hf", f"GPT-2 from {args.hf_checkpoint}")
        else:
            from zerojax.models.hf_llama import config_from_hf
            with open(os.path.join(args.hf_checkpoint, "config.json")) as f:
                config = config_from_hf(json.load(f))
            choice = ModelChoice("llama", config, "hf", f"{kind} from {args.hf_checkpoint}")
        if os.path.exists(os.path.join(args.hf_checkpoint, "tokenizer.json")):
            args.tokenizer = args.tokenizer or args.hf_checkpoint  # the folder: its chat template too
    else:
        choice = named_model(size)
    if meta is not None:  # the checkpoint's model, before anything is built
        choice = _checkpoint_model(meta, args, choice)
    size, family = choice.size, choice.family
    seq_len = args.seq_len if args.seq_len is not None else min(1024, choice.max_positions)
    if seq_len > choice.max_positions and family == "gpt2":
        raise ConfigMismatch(f"--seq-len {seq_len}: GPT-2 has {choice.max_positions} positions")
    lr_default = 1e-4 if args.hf_checkpoint else 1e-3 if size == "tiny" or size.startswith("tiny-") else 3e-4
    lr = _from_checkpoint("lr", "--lr", args.lr, saved, lr_default, notes)

    micro = args.micro_batch if args.micro_batch not in (None, "auto") else (8 if gpu else 4)
    fill = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.grad_accum,
        "optimizer.params.lr": lr, "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0.0, "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": max(1, schedule_steps // 10),
        "scheduler.params.total_num_steps": schedule_steps,
        "gradient_clipping": 1.0,
    }
    raw, precision, precision_why = resolve_precision(read_config(args.config), args.precision, jax.devices()[0])
    # hidden_size: the ZeRO bucket / persistence "auto"s as the Hugging Face Trainer fills them
    cfg = zerojax.load_config(raw, fill=fill, hidden_size=choice.config.n_embd, name=args.config)
    if cfg.optimizer is None:
        # DeepSpeed then expects a client optimizer (deepspeed.initialize(optimizer=...)), as the
        # Hugging Face Trainer supplies; ours is AdamW with the flags' lr.
        print(f"{args.config} has no optimizer section: using AdamW(lr={lr})")
        cfg = zerojax.load_config({**cfg.to_dict(), "optimizer": {"type": "AdamW", "params": {"lr": lr}}},
                                  world_size=cfg.world_size)

    if cfg.fp16.enabled and not gpu:
        if args.precision == "fp16":
            raise ConfigMismatch("--fp16: XLA does not run fp16 matrix products on CPU ('F16_F16_F32' is not "
                                 "supported by dot_general); use --bf16 or --fp32 here, or --fp16 on a GPU")
        raise ConfigMismatch(f"{args.config} enables fp16 (fp16.enabled: true), whose matrix products XLA does "
                             f"not run on CPU ('F16_F16_F32' is not supported by dot_general); use a GPU, or "
                             f"a bf16 config such as configs/zero2_bf16.json")
    check_monitors(cfg)  # a monitor that cannot start (e.g. wandb not installed): now, not after the build
    dtype = compute_dtype(cfg)
    lora_cfg = lora_settings(args, cfg, dtype, saved.get("lora"))  # LoRA's refusals: before the data and the model
    if args.resume and saved:
        _check_lora_resume(args, saved.get("lora"), lora_cfg, notes)
    # read (and refuse) the data before anything is compiled
    data = load_data(args, choice, seq_len, cfg.train_batch_size, notes)
    remat = args.remat
    remat_why = "--remat"
    if remat is None:
        ac = cfg.activation_checkpointing
        remat = zerojax.config.remat_policy_for(cfg) or "none"
        remat_why = ("the config has no activation_checkpointing section" if ac is None else
                     "the config's activation_checkpointing section")
    remat = None if remat == "none" else remat
    loss_fn = _loss_fn(args.loss_chunk, family)

    def build(remat_policy):  # a randomly initialised model (the planner's and the offload probe's too)
        if lora_cfg is None:
            return choice.build(seed, dtype, remat_policy)
        # LoRA: the base drawn in its stored dtype (an fp32 Llama-3.1-8B would not fit a 24 GB
        # card before it is cast), the adapters applied: what the planner compiles is what runs
        from zerojax import lora
        base_dtype = lora_cfg.get("base_dtype") or dtype
        return lora.apply(choice.build(seed, dtype, remat_policy, param_dtype=base_dtype), lora_cfg)

    if lora_cfg is not None:  # the adapters' shapes, and LoRA's refusals (e.g. nf4 on a layer whose size
        from zerojax import lora  # is not a multiple of its block), before anything is compiled

        try:
            shaped = nnx.eval_shape(functools.partial(build, remat))
        except ValueError as e:
            if isinstance(e, zerojax.ConfigError):
                raise
            raise ConfigMismatch(f"LoRA on {choice.label}: {e}") from None
        lora_targets, lora_trained = shaped.adapter.targets, lora.trainable_count(shaped)
        del shaped
    planned = False
    if args.micro_batch == "auto" or (args.micro_batch is None and
                                      raw.get("train_micro_batch_size_per_gpu") == "auto"):
        planned_remat = remat
        # the planner varies remat unless --remat or the config's remat_policy names one
        named = args.remat is not None or getattr(cfg.activation_checkpointing, "remat_policy", None) is not None
        cfg, remat = _plan_micro_batch(cfg, build, dtype, remat, not named, seq_len, loss_fn,
                                       _requested_options(args), lora=lora_cfg is not None)
        planned = True
        if remat != planned_remat:
            remat_why = "chosen by the planner (micro-batch auto)"
    if meta is not None and _batch_note(meta, cfg):
        notes.append(_batch_note(meta, cfg))
    _print_run(args, cfg, choice.label, size, steps, schedule_steps, lr, lr_default, precision, precision_why,
               remat, remat_why, seq_len, data, saved, notes, filled=_filled_autos(raw, fill, cfg), lora=lora_cfg)
    make_model = functools.partial(build, remat)
    loop, loop_why = (args.offload_loop, "--offload-loop") if args.offload_loop else _offload_loop_auto(
        cfg, make_model, seq_len, loss_fn)
    # FLOPs a token for MFU: GPT-2's own count; other models' from zerojax.model (their parameter tree)
    if family == "gpt2":
        from zerojax.models.gpt2 import num_params

        fpt, n_params = flops_per_token(choice.config, seq_len), num_params(choice.config)
    else:
        from zerojax.model import model_dims

        dims = model_dims(nnx.eval_shape(lambda: choice.build(seed, dtype, remat)))  # the whole model's
        fpt, n_params = dims.flops_per_token(seq_len), dims.params
    if lora_cfg is not None:  # a frozen base takes no weight gradients: 2 of its 6 FLOPs a parameter
        fpt -= 2.0 * n_params
    if hf is not None:
        from zerojax.models.hf import gpt2_from_params
        model = gpt2_from_params(choice.config, hf, dtype=dtype, remat_policy=remat)
    elif args.hf_checkpoint:  # Llama family: read tensor by tensor (fp32 storage), computing in dtype
        from zerojax.models import from_hf
        # (with LoRA: the frozen base read straight into its stored dtype, never whole in fp32)
        base_dtype = (lora_cfg.get("base_dtype") or dtype) if lora_cfg is not None else None
        model = from_hf(args.hf_checkpoint, dtype=base_dtype, remat_policy=remat)
        model.dtype = np.dtype(dtype)
    elif lora_cfg is not None and lora_cfg.get("quantize") and gpu:
        # QLoRA: the base drawn on the host, each kernel quantized on the device as it arrives, so
        # the device never holds the unquantized base (lora.apply's `device`)
        with jax.default_device(jax.devices("cpu")[0]):
            model = lora.apply(choice.build(seed, dtype, remat, param_dtype=dtype), lora_cfg,
                               device=jax.devices()[0])
    else:  # built shard by shard on the devices, never whole on one
        model = make_model
    if lora_cfg is not None:
        from zerojax import lora

        if isinstance(model, nnx.Module) and getattr(model, "adapter", None) is None:  # read from a folder
            model = lora.apply(model, lora_cfg)
        print(f"LoRA: rank {lora_cfg['r']}, alpha {lora_cfg['lora_alpha']:g}, targets "
              f"{', '.join(lora_targets)}; {lora_trained:,} trained parameters, the base "
              f"frozen" + (f" and stored {lora_cfg['quantize']}" if lora_cfg.get("quantize") else
                           f" in {lora_cfg['base_dtype']}"))
    options = _engine_options(args, cfg, loop, planned)
    # MFU's denominator: --peak-tflops, else the matmul ceiling in the run's precision, measured
    # before the engine holds any memory (its buffers are freed); none where no step is timed (the
    # first one compiles), nor on CPU, where the measured rate is not stable (zerojax.planning.ceiling)
    peak, peak_why = args.peak_tflops, "--peak-tflops"
    if peak is None:
        if steps < 2:
            peak_why = "no MFU (fewer than 2 steps: none is timed)"
        elif not ceiling_is_stable():
            peak_why = ("no MFU on CPU: its matmul rate varies from run to run, so there is no ceiling to "
                        "measure against (--peak-tflops gives one)")
        else:
            peak = measure_matmul_ceiling(dtype=dtype)["ceiling_tflops"]
            peak_why = f"the {np.dtype(dtype).name} matmul ceiling measured here"
    engine = zerojax.shard(model, cfg, loss_fn=loss_fn, options=options)
    del model, hf
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats and "bytes_limit" in stats:
        print(f"device memory after building: {stats['bytes_in_use'] / 2**30:.2f} GiB in use of "
              f"{stats['bytes_limit'] / 2**30:.2f} (build peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f})")
    _warn_replicated(engine, cfg)
    if engine.offload_settings and cfg.zero_optimization.offload_optimizer.device == "cpu":
        o = engine.offload_settings
        print(f"optimizer offload: {o['loop']} loop, {o['chunks']} layer group(s), "
              f"master {'split (bf16 copy + 16-bit host remainder)' if o.get('split_master') else 'fp32'}, "
              f"first moment {engine.options.adam_mu_dtype or 'fp32'}" + (f" ({loop_why})" if loop_why else ""))

    start = 0
    if args.resume:
        path, _ = engine.load_checkpoint(args.save)
        start = engine.global_steps
    batches = data.train_batches(cfg.train_batch_size, seed=seed, start_step=start,
                                 num_steps=max(0, steps - start))
    if args.resume:
        epoch, k = divmod(start, data.steps_per_epoch)
        print(f"resumed from {path} at step {start} (data position: batch {start}, i.e. epoch {epoch} "
              f"batch {k} of {data.steps_per_epoch}, seed {seed})")
        if start >= steps:
            print(f"the checkpoint is at step {start} >= --steps {steps}: nothing to train "
                  f"(raise --steps to continue)")

    n_dev = jax.device_count()
    kind = jax.devices()[0].device_kind
    # from shapes: under offload `master_params` merges every host chunk on the device (32 GB at 8B)
    trained = sum(x.size for x in jax.tree.leaves(engine.layout.abstract_master))
    whole = trained if lora_cfg is None else sum(  # LoRA: the frozen base's too
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: choice.build(seed, dtype, remat)),
                                                                 nnx.Param)))
    print(f"{choice.label} ({whole / 1e6:.1f}M params" + (f"; LoRA: {trained:,} trained" if lora_cfg else "") + "), "
          f"{n_dev} x {kind}, ZeRO stage {cfg.zero_optimization.stage}, {dtype.name if hasattr(dtype, 'name') else dtype}, "
          f"batch {cfg.train_batch_size} = {cfg.train_micro_batch_size_per_gpu} x {cfg.gradient_accumulation_steps} "
          f"x {cfg.world_size}, seq {seq_len}, remat {remat}; " + (
              f"MFU against {peak:.3g} TFLOP/s per device ({peak_why})" if peak else peak_why)
          + "; tokens/s are per device, steps that compile excluded")

    # one definition of speed (zerojax.train.monitor.SpeedMeter): tokens/s per device over the steps
    # that compiled nothing, in the progress bar, the log lines and the SUMMARY alike
    meter = SpeedMeter(cfg.train_batch_size * seq_len, n_dev, fpt, peak)
    # a progress bar on a terminal; elsewhere (a log file, a pipe) one line every 10 steps
    interactive = not quiet and sys.stderr.isatty()
    bar = tqdm(batches, total=max(0, steps - start), initial=0, desc="train", dynamic_ncols=True,
               disable=not interactive)
    losses = []  # device scalars, read once at the end (no host sync per step)
    began = time.perf_counter()  # the training loop's wall time, compiles included: the closing line's
    for i, batch in enumerate(bar):
        meter.before_step()
        metrics = engine.train_step(batch)
        losses.append(metrics["loss"])
        meter.after_step(metrics["loss"])
        if (i + 1) % 10 == 0 or i == steps - start - 1:
            meter.sync(metrics["loss"])
            post = {"loss": f"{float(metrics['loss']):.3f}"}
            if meter.tokens_per_s_per_device is not None:
                post["tok/s/device"] = f"{meter.tokens_per_s_per_device:,.0f}"
            if meter.mfu is not None:
                post["MFU"] = f"{100 * meter.mfu:.1f}%"
            stats = jax.local_devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                post["mem"] = f"{stats['peak_bytes_in_use'] / 2**30:.1f}GiB"
            if interactive:
                bar.set_postfix(post)
            elif not quiet:
                print(f"step {start + i + 1}/{steps}: loss {post['loss']}"
                      + (f", {post['tok/s/device']} tokens/s per device" if "tok/s/device" in post else "")
                      + (f", MFU {post['MFU']}" if "MFU" in post else "")
                      + (f", peak memory {post['mem']}" if "mem" in post else ""), flush=True)
    engine.synchronize()
    jax.block_until_ready(engine.state)
    bar.close()
    train_seconds = time.perf_counter() - began
    losses = [float(x) for x in losses]
    summary = {"model": size, "family": family, "config": os.path.basename(args.config), "devices": n_dev,
               "stage": cfg.zero_optimization.stage, "train_batch_size": cfg.train_batch_size,
               "seq_len": seq_len, "remat": remat, "precision": precision, "start_step": start,
               "steps": steps, "schedule_steps": schedule_steps, "lr": lr,
               "master_split": engine.layout.master_split, "trained_params": int(trained),
               "lora": lora_cfg, "train_seconds": round(train_seconds, 2)}
    if meter.tokens_per_s_per_device is not None:
        summary["tokens_per_s_per_device"] = round(meter.tokens_per_s_per_device)
    if meter.mfu is not None:
        summary["mfu"] = round(meter.mfu, 4)
        summary["mfu_against_tflops"] = float(f"{peak:.3g}")
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        summary["peak_gib_device0"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
    host_peak = _host_peak_rss()
    if host_peak is not None:  # offload's state lives there: the host's share of "never an OOM"
        summary["host_peak_rss_gib"] = round(host_peak / 2**30, 2)
        print(f"host peak RSS {host_peak / 2**30:.2f} GiB (this process, building included)")

    val_losses = [float(engine.eval_step(batch))
                  for _, batch in zip(range(args.eval_batches), data.val_batches(cfg.train_batch_size))]
    if val_losses:
        v = float(np.mean(val_losses))
        print(f"validation loss {v:.4f}, perplexity {math.exp(min(v, 50)):.2f}")
    if losses:
        print(f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(engine.memory_report())
    summary.update(first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   losses=losses, val_loss=float(np.mean(val_losses)) if val_losses else None)
    # for programs (benchmarks/ and the tests grep `^SUMMARY `); people get the closing line below
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.summary_json and not quiet:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=1)

    if args.save and (losses or not args.resume):  # a resumed run that trained nothing changed nothing
        before = set(checkpoint_files.finalized_tags(args.save))
        client_state = {"gpt2_large_example": {"schedule_steps": schedule_steps, "lr": lr, "seed": seed,
                                               "lora": lora_cfg}}
        path = engine.save_checkpoint(args.save, client_state=client_state, keep=args.keep)
        print(f"checkpoint saved: {path}")
        removed = sorted(before - set(checkpoint_files.finalized_tags(args.save)))
        if removed:
            print(f"--keep {args.keep}: removed the older checkpoint(s) {', '.join(removed)}")
    if args.export_hf:
        export_hf(args, engine, choice, lora_cfg)
    engine.close()
    print(closing_line(summary), flush=True)  # last: what people read of a run
    return summary


def closing_line(summary: dict) -> str:
    """The run in one line for people, from its SUMMARY: steps and time, loss first -> last,
    speed, validation loss, device peak."""
    losses, start = summary["losses"], summary["start_step"]
    if not losses:
        parts = [f"no training step (at global step {start})"]
    else:
        parts = [f"trained {len(losses)} step{'s' if len(losses) != 1 else ''}"
                 + (f" ({start} -> {start + len(losses)})" if start else "")
                 + f" in {summary['train_seconds']:.1f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}"]
    if summary.get("tokens_per_s_per_device") is not None:
        parts.append(f"{summary['tokens_per_s_per_device']:,} tokens/s per device")
    if summary.get("mfu") is not None:
        parts.append(f"MFU {100 * summary['mfu']:.1f}%")
    if summary.get("val_loss") is not None:
        parts.append(f"validation loss {summary['val_loss']:.2f}")
    if summary.get("peak_gib_device0") is not None:
        parts.append(f"peak {summary['peak_gib_device0']:.1f} GiB")
    elif summary.get("host_peak_rss_gib") is not None:  # CPU: its devices report no peak
        parts.append(f"host peak {summary['host_peak_rss_gib']:.1f} GiB")
    return ", ".join(parts)


def _print_run(args, cfg, label, size, steps, schedule_steps, lr, lr_default, precision, precision_why,
               remat, remat_why, seq_len, data, saved, notes, filled=(), lora=None):
    """The run as resolved from flags, config and checkpoint, printed once before any compile."""
    sched = cfg.to_dict().get("scheduler")
    sched_text = "none (constant lr)" if not sched else (
        f"{sched['type']} " + ", ".join(f"{k}={v}" for k, v in sorted((sched.get("params") or {}).items())))
    lr_why = ("--lr" if args.lr is not None else "saved with the checkpoint" if "lr" in saved
              else f"default for {'--hf-checkpoint' if args.hf_checkpoint else size}; --lr to change")
    sched_why = ("--schedule-steps" if args.schedule_steps is not None else
                 "saved with the checkpoint" if "schedule_steps" in saved else
                 "= --steps" if steps else "unused: no training step")
    data_name = args.data or "the embedded corpus"
    print(f"run: {label}, config {args.config}, ZeRO stage {cfg.zero_optimization.stage}")
    print(f"  steps:     {'resume, then ' if args.resume else ''}train until global step {steps}"
          + (" (0: no training, evaluation only)" if steps == 0 else ""))
    print(f"  schedule:  {sched_text}  [length {schedule_steps}: {sched_why}]")
    print(f"  lr:        {lr:g} ({lr_why}){'  (0: the weights will not change)' if lr == 0 else ''}")
    print(f"  precision: {precision} ({precision_why}; --bf16 / --fp16 / --fp32)")
    print(f"  remat:     {remat or 'none'} ({remat_why})")
    print(f"  batch:     train_batch_size {cfg.train_batch_size} = micro-batch "
          f"{cfg.train_micro_batch_size_per_gpu} x accumulation {cfg.gradient_accumulation_steps} x "
          f"{cfg.world_size} data-parallel; seq {seq_len}: {cfg.train_batch_size * seq_len:,} tokens/step")
    print(f"  data:      {data_name}: {data.n_train:,} {data.what}, {data.n_val:,} validation rows")
    if lora:
        print(f"  lora:      " + ", ".join(f"{k}={json.dumps(v)}" for k, v in lora.items()
                                          if v not in (None, False) or k in ("r", "lora_alpha")))
    if filled:
        print(f"  auto:      {', '.join(filled)}")
    total = (((sched or {}).get("params") or {}).get("total_num_steps"))
    if isinstance(total, int) and steps > total:
        import zerojax

        end = float(zerojax.build_schedule(cfg)(steps - 1))  # the lr of this run's last update
        notes.append(f"--steps {steps} runs past the schedule's {total} steps ({sched_why}): past its end the "
                     f"lr stays at {end:g}{' (the weights stop changing)' if end == 0 else ''}; to extend the "
                     f"schedule, add "
                     f"--schedule-steps {steps} (with --resume too: the lr then follows a {steps}-step "
                     f"schedule from the checkpoint's step on)")
    for note in notes:
        print(f"  note:      {note}")


if __name__ == "__main__":
    from zerojax.checkpoint.state import CheckpointError
    from zerojax.config import ConfigError
    from zerojax.data.text import DataError
    from zerojax.planning.memory import HeldMemoryError, WillNotFitError
    from zerojax.train.monitor import MonitorError

    try:
        main()
    except (ConfigError, ConfigMismatch, NoPlanFits, DataError, CheckpointError, WillNotFitError,
            HeldMemoryError, FileNotFoundError, FloatingPointError, MonitorError) as e:
        # the message names the key / file / step and the fix: no traceback needed
        sys.exit(f"error: {e}")
