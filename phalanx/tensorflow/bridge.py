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

The chain of a graph. A control dependency is executed, not only ordered: running a collective
runs every one it depends on. ``chained=False`` (variable broadcasts: Horovod's
``broadcast_global_variables`` / ``BroadcastGlobalVariablesHook``, built after the training step
and run alone before it) neither depends on the chain nor is depended on, so running it does not
run the step. Such a broadcast run in one ``session.run`` with other collectives is not ordered
among them: a process lock keeps them one at a time in gloo, and the cross-rank check of each call
turns ranks that picked different ones into a :class:`MismatchError` on every rank where the calls
differ (kind, dtype, shape, name).

A cross-rank mismatch (shapes, dtypes, ops, roots that differ between ranks) comes out as
:class:`MismatchError`, a ``tf.errors.FailedPreconditionError`` as Horovod's is. Inside a graph
TensorFlow would re-raise any exception of a ``py_function`` as ``UnknownError``, so there the
``py_function`` returns the message as one more output and a TensorFlow op raises it with that
code (:func:`_raise_failed_precondition`).

Example::

    out, = call(lambda ts: [ts[0] * 2], [tf.constant([1.0])], [(tf.float32, [1])])
"""

from __future__ import annotations

import threading
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


_chains: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # v1 graph -> its chain's last link
_graph_lock = threading.Lock()  # one graph collective at a time in this process (TF runs ops on several threads)


class _Link:
    """A graph collective's op (the chain's last link)."""

    __slots__ = ("op",)

    def __init__(self):
        self.op = None


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


def _host(fn, dtypes, status: bool = False, link: _Link | None = None):
    """The py_function body; with ``status`` it returns a mismatch as a last string output instead."""

    def run(*xs):
        if link is None:
            return _run(*xs)
        with _graph_lock:
            return _run(*xs)

    def _run(*xs):
        try:
            outs = fn([to_torch(x) for x in xs])
        except CollectiveMismatchError as err:
            if status:
                return [tf.zeros([0], d) for d in dtypes] + [tf.constant(str(err))]
            if isinstance(err, MismatchError):
                raise
            raise MismatchError(str(err)) from None
        except ValueError as err:  # (inside a graph TensorFlow makes a ValueError InvalidArgument itself)
            if isinstance(err, InvalidArgument):
                raise
            raise InvalidArgument(str(err)) from None
        outs = [to_tf(o, d) for o, d in zip(outs, dtypes)]
        return outs + [tf.constant("")] if status else outs

    return run


def _raise_failed_precondition(message):
    """An op that fails with ``FailedPreconditionError(message)`` when the string ``message`` is not empty.

    TensorFlow has no op that raises an error of a given code, and maps a ``py_function``'s
    exceptions to a few codes (``UnknownError`` for ours). A hash table refuses, with exactly this
    code, a second value for a key it holds, and names the value in its message: a fresh table
    (``AnonymousHashTable``: one per run of the op) given ``""`` and ``message`` for one key does
    nothing when the message is empty and fails with it otherwise. Cost: two small ops (and an
    identity per output) per collective.
    """
    table = tf.raw_ops.AnonymousHashTable(key_dtype=tf.string, value_dtype=tf.string)
    key = tf.constant(["phalanx collective", "phalanx collective"])
    return tf.raw_ops.LookupTableImportV2(table_handle=table, keys=key,
                                          values=tf.stack([tf.constant(""), message]))


def call(fn, inputs, outputs, chained: bool = True):
    """``fn`` on ``inputs`` (TF tensors); ``outputs``: one ``(dtype, static shape or None)`` per result.

    Returns the results as a list of TF tensors. ``chained=False``: in a v1 graph, outside the
    graph's chain of collectives (module docstring).
    """
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    dtypes = [tf.as_dtype(d) for d, _ in outputs]
    if tf.executing_eagerly():
        return _host(fn, dtypes)(*inputs)
    graph = tf.compat.v1.get_default_graph()
    in_graph = not graph.building_function
    link = _Link() if in_graph else None
    last = _chains.get(graph) if in_graph and chained else None
    previous = last.op if last is not None else None
    with tf.control_dependencies([previous] if previous is not None else []):
        *outs, message = tf.py_function(_host(fn, dtypes, status=True, link=link), inputs, Tout=dtypes + [tf.string],
                                        name="phalanx_collective")
    with tf.control_dependencies([_raise_failed_precondition(message)]):
        outs = [tf.identity(o) for o in outs]
    if in_graph:
        link.op = message.op
        if chained:
            _chains[graph] = link
    for o, (_, shape) in zip(outs, outputs):
        if shape is not None:
            o.set_shape(shape)
    return outs
