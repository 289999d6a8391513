"""``Topology``: the job as seen from one rank, and the process groups that join its ranks.

Example::

    topo = px.init()
    topo.hosts               # ((0, 1), (2, 3)): global ranks per host, host-major
    topo.local_group()       # the ranks on this host
    topo.cross_group()       # one rank per host, those with this local rank
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist

from phalanx.runtime.env import LaunchInfo, PhalanxRuntimeError
from phalanx.settings import DEFAULT_TIMEOUT_S

__all__ = ["Topology", "gather_hosts"]


class _Groups:
    """Process groups of one topology, each made by every rank of the world, in the same order.

    ``dist.new_group`` without ``use_local_synchronization=True``: that mode names a group from
    its ranks *and the number of groups this rank already has*, so a member that skipped an
    earlier group (a non-member does) names it differently from the other members and they wait
    on different store keys forever. Made by every rank in the same order, a group is named from
    the world's group counter, the same everywhere (as process sets are built).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.steps: dist.ProcessGroup | None = None

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The group of ``ranks`` (a non-member gets torch's non-member handle); every rank calls."""
        with self._lock:
            if ranks not in self._cache:
                self._cache[ranks] = dist.new_group(list(ranks))
            return self._cache[ranks]

    def levels(self, hosts: tuple[tuple[int, ...], ...]) -> None:
        """Every host's group, then every cross group (local rank 0, 1, …), on the first call."""
        for host in hosts:
            self.get(host)
        for local in range(max(len(h) for h in hosts)):
            self.get(tuple(h[local] for h in hosts if local < len(h)))


@dataclasses.dataclass(frozen=True)
class Topology:
    """Immutable description of the job as seen from this rank.

    ``hosts[h]`` lists the global ranks on host ``h`` (host-major order).
    ``local_group()`` joins the ranks of this host, ``cross_group()`` the ranks
    with this local rank on every host — the two levels of a hierarchical
    collective. Groups are created on first use, by every rank of the world (the first
    ``local_group()`` or ``cross_group()`` makes every host's and every cross group, so call it
    on every rank, as a hierarchical collective does). ``timeout_s``
    is how long a collective waits for its peers (read once, at ``init()``).
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
        """The ranks on this host (the first call, on every rank, makes every level's groups)."""
        self._groups.levels(self.hosts)
        return self._groups.get(self.hosts[self.cross_rank])

    def cross_group(self) -> dist.ProcessGroup:
        """One rank per host: those whose local rank equals ours."""
        self._groups.levels(self.hosts)
        peers = tuple(h[self.local_rank] for h in self.hosts if self.local_rank < len(h))
        return self._groups.get(peers)

    def group(self, ranks) -> dist.ProcessGroup:
        """Any group of global ranks, created once and cached. Every rank of the world calls it, in
        the same order (a non-member gets a handle it must not use), as ``dist.new_group``."""
        return self._groups.get(tuple(sorted(int(r) for r in ranks)))

    def steps_group(self) -> dist.ProcessGroup:
        """A second group of the whole world that carries only data-parallel optimizer steps.

        A rank inside ``hvd.join`` then waits for the others' next step on it and for their next
        facade collective on the world group at once. Made on first use: every rank calls it at the
        same point (building its first ``DistributedOptimizer``, or re-deriving one after a re-form).
        """
        with self._groups._lock:
            if self._groups.steps is None:
                self._groups.steps = dist.new_group(list(range(self.size)))
            return self._groups.steps

    def describe(self) -> str:
        """One line for logs: ``rank 1/4 (local 1/2, host 0/2) gloo cpu hosts [2, 2] timeout 300s``."""
        return (f"rank {self.rank}/{self.size} (local {self.local_rank}/{self.local_size}, "
                f"host {self.cross_rank}/{self.cross_size}) backend {self.backend} device {self.device} "
                f"ranks per host {[len(h) for h in self.hosts]} timeout {self.timeout_s:g}s")


def gather_hosts(info: LaunchInfo, device: torch.device) -> tuple[tuple[int, ...], ...]:
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
