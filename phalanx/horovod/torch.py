"""``import phalanx.horovod.torch as hvd``: Horovod's ``horovod.torch`` API on phalanx.

Translation only: each call maps Horovod's arguments onto :mod:`phalanx.comm.horovod_ops.ops`
(names, join, dtypes, Adasum), :mod:`phalanx.comm.horovod_ops.autograd` (differentiable forms),
:mod:`phalanx.comm.horovod_ops.process_sets` and :mod:`phalanx.horovod.training` (optimizer, state
broadcasts, join, timeline). ``import phalanx.horovod as hvd`` is the same API. Differences
from Horovod 0.28.1 are listed in docs/horovod.md.

Example (Horovod's canonical metric average, only the import changed)::

    import phalanx.horovod.torch as hvd
    hvd.init()
    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()
"""

from __future__ import annotations

import torch

import phalanx.horovod.elastic as elastic
from phalanx import runtime
from phalanx.comm import collectives as c
from phalanx.comm.compression.codecs import CastCompressor, NoneCompressor
from phalanx.comm.horovod_ops import autograd as ag
from phalanx.comm.horovod_ops import ops as ops
from phalanx.comm.horovod_ops.ops import HorovodInternalError, poll, synchronize
from phalanx.comm.horovod_ops.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from phalanx.horovod.training import (
    DistributedOptimizer,
    SyncBatchNorm,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    start_timeline,
    stop_timeline,
)
from phalanx.launcher.startup import join as join_job

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "SyncBatchNorm", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline", "elastic",
]

Average, Sum, Min, Max, Product = c.Average, c.Sum, c.Min, c.Max, c.Product
Adasum = ops.ADASUM
_NONE = NoneCompressor()


# ---------------------------------------------------------------- runtime
def init(comm=None, process_sets=None):
    """Start phalanx (``comm``: a list of ranks is accepted; MPI communicators are not used)."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("phalanx.horovod.init: MPI communicators are not supported; launch with phalanx run")
    ops.reset()  # no name of an earlier job is pending
    join_job()  # as px.init(): the runtime, and the services `phalanx run` asks for (heartbeat, timeline, autotune)
    for ps in process_sets or []:
        add_process_set(ps)


def shutdown() -> None:
    """Stop phalanx; named asynchronous collectives still pending on this rank are dropped."""
    ops.reset()
    runtime.shutdown()


is_initialized = runtime.is_initialized
size, rank, local_size, local_rank = runtime.size, runtime.rank, runtime.local_size, runtime.local_rank
cross_size, cross_rank = runtime.cross_size, runtime.cross_rank


def is_homogeneous() -> bool:
    return runtime.topology().is_homogeneous


# Build checks, answered truthfully for this pure-Python implementation.
def mpi_threads_supported() -> bool:
    return False


mpi_enabled = mpi_built = ddl_built = ccl_built = mpi_threads_supported


def gloo_built() -> bool:
    return torch.distributed.is_gloo_available()


gloo_enabled = gloo_built


def nccl_built() -> bool:
    return torch.distributed.is_nccl_available() and torch.cuda.is_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return torch.version.hip is not None


def _op(average, op):
    """Horovod's ``average=`` (deprecated) and ``op=`` to one op; Average by default."""
    if average is not None:
        if op is not None:
            raise ValueError("pass either average= (deprecated) or op=, not both")
        return Average if average else Sum
    return Average if op is None else op


# ---------------------------------------------------------------- allreduce
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    return ops.allreduce_async(tensor, _op(average, op), name, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    return ops.allreduce_async(tensor, _op(average, op), name, prescale_factor, postscale_factor, process_set,
                               inplace=True)


def allreduce(tensor, average=None, name=None, compression=_NONE, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over the process set into a new tensor (Average by default); differentiable."""
    payload, ctx = compression.compress(tensor)
    out = ag.allreduce(payload, _op(average, op), name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    return ops.grouped_allreduce_async(tensors, _op(average, op), name, prescale_factor, postscale_factor,
                                       process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    return ops.grouped_allreduce_async(tensors, _op(average, op), name, prescale_factor, postscale_factor,
                                       process_set, inplace=True)


def grouped_allreduce(tensors, average=None, name=None, compression=_NONE, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors with one fused collective per dtype; differentiable."""
    packed = [compression.compress(t) for t in tensors]
    out = ag.grouped_allreduce([p for p, _ in packed], _op(average, op), name, prescale_factor, postscale_factor,
                               process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Allgather of indices and values; the handle is callable (as Horovod's) and works with synchronize."""
    return ops.sparse_allreduce_async(tensor, _op(None, op), name, process_set)


# ---------------------------------------------------------------- allgather / broadcast / alltoall / reducescatter
def allgather_async(tensor, name=None, process_set=global_process_set):
    return ops.allgather_async(tensor, name, process_set)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ); differentiable."""
    return ag.allgather(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    return ops.grouped_allgather_async(tensors, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return ag.grouped_allgather(list(tensors), name, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return ops.broadcast_async(tensor, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return ops.broadcast_async(tensor, root_rank, name, process_set, inplace=True)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s tensor on every rank (a new tensor); differentiable."""
    return ag.broadcast(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """``synchronize`` returns ``(output, received_splits)``."""
    return ops.alltoall_async(tensor, splits, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send slice i to rank i; with ``splits`` also returns the received splits (as Horovod); differentiable."""
    out, received = ag.alltoall(tensor, splits, name, process_set)
    return (out, received) if splits is not None else out


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    return ops.reducescatter_async(tensor, _op(None, op), name, process_set, prescale_factor, postscale_factor)


def reducescatter(tensor, name=None, compression=_NONE, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce, then give rank i the i-th slice of dim 0; differentiable."""
    payload, ctx = compression.compress(tensor)
    out = ag.reducescatter(payload, _op(None, op), name, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    return ops.grouped_reducescatter_async(tensors, _op(None, op), name, process_set, prescale_factor,
                                           postscale_factor)


def grouped_reducescatter(tensors, name=None, compression=_NONE, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    packed = [compression.compress(t) for t in tensors]
    out = ag.grouped_reducescatter([p for p, _ in packed], _op(None, op), name, process_set, prescale_factor,
                                   postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def barrier(process_set=global_process_set):
    ops.barrier(process_set)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    return ops.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    return ops.allgather_object(obj, name, process_set)


# ---------------------------------------------------------------- compression
class Compression:
    """Horovod's ``hvd.Compression``: ``none`` and ``fp16``, plus ``bf16``.

    phalanx's other compressors (int8, topk, sign, powersgd, …) are passed to
    ``DistributedOptimizer`` by name: ``compression="int8"``.
    """

    none = _NONE
    fp16 = CastCompressor(torch.float16, "fp16")
    bf16 = CastCompressor(torch.bfloat16, "bf16")
