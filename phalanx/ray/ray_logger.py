"""Send metrics from a rank to the driver's ``callbacks`` (horovod.ray's ``ray_logger``).

Inside a function run by :class:`~phalanx.ray.RayExecutor`, ``ray_logger.log(d)`` on rank 0
hands ``d`` to every callback given to ``executor.run(…, callbacks=[…])`` on the driver
(``chief_only=False``: from every rank). Outside a Ray job, or when the driver gave no
callbacks, it does nothing (with one warning).

Example::

    from phalanx.ray import ray_logger

    def train():
        px.init()
        for epoch in range(3):
            ...
            ray_logger.log({"epoch": epoch, "loss": loss.item()})

    executor.run(train, callbacks=[print])      # the driver prints rank 0's three dicts
"""

from __future__ import annotations

import os
import warnings

__all__ = ["configure", "log"]

_queue = None
_warned = False


def configure(queue) -> None:
    """Called by the executor in each actor: where :func:`log` puts its dicts."""
    global _queue
    _queue = queue


def log(info: dict, chief_only: bool = True) -> None:
    """Send ``info`` (picklable) to the driver's callbacks; by default only rank 0's."""
    global _warned
    rank = os.environ.get("RANK", os.environ.get("HOROVOD_RANK"))
    if chief_only and rank != "0":
        return
    if _queue is None:
        if not _warned:
            warnings.warn("ray_logger.log: no driver callbacks to send to (run under RayExecutor.run(..., "
                          "callbacks=[...]))", stacklevel=2)
            _warned = True
        return
    _queue.put(info)
