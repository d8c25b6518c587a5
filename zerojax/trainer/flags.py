"""The training run's flags (`zerojax train`, examples/gpt2_large.py): one parser, its checks.

Values are checked where they are read: a number out of range, a flag that needs another, is an
argparse error naming it, before anything is imported that is slow.
"""
from __future__ import annotations

import argparse
import os
import sys

from zerojax.arg_types import mlp_tile as _mlp_tile
from zerojax.arg_types import number as _number

# the default --config: DeepSpeed's ZeRO-2 with bf16 and "auto" batch / lr keys, in the checkout
DEFAULT_CONFIG = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "zero2_bf16.json"))


def _learning_rate(text):
    """--lr's value: a number the config's learning-rate keys also accept (finite, >= 0, held by
    float32: `zerojax.config.learning_rate_problem`); 0 keeps the weights fixed."""
    from zerojax.config import learning_rate_problem  # no jax: zerojax.config imports none

    value = _number(float)(text)
    why = learning_rate_problem(value)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return value


def _seq_len(text):
    return "auto" if text == "auto" else _number(int, 2, note=" (a row of T tokens gives T-1 predictions)")(text)


def _micro_batch(text):
    return "auto" if text == "auto" else _number(int, 1, note=" (or auto)")(text)


# Flags whose value may be negative: argparse reads "-1e-3" as an option (its negative-number rule
# misses exponents), so "--lr -1e-3" is rewritten "--lr=-1e-3" and the type checks then say why
# a negative value is refused, instead of "expected one argument".
_VALUE_FLAGS = ("--eval-every", "--save-every", "--steps", "--schedule-steps", "--seq-len", "--grad-accum", "--lr",
                "--loss-chunk",
                "--eval-batches", "--sample-tokens", "--seed", "--peak-tflops", "--keep", "--micro-batch", "--lora",
                "--lora-alpha",
                "--mlp-tile")

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


DESCRIPTION = """Train or fine-tune GPT-2 or a Llama-family model (any registered family) with a DeepSpeed config.

    zerojax train --model tiny --steps 200                                   # CPU: a tiny GPT-2
    zerojax train --hf-checkpoint ./Llama-3.2-1B-Instruct --data chat.jsonl --lora 16 --export-hf out

--model names a registered family's shape (random init); --hf-checkpoint reads a local Hugging Face
folder with its tokenizer. Without --data it trains on an embedded corpus (Python's documentation).
--data takes .txt or .jsonl ({"text"}, {"prompt", "completion"}, {"messages"}: the loss on the
completion / assistant turns only)."""


def parse_args(argv=None, *, prog=None, description=None):
    p = argparse.ArgumentParser(prog=prog, description=description or DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="a DeepSpeed JSON config (its \"auto\" values are filled from the flags below)")
    _add_model_and_data_flags(p)
    _add_training_flags(p)
    _add_save_and_lora_flags(p)
    _add_memory_flags(p)
    _add_report_flags(p)
    args = p.parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    _check_flag_pairs(p, args)
    return args


def _add_model_and_data_flags(p) -> None:
    """What is trained and on what: --model / --hf-checkpoint, --method, --data, --tokenizer."""
    from zerojax import methods  # no jax: the methods import their code when they run
    from zerojax.models import registry

    families = registry.families().values()
    model_choices = ("auto", *registry.shape_names())
    p.add_argument("--model", default="auto", choices=model_choices, metavar="NAME",
                   help="the model, randomly initialised: a named shape of a registered family (" + "; ".join(
                       f"{f.label}: {', '.join(f.shapes)}" for f in families) + "; tiny-*: test shapes with a "
                        "byte vocabulary); auto = GPT-2 large on a GPU, tiny on CPU (on --resume the checkpoint's)")
    p.add_argument("--hf-checkpoint", metavar="DIR",
                   help="local Hugging Face folder (config.json, model.safetensors or its shards) of a registered "
                        "family (model_type " + ", ".join(registry.hf_model_types()) + "); its tokenizer is used")
    p.add_argument("--method", default="sft", metavar="NAME",
                   help="the training method: sft (next-token loss, the default), module:object (your own "
                        "zerojax.methods.Method, imported from the working folder first; docs/extending.md), "
                        "or a registered one (zerojax.methods), each a loss and a data reader (--data): " + "; ".join(
                            f"{m.name}: {m.what}" for m in methods.methods().values()))
    p.add_argument("--method-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of --method (repeatable; VALUE read as JSON, else as text), e.g. "
                        "--method-option beta=0.2 --method-option loss_type=ipo")
    p.add_argument("--data", help=".txt / .jsonl file or folder; .jsonl fine-tuning records {\"prompt\", "
                                  "\"completion\"} or {\"messages\"} train on the completion / assistant "
                                  "turns only; {\"text\"} records are cut into --seq-len blocks as .txt is; "
                                  "default: the embedded corpus")
    p.add_argument("--pad", action="store_true",
                   help="fine-tuning .jsonl: one example a row, padded (default: examples packed into rows, "
                        "kept apart by segment ids; GPT-2, which has none, is always padded)")
    p.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json, tokenizer_config.json with the chat "
                                       "template) or tokenizer.json (default: the checkpoint's, else byte-level)")


def _add_training_flags(p) -> None:
    """How long and how: steps, schedule, sequence, batch, lr, precision, remat, MLP tile."""
    from zerojax.config import REMAT_POLICY_NAMES  # no jax: zerojax.config imports none

    p.add_argument("--steps", type=_number(int, 0, note=" (0 = no training, evaluation only)"), default=None,
                   help="train until this global optimizer step (default 300 on CPU, 100 on GPU); with "
                        "--resume the run continues from the checkpoint's step up to it")
    p.add_argument("--schedule-steps", type=_number(int, 1), default=None,
                   help="length of the lr schedule (fills scheduler total_num_steps \"auto\"; warmup "
                        "is 10%% of it); default: --steps, or on --resume the length saved with the "
                        "checkpoint")
    p.add_argument("--seq-len", type=_seq_len, default=None,
                   help="tokens per row (default 1024; tiny: 128), or auto = the longest row that fits the device "
                        "and the host memory (compiled peaks, found before anything is allocated; a multiple of 128; "
                        "at --micro-batch N, or at micro-batch 1 with --micro-batch auto)")
    p.add_argument("--micro-batch", type=_micro_batch, default=None,
                   help="fills train_micro_batch_size_per_gpu \"auto\" (a number also replaces a value the config "
                        "sets; the run header says so): a number, or auto = the largest "
                        "that fits the device (XLA's compiled peak, found before anything is allocated); "
                        "default 8 on a GPU, 4 on CPU")
    p.add_argument("--grad-accum", type=_number(int, 1), default=None,
                   help="fills gradient_accumulation_steps \"auto\" (default 1), and replaces a value the config "
                        "sets (the run header says so)")
    p.add_argument("--lr", type=_learning_rate, default=None,
                   help="the learning rate, >= 0 (0 keeps the weights fixed): fills the optimizer / scheduler lr "
                        "\"auto\", and replaces a value the config sets there (the run header says so) (default 1e-3 "
                        "tiny, 3e-4 others, 1e-4 from --hf-checkpoint; on --resume the checkpoint's)")
    # said once for the three flags: what decides the precision (resolve_precision, default_precision)
    precision = p.add_argument_group(
        "precision", "A flag decides: it replaces the config's fp16 / bf16 enabled (--bf16 over a shipped fp16\n"
        "config turns its fp16 section off; the run header says so). Without one the config decides where\n"
        "it sets enabled: true: the default config, configs/zero2_bf16.json, sets bf16, so a run\n"
        "without --config trains in bf16, on CPU too. Where the config leaves it open (enabled \"auto\",\n"
        "or no fp16 / bf16 section): bf16 on a GPU that has it, fp32 on CPU."
    ).add_mutually_exclusive_group()
    for name in ("bf16", "fp16", "fp32"):
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help=f"train in {name}, whatever the config's fp16 / bf16 sections enable")
    # the names object itself, not a list of it: its membership takes "<name>_<k>" too (dots_24, segments_4)
    p.add_argument("--remat", choices=REMAT_POLICY_NAMES, default=None,
                   help="activation checkpointing per layer (default: from the config's "
                        "activation_checkpointing section: its remat_policy, else cpu_checkpointing -> "
                        "offload, else full); segments / offload_segments: two-level, every k-th layer input "
                        "kept (on the device / in host memory), a segment's k rebuilt in the backward, k near "
                        "sqrt(layers), or segments_<k> / offload_segments_<k>; dots_<k>: dots on k layers")
    p.add_argument("--mlp-tile", type=_mlp_tile, default=None, metavar="N|auto",
                   help="run each layer's MLP N positions of the row at a time (ALST's tiled MLP: the "
                        "[batch, seq, intermediate] activations held one piece at a time, the MLP's forward "
                        "rerun in the backward; models with mlp_tile, the Llama family); auto = the planner "
                        "of --micro-batch auto chooses (a tile on long rows, where the tiled step is the fastest "
                        "that fits); default: untiled")


def _add_save_and_lora_flags(p) -> None:
    """Checkpoints and exports; LoRA adapters and the quantized base."""
    p.add_argument("--save", help="checkpoint folder (orbax); saved at the end")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save")
    p.add_argument("--keep", type=_number(int, 1), default=None,
                   help="after saving, delete all but the newest N checkpoints in --save, never the "
                        "one `latest` names (Hugging Face's save_total_limit); default: keep all")
    p.add_argument("--export-hf", metavar="DIR",
                   help="write the trained model as a Hugging Face folder (transformers' from_pretrained "
                        "loads it; the checkpoint's tokenizer files copied in); with LoRA: PEFT's adapter "
                        "folder naming --hf-checkpoint as its base (peft.AutoPeftModelForCausalLM.from_pretrained), "
                        "see --merge")
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
                        "plain Hugging Face folder in the dtype the --hf-checkpoint folder stores) and "
                        "DIR/adapter the PEFT adapter")


def _add_memory_flags(p) -> None:
    """The knobs that trade memory for speed beyond the config (zerojax.EngineOptions)."""
    from zerojax.options import OFFLOAD_LOOPS  # no jax: zerojax.options imports none

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
    p.add_argument("--ep-size", type=_number(int, 1), default=1,
                   help="expert parallelism for a mixture-of-experts model (DeepSpeed-MoE's ep_size, "
                        "zerojax.EngineOptions.ep_size): its experts split over this many devices, tokens "
                        "sent to them by all-to-all within groups of this many devices; 1 = off, else a "
                        "divisor of the data-parallel size and of num_experts")
    p.add_argument("--master-split", action="store_true",
                   help="keep the fp32 master as the bf16 params + an int16 remainder on the device "
                        "(zerojax.EngineOptions(split_master=\"on\")): 2 bytes a parameter less, the same "
                        "training but for exact ties (one fp32 ulp); needs bf16; under optimizer offload to cpu "
                        "it splits the host copy (the host loop does by default), not with NVMe)")


def _add_report_flags(p) -> None:
    """What the run reports and when: summary, evaluation, samples, periodic saves, seed, MFU."""
    p.add_argument("--summary-json", metavar="PATH",
                   help="also write the run's SUMMARY (settings, every loss, speed, memory: the JSON of the "
                        "`SUMMARY {...}` line, which lists the losses only for a run of at most 20 steps) to PATH")
    p.add_argument("--eval-batches", type=_number(int, 0), default=8,
                   help="validation batches (of train_batch_size rows, from the held-out part of the "
                        "data) evaluated after training; 0 = no validation")
    p.add_argument("--eval-every", type=_number(int, 1), default=None, metavar="N",
                   help="also evaluate --eval-batches validation batches every N training steps")
    p.add_argument("--sample-prompts", metavar="FILE",
                   help="print the model's greedy answers to these prompts (a .jsonl of {\"prompt\": text or "
                        "chat messages}, or one prompt a line; at most 16) at each evaluation and at the end, "
                        "generated from the live weights")
    p.add_argument("--sample-tokens", type=_number(int, 1), default=64, metavar="N",
                   help="new tokens of each --sample-prompts answer (default 64)")
    p.add_argument("--save-every", type=_number(int, 1), default=None, metavar="N",
                   help="also save a checkpoint to --save every N training steps (--keep prunes them)")
    p.add_argument("--seed", type=_number(int, 0), default=None,
                   help="init and data-order seed (default 0; on --resume the checkpoint's)")
    p.add_argument("--peak-tflops", type=_number(float, 0.0, above=True), default=None,
                   help="per-device TFLOP/s that MFU is reported against (default on a GPU / TPU: the "
                        "matmul ceiling in the run's precision, measured at start, zerojax.planning.ceiling; "
                        "a datasheet peak is never reached; on CPU no MFU is reported without this flag)")
    # read (and removed) by run_cli before parsing, listed here for --help
    p.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error (default: one error: line, exit status 1)")


def _check_flag_pairs(p, args) -> None:
    """Flags that need another flag: argparse's error line (exit status 2) naming both."""
    if args.keep is not None and not args.save:
        p.error("--keep needs --save DIR (the checkpoint folder to prune)")
    if args.save_every and not args.save:
        p.error("--save-every needs --save DIR (the checkpoint folder)")
    if args.resume and not args.save:
        p.error("--resume needs --save DIR (the checkpoint folder to continue from)")
    for item in args.method_option:
        if "=" not in item:
            p.error(f"--method-option {item!r}: write KEY=VALUE (e.g. beta=0.2)")
    if args.method_option and args.method == "sft":
        p.error("--method-option needs --method NAME (sft has no options)")
    if args.merge and not args.export_hf:
        p.error("--merge needs --export-hf DIR (where the merged model is written)")


def method_options(items) -> dict:
    """--method-option KEY=VALUE items -> {key: value}, each VALUE read as JSON where it is JSON."""
    import json

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out
