"""Where the actors of a :class:`~phalanx.ray.RayExecutor` job go: one placement group, one actor per rank.

* ``num_workers=N``: N bundles of ``{CPU: cpus_per_worker, GPU: gpus_per_worker}``,
  strategy PACK by default (``placement_strategy="SPREAD"`` etc. as Ray names them).
* ``num_hosts=H, num_workers_per_host=K``: H bundles of K workers' resources with
  STRICT_SPREAD, so each host runs exactly K ranks (horovod.ray's colocated strategy).
* Inside a placement group already (a Ray Tune trial, with
  ``use_current_placement_group=True``): the actors go in that group's bundles.

Ranks are then assigned host-major from where the actors landed (rank 0 is the first
actor of the first host), so ``local_rank``/``cross_rank`` are what ``phalanx run``
would give for the same layout.

Example (what the executor does)::

    placed = place_workers(spec, name="phalanx-ab12")
    placed.workers, placed.group        # actors in creation order, the placement group
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import ray
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from phalanx.ray.worker import BaseWorker

__all__ = ["WorkerSpec", "Placed", "place_workers", "ranks_host_major", "rank_environments", "STRATEGIES"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    num_workers: int | None
    num_hosts: int | None
    num_workers_per_host: int
    cpus_per_worker: float
    use_gpu: bool
    gpus_per_worker: float
    placement_strategy: str
    use_current_placement_group: bool
    placement_group_timeout_s: float

    @property
    def world_size(self) -> int:
        return self.num_workers if self.num_workers else self.num_hosts * self.num_workers_per_host

    def worker_resources(self) -> dict[str, float]:
        res = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            res["GPU"] = float(self.gpus_per_worker)
        return res


@dataclasses.dataclass
class Placed:
    workers: list[Any]
    group: Any  # the placement group this job made (None when it used the caller's)
    names: list[str]


def _bundles(spec: WorkerSpec) -> tuple[list[dict[str, float]], str, list[int]]:
    """Bundles, strategy, and the bundle index of each worker in creation order."""
    one = spec.worker_resources()
    if spec.num_workers:
        return [dict(one) for _ in range(spec.num_workers)], spec.placement_strategy, list(range(spec.num_workers))
    per_host = {k: v * spec.num_workers_per_host for k, v in one.items()}
    index = [h for h in range(spec.num_hosts) for _ in range(spec.num_workers_per_host)]
    return [dict(per_host) for _ in range(spec.num_hosts)], "STRICT_SPREAD", index


def _current_group_indices(pg, spec: WorkerSpec) -> list[int]:
    """Bundles of the caller's group that fit one worker; the last N of them (a Tune trial's
    first bundle is its own head)."""
    need = spec.worker_resources()
    fits = [i for i, b in enumerate(pg.bundle_specs) if all(b.get(k, 0) >= v for k, v in need.items() if v)]
    n = spec.world_size
    if len(fits) < n:
        return [-1] * n  # any bundle with room; Ray queues the actor until one frees up
    return fits[-n:]


def place_workers(spec: WorkerSpec, job: str | None = None) -> Placed:
    """Reserve the resources and start one actor per rank; raise TimeoutError if they never fit."""
    job = job or uuid.uuid4().hex[:8]
    current = get_current_placement_group() if spec.use_current_placement_group else None
    own = None
    if current is not None:
        pg, index = current, _current_group_indices(current, spec)
    else:
        bundles, strategy, index = _bundles(spec)
        own = pg = placement_group(bundles, strategy=strategy, name=f"phalanx-{job}")
        ready, _ = ray.wait([pg.ready()], timeout=spec.placement_group_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise TimeoutError(
                f"RayExecutor: the cluster could not place {len(bundles)} bundles of {bundles[0]} ({strategy}) "
                f"within placement_group_timeout_s={spec.placement_group_timeout_s:g}; available: "
                f"{ray.available_resources()}. Ask for fewer workers/CPUs/GPUs or add nodes.")
    remote = ray.remote(BaseWorker)
    workers, names = [], []
    for i, b in enumerate(index):
        name = f"phalanx-{job}-w{i}"
        opts = {"num_cpus": spec.cpus_per_worker, "num_gpus": spec.gpus_per_worker if spec.use_gpu else 0,
                "name": name, "max_restarts": 0, "max_concurrency": 1,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)}
        workers.append(remote.options(**opts).remote())
        names.append(name)
    return Placed(workers, own, names)


def ranks_host_major(infos: list[dict]) -> list[int]:
    """Creation index of the worker that gets each rank: hosts in order of first appearance."""
    hosts: dict[str, list[int]] = {}
    for i, info in enumerate(infos):
        hosts.setdefault(info["node_id"], []).append(i)
    return [i for members in hosts.values() for i in members]


def rank_environments(infos: list[dict], *, master_addr: str, master_port: int, use_gpu: bool = False,
                      iface: str | None = None, nics=None, extra: dict | None = None) -> list[dict[str, str]]:
    """The variables ``phalanx.init()`` reads, for each rank (``infos`` in rank order, host-major).

    With ``use_gpu`` every rank of a host sees all the GPUs Ray gave that host's ranks, in
    local-rank order (so peers can use CUDA IPC, as horovod.ray does), and computes on its own
    first one (PHALANX_DEVICE).
    """
    hosts: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        hosts.setdefault(info["node_id"], []).append(r)
    host_index = {node: h for h, node in enumerate(hosts)}
    common = {"WORLD_SIZE": len(infos), "GROUP_WORLD_SIZE": len(hosts), "PHALANX_LAUNCHER": "ray",
              "MASTER_ADDR": master_addr, "MASTER_PORT": master_port}
    if iface:
        common["GLOO_SOCKET_IFNAME"] = iface
        common["NCCL_SOCKET_IFNAME"] = ",".join(sorted(nics or [iface]))
    envs = []
    for r, info in enumerate(infos):
        members = hosts[info["node_id"]]
        env = {**common, "RANK": r, "LOCAL_RANK": members.index(r), "LOCAL_WORLD_SIZE": len(members),
               "GROUP_RANK": host_index[info["node_id"]], "HOROVOD_HOSTNAME": info["hostname"]}
        if use_gpu:
            node_gpus = [g for m in members for g in infos[m]["gpu_ids"]]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            if info["gpu_ids"]:
                env["PHALANX_DEVICE"] = f"cuda:{node_gpus.index(info['gpu_ids'][0])}"
        env.update(extra or {})
        envs.append({k: str(v) for k, v in env.items()})
    return envs

