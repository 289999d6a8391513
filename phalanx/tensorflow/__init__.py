"""The commonly used part of ``horovod.tensorflow``: ``import phalanx.tensorflow as hvd``.

Horovod's TensorFlow API for custom training loops, eagerly, inside ``tf.function`` and in
``tf.compat.v1`` graphs: the collectives (with their gradients; ``ops.py``), variables and
objects from one rank (``functions.py``), ``DistributedGradientTape`` and its partial form
(``tape.py``), ``elastic`` and ``SyncBatchNormalization``; ``DistributedOptimizer`` takes
Keras 3 and tf-keras (Keras 2) optimizers (``phalanx.keras``'s) and TensorFlow 1 optimizers
(``tf.compat.v1.train.Optimizer``; ``v1_optimizer.py``). Tensors cross into phalanx's collectives by
DLPack, without a copy (``bridge.py``; docs/keras.md has the measured cost).
``phalanx.tensorflow.keras`` is ``phalanx.keras``.

Example::

    import tensorflow as tf
    import phalanx.tensorflow as hvd

    hvd.init()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)   # after the first step builds them
"""

from __future__ import annotations

import importlib
import sys

import phalanx.keras as _keras
import phalanx.runtime as runtime
from phalanx.comm.collectives import Average, Max, Min, Product, Sum
from phalanx.comm.horovod_ops.ops import HorovodInternalError
from phalanx.comm.horovod_ops.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from phalanx.horovod.torch import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from phalanx.keras import PartialDistributedOptimizer
from phalanx.tensorflow import util
from phalanx.tensorflow.bridge import MismatchError
from phalanx.tensorflow.compression import Compression
from phalanx.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from phalanx.tensorflow.ops import (
    ADASUM,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from phalanx.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from phalanx.tensorflow.util import executing_eagerly
from phalanx.tensorflow.v1_optimizer import V1DistributedOptimizer, is_v1_optimizer

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    "broadcast_variables", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object", "broadcast_object_fn",
    "allgather_object", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "MismatchError", "keras", "elastic", "util", "executing_eagerly",
]

Adasum = ADASUM
_executing_eagerly = executing_eagerly  # Horovod's spelling, which scripts call as hvd._executing_eagerly()


def init(comm=None, process_sets=None) -> None:
    """Join the job (``phalanx run`` / torchrun / SLURM / MPI variables; a world of one otherwise).

    ``process_sets``: lists of ranks (or ``ProcessSet``) to register, as Horovod's ``init`` takes.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("phalanx.tensorflow.init: MPI communicators are not supported; launch with phalanx run")
    _keras.init(comm)
    for ps in process_sets or []:
        add_process_set(ps)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer``: gradients averaged over the ranks, then applied.

    A ``tf.compat.v1.train.Optimizer`` gets :class:`V1DistributedOptimizer` (``compute_gradients``
    reduces, ``apply_gradients`` is the wrapped one's); a Keras 3 or tf-keras optimizer gets
    ``phalanx.keras.DistributedOptimizer``, as Horovod hands Keras optimizers to its Keras front.

    Example::

        opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.001 * hvd.size()))
        train_op = opt.minimize(loss)
    """
    if is_v1_optimizer(optimizer):
        return V1DistributedOptimizer(optimizer, name, use_locking, device_dense, device_sparse, compression,
                                      sparse_as_dense, op, gradient_predivide_factor, backward_passes_per_step,
                                      num_groups, groups, process_set, scale_local_gradients)
    return _keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups, groups=groups,
        process_set=None if process_set is global_process_set else process_set)


shutdown, is_initialized = runtime.shutdown, runtime.is_initialized
size, rank, local_size, local_rank = runtime.size, runtime.rank, runtime.local_size, runtime.local_rank
cross_size, cross_rank = runtime.cross_size, runtime.cross_rank

# `import phalanx.tensorflow.keras as hvd` is phalanx.keras itself (and its callbacks module).
keras = _keras
sys.modules[__name__ + ".keras"] = _keras
sys.modules[__name__ + ".keras.callbacks"] = _keras.callbacks


def __getattr__(name):
    # on first use: elastic brings in phalanx.horovod's elastic loop; SyncBatchNormalization a Keras layer class
    if name == "elastic":
        return importlib.import_module("phalanx.tensorflow.elastic")
    if name == "SyncBatchNormalization":
        return importlib.import_module("phalanx.tensorflow.sync_batch_norm").SyncBatchNormalization
    raise AttributeError(f"module 'phalanx.tensorflow' has no attribute {name!r}")
