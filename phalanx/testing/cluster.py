"""A simulated cluster on one Linux machine: network namespaces on a bridge, capped links, sshd.

Each "host" is a network namespace with its own address on a private bridge,
its link capped with ``tc tbf`` in both directions (egress inside the namespace,
and egress of the bridge-side veth, i.e. the host's ingress). With ``ssh=True``
each host also runs its own ``sshd`` bound to its address, with a generated host
key and a generated job key in ``authorized_keys``; :attr:`SimCluster.ssh_config`
is an ssh_config file that reaches every host by its address::

    root namespace:  pxcbr<id> 10.213.N.1/24
                        |-- veth pxc<id>h0 <-> [ns pxc-<id>-h0] px0 10.213.N.2  tbf rate R, sshd
                        |-- veth pxc<id>h1 <-> [ns pxc-<id>-h1] px0 10.213.N.3  tbf rate R, sshd

Every name starts with ``pxc`` so ``teardown_all()`` (``phalanx cluster down``)
finds what a crashed test left. Needs root, ``ip`` and ``tc`` (and ``sshd`` for ssh).

Example::

    from phalanx.testing.cluster import SimCluster
    with SimCluster(hosts=2, rate="1gbit", ssh=True) as c:
        c.exec(0, ["ping", "-c1", c.addresses[1]])
        # phalanx run -H 10.213.N.2:2,10.213.N.3:2 --ssh-config c.ssh_config --network-interface px0 …
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time

__all__ = ["SimCluster", "ClusterUnavailable", "requirements_missing", "teardown_all", "PREFIX", "IFNAME"]

PREFIX = "pxc"
IFNAME = "px0"  # the interface name inside every simulated host
_STATE_ROOT = os.path.join(tempfile.gettempdir(), "phalanx-cluster")


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a simulated cluster (not root, or tools missing)."""


def requirements_missing(ssh: bool = False) -> str | None:
    """Why a simulated cluster cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces, veth, tc)"
    tools = ["ip", "tc"] + (["sshd", "ssh", "ssh-keygen"] if ssh else [])
    missing = [t for t in tools if not shutil.which(t) and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return f"missing tools {missing}: apt-get install iproute2 openssh-server openssh-client"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode:
        return f"cannot create network namespaces: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def _free_subnet() -> int:
    used = set(int(m) for m in re.findall(r"inet 10\.213\.(\d+)\.", _ip("-o", "addr").stdout))
    for n in range(1, 255):
        if n not in used:
            return n
    raise ClusterUnavailable("no free 10.213.N.0/24 subnet left; run `phalanx cluster down`")


def _burst_bytes(rate: str) -> int:
    """tbf needs a bucket of at least rate/HZ; give it 2 ms of traffic (>= 64 KiB for GSO packets)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.lower())
    if not m:
        raise ValueError(f"rate={rate!r}: write it as tc does, e.g. 1gbit, 100mbit, 500kbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    bytes_per_s = float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)
    return max(64 * 1024, int(bytes_per_s * 0.002))


class SimCluster:
    """N simulated hosts; use as a context manager (teardown runs even when the body raises)."""

    def __init__(self, hosts: int = 2, rate: str | None = "1gbit", ssh: bool = False) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be >= 1, got {hosts}")
        if rate is not None:
            _burst_bytes(rate)  # validate before touching the system
        self.n, self.rate, self.ssh = hosts, rate, ssh
        self.id = secrets.token_hex(2)
        self.bridge = f"{PREFIX}br{self.id}"
        self.namespaces = [f"{PREFIX}-{self.id}-h{i}" for i in range(hosts)]
        self.state_dir = os.path.join(_STATE_ROOT, self.id)
        self.addresses: list[str] = []
        self.ssh_config: str | None = None
        self.sshd_pids: list[int] = []

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> SimCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> SimCluster:
        why = requirements_missing(self.ssh)
        if why:
            raise ClusterUnavailable(why)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        try:
            # Two clusters coming up at once (parallel test workers, two users) must not pick the
            # same subnet: choosing it and claiming it on the bridge is one step under a file lock.
            with open(os.path.join(_STATE_ROOT, ".subnet.lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                subnet = _free_subnet()
                self.gateway = f"10.213.{subnet}.1"
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                addr = f"10.213.{subnet}.{i + 2}"
                outer, inner = f"{PREFIX}{self.id}h{i}", f"{PREFIX}{self.id}i{i}"
                _ip("netns", "add", ns)
                # `ip netns exec` bind-mounts /etc/netns/NS/* over /etc: no DNS server is
                # reachable from the namespace, so lookups must fail fast instead of timing out.
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:
                    f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write("127.0.0.1 localhost\n" + "".join(
                        f"10.213.{subnet}.{j + 2} {n}\n" for j, n in enumerate(self.namespaces)))
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("-n", ns, "link", "set", inner, "name", IFNAME)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "default", "via", self.gateway)
                if self.rate:
                    self._cap(ns, IFNAME)
                    self._cap(None, outer)
                self.addresses.append(addr)
            if self.ssh:
                self._start_sshd()
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _cap(self, ns: str | None, dev: str) -> None:
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
               "burst", str(_burst_bytes(self.rate)), "latency", "50ms"]
        if ns:
            cmd = ["ip", "netns", "exec", ns, *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")

    def exec(self, host: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside simulated host ``host`` and wait for it."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(["ip", "netns", "exec", self.namespaces[host], *argv], **kw)

    def popen(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], **kw)

    def host_spec(self, slots: int) -> str:
        """``-H`` value naming every host with ``slots`` slots."""
        return ",".join(f"{a}:{slots}" for a in self.addresses)

    def down(self) -> None:
        """Stop sshd and every process in the namespaces, remove links, namespaces and files."""
        _teardown(self.id)

    # -- sshd --------------------------------------------------------------
    def _start_sshd(self) -> None:
        d = self.state_dir
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-f", f"{d}/host_key"], check=True)
        subprocess.run([*keygen, "-f", f"{d}/job_key", "-C", f"phalanx-cluster-{self.id}"], check=True)
        shutil.copy(f"{d}/job_key.pub", f"{d}/authorized_keys")
        os.chmod(f"{d}/authorized_keys", 0o600)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        host_pub = open(f"{d}/host_key.pub").read().split()[:2]
        known, config = [], []
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for i, addr in enumerate(self.addresses):
            cfg = f"{d}/sshd_{i}.conf"
            with open(cfg, "w") as f:
                f.write(
                    f"ListenAddress {addr}\nPort 22\nHostKey {d}/host_key\nPidFile {d}/sshd_{i}.pid\n"
                    f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    "StrictModes no\nAcceptEnv PHALANX_*\nMaxStartups 100\nMaxSessions 100\n"
                )
            res = self.exec(i, [sshd, "-f", cfg, "-E", f"{d}/sshd_{i}.log"])
            if res.returncode:
                raise RuntimeError(f"sshd on simulated host {i} failed: {res.stderr.strip()}; "
                                   f"see {d}/sshd_{i}.log")
            known.append(f"{addr} {' '.join(host_pub)}")
            config.append(
                f"Host {addr}\n  IdentityFile {d}/job_key\n  IdentitiesOnly yes\n  User root\n"
                f"  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n"
                "  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n"
            )
        with open(f"{d}/known_hosts", "w") as f:
            f.write("\n".join(known) + "\n")
        self.ssh_config = f"{d}/ssh_config"
        with open(self.ssh_config, "w") as f:
            f.write("\n".join(config))
        deadline = time.monotonic() + 10
        for i in range(len(self.addresses)):
            pidfile = f"{d}/sshd_{i}.pid"
            while not os.path.exists(pidfile) and time.monotonic() < deadline:
                time.sleep(0.05)
            with contextlib.suppress(OSError, ValueError):
                self.sshd_pids.append(int(open(pidfile).read()))

    def _save(self) -> None:
        with open(os.path.join(self.state_dir, "cluster.json"), "w") as f:
            json.dump({"id": self.id, "addresses": self.addresses, "namespaces": self.namespaces,
                       "bridge": self.bridge, "rate": self.rate, "ssh_config": self.ssh_config,
                       "interface": IFNAME}, f, indent=1)


def _ns_pids(ns: str) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split()]


def _teardown(cluster_id: str | None) -> list[str]:
    """Remove what belongs to cluster ``cluster_id`` (every ``pxc`` cluster when None); return it."""
    removed = []
    tag = f"{PREFIX}-{cluster_id}-" if cluster_id else f"{PREFIX}-"
    namespaces = [n.split()[0] for n in _ip("netns", "list", check=False).stdout.splitlines() if n.strip()]
    for ns in namespaces:
        if not ns.startswith(tag):
            continue
        for _ in range(3):  # sshd, agents and workers living in the namespace
            pids = _ns_pids(ns)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        removed.append(f"netns {ns}")
    ours = (f"{PREFIX}{cluster_id}", f"{PREFIX}br{cluster_id}") if cluster_id else (PREFIX,)
    for name in re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, flags=re.M):
        if name.startswith(ours):  # veths usually went with their namespace; the bridge did not
            _ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    dirs = [os.path.join(_STATE_ROOT, cluster_id)] if cluster_id else glob.glob(os.path.join(_STATE_ROOT, "*"))
    for d in dirs:
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(f"dir {d}")
    return removed


def teardown_all() -> list[str]:
    """Remove every namespace, link, sshd and state dir with the ``pxc`` prefix (``phalanx cluster down``)."""
    return _teardown(None)


def leftovers(cluster_id: str | None = None) -> list[str]:
    """Namespaces and links with our prefix (of one cluster, or any) that still exist."""
    tag = f"{PREFIX}-{cluster_id}-" if cluster_id else f"{PREFIX}-"
    ns = [n.split()[0] for n in _ip("netns", "list", check=False).stdout.splitlines()
          if n.strip() and n.startswith(tag)]
    link_tags = (f"{PREFIX}{cluster_id}", f"{PREFIX}br{cluster_id}") if cluster_id else (PREFIX,)
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", "show", check=False).stdout, flags=re.M)
    return ns + [ln for ln in links if ln.startswith(link_tags)]
