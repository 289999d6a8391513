"""Is this a tf-keras (Keras 2) object? Answered without importing tf-keras (which needs TensorFlow).

Example::

    if is_tf_keras_optimizer(opt): ...
"""

from __future__ import annotations

import sys

__all__ = ["is_tf_keras_optimizer", "is_tf_keras_model"]


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
