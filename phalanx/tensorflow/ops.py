"""Horovod's TensorFlow collectives on phalanx: eager, ``tf.function`` and ``tf.compat.v1`` graphs.

Each call crosses to :mod:`phalanx.comm.horovod_ops` (Horovod's semantics on torch tensors:
process sets, dtypes gloo lacks, join, the cross-rank check) through :mod:`phalanx.tensorflow.bridge`.
Floating-point results carry a gradient, as Horovod registers one for each op:

=================  ===========================================================
op                 gradient of the input
=================  ===========================================================
allreduce          allreduce of the gradient (same op, same scale factors)
allgather          average of the gradient over the ranks, this rank's rows
broadcast          average of the gradient on the root, zeros elsewhere
alltoall           alltoall of the gradient back with the received splits
reducescatter      allgather of the gradient (x set size for Sum, x scale factors)
=================  ===========================================================

Example::

    summed = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)
    rows = hvd.allgather(tf.ones([hvd.rank() + 1, 3]))
"""

from __future__ import annotations

import tensorflow as tf
import torch

from phalanx import runtime
from phalanx.comm import collectives as c
from phalanx.comm.horovod_ops import ops
from phalanx.comm.horovod_ops.process_sets import global_process_set, registered
from phalanx.tensorflow.bridge import InvalidArgument, call
from phalanx.tensorflow.compression import Compression

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
           "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op", "ADASUM"]

ADASUM = ops.ADASUM


def _op(average, op):
    if average is not None:
        if op is not None:
            raise ValueError("allreduce: pass op= or the deprecated average=, not both")
        return c.Average if average else c.Sum
    return c.Average if op is None else op


def _differentiable(tensors) -> bool:
    return any(t.dtype.is_floating or t.dtype.is_complex for t in tensors)


def _with_gradient(forward, backward, tensors):
    """``forward(tensors)`` with ``backward(upstream_grads) -> input grads`` as its gradient (floats only)."""
    if not _differentiable(tensors):
        return forward(tensors)

    @tf.custom_gradient
    def run(*xs):
        ys = forward(list(xs))

        def grad(*dys):
            return backward([tf.zeros_like(y) if d is None else d for y, d in zip(ys, dys)])

        return ys, grad

    return list(run(*tensors))


def _as_tensors(tensors):
    return [tf.convert_to_tensor(t.value() if isinstance(t, tf.Variable) else t) for t in tensors]


# ---------------------------------------------------------------- allreduce
def _grouped_allreduce_raw(tensors, op, pre, post, ps, name):
    def fn(ts):
        if len(ts) == 1:  # checked with its own shape (a fused group is checked as one flat buffer)
            return [ops.synchronize(ops.allreduce_async(ts[0], op, name, pre, post, ps))]
        return ops.synchronize(ops.grouped_allreduce_async(ts, op, name, pre, post, ps))

    outs = call(fn, tensors, [(t.dtype, t.shape) for t in tensors], ps)

    def grad(dys):
        return _grouped_allreduce(dys, op, pre, post, ps, None)

    return outs, grad


def _grouped_allreduce(tensors, op, pre, post, ps, name):
    if not tensors:
        return []
    if _differentiable(tensors) and op not in (c.Average, c.Sum):
        return _grouped_allreduce_raw(tensors, op, pre, post, ps, name)[0]  # no gradient: as Horovod's Min/Max
    return _with_gradient(lambda ts: _grouped_allreduce_raw(ts, op, pre, post, ps, name)[0],
                          lambda dys: _grouped_allreduce(dys, op, pre, post, ps, None), tensors)


def _sparse_allreduce(slices, op, ps, pre, post):
    if op == ADASUM or op not in (c.Average, c.Sum):
        raise NotImplementedError("allreduce of tf.IndexedSlices supports op=hvd.Sum or hvd.Average only "
                                  "(pass sparse_as_dense=True to reduce it dense with other ops)")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("allreduce of tf.IndexedSlices takes no prescale/postscale factors")
    values = allgather(slices.values, process_set=ps)
    indices = allgather(slices.indices, process_set=ps)
    if op == c.Average:
        values = values / tf.cast(ps.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` (a tensor, variable or ``tf.IndexedSlices``) over the process set; Average by default.

    ``tf.IndexedSlices`` are reduced by gathering their values and indices (Sum or Average).

    Example::

        mean = hvd.allreduce(tf.constant([1.0]))
        total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, compression=hvd.Compression.fp16)
    """
    op = _op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, process_set, prescale_factor, postscale_factor)
    tensor = _as_tensors([tensor])[0]
    payload, ctx = compression.compress(tensor)
    out = _grouped_allreduce([payload], op, prescale_factor, postscale_factor, process_set, name)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      name=None, ignore_name_scope=False):
    """Reduce every tensor of ``tensors`` in one fused collective per dtype; a list back in the same order.

    Example::

        a, b = hvd.grouped_allreduce([tf.ones([2]), tf.ones([3, 3])], op=hvd.Sum)
    """
    op = _op(average, op)
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set) for t in tensors]
    packed = [compression.compress(t) for t in _as_tensors(tensors)]
    outs = _grouped_allreduce([p for p, _ in packed], op, prescale_factor, postscale_factor, process_set, name)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


# ---------------------------------------------------------------- allgather
def _own_rows(dys, xs, ps):
    """Backward of allgather: the gradient averaged over the ranks, this rank's rows of it."""
    reduced = _grouped_allreduce(dys, c.Average, 1.0, 1.0, ps, None)
    out = []
    for g, x in zip(reduced, xs):
        counts = tf.reshape(grouped_allgather([tf.reshape(tf.shape(x)[0], [1])], process_set=ps)[0], [-1])
        me = ps.rank()
        start = tf.reduce_sum(counts[:me])
        out.append(tf.slice(g, tf.concat([[start], tf.zeros([tf.rank(g) - 1], tf.int32)], 0),
                            tf.concat([[counts[me]], tf.shape(g)[1:]], 0)))
    return out


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's tensors along the first dimension, tensor by tensor (sizes may differ).

    Example::

        a, b = hvd.grouped_allgather([tf.ones([hvd.rank() + 1]), tf.zeros([2, 2])])
    """
    tensors = _as_tensors(tensors)
    if not tensors:
        return []

    def forward(ts):
        def fn(tt):
            return list(ops.synchronize(ops.grouped_allgather_async(tt, name, process_set)))

        return call(fn, ts, [(t.dtype, [None] + t.shape[1:] if t.shape.rank else None) for t in ts], process_set)

    return _with_gradient(forward, lambda dys: _own_rows(dys, tensors, process_set), tensors)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ).

    Example::

        rows = hvd.allgather(tf.fill([hvd.rank() + 1, 2], float(hvd.rank())))
    """
    return grouped_allgather([tensor], name=name, process_set=process_set)[0]


# ---------------------------------------------------------------- broadcast
def _broadcast_raw(tensors, root_rank, ps, name):
    def fn(ts):
        return [ops.synchronize(ops.broadcast_async(t, root_rank, None if name is None else f"{name}.{i}", ps))
                for i, t in enumerate(ts)]

    return call(fn, tensors, [(t.dtype, t.shape) for t in tensors], ps)


def _broadcast_grad(dys, root_rank, ps):
    reduced = _grouped_allreduce(dys, c.Average, 1.0, 1.0, ps, None)
    return reduced if runtime.rank() == root_rank else [g * 0 for g in reduced]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every rank of the process set.

    Example::

        w0 = hvd.broadcast(tf.constant([float(hvd.rank())]), root_rank=0)
    """
    tensors = _as_tensors([tensor])
    return _with_gradient(lambda ts: _broadcast_raw(ts, root_rank, process_set, name),
                          lambda dys: _broadcast_grad(dys, root_rank, process_set), tensors)[0]


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` with ``root_rank``'s values, in place; returns them (graph: the assigned values).

    Example::

        hvd.broadcast_([v1, v2], root_rank=0)
    """
    variables = list(variables)
    values = _broadcast_raw(_as_tensors(variables), root_rank, process_set, name)
    assigned = [v.assign(x) for v, x in zip(variables, values)]
    return variables if tf.executing_eagerly() else assigned


# ---------------------------------------------------------------- alltoall, reducescatter
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send slice i of the first dimension to rank i (``splits``: rows per destination; equal by default).

    Returns the received rows, and with ``splits`` given also the rows received from each rank.

    Example::

        received, received_splits = hvd.alltoall(tf.range(4), splits=[1, 3])
    """
    tensor = _as_tensors([tensor])[0]
    split_tensor = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int64)

    def forward(ts):
        def fn(tt):
            send = None if len(tt) == 1 else tt[1].to(torch.int64).tolist()
            out, received = ops.synchronize(ops.alltoall_async(tt[0], send, name, process_set))
            return [out, received.to(torch.int32)]

        ins = ts if split_tensor is None else ts + [split_tensor]
        shape = [None] + tensor.shape[1:] if tensor.shape.rank else None
        return call(fn, ins, [(tensor.dtype, shape), (tf.int32, [process_set.size()])], process_set)

    if _differentiable([tensor]):
        @tf.custom_gradient
        def run(x):
            out, received = forward([x])

            def grad(dy, _unused=None):
                return alltoall(dy, splits=received, process_set=process_set)[0]

            return (out, received), grad

        out, received = run(tensor)
    else:
        out, received = forward([tensor])
    return (out, received) if splits is not None else out


def _reducescatter_grad(dys, op, ps, pre, post):
    scale = (ps.size() if op == c.Sum else 1.0) * pre * post
    return [allgather(g * scale if scale != 1.0 else g, process_set=ps) for g in dys]


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=c.Average, name=None,
                          process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce each tensor over the ranks and give rank i the i-th slice of its first dimension.

    Example::

        part, = hvd.grouped_reducescatter([tf.ones([4, 2])], op=hvd.Sum)
    """
    tensors = _as_tensors(tensors)
    for t in tensors:
        if t.shape.rank == 0:
            raise InvalidArgument("reducescatter: a scalar cannot be scattered over the ranks; pass a tensor "
                                  "whose first dimension is split across them")
    packed = [compression.compress(t) for t in tensors]
    payloads = [p for p, _ in packed]

    def forward(ts):
        def fn(tt):
            return list(ops.synchronize(ops.grouped_reducescatter_async(tt, op, name, process_set, prescale_factor,
                                                                        postscale_factor)))

        return call(fn, ts, [(t.dtype, [None] + t.shape[1:] if t.shape.rank else None) for t in ts], process_set)

    outs = _with_gradient(forward, lambda dys: _reducescatter_grad(dys, op, process_set, prescale_factor,
                                                                   postscale_factor), payloads)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=c.Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks; rank i gets the i-th slice of the first dimension (Average by default).

    Example::

        mine = hvd.reducescatter(tf.ones([4, 2]), op=hvd.Sum)   # 2 ranks: [2, 2] of 2.0
    """
    return grouped_reducescatter([tensor], compression=compression, op=op, name=name, process_set=process_set,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)[0]


# ---------------------------------------------------------------- join, barrier, the *_op family
def join():
    """Wait until every rank has joined (answering their collectives meanwhile); returns the last rank to join.

    Example::

        last = hvd.join()
    """
    return ops.join()


def barrier(process_set=global_process_set):
    """Block until every rank of the process set reaches this call."""
    ops.barrier(process_set)


def size_op(process_set_id=0, name=None):
    """The process set's size as an int32 tensor (Horovod's ``size_op``)."""
    return tf.constant(_set_of(process_set_id).size(), dtype=tf.int32, name=name)


def _set_of(process_set_id):
    return registered(process_set_id)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank belongs to the process set, else 0 (an int32 tensor)."""
    return tf.constant(int(_set_of(process_set_id).included()), dtype=tf.int32, name=name)


def local_size_op(name=None):
    """``hvd.local_size()`` as an int32 tensor."""
    return tf.constant(runtime.local_size(), dtype=tf.int32, name=name)


def rank_op(name=None):
    """``hvd.rank()`` as an int32 tensor."""
    return tf.constant(runtime.rank(), dtype=tf.int32, name=name)


def local_rank_op(name=None):
    """``hvd.local_rank()`` as an int32 tensor."""
    return tf.constant(runtime.local_rank(), dtype=tf.int32, name=name)
