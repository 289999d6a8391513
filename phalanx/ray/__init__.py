"""phalanx on Ray: ``RayExecutor`` with horovod.ray's API (``pip install 'phalanx[ray]'``).

``import phalanx`` never imports Ray; this package does.

Example::

    import ray
    import phalanx as px
    from phalanx.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    executor.run(lambda: (px.init(), px.rank())[1])     # [0, 1]
    executor.shutdown()

See docs/ray.md.
"""

import os as _os
import sys as _sys

# Ray's driver folds log lines that differ only in numbers ("[0]: loss 1.2" and "[1]: loss 1.3"),
# which would hide every rank but one. Exempt rank-prefixed lines, unless the user chose otherwise;
# Ray reads this when it is first imported (RayExecutor.start warns if that was before us).
if "ray" not in _sys.modules:
    _os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"^\[\d+\]: ")

try:
    import ray as _ray  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("phalanx.ray needs Ray: pip install 'phalanx[ray]'") from err

from phalanx.ray import ray_logger
from phalanx.ray.elastic_executor import ElasticRayExecutor
from phalanx.ray.executor import RayExecutor, Settings, start_lean_ray
from phalanx.ray.worker import BaseWorker

BaseHorovodWorker = BaseWorker  # horovod.ray's name for the actor class

__all__ = ["RayExecutor", "ElasticRayExecutor", "Settings", "BaseWorker", "BaseHorovodWorker", "ray_logger",
           "start_lean_ray"]
