"""A real SLURM cluster on this machine for tests: munged, one slurmctld, two slurmd (``n1``, ``n2``).

Everything lives in a temporary directory (config, keys, sockets, spool, logs), on free
ports, so two test sessions on one machine do not meet. The nodes are two ``slurmd``
processes on this host (``slurmd -N n1``, ``slurmd -N n2``; Debian's slurm-wlm is built
with multiple-slurmd support)::

    munged --socket DIR/munge.socket
    slurmctld            SlurmctldPort=P0
    slurmd -N n1         NodeName=n1 NodeHostname=<this host> NodeAddr=127.0.0.1 Port=P1
    slurmd -N n2         NodeName=n2 NodeHostname=<this host> NodeAddr=127.0.0.1 Port=P2

The node names are *not* put in /etc/hosts: they resolve only through SLURM
(``scontrol show node`` NodeAddr), as on clusters whose node names are not in DNS.
Clients find the cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`).

Use from a test module::

    from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm is the fixture)

    @needs_slurm
    def test_x(slurm):
        subprocess.run(["salloc", "-N2", "-n2", "srun", "hostname"], env=slurm.env, check=True)

The cluster starts once per test process (the first test that asks) and stops at exit.
Needs root, ``slurmctld``/``slurmd``/``munged`` (``apt-get install slurm-wlm munge``);
:func:`requirements_missing` says why not otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

__all__ = ["SlurmCluster", "Started", "requirements_missing", "get_cluster", "needs_slurm", "slurm", "NODES"]

NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # more than the machine has (config_overrides): a node may run 2 tasks and a step
# AuthInfo cred_expire: a step credential's lifetime, and how long a requeued job must wait before it
# starts again (SLURM's default 120 s; 15 s here keeps the preemption test short, and is still ample
# time to launch a step on a loaded machine: a credential is checked within a second or two of its issue)
CRED_EXPIRE_S = 15
_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sbatch", "scontrol", "sinfo")


def requirements_missing() -> str | None:
    """Why a SLURM cluster cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (munged and slurmd run as root)"
    missing = [t for t in _TOOLS if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return f"missing {missing}: run scripts/install-test-deps.sh (apt-get install slurm-wlm munge)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Started:
    """A command started by :meth:`SlurmCluster.start`; :meth:`wait` gives its CompletedProcess (once)."""

    def __init__(self, proc: subprocess.Popen, timeout: float) -> None:
        self.proc, self.deadline, self._done = proc, time.monotonic() + timeout, None

    def wait(self) -> subprocess.CompletedProcess:
        if self._done is None:
            try:
                out, err = self.proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
                err += f"\n(killed: still running at its timeout: {self.proc.args})"
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        return self._done


class SlurmCluster:
    """One slurmctld and two slurmd on this host; :meth:`up` starts it, :meth:`down` stops it."""

    def __init__(self, cred_expire: int = CRED_EXPIRE_S) -> None:
        self.cred_expire = cred_expire  # also how long a requeued job waits before it may start again
        self.dir = tempfile.mkdtemp(prefix="phalanx-slurm-")
        os.chmod(self.dir, 0o755)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge", "munge.socket")
        self.host = socket.gethostname().split(".")[0]
        self.nodes = NODES
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]  # a cluster inside another's job would read the outer job's variables

    # -- start / stop ------------------------------------------------------
    def up(self) -> SlurmCluster:
        try:
            self._start_munge()
            self._write_config()
            self._spawn([_tool("slurmctld"), "-D", "-i", "-f", self.conf], "slurmctld.out")
            for node in self.nodes:
                os.makedirs(os.path.join(self.dir, f"spool-{node}"), exist_ok=True)
                self._spawn([_tool("slurmd"), "-D", "-N", node, "-f", self.conf], f"slurmd-{node}.out")
            self._wait_idle(60)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL) and remove the directory."""
        if not self.procs:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=10)
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait(5)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- helpers for tests ----------------------------------------------------
    def run(self, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run a client command (salloc, sbatch, srun, scontrol …) against this cluster."""
        env = {**self.env, **kw.pop("env", {})}
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, **kw)

    def start(self, argv: list[str], timeout: float = 240, **kw) -> Started:
        """Start a client command now and collect it later (:meth:`Started.wait`): several jobs at once."""
        env = {**self.env, **kw.pop("env", {})}
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        return Started(proc, timeout)

    def log(self, name: str = "slurmctld.log", tail: int = 3000) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.dir, name)) as f:
            return f.read()[-tail:]
        return ""

    # -- internals -------------------------------------------------------------
    def _spawn(self, argv: list[str], out: str) -> subprocess.Popen:
        with open(os.path.join(self.dir, out), "w") as f:
            p = subprocess.Popen(argv, env=self.env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def _start_munge(self) -> None:
        mdir = os.path.dirname(self.munge_socket)
        os.makedirs(mdir, mode=0o700)
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self._spawn([_tool("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={mdir}/munged.pid", f"--seed-file={mdir}/munged.seed",
                     f"--log-file={mdir}/munged.log"], "munged.out")
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged.out')} {self.log('munge/munged.log')}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        ctld, *node_ports = _free_ports(1 + len(self.nodes))
        d = self.dir
        lines = [
            "ClusterName=phalanx",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "SchedulerParameters=sched_interval=1",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=NO")
        os.makedirs(f"{d}/state")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        out = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: {self.log('slurmctld.log')}")
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            out = res.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"SLURM nodes not idle after {timeout_s:.0f}s: {out!r}; {self.log('slurmctld.log')}")


_CLUSTER: SlurmCluster | None = None
_FAILED: str | None = None


def get_cluster() -> SlurmCluster:
    """The process's one cluster, started at the first call and stopped at exit."""
    global _CLUSTER, _FAILED
    if _FAILED:
        raise RuntimeError(_FAILED)
    if _CLUSTER is None:
        try:
            _CLUSTER = SlurmCluster().up()
        except Exception as err:
            _FAILED = f"the SLURM test cluster did not start: {err}"
            raise
        atexit.register(_CLUSTER.down)
    return _CLUSTER


_why = requirements_missing()
needs_slurm = pytest.mark.skipif(_why is not None, reason=f"SLURM cluster unavailable: {_why}")


@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    """The running test cluster (session-scoped; started once per test process)."""
    return get_cluster()
