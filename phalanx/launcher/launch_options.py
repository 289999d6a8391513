"""``phalanx run`` options for fault tolerance: --min-np/--max-np, --host-discovery-script,
--resume-from, --max-restarts, --preempt-signal, --requeue. Kept here so the launcher's own file stays small.

Example::

    phalanx run -np 4 --max-restarts 3 --resume-from ckpts python train.py
    phalanx run -np 2 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py
    phalanx run -np 2 --preempt-signal USR1 python train.py     # USR1 or SIGTERM: save, exit 85
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess

from phalanx.launcher.discovery import discover_hosts
from phalanx.preemption.signals import parse_signal

__all__ = ["add_elastic_arguments", "elastic_launch_options", "stall_launch_options"]


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance")
    g.add_argument("--max-restarts", type=int, default=None,
                   help="restart the worker group up to N times after a worker fails; workers resume "
                        "from their last commit/checkpoint (default 0, or 3 with --min-np/--max-np)")
    g.add_argument("--min-np", "--min-num-proc", type=int, default=None, help="elastic: fewest workers to run with")
    g.add_argument("--max-np", "--max-num-proc", type=int, default=None, help="elastic: most workers to admit")
    g.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                   help="elastic (horovodrun's flag): executable printing 'host:slots' lines; polled, and "
                        "the job resizes to this machine's slots (within --min-np..--max-np) at the next commit")
    g.add_argument("--discovery-interval", type=float, default=1.0, metavar="S",
                   help="seconds between runs of the host discovery script (default 1)")
    g.add_argument("--stall-warning", type=float, default=60.0, metavar="S",
                   help="after S seconds of one collective waiting (or a rank silent), print which ranks are "
                        "behind, where, and their Python stacks (default 60, Horovod's stall check)")
    g.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="kill a rank whose heartbeat stopped, or that every other rank has waited on, for S "
                        "seconds (default: none; the collective --timeout ends the job)")
    g.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                   help="elastic: a worker whose heartbeat stopped for S seconds (frozen, SIGSTOPped) is lost: "
                        "killed, and the others re-form in-process (default 3; PHALANX_HEARTBEAT_TIMEOUT)")
    g.add_argument("--reset-limit", type=int, default=None, metavar="N",
                   help="elastic (horovodrun's flag): stop the job when its membership would change an "
                        "N+1-th time (default: no limit)")
    g.add_argument("--blacklist-cooldown-range", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="elastic (horovodrun's flag): a host whose worker failed may return after a random "
                        "MIN..MAX seconds, doubled at each failure there (default: never)")
    g.add_argument("--elastic-timeout", type=float, default=600.0, metavar="S",
                   help="elastic (horovodrun's flag): seconds to wait for --min-np workers to be possible "
                        "again before the job stops (default 600)")
    g.add_argument("--resume-from", default=None, metavar="DIR",
                   help="resume from the newest intact checkpoint under DIR (exported to the "
                        "workers as PHALANX_RESUME_FROM)")
    g.add_argument("--preempt-signal", default=None, metavar="SIG",
                   help="besides SIGTERM, this signal (e.g. USR1, as in #SBATCH --signal=USR1@90) means "
                        "'preempted': forwarded to the workers, which save one checkpoint at the same step "
                        "and exit 85; phalanx run then exits 85 (docs/preemption.md)")
    g.add_argument("--requeue", dest="requeue", action="store_true", default=None,
                   help="under SLURM, requeue the job (scontrol requeue) after a --preempt-signal checkpoint "
                        "(default: when the job is requeueable, e.g. sbatch --requeue)")
    g.add_argument("--no-requeue", dest="requeue", action="store_false", help="never requeue under SLURM")


def elastic_launch_options(args: argparse.Namespace, np: int, env: dict[str, str]) -> dict:
    """Validate the flags, add their environment to ``env``; return extra LaunchSpec fields.

    Raises ValueError naming the flag and the fix.
    """
    min_np, max_np = args.min_np, args.max_np
    elastic = min_np is not None or max_np is not None or args.host_discovery_script is not None
    if min_np is not None and min_np < 1:
        raise ValueError(f"--min-np must be at least 1, got {min_np}")
    if min_np is not None and min_np > np:
        raise ValueError(f"--min-np {min_np} is larger than -np {np}; lower --min-np or raise -np")
    if max_np is not None and max_np < np:
        raise ValueError(f"--max-np {max_np} is smaller than -np {np}; raise --max-np or lower -np")
    if args.discovery_interval <= 0:
        raise ValueError(f"--discovery-interval must be positive, got {args.discovery_interval}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ValueError(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if args.elastic_timeout <= 0:
        raise ValueError(f"--elastic-timeout must be positive, got {args.elastic_timeout}")
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        raise ValueError(f"--blacklist-cooldown-range {cooldown[0]:g} {cooldown[1]:g}: write MIN MAX "
                         "with 0 <= MIN <= MAX seconds")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.host_discovery_script is not None:
        script = args.host_discovery_script
        if not (os.path.isfile(script) and os.access(script, os.X_OK)):
            raise ValueError(f"--host-discovery-script {script} is not an executable file; chmod +x it")
        try:  # a script that prints what is not host:slots is a bug to fix now, not a warning every poll
            discover_hosts(os.path.abspath(script), timeout_s=30.0)
        except ValueError as err:
            raise ValueError(f"--host-discovery-script {script}: at launch it printed "
                             f"{str(err).split(' printed ', 1)[-1]} (e.g. localhost:2)") from None
        except (OSError, subprocess.SubprocessError):
            pass  # a failed run may pass (an API server not up yet): the supervisor retries at each poll
        env["PHALANX_HOST_DISCOVERY_SCRIPT"] = os.path.abspath(script)
    if args.resume_from is not None:
        env["PHALANX_RESUME_FROM"] = os.path.abspath(args.resume_from)
    out: dict = {}
    if args.preempt_signal is not None:
        sig = parse_signal(args.preempt_signal)  # ValueError: one line naming the flag
        env["PHALANX_PREEMPT_SIGNAL"] = sig.name
        out["preempt_signals"] = tuple(dict.fromkeys((signal.SIGTERM, sig)))
    if args.requeue is not None:
        env["PHALANX_REQUEUE"] = "1" if args.requeue else "0"
    restarts = args.max_restarts if args.max_restarts is not None else (3 if elastic else None)
    if restarts is not None:
        out["max_restarts"] = restarts
        env["PHALANX_MAX_RESTARTS"] = str(restarts)
    if elastic and args.host_discovery_script is None:
        # TorchElastic counts nodes (agents), each running -np workers here; used by the group
        # restart path (phalanx run itself runs elastic jobs in-process: launcher/supervisor.py)
        out["min_nodes"] = max(1, math.ceil((min_np or np) / np))
        out["max_nodes"] = max(out["min_nodes"], math.ceil((max_np or np) / np))
        if out["max_nodes"] > out["min_nodes"]:
            # TorchElastic waits 30 s (last call) for more nodes once min_nodes joined, at every
            # (re)start; late nodes are admitted at the next restart anyway, so wait 2 s
            out["rdzv_extra"] = {"last_call_timeout": 2}
    return out


def stall_launch_options(args: argparse.Namespace) -> dict:
    """LaunchSpec fields of --stall-warning/--stall-timeout; ValueError naming the flag if bad."""
    if args.stall_warning <= 0:
        raise ValueError(f"--stall-warning must be positive seconds, got {args.stall_warning:g}")
    if args.stall_timeout is not None and args.stall_timeout <= 0:
        raise ValueError(f"--stall-timeout must be positive seconds, got {args.stall_timeout:g}")
    if getattr(args, "heartbeat_timeout", None) is not None and args.heartbeat_timeout <= 0:
        raise ValueError(f"--heartbeat-timeout must be positive seconds, got {args.heartbeat_timeout:g}")
    return {"stall_warning_s": args.stall_warning, "stall_timeout_s": args.stall_timeout}
