"""``hvd.SyncBatchNormalization``: batch normalization whose batch statistics span every rank.

``tf.keras.layers.BatchNormalization`` with its per-batch moments replaced by the moments of
the global batch (Horovod's layer of the same name). One differentiable allreduce (Sum) of
three values per channel gives them::

    local: sum x, sum x^2, count   ── allreduce Sum ──>   mean = S / N,   var = Q / N - mean^2

so the result, its moving averages and its gradient equal those of one process normalizing
the concatenated batch. The base class is whatever ``tf.keras.layers.BatchNormalization`` is in
this process: Keras 3, or tf-keras under ``TF_USE_LEGACY_KERAS=1`` (where ``fused`` is forced
off, as in Horovod, because the fused kernel computes its own moments).

Example::

    model = tf.keras.Sequential([tf.keras.layers.Conv2D(8, 3), hvd.SyncBatchNormalization(), ...])
"""

from __future__ import annotations

import tensorflow as tf

from phalanx.comm.collectives import Sum
from phalanx.tensorflow.ops import grouped_allreduce

__all__ = ["SyncBatchNormalization", "global_moments"]


def global_moments(inputs, axes, keep_dims: bool):
    """Mean and (biased) variance of ``inputs`` over ``axes`` and over every rank's batch."""
    axes = list(axes)
    x = inputs
    local_sum = tf.reduce_sum(x, axes, keepdims=True)
    local_squares = tf.reduce_sum(tf.square(x), axes, keepdims=True)
    shape = tf.shape(x)
    count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), x.dtype)
    total, squares, n = grouped_allreduce([local_sum, local_squares, tf.reshape(count, [1])], op=Sum)
    mean = total / n[0]
    variance = tf.maximum(squares / n[0] - tf.square(mean), 0.0)
    if not keep_dims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """Batch normalization over the global batch (every rank's); arguments as ``BatchNormalization``'s.

    Example::

        x = hvd.SyncBatchNormalization(axis=1)(x, training=True)
    """

    def __init__(self, *args, **kwargs):
        if "fused" in kwargs or hasattr(tf.keras.layers.BatchNormalization, "_calculate_mean_and_var"):
            if kwargs.get("fused"):
                raise ValueError("SyncBatchNormalization does not support fused=True (the fused kernel computes "
                                 "its own batch moments); leave fused unset")
            kwargs["fused"] = False
        super().__init__(*args, **kwargs)

    # Keras 3
    def _moments(self, inputs, *args, **kwargs):
        if args and not isinstance(args[0], (list, tuple)) or not args and "reduction_axes" not in kwargs:
            mask = args[0] if args else kwargs.get("mask")
            if mask is not None:
                raise ValueError("SyncBatchNormalization does not support masks")
            return global_moments(inputs, self._reduction_axes, keep_dims=False)
        return super()._moments(inputs, *args, **kwargs)  # tf-keras: its _moments calls the hook below

    # tf-keras (Keras 2)
    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        if mask is not None:
            raise ValueError("SyncBatchNormalization does not support masks")
        return global_moments(inputs, reduction_axes, keep_dims)
