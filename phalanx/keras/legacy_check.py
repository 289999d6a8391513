"""Keras objects of either generation, answered without importing tf-keras (which needs TensorFlow):
is this a tf-keras (Keras 2) object, and which weights do a user's ``local_layers`` hold.

Example::

    if is_tf_keras_optimizer(opt): ...
"""

from __future__ import annotations

import sys

__all__ = ["is_tf_keras_optimizer", "is_tf_keras_model", "local_weights", "ForwardsSchedule", "same_gradients"]


def is_tf_keras_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is a tf-keras optimizer (current or ``optimizers.legacy``)."""
    module = sys.modules.get("tf_keras")
    if module is None:
        return False
    return isinstance(optimizer, (module.optimizers.Optimizer, module.optimizers.legacy.Optimizer))


def is_tf_keras_model(model) -> bool:
    """Whether ``model`` is a tf-keras ``Model``."""
    module = sys.modules.get("tf_keras")
    return module is not None and isinstance(model, module.Model)


def local_weights(local_layers, who: str) -> list:
    """The trainable weights of ``local_layers`` (None, one layer, or layers of Keras 3 or tf-keras);
    anything else is one ValueError naming ``who``."""
    if local_layers is None:
        local_layers = []
    elif hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    bad = [type(layer).__name__ for layer in local_layers if not hasattr(layer, "trainable_weights")]
    if bad:
        raise ValueError(f"{who}: local_layers must be Keras layers, got {bad}")
    return [v for layer in local_layers for v in layer.trainable_weights]


def same_gradients(prepared: list | None, grads_and_vars: list) -> bool:
    """Whether ``grads_and_vars`` carry exactly the gradients ``prepared`` (the objects themselves):
    the pairs a distributed optimizer's ``_compute_gradients`` (Horovod's private name) returned,
    reduced already, so ``apply_gradients`` applies them without reducing them again."""
    return (prepared is not None and len(prepared) == len(grads_and_vars)
            and all(p is g for p, (g, _) in zip(prepared, grads_and_vars)))


class ForwardsSchedule:
    """Mixin of the tf-keras distributed optimizers (the current one and the legacy OptimizerV2 one):
    ``iterations`` and ``learning_rate`` are those of the optimizer they wrap (``inner_optimizer``),
    so that callbacks and schedules that read or set them act on the optimizer that steps."""

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, variable):
        self.inner_optimizer.iterations = variable

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value
