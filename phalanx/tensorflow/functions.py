"""Horovod's ``horovod.tensorflow.functions``: variables and Python objects from one rank to all.

``broadcast_variables`` works eagerly, inside a ``tf.function`` (Horovod's examples call it in
their training step on the first batch) and in a ``tf.compat.v1`` graph: the variables' values go
as one coalesced broadcast per dtype (one ``tf.py_function`` in a graph), then are assigned.

Example::

    hvd.broadcast_variables(model.variables, root_rank=0)
    config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
"""

from __future__ import annotations

import tensorflow as tf

from phalanx import runtime
from phalanx.comm.broadcast import broadcast_coalesced
from phalanx.comm.horovod_ops import ops
from phalanx.comm.horovod_ops.process_sets import global_process_set, group_of
from phalanx.tensorflow.bridge import call

__all__ = ["broadcast_variables", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object", "broadcast_object_fn",
           "allgather_object"]


def _check_root(root_rank: int, process_set, what: str) -> None:
    if not 0 <= int(root_rank) < runtime.size():
        raise ValueError(f"{what}: root_rank {root_rank} is outside 0..{runtime.size() - 1}")
    if process_set.ranks is not None and int(root_rank) not in process_set.ranks:
        raise ValueError(f"{what}: root_rank {root_rank} is not a member of {process_set}")


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s values to ``variables`` (TF or Keras variables) on every rank of the set.

    Eagerly it returns None; in a graph, the op that assigns them (run it, or let ``tf.function``
    run it). ``inplace`` is accepted (every assignment here is in place).

    Example::

        @tf.function
        def step(x, first_batch):
            ...
            if first_batch:
                hvd.broadcast_variables(model.variables, root_rank=0)
    """
    variables = list(variables)
    _check_root(root_rank, process_set, "broadcast_variables")
    if not variables or process_set.size() == 1:
        return None if tf.executing_eagerly() else tf.no_op()
    group = group_of(process_set)
    values = [tf.convert_to_tensor(v) for v in variables]

    def fn(ts):
        copies = [t.clone() for t in ts]  # DLPack views of TF's buffers are not ours to write
        broadcast_coalesced(copies, int(root_rank), group, "tf.broadcast_variables")
        return copies

    synced = call(fn, values, [(v.dtype, v.shape) for v in values], process_set)
    assigns = [v.assign(s) for v, s in zip(variables, synced)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank):
    """TF1 graphs: broadcast every global variable (``tf.compat.v1.global_variables()``) from ``root_rank``.

    Eagerly there are no global variables: Horovod raises, and so does this, naming the call to use.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 ``MonitoredTrainingSession`` / Estimator hook: broadcast every global variable from ``root_rank``
    once the session is created (Horovod's hook; ``device`` places the op).

    The broadcast is built in ``begin()``, after the model and its training step, and runs alone:
    a graph's collectives depend on no other (the ranks order them at run time, ``graph_order.py``),
    so running it does not run the step's collectives or ask for their inputs.

    Example::

        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session: ...
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """``root_rank``'s picklable ``obj`` on every rank of the set (``session`` is accepted and unused).

    Example::

        epoch = hvd.broadcast_object(epoch, root_rank=0)
    """
    _check_root(root_rank, process_set, "broadcast_object")
    return ops.broadcast_object(obj, int(root_rank), name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's form for TF1 sessions)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)

    return fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's picklable ``obj``, as a list in rank order.

    Example::

        hosts = hvd.allgather_object(socket.gethostname())
    """
    return ops.allgather_object(obj, name, process_set)
