"""Horovod's ``horovod.runner.common.util.env.get_env_rank_and_size`` (its data-service example imports it).

Example::

    from phalanx.tensorflow.data import env
    rank, size = env.get_env_rank_and_size()
"""

from __future__ import annotations

import os

__all__ = ["get_env_rank_and_size"]

_NAMES = (("RANK", "WORLD_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
          ("PMI_RANK", "PMI_SIZE"))


def get_env_rank_and_size() -> tuple[int, int] | None:
    """This process's ``(rank, size)`` from the launcher's environment (phalanx run, Horovod, MPI), or None."""
    for rank, size in _NAMES:
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return None
