"""A local Ray cluster for tests: ``start_local_ray(ray)``, retried where a loaded machine misses Ray's start deadline."""

from __future__ import annotations

import contextlib

import psutil


def start_local_ray(ray_module, tries: int = 3, num_cpus: int = 2, num_gpus: int | None = None) -> None:
    """ray.init(num_cpus=2) (``num_gpus``: Ray's logical GPUs, none needed on the machine); Ray gives its
    raylet a fixed 30 s to register, which a loaded machine can miss."""
    me = psutil.Process()
    for attempt in range(tries):
        before = {c.pid for c in me.children(recursive=True)}
        try:
            # address="local": a cluster of its own, never the latest one another test started on this machine
            # (ray.init() with no address joins that one, and its workers' output then goes to that driver)
            ray_module.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                            log_to_driver=True)
            return
        except Exception:
            ray_module.shutdown()
            # a start that missed its deadline leaves its gcs_server, monitor and log monitor running
            for child in me.children(recursive=True):
                if child.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
            if attempt == tries - 1:
                raise
