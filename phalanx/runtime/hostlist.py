"""SLURM's compressed host lists and task counts, expanded the way ``scontrol show hostnames`` does.

Host lists (``SLURM_JOB_NODELIST``)::

    gpu-[01-04,07],cpu[1-2]    -> gpu-01 gpu-02 gpu-03 gpu-04 gpu-07 cpu1 cpu2
    rack[1-2]-n[01-02]         -> rack1-n01 rack1-n02 rack2-n01 rack2-n02   (several groups: every combination)
    n[8-10]  /  n[098-101]     -> n8 n9 n10  /  n098 n099 n100 n101      (the low end's width pads)

Task counts (``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``)::

    2(x3),1                    -> [2, 2, 2, 1]

Node addresses: a node name that does not resolve here (clusters whose node names are not in
DNS) is looked up in SLURM itself, ``scontrol show node NAME`` → ``NodeAddr``.

Example::

    from phalanx.runtime.hostlist import expand_hostlist, expand_counts, node_addresses
    expand_hostlist("gpu-[01-02],cpu1")     # ['gpu-01', 'gpu-02', 'cpu1']
    expand_counts("2(x3),1")               # [2, 2, 2, 1]
    node_addresses(["n1", "n2"])           # {'n1': '10.1.0.1', 'n2': '10.1.0.2'} (NodeAddr when n1 does not resolve)
"""

from __future__ import annotations

import itertools
import re
import shutil
import socket
import subprocess

__all__ = ["expand_hostlist", "expand_counts", "node_addresses"]


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets; a bracket left open is an error."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' in host list {text!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"']' without '[' in host list {text!r}")
            depth = 0
        elif ch == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unclosed '[' in host list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _range(item: str, whole: str) -> list[str]:
    lo, dash, hi = item.strip().partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()):
        raise ValueError(f"bad range {item!r} in host list {whole!r}; write e.g. n[01-04,07]")
    if not dash:
        return [lo]
    a, b = int(lo), int(hi)
    if b < a:
        raise ValueError(f"range {item!r} runs backwards in host list {whole!r}")
    return [f"{i:0{len(lo)}d}" for i in range(a, b + 1)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list into names, in order (duplicates kept, as SLURM keeps them)."""
    hosts: list[str] = []
    for part in _split_top(text):
        pieces = re.split(r"(\[[^\]]*\])", part)  # literal, [ranges], literal, [ranges], …
        choices = [[p] if not p.startswith("[") else [x for r in p[1:-1].split(",") for x in _range(r, text)]
                   for p in pieces]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def expand_counts(text: str) -> list[int]:
    """Expand ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not match:
            raise ValueError(f"cannot read {item!r} in the SLURM count list {text!r}; expected e.g. 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
        return True
    except (OSError, UnicodeError):
        return False


def node_addresses(names: list[str], timeout_s: float = 15.0) -> dict[str, str]:
    """Each node's address: its name where the name resolves, else SLURM's ``NodeAddr`` for it.

    A name SLURM does not know either (or no ``scontrol``) is kept as it is, so the error that
    follows names it.
    """
    out = {n: n for n in names}
    unknown = [n for n in dict.fromkeys(names) if not _resolves(n)]
    if not unknown or not shutil.which("scontrol"):
        return out
    try:
        res = subprocess.run(["scontrol", "-o", "show", "node", ",".join(unknown)], capture_output=True,
                             text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return out
    for line in res.stdout.splitlines():
        name = re.search(r"(?:^|\s)NodeName=(\S+)", line)
        addr = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
        if name and addr and name.group(1) in out:
            out[name.group(1)] = addr.group(1)
    return out
