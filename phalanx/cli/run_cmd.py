"""``phalanx run``: start a command on N ranks (horovodrun's spellings are accepted).

Example::

    phalanx run -np 2 python train.py --epochs 3
    phalanx run -np 4 -H localhost:4 -- python -c "import phalanx as px; px.init(); print(px.rank())"
"""

from __future__ import annotations

import argparse
import os
import sys

from phalanx.launcher.horovodrun_flags import add_horovodrun_arguments, horovodrun_env
from phalanx.launcher.hosts import is_local, parse_hostfile, parse_hosts
from phalanx.launcher.launch_options import add_elastic_arguments, elastic_launch_options
from phalanx.launcher.local import LaunchSpec, launch
from phalanx.launcher.ssh import add_remote_arguments
from phalanx.version import __version__


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a command on N workers",
        description="Run COMMAND on N workers with rank-prefixed output; stops all if one fails.",
    )
    p.add_argument("-np", "--num-proc", "--np", dest="np", type=int, default=None,
                   help="total number of workers (default: sum of host slots, or 1)")
    p.add_argument("-H", "--hosts", default=None, help="hosts and slots, e.g. localhost:2")
    p.add_argument("--hostfile", "-hostfile", default=None, help="file of 'host slots=N' lines")
    p.add_argument("--start-timeout", type=int, default=60,
                   help="seconds to wait for every worker to join (default 60)")
    p.add_argument("--timeout", "--gloo-timeout-seconds", type=float, default=None,
                   help="seconds a collective may wait for peers before it raises (default 300)")
    p.add_argument("--log-dir", "--output-filename", default=None, help="keep each worker's stdout/stderr files here")
    p.add_argument("--servers", type=int, default=None, metavar="N",
                   help="parameter-server jobs: the first N ranks serve (exports PHALANX_NUM_SERVERS)")
    p.add_argument("--timeline", "--timeline-filename", default=None, metavar="FILE",
                   help="write a Chrome-trace timeline of every rank to FILE (open in ui.perfetto.dev)")
    p.add_argument("--autotune", action="store_true",
                   help="tune the gradient bucket size (and hierarchical allreduce on several hosts) online "
                        "during the first steps, keeping the fastest (exports PHALANX_AUTOTUNE=1)")
    p.add_argument("--autotune-log-file", default=None, metavar="FILE",
                   help="with --autotune: rank 0 writes the search (CSV) to FILE")
    p.add_argument("--autotune-warmup-samples", type=int, default=None, metavar="N",
                   help="with --autotune: steps to skip before timing (default 3)")
    p.add_argument("--autotune-steps-per-sample", type=int, default=None, metavar="N",
                   help="with --autotune: steps timed per candidate (default 5)")
    add_remote_arguments(p)
    add_horovodrun_arguments(p)
    add_elastic_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.check_build:
        print(check_build())
        return 0
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("phalanx run: no command given; e.g. phalanx run -np 2 python train.py", file=sys.stderr)
        return 2
    try:
        hosts = parse_hostfile(args.hostfile) if args.hostfile else (parse_hosts(args.hosts) if args.hosts else [])
    except (OSError, ValueError) as err:
        print(f"phalanx run: {err}", file=sys.stderr)
        return 2
    np = args.np or (sum(h.slots for h in hosts) if hosts else 1)
    try:
        env = job_env(args, np)
    except ValueError as err:
        print(f"phalanx run: {err}", file=sys.stderr)
        return 2
    if any(not is_local(h.name) for h in hosts):
        from phalanx.launcher.ssh import run_remote

        return run_remote(args, hosts, command, env=env)
    if hosts and np > sum(h.slots for h in hosts):
        print(f"phalanx run: -np {np} exceeds the {sum(h.slots for h in hosts)} slots of the hosts given",
              file=sys.stderr)
        return 2
    try:
        elastic = elastic_launch_options(args, np, env)
    except ValueError as err:
        print(f"phalanx run: {err}", file=sys.stderr)
        return 2
    spec = LaunchSpec(nproc_per_node=np, start_timeout_s=args.start_timeout, log_dir=args.log_dir, env=env,
                      **elastic)
    if in_process_elastic(args):
        code = _run_in_process(args, spec, command, np)
    else:
        code = launch(spec, command)
    if args.timeline:
        from phalanx.profiler.timeline import merge_parts

        merge_parts(os.path.abspath(args.timeline))
    return code


def in_process_elastic(args: argparse.Namespace) -> bool:
    """``--min-np``/``--max-np``/``--host-discovery-script``: survivors of a failure keep running."""
    return args.min_np is not None or args.max_np is not None or args.host_discovery_script is not None


def _run_in_process(args: argparse.Namespace, spec: LaunchSpec, command: list[str], np: int) -> int:
    """The in-process elastic supervisor, with TorchElastic's group restart as its fallback."""
    import dataclasses

    from phalanx.launcher.ssh import SSHOptions
    from phalanx.launcher.supervisor import Supervisor

    def fallback(n: int, restarts: int) -> int:
        env = {**spec.env, "PHALANX_MAX_RESTARTS": str(restarts)}
        return launch(dataclasses.replace(spec, nproc_per_node=n, min_nodes=1, max_nodes=1, rdzv_extra={},
                                          max_restarts=restarts, run_id=sup.run_id, env=env), command)

    ssh = SSHOptions(config=args.ssh_config, identity=args.ssh_identity, port=args.ssh_port, user=args.ssh_user)
    sup = Supervisor(command, np, min_np=args.min_np, max_np=args.max_np, env=spec.env,
                     script=os.path.abspath(args.host_discovery_script) if args.host_discovery_script else None,
                     interval_s=args.discovery_interval, max_restarts=spec.max_restarts, ssh=ssh,
                     network_interface=args.network_interface, start_timeout=args.start_timeout,
                     run_id=spec.run_id, fallback=fallback)
    return sup.run()


def job_env(args: argparse.Namespace, np: int) -> dict[str, str]:
    """The variables the run's options export to every worker, local or remote; ValueError if bad."""
    env = {}
    if args.timeout is not None:
        env["PHALANX_TIMEOUT"] = str(args.timeout)
    if args.servers is not None:
        if not 1 <= args.servers < np:
            raise ValueError(f"--servers {args.servers} must be between 1 and -np minus 1 ({np - 1})")
        env["PHALANX_NUM_SERVERS"] = str(args.servers)
    if args.timeline:
        env["PHALANX_TIMELINE"] = os.path.abspath(args.timeline)
    env.update(autotune_env(args))
    env.update(horovodrun_env(args))
    return env


def autotune_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables ``--autotune`` and its knobs (horovodrun's spellings) export to every worker."""
    knobs = (args.autotune_log_file, args.autotune_warmup_samples, args.autotune_steps_per_sample)
    if not args.autotune:
        if any(k is not None for k in knobs):
            raise ValueError("--autotune-* options need --autotune")
        return {}
    env = {"PHALANX_AUTOTUNE": "1"}
    if args.autotune_log_file:
        env["PHALANX_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    for key, flag, value, least in (
        ("PHALANX_AUTOTUNE_WARMUP_STEPS", "--autotune-warmup-samples", args.autotune_warmup_samples, 0),
        ("PHALANX_AUTOTUNE_STEPS_PER_TRIAL", "--autotune-steps-per-sample", args.autotune_steps_per_sample, 1),
    ):
        if value is not None:
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
            env[key] = str(value)
    return env


def check_build() -> str:
    """horovodrun -cb's table, answered truthfully for this machine."""
    import torch
    import torch.distributed as dist

    def mark(ok: bool) -> str:
        return "[X]" if ok else "[ ]"

    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
    return "\n".join([
        f"phalanx v{__version__} (torch {torch.__version__}):",
        "",
        "Available Frameworks:",
        f"    {mark(True)} PyTorch",
        f"    {mark(False)} TensorFlow",
        f"    {mark(False)} MXNet",
        "",
        "Available Controllers:",
        f"    {mark(False)} MPI",
        f"    {mark(dist.is_available() and dist.is_gloo_available())} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {mark(nccl)} NCCL",
        f"    {mark(False)} DDL",
        f"    {mark(False)} CCL",
        f"    {mark(False)} MPI",
        f"    {mark(dist.is_available() and dist.is_gloo_available())} Gloo",
    ])
