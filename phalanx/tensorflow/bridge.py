"""TensorFlow tensors through phalanx's torch collectives: eagerly, in ``tf.function`` and in v1 graphs.

One function, :func:`call`, runs ``fn(torch_tensors) -> torch_tensors`` on TensorFlow
tensors::

    eager:                 DLPack in (no copy) ── fn ── DLPack out
    tf.function:           one tf.py_function (ordered by TF's automatic control dependencies)
    tf.compat.v1 graph:    one tf.py_function, with a control dependency on the graph's previous
                           collective, so a session.run of several collectives runs them one at a
                           time in program order on every rank (TF would start them on parallel
                           threads, in an order of its choosing: two ranks would wait on different
                           collectives, or gloo would see two at once)

A cross-rank mismatch (shapes, dtypes, ops, roots that differ between ranks) comes out as
:class:`MismatchError`, a ``tf.errors.FailedPreconditionError`` as Horovod's is (inside a
graph TensorFlow re-raises it as ``UnknownError`` with the same one-line message).

Example::

    out, = call(lambda ts: [ts[0] * 2], [tf.constant([1.0])], [(tf.float32, [1])])
"""

from __future__ import annotations

import weakref

import tensorflow as tf
import torch

from phalanx.comm.mismatch import CollectiveMismatchError
from phalanx.keras.tensors import TF_ALIGN_BYTES

__all__ = ["MismatchError", "InvalidArgument", "call", "to_torch", "to_tf"]


class MismatchError(tf.errors.FailedPreconditionError, CollectiveMismatchError):
    """The ranks' collectives do not match; Horovod raises ``tf.errors.FailedPreconditionError``."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidArgument(tf.errors.InvalidArgumentError, ValueError):
    """A collective's arguments are wrong on this rank (splits that do not add up, a scalar to scatter):
    TensorFlow's ``InvalidArgumentError`` as Horovod's kernels raise, and a ``ValueError`` as phalanx's."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


_last_collective: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # v1 graph -> its last collective op


def to_torch(x) -> torch.Tensor:
    """A torch tensor over ``x``'s buffer (DLPack; bool and strings through NumPy)."""
    if x.dtype == tf.bool:
        return torch.from_numpy(x.numpy())
    return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(x))


def to_tf(t: torch.Tensor, dtype=None):
    """``t`` as a TensorFlow tensor of ``dtype`` (shares ``t``'s buffer when aligned)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bool:
        out = tf.convert_to_tensor(t.numpy())
    else:
        if t.data_ptr() % TF_ALIGN_BYTES:  # TF aborts on a misaligned buffer (a view into a bucket)
            t = t.clone()
        out = tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    return out if dtype is None or out.dtype == dtype else tf.cast(out, dtype)


def _host(fn, dtypes):
    def run(*xs):
        try:
            outs = fn([to_torch(x) for x in xs])
        except CollectiveMismatchError as err:
            if isinstance(err, MismatchError):
                raise
            raise MismatchError(str(err)) from None
        except ValueError as err:  # (inside a graph TensorFlow makes a ValueError InvalidArgument itself)
            if isinstance(err, InvalidArgument):
                raise
            raise InvalidArgument(str(err)) from None
        return [to_tf(o, d) for o, d in zip(outs, dtypes)]

    return run


def call(fn, inputs, outputs):
    """``fn`` on ``inputs`` (TF tensors); ``outputs``: one ``(dtype, static shape or None)`` per result.

    Returns the results as a list of TF tensors.
    """
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    dtypes = [tf.as_dtype(d) for d, _ in outputs]
    host = _host(fn, dtypes)
    if tf.executing_eagerly():
        return host(*inputs)
    graph = tf.compat.v1.get_default_graph()
    previous = None if graph.building_function else _last_collective.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        outs = tf.py_function(host, inputs, Tout=dtypes, name="phalanx_collective")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if not graph.building_function and outs:
        _last_collective[graph] = outs[0].op
    for o, (_, shape) in zip(outs, outputs):
        if shape is not None:
            o.set_shape(shape)
    return outs
