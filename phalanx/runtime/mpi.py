"""Rank 0's address for a job ``mpirun`` started across hosts, exchanged over MPI itself (``mpi4py``).

``mpirun`` tells every process its rank, size and local rank, but not where rank 0 runs, which
the rendezvous needs. On one host that is 127.0.0.1. Across hosts, with the optional
``mpi4py`` (``pip install 'phalanx[mpi]'``), rank 0 broadcasts its host name over
``MPI.COMM_WORLD`` once, so seed 002's line works as written::

    mpirun -np 8 -hostfile hosts.txt python train_horovod.py

Without mpi4py, ``MASTER_ADDR`` must be passed (``mpirun -x MASTER_ADDR=$(hostname) …``); the
error says so. The exchange is collective: every rank calls it once, from ``phalanx.init()``.

Example::

    from phalanx.runtime.mpi import rank0_address
    addr = rank0_address(4)     # the same host name on every rank, or None without mpi4py
"""

from __future__ import annotations

import importlib.util
import socket

__all__ = ["rank0_address", "mpi4py_available"]

_ADDRESS: str | None = None


def mpi4py_available() -> bool:
    """Whether mpi4py is installed (found, not imported: importing ``mpi4py.MPI`` initialises MPI)."""
    return importlib.util.find_spec("mpi4py") is not None


def rank0_address(size: int) -> str | None:
    """Rank 0's host name, broadcast from rank 0 over MPI (once per process); None without mpi4py.

    ``size``: the job's size as the launcher's variables say; MPI's own world must agree.
    """
    global _ADDRESS
    if _ADDRESS is None:
        if not mpi4py_available():
            return None
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError):  # installed, but no MPI library to load
            return None
        comm = MPI.COMM_WORLD
        if comm.Get_size() != size:
            return None
        _ADDRESS = comm.bcast(socket.gethostname() if comm.Get_rank() == 0 else None, root=0)
    return _ADDRESS
