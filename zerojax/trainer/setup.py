"""A training run's settings resolved from flags, config and checkpoint, before anything is built:
precision, the planner's micro-batch, the offload loop, engine options, LoRA settings, the lines
the run prints about them. Errors here name the flag or key and the fix.
"""
from __future__ import annotations

import difflib
import functools
import json
import math
import os

from zerojax import user_code
from zerojax.trainer.errors import ConfigMismatch, NoPlanFits


def loss_fn_for(loss_chunk: int, family):
    """The registered `family`'s loss, computing the logits `loss_chunk` tokens at a time (0: whole)."""
    return family.chunked_loss(loss_chunk) if loss_chunk else family.loss


def training_method(args, lora_cfg):
    """--method and its --method-option settings -> (the registered `zerojax.methods.Method`, the
    user's options, checked; `Method.resolve(options, data)` fills the rest), or (None, {}) for sft
    (the family's next-token loss); refused before anything is read."""
    if args.method == "sft":
        return None, {}
    from zerojax import methods
    from zerojax.trainer.flags import method_options

    try:
        method = user_method(args.method) if user_code.is_spec(args.method) else methods.get(args.method)
    except KeyError:
        names = ["sft", *methods.methods()]
        near = difflib.get_close_matches(args.method.lower(), names, n=1)
        raise ConfigMismatch(f"--method {args.method}: not a training method; choose sft or "
                             f"{', '.join(methods.methods())}, or module:object (your own zerojax.methods.Method; "
                             "docs/extending.md)" + (f"; did you mean {near[0]}?" if near else "")) from None
    options = method_options(args.method_option)  # the user's alone: what the data decides is filled later
    options = {**method.defaults_for(lora_cfg is not None), **options}  # LoRA or the whole model: DPO's reference
    try:
        method.resolve(options)  # unknown keys refused now
    except ValueError as e:
        raise ConfigMismatch(f"--method-option: {e}") from None
    if method.name == "reward" and lora_cfg is not None and args.export_hf:
        raise ConfigMismatch("--export-hf of a LoRA reward model: the Hugging Face sequence-classification export "
                             "takes a whole model; train the reward model without --lora, or save with --save "
                             "and export later")
    return method, options


def user_method(spec: str):
    """--method module:object: a user's own `zerojax.methods.Method`, or a factory (called with no
    arguments) returning one, imported from the working folder first (`zerojax.user_code`)."""
    from zerojax.methods import Method

    fix = "give module:object naming a zerojax.methods.Method (or a function returning one) in the working folder"
    try:
        found = user_code.import_object(spec, f"--method {spec}", fix + " or on PYTHONPATH")
    except ValueError as e:
        raise ConfigMismatch(str(e)) from None
    method = found
    if callable(found) and not isinstance(found, Method):
        try:
            method = found()
        except Exception as e:  # noqa: BLE001 - the user's code: its error, on one line
            first = str(e).splitlines()[0] if str(e) else ""
            raise ConfigMismatch(f"--method {spec}: calling {spec.replace(':', '.')}() failed: "
                                 f"{type(e).__name__}: {first}; {fix}") from None
    if not isinstance(method, Method):
        made = f", which returned a {type(method).__name__}" if method is not found else ""
        raise ConfigMismatch(f"--method {spec}: {spec.replace(':', '.')} is a {type(found).__name__}{made}, not a "
                             f"zerojax.methods.Method; {fix} (docs/extending.md)")
    return method


def check_method(method, options: dict, cfg, data) -> None:
    """The method's own check of its options against the batch and the data (`Method.check`), refused
    in one line naming --method; a batch of no whole groups also names the flags that make it one."""
    if method.check is None:
        return
    try:
        method.check(options, cfg.train_batch_size, data)
    except ValueError as e:
        raise ConfigMismatch(f"--method {method.name}: {e}{group_fix(options.get('group'), cfg)}") from None


def group_fix(group, cfg) -> str:
    """Where train_batch_size is not a multiple of `group` (an RL method's completions per prompt): the
    `zerojax train` flags that make it one, the smallest larger --micro-batch and the largest smaller
    group (--method-option group=N); "" where it is one."""
    rows = cfg.train_batch_size
    if not isinstance(group, int) or group < 1 or rows % group == 0:
        return ""
    unit = cfg.gradient_accumulation_steps * cfg.world_size  # rows a micro-batch row becomes
    step = group // math.gcd(group, unit)
    micro = -(-cfg.train_micro_batch_size_per_gpu // step) * step
    fix = (f"; give --micro-batch {micro} (train_batch_size {micro * unit} = {micro} x accumulation "
           f"{cfg.gradient_accumulation_steps} x {cfg.world_size} data-parallel)")
    smaller = max((g for g in range(2, group) if rows % g == 0), default=None)
    return fix + (f", or --method-option group={smaller}" if smaller else "")


def check_task_data(args, method) -> None:
    """--data naming a built-in RL task (prompts and their reward: zerojax.rl.tasks), or a missing path
    close to one, for a method that trains on files (sft, dpo, reward): one line saying what the
    tasks are and what to give, before anything is read."""
    if not args.data or os.path.exists(args.data) or (method is not None and method.rollouts is not None):
        return
    from zerojax.data.text import DataError
    from zerojax.rl import tasks

    named = args.data in tasks.TASKS
    near = [] if named else difflib.get_close_matches(args.data, list(tasks.TASKS), n=1)
    if not (named or near):
        return  # a missing file: the reader names it
    what = "a built-in RL task" if named else f"no such file or folder ({os.path.abspath(args.data)})"
    hint = f"; did you mean {near[0]}?" if near else ""
    raise DataError(f"--data {args.data}: {what}; the built-in tasks ({', '.join(tasks.TASKS)}{hint}) are prompts "
                    f"and their reward, for --method grpo or ppo; --method {args.method} trains on a file "
                    + ("(.txt or .jsonl; no --data: the embedded corpus)" if method is None else
                       "(.jsonl of its records)"))


def resolve_mlp_tile(args, choice, planner_runs: bool):
    """--mlp-tile checked before anything is built -> (the tile: None = untiled, an int, or "auto"
    for the planner of micro-batch auto to choose; why, "" for a family without a tiled MLP: the
    run header then says nothing of it). Refused in one line: a tile for a family whose model has
    no tiled MLP, and auto where no planner runs."""
    tile, tiles = args.mlp_tile, choice.family_spec.takes("mlp_tile")
    if tile is None:
        return None, "default; --mlp-tile N or auto tiles it" if tiles else ""
    if not tiles:
        raise ConfigMismatch(f"--mlp-tile {tile}: {choice.family_spec.label} has no tiled MLP (its model takes no "
                             f"mlp_tile); drop --mlp-tile, or train a Llama-family model")
    if tile == "auto" and not planner_runs:
        raise ConfigMismatch("--mlp-tile auto: the planner of --micro-batch auto chooses the tile, and this run "
                             "fixes the micro-batch; add --micro-batch auto, or give --mlp-tile N")
    return tile, "--mlp-tile"


def _planner_factory(build, remat, mlp_tile, explore_remat, explore_tile):
    """`build(remat_policy, mlp_tile=...)` as the planner calls it: the planner varies what the
    factory takes as keywords, so only the explored choices are keywords; the others stay the run's."""
    if explore_remat and explore_tile:
        return lambda remat_policy=None, mlp_tile=None: build(remat_policy, mlp_tile=mlp_tile)
    if explore_remat:
        return lambda remat_policy=None: build(remat_policy, mlp_tile=mlp_tile)
    if explore_tile:
        return lambda mlp_tile=None: build(remat, mlp_tile=mlp_tile)
    return lambda: build(remat, mlp_tile=mlp_tile)


def plan_micro_batch(cfg, build, dtype, remat, explore_remat, seq_len, loss_fn, options, lora=False, batch_fn=None,
                     mlp_tile=None):
    """train_micro_batch_size_per_gpu "auto": the planner's fastest choice that fits the device
    (zerojax.planning.planner: remat, MLP tile, micro-batch x accumulation keeping the global batch,
    stage, offload; compiled before anything is allocated, with the run's EngineOptions:
    --master-split and --adam-mu-dtype hold less). Unless --remat or the config names a policy,
    the remat choices are none and the planner's measured ladder (dots ... full); mlp_tile "auto"
    (--mlp-tile auto): the planner's tile choices, else the tile is kept. `build(remat_policy,
    mlp_tile=...)` -> the model (GPT-2 or Llama; with LoRA its adapters applied). -> (config,
    remat, tile); the tile is "auto" still where no planner ran (the device reports no limit)."""
    import zerojax
    from zerojax.planning import planner
    from zerojax.planning.memory import device_budget

    budget = device_budget()
    if budget is None:
        print(f"micro-batch auto: this device reports no memory limit; using "
              f"{cfg.train_micro_batch_size_per_gpu}")
        return cfg, remat, mlp_tile
    explore_tile = mlp_tile == "auto"
    factory = _planner_factory(build, remat, mlp_tile, explore_remat, explore_tile)
    # LoRA: the frozen base is in what the planner compiles; parameter offload is not among its
    # choices (its time estimate prices the trained parameters' transfers, not a frozen base moved
    # a layer at a time); a config that asks for offload_param gets it
    offloads = tuple(o for o in planner.DEFAULT_OFFLOADS if not lora or o != "param")
    found = planner.search(factory, cfg.to_dict(), budget, seq_len, loss_fn=loss_fn, max_plans=1, offloads=offloads,
                           batch_fn=batch_fn,
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
    hint = offload_hint(best, planner.model_shape(factory, seq_len).params, cfg.world_size, options, dtype)
    if hint:
        print(hint)
    cfg = zerojax.load_config(best.apply(cfg.to_dict()), world_size=cfg.world_size)
    return cfg, (best.remat if explore_remat else remat), (best.mlp_tile if explore_tile else mlp_tile)


def longest_seq_len(args, cfg, method, factory, loss_fn, cap, micro_auto: bool) -> tuple:
    """--seq-len auto: the planner's longest row (`zerojax.planning.planner.longest_row`: compiled
    peaks, nothing allocated) under the device's memory and the host's, the stage / offload as
    configured. With --micro-batch N at that micro-batch; with auto at micro-batch 1 (the longest
    row a device can hold; accumulation keeps the rows per step, as micro-batch auto's plan at that
    length then does). `factory()` -> the run's model (with micro-batch auto choosing the remat:
    remat "full", its choice that holds the least). Refused in one line: a method whose rows its
    records shape, a device reporting no memory limit, and a budget not even one granule fits.
    -> (`planner.LongestRow`, the micro-batch it was searched at)."""
    from zerojax.planning import planner
    from zerojax.planning.memory import device_budget

    if method is not None:
        raise ConfigMismatch(f"--seq-len auto: --method {method.name} trains on rows its records shape; it searches "
                             "the next-token (sft) row only; give --seq-len N")
    budget = device_budget()
    if budget is None:
        raise ConfigMismatch("--seq-len auto: this device reports no memory limit to search the longest row against "
                             "(CPU); give --seq-len N, or find one with zerojax estimate --aot --budget B --seq auto")
    micro = 1 if micro_auto else cfg.train_micro_batch_size_per_gpu
    accum = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps // micro
    try:
        found = planner.longest_row(factory, cfg.to_dict(), budget, micro_batch=micro, grad_accum=accum, cap=cap,
                                    loss_fn=loss_fn, options=requested_options(args))
    except planner.NoRowFits as e:
        raise NoPlanFits(f"--seq-len auto: {e}") from None
    print(f"seq-len auto: {found.describe()} ({found.compiles} compiles)")
    return found, micro


def configured_remat(cfg, build) -> str | None:
    """The remat policy the config's activation_checkpointing section names
    (`zerojax.config.remat_policy_for`); where its number_checkpoints is set, counted against the
    layers of the model `build()` makes (traced abstractly; two-level segments where it is fewer)."""
    from zerojax.config import remat_policy_for

    if not getattr(cfg.activation_checkpointing, "number_checkpoints", None):
        return remat_policy_for(cfg)
    from flax import nnx

    from zerojax.model import model_dims

    return remat_policy_for(cfg, model_dims(nnx.eval_shape(build)).layers or None)


def remat_named(args, cfg) -> bool:
    """Whether --remat or the config's remat_policy names the policy (else micro-batch auto varies it)."""
    return args.remat is not None or getattr(cfg.activation_checkpointing, "remat_policy", None) is not None


def seq_len_why(found, micro: int, remat, micro_auto: bool) -> str:
    """The run header's words for a length --seq-len auto found: what it was searched at, its
    peaks and what ends it."""
    then = "; then micro-batch auto at it" if micro_auto else ""
    return f"--seq-len auto at micro-batch {micro}, remat {remat or 'none'}{then}: {found.describe()}"


def offload_hint(plan, params: int, n_data: int, options, dtype) -> str | None:
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


def resolve_precision(raw: dict, flag: str | None, device) -> tuple[dict, str, str, list[str]]:
    """The config's fp16 / bf16 `enabled` resolved as Hugging Face's Trainer fills them, a flag
    over them as --lr is over the optimizer's lr.

    A flag (--bf16 / --fp16 / --fp32) decides: where the config sets another mode's `enabled: true`
    (a shipped fp16 config and --bf16) that section is turned off, and where it sets the flag's own
    `enabled: false` it is turned on, each said in a line for the run header. Without a flag a
    config that sets `enabled: true` decides; where `enabled` is "auto" or the section is absent,
    `default_precision` picks, never a mode the config sets false.
    Returns (config dict with both `enabled` set, precision, why, header lines for replaced keys).
    """
    raw = json.loads(json.dumps(raw))
    keys = {"fp16": "fp16", "bf16": "bfloat16" if "bfloat16" in raw and "bf16" not in raw else "bf16"}
    enabled = {m: (raw[k].get("enabled", False) if isinstance(raw.get(k), dict) else None)
               for m, k in keys.items()}
    chosen = [m for m in ("bf16", "fp16") if enabled[m] is True]
    said = []
    if flag is not None:
        mode, why = flag, f"--{flag}"
        # what the flag overrides: another mode the config enables, or the flag's own mode it disables
        replaced = [f"{keys[m]}.enabled = {json.dumps(enabled[m])}" for m in ("bf16", "fp16")
                    if (enabled[m] is True and m != mode) or (enabled[m] is False and m == mode)]
        if replaced:
            said.append(f"--{flag} replaces the config's {' and '.join(replaced)}: training in {flag}"
                        + (f", the config's {keys[chosen[0]]} section off" if chosen and chosen[0] != mode else ""))
    elif chosen:
        mode, why = chosen[0], f"the config's {keys[chosen[0]]}.enabled: true"
    else:
        mode, why = default_precision(device)
        if mode != "fp32" and enabled[mode] is False:
            mode, why = "fp32", f"the config sets {keys['bf16']}.enabled: false"
    for m, k in keys.items():
        if enabled[m] is not None or m == mode:
            raw[k] = {**raw.get(k, {}), "enabled": m == mode}
    return raw, mode, why, said


def flag_values(args) -> dict:
    """The config keys the flags the user gave set, dotted key -> (flag, value): a flag left out sets
    none (its default only fills an "auto")."""
    given = {}
    if args.lr is not None:
        given["optimizer.params.lr"] = given["scheduler.params.warmup_max_lr"] = ("--lr", args.lr)
    if args.micro_batch not in (None, "auto"):
        given["train_micro_batch_size_per_gpu"] = ("--micro-batch", args.micro_batch)
    if args.grad_accum is not None:
        given["gradient_accumulation_steps"] = ("--grad-accum", args.grad_accum)
    return given


def flags_over_config(raw: dict, given: dict) -> tuple[dict, list[str]]:
    """The flags the user gave (`flag_values`) over the values the config sets: each key the config
    sets to another value (not "auto", which the flag only fills) takes the flag's, with a line for
    the run header naming both; a key the config does not hold is left out (the flag fills it where
    the config says "auto"). -> (the config dict, the lines)."""
    raw, said = json.loads(json.dumps(raw)), []
    for key, (flag, value) in given.items():
        *parents, name = key.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or name not in node or node[name] == "auto" or node[name] == value:
            continue
        said.append(f"{flag} {value} replaces the config's {key} = {json.dumps(node[name])}")
        node[name] = value
    return raw, said


def resolved_config_source(args, fill, hidden_size, device) -> tuple[dict, str, str, list[str]]:
    """The run's config before it is loaded: first validated as written, exactly as
    `zerojax.load_config` does (what it refuses, this run refuses, before any flag rewrites a key);
    then the flags the user gave over the values it sets, and precision's `enabled` resolved
    (`resolve_precision`). -> (config dict, precision, why, header lines for the overridden keys)."""
    import zerojax
    from zerojax.config import read_source

    written = read_source(args.config)
    zerojax.load_config(written, fill=fill, hidden_size=hidden_size, name=args.config)
    raw, said = flags_over_config(written, flag_values(args))
    raw, precision, why, precision_said = resolve_precision(raw, args.precision, device)
    return raw, precision, why, said + precision_said


def offload_loop_auto(cfg, make_model, seq_len, loss_fn, batch_shapes=None) -> tuple[str, str | None]:
    """No --offload-loop: where the config offloads the optimizer to cpu alone and the device
    reports its memory, "host" if its step fits (compiled first on an abstract engine, holding no
    memory), else "in_place" (the library's default: 3-6 GiB less on GPT-2 Large / XL, ~1.75x
    slower; benchmarks/RESULTS.md). -> (loop, why; None where no choice was made)."""
    import jax
    import jax.numpy as jnp

    from zerojax import EngineOptions
    from zerojax.engine.engine import abstract_engine
    from zerojax.engine.offload_choice import chunk_loops_apply, offloads
    from zerojax.planning.memory import device_budget, fmt_bytes

    if not chunk_loops_apply(cfg.zero_optimization, *offloads(cfg)):
        return "in_place", None
    if cfg.fp16.enabled:  # fp16 matmuls do not run on CPU, so the host loop's loss-scale skips are untested
        return "in_place", ("default; the host loop is not yet tested with fp16 loss scaling "
                            "(--offload-loop host to try)")
    budget = device_budget()
    if budget is None:
        return "in_place", "default; this device reports no memory limit to check \"host\" against"
    probe = abstract_engine(make_model, cfg, loss_fn=loss_fn, options=EngineOptions(offload_loop="host"))
    shapes = batch_shapes or {"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, seq_len), jnp.int32)}
    peak = probe.step_memory(shapes).peak
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


def requested_options(args, loop=None):
    """The EngineOptions the flags ask for (--offload-loop, else `loop`; --adam-mu-dtype; --master-split)."""
    from zerojax import EngineOptions

    return EngineOptions(offload_loop=args.offload_loop or loop or "auto", adam_mu_dtype=args.adam_mu_dtype,
                         split_master="on" if args.master_split else "auto", ep_size=getattr(args, "ep_size", 1))


def engine_options(args, cfg, loop=None, planned=False):
    """--offload-loop (else `loop`) and --master-split, checked against the config before the engine is built ->
    zerojax.EngineOptions. `planned`: the planner chose the config's offload (micro-batch auto), so
    --master-split gives way where that plan offloads (the host loop splits the master itself)."""
    from zerojax.engine.offload_choice import offloads, options_for_config, resolve_offload_loop, resolve_split_master

    options = requested_options(args, loop)
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


def check_lora_resume(args, was: dict | None, now: dict | None, notes: list):
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


def filled_autos(raw, fill, cfg) -> list[str]:
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


def batch_note(meta, cfg):
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


def from_checkpoint(name, flag, value, saved, default, notes):
    """A run setting: the flag's value, else the one saved with the checkpoint, else default.
    A flag that changes the saved value adds a line to `notes`."""
    if value is None:
        return saved.get(name, default)
    if name in saved and saved[name] != value:
        notes.append(f"{flag} {value} replaces the checkpoint's {saved[name]}")
    return value


def data_source(data_flag) -> str | None:
    """What a checkpoint records of its run's data: --data as an absolute path where it names a file
    or folder (a resume from another working folder finds it), else as given (a built-in task's
    name); None: the embedded corpus."""
    if data_flag is None:
        return None
    return os.path.abspath(data_flag) if os.path.exists(data_flag) else str(data_flag)


def run_folders(args) -> dict:
    """What a checkpoint records of the folders its run read, as absolute paths (None: none): the
    Hugging Face model (--hf-checkpoint) and the tokenizer folder (--tokenizer, else the model's):
    what `zerojax export` / `generate` of the checkpoint need beside its weights."""
    tokenizer = args.tokenizer if args.tokenizer and os.path.isdir(args.tokenizer) else None
    return {"hf_checkpoint": os.path.abspath(args.hf_checkpoint) if args.hf_checkpoint else None,
            "tokenizer": os.path.abspath(tokenizer) if tokenizer else None}


def resume_data(args, saved: dict, notes: list) -> None:
    """--resume: the data the checkpoint's run trained on (`data_source`, saved with it) unless
    --data is given: args.data set to it, with a header line; a --data that differs is a warning
    naming both. A checkpoint that records none (saved before the record was kept) is left as is."""
    if "data" not in saved:
        return
    was = saved["data"]
    if args.data is None:
        if was is not None:
            args.data = was
            notes.append(f"data: the checkpoint's run's, {was} (no --data given; --data replaces it)")
        return
    if data_source(args.data) != was:
        print(f"warning: --data {args.data} is not the data this checkpoint trained on "
              f"({was or 'the embedded corpus'}); the run continues on --data {args.data}", flush=True)


def warn_replicated(engine, cfg):
    """Stage 3 keeps leaves under stage3_param_persistence_threshold elements whole on every
    device (DeepSpeed's rule): a small model then is barely partitioned, so say so once."""
    import jax

    from zerojax.sharding import partition

    zero = cfg.zero_optimization
    if zero.stage != 3 or partition.data_size(engine.mesh) < 2:
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


def configured_lr(cfg, lr, why) -> tuple:
    """The lr the run header shows: the optimizer's as loaded (a value the config sets, where no --lr
    replaced it, is the one that trains, not the flag's default), and where the schedule's peak key
    says another, that too."""
    params = cfg.optimizer.params if cfg.optimizer is not None else {}
    if isinstance(params.get("lr"), (int, float)) and params["lr"] != lr:
        lr, why = params["lr"], "the config's optimizer.params.lr"
    sched = (cfg.scheduler.params if cfg.scheduler is not None else None) or {}
    for key in ("warmup_max_lr", "cycle_max_lr"):
        if isinstance(sched.get(key), (int, float)) and sched[key] != lr:
            why += f"; the schedule peaks at scheduler.params.{key} = {sched[key]:g}"
    return lr, why


SUMMARY_LINE_LOSSES = 20  # a run this short prints its every loss on the SUMMARY line


def summary_line(summary: dict) -> str:
    """The `SUMMARY {...}` line's JSON: the run's SUMMARY, with its every loss only for a short run
    (what a test or a quick check reads); a longer run's line has first_loss / last_loss and
    "loss_count" (--summary-json keeps every loss), not hundreds of numbers on one line."""
    losses = summary.get("losses") or []
    if len(losses) <= SUMMARY_LINE_LOSSES:
        return json.dumps(summary)
    return json.dumps({**{k: v for k, v in summary.items() if k != "losses"}, "loss_count": len(losses)})


def print_run(args, cfg, label, size, steps, schedule_steps, lr, lr_default, precision, precision_why,
               remat, remat_why, seq_len, data, saved, notes, filled=(), lora=None, mlp_tile=None, mlp_tile_why="",
               row_tokens=None, seq_why=""):
    """The run as resolved from flags, config and checkpoint, printed once before any compile.
    row_tokens: the tokens one batch row trains (a preference pair: its chosen and rejected
    sequences); default seq_len. seq_why: where the length was searched (--seq-len auto), how."""
    row_tokens = row_tokens or seq_len
    sched = cfg.to_dict().get("scheduler")
    sched_text = "none (constant lr)" if not sched else (
        f"{sched['type']} " + ", ".join(f"{k}={v}" for k, v in sorted((sched.get("params") or {}).items())))
    lr_why = ("--lr" if args.lr is not None else "saved with the checkpoint" if "lr" in saved
              else f"default for {'--hf-checkpoint' if args.hf_checkpoint else size}; --lr to change")
    lr, lr_why = configured_lr(cfg, lr, lr_why)
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
    if mlp_tile_why:
        print(f"  MLP tile:  {mlp_tile or 'none'} ({mlp_tile_why})")
    if seq_why:
        print(f"  seq-len:   {seq_len:,} ({seq_why})")
    print(f"  batch:     train_batch_size {cfg.train_batch_size} = micro-batch "
          f"{cfg.train_micro_batch_size_per_gpu} x accumulation {cfg.gradient_accumulation_steps} x "
          f"{cfg.world_size} data-parallel; seq {seq_len}: {cfg.train_batch_size * row_tokens:,} tokens/step"
          + (f" ({row_tokens // seq_len} sequences a row)" if row_tokens != seq_len else ""))
    print(f"  data:      {data_name}: {data.n_train:,} {data.what}, {data.n_val:,} validation rows")
    if lora:
        print("  lora:      " + ", ".join(f"{k}={json.dumps(v)}" for k, v in lora.items()
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
