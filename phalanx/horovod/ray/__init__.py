"""``horovod.ray`` for phalanx: ``from phalanx.horovod.ray import RayExecutor``.

An alias of :mod:`phalanx.ray`; see docs/ray.md.

Example::

    from phalanx.horovod.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
"""

from phalanx.ray import BaseHorovodWorker, ElasticRayExecutor, RayExecutor, Settings, ray_logger

__all__ = ["RayExecutor", "ElasticRayExecutor", "Settings", "BaseHorovodWorker", "ray_logger"]
