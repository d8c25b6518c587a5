"""`zerojax launch`: start the processes of a run, with DeepSpeed's launcher flags.

    zerojax launch --num_procs 2 train.py --config ds.json        # 2 processes on this machine
    zerojax launch --proc_per_gpu train.py ...                      # one process per local GPU
    zerojax launch --hostfile hosts --include "w0@w1:0,2" train.py  # several machines (pdsh)
    zerojax launch --no_ssh --node_rank 1 --hostfile hosts train.py # run by hand on each node

The hostfile, --include / --exclude, --num_nodes / --num_gpus and the multi-node commands follow
DeepSpeed's `deepspeed/launcher/runner.py` and `multinode_runner.py` (v0.19.6, the copy read;
the launcher is unchanged through 0.19.8): same formats, same refusals. Differences, each because
JAX runs differently from torch.distributed:
- one process per node by default (JAX's usual form: one process drives all its local devices);
  `--proc_per_gpu` gives DeepSpeed's one process per GPU, `--num_procs N` N processes per node
  sharing its GPUs evenly (also on a CPU-only machine, for tests);
- the script is not passed `--local_rank` (JAX scripts call `zerojax.init_distributed()`, which
  reads the variables set here);
- without `--master_addr` the first host's name is used (DeepSpeed asks it for `hostname -I`);
- a launcher `ssh` (one ssh per node, no pdsh needed) besides pdsh / slurm / openmpi.
Every child's output lines are prefixed with its rank; the first child that fails stops the
others and its exit status is the launcher's (a child killed by signal S: 128 + S, as a shell).
"""
from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from copy import deepcopy

DLTS_HOSTFILE = "/job/hostfile"        # DeepSpeed's default --hostfile
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's default --master_port
PDSH_MAX_FAN_OUT = 1024
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
# variables forwarded to other nodes (DeepSpeed: MLFLOW, PYTHON, MV2, UCX and the accelerator's
# NCCL; here also XLA_, whose flags every process of a JAX run must share)
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "XLA_"]
LAUNCHERS = ("pdsh", "ssh", "slurm", "openmpi")
STOP_GRACE_S = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="zerojax launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-H", "--hostfile", default=DLTS_HOSTFILE,
                   help="MPI-style hostfile of the machines to use, lines 'worker-0 slots=4' "
                        f"(default {DLTS_HOSTFILE}; without one, this machine only)")
    p.add_argument("-i", "--include", default="",
                   help='resources to use, NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC=NAME[:SLOT[,SLOT ...]], '
                        'e.g. "worker-0@worker-1:0,2"')
    p.add_argument("-e", "--exclude", default="", help="resources not to use (same format as --include)")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1,
                   help="use GPUs [0, N) on each node")
    p.add_argument("--num_procs", type=int, default=None,
                   help="processes per node, sharing its GPUs evenly (default 1: JAX's one process "
                        "per node; on a CPU-only machine each has its own CPU devices)")
    p.add_argument("--proc_per_gpu", action="store_true",
                   help="one process per GPU (DeepSpeed's and torchrun's form)")
    p.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT,
                   help="port of the JAX coordinator on the first node")
    p.add_argument("--master_addr", default="",
                   help="address of the first node (default: 127.0.0.1 alone, else the first host's name)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index; with --no_ssh")
    p.add_argument("--launcher", default="pdsh", type=str.lower, choices=LAUNCHERS,
                   help="how to start the other nodes (default pdsh)")
    p.add_argument("--launcher_args", default="", help="extra arguments for the launcher, one quoted string")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for remote nodes")
    p.add_argument("--no_ssh", action="store_true",
                   help="start only this node's processes (run the same command on every node, "
                        "each with its --node_rank)")
    p.add_argument("--module", action="store_true", help="run the script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="run the script directly, not with python")
    p.add_argument("--dry_run", action="store_true",
                   help="print the command(s) that would start the processes, start nothing")
    p.add_argument("--world_info", default=None, help=argparse.SUPPRESS)  # set for remote nodes
    p.add_argument("user_script", help="the training script, followed by its arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.proc_per_gpu and args.num_procs is not None:
        p.error("--proc_per_gpu and --num_procs both say how many processes per node: give one")
    if args.num_procs is not None and args.num_procs < 1:
        p.error(f"--num_procs {args.num_procs}: must be at least 1")
    if args.no_python and args.module:
        p.error("Don't use both the '--no_python' flag and the '--module' flag at the same time.")
    return args


# ------------------------------------------------------------ DeepSpeed's resource parsing

def fetch_hostfile(hostfile_path):
    if not os.path.isfile(hostfile_path):
        return None
    with open(hostfile_path) as fd:
        return parse_hostfile(fd.readlines())


def parse_hostfile(hostfile_lines):
    """host -> slots from 'host slots=N' lines; '#' comments and blank lines skipped (DeepSpeed's
    `_parse_hostfile`, with its errors)."""
    pattern = r"^(\S+)\s+slots=(\d+)"
    resource_pool = collections.OrderedDict()
    for line in hostfile_lines:
        line = line.strip()
        match = re.search(pattern, line)
        if line.startswith("#") or line == "":
            continue
        elif match:
            host, num_slots = match.group(1), int(match.group(2))
            if host in resource_pool:
                raise ValueError(f"Hostfile contains multiple entries for {host}, unable to proceed with launching")
            resource_pool[host] = num_slots
        else:
            raise ValueError(f"Hostfile contains a bad entry: {line}, unable to proceed with launching "
                             f"(each line is 'hostname slots=N')")
    if not resource_pool:
        raise ValueError("Hostfile is empty or not formatted correctly, unable to proceed with launching.")
    return resource_pool


def _stable_remove_duplicates(data):
    out = []
    for x in data:
        if x not in out:
            out.append(x)
    return out


def parse_node_config(node_config: str) -> tuple[str, list[int]]:
    if ":" not in node_config:
        return node_config, []
    hostname, slots = node_config.split(":")
    try:
        return hostname, [int(x) for x in slots.split(",")]
    except ValueError:
        raise ValueError(f"'{node_config}': slots after ':' are comma-separated integers, "
                         f"e.g. worker-1:0,2") from None


def parse_node_config_list(node_config_list: str) -> dict[str, list[int]]:
    node_configs = defaultdict(list)
    for node_config in node_config_list.split("@"):
        hostname, slots = parse_node_config(node_config)
        node_configs[hostname] += slots
    return {k: sorted(set(v)) for k, v in node_configs.items()}


def parse_resource_filter(host_info, include_str="", exclude_str=""):
    """Filter {host: [slots]} by an --include or --exclude string (DeepSpeed's
    `parse_resource_filter`): NODE_SPEC[@NODE_SPEC ...], NODE_SPEC = NAME[:SLOT[,SLOT ...]]."""
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive.")
    if not include_str and not exclude_str:
        return host_info
    filtered_hosts = {} if include_str else deepcopy(host_info)
    parse_str = include_str or exclude_str
    for hostname, slots in parse_node_config_list(parse_str).items():
        if hostname not in host_info:
            raise ValueError(f"Hostname '{hostname}' not found in hostfile")
        if slots:
            for slot in slots:
                if slot not in host_info[hostname]:
                    raise ValueError(f"No slot '{slot}' specified on host '{hostname}'")
            if include_str:
                filtered_hosts[hostname] = slots
            else:
                for slot in slots:
                    filtered_hosts[hostname].remove(slot)
        else:
            filtered_hosts[hostname] = host_info[hostname] if include_str else []
    filtered_hosts = {h: _stable_remove_duplicates(s) for h, s in filtered_hosts.items() if s}
    # host_info's order decides the ranks
    return collections.OrderedDict((h, filtered_hosts[h]) for h in host_info if h in filtered_hosts)


def parse_inclusion_exclusion(resource_pool, inclusion, exclusion):
    active_resources = collections.OrderedDict()
    node_configs = parse_node_config_list(inclusion)
    for hostname, slots in resource_pool.items():
        # DeepSpeed 0.19.6 takes node_configs[hostname] even when it is [] (a host named without
        # slots), so `-i "worker-0@worker-1:0,2"` drops worker-0 and `-i worker-0` leaves nothing,
        # against its own --include help ("all slots on worker-0"); the help is followed here.
        active_resources[hostname] = node_configs.get(hostname) or list(range(slots))
    return parse_resource_filter(active_resources, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info) -> str:
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def decode_world_info(text: str):
    return json.loads(base64.urlsafe_b64decode(text), object_pairs_hook=collections.OrderedDict)


def local_gpu_count() -> int:
    """NVIDIA GPUs the driver lists, without starting JAX (the launcher must not hold devices)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        pass
    if shutil.which("nvidia-smi") is None:  # no NVIDIA driver: CPU processes
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def active_resources(args, env=os.environ, gpu_count=local_gpu_count):
    """{host: [GPU ids]} to run on and whether other machines are involved (DeepSpeed's main())."""
    resource_pool = fetch_hostfile(args.hostfile)
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not resource_pool and visible and not (args.include or args.exclude or args.num_nodes > 1
                                              or args.num_gpus > 0):
        args.include = f"localhost:{visible}"  # DeepSpeed: respect VISIBLE_DEVICES on one node
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
    multi_node = True
    if not resource_pool:
        resource_pool = {"localhost": gpu_count()}  # a CPU-only machine: no slots, CPU devices
        args.master_addr = args.master_addr or "127.0.0.1"
        multi_node = False
    if not multi_node and args.num_nodes > 1:
        raise ValueError(f"Num nodes is >1 but no extra nodes available via hostfile "
                         f"({args.hostfile} not found; pass --hostfile)")
    active = parse_inclusion_exclusion(resource_pool, args.include, args.exclude)
    if args.num_nodes > 0:
        active = collections.OrderedDict(list(active.items())[:args.num_nodes])
    if args.num_gpus > 0:
        active = collections.OrderedDict((h, list(range(args.num_gpus))) for h in active)
    if not active:
        raise ValueError("--include / --exclude leave no host to run on")
    if args.no_ssh and not 0 <= args.node_rank < len(active):
        raise ValueError(f"Launching training without ssh, but --node_rank is not set correctly: "
                         f"--node_rank {args.node_rank} must be in [0, {len(active)}) for the hosts "
                         f"{', '.join(active)}")
    if not args.master_addr:
        args.master_addr = next(iter(active))
    return active, resource_pool, multi_node and len(active) > 1 and not args.no_ssh


# ------------------------------------------------------------ processes of one node

def procs_per_node(args, slots: list[int]) -> int:
    if args.proc_per_gpu:
        if not slots:
            raise ValueError("--proc_per_gpu: this node has no GPUs; use --num_procs N for CPU processes")
        return len(slots)
    return args.num_procs or 1


def node_processes(world_info, node_rank: int, args) -> list[dict]:
    """The environment of each process of node `node_rank` (only what the launcher adds).

    One GPU per process: DeepSpeed's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    CUDA_VISIBLE_DEVICES = the node's GPUs), which init_distributed reads as one process per GPU.
    Several GPUs per process, or none (CPU): JAX's own JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID (all visible devices), CUDA_VISIBLE_DEVICES = its share;
    the DeepSpeed variables are set as well for scripts that read them.
    """
    hosts = list(world_info)
    counts = [procs_per_node(args, world_info[h]) for h in hosts]
    for h, n in zip(hosts, counts):
        if world_info[h] and len(world_info[h]) % n:
            raise ValueError(f"{n} processes per node cannot share the {len(world_info[h])} GPUs "
                             f"{world_info[h]} of {h} evenly; choose --num_procs dividing it")
    world, first = sum(counts), sum(counts[:node_rank])
    slots, n = world_info[hosts[node_rank]], counts[node_rank]
    per = len(slots) // n if slots else 0
    out = []
    for local in range(n):
        env = {"MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
               "WORLD_SIZE": str(world), "RANK": str(first + local), "LOCAL_RANK": str(local),
               "LOCAL_SIZE": str(n), "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(len(hosts))}
        if per == 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        else:
            env.update(JAX_COORDINATOR_ADDRESS=f"{args.master_addr}:{args.master_port}",
                       JAX_NUM_PROCESSES=str(world), JAX_PROCESS_ID=str(first + local))
            if slots:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots[local * per:(local + 1) * per]))
        out.append(env)
    return out


def script_command(args) -> list[str]:
    if args.no_python:
        return [args.user_script, *args.user_args]
    return [sys.executable, "-u", *(["-m"] if args.module else []), args.user_script, *args.user_args]


def _pump(stream, prefix, lock):
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()
    stream.close()


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal S -> 128 + S


def supervise(commands, envs, prefixes) -> int:
    """Run the commands; prefix their output lines; the first failure stops all and is returned."""
    lock = threading.Lock()
    procs, pumps = [], []
    for cmd, env, prefix in zip(commands, envs, prefixes):
        # own session: stopping a child also stops what it started
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, prefix.encode(), lock), daemon=True)
        t.start()
        pumps.append(t)

    def stop(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def on_signal(signum, frame):
        stop()
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = next((p for p in procs if p.poll() not in (None, 0)), None)
            if failed is not None:
                status = _exit_status(failed.returncode)
                rank = prefixes[procs.index(failed)].strip()
                with lock:
                    print(f"zerojax launch: {rank} exited with status {status}; stopping the others",
                          file=sys.stderr, flush=True)
                stop()
                deadline = time.monotonic() + STOP_GRACE_S
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.1)
                stop(signal.SIGKILL)
                break
            time.sleep(0.2)
        for p in procs:
            p.wait()
        if not status:
            status = next((_exit_status(p.returncode) for p in procs if p.returncode), 0)
        for t in pumps:
            t.join(timeout=5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return status


def run_node(world_info, node_rank, args) -> int:
    base = dict(os.environ)
    base.pop("CUDA_VISIBLE_DEVICES", None)  # replaced by the slots (DeepSpeed does the same)
    envs = node_processes(world_info, node_rank, args)
    cmd = script_command(args)
    if args.dry_run:
        for env in envs:
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    return supervise([cmd] * len(envs), [{**base, **e} for e in envs],
                     [f"[{e['RANK']}] " for e in envs])


# ------------------------------------------------------------ other machines

def _export_value(var: str) -> str:
    var = var.strip()
    return f'"{var}"' if re.search(r"[^\w@%+=:,./-]", var) else var  # DeepSpeed's add_export


def exports(env) -> dict[str, str]:
    """Variables to set on the other nodes: EXPORT_ENVS prefixes, then .deepspeed_env files."""
    out = {k: _export_value(v) for k, v in env.items() if any(k.startswith(n) for n in EXPORT_ENVS)}
    for path in DEEPSPEED_ENVIRONMENT_PATHS:
        environ_file = os.path.join(path, DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(environ_file):
            with open(environ_file) as fd:
                for line in fd:
                    if not line.strip() or line.lstrip().startswith("#"):
                        continue
                    if "=" not in line:
                        raise ValueError(f"{environ_file}: line {line.strip()!r} is not KEY=VALUE")
                    key, val = line.split("=", maxsplit=1)
                    out[key.strip()] = _export_value(val)
    return out


def _node_launch(args, world_info, node_rank: str) -> list[str]:
    """The command that starts one node's processes there (this module with --no_ssh)."""
    cmd = [sys.executable, "-u", "-m", "zerojax.launch.launcher", f"--world_info={encode_world_info(world_info)}",
           "--no_ssh", f"--node_rank={node_rank}", f"--master_addr={args.master_addr}",
           f"--master_port={args.master_port}"]
    if args.proc_per_gpu:
        cmd.append("--proc_per_gpu")
    if args.num_procs:
        cmd.append(f"--num_procs={args.num_procs}")
    cmd += ["--module"] * args.module + ["--no_python"] * args.no_python
    return cmd + [args.user_script, *args.user_args]


def _remote_shell(args, world_info, node_rank, exported) -> str:
    prefix = "".join(f"export {k}={v}; " for k, v in exported.items())
    launch = " ".join(shlex.quote(a) if a != "%n" else a for a in _node_launch(args, world_info, node_rank))
    return f"{prefix}cd {shlex.quote(os.path.abspath('.'))}; {launch}"


def multinode_commands(args, active, resource_pool, exported) -> list[list[str]]:
    """The command(s) that start every node, for args.launcher (DeepSpeed's runners' shapes)."""
    hosts = list(active)
    extra = shlex.split(args.launcher_args)
    if args.launcher == "pdsh":  # pdsh replaces %n by the host's index in -w
        return [["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts), *extra,
                 _remote_shell(args, active, "%n", exported)]]
    if args.launcher == "ssh":
        port = ["-p", str(args.ssh_port)] if args.ssh_port is not None else []
        return [["ssh", *port, *extra, h, _remote_shell(args, active, str(i), exported)]
                for i, h in enumerate(hosts)]
    # slurm / openmpi start one process per GPU themselves and JAX detects their variables
    # (init_distributed's cluster form), so the script runs directly, as under DeepSpeed.
    if args.num_procs:
        raise ValueError(f"--num_procs with --launcher {args.launcher}: {args.launcher} starts one "
                         f"process per GPU (JAX's {args.launcher} detection expects that); drop "
                         f"--num_procs, or use --launcher pdsh / ssh")
    total = max(sum(len(s) for s in active.values()), len(hosts))
    if args.launcher == "slurm":
        srun = ["srun", "-n", str(total), "--nodelist", ",".join(hosts), *extra]
        export = "--export=ALL" + "".join(f",{k}={v}" for k, v in exported.items())
        return [srun + [export] + script_command(args)]
    if args.include or args.exclude:
        raise ValueError("openmpi backend does not support worker include/exclusion")
    if args.num_nodes != -1 or args.num_gpus != -1:
        raise ValueError("openmpi backend does not support limiting num nodes/gpus")
    btl = [] if any(a == "btl_tcp_if_include" for a in extra) else ["--mca", "btl_tcp_if_include", "eth0"]
    mpirun = ["mpirun", "-n", str(sum(resource_pool.values())), "-hostfile", args.hostfile,
              "--mca", "btl", "^openib", *btl, *extra]
    x = [a for k, v in {"UCX_TLS": "tcp", **exported}.items() for a in ("-x", f"{k}={v}")]
    return [mpirun + x + script_command(args)]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.world_info:  # started on a node by the multi-node command
            return run_node(decode_world_info(args.world_info), args.node_rank, args)
        active, pool, multi_node = active_resources(args)
        if not multi_node:
            return run_node(active, max(args.node_rank, 0) if args.no_ssh else 0, args)
        # DeepSpeed: this directory goes first on PYTHONPATH, here and (exported) on every node
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.abspath("."), *filter(None, [os.environ.get("PYTHONPATH")])]))
        commands = multinode_commands(args, active, pool, exports(env))
    except ValueError as e:  # a hostfile, --include / --exclude or node count that cannot be met
        print(f"error: zerojax launch: {e}", file=sys.stderr)
        return 1
    if args.dry_run:
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    if shutil.which(commands[0][0]) is None:
        print(f"error: zerojax launch: launcher '{args.launcher}' not installed ({commands[0][0]} not on PATH); "
              f"choose another with --launcher {{{','.join(LAUNCHERS)}}}", file=sys.stderr)
        return 1
    return supervise(commands, [env] * len(commands),
                     [f"[{h}] " for h in active] if args.launcher == "ssh" else [""])


if __name__ == "__main__":
    sys.exit(main())
