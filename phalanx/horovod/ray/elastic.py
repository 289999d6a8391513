"""``horovod.ray.elastic`` for phalanx: its ``RayHostDiscovery`` and ``TestDiscovery`` (slots on a Ray cluster
for an elastic job), and ``ElasticRayExecutor``: ``from phalanx.horovod.ray.elastic import TestDiscovery``.

An elastic :class:`~phalanx.ray.RayExecutor` sizes itself from Ray's free resources. A discovery
object set on the settings (``settings.discovery = TestDiscovery(...)``, with
``override_discovery=False``, as horovod.ray's ``basic_ray_elastic.py`` example does) replaces that:
the job may grow to the slots it reports (each alive node's CPUs, and GPUs with ``use_gpu``, per
slot), bounded by min/max workers.

``TestDiscovery`` pretends nodes come and go: every ``change_frequency_s`` it sets one node aside
or brings one back (between ``min_hosts`` and ``max_hosts``), so a job on a real multi-node cluster
shrinks and grows. Only the graceful mode (``_graceful=True``, its default) is supported: the
forceful one terminates a cloud node through Ray's autoscaler config, which phalanx does not drive.

Example::

    settings = ElasticRayExecutor.create_settings()
    settings.discovery = TestDiscovery(min_hosts=1, max_hosts=4, change_frequency_s=20, cpus_per_slot=1)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
"""

from __future__ import annotations

import math
import random
import time

import ray

from phalanx.log import get_logger
from phalanx.ray import ElasticRayExecutor

__all__ = ["ElasticRayExecutor", "RayHostDiscovery", "TestDiscovery"]

log = get_logger(__name__)


class RayHostDiscovery:
    """``find_available_hosts_and_slots()``: ``{node address: slots}`` over the alive nodes of the cluster."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1) -> None:
        if cpus_per_slot <= 0 or (use_gpu and gpus_per_slot <= 0):
            raise ValueError(f"RayHostDiscovery: cpus_per_slot ({cpus_per_slot}) and gpus_per_slot ({gpus_per_slot}) "
                             "must be positive")
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            res = node["Resources"]
            slots = res.get("CPU", 0.0) / self.cpus_per_slot
            if self.use_gpu:
                slots = min(slots, res.get("GPU", 0.0) / self.gpus_per_slot)
            slots = int(math.floor(slots + 1e-9))
            if slots:
                hosts[node["NodeManagerAddress"]] = hosts.get(node["NodeManagerAddress"], 0) + slots
        return hosts


class TestDiscovery(RayHostDiscovery):
    """Ray's nodes, with one set aside or brought back every ``change_frequency_s`` (see the module docstring)."""

    __test__ = False  # not a pytest class

    def __init__(self, min_hosts: int, max_hosts: int, change_frequency_s: float, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float = 1, verbose: bool = True,
                 _graceful: bool = True) -> None:
        super().__init__(use_gpu=use_gpu, cpus_per_slot=cpus_per_slot, gpus_per_slot=gpus_per_slot)
        if not _graceful:
            raise ValueError("TestDiscovery: _graceful=False (--forceful) terminates cloud nodes through Ray's "
                             "autoscaler, which phalanx does not drive; use the graceful mode (the default)")
        if not 1 <= min_hosts <= max_hosts:
            raise ValueError(f"TestDiscovery: need 1 <= min_hosts <= max_hosts, got {min_hosts}, {max_hosts}")
        self.min_hosts, self.max_hosts, self.change_frequency_s = min_hosts, max_hosts, change_frequency_s
        self.verbose = verbose
        self.removed: set[str] = set()
        self._last_change: float | None = None

    def _change(self, hosts: dict[str, int]) -> None:
        self.removed &= hosts.keys()  # a node that left the cluster is no longer ours to bring back
        present = len(hosts) - len(self.removed)
        grow = present <= self.min_hosts or (present < self.max_hosts and random.random() < 0.5)
        if grow and self.removed:
            self.removed.discard(random.choice(sorted(self.removed)))
        elif not grow and present > self.min_hosts:
            self.removed.add(random.choice(sorted(h for h in hosts if h not in self.removed)))

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        now = time.monotonic()
        if self._last_change is None:
            self._last_change = now
        hosts = super().find_available_hosts_and_slots()
        if now - self._last_change >= self.change_frequency_s:
            self._change(hosts)
            self._last_change = now
        left = {h: n for h, n in hosts.items() if h not in self.removed}
        if self.verbose:
            log.warning("TestDiscovery: %d of %d hosts: %s", len(left), len(hosts), left)
        return left
