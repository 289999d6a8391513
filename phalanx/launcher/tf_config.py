"""TF_CONFIG for ``tf.distribute`` scripts started by ``phalanx run`` (standard library and phalanx.settings only).

``MultiWorkerMirroredStrategy`` finds its peers in the ``TF_CONFIG`` variable::

    {"cluster": {"worker": ["host0:p0", "host0:p1", "host1:p0", ...]},
     "task": {"type": "worker", "index": RANK}}

The exec shim (``_exec.py``) exports it for every worker from the variables the launcher
already sets, so a seed-000 style script runs under ``phalanx run -np N`` unedited. Each
worker's TensorFlow server listens on ``base_port + local_rank`` of its host, where
``base_port`` is ``PHALANX_TF_PORT`` or, by default, ``MASTER_PORT + 1``. A multi-host
``phalanx run -H a:2,b:2`` exports, per host, :func:`host_env`: ``PHALANX_WORKER_HOSTS``
(``"a:2,b:2"``, every host the job runs on, in launch order) and ``PHALANX_HOST_INDEX``
(this host's place in it). A worker's task index is its slot in that list (the hosts
before it, then ``LOCAL_RANK``), not its torch ``RANK``: TorchElastic's rendezvous may
number the hosts in another order, and TF needs only that every worker agrees on the
list and finds itself in it. A job on one host needs nothing more (``MASTER_ADDR``;
index = ``RANK``). A ``TF_CONFIG`` the user set is left alone.

Example::

    >>> tf_config({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
    ...            "MASTER_PORT": "29500"})
    '{"cluster": {"worker": ["127.0.0.1:29501", "127.0.0.1:29502"]}, "task": {"type": "worker", "index": 1}}'
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from phalanx.settings import LauncherSettings

__all__ = ["parse_hosts", "worker_addresses", "tf_config", "host_env"]


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


def host_env(plan: list[tuple[str, int]], index: int) -> dict[str, str]:
    """What the launcher exports to the workers of host ``plan[index]`` (``plan``: (host, workers) in launch order).

    >>> host_env([("a", 1), ("b", 1)], 1)
    {'PHALANX_WORKER_HOSTS': 'a:1,b:1', 'PHALANX_HOST_INDEX': '1'}
    """
    return {"PHALANX_WORKER_HOSTS": ",".join(f"{h}:{n}" for h, n in plan), "PHALANX_HOST_INDEX": str(index)}


def tf_config(env: Mapping[str, str]) -> str | None:
    """The ``TF_CONFIG`` JSON for the worker described by ``env``; None when ``env`` is not a phalanx worker's."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    job = LauncherSettings.read(env)
    base_port = job.tf_port or int(env.get("MASTER_PORT", "29500")) + 1
    if job.worker_hosts:
        hosts = parse_hosts(job.worker_hosts)
    else:
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        if local != world:  # several hosts, but nobody said which: TF could not find its peers
            return None
        hosts = [(env.get("MASTER_ADDR", "127.0.0.1"), world)]
    workers = worker_addresses(hosts, base_port)
    if len(workers) != world:
        raise ValueError(f"PHALANX_WORKER_HOSTS lists {len(workers)} slots for a world of {world}")
    index = rank
    if job.host_index is not None:  # this worker's slot in the list, whatever RANK the rendezvous gave it
        host = job.host_index
        local = int(env.get("LOCAL_RANK", "0"))
        if not (0 <= host < len(hosts) and 0 <= local < hosts[host][1]):
            raise ValueError(f"PHALANX_HOST_INDEX={host}, LOCAL_RANK={local} is not a slot of "
                             f"PHALANX_WORKER_HOSTS={job.worker_hosts}")
        index = sum(n for _, n in hosts[:host]) + local
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
