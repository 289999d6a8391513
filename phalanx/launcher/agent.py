"""The host side of a multi-host launch: what ``ssh host python -m phalanx.launcher.agent …`` runs.

Three modes, each started by the launcher on the machine you typed the command on
(:mod:`phalanx.launcher.ssh`, :mod:`phalanx.launcher.supervisor`)::

    agent  OPTIONS -- CMD   this host's share of `phalanx run -H …`: a TorchElastic agent
                            (phalanx.launcher.local) running --nproc workers; rendezvous on --rdzv
    worker OPTIONS -- CMD   one in-process elastic worker (the supervisor adds it on a discovered host)
    timeline-parts PATH     print this host's PATH.rank<N> timeline parts as JSON, then remove them

``agent`` and ``worker`` read the job secret from stdin first (:func:`handoff.receive`)
and then keep reading: EOF (the launcher stopped the job, or died) stops the workers.
They exit with the workers' status (128 + N when signal N ended a worker).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import threading

from phalanx.launcher import handoff
from phalanx.launcher.worker_output import stop_processes

__all__ = ["agent_main", "worker_main", "timeline_parts_main", "main"]

_GRACE_S = 10.0
_EXEC_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exec.py")


def _split(argv: list[str], prog: str, mode: str) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        sys.exit(f"usage: python -m {handoff.AGENT_MODULE} {mode} OPTIONS -- COMMAND ({prog})")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _common(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--network-interface", default=None)
    p.add_argument("--env", action="append", default=[])
    return p


def agent_main(argv: list[str]) -> int:
    """``agent OPTIONS -- COMMAND``: this host's workers under a TorchElastic agent."""
    from phalanx.launcher.local import LaunchSpec, launch

    p = _common("phalanx-agent")
    p.add_argument("--rdzv", required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--local-addr", default=None)
    p.add_argument("--is-host", action="store_true")
    p.add_argument("--start-timeout", type=int, default=60)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--ranks-filter", default=None)
    p.add_argument("--max-restarts", type=int, default=0)  # group restarts (every node's agent re-forms)
    options, command = _split(argv, "phalanx-agent", "agent")
    args = p.parse_args(options)
    try:
        secret_path, env = handoff.receive(args.env, args.network_interface)
    except handoff.NoSecret as err:
        print(f"phalanx agent: {err}", file=sys.stderr)
        return 2
    threading.Thread(target=_stop_at_eof, args=(os.getpid(),), daemon=True).start()
    spec = LaunchSpec(nproc_per_node=args.nproc, min_nodes=args.nnodes, max_nodes=args.nnodes,
                      rdzv_endpoint=args.rdzv, run_id=args.run_id, start_timeout_s=args.start_timeout,
                      local_addr=args.local_addr, env=env, rdzv_extra={"is_host": args.is_host},
                      log_dir=args.log_dir, max_restarts=args.max_restarts,
                      ranks_filter=frozenset(map(int, args.ranks_filter.split(","))) if args.ranks_filter else None)
    try:
        return launch(spec, command)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(secret_path)


def _stop_at_eof(pid: int) -> None:
    sys.stdin.read()  # returns at EOF: the launcher is gone or asks us to stop
    os.kill(pid, signal.SIGTERM)


def worker_main(argv: list[str]) -> int:
    """``worker OPTIONS -- COMMAND``: one in-process elastic worker on this host."""
    options, command = _split(argv, "phalanx-worker", "worker")
    args = _common("phalanx-worker").parse_args(options)
    try:
        secret_path, extra = handoff.receive(args.env, args.network_interface)
    except handoff.NoSecret as err:
        print(f"phalanx worker: {err}", file=sys.stderr)
        return 2
    proc = subprocess.Popen([sys.executable, _EXEC_SHIM, *command], env={**os.environ, **extra})

    def stop_at_eof() -> None:
        sys.stdin.read()
        stop_processes([proc], _GRACE_S)

    threading.Thread(target=stop_at_eof, daemon=True).start()
    try:
        code = proc.wait()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(secret_path)
    return 128 - code if code < 0 else code


def timeline_parts_main(path: str) -> int:
    """``timeline-parts PATH``: print this host's parts as JSON ``{name: text}``, then remove them."""
    found = {}
    for name in sorted(glob.glob(glob.escape(path) + ".rank*")):
        with open(name) as f:
            found[name] = f.read()
    print(json.dumps(found))
    sys.stdout.flush()
    for name in found:
        with contextlib.suppress(OSError):
            os.remove(name)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "agent":
        return agent_main(rest)
    if mode == "worker":
        return worker_main(rest)
    if mode == "timeline-parts" and len(rest) == 1:
        return timeline_parts_main(rest[0])
    print(f"usage: python -m {handoff.AGENT_MODULE} agent|worker OPTIONS -- COMMAND, or timeline-parts PATH "
          "(the launcher runs this; you do not need to)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
