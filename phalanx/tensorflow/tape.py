"""``DistributedGradientTape`` and ``PartialDistributedGradientTape`` (Horovod's, for custom TF loops).

The tape holds a ``tf.GradientTape`` and delegates to it; ``gradient()`` reduces the gradients
of one call together, fused into buckets (``phalanx.keras.optimizer.reduce_gradients``: one
``tf.py_function`` inside a ``tf.function``). Sources registered as local (the weights of
``local_layers``) keep their own gradient, divided by the set's size when
``scale_local_gradients`` (Horovod's choice, so that a local layer learns at the pace the
averaged ones do).

Example::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    grads = tape.gradient(loss, model.trainable_variables)
"""

from __future__ import annotations

import tensorflow as tf

from phalanx.comm.collectives import Average, ReduceOp, Sum
from phalanx.comm.horovod_ops.process_sets import global_process_set
from phalanx.keras.fused import DEFAULT_BUCKET_MB, reduce_gradients
from phalanx.keras.legacy_check import local_weights
from phalanx.tensorflow.compression import Compression
from phalanx.tensorflow.ops import grouped_allreduce

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


def _key(source):
    return source.ref() if hasattr(source, "ref") else id(source)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over every rank.

    Args as Horovod's (``compression``, ``sparse_as_dense``, ``op`` Average or Sum,
    ``gradient_predivide_factor``, ``num_groups``/``groups``, ``process_set``,
    ``scale_local_gradients``); the device arguments are accepted. ``bucket_mb`` (phalanx's)
    sets the fusion bucket size. Sparse gradients (``tf.IndexedSlices``) are reduced dense.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    """

    def __init__(self, gradtape, device_dense="", device_sparse="", compression=Compression.none,
                 sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True, bucket_mb=None):
        if op not in (Average, Sum, "average", "sum"):
            raise ValueError(f"DistributedGradientTape: op must be hvd.Average or hvd.Sum, got {op!r}")
        op = ReduceOp(op)
        if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op is not Average):
            raise ValueError("DistributedGradientTape: gradient_predivide_factor must be > 0 and needs "
                             f"op=hvd.Average; got {gradient_predivide_factor}")
        self.tape = gradtape
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.num_groups = len(groups) if isinstance(groups, (list, tuple)) else int(groups or num_groups or 0)
        self.bucket_mb = bucket_mb
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_sources: set = set()

    def __getattr__(self, name):
        return getattr(self.__dict__["tape"], name)

    def __enter__(self):
        self.tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self.tape.__exit__(*exc)

    def register_local_source(self, source):
        """Keep ``source``'s gradient on this rank (not reduced; scaled by 1/size if ``scale_local_gradients``)."""
        self.local_sources.add(_key(source))

    def _reduce(self, grads):
        if self.process_set is not global_process_set:
            op = Average if self.op is Average else Sum
            present = [g for g in grads if g is not None]
            reduced = iter(grouped_allreduce(present, op=op, compression=self.compression,
                                             prescale_factor=1.0 / self.gradient_predivide_factor,
                                             postscale_factor=self.gradient_predivide_factor,
                                             process_set=self.process_set))
            return [None if g is None else next(reduced) for g in grads]
        bucket_mb = self.bucket_mb or DEFAULT_BUCKET_MB
        if self.num_groups and self.bucket_mb is None:
            total = sum(g.shape.num_elements() * g.dtype.size for g in grads if g is not None)
            bucket_mb = max(total / self.num_groups / 2**20, 1e-3)
        return reduce_gradients(grads, average=self.op is Average, compression=self.compression,
                                bucket_mb=bucket_mb, predivide=self.gradient_predivide_factor, name="tf.tape")

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        grads = self.tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        local = [_key(s) in self.local_sources for s in flat_sources]
        shared = [g for g, is_local in zip(flat, local) if not is_local]
        reduced = iter(self._reduce(shared))
        size = float(self.process_set.size())
        out = []
        for g, is_local in zip(flat, local):
            if not is_local:
                out.append(next(reduced))
            elif g is None or not self.scale_local_gradients:
                out.append(g)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(g.values / size, g.indices, g.dense_shape))
            else:
                out.append(g / size)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``(local [(source, grad)], global [(source, grad)])`` from one ``gradient()`` call."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        pairs = list(zip(sources, grads))
        local = [(s, g) for s, g in pairs if _key(s) in self.local_sources]
        return local, [(s, g) for s, g in pairs if _key(s) not in self.local_sources]


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A :class:`DistributedGradientTape` that leaves the gradients of ``local_layers``' weights unreduced.

    Example::

        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[head])
    """
    local = local_weights(local_layers, "PartialDistributedGradientTape")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for var in local:
        tape.register_local_source(var)
    return tape
