"""``horovodrun``'s flags on ``phalanx run``: the ones with a phalanx meaning, and the ones with none.

A Horovod job script usually comes with a launch line; it should work with
``horovodrun`` replaced by ``phalanx run``. Flags that map to a phalanx setting are
translated into the variables the workers read (bucket size, allreduce algorithm,
log level); flags of Horovod's background coordinator, which phalanx does not have,
are accepted with a warning that names them. Spelling aliases (``--timeline-filename``,
``--output-filename``, ``--min-num-proc`` …) live on the options they alias.
The full mapping is in docs/horovod.md.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_horovodrun_arguments", "horovodrun_env"]

# Horovod coordinator / MPI-controller knobs: (flag, takes a value). No phalanx counterpart.
_IGNORED = (
    ("--cycle-time-ms", True), ("--cache-capacity", True), ("--hierarchical-allgather", False),
    ("--no-hierarchical-allreduce", False), ("--no-hierarchical-allgather", False),
    ("--no-stall-check", False), ("--stall-check-warning-time-seconds", True),
    ("--stall-check-shutdown-time-seconds", True), ("--thread-affinity", True), ("--num-nccl-streams", True),
    ("--timeline-mark-cycles", False), ("--disable-cache", False), ("--autotune-bayes-opt-max-samples", True),
    ("--autotune-gaussian-process-noise", True), ("--prefix-output-with-timestamp", False),
    ("--log-without-timestamp", False), ("--log-hide-timestamp", False), ("--tcp", False),
    ("--mpi-threads-disable", False), ("--gloo", False),
)


class _Ignored(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.horovod_ignored = [*getattr(namespace, "horovod_ignored", []), option_string]


def add_horovodrun_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("horovodrun compatibility")
    g.add_argument("--fusion-threshold-mb", type=float, default=None, metavar="MB",
                   help="gradient bucket size for DataParallel / DistributedOptimizer (exports PHALANX_BUCKET_MB)")
    g.add_argument("--hierarchical-allreduce", action="store_true",
                   help="hierarchical allreduce (intra-host, then inter-host) by default (PHALANX_ALGORITHM)")
    g.add_argument("--verbose", action="store_true", help="library log level INFO (PHALANX_LOG_LEVEL)")
    g.add_argument("--log-level", default=None, choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"],
                   help="library log level (PHALANX_LOG_LEVEL)")
    g.add_argument("-cb", "--check-build", action="store_true",
                   help="print which frameworks, controllers and collective backends are available, and exit")
    g.add_argument("--mpi", "--jsrun", dest="horovod_mpi", action="store_const", const=True, default=None,
                   help=argparse.SUPPRESS)
    g.add_argument("--mpi-args", "--binding-args", dest="horovod_mpi", help=argparse.SUPPRESS)
    for flag, takes_value in _IGNORED:
        g.add_argument(flag, action=_Ignored, nargs=1 if takes_value else 0, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    p.set_defaults(horovod_ignored=[])


def horovodrun_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables these flags export to every worker; ValueError for ones phalanx cannot honour."""
    if args.horovod_mpi is not None:
        raise ValueError("--mpi/--jsrun: phalanx launches with its own agent (TorchElastic over SSH) and "
                         "talks over c10d (gloo/NCCL), not MPI. Drop the flag, or start the script with "
                         "mpirun/srun directly: phalanx.init() reads their environment.")
    for flag in args.horovod_ignored:
        print(f"phalanx run: ignoring {flag} (a knob of Horovod's background coordinator or MPI "
              "controller; phalanx has none, see docs/horovod.md)", file=sys.stderr)
    env = {}
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb <= 0:
            raise ValueError(f"--fusion-threshold-mb must be positive, got {args.fusion_threshold_mb}")
        env["PHALANX_BUCKET_MB"] = str(args.fusion_threshold_mb)
    if args.hierarchical_allreduce:
        env["PHALANX_ALGORITHM"] = "hierarchical"
    level = "INFO" if args.verbose else args.log_level
    if level:
        env["PHALANX_LOG_LEVEL"] = {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(level, level)
    return env
