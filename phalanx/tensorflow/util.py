"""``horovod.tensorflow.util``'s one helper that user and test code import: is TensorFlow eager here?

Horovod spells it ``_executing_eagerly`` (and scripts, Horovod's own tests among them, call
``hvd._executing_eagerly()`` and ``hvd.util._executing_eagerly()``); both names are kept.

Example::

    from phalanx.tensorflow.util import executing_eagerly
    if executing_eagerly(): ...
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["executing_eagerly", "_executing_eagerly"]


def executing_eagerly() -> bool:
    """True outside graphs and ``tf.function`` tracing."""
    return tf.executing_eagerly()


_executing_eagerly = executing_eagerly  # Horovod's name
