"""TensorFlow tensors through phalanx's torch collectives: eagerly, in ``tf.function`` and in v1 graphs.

One function, :func:`call`, runs ``fn(torch_tensors) -> torch_tensors`` on TensorFlow
tensors::

    eager:                 DLPack in (no copy) ── fn ── DLPack out
    tf.function:           one tf.py_function (ordered by TF's automatic control dependencies)
    tf.compat.v1 graph:    a py_function posts the inputs, a tf.data iterator's get_next waits for
                           the result; the ranks agree at run time which posted collective runs next
                           (:mod:`phalanx.tensorflow.graph_order`, Horovod's coordinator), so a
                           session.run may fetch any of a graph's collectives, in any order, and runs
                           only those

A cross-rank mismatch (shapes, dtypes, ops, roots that differ between ranks) comes out as
:class:`MismatchError`, a ``tf.errors.FailedPreconditionError`` as Horovod's is. Inside a graph
TensorFlow would re-raise any exception of a ``py_function`` as ``UnknownError``, so there the
``py_function`` returns the message as one more output and a TensorFlow op raises it with that
code (:func:`_raise_failed_precondition`).

Example::

    out, = call(lambda ts: [ts[0] * 2], [tf.constant([1.0])], [(tf.float32, [1])])
"""

from __future__ import annotations

import tensorflow as tf
import torch

from phalanx import runtime
from phalanx.comm.mismatch import CollectiveMismatchError
from phalanx.keras.tensors import TF_ALIGN_BYTES
from phalanx.tensorflow import graph_order

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


def _host(fn, dtypes, status: bool = False):
    """The py_function body; with ``status`` it returns a mismatch as a last string output instead."""

    def run(*xs):
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


def _failure_message(err: BaseException) -> str | None:
    """A graph collective's failure raised as ``FailedPreconditionError(message)``: a cross-rank mismatch."""
    return str(err) if isinstance(err, CollectiveMismatchError) else None


def _members(process_set) -> list[int]:
    ranks = getattr(process_set, "ranks", None)
    return list(ranks) if ranks is not None else list(range(runtime.size()))


_DATA_OPTIONS = tf.data.Options()  # no rewrite passes (an injected prefetch would call the map early)
_DATA_OPTIONS.experimental_optimization.apply_default_optimizations = False
_DATA_OPTIONS.autotune.enabled = False


class _Posted:
    """The ticket of a graph collective's latest post, for its iterator's next element."""

    __slots__ = ("name", "ident")

    def __init__(self) -> None:
        self.name, self.ident = "", None


def _graph_call(fn, inputs, dtypes, process_set):
    """The v1 graph form of :func:`call`: post, then wait on tf.data's thread (:mod:`graph_order`).

    The wait is the next element of a one-shot iterator (made once with the graph) over an endless
    dataset mapped by a ``py_function``: ``get_next`` is asynchronous (the map runs on tf.data's
    thread), and the map, called once per run after the post (a control dependency), takes the
    latest post's ticket. (A fresh iterator per run over the ticket would cost ~5 ms a run, and
    ``Dataset.from_generator`` three times this one's first run: measured on cpu2.) A post whose run
    failed before its wait is dropped by the next post (its collective still runs on every rank).
    """
    posted = _Posted()

    def post(*xs):
        ts = [to_torch(x).clone() for x in xs]  # fn runs later, on the coordinator's thread
        order = graph_order.coordinator(runtime.rank(), runtime.current_settings().runtime.timeout_s)
        ident = order.post(posted.name, fn, ts, _members(process_set), _failure_message)
        if posted.ident is not None:
            graph_order.drop(posted.ident)
        posted.ident = ident
        return tf.constant(ident, tf.int64)

    def failed(message: str):
        return [tf.zeros([0], d) for d in dtypes] + [tf.constant(message)]

    def result(_):
        ident, posted.ident = posted.ident, None
        if ident is None:
            return failed("graph collective: its result was asked for before it was posted (two session.run "
                          "calls of one collective at once are not supported)")
        ticket = graph_order.take(ident)
        if ticket.error is not None:
            if isinstance(ticket.error, ValueError) and not isinstance(ticket.error, InvalidArgument):
                raise InvalidArgument(str(ticket.error)) from None
            raise ticket.error
        if ticket.message:
            return failed(ticket.message)
        return [to_tf(o, d) for o, d in zip(ticket.outputs, dtypes)] + [tf.constant("")]

    ticket = tf.py_function(post, inputs, Tout=tf.int64, name="phalanx_collective")
    posted.name = ticket.op.name
    types = dtypes + [tf.string]
    data = tf.data.Dataset.from_tensors(0).repeat().map(lambda i: tf.py_function(result, [i], Tout=types))
    iterator = tf.compat.v1.data.make_one_shot_iterator(data.with_options(_DATA_OPTIONS))
    with tf.control_dependencies([ticket]):
        return list(iterator.get_next())


def call(fn, inputs, outputs, process_set=None):
    """``fn`` on ``inputs`` (TF tensors); ``outputs``: one ``(dtype, static shape or None)`` per result.

    Returns the results as a list of TF tensors. ``process_set``: the Horovod process set ``fn``
    runs on (None: every rank), whose members agree on the order of a v1 graph's collectives.
    """
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    dtypes = [tf.as_dtype(d) for d, _ in outputs]
    if tf.executing_eagerly():
        return _host(fn, dtypes)(*inputs)
    if tf.compat.v1.get_default_graph().building_function:  # tf.function: TF keeps program order
        *outs, message = tf.py_function(_host(fn, dtypes, status=True), inputs, Tout=dtypes + [tf.string],
                                        name="phalanx_collective")
    else:
        *outs, message = _graph_call(fn, inputs, dtypes, process_set)
    with tf.control_dependencies([_raise_failed_precondition(message)]):
        outs = [tf.identity(o) for o in outs]
    for o, (_, shape) in zip(outs, outputs):
        if shape is not None:
            o.set_shape(shape)
    return outs
