"""Host lists: ``-H a:2,b:2`` and hostfiles (``host slots=N`` lines, as horovodrun and mpirun read)."""

from __future__ import annotations

import dataclasses
import re
import socket

__all__ = ["Host", "parse_hosts", "parse_hostfile", "is_local", "SetAside", "route_source"]


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hosts(spec: str) -> list[Host]:
    """``"a:2,b:2"`` -> ``[Host("a", 2), Host("b", 2)]``; a host without ``:N`` has 1 slot."""
    hosts = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"bad host entry {item!r} in -H {spec!r}: write host:slots, e.g. node1:4")
        hosts.append(Host(name, int(slots)))
    if not hosts:
        raise ValueError(f"no hosts in -H {spec!r}")
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """Read ``host slots=N`` lines (``#`` comments and blank lines are skipped)."""
    hosts = []
    with open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?(?:\s+max[-_]slots\s*=\s*\d+)?", line)
            if not match:
                raise ValueError(f"{path}:{lineno}: cannot read {line!r}; write 'hostname slots=N'")
            hosts.append(Host(match.group(1), int(match.group(2) or 1)))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


def route_source(remote: str) -> str:
    """This machine's address on the way to ``remote`` (where the workers there reach our store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(remote), 9))
        return s.getsockname()[0]


def is_local(name: str) -> bool:
    """True for this machine's names and loopback addresses."""
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


class SetAside:
    """Hosts set aside after a worker there failed (Horovod's blacklist), each until its cooldown ends.

    ``cooldown``: ``(low, high)`` seconds (``--blacklist-cooldown-range``): a host returns after a
    random time in that range, doubled for each earlier failure there (capped at ``high``);
    ``None``: it never returns, as in Horovod without the flag.

    Example::

        aside = SetAside((5, 60))
        aside.add("node2")             # a worker on node2 failed
        aside.usable({"node1": 2, "node2": 2})   # {"node1": 2} for 5-10 s
    """

    def __init__(self, cooldown: tuple[float, float] | None = None, clock=None, rng=None) -> None:
        import random
        import time

        self.cooldown = cooldown
        self._clock = clock or time.monotonic
        self._rng = rng or random.Random()
        self.until: dict[str, float] = {}  # host -> when it may be used again (inf: never)
        self.failures: dict[str, int] = {}

    def add(self, host: str) -> float:
        """Set ``host`` aside; returns the seconds until it may return (inf: never)."""
        n = self.failures[host] = self.failures.get(host, 0) + 1
        if self.cooldown is None:
            wait = float("inf")
        else:
            low, high = self.cooldown
            wait = min(high, self._rng.uniform(low, high) * 2 ** (n - 1))
        self.until[host] = self._clock() + wait
        return wait

    def returning(self) -> list[str]:
        """Hosts whose cooldown is over (they are usable again from now on)."""
        now = self._clock()
        back = [h for h, t in self.until.items() if t <= now]
        for h in back:
            del self.until[h]
        return back

    def usable(self, hosts: dict[str, int]) -> dict[str, int]:
        return {h: n for h, n in hosts.items() if h not in self.until}

    def any_returns(self) -> bool:
        """Will any host set aside now come back by itself (a cooldown, not for good)?"""
        return any(t != float("inf") for t in self.until.values())
