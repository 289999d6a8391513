"""Runtime: who this process is, who its peers are, and the groups that join them.

``init()`` reads the environment of whatever started the process, brings up
PyTorch's default process group (gloo on CPU, NCCL on CUDA) and returns an
immutable :class:`Topology`. Strategies take that object as an argument; no
strategy reads a module global.

Launchers understood, in the order they are tried::

    phalanx run / torchrun   RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR/PORT
    SLURM (srun)             SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NODEID SLURM_JOB_NODELIST
    Open MPI (mpirun)        OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}
    MPICH / Intel MPI (PMI)  PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS
    plain ``python x.py``    a world of one; no error, collectives return at once

Example::

    import phalanx as px
    topo = px.init()              # gloo+CPU here, NCCL+cuda:local_rank on GPUs
    print(topo.rank, topo.size, topo.local_rank, topo.cross_rank)
    px.shutdown()
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import hashlib
import os
import re
import socket
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = [
    "LaunchInfo",
    "Topology",
    "detect_environment",
    "expand_nodelist",
    "init",
    "shutdown",
    "is_initialized",
    "topology",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when neither ``init(timeout=…)`` nor PHALANX_TIMEOUT says otherwise."""

_DEFAULT_PORT = 29500


class PhalanxRuntimeError(RuntimeError):
    """Raised for a misconfigured launch environment or use before ``init()``."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process, before any connection is made."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    master_addr: str
    master_port: int
    source: str  # "phalanx", "torchrun", "slurm", "openmpi", "pmi" or "single"


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise PhalanxRuntimeError(f"environment variable {key} is missing; the launcher should set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise PhalanxRuntimeError(f"environment variable {key}={value!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list: ``"gpu[01-03,07],cpu1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]``."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            for i in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    return hosts


def _port_from_job(job_id: str) -> int:
    # Every rank of one job derives the same port without talking to the others.
    digest = hashlib.sha256(job_id.encode()).digest()
    return 20000 + int.from_bytes(digest[:2], "little") % 20000


def detect_environment(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, sizes and the rendezvous address from the launcher's variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        size = _int(env, "WORLD_SIZE")
        local_size = _int(env, "LOCAL_WORLD_SIZE", size)
        cross_size = _int(env, "GROUP_WORLD_SIZE", max(1, size // max(local_size, 1)))
        return LaunchInfo(
            rank=_int(env, "RANK"),
            size=size,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_size=local_size,
            cross_rank=_int(env, "GROUP_RANK", 0),
            cross_size=cross_size,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", _DEFAULT_PORT),
            source="phalanx" if "PHALANX_LAUNCHER" in env else "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
        size = _int(env, "SLURM_NTASKS")
        cross_size = _int(env, "SLURM_NNODES", len(nodes))
        return LaunchInfo(
            rank=_int(env, "SLURM_PROCID"),
            size=size,
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_size=_slurm_local_size(env, size, cross_size),
            cross_rank=_int(env, "SLURM_NODEID", 0),
            cross_size=cross_size,
            master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=_int(env, "MASTER_PORT", _port_from_job(env.get("SLURM_JOB_ID", "slurm"))),
            source="slurm",
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi_info(
            env,
            source="openmpi",
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
            node_rank=env.get("OMPI_COMM_WORLD_NODE_RANK"),
            job=env.get("OMPI_MCA_orte_ess_jobid", env.get("OMPI_MCA_ess_base_jobid", "ompi")),
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpi_info(
            env,
            source="pmi",
            rank=_int(env, "PMI_RANK"),
            size=_int(env, "PMI_SIZE"),
            local_rank=_int(env, "MPI_LOCALRANKID", 0),
            local_size=_int(env, "MPI_LOCALNRANKS", 1),
            node_rank=None,
            job=env.get("PMI_KVSNAME", env.get("PMI_ID", "pmi")),
        )
    return LaunchInfo(0, 1, 0, 1, 0, 1, "127.0.0.1", _DEFAULT_PORT, "single")


def _slurm_local_size(env: Mapping[str, str], size: int, nnodes: int) -> int:
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    match = re.match(r"(\d+)", per_node)
    return int(match.group(1)) if match else max(1, size // max(nnodes, 1))


def _mpi_info(env, *, source, rank, size, local_rank, local_size, node_rank, job) -> LaunchInfo:
    single_host = local_size == size
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if not single_host:
            raise PhalanxRuntimeError(
                f"{source}: a job across hosts needs MASTER_ADDR set to the host of rank 0, "
                "e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 …`"
            )
        addr = "127.0.0.1"
    cross_rank = int(node_rank) if node_rank is not None else rank // max(local_size, 1)
    return LaunchInfo(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=max(1, size // max(local_size, 1)),
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT", _port_from_job(job)),
        source=source,
    )


class _Groups:
    """Lazily built process groups of one topology (not part of its identity)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        with self._lock:
            if ranks not in self._cache:
                # Only the members synchronise, so a group can be made on first use
                # by the ranks that need it, without a world-wide barrier.
                self._cache[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            return self._cache[ranks]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Immutable description of the job as seen from this rank.

    ``hosts[h]`` lists the global ranks on host ``h`` (host-major order).
    ``local_group()`` joins the ranks of this host, ``cross_group()`` the ranks
    with this local rank on every host — the two levels of a hierarchical
    collective. Groups are created on first use by their members.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    backend: str
    device: torch.device
    hosts: tuple[tuple[int, ...], ...]
    timeout_s: float = DEFAULT_TIMEOUT_S
    _groups: _Groups = dataclasses.field(default_factory=_Groups, compare=False, repr=False)

    @property
    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    def world_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def local_group(self) -> dist.ProcessGroup:
        """The ranks on this host."""
        return self._groups.get(self.hosts[self.cross_rank])

    def cross_group(self) -> dist.ProcessGroup:
        """One rank per host: those whose local rank equals ours."""
        peers = tuple(h[self.local_rank] for h in self.hosts if self.local_rank < len(h))
        return self._groups.get(peers)

    def group(self, ranks) -> dist.ProcessGroup:
        """Any group of global ranks, created once and cached (members must call)."""
        return self._groups.get(tuple(sorted(int(r) for r in ranks)))


_lock = threading.Lock()
_topology: Topology | None = None
_owns_default_group = False


def _timeout_s(timeout: float | datetime.timedelta | None) -> float:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if timeout is None:
        raw = os.environ.get("PHALANX_TIMEOUT", str(DEFAULT_TIMEOUT_S))
        try:
            timeout = float(raw)
        except ValueError:
            raise PhalanxRuntimeError(f"PHALANX_TIMEOUT={raw!r} is not a number of seconds") from None
    if timeout <= 0:
        raise PhalanxRuntimeError(f"timeout must be positive seconds, got {timeout}")
    return float(timeout)


def _choose_backend_and_device(info: LaunchInfo, backend: str | None, device) -> tuple[str, torch.device]:
    backend = backend or os.environ.get("PHALANX_BACKEND")
    device = device or os.environ.get("PHALANX_DEVICE")
    cuda = torch.cuda.is_available()
    if device is None:
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    device = torch.device(device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise PhalanxRuntimeError(
            f"backend 'nccl' needs a CUDA device but device is {device}; use backend='gloo' on CPU"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend, device


def init(
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Topology:
    """Join the job and return its :class:`Topology`. Calling it again returns the same one.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is present, else gloo
            (env PHALANX_BACKEND).
        device: the device this rank computes on; default ``cuda:local_rank`` or CPU
            (env PHALANX_DEVICE).
        timeout: seconds a collective may wait for its peers before it raises
            (default 300, env PHALANX_TIMEOUT).
    """
    global _topology, _owns_default_group
    with _lock:
        if _topology is not None:
            return _topology
        _register_exit_shutdown()
        info = detect_environment()
        backend, device = _choose_backend_and_device(info, backend, device)
        timeout_s = _timeout_s(timeout)
        td = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            # Someone (the user, a test framework) already made the default group: adopt it.
            _owns_default_group = False
            backend = dist.get_backend()
            info = dataclasses.replace(info, rank=dist.get_rank(), size=dist.get_world_size())
        else:
            _owns_default_group = True
            kwargs = {"backend": backend, "timeout": td}
            if device.type == "cuda":
                kwargs["device_id"] = device
            store = dist.HashStore() if info.size == 1 else _rendezvous_store(info, td)
            import_dynamo_first()
            dist.init_process_group(store=store, rank=info.rank, world_size=info.size, **kwargs)
        hosts = _gather_hosts(info, device)
        _topology = Topology(
            rank=info.rank,
            size=info.size,
            local_rank=info.local_rank,
            local_size=len(hosts[info.cross_rank]) if info.cross_rank < len(hosts) else info.local_size,
            cross_rank=info.cross_rank,
            cross_size=len(hosts),
            backend=backend,
            device=device,
            hosts=hosts,
            timeout_s=timeout_s,
        )
        return _topology


def bound_tcp_store(host: str, port: int, *, timeout: datetime.timedelta, world_size: int | None = None,
                    multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server that listens on ``host``'s address only, not on every interface.

    torch's TCPStore binds the wildcard address; a socket bound here and handed over
    through ``master_listen_fd`` keeps the store off other networks. ``port`` 0 picks a
    free one (read it back from ``store.port``). With ``multi_tenant=True`` a later
    ``TCPStore(..., multi_tenant=True)`` on the same port in this process (TorchElastic's
    rendezvous) reuses this server. Falls back to torch's default binding, with a log
    line, where the address cannot be bound or this torch lacks ``master_listen_fd``.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=sock.detach())
    except (OSError, TypeError, RuntimeError, ValueError) as err:
        from phalanx.log import get_logger

        get_logger(__name__).info("store on %s:%s binds all addresses (%s)", host, port, err)
        return dist.TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, multi_tenant=multi_tenant)
    return store  # the server owns the listening fd now (detached from the Python socket)


_stores: dict[tuple[str, int], dist.Store] = {}
_generation = 0


def _rendezvous_store(info: LaunchInfo, timeout: datetime.timedelta) -> dist.Store:
    """The job's TCPStore, kept for the life of the process; each ``init()`` gets a fresh prefix.

    Re-using one store across shutdown/init avoids a race in which a fast rank
    reconnects to the store of the previous generation while rank 0 replaces it.
    Under torchrun or ``phalanx run`` the agent hosts the store and every worker
    is a client (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 hosts it.
    """
    global _generation
    key = (info.master_addr, info.master_port)
    if key not in _stores:
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if info.rank == 0 and not agent_hosts:
            _stores[key] = bound_tcp_store(info.master_addr, info.master_port, timeout=timeout,
                                           world_size=info.size)
        else:
            _stores[key] = dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout,
                                         wait_for_workers=False)
    _generation += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"phalanx/r{restart}/g{_generation}", _stores[key])


def _gather_hosts(info: LaunchInfo, device: torch.device) -> tuple[tuple[int, ...], ...]:
    """Which ranks share a host: one small allgather at start-up, robust to uneven hosts."""
    if info.size == 1:
        return ((0,),)
    mine = torch.tensor([info.cross_rank, info.local_rank], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(info.size)]
    dist.all_gather(every, mine)
    by_host: dict[int, list[tuple[int, int]]] = {}
    for r, t in enumerate(every):
        host, local = (int(v) for v in t.tolist())
        by_host.setdefault(host, []).append((local, r))
    if sorted(by_host) != list(range(len(by_host))):
        raise PhalanxRuntimeError(f"host (cross) ranks are not 0..n-1: {sorted(by_host)}")
    return tuple(tuple(r for _, r in sorted(by_host[h])) for h in range(len(by_host)))


_exit_hook_registered = False


def _register_exit_shutdown() -> None:
    """Leave the job at interpreter exit if the script did not call :func:`shutdown`.

    Without it a process that exits right after a collective can tear down the
    process group's threads mid-flight and abort ("terminate called without an
    active exception"). Registered at the first ``init()``, so exit hooks added
    later (timeline, async checkpoint writer) run before it, while the group lives.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_shutdown_at_exit)


def import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before a process group is made.

    torch.optim imports it at the first ``step()``. Imported while a gloo group exists
    (torch 2.13), it leaves that group referenced from C++, so ``destroy_process_group()``
    no longer stops gloo's threads ('pt_gloo_runloop', 'gloo_tcp_loop') and the store's;
    they are then torn down at process exit, which sometimes aborts a process whose script
    had finished ("terminate called without an active exception"; 3 of 12 two-rank runs
    under CPU load). One process reproduces it: init gloo, import torch._dynamo, destroy:
    the threads remain; importing it before the init: they are gone. The import costs
    nothing extra for a training script, which pays it at its first optimizer step anyway.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch build without dynamo: nothing to order
        pass


def _shutdown_at_exit() -> None:
    try:
        shutdown()
        # Exiting: also tear down groups phalanx adopted rather than made (elastic restarts,
        # a user's own init), and the stores, while the interpreter is whole. Left to static
        # destruction, gloo's device threads can be destroyed still joinable, which aborts
        # the process ("terminate called without an active exception") after a good run.
        if dist.is_initialized():
            dist.destroy_process_group()
        _stores.clear()
    except Exception:  # noqa: BLE001 - exiting anyway; a failing teardown must not mask the exit status
        pass


def shutdown() -> None:
    """Leave the job. ``init()`` may be called again afterwards."""
    global _topology, _owns_default_group
    with _lock:
        if _topology is not None and _owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        _topology = None
        _owns_default_group = False


def is_initialized() -> bool:
    return _topology is not None


def topology() -> Topology:
    """The topology from ``init()``; raises if ``init()`` has not been called."""
    if _topology is None:
        raise PhalanxRuntimeError("phalanx is not initialised: call phalanx.init() first")
    return _topology


def rank() -> int:
    return topology().rank


def size() -> int:
    return topology().size


def local_rank() -> int:
    return topology().local_rank


def local_size() -> int:
    return topology().local_size


def cross_rank() -> int:
    return topology().cross_rank


def cross_size() -> int:
    return topology().cross_size
