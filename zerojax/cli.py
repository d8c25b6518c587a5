"""The `zerojax` command. One subcommand per `_add_<name>(subparsers)` function in `COMMANDS`.

    zerojax estimate --model large --gpus 2                       # DeepSpeed + ZeRO-paper formulas
    zerojax estimate --model large --gpus 1 --aot --budget 24GB   # + compiled peaks and a plan
    zerojax estimate --params 2851e6 --largest-layer 32e6 --gpus 8
    zerojax export runs/ckpt hf_out --dtype bf16                  # consolidated weights
    zerojax launch --num_procs 2 train.py --config ds.json        # several processes (zerojax.launch)

A new subcommand is a function `_add_<name>(subparsers)` that adds its parser and sets
`func=<handler(args) -> exit code>`, appended to COMMANDS.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

SIZES = ("tiny", "small", "medium", "large", "xl")


def _add_estimate(sub):
    p = sub.add_parser(
        "estimate", help="memory needed per device: DeepSpeed's formulas, compiled peaks, a plan",
        description="Model-state memory by DeepSpeed's estimators and the ZeRO paper's table; with "
                    "--aot the exact per-device peak of the compiled training step for each stage "
                    "and a plan of the (stage, offload, micro-batch, remat) choices that fit a budget.")
    p.add_argument("--model", default="large", help=f"GPT-2 size: {', '.join(SIZES)} (default large)")
    p.add_argument("--params", type=float, help="total parameters instead of --model (formulas only)")
    p.add_argument("--largest-layer", type=float,
                   help="largest layer's parameters (ZeRO-3 formula; with --params)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this ZeRO stage")
    p.add_argument("--budget", help="device memory budget, e.g. 24GB or 22GiB (default: the "
                                    "device's bytes_limit; required on CPU for a plan)")
    p.add_argument("--aot", action="store_true",
                   help="compile the real step (allocates nothing) for compiled peaks and a plan")
    p.add_argument("--config", help="DeepSpeed JSON config to start from (default: bf16 AdamW)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: model's)")
    p.add_argument("--micro-batch", default="8",
                   help="micro-batch per device for compiled peaks, or 'auto' (default 8)")
    p.add_argument("--remat", choices=("both", "on", "off"), default="both",
                   help="activation checkpointing choices to plan over (default both)")
    p.add_argument("--no-plan", action="store_true", help="with --aot: compiled peaks only")
    p.add_argument("--cpu", action="store_true",
                   help=f"compile on {'{gpus}'} virtual CPU devices (shapes only; CPU and GPU "
                        "compilers differ, so peaks are indicative)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(func=cmd_estimate)


def _add_export(sub):
    p = sub.add_parser(
        "export", help="consolidated weights of a checkpoint as safetensors (GPT-2: Hugging Face)",
        description="Write a checkpoint's master weights as one safetensors file: a Hugging Face "
                    "GPT-2 folder (config.json + model.safetensors) when the checkpoint holds "
                    "zerojax's GPT-2, else a flat safetensors file with dotted names. Reads only "
                    "the weights, never the optimizer state.")
    p.add_argument("checkpoint", metavar="CKPT", help="the save_checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--tag", help="checkpoint tag (default: the one named in CKPT/latest)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="saved dtype (default fp32)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from zerojax.checkpoint import export

    try:
        path = export(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"zerojax export: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _add_launch(sub):
    # listed for --help only: main() hands `launch ...` to zerojax.launch before parsing, since its
    # arguments end with the user's script and that script's own flags
    sub.add_parser("launch", add_help=False,
                   help="start a multi-process / multi-node run (DeepSpeed's launcher flags)")


COMMANDS = [_add_estimate, _add_export, _add_launch]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerojax", description="zerojax: DeepSpeed's ZeRO memory toolkit on JAX/Flax")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        from zerojax.launch import main as launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


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


def gpt2_factory(size, cfg_dict, seq=None):
    """model_factory(remat=False) for a GPT-2 size, compute dtype from the config."""
    import jax.numpy as jnp
    from flax import nnx

    from zerojax.models.gpt2 import GPT2, GPT2Config

    config = GPT2Config.named(size)
    dtype = (jnp.bfloat16 if (cfg_dict.get("bf16") or {}).get("enabled")
             else jnp.float16 if (cfg_dict.get("fp16") or {}).get("enabled") else jnp.float32)

    def factory(remat=False):
        return GPT2(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                    remat_policy="full" if remat else None)

    return config, factory


def cmd_estimate(args) -> int:
    n_devices = args.gpus * args.nodes
    if args.aot and (args.cpu or os.environ.get("JAX_PLATFORMS", "") == "cpu"):
        # before jax is imported: one virtual CPU device per GPU of the plan
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n_devices}").strip()
    from zerojax import memory as M

    result: dict = {"gpus_per_node": args.gpus, "nodes": args.nodes}
    if args.params:
        total = int(args.params)
        largest = int(args.largest_layer or 0)
        if args.aot:
            print("--aot needs --model (a model to compile), not --params", file=sys.stderr)
            return 2
    else:
        from flax import nnx

        cfg0 = _load_base_config(args)
        model_cfg, factory = gpt2_factory(args.model, cfg0)
        total, largest = M.count_params(nnx.eval_shape(factory))
        if args.largest_layer:
            largest = int(args.largest_layer)
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    rows = M.formula_rows(total, largest, args.gpus, args.nodes, stages=stages)
    print(M.format_formula_table(rows, total, largest, args.gpus, args.nodes))
    result.update(total_params=total, largest_layer_params=largest,
                  formulas=[r.__dict__ for r in rows])

    if args.aot:
        result.update(_estimate_aot(args, M, factory, model_cfg, stages, n_devices))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


def _load_base_config(args) -> dict:
    if not args.config:
        return default_config()
    import hjson

    with open(args.config) as f:
        return json.loads(json.dumps(hjson.load(f)))


def _estimate_aot(args, M, factory, model_cfg, stages, n_devices) -> dict:
    import jax

    if jax.device_count() < n_devices:
        raise SystemExit(f"--aot for {n_devices} devices but jax sees {jax.device_count()} "
                         f"({jax.default_backend()}); run on the GPUs or add --cpu")
    from zerojax.partition import make_mesh

    mesh = make_mesh(data=n_devices, devices=jax.devices()[:n_devices])
    cfg = _load_base_config(args)
    seq = args.seq or model_cfg.n_positions
    budget = M.parse_bytes(args.budget) if args.budget else M.device_budget()
    remats = {"both": (False, True), "on": (True,), "off": (False,)}[args.remat]
    micro = args.micro_batch if args.micro_batch == "auto" else int(args.micro_batch)
    out: dict = {"seq_len": seq, "budget_bytes": budget, "backend": jax.default_backend(),
                 "compiled": []}

    print(f"\nCompiled training step per device ({jax.default_backend()}, {n_devices} device(s), "
          f"seq {seq}, micro-batch {micro if micro != 'auto' else 8}):")
    print(f"{'stage':>5} {'remat':>6} | {'peak':>11} | {'args':>10} | {'temp':>10} | {'host':>10}")
    for stage in stages:
        for r in remats:
            c = M._with(cfg, **{"zero_optimization.stage": stage})
            try:
                mem = M.step_memory(factory, c, seq, 8 if micro == "auto" else micro, remat=r,
                                    mesh=mesh)
            except NotImplementedError as e:
                print(f"  (unavailable: {e})")
                return out
            print(f"{stage:>5} {('on' if r else 'off'):>6} | {M.fmt_bytes(mem.peak):>11} | "
                  f"{M.fmt_bytes(mem.argument):>10} | {M.fmt_bytes(mem.temp):>10} | "
                  f"{M.fmt_bytes(mem.host_peak):>10}")
            out["compiled"].append({"stage": stage, "remat": r, **mem.to_dict()})

    if args.no_plan:
        return out
    if budget is None:
        print("\nNo plan: the device reports no memory limit (CPU); pass --budget, e.g. 24GB.")
        return out
    print(f"\nPlan under {M.fmt_bytes(budget)} per device: fastest first (cost model: no offload > "
          "partial optimizer offload (ratio) > optimizer offload > param offload; no remat > remat; "
          "larger micro-batch first):")

    def progress(p, fits):
        status = "fits" if fits is True else "does not fit" if fits is False else f"failed: {fits}"
        print(f"  tried {p.describe()} -> {status}", file=sys.stderr)

    plans = M.plan(factory, cfg, budget, seq, stages=stages, remat=remats, micro_batch=micro,
                   mesh=mesh, on_result=progress)
    for i, p in enumerate(plans):
        print(f"  {i + 1}. {p.describe()}  {json.dumps(p.config_patch())}")
    if not plans:
        print("  nothing fits: more devices, a shorter sequence, or a smaller model")
    out["plans"] = [dict(p.__dict__, config_patch=p.config_patch()) for p in plans]
    return out


if __name__ == "__main__":
    sys.exit(main())
