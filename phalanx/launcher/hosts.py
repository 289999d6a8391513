"""Host lists: ``-H a:2,b:2`` and hostfiles (``host slots=N`` lines, as horovodrun and mpirun read)."""

from __future__ import annotations

import dataclasses
import re
import socket

__all__ = ["Host", "parse_hosts", "parse_hostfile", "is_local"]


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


def is_local(name: str) -> bool:
    """True for this machine's names and loopback addresses."""
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())
