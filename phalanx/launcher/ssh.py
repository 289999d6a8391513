"""Multi-host launch over SSH: one TorchElastic agent per host, rendezvous on the first host.

``phalanx run -np 4 -H a:2,b:2 python train.py`` does, from the machine you type it on::

    launcher ──ssh a── agent a (c10d rendezvous store host) ── workers rank 0,1
             └─ssh b── agent b (joins a:PORT)                  ── workers rank 2,3
       stdin of each ssh: the job secret, then kept open (EOF = "stop now")
       stdout of each ssh: the workers' "[rank]: line" output, streamed back

* Every host is first probed (``ssh host true``, in parallel, ConnectTimeout 5 s);
  one that cannot be reached fails the launch at once, naming it and SSH's error.
* Ranks are host-major: TorchElastic gives each agent a contiguous block of
  global ranks (agents are ordered by their address), with LOCAL_RANK and
  GROUP_RANK (= cross rank) set accordingly.
* When any host's agent exits non-zero (a worker failed) or the user hits
  Ctrl-C, the launcher closes every other agent's stdin; each agent then stops
  its workers (SIGTERM, then SIGKILL) and exits; ssh clients still running after
  a grace period are killed.
* The secret reaches agents on stdin and workers through a 0600 file
  (``PHALANX_SECRET_FILE``); it is never on a command line.
* ``--timeline FILE``: every worker writes ``FILE.rank<N>`` on its own host; after
  the job the launcher collects the parts from each host over SSH and merges them.

This module is the launcher side; the host side is :mod:`phalanx.launcher.agent`
(``python -m phalanx.launcher.agent agent …``), and what passes between them (the
secret, the environment) is :mod:`phalanx.launcher.handoff`. The in-process elastic
supervisor (:mod:`phalanx.launcher.supervisor`) uses the same SSH options and probe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence

from phalanx.launcher import handoff, tf_config
from phalanx.launcher import secret as job_secret
from phalanx.launcher.hosts import Host
from phalanx.log import get_logger
from phalanx.settings import LauncherSettings

__all__ = ["SSHOptions", "UnreachableHost", "probe", "launch_remote", "run_remote", "add_remote_arguments"]

log = get_logger(__name__)
_GRACE_S = 10.0


class UnreachableHost(RuntimeError):
    """A host did not answer ``ssh host true``; the message names it and SSH's error."""


class SSHOptions:
    """How to reach the hosts: ``ssh [-F config] [-i identity] [-p port] [-l user] host``."""

    def __init__(self, config: str | None = None, identity: str | None = None, port: int | None = None,
                 user: str | None = None, connect_timeout: int = 5, extra: Sequence[str] = ()) -> None:
        self.argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}"]
        if config:
            self.argv += ["-F", config]
        if identity:
            self.argv += ["-i", identity]
        if port:
            self.argv += ["-p", str(port)]
        if user:
            self.argv += ["-l", user]
        self.argv += list(extra)

    def command(self, host: str, remote: str) -> list[str]:
        return [*self.argv, host, remote]


def probe(hosts: list[str], ssh: SSHOptions, timeout_s: float) -> None:
    """Run ``ssh host true`` on every host at once; raise :class:`UnreachableHost` naming those that fail."""
    procs = {h: subprocess.Popen(ssh.command(h, "true"), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for h in dict.fromkeys(hosts)}
    errors = []
    for h, p in procs.items():
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            err = f"no answer within {timeout_s:.0f}s"
        if p.returncode:
            errors.append(f"host {h!r} cannot be reached by ssh: {err.strip() or f'exit {p.returncode}'}")
    if errors:
        raise UnreachableHost("; ".join(errors))


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        # Worker lines already carry "[rank]: "; the agent's own lines get the host name.
        out.write(line if line.startswith("[") else f"[{prefix}] {line}")
        out.flush()
    stream.close()


def launch_remote(
    hosts: list[Host],
    np: int,
    command: list[str],
    *,
    ssh: SSHOptions | None = None,
    network_interface: str | None = None,
    start_timeout: int = 60,
    env: dict[str, str] | None = None,
    port: int | None = None,
    python: str | None = None,
    log_dir: str | None = None,
    ranks_filter: frozenset[int] | None = None,
) -> int:
    """Start ``command`` on ``np`` workers spread over ``hosts`` (host order, filling slots); return the exit code.

    Example::

        launch_remote([Host("a", 2), Host("b", 2)], 4, ["python", "train.py"],
                      ssh=SSHOptions(config="~/.ssh/config"), network_interface="eth0")

    ``log_dir``: each host keeps its ranks' output in ``log_dir/rank.N/`` on its own disk;
    ``ranks_filter``: the local ranks whose output each host streams back.
    """
    ssh = ssh or SSHOptions()
    plan, left = [], np
    for h in hosts:
        if left <= 0:
            break
        plan.append((h.name, min(h.slots, left)))
        left -= plan[-1][1]
    if left > 0:
        raise ValueError(f"-np {np} exceeds the {sum(h.slots for h in hosts)} slots of the hosts given")
    if len({k for _, k in plan}) != 1:
        log.warning("hosts run different numbers of workers %s; hierarchical collectives fall back to flat",
                    [k for _, k in plan])
    probe([h for h, _ in plan], ssh, timeout_s=15)
    key = job_secret.new_secret()
    run_id = uuid.uuid4().hex[:12]
    port = port or random.randint(20000, 40000)
    rdzv = f"{plan[0][0]}:{port}"
    procs: list[tuple[str, subprocess.Popen]] = []
    pumps = []
    for index, (host, slots) in enumerate(plan):
        options = ["--rdzv", rdzv, "--nnodes", str(len(plan)), "--nproc", str(slots), "--run-id", run_id,
                   "--local-addr", host, "--start-timeout", str(start_timeout)] + (["--is-host"] if index == 0 else [])
        if log_dir:
            options += ["--log-dir", os.path.abspath(log_dir)]
        if ranks_filter is not None:
            options += ["--ranks-filter", ",".join(map(str, sorted(ranks_filter)))]
        host_env = {**(env or {}), **tf_config.host_env(plan, index)}  # TF_CONFIG's worker list (tf_config.py)
        remote = handoff.remote_command("agent", host_env, network_interface, command, options, python=python)
        p = subprocess.Popen(ssh.command(host, remote), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        handoff.send_secret(p, key)
        procs.append((host, p))
        t = threading.Thread(target=_pump, args=(p.stdout, host, sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    return _supervise(procs, pumps)


def _supervise(procs, pumps) -> int:
    stop = threading.Event()
    previous = {}

    def on_signal(signum, _frame):
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            previous[sig] = signal.signal(sig, on_signal)
    code, failed_host = 0, None
    try:
        while not stop.is_set():
            running = [(h, p) for h, p in procs if p.poll() is None]
            bad = [(h, p) for h, p in procs if p.poll() not in (None, 0)]
            if bad:
                failed_host, p = bad[0]
                code = p.returncode
                break
            if not running:
                break
            time.sleep(0.1)
        if stop.is_set():
            code = 130
            print("phalanx: interrupted; stopping the workers on every host", file=sys.stderr, flush=True)
    finally:
        _stop_all(procs)
        for t in pumps:
            t.join(2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed_host is not None:
        what = "cannot be reached by ssh" if code == 255 else f"exited with code {code}"
        others = [h for h, _ in procs if h != failed_host]
        print(f"phalanx: the agent on host {failed_host} {what}; stopped the job on {others}",
              file=sys.stderr, flush=True)
    return code


def _stop_all(procs) -> None:
    for _, p in procs:  # EOF on stdin tells each agent to stop its workers and exit
        with contextlib.suppress(OSError, ValueError):
            p.stdin.close()
    deadline = time.monotonic() + _GRACE_S
    for _, p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    for _, p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """The multi-host options of ``phalanx run``."""
    p.add_argument("--network-interface", "--network-interfaces", default=None, metavar="IFACE",
                   help="interface the workers talk on (sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)")
    p.add_argument("--ssh-config", "-F", default=None, help="ssh_config file to reach the hosts")
    p.add_argument("--ssh-identity", "-i", "--ssh-identity-file", default=None, help="ssh private key")
    p.add_argument("--ssh-port", "-p", type=int, default=None, help="ssh port on every host")
    p.add_argument("--ssh-user", default=None, help="user name on the hosts")
    p.add_argument("--rdzv-port", type=int, default=None,
                   help="port of the rendezvous store on the first host (default: random 20000-40000)")


def run_remote(args: argparse.Namespace, hosts: list[Host], command: list[str],
               env: dict[str, str] | None = None, ranks_filter: frozenset[int] | None = None) -> int:
    """``phalanx run`` with remote hosts: validate, then :func:`launch_remote`.

    ``env``: what the run's options export to every worker (``run_cmd.job_env``).
    """
    np = args.np or sum(h.slots for h in hosts)
    env = dict(env or {})
    timeline = LauncherSettings.one("timeline", env)  # the workers write PATH.rank<N> on their own host
    ssh = SSHOptions(config=args.ssh_config, identity=args.ssh_identity, port=args.ssh_port, user=args.ssh_user)
    try:
        code = launch_remote(hosts, np, command, ssh=ssh, network_interface=args.network_interface,
                             start_timeout=args.start_timeout, env=env, port=args.rdzv_port,
                             log_dir=args.log_dir, ranks_filter=ranks_filter)
    except (UnreachableHost, ValueError) as err:
        print(f"phalanx run: {err}", file=sys.stderr, flush=True)
        return 255 if isinstance(err, UnreachableHost) else 2
    if timeline:
        used, left = [], np
        for h in hosts:
            if left > 0:
                used.append(h.name)
                left -= h.slots
        _gather_timeline(timeline, used, ssh)
    return code


def _gather_timeline(path: str, hosts: list[str], ssh: SSHOptions, timeout_s: float = 60.0) -> None:
    """Bring every host's ``PATH.rank<N>`` parts here and merge them into ``PATH``.

    Each host hands over (and removes) the parts it holds, all hosts are read before
    anything is written here, so a filesystem shared by the hosts (NFS, or the
    simulated cluster) and separate disks both end with one merged file and no parts.
    """
    from phalanx.profiler.timeline import merge_parts

    python = sys.executable
    parts: dict[str, str] = {}
    for host in dict.fromkeys(hosts):
        remote = f"exec {shlex.join([python, '-m', handoff.AGENT_MODULE, 'timeline-parts', path])}"
        try:
            res = subprocess.run(ssh.command(host, remote), stdin=subprocess.DEVNULL, capture_output=True,
                                 text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("timeline: host %s did not hand over its parts within %.0fs", host, timeout_s)
            continue
        if res.returncode:
            log.warning("timeline: could not read the parts on host %s: %s", host, res.stderr.strip()[-500:])
            continue
        parts.update(json.loads(res.stdout or "{}"))
    for name, text in parts.items():
        if os.path.dirname(name) == os.path.dirname(path) and os.path.basename(name).startswith(
                os.path.basename(path) + ".rank"):  # never write outside the timeline's own name
            with open(name, "w") as f:
                f.write(text)
    merge_parts(path)
