"""TF_CONFIG for ``tf.distribute`` scripts started by ``phalanx run`` (standard library only).

``MultiWorkerMirroredStrategy`` finds its peers in the ``TF_CONFIG`` variable::

    {"cluster": {"worker": ["host0:p0", "host0:p1", "host1:p0", ...]},
     "task": {"type": "worker", "index": RANK}}

The exec shim (``_exec.py``) exports it for every worker from the variables the launcher
already sets, so a seed-000 style script runs under ``phalanx run -np N`` unedited. Each
worker's TensorFlow server listens on ``base_port + local_rank`` of its host, where
``base_port`` is ``PHALANX_TF_PORT`` or, by default, ``MASTER_PORT + 1``. Hosts come from
``PHALANX_WORKER_HOSTS`` (``"host0:4,host1:4"``, in cross-rank order) when the launcher
sets it; a job on one host needs nothing more (``MASTER_ADDR``). A ``TF_CONFIG`` the user
set is left alone.

Example::

    >>> tf_config({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    ...            "MASTER_PORT": "29500"})
    '{"cluster": {"worker": ["127.0.0.1:29501", "127.0.0.1:29502"]}, "task": {"type": "worker", "index": 1}}'
"""

from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["parse_hosts", "worker_addresses", "tf_config"]


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` -> ``[("a", 2), ("b", 2)]`` (a host without ``:slots`` has one)."""
    hosts = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        host, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"PHALANX_WORKER_HOSTS: {item!r} is not HOST:SLOTS with SLOTS >= 1")
        hosts.append((host, int(slots)))
    return hosts


def worker_addresses(hosts: list[tuple[str, int]], base_port: int) -> list[str]:
    """Every worker's ``host:port``, in rank order (host by host, local ranks in order)."""
    return [f"{host}:{base_port + local}" for host, slots in hosts for local in range(slots)]


def tf_config(env: Mapping[str, str]) -> str | None:
    """The ``TF_CONFIG`` JSON for the worker described by ``env``; None when ``env`` is not a phalanx worker's."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    base_port = int(env.get("PHALANX_TF_PORT") or int(env.get("MASTER_PORT", "29500")) + 1)
    if env.get("PHALANX_WORKER_HOSTS"):
        hosts = parse_hosts(env["PHALANX_WORKER_HOSTS"])
    else:
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        if local != world:  # several hosts, but nobody said which: TF could not find its peers
            return None
        hosts = [(env.get("MASTER_ADDR", "127.0.0.1"), world)]
    workers = worker_addresses(hosts, base_port)
    if len(workers) != world:
        raise ValueError(f"PHALANX_WORKER_HOSTS lists {len(workers)} slots for a world of {world}")
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
