"""phalanx: distributed training for PyTorch, in pure Python, on PyTorch's own engine.

Example::

    import torch, phalanx as px

    px.init()                                   # reads torchrun / SLURM / MPI / phalanx run env
    model = torch.nn.Linear(10, 1)
    px.broadcast_parameters(model.state_dict(), root_rank=0)
    ...
    loss.backward()
    for p in model.parameters():                # (DataParallel does this for you, fused and overlapped)
        px.allreduce(p.grad, op=px.Average, inplace=True)

Run it with ``phalanx run -np 2 python train.py``.
"""

from phalanx import balance, checkpoint, elastic, preemption
from phalanx.comm.broadcast import broadcast_optimizer_state, broadcast_parameters
from phalanx.comm.collectives import (
    Average,
    Handle,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    reducescatter,
)
from phalanx.comm.mismatch import CollectiveMismatchError, set_mismatch_check
from phalanx.launcher.spawn import RankError, RankTimeoutError, run
from phalanx.launcher.startup import join as _join
from phalanx.log import log0, print0
from phalanx.parallel.data import DataParallel, DistributedOptimizer
from phalanx.parallel.expert import expert_parallel
from phalanx.parallel.grid import RankGrid
from phalanx.parallel.parallelize import parallelize
from phalanx.parallel.sync_batchnorm import SyncBatchNorm
from phalanx.parallel.zero import zero
from phalanx.profiler.memory import memory_report
from phalanx.runtime import (
    Topology,
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    topology,
)
from phalanx.trainer import Trainer
from phalanx.version import __version__


def init(backend=None, device=None, timeout=None) -> Topology:
    """Join the job (see :func:`phalanx.runtime.init`); also starts the timeline when
    ``phalanx run --timeline FILE`` set PHALANX_TIMELINE, and bucket autotuning when
    ``phalanx run --autotune`` set PHALANX_AUTOTUNE. The runtime never imports these services.

    Example::

        topo = px.init()
    """
    return _join(backend=backend, device=device, timeout=timeout)


__all__ = [
    "__version__",
    # runtime
    "init",
    "shutdown",
    "is_initialized",
    "topology",
    "Topology",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "print0",
    "log0",
    # collectives
    "ReduceOp",
    "Sum",
    "Average",
    "Min",
    "Max",
    "Product",
    "Handle",
    "CollectiveMismatchError",
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "alltoall",
    "barrier",
    "broadcast_object",
    "allgather_object",
    "set_mismatch_check",
    # data parallel
    "DataParallel",
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "zero",
    "memory_report",
    "balance",
    "SyncBatchNorm",
    # training loop
    "Trainer",
    # model parallel
    "RankGrid",
    "parallelize",
    "expert_parallel",
    # launching
    "run",
    "RankError",
    "RankTimeoutError",
    # fault tolerance (subpackages)
    "checkpoint",
    "elastic",
    "preemption",
]
