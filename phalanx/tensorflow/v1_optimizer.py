"""``DistributedOptimizer`` for TensorFlow 1 optimizers (``tf.compat.v1.train.Optimizer``), as Horovod's.

``compute_gradients`` returns the gradients averaged (or summed) over the process set, one
fused collective per dtype (``phalanx.tensorflow.ops.grouped_allreduce``); ``apply_gradients``,
``get_slot``, ``get_slot_names`` and ``variables`` are the wrapped optimizer's. ``minimize``
(the base class's) calls both, so a TF1 training graph needs only the wrapping line::

    opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.01 * hvd.size(), 0.9))
    train_op = opt.minimize(loss)                      # in a tf.compat.v1 graph (or eagerly)
    session.run(hvd.broadcast_global_variables(0))    # after the variables' initializer

Variables registered with ``register_local_var`` keep their own gradient, divided by the set's
size when ``scale_local_gradients`` (Horovod's choice). ``backward_passes_per_step`` > 1 is
not supported here (one clear error); the Keras optimizers have it.
"""

from __future__ import annotations

import tensorflow as tf

from phalanx.comm.collectives import Average, ReduceOp, Sum
from phalanx.comm.horovod_ops.process_sets import global_process_set
from phalanx.tensorflow.compression import Compression
from phalanx.tensorflow.ops import allreduce, grouped_allreduce

__all__ = ["V1DistributedOptimizer", "is_v1_optimizer"]


def is_v1_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is a TensorFlow 1 optimizer (``tf.compat.v1.train.Optimizer``)."""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


class V1DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces the gradients over the ranks.

    Holds the wrapped optimizer and delegates to it (no class built at run time). Args as
    Horovod's ``horovod.tensorflow.DistributedOptimizer``; ``device_dense``/``device_sparse`` are
    accepted. A ``tf.IndexedSlices`` gradient is reduced by gathering (``sparse_as_dense=False``)
    or dense.

    Example::

        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train_op = opt.minimize(loss)
    """

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                 backward_passes_per_step=1, num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
        if isinstance(optimizer, V1DistributedOptimizer):
            raise ValueError("the optimizer is already a phalanx DistributedOptimizer; wrap it only once")
        if int(backward_passes_per_step) != 1:
            raise ValueError(f"DistributedOptimizer(tf.compat.v1.train.Optimizer): backward_passes_per_step must "
                             f"be 1, got {backward_passes_per_step}; accumulate with a Keras optimizer instead")
        if op not in (Average, Sum, "average", "sum"):
            raise ValueError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum for gradients, got {op!r}")
        op = ReduceOp(op)
        if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op is not Average):
            raise ValueError("DistributedOptimizer: gradient_predivide_factor must be > 0 and needs op=hvd.Average; "
                             f"got {gradient_predivide_factor}")
        super().__init__(use_locking=use_locking, name=name or f"Distributed{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.op = op
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.predivide = float(gradient_predivide_factor)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_vars: set = set()

    def register_local_var(self, var):
        """Keep ``var``'s gradient on this rank (not reduced; divided by the set's size if ``scale_local_gradients``)."""
        self.local_vars.add(var.ref())

    def _reduce(self, grads):
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
        out = list(grads)
        scale = dict(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        for i, g in zip(dense, grouped_allreduce([grads[i] for i in dense], op=self.op, compression=self.compression,
                                                 process_set=self.process_set, **scale)):
            out[i] = g
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                out[i] = allreduce(tf.convert_to_tensor(g) if self.sparse_as_dense else g, op=self.op,
                                   compression=self.compression, process_set=self.process_set)
        return out

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, with the gradients reduced over the set."""
        pairs = self.optimizer.compute_gradients(*args, **kwargs)
        if self.process_set.size() == 1:
            return pairs
        shared = [i for i, (_, v) in enumerate(pairs) if v.ref() not in self.local_vars]
        reduced = dict(zip(shared, self._reduce([pairs[i][0] for i in shared])))
        size = float(self.process_set.size())
        out = []
        for i, (g, v) in enumerate(pairs):
            if i in reduced:
                g = reduced[i]
            elif g is not None and self.scale_local_gradients:
                g = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) if isinstance(
                    g, tf.IndexedSlices) else g / size
            out.append((g, v))
        return out

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients``."""
        return self.optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def get_slot(self, *args, **kwargs):
        return self.optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self.optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self.optimizer.variables(*args, **kwargs)
