"""``DistributedOptimizer`` for Keras 2 code: tf-keras optimizers (``TF_USE_LEGACY_KERAS=1``).

TensorFlow >= 2.16 runs Keras 2 code with the ``tf-keras`` package; ``tf.keras.optimizers.Adam``
is then a ``tf_keras.optimizers.Optimizer``, which Keras 3's ``model.compile`` cannot take and
tf-keras's ``model.compile`` insists on. ``phalanx.keras.DistributedOptimizer(tf_keras_opt)``
returns this class instead: a tf-keras optimizer that holds the user's one and delegates to it
(learning rate, iterations, variables, config), averaging the gradients in ``apply_gradients``::

    model.fit ─ train_step ─ optimizer.minimize(loss, vars, tape)
                              ├─ compute_gradients (tf-keras's own)
                              └─ apply_gradients ─ [accumulate k passes] ─ reduce_gradients
                                                   (one tf.py_function, bucketed) ─ inner.apply_gradients

Horovod built a subclass of the user's class at run time; composition gives the same
behaviour without it. ``backward_passes_per_step=k`` sums (or with
``average_aggregated_gradients`` averages) k passes locally and reduces once per k.

Example (Horovod's tensorflow2_keras_mnist.py, only the import changed)::

    import phalanx.tensorflow.keras as hvd
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001 * hvd.size()))
    model.compile(loss=..., optimizer=opt, metrics=["accuracy"])
"""

from __future__ import annotations

from types import SimpleNamespace

import tensorflow as tf
import tf_keras

from phalanx.comm.collectives import Average, ReduceOp
from phalanx.keras.fused import reduce_with_local_variables
from phalanx.keras.legacy_check import ForwardsSchedule, same_gradients

__all__ = ["TFKerasDistributedOptimizer", "distributed_tf_keras_optimizer"]


def distributed_tf_keras_optimizer(optimizer, *args, **kwargs):
    """The tf-keras wrapper that fits ``optimizer``: :class:`TFKerasDistributedOptimizer`, or for a legacy
    one (``tf.keras.optimizers.legacy``, OptimizerV2) ``legacy_v2.TFKerasLegacyDistributedOptimizer``."""
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        from phalanx.keras.legacy_v2 import TFKerasLegacyDistributedOptimizer

        return TFKerasLegacyDistributedOptimizer(optimizer, *args, **kwargs)
    return TFKerasDistributedOptimizer(optimizer, *args, **kwargs)


class TFKerasDistributedOptimizer(ForwardsSchedule, tf_keras.optimizers.Optimizer):
    """A tf-keras optimizer averaging gradients over every rank, then applying ``optimizer``'s update.

    Arguments as :class:`phalanx.keras.DistributedOptimizer`; ``local_variables`` (Horovod's
    ``PartialDistributedOptimizer``): variables whose gradients stay on this rank.
    """

    def __init__(self, optimizer, name=None, compression=None, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, gradient_predivide_factor=1.0, bucket_mb=None,
                 local_variables=(), scale_local_gradients=True):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", jit_compile=False)
        self.inner_optimizer = optimizer
        self.compression = compression
        self.op = ReduceOp(op)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.bucket_mb = bucket_mb
        self.local_variables = {v.ref() for v in local_variables}
        self.scale_local_gradients = scale_local_gradients
        self._accumulated = None
        self._passes = None

    def register_local_var(self, var):
        """Keep ``var``'s gradient on this rank (Horovod's ``register_local_var``; scaled by 1/size)."""
        self.local_variables.add(var.ref())

    # ---------------------------------------------------------------- delegation
    @property
    def lr(self):
        return self.inner_optimizer.lr

    @lr.setter
    def lr(self, learning_rate):
        self.inner_optimizer.lr = learning_rate

    @property
    def variables(self):
        return self.inner_optimizer.variables

    def build(self, var_list):
        self.inner_optimizer.build(var_list)

    def update_step(self, gradient, variable):
        raise RuntimeError("TFKerasDistributedOptimizer applies updates through the optimizer it wraps")

    def get_config(self):
        return {"name": self.name, "optimizer": {"class_name": type(self.inner_optimizer).__name__.lower(),
                                                     "config": self.inner_optimizer.get_config()},
                "compression": getattr(self.compression, "name", None), "op": self.op.value,
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients,
                "gradient_predivide_factor": self.gradient_predivide_factor, "bucket_mb": self.bucket_mb}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        from phalanx.comm.compression.codecs import get_compressor

        config = dict(config)
        inner = tf_keras.optimizers.deserialize(config.pop("optimizer"), custom_objects=custom_objects)
        config["compression"] = get_compressor(config.get("compression"))
        return cls(inner, **config)

    def set_weights(self, weights):
        self.inner_optimizer.set_weights(weights)

    def __getattr__(self, name):
        # the wrapped optimizer's hyper-parameters (beta_1, momentum, ...) read through
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)

    # ---------------------------------------------------------------- the step
    def _reduce(self, grads, variables):
        return reduce_with_local_variables(
            grads, variables, local=self.local_variables, scale_local=self.scale_local_gradients, op=self.op,
            compression=self.compression, predivide=self.gradient_predivide_factor, bucket_mb=self.bucket_mb,
            name=f"{self.name}.grads")

    def _accumulate(self, grads, variables):
        """Adds this pass's ``grads`` to the running sums; returns the number of passes summed."""
        self._agg_helper  # noqa: B018 (creates the pass counter)
        if self._accumulated is None:
            with tf.init_scope():
                self._accumulated = [tf.Variable(tf.zeros_like(v), trainable=False, name="accumulated_grad")
                                     for v in variables]
        for acc, g in zip(self._accumulated, grads):
            if g is not None:
                acc.assign_add(tf.cast(g, acc.dtype))
        return self._passes.assign_add(1)

    def _reduce_accumulated(self, grads, variables):
        """The k passes' sums (means with ``average_aggregated_gradients``) reduced; the sums cleared."""
        k = self.backward_passes_per_step
        summed = [None if g is None else (acc / k if self.average_aggregated_gradients else acc + 0)
                  for acc, g in zip(self._accumulated, grads)]
        reduced = self._reduce(summed, variables)
        with tf.control_dependencies([g for g in reduced if g is not None]):
            for acc in self._accumulated:
                acc.assign(tf.zeros_like(acc))
            self._passes.assign(0)
        return reduced

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if same_gradients(self.__dict__.pop("_prepared", None), grads_and_vars):
            return self._apply_prepared(grads_and_vars, name)
        grads = [None if g is None else tf.convert_to_tensor(g) for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        k = self.backward_passes_per_step
        if k == 1:
            reduced = self._reduce(grads, variables)
            return self.inner_optimizer.apply_gradients(
                [(g, v) for g, v in zip(reduced, variables) if g is not None], name=name)
        passes = self._accumulate(grads, variables)

        def update():
            reduced = self._reduce_accumulated(grads, variables)
            self.inner_optimizer.apply_gradients([(g, v) for g, v in zip(reduced, variables) if g is not None])
            return tf.constant(True)

        return tf.cond(tf.equal(passes, k), update, lambda: tf.constant(False))

    # ------------------------------------------- Horovod's private names (compatibility aliases)
    @property
    def _agg_helper(self):
        """Horovod's ``opt._agg_helper`` (code and tests read ``_agg_helper.counter``): None when
        ``backward_passes_per_step`` is 1, else an object whose ``counter`` is the int64 variable
        holding the number of backward passes summed since the last update."""
        if self.backward_passes_per_step == 1:
            return None
        if self.__dict__.get("_passes") is None:
            with tf.init_scope():
                self._passes = tf.Variable(0, dtype=tf.int64, trainable=False, name="backward_passes")
        return SimpleNamespace(counter=self._passes, backward_passes_per_step=self.backward_passes_per_step)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's ``opt._compute_gradients``: this rank's gradients of ``loss`` (a tensor recorded on
        ``tape``, or a callable) reduced over the ranks, as ``(gradient, variable)`` pairs.

        With ``backward_passes_per_step=k`` > 1 the pass is summed locally and the k-th pass returns
        the reduced sums (the others the running sums), and ``apply_gradients`` of the pairs returned
        here updates on the k-th pass only and counts every pass in ``iterations``, as Horovod's
        optimizer did (``phalanx``'s own path, ``minimize`` / ``fit``, counts updates).
        ``grad_loss`` is not supported (Horovod's Keras optimizers ignore it too).
        """
        pairs = tf_keras.optimizers.Optimizer.compute_gradients(self, loss, var_list, tape)
        grads = [None if g is None else tf.convert_to_tensor(g) for g, _ in pairs]
        variables = [v for _, v in pairs]
        k = self.backward_passes_per_step
        if k == 1:
            out = self._reduce(grads, variables)
        else:
            passes = self._accumulate(grads, variables)
            present = [i for i, g in enumerate(grads) if g is not None]

            def update():
                reduced = self._reduce_accumulated(grads, variables)
                return [reduced[i] for i in present]

            def running():
                return [self._accumulated[i].read_value() for i in present]

            sums = tf.cond(tf.equal(passes, k), update, running)
            out = [None] * len(grads)
            for i, g in zip(present, sums):
                out[i] = g
        self.__dict__["_prepared"] = out  # (outside tf.Module's attribute tracking)
        return list(zip(out, variables))

    def _apply_prepared(self, grads_and_vars, name):
        """``apply_gradients`` of :meth:`_compute_gradients`'s pairs: already reduced; with k > 1 an
        update when the pass counter was just reset (the k-th pass), else one more iteration."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if self.backward_passes_per_step == 1:
            return self.inner_optimizer.apply_gradients(pairs, name=name)

        def update():
            self.inner_optimizer.apply_gradients(pairs)
            return tf.constant(True)

        def count():
            self.inner_optimizer.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(self._passes, 0), update, count)
