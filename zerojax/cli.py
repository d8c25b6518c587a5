"""The `zerojax` command. One subcommand per `_add_<name>(subparsers)` function in `COMMANDS`.

    zerojax estimate --model large --gpus 2                       # DeepSpeed + ZeRO-paper formulas
    zerojax estimate --model qwen3-0.6b --gpus 8                  # a Llama-family shape
    zerojax estimate --model mypkg.models:build --gpus 8          # any model: a factory of an nnx.Module
    zerojax estimate --model large --gpus 1 --aot --budget 24GB   # + compiled peaks and plans
    zerojax estimate --model tiny --gpus 2 --aot --cpu --budget 12MB --micro-batch auto --json
    zerojax estimate --params 2851e6 --largest-layer 32e6 --gpus 8
    zerojax plan --model xl --devices 4 --search-mesh --budget 139GiB --global-batch 64  # mesh shapes
    zerojax export runs/ckpt hf_out --dtype bf16                  # consolidated weights
    zerojax train --model tiny --steps 200 --config configs/zero2_bf16.json   # the trainer (zerojax.trainer)
    zerojax launch --num_procs 2 train.py --config ds.json        # several processes (zerojax.launch.launcher)
    zerojax generate --hf-checkpoint DIR --prompt "Once upon" --max-new-tokens 64   # text from a checkpoint
    zerojax chat --hf-checkpoint DIR                              # a conversation on stdin (its chat template)
    zerojax serve --hf-checkpoint DIR --port 8000                 # an OpenAI-compatible server (the serve extra)

A new subcommand is a function `_add_<name>(subparsers)` that adds its parser and sets
`func=<handler(args) -> exit code>`, appended to COMMANDS.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

from zerojax import arg_types, model_arg
from zerojax._moved import renamed
from zerojax.model_arg import (  # noqa: F401 - resolve_model and its kin keep their old path, zerojax.cli
    DEFAULT_SEQ,
    MODEL_ACCEPTS,
    FlagError,
    ModelArgError,
    family_factory,
    max_positions,
    resolve_model,
)
from zerojax.planning import estimate

# the commands' ModelChoice is zerojax.model_arg's, the one the trainer uses too
__getattr__ = renamed(__name__, {"ModelChoice": "zerojax.model_arg.ModelChoice"})

MODEL_HELP = f"the model: {MODEL_ACCEPTS}; default large (GPT-2)"


def _add_estimate(sub):
    p = sub.add_parser(
        "estimate", help="memory needed per device: DeepSpeed's formulas, compiled peaks, a plan",
        description="Model-state memory by DeepSpeed's estimators and the ZeRO paper's table; with "
                    "--aot the exact per-device peak of the compiled training step for each stage "
                    "and a plan of the (stage, offload, micro-batch, remat) choices that fit a budget.")
    p.add_argument("--model", default="large", help=MODEL_HELP)
    p.add_argument("--params", type=arg_types.number(float, 0.0, above=True),
                   help="total parameters instead of --model (formulas only)")
    p.add_argument("--largest-layer", type=arg_types.number(float, 0.0, above=True),
                   help="largest layer's parameters (ZeRO-3 formula; with --params)")
    p.add_argument("--gpus", type=arg_types.number(int, 1), default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=arg_types.number(int, 1), default=1, help="nodes (default 1)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this ZeRO stage")
    p.add_argument("--budget", help="device memory budget, e.g. 24GB or 22GiB (default: the "
                                    "device's bytes_limit; required on CPU for a plan)")
    p.add_argument("--aot", action="store_true",
                   help="compile the real step (allocates nothing) for compiled peaks and a plan")
    p.add_argument("--config", help="DeepSpeed JSON config to start from (default: bf16 AdamW)")
    _add_seq_flag(p, auto=True)
    p.add_argument("--micro-batch", default="8", type=_micro_batch_arg,
                   help="micro-batch per device, or 'auto': every divisor of the rows per device "
                        "per step (the config's batch keys, else 8), accumulation raised to keep "
                        "them (default 8)")
    p.add_argument("--remat", choices=("both", "on", "off", "offload"), default="both",
                   help="activation checkpointing to plan over: both = none and full (default), "
                        "on = full, off = none, offload = none, full and offload (block inputs in "
                        "host memory)")
    _add_mlp_tile_flag(p)
    p.add_argument("--max-plans", type=arg_types.number(int, 1), default=3, help="plans to find (default 3)")
    p.add_argument("--no-plan", action="store_true", help="with --aot: compiled peaks only")
    _add_engine_option_flags(p, "with --aot: ")
    p.add_argument("--cpu", action="store_true",
                   help="compile on --gpus x --nodes virtual CPU devices (shapes only; CPU and GPU "
                        "compilers differ, so peaks are indicative)")
    _add_hardware_flags(p)
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="also write the results as JSON to FILE; without FILE, JSON on stdout "
                        "(the tables then go to stderr)")
    p.set_defaults(func=cmd_estimate)


def _add_seq_flag(p, *, auto: bool) -> None:
    """--seq / --seq-len: a length, or (auto, estimate's) 'auto', the longest row that fits."""
    help_ = f"sequence length (default: the model's maximum positions, else {DEFAULT_SEQ})"
    if auto:
        help_ += (", or auto (with --aot): the longest row whose compiled step fits --budget and the host memory, a "
                  "multiple of 128, at --micro-batch (auto: 1), the --stage (else the config's), the --remat "
                  "choice that holds the least; the rest of the estimate then runs at it")
    p.add_argument("--seq", "--seq-len", dest="seq", type=_seq_arg if auto else arg_types.number(int, 1),
                   default=None, help=help_)


def _seq_arg(text: str):
    """--seq's value: 'auto' or an int >= 1."""
    return "auto" if text == "auto" else arg_types.number(int, 1)(text)


def _micro_batch_arg(text: str) -> str:
    """--micro-batch's value, checked when parsed: 'auto' or an int >= 1 (kept as text)."""
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: 'auto' or a whole number >= 1 (rows per device)")


def _add_mlp_tile_flag(p):
    """--mlp-tile, shared by estimate and plan; its value checked as `zerojax train`'s is."""
    p.add_argument("--mlp-tile", type=arg_types.mlp_tile, default="auto", metavar="N|auto",
                   help="the tiled MLP to plan (models taking mlp_tile, the Llama family: the [batch, seq, "
                        "intermediate] activations held one piece at a time, the MLP's forward rerun in the "
                        "backward): auto (default) = untiled, and on rows longer than 2048 positions also the row "
                        "in equal pieces of at most 2048; N = N positions a piece only")


def _mlp_tile_of(args):
    """--mlp-tile as the planner takes it: None (auto: the planner's own choices) or N."""
    return None if args.mlp_tile == "auto" else args.mlp_tile


def _check_mlp_tile(args, choice) -> None:
    """ModelArgError (one line naming the flag and the fix) for --mlp-tile N on a model without a
    tiled MLP; auto plans such a model as built."""
    if args.mlp_tile == "auto":
        return
    from zerojax.planning.planner import factory_kwargs

    if "mlp_tile" not in factory_kwargs(choice.factory, mlp_tile=args.mlp_tile):
        raise ModelArgError(f"--mlp-tile {args.mlp_tile}: {choice.label} has no tiled MLP (its model takes no "
                            "mlp_tile); drop --mlp-tile, or plan a Llama-family model")


def _say_plan(say, i, p) -> None:
    """A plan's line and its config keys; a tiled MLP, a model-build keyword, is said beside them."""
    from zerojax.planning.planner import is_tiled

    tile = (f"\n     and build the model with mlp_tile={p.mlp_tile} (zerojax train --mlp-tile {p.mlp_tile})"
            if is_tiled(p.mlp_tile) else "")
    say(f"  {i}. {p.describe()}\n     {json.dumps(p.config_patch())}{tile}")


def _add_hardware_flags(p):
    """The step-time model's throughputs (`estimate.Hardware`), shared by estimate and plan."""
    hw = estimate.Hardware()
    p.add_argument("--matmul-flops", type=arg_types.number(float, 0.0, above=True), default=hw.matmul_flops,
                   help=f"16-bit matmul ceiling per device for predicted speed (default "
                        f"{hw.matmul_flops:.3g}, measured on an H200)")
    p.add_argument("--host-bandwidth", type=arg_types.number(float, 0.0, above=True), default=hw.host_bytes_per_s,
                   help=f"host<->device bytes/s (default {hw.host_bytes_per_s:.3g}, measured PCIe)")
    p.add_argument("--interconnect-bandwidth", type=arg_types.number(float, 0.0, above=True),
                   default=hw.interconnect_bytes_per_s,
                   help=f"collective bytes/s per device (default {hw.interconnect_bytes_per_s:.3g})")


def _add_engine_option_flags(p, when=""):
    """The EngineOptions that change a step's memory, shared by estimate and plan."""
    p.add_argument("--master-split", action="store_true",
                   help=f"{when}plan as zerojax.EngineOptions(split_master='on') runs (bf16, no offload: the "
                        "fp32 master kept as the bf16 params + an int16 remainder, 2 bytes a parameter less)")
    p.add_argument("--adam-mu-dtype", choices=("bfloat16",), default=None,
                   help=f"{when}plan as EngineOptions(adam_mu_dtype=...) runs (Adam's first moment stored in "
                        "bf16: 2 bytes a parameter less)")


def _engine_options_of(args, cfg: dict):
    """The EngineOptions the flags ask for, checked against the config: --master-split with a config
    that fixes fp16 or fp32 compute is refused (FlagError naming the keys), as the example and the
    engine refuse it, instead of planning silently without the split. A config leaving the precision
    to "auto" keeps it: the split then applies to the bf16 candidates."""
    from zerojax.options import EngineOptions

    if args.master_split:
        fp16, bf16 = (cfg.get(k) or {} for k in ("fp16", "bf16"))
        bf16 = bf16 or cfg.get("bfloat16") or {}  # DeepSpeed's old name
        enabled = fp16.get("enabled"), bf16.get("enabled")
        if "auto" not in enabled and (enabled[0] is True or enabled[1] is not True):
            raise FlagError(
                f"--master-split needs bf16 compute (the fp32 master kept as the bf16 params + an int16 "
                f"remainder); {args.config or 'the config'} has fp16.enabled {enabled[0]}, bf16.enabled "
                f"{enabled[1]}: set bf16.enabled true (or \"auto\") or drop --master-split")
    return EngineOptions(split_master="on" if args.master_split else "auto", adam_mu_dtype=args.adam_mu_dtype)


def _hardware(args) -> estimate.Hardware:
    return estimate.Hardware(matmul_flops=args.matmul_flops, host_bytes_per_s=args.host_bandwidth,
                             interconnect_bytes_per_s=args.interconnect_bandwidth)


def _add_plan(sub):
    p = sub.add_parser(
        "plan", help="rank mesh shapes (data x tensor x pipe), ZeRO stages and micro-batches for N devices",
        description="The planner's mesh search: for --devices N, every data x tensor x pipe split the model "
                    "allows (tensor sizes dividing the heads and MLP width; pipe sizes dividing "
                    "the layers), each ZeRO stage (pipelines: 0 and 1) and micro-batch x accumulation of the "
                    "global batch, ranked by predicted tokens/s per device among those whose peak fits "
                    "--budget. Peaks: the formula (estimate.mesh_peak_bytes, calibrated on one compiled "
                    "GPU step) unless --aot compiles the real step. Prints the config keys to set.")
    p.add_argument("--model", default="large", help=MODEL_HELP)
    p.add_argument("--config", help="DeepSpeed JSON config to start from (default: bf16 AdamW)")
    _add_seq_flag(p, auto=False)
    p.add_argument("--devices", type=arg_types.number(int, 1), required=True,
                   help="devices to split (e.g. 4 GPUs of a node)")
    p.add_argument("--search-mesh", action="store_true",
                   help="search tensor and pipe sizes too (default: data-parallel only, the mesh "
                        "`zerojax.shard` builds for a config without tensor_parallel / pipeline)")
    p.add_argument("--budget", help="device memory budget, e.g. 139GiB (default: the device's bytes_limit "
                                    "with --aot; required otherwise)")
    p.add_argument("--global-batch", type=arg_types.number(int, 1),
                   help="rows per optimizer step (default: the config's train_batch_size, else micro x "
                        "accumulation x devices)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this ZeRO stage")
    p.add_argument("--micro-batch", default="auto", type=_micro_batch_arg,
                   help="auto (default: every divisor) or an int")
    p.add_argument("--remat", choices=("on", "off"), default="off",
                   help="the model's per-layer activation checkpointing (default off)")
    _add_mlp_tile_flag(p)
    p.add_argument("--aot", action="store_true", help="compile each candidate's real step for its peak")
    p.add_argument("--cpu", action="store_true", help="with --aot: compile on --devices virtual CPU devices")
    p.add_argument("--max-compiles", type=arg_types.number(int, 1), default=12,
                   help="with --aot: compiles to spend (default 12)")
    p.add_argument("--top", type=arg_types.number(int, 1), default=10, help="plans to print (default 10)")
    _add_engine_option_flags(p)
    _add_hardware_flags(p)
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="also write plans and what was tried as JSON to FILE (without FILE: stdout)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    if args.aot and (args.cpu or os.environ.get("JAX_PLATFORMS", "") == "cpu"):
        _virtual_cpu_devices(args.devices)
    if not args.budget and not args.aot:
        raise FlagError("--budget is required without --aot (e.g. --budget 139GiB for an H200)")
    out = sys.stderr if args.json == "-" else sys.stdout
    say = lambda *a: print(*a, file=out)  # noqa: E731

    from zerojax.planning import mesh_search as mesh_plan
    from zerojax.planning.memory import device_budget, fmt_bytes, parse_bytes

    cfg = _load_base_config(args)
    choice = _model_of(args, cfg)
    factory, seq = choice.factory, choice.seq_len(args.seq)
    remat = "full" if args.remat == "on" else None
    if remat:
        from zerojax.planning.planner import factory_kwargs

        if "remat_policy" not in factory_kwargs(factory, remat=remat):
            raise FlagError(f"--remat on needs a model factory taking remat_policy=; {choice.name} takes none "
                            "(use --remat off)")
        factory = functools.partial(factory, remat_policy=remat)
    budget = parse_bytes(args.budget) if args.budget else device_budget()
    if budget is None:
        raise FlagError("the device reports no memory limit (CPU); pass --budget")
    one = None if args.search_mesh else [1]
    try:
        model = mesh_plan.mesh_model_of(factory, seq)
    except ValueError as e:
        raise FlagError(f"--model {args.model}: {e}") from None
    found = mesh_plan.search_mesh(
        factory, cfg, budget, seq, devices=args.devices, global_batch=args.global_batch,
        stages=(args.stage,) if args.stage is not None else (0, 1, 2, 3), micro_batch=args.micro_batch,
        tensor_sizes=one, pipe_sizes=one, compile=args.aot, remat=remat, hardware=_hardware(args),
        max_compiles=args.max_compiles, model=model, options=_engine_options_of(args, cfg),
        mlp_tile=_mlp_tile_of(args))
    say(f"{choice.label}, seq {seq}, {args.devices} devices, budget {fmt_bytes(budget)} per device; "
        f"peaks {'compiled' if args.aot else 'by formula (estimate.mesh_peak_bytes; --aot compiles)'}; "
        "fastest predicted first:")
    for i, p in enumerate(found.plans[:args.top], 1):
        _say_plan(say, i, p)
    if not found.plans:
        say("  nothing fits: more devices, a shorter sequence, a smaller global batch or --remat on")
    for shape, why in found.refused:
        say(f"  not a choice: data {shape[0]} x tensor {shape[1]} x pipe {shape[2]}: {why}")
    result = {"model": choice.name, "seq_len": seq, "devices": args.devices, "budget_bytes": budget,
              "peak_source": "compiled" if args.aot else "estimated",
              "plans": [p.to_dict() for p in found.plans],
              "tried": [{"plan": p.to_dict(), "outcome": o} for p, o in found.tried],
              "refused": [{"data": s[0], "tensor": s[1], "pipe": s[2], "why": w} for s, w in found.refused]}
    _write_json(args.json, result)
    return 0


def _add_export(sub):
    p = sub.add_parser(
        "export", help="a training checkpoint as a Hugging Face folder (weights, tokenizer, generation config)",
        description="A checkpoint's master weights as its family's Hugging Face folder with the run's tokenizer "
                    "files and pad_token_id (transformers loads it offline; no registered family: flat safetensors). "
                    "Reads no optimizer state. A LoRA checkpoint is refused with the command that writes its adapter.")
    p.add_argument("checkpoint", metavar="CKPT", help="the --save folder of a training run")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--tag", help="checkpoint tag (default: the one named in CKPT/latest)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="saved dtype (default fp32)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    if not os.path.isdir(args.checkpoint):  # before jax is imported: a mistyped path says so at once
        raise FlagError(f"CKPT {args.checkpoint}: no such folder ({os.path.abspath(args.checkpoint)}); give the "
                        "--save folder of a training run")
    from zerojax.trainer.run_folder import export_run

    print(export_run(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype))
    return 0


def _add_launch(sub):
    # listed for --help only: main() hands `launch ...` to zerojax.launch.launcher before parsing, since its
    # arguments end with the user's script and that script's own flags
    sub.add_parser("launch", add_help=False,
                   help="start a multi-process / multi-node run (DeepSpeed's launcher flags)")


def _add_train(sub):
    # for --help only: main() hands `train ...` to the trainer's own parser (zerojax.trainer.flags)
    sub.add_parser("train", add_help=False,
                   help="train or fine-tune a model with a DeepSpeed config (`zerojax train --help`)")


def _add_generation_flags(p):
    p.add_argument("--hf-checkpoint", required=True, metavar="DIR",
                   help="a Hugging Face folder (GPT-2, Llama, Mistral, Qwen2, Qwen3; safetensors + tokenizer.json), or "
                        "the --save folder of a training run (its weights and its run's tokenizer)")
    p.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder, applied (not merged)")
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer folder (default: --hf-checkpoint)")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="weights and compute (auto: bf16 on a GPU, else fp32)")
    p.add_argument("--max-new-tokens", type=arg_types.number(int, 1), default=256, metavar="N")
    p.add_argument("--temperature", type=arg_types.number(float, 0.0), default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=arg_types.number(int, 1), default=None)
    p.add_argument("--top-p", type=arg_types.number(float, 0.0, above=True), default=None)
    p.add_argument("--repetition-penalty", type=arg_types.number(float, 0.0, above=True), default=None)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    # zerojax.generation.decoder.DECODE_ATTENTIONS, spelled out: this module imports no jax until a command runs
    p.add_argument("--decode-attention", choices=("auto", "xla", "kernel"), default="xla",
                   help="a decode step's attention: XLA's products, one fused Pallas kernel, or auto (the kernel on "
                   "one GPU where it takes the model's shape; docs/generation.md)")


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a Hugging Face checkpoint (KV-cache decoder)",
                       description="Generate a continuation of --prompt with zerojax's decoder (docs/generation.md).")
    _add_generation_flags(p)
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT", help="a prompt (repeatable: a batch)")
    p.set_defaults(func=cmd_generate)


def _add_chat(sub):
    p = sub.add_parser("chat", help="chat with a Hugging Face checkpoint on stdin (its chat template)",
                       description="Reads a line from stdin per user turn, keeps the conversation, prints the "
                                   "assistant's reply; exits on end of input or /exit.")
    _add_generation_flags(p)
    p.add_argument("--system", metavar="TEXT", help="a system message first")
    p.set_defaults(func=cmd_chat)


def check_model_folder(path: str) -> None:
    """--hf-checkpoint's folder, checked before jax is imported (zerojax.local_files): a missing path,
    or a PEFT adapter folder, whose base goes to --hf-checkpoint and itself to --adapter."""
    from zerojax.local_files import model_folder_problem

    problem = model_folder_problem(path, lambda base: "give its base model to --hf-checkpoint and this folder to "
                                                      f"--adapter: --hf-checkpoint {base} --adapter {path}")
    if problem:
        raise FlagError(problem)


def _generation_setup(args):
    """(model, tokenizer, generate keyword arguments) from the generation flags."""
    check_model_folder(args.hf_checkpoint)  # before jax is imported
    from zerojax.trainer.run_folder import model_folder_of

    folder = model_folder_of(args.hf_checkpoint)  # a training checkpoint: exported (weights, tokenizer) first
    import jax
    import jax.numpy as jnp

    from zerojax import lora
    from zerojax.models import from_hf, load_tokenizer

    dtype = args.dtype if args.dtype != "auto" else ("bf16" if jax.default_backend() == "gpu" else "fp32")
    dtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    model = from_hf(folder, dtype)
    model.dtype = jnp.dtype(dtype)  # compute in the weights' dtype
    if args.adapter:
        model = lora.load_peft(model, args.adapter)
    tokenizer = load_tokenizer(args.tokenizer or folder)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, repetition_penalty=args.repetition_penalty, stop=args.stop, seed=args.seed,
                  tokenizer=tokenizer, decode_attention=args.decode_attention)
    return model, tokenizer, kwargs


def cmd_generate(args) -> int:
    model, _, kwargs = _generation_setup(args)  # the folder checked before jax is imported
    from zerojax.generation import generate

    for text in generate(model, args.prompt, **kwargs).texts:
        print(text, flush=True)
    return 0


def cmd_chat(args) -> int:
    model, tokenizer, kwargs = _generation_setup(args)  # the folder checked before jax is imported
    from zerojax.generation.api import chat, check_chat_template

    check_chat_template(tokenizer)  # before the first line is read

    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt = lambda: sys.stdin.isatty() and print("> ", end="", file=sys.stderr, flush=True)  # noqa: E731
    prompt()
    for line in iter(sys.stdin.readline, ""):  # (a line at a time: `for line in sys.stdin` reads ahead)
        if line.strip() == "/exit":
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = chat(model, messages, **kwargs).texts[0]
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
        prompt()
    return 0


def _add_serve(sub):
    from zerojax.serving.cli import add_serve_flags, main  # imports no jax until it runs

    p = sub.add_parser("serve",
                       help="an OpenAI-compatible server with continuous batching (pip install -e \".[serve]\")",
                       description="Serve a checkpoint over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics (docs/serving.md).")
    add_serve_flags(p)
    p.set_defaults(func=main)


COMMANDS = [_add_estimate, _add_plan, _add_export, _add_train, _add_launch, _add_generate, _add_chat, _add_serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerojax", description="zerojax: DeepSpeed's ZeRO memory toolkit on JAX/Flax")
    parser.add_argument("--debug", action="store_true",  # read by main() before parsing, here for --help
                        help="show the Python traceback of an error (default: one error: line, exit status 1); "
                             "before or after the command")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    """The command; a user's mistake ends in one `error:` line (exit status 1), Ctrl-C in one line
    (130), --debug (before or after the subcommand) shows the traceback (zerojax.trainer.exits)."""
    from zerojax.trainer.exits import DEBUG_FLAG, run_command, split_debug

    argv = sys.argv[1:] if argv is None else list(argv)
    head = next((i for i, a in enumerate(argv) if a != DEBUG_FLAG), len(argv))  # --debug before the subcommand
    debug, argv = head > 0, argv[head:]
    if argv[:1] == ["launch"]:  # the rest is the user's script and its flags: a --debug there is theirs
        from zerojax.launch.launcher import main as launch

        return run_command(lambda: launch(argv[1:]), debug)
    if argv[:1] == ["train"]:
        from zerojax.trainer import run_cli

        return run_cli(argv[1:] + [DEBUG_FLAG] * debug, prog="zerojax train")
    argv, debug_after = split_debug(argv)
    args = build_parser().parse_args(argv)
    return run_command(lambda: args.func(args), debug or debug_after)


# ---------------------------------------------------------------------------------------------
# estimate


def default_config(micro_batch=8) -> dict:
    """The DeepSpeed config the estimate and the benchmarks use unless given one."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
    }


# where a model (or its .config) may say its maximum positions, by the names projects give it


def _model_of(args, cfg_dict) -> model_arg.ModelChoice:
    """resolve_model for the command, --mlp-tile checked against the model (ModelArgError: one line)."""
    choice = resolve_model(args.model, cfg_dict)
    _check_mlp_tile(args, choice)
    return choice


def _describe_dims(dims, shape=None) -> str:
    layers = (shape.layers if shape is not None else 0) or dims.layers
    parts = [f"{layers} layers" if layers else "layers unknown", f"width {dims.d_model}"]
    if dims.heads:
        kv = f", {dims.kv_heads} kv" if dims.kv_heads and dims.kv_heads != dims.heads else ""
        parts.append(f"{dims.heads} heads x {dims.head_dim}{kv}")
    if dims.mlp:
        parts.append(f"MLP {dims.mlp}")
    parts.append(f"vocabulary {dims.vocab}")
    return ", ".join(parts)


def cmd_estimate(args) -> int:
    n_devices = args.gpus * args.nodes
    if (args.master_split or args.adam_mu_dtype) and not args.aot:
        raise FlagError("--master-split / --adam-mu-dtype change the compiled step: add --aot")
    if args.seq == "auto" and (not args.aot or args.params):
        raise FlagError("--seq auto compiles the step to find the longest row: add --aot, with --model")
    if args.aot and (args.cpu or os.environ.get("JAX_PLATFORMS", "") == "cpu"):
        _virtual_cpu_devices(n_devices)
    # with JSON on stdout, the human-readable tables go to stderr
    out = sys.stderr if args.json == "-" else sys.stdout
    say = lambda *a: print(*a, file=out)  # noqa: E731

    result: dict = {"gpus_per_node": args.gpus, "nodes": args.nodes}
    if args.params:
        total = int(args.params)
        largest = int(args.largest_layer or 0)
        if args.aot:
            raise FlagError("--aot needs --model (a model to compile), not --params")
        if args.mlp_tile != "auto":
            raise FlagError("--mlp-tile needs --model (a model whose MLP it tiles), not --params")
    else:
        from flax import nnx

        from zerojax.model import model_dims
        from zerojax.planning.memory import count_params
        from zerojax.planning.planner import model_shape

        cfg0 = _load_base_config(args)
        choice = _model_of(args, cfg0)
        if args.seq == "auto":
            result["longest"] = _longest_row(args, say, choice, n_devices)
            args.seq = result["longest"]["seq_len"]
        model = nnx.eval_shape(choice.factory)
        total, largest = count_params(model)
        if args.largest_layer:
            largest = int(args.largest_layer)
        dims, seq = model_dims(model), choice.seq_len(args.seq)
        shape = model_shape(model, seq)
        say(f"{choice.label}: {_describe_dims(dims, shape)}; "
            f"{estimate.train_flops_per_token(shape) / 1e9:.3g} GFLOPs per training token at seq {seq}")
        result.update(model=choice.name, seq_len=seq, layers=shape.layers, d_model=dims.d_model, heads=dims.heads,
                      kv_heads=dims.kv_heads, head_dim=dims.head_dim, vocab=dims.vocab, mlp=dims.mlp,
                      flops_per_token=estimate.train_flops_per_token(shape))
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    rows = estimate.formula_rows(total, largest, args.gpus, args.nodes, stages=stages)
    say(estimate.format_formula_table(rows, total, largest, args.gpus, args.nodes))
    result.update(total_params=total, largest_layer_params=largest,
                  formulas=[r.__dict__ for r in rows])
    if not args.params:
        acts = _tile_activations(args, say, choice, shape, dims, cfg0, n_devices)
        if acts:
            result["activations"] = acts

    if args.aot:
        result.update(_estimate_aot(args, say, choice, stages, n_devices))
    _write_json(args.json, result)
    return 0


# --remat's choices (estimate) -> the remat policies planned
REMATS = {"both": (None, "full"), "on": ("full",), "off": (None,), "offload": (None, "full", "offload")}


def _micro_rows(args, cfg, n_devices) -> tuple:
    """(micro, rows): --micro-batch as the planner takes it ("auto" or an int), and the rows a device
    trains in one micro-batch (that int; for auto, the rows per device per step,
    `planner.rows_per_device`)."""
    from zerojax.planning import planner

    micro = args.micro_batch if args.micro_batch == "auto" else int(args.micro_batch)
    return micro, planner.rows_per_device(cfg, n_devices) if micro == "auto" else micro


def _tile_activations(args, say, choice, shape, dims, cfg, n_devices) -> list[dict]:
    """Where the row is one the planner tiles (`planner.mlp_tile_choices`; --mlp-tile N: that tile),
    the activations per device by formula (`estimate.mesh_peak_bytes`, data-parallel over the
    devices) of the untiled MLP beside each tile, for each remat of --remat: what a tile saves,
    before anything compiles. [] (nothing said) where no tile is among the choices."""
    from zerojax.planning import planner

    tiles = [t for t in planner.mlp_tile_choices(choice.factory, _mlp_tile_of(args), shape.seq_len, cfg)
             if planner.is_tiled(t)]
    if not tiles:
        return []
    _, rows = _micro_rows(args, cfg, n_devices)
    precision = planner.configured_precision(cfg)
    say(f"\nActivations per device by formula (estimate.mesh_peak_bytes; seq {shape.seq_len}, micro-batch {rows}, "
        f"{precision}; --aot compiles them):")
    say(f"{'remat':>8} | " + " | ".join(f"{f'MLP tile {t}' if t else 'untiled':>13}" for t in (None, *tiles)))
    out = []
    for remat in REMATS[args.remat]:
        for tile in (None, *tiles):
            peak = estimate.mesh_peak_bytes(shape, heads=dims.heads, vocab=dims.vocab, micro_batch=rows,
                                            n_data=n_devices, precision=precision, remat=remat, mlp_tile=tile)
            out.append({"remat": remat, "mlp_tile": tile, "micro_batch": rows, "bytes": peak["activations"]})
        row = out[-len(tiles) - 1:]
        say(f"{remat or 'none':>8} | " + " | ".join(f"{estimate.fmt_bytes(r['bytes']):>13}" for r in row))
    return out


def _write_json(where, result) -> None:
    """--json: "-" prints `result` to stdout, a path writes it there, None does nothing."""
    if where == "-":
        print(json.dumps(result, indent=2, default=str))
    elif where:
        with open(where, "w") as f:
            json.dump(result, f, indent=2, default=str)


def _virtual_cpu_devices(n: int) -> None:
    """Before jax is imported: compile on n virtual CPU devices (one per GPU of the plan)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()


def _load_base_config(args) -> dict:
    """--config as a plain dict, read as load_config reads it (its errors name the file); else the default."""
    if not args.config:
        return default_config()
    from zerojax.config import read_source

    return json.loads(json.dumps(read_source(args.config)))


def _aot_mesh(n_devices):
    """The data-parallel mesh --aot compiles on: the first n_devices devices jax sees."""
    import jax

    from zerojax.sharding.partition import make_mesh

    if jax.device_count() < n_devices:
        raise FlagError(f"--aot for {n_devices} devices but jax sees {jax.device_count()} "
                         f"({jax.default_backend()}); run on the GPUs or add --cpu")
    return make_mesh(data=n_devices, devices=jax.devices()[:n_devices])


def _longest_row(args, say, choice, n_devices) -> dict:
    """--seq auto: the planner's longest row (`planner.longest_row`) under --budget (else the
    device's limit) and the host memory; said, and returned as the JSON's "longest"."""
    from zerojax.planning import planner
    from zerojax.planning.memory import device_budget, parse_bytes

    budget = parse_bytes(args.budget) if args.budget else device_budget()
    if budget is None:
        raise FlagError("--seq auto: the device reports no memory limit (CPU); pass --budget, e.g. 24GB")
    cfg = _load_base_config(args)
    if args.stage is not None:
        cfg = planner.merge_config(cfg, {"zero_optimization": {"stage": args.stage}})
    micro = 1 if args.micro_batch == "auto" else int(args.micro_batch)
    tile = planner.AS_BUILT if args.mlp_tile == "auto" else args.mlp_tile
    remat = REMATS[args.remat][-1]  # the choice that holds the least reaches the longest row
    try:
        found = planner.longest_row(choice.factory, cfg, budget, micro_batch=micro, cap=choice.position_cap,
                                    remat=remat, precision=planner.precision_choices(cfg, choice.factory)[0],
                                    mesh=_aot_mesh(n_devices), options=_engine_options_of(args, cfg), mlp_tile=tile)
    except planner.NoRowFits as e:
        raise FlagError(f"--seq auto: {e}") from None
    say(f"Longest row (--seq auto; micro-batch {micro}, remat {remat or 'none'}, ZeRO stage "
        f"{(cfg.get('zero_optimization') or {}).get('stage', 0)}): {found.describe()}; {found.compiles} compiles")
    return {**found.to_dict(), "micro_batch": micro, "remat": remat}


def _estimate_aot(args, say, choice, stages, n_devices) -> dict:
    import jax

    from zerojax.planning import planner
    from zerojax.planning.memory import device_budget, fmt_bytes, parse_bytes

    mesh = _aot_mesh(n_devices)
    cfg = _load_base_config(args)
    options = _engine_options_of(args, cfg)
    factory, seq = choice.factory, choice.seq_len(args.seq)
    budget = parse_bytes(args.budget) if args.budget else device_budget()
    remats = REMATS[args.remat]
    micro, rows = _micro_rows(args, cfg, n_devices)
    precision = planner.precision_choices(cfg, factory)[0]
    hardware = _hardware(args)
    out: dict = {"seq_len": seq, "budget_bytes": budget, "backend": jax.default_backend(),
                 "compiled": []}

    if args.no_plan or budget is None:
        # compiled peaks without a plan: no offload, micro-batch = the rows per step
        say(f"\nCompiled training step per device ({jax.default_backend()}, {n_devices} "
            f"device(s), seq {seq}, micro-batch {rows}):")
        tiles = planner.mlp_tile_choices(factory, _mlp_tile_of(args), seq, cfg)
        shown = any(planner.is_tiled(t) for t in tiles)

        def tile_cell(text):  # a tile column only where a tile is planned
            return f" {text:>8}" if shown else ""

        say(f"{'stage':>5} {'remat':>8}{tile_cell('MLP tile')} | {'peak':>11} | {'args':>10} | {'temp':>10} | "
            f"{'host':>10}")
        for stage in stages:
            for r, t in itertools.product(remats, tiles):
                try:
                    m = planner.step_memory(factory, planner.zero_choice(cfg, stage, "none", 1.0),
                                            seq, rows, remat=r, precision=precision, grad_accum=1,
                                            mesh=mesh, options=options, mlp_tile=t)
                except NotImplementedError as e:
                    say(f"  (unavailable: {e})")
                    return out
                say(f"{stage:>5} {r or 'none':>8}{tile_cell(t or 'none')} | {fmt_bytes(m.peak):>11} | "
                    f"{fmt_bytes(m.argument):>10} | {fmt_bytes(m.temp):>10} | {fmt_bytes(m.host_peak):>10}")
                out["compiled"].append({"stage": stage, "remat": r, "mlp_tile": t, "micro_batch": rows, **m.to_dict()})
    if budget is None:
        say("\nNo plan: the device reports no memory limit (CPU); pass --budget, e.g. 24GB.")
        return out
    if args.no_plan:
        return out
    say(f"\nPlans under {fmt_bytes(budget)} per device, fastest predicted first (step time: FLOPs "
        f"with recompute at {hardware.matmul_flops:.3g} FLOP/s, collectives, host copies):")

    def progress(p, outcome):
        print(f"  tried {p.describe()} -> {outcome}", file=sys.stderr)

    found = planner.search(factory, cfg, budget, seq, stages=stages, remat=remats,
                           micro_batch=micro, batch_rows=rows, mesh=mesh, hardware=hardware,
                           max_plans=args.max_plans, on_result=progress, options=options,
                           mlp_tile=_mlp_tile_of(args))
    for i, p in enumerate(found.plans, 1):
        _say_plan(say, i, p)
    if not found.plans:
        say("  nothing fits: more devices, a shorter sequence, or a smaller model")
    out["plans"] = [p.to_dict() for p in found.plans]
    out["tried"] = [{"plan": p.to_dict(), "outcome": o} for p, o in found.tried]
    out["compiled"] = [{"plan": p.describe(), "peak": p.peak_bytes} for p, o in found.tried
                       if o in ("fits", "does not fit")]
    return out


if __name__ == "__main__":
    sys.exit(main())
