"""The commonly used part of ``horovod.tensorflow``: ``import phalanx.tensorflow as hvd``.

For custom TensorFlow training loops: collectives on ``tf.Tensor`` (eagerly or inside
``tf.function``), ``broadcast_variables``, ``DistributedGradientTape`` and the Keras
``DistributedOptimizer``. Tensors cross into phalanx's collectives by DLPack, without
a copy (docs/keras.md has the measured cost). ``phalanx.tensorflow.keras`` is
``phalanx.keras``.

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

import sys

import phalanx.keras as _keras
import phalanx.runtime as runtime
from phalanx.comm.collectives import Average, Max, Min, Product, Sum
from phalanx.keras import Compression, DistributedOptimizer, broadcast_variables
from phalanx.keras.fused import DEFAULT_BUCKET_MB
from phalanx.keras.optimizer import reduce_gradients

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "Average", "Sum", "Min", "Max", "Product", "Compression",
    "allreduce", "allgather", "broadcast", "broadcast_variables",
    "DistributedGradientTape", "DistributedOptimizer", "keras",
]

init = _keras.init
shutdown, is_initialized = runtime.shutdown, runtime.is_initialized
size, rank, local_size, local_rank = runtime.size, runtime.rank, runtime.local_size, runtime.local_rank
cross_size, cross_rank = runtime.cross_size, runtime.cross_rank

# `import phalanx.tensorflow.keras as hvd` is phalanx.keras itself (and its callbacks module).
keras = _keras
sys.modules[__name__ + ".keras"] = _keras
sys.modules[__name__ + ".keras.callbacks"] = _keras.callbacks


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Average (default) or reduce ``tensor`` over all ranks (Horovod's argument order).

    Example::

        total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
    """
    return _keras.allreduce(tensor, name=name, average=average, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(tensor, name=None):
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ)."""
    return _keras.allgather(tensor, name=name)


def broadcast(tensor, root_rank, name=None):
    """``root_rank``'s ``tensor`` on every rank."""
    return _keras.broadcast(tensor, root_rank=root_rank, name=name)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over every rank.

    Holds the tape and delegates to it; the gradients of one ``gradient()`` call are
    fused into buckets and reduced together. Args as Horovod's (``compression``, ``op``,
    ``gradient_predivide_factor``, ``num_groups``; the device and sparse ones are
    accepted, sparse gradients are reduced dense).

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 bucket_mb=None):
        if op not in (Average, Sum):
            raise ValueError(f"DistributedGradientTape: op must be hvd.Average or hvd.Sum, got {op}")
        if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op is not Average):
            raise ValueError("gradient_predivide_factor must be > 0 and needs op=hvd.Average; "
                             f"got {gradient_predivide_factor}")
        self.tape = gradtape
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.num_groups = len(groups) if isinstance(groups, (list, tuple)) else int(groups or num_groups or 0)
        self.bucket_mb = bucket_mb

    def __getattr__(self, name):
        return getattr(self.__dict__["tape"], name)

    def __enter__(self):
        self.tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self.tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        import tensorflow as tf

        grads = self.tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        bucket_mb = self.bucket_mb or DEFAULT_BUCKET_MB
        if self.num_groups and self.bucket_mb is None:
            total = sum(g.shape.num_elements() * g.dtype.size for g in flat if g is not None)
            bucket_mb = max(total / self.num_groups / 2**20, 1e-3)
        reduced = reduce_gradients(flat, average=self.op is Average, compression=self.compression,
                                   bucket_mb=bucket_mb, predivide=self.gradient_predivide_factor, name="tf.tape")
        return tf.nest.pack_sequence_as(grads, reduced)
