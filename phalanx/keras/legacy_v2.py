"""``DistributedOptimizer`` for tf-keras's legacy optimizers (``tf.keras.optimizers.legacy.*``, OptimizerV2).

Keras 2 code written for TensorFlow <= 2.10 uses these (``tf.keras.optimizers.legacy.Adam(lr=...)``);
under ``TF_USE_LEGACY_KERAS=1`` they still exist. ``phalanx.keras.DistributedOptimizer(legacy_opt)``
returns this class: an OptimizerV2 that holds the user's one and delegates to it (hyper-parameters,
``lr``, ``iterations``, weights, config), averaging the gradients between the two halves of
``minimize``::

    model.fit ─ train_step ─ optimizer.minimize(loss, vars, tape)
                              ├─ inner._compute_gradients (its own clipping)
                              └─ apply_gradients ─ reduce (one tf.py_function, bucketed) ─ inner.apply_gradients

The reduction is :class:`phalanx.keras.legacy.TFKerasDistributedOptimizer`'s
(``reduce_with_local_variables``: same arguments, local variables included); ``backward_passes_per_step`` > 1 is refused with one clear line (the
current tf-keras optimizers have it).

Example::

    opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.Adam(lr=0.001 * hvd.size()))
    model.compile(loss="mse", optimizer=opt)
"""

from __future__ import annotations

import tf_keras

from phalanx.comm.collectives import Average, ReduceOp
from phalanx.keras.fused import reduce_with_local_variables
from phalanx.keras.legacy_check import ForwardsSchedule

__all__ = ["TFKerasLegacyDistributedOptimizer"]


class TFKerasLegacyDistributedOptimizer(ForwardsSchedule, tf_keras.optimizers.legacy.Optimizer):
    """A tf-keras OptimizerV2 averaging gradients over every rank, then applying ``optimizer``'s update."""

    def __init__(self, optimizer, name=None, compression=None, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, gradient_predivide_factor=1.0, bucket_mb=None,
                 local_variables=(), scale_local_gradients=True):
        if int(backward_passes_per_step) != 1:
            raise ValueError(f"phalanx.keras.DistributedOptimizer: backward_passes_per_step="
                             f"{backward_passes_per_step} needs a current tf-keras optimizer; use "
                             f"tf.keras.optimizers.{type(optimizer).__name__} instead of the legacy one")
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.op = ReduceOp(op)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.bucket_mb = bucket_mb
        self.local_variables = {v.ref() for v in local_variables}
        self.scale_local_gradients = scale_local_gradients

    def register_local_var(self, var):
        """Keep ``var``'s gradient on this rank (Horovod's ``register_local_var``; scaled by 1/size)."""
        self.local_variables.add(var.ref())

    # ---------------------------------------------------------------- the step
    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        grads_and_vars = self.inner_optimizer._compute_gradients(loss, var_list=var_list, grad_loss=grad_loss,
                                                                 tape=tape)
        return self.apply_gradients(grads_and_vars, name=name)

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        pairs = [(g, v) for g, v in grads_and_vars]
        reduced = reduce_with_local_variables(
            [g for g, _ in pairs], [v for _, v in pairs], local=self.local_variables,
            scale_local=self.scale_local_gradients, op=self.op, compression=self.compression,
            predivide=self.gradient_predivide_factor, bucket_mb=self.bucket_mb, name=f"{self._name}.grads")
        return self.inner_optimizer.apply_gradients(
            [(g, v) for g, (_, v) in zip(reduced, pairs) if g is not None], name=name,
            experimental_aggregate_gradients=experimental_aggregate_gradients)

    # ---------------------------------------------------------------- delegation
    @property
    def weights(self):
        return self.inner_optimizer.weights

    def variables(self):
        return self.inner_optimizer.variables()

    def get_weights(self):
        return self.inner_optimizer.get_weights()

    def set_weights(self, weights):
        self.inner_optimizer.set_weights(weights)

    def get_config(self):
        return {"name": self._name, "optimizer": tf_keras.optimizers.serialize(self.inner_optimizer),
                "op": self.op.value, "gradient_predivide_factor": self.gradient_predivide_factor,
                "bucket_mb": self.bucket_mb}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = tf_keras.optimizers.deserialize(config.pop("optimizer"), custom_objects=custom_objects,
                                                use_legacy_optimizer=True)
        return cls(inner, **config)

    def __getattr__(self, name):
        # the wrapped optimizer's hyper-parameters (beta_1, momentum, ...) read through
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)
