"""``horovod.keras`` / ``horovod.tensorflow.keras`` on Keras 3: ``import phalanx.keras as hvd``.

Runs on the torch backend (``KERAS_BACKEND=torch``: gradients are torch tensors and
go to phalanx's collectives as they are) and on TensorFlow (tensors cross by DLPack,
without a copy). Launch with ``phalanx run -np N python train.py``. docs/keras.md
lists every call and what differs from Horovod.

Example (seed 002's script, the import changed)::

    import keras
    import phalanx.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size())],
              verbose=1 if hvd.rank() == 0 else 0)
"""

from __future__ import annotations

import keras
import torch

import phalanx.runtime as runtime
from phalanx.comm import collectives
from phalanx.comm.compression.codecs import CastCompressor, NoneCompressor, get_compressor
from phalanx.keras import callbacks
from phalanx.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from phalanx.keras.tensors import from_torch, kind, over_torch, to_torch
from phalanx.keras.variables import broadcast_variables
from phalanx.launcher.startup import join as join_job

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "Average", "Sum", "Min", "Max", "Product", "Compression",
    "allreduce", "allgather", "broadcast", "broadcast_variables",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "callbacks", "elastic",
]

Average, Sum, Min, Max, Product = (collectives.Average, collectives.Sum, collectives.Min, collectives.Max,
                                   collectives.Product)


def init(comm=None, process_sets=None) -> None:
    """Join the job (reads ``phalanx run`` / torchrun / SLURM / MPI variables; a world of one otherwise)."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("phalanx.keras.init: MPI communicators are not supported; launch with phalanx run")
    if process_sets:
        raise ValueError("phalanx.keras.init: process_sets are not supported by the Keras front yet")
    join_job()  # as px.init(): the runtime, and the services `phalanx run` asks for (heartbeat, timeline, autotune)


shutdown, is_initialized = runtime.shutdown, runtime.is_initialized
size, rank, local_size, local_rank = runtime.size, runtime.rank, runtime.local_size, runtime.local_rank
cross_size, cross_rank = runtime.cross_size, runtime.cross_rank


class Compression:
    """Horovod's ``hvd.Compression`` (``none``, ``fp16``) plus ``bf16``; other phalanx compressors by name."""

    none = NoneCompressor()
    fp16 = CastCompressor(torch.float16, "fp16")
    bf16 = CastCompressor(torch.bfloat16, "bf16")


def _op(average, op):
    if op is not None and average is not None:
        raise ValueError("allreduce: pass op= or the deprecated average=, not both")
    if op is None:
        return collectives.Average if average in (None, True) else collectives.Sum
    return collectives.ReduceOp(op)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Reduce a backend tensor, NumPy array or number over all ranks; returns the same kind.

    Works eagerly and inside a ``tf.function``. Example::

        mean_loss = hvd.allreduce(loss, name="loss")
    """
    compressor = get_compressor(compression)
    op = _op(average, op)

    def reduce(ts, align_bytes):
        payload, ctx = compressor.compress(ts[0])
        out = collectives.allreduce(payload, op, name=name, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)
        return [compressor.decompress(out, ctx).to(ts[0].dtype)]

    return _one(reduce, value)


def allgather(value, name=None):
    """Concatenate every rank's ``value`` along the first dimension (sizes may differ)."""
    return _one(lambda ts, _: [collectives.allgather(ts[0], name=name)], value, same_shape=False)


def broadcast(value, root_rank=0, name=None):
    """``root_rank``'s ``value`` on every rank."""
    return _one(lambda ts, _: [collectives.broadcast(ts[0], root_rank, name=name)], value)


def _one(fn, value, same_shape=True):
    if kind(value) == "numpy":  # NumPy arrays and Python numbers come back as such
        return from_torch(fn([to_torch(value)], 0)[0], value)
    return over_torch(fn, [value], same_shape=same_shape)[0]


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Load a model saved with ``model.save``; its optimizer comes back as a :class:`DistributedOptimizer`.

    A model compiled with ``DistributedOptimizer`` restores as one (with ``compression``);
    a model saved with a plain Keras optimizer gets it wrapped, as Horovod's ``load_model`` does.

    Example::

        model = hvd.load_model("checkpoint.keras")
    """
    objects = {"DistributedOptimizer": DistributedOptimizer}
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.compression = get_compressor(compression)
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model


def __getattr__(name):
    # hvd.elastic on first use: it brings in phalanx.horovod, which a job without elasticity never needs
    if name == "elastic":
        import importlib

        return importlib.import_module("phalanx.keras.elastic")
    raise AttributeError(f"module 'phalanx.keras' has no attribute {name!r}")
