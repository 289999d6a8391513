"""``horovod.ray.elastic`` for phalanx: ``from phalanx.horovod.ray.elastic import TestDiscovery``.

Example::

    from phalanx.horovod.ray.elastic import ElasticRayExecutor, TestDiscovery
    settings = ElasticRayExecutor.create_settings(min_np=1, max_np=4)
    settings.discovery = TestDiscovery(min_hosts=1, max_hosts=4, change_frequency_s=20)
"""

from phalanx.ray.discovery import RayHostDiscovery, TestDiscovery
from phalanx.ray.elastic_executor import ElasticRayExecutor

__all__ = ["ElasticRayExecutor", "RayHostDiscovery", "TestDiscovery"]
