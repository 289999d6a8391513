"""``phalanx run``: start a command on N ranks (horovodrun's spellings are accepted).

Example::

    phalanx run -np 2 python train.py --epochs 3
    phalanx run -np 4 -H localhost:4 -- python -c "import phalanx as px; px.init(); print(px.rank())"
    phalanx run --nproc-per-node 2 --local-ranks-filter 0 train.py        # torchrun's spellings

The command's interpreter: a bare ``python`` (or ``python3``, ``python3.X`` of this
version) and a ``.py`` first word run with the Python that runs ``phalanx`` itself
(``sys.executable``), so a virtual environment's ``phalanx`` works without activating
it. To run another interpreter, give its path (``/opt/py/bin/python train.py``);
``--no-python`` runs a ``.py`` command as it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from phalanx.cli.parser import UsageError
from phalanx.cli.torchrun_flags import add_torchrun_arguments, parse_ranks, torchrun_layout
from phalanx.launcher.horovodrun_flags import add_horovodrun_arguments, horovodrun_env
from phalanx.launcher.hosts import is_local, parse_hostfile, parse_hosts
from phalanx.launcher.launch_options import (
    add_elastic_arguments,
    elastic_launch_options,
    stall_launch_options,
)
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
                   help="total number of workers, at least 1 (default: sum of host slots, or 1)")
    p.add_argument("-H", "--hosts", default=None, help="hosts and slots, e.g. localhost:2")
    p.add_argument("--hostfile", "-hostfile", default=None, help="file of 'host slots=N' lines")
    p.add_argument("--start-timeout", type=int, default=60,
                   help="seconds to wait for every worker to join (default 60)")
    p.add_argument("--timeout", "--gloo-timeout-seconds", type=float, default=None,
                   help="seconds a collective may wait for peers before it raises (default 300)")
    p.add_argument("--output-filename", "--log-dir", dest="log_dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/stdout and DIR/rank.N/stderr "
                        "(horovodrun's layout); without it no log file is kept")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default=None, metavar="RANKS",
                   help="show only these local ranks' output on the console, e.g. 0 or 0,1 (torchrun's flag); "
                        "--output-filename still keeps every rank's")
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
    add_torchrun_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.check_build:
        print(check_build())
        return 0
    command = worker_command(args)
    try:
        hosts = parse_hostfile(args.hostfile) if args.hostfile else (parse_hosts(args.hosts) if args.hosts else [])
        layout = torchrun_layout(args)
        np = layout["np"] if layout and layout["np"] is not None else args.np
        if np is not None and np < 1:
            raise ValueError(f"-np must be at least 1, got {np}")
        np = np or (sum(h.slots for h in hosts) if hosts else (_allocation_tasks() or 1))
        ranks_filter = parse_ranks(args.local_ranks_filter) if args.local_ranks_filter else None
        env = job_env(args, np)
    except (OSError, ValueError) as err:
        raise UsageError(str(err)) from None
    level = _launcher_log_level(args)
    if not hosts and not (layout and layout["multi"]):
        code = _run_in_allocation(args, np, command, env, ranks_filter)
        if code is not None:
            return code
    if any(not is_local(h.name) for h in hosts) and not in_process_elastic(args):
        from phalanx.launcher.ssh import run_remote

        args.np = np
        return run_remote(args, hosts, command, env=env, ranks_filter=ranks_filter)
    if hosts and np > sum(h.slots for h in hosts):
        raise UsageError(f"-np {np} exceeds the {sum(h.slots for h in hosts)} slots of the hosts given")
    try:
        elastic = elastic_launch_options(args, np, env)
        elastic.update(stall_launch_options(args))
    except ValueError as err:
        raise UsageError(str(err)) from None
    if layout and layout["multi"]:
        if in_process_elastic(args):
            raise UsageError("--nnodes jobs restart as a group (--max-restarts); --min-np/--max-np/"
                             "--host-discovery-script belong to jobs started from one machine")
        elastic.update(min_nodes=layout["min_nodes"], max_nodes=layout["max_nodes"], run_id=layout["run_id"],
                       rdzv_endpoint=layout["rdzv_endpoint"], rdzv_extra={"is_host": layout["is_host"]})
    spec = LaunchSpec(nproc_per_node=np, start_timeout_s=args.start_timeout, log_dir=args.log_dir, env=env,
                      ranks_filter=ranks_filter, quiet_agent=level != logging.DEBUG, local_addr=args.local_addr,
                      monitor_interval_s=args.monitor_interval or 0.1, **elastic)
    if in_process_elastic(args):
        code = _run_in_process(args, spec, command, np, hosts)
    else:
        code = launch(spec, command)
    if args.timeline:
        from phalanx.profiler.timeline import merge_parts

        merge_parts(os.path.abspath(args.timeline))
    return code


def _allocation_tasks() -> int | None:
    """Inside a SLURM allocation (salloc, sbatch) and no -H: its task count, the default -np."""
    from phalanx.launcher.slurm import allocation

    alloc = allocation()
    return alloc.total if alloc and shutil.which("srun") else None


def _run_in_allocation(args, np, command, env, ranks_filter) -> int | None:
    """``phalanx run`` in an salloc shell or sbatch script: one agent per node through srun; None elsewhere."""
    from phalanx.launcher.slurm import allocation, launch_slurm

    try:
        alloc = allocation()
    except ValueError as err:
        raise UsageError(str(err)) from None
    if alloc is None:
        return None
    if not shutil.which("srun"):  # e.g. a container started inside the job: SLURM's variables, no srun
        logging.getLogger("phalanx.launcher").warning(
            "inside %s but srun is not on PATH; running on this host only", alloc.describe())
        return None
    if in_process_elastic(args):
        return None  # the in-process supervisor over the allocation's nodes (_run_in_process)
    try:
        restarts = elastic_launch_options(args, np, env).get("max_restarts", 0)  # validates; exports its env
        code = launch_slurm(alloc, np, command, env=env, network_interface=args.network_interface,
                            start_timeout=args.start_timeout, port=args.rdzv_port, log_dir=args.log_dir,
                            ranks_filter=ranks_filter, max_restarts=restarts)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.timeline:  # the parts are on the nodes' disks: merged here when the directory is shared
        from phalanx.profiler.timeline import merge_parts

        merge_parts(os.path.abspath(args.timeline))
    return code


_BARE_PYTHON = ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command every worker runs, with a bare ``python`` or a ``.py`` script on this Python."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given; e.g. phalanx run -np 2 python train.py")
    if args.module:
        return [sys.executable, "-m", *command]
    if command[0] in _BARE_PYTHON:
        return [sys.executable, *command[1:]]
    if command[0].endswith(".py") and not args.no_python:
        return [sys.executable, *command]
    return command


def _launcher_log_level(args: argparse.Namespace) -> int:
    """``--verbose``/``--log-level``: the launcher's own lines ("phalanx: …") at that level too."""
    name = "INFO" if args.verbose else (args.log_level or "WARNING")
    level = logging.DEBUG if name == "TRACE" else logging.getLevelName("CRITICAL" if name == "FATAL" else name)
    logger = logging.getLogger("phalanx.launcher")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("phalanx: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return level


def in_process_elastic(args: argparse.Namespace) -> bool:
    """``--min-np``/``--max-np``/``--host-discovery-script``: survivors of a failure keep running."""
    return args.min_np is not None or args.max_np is not None or args.host_discovery_script is not None


def _run_in_process(args: argparse.Namespace, spec: LaunchSpec, command: list[str], np: int, hosts) -> int:
    """The in-process elastic supervisor, with TorchElastic's group restart as its fallback."""
    import dataclasses

    from phalanx.launcher.ssh import SSHOptions
    from phalanx.launcher.supervisor import Supervisor

    def fallback(n: int, restarts: int) -> int:
        env = {**spec.env, "PHALANX_MAX_RESTARTS": str(restarts)}
        return launch(dataclasses.replace(spec, nproc_per_node=n, min_nodes=1, max_nodes=1, rdzv_extra={},
                                          max_restarts=restarts, run_id=sup.run_id, env=env), command)

    where = {"ssh": SSHOptions(config=args.ssh_config, identity=args.ssh_identity, port=args.ssh_port,
                               user=args.ssh_user),
             "hosts": {h.name: h.slots for h in hosts} if hosts else None}
    if not hosts and not args.host_discovery_script and _allocation_tasks():  # salloc/sbatch: its nodes
        from phalanx.launcher.slurm import allocation, elastic_options

        try:
            where = elastic_options(allocation(), np)
        except ValueError as err:
            raise UsageError(str(err)) from None
    sup = Supervisor(command, np, min_np=args.min_np, max_np=args.max_np, env=spec.env,
                     script=os.path.abspath(args.host_discovery_script) if args.host_discovery_script else None,
                     interval_s=args.discovery_interval, max_restarts=spec.max_restarts,
                     network_interface=args.network_interface, start_timeout=args.start_timeout,
                     run_id=spec.run_id, fallback=fallback, ranks_filter=spec.ranks_filter, **where,
                     reset_limit=args.reset_limit,
                     cooldown=tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None,
                     elastic_timeout=args.elastic_timeout, log_dir=spec.log_dir,
                     stall_timeout=args.stall_timeout, heartbeat_timeout=args.heartbeat_timeout)
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
