"""Old home of ``DistributedOptimizer`` and the broadcasts, kept for code that imports it.

``DistributedOptimizer`` is in :mod:`phalanx.parallel.data.optimizer`, the broadcasts in
:mod:`phalanx.comm.broadcast`.

Example::

    from phalanx.parallel.data_optimizer import DistributedOptimizer, broadcast_parameters
"""

from phalanx.comm.broadcast import broadcast_optimizer_state, broadcast_parameters, root_of
from phalanx.parallel.data.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "root_of"]
