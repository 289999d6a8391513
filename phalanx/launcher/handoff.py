"""What the launcher hands a process it starts on another host over SSH, and how that side reads it.

Both SSH paths use it: ``phalanx run -H …`` starts one agent per host
(:mod:`phalanx.launcher.ssh` → :mod:`phalanx.launcher.agent`), and the in-process
elastic supervisor starts single workers on discovered hosts
(:mod:`phalanx.launcher.supervisor` → ``agent worker``)::

    launcher side                                 host side
    remote_command(mode, env, iface, cmd) ──ssh──> python -m phalanx.launcher.agent MODE --env K=V … -- CMD
    send_secret(proc, key)  ── stdin line ──────> receive(env_pairs, iface): the secret into a 0600 file,
                            (then kept open;                                  PHALANX_SECRET_FILE, K=V,
                             EOF means "stop now")                            GLOO/NCCL_SOCKET_IFNAME

The secret never appears on a command line; the environment does (it holds no secret).

Example::

    remote = remote_command("worker", {"PHALANX_TIMEOUT": "60"}, "eth0", ["python", "train.py"])
    proc = subprocess.Popen(ssh.command(host, remote), stdin=subprocess.PIPE, text=True)
    send_secret(proc, key)
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from phalanx.launcher import secret as job_secret

__all__ = ["AGENT_MODULE", "remote_command", "send_secret", "receive", "NoSecret"]

AGENT_MODULE = "phalanx.launcher.agent"


class NoSecret(RuntimeError):
    """The host side read no job secret on its standard input."""


def remote_command(mode: str, env: Mapping[str, str], network_interface: str | None, command: Sequence[str],
                   options: Sequence[str] = (), python: str | None = None) -> str:
    """The shell line ssh runs on the host: this working directory, this interpreter, the agent in ``mode``."""
    argv = [python or sys.executable, "-m", AGENT_MODULE, mode, *options]
    if network_interface:
        argv += ["--network-interface", network_interface]
    for k, v in env.items():
        argv += ["--env", f"{k}={v}"]
    return f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec {shlex.join([*argv, '--', *command])}"


def send_secret(proc, key: bytes) -> None:
    """Write the job secret as the first line of ``proc``'s stdin (left open: EOF means stop)."""
    proc.stdin.write(key.decode() + "\n")
    proc.stdin.flush()


def receive(env_pairs: Sequence[str], network_interface: str | None, stdin=None) -> tuple[str, dict[str, str]]:
    """Host side: read the secret line, store it 0600; return (its path, the workers' extra environment).

    Raises :class:`NoSecret` when stdin holds no secret (not started by ``phalanx run``).
    """
    key = (stdin or sys.stdin).readline().strip().encode()
    if not key:
        raise NoSecret("no job secret on stdin; start it with `phalanx run`")
    path = job_secret.write_secret_file(key)
    env = dict(kv.split("=", 1) for kv in env_pairs)
    env[job_secret.SECRET_FILE_ENV] = path
    if network_interface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = network_interface
    return path, env
