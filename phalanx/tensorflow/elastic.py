"""``horovod.tensorflow.elastic`` on phalanx: ``TensorFlowKerasState``, ``TensorFlowState`` and ``run``.

``TensorFlowKerasState`` is :class:`phalanx.keras.elastic.KerasState` (Keras 3 and tf-keras
models); ``TensorFlowState`` keeps a list of ``tf.Variable`` (a custom loop's model and optimizer
variables) plus named extras. Both keep the last commit in memory and as a snapshot, and
``sync()`` makes rank 0's values the point ``restore()`` returns to, as Horovod's do.

Example::

    import phalanx.tensorflow as hvd
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

    train(state)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from phalanx.horovod.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    TorchState,
    restart_count,
    run,
)
from phalanx.keras.elastic import (
    CommitStateCallback,
    KerasState,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

__all__ = ["TensorFlowKerasState", "TensorFlowState", "KerasState", "ObjectState", "run",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "HostsUpdatedInterrupt", "HorovodInternalError", "restart_count"]


class _VariableValues:
    """A list of ``tf.Variable`` as one ``state_dict`` piece (NumPy copies of their values)."""

    def __init__(self, variables) -> None:
        self.variables = list(variables)

    def state_dict(self) -> dict:
        return {"values": [np.array(v.numpy()) for v in self.variables]}

    def load_state_dict(self, state: dict) -> None:
        values = state["values"]
        if len(values) != len(self.variables):
            raise ValueError(f"TensorFlowState: the committed state has {len(values)} variables, this one "
                             f"{len(self.variables)}; every worker must build the same variables")
        for v, value in zip(self.variables, values):
            v.assign(value)


class TensorFlowState(TorchState):
    """Horovod's ``TensorFlowState(variables=None, session=None, **kwargs)``: variables and extras as one state.

    ``variables`` defaults to ``tf.compat.v1.global_variables()`` (graph code); eagerly, pass them.

    Example::

        state = hvd.elastic.TensorFlowState(model.variables + opt.variables, epoch=0)
    """

    def __init__(self, variables=None, session=None, **kwargs: Any) -> None:
        if variables is None:
            import tensorflow as tf

            variables = tf.compat.v1.global_variables()
        if "variables" in kwargs:
            raise ValueError("TensorFlowState: 'variables' is the name of the variables' own piece")
        super().__init__(None, None, variables=_VariableValues(variables), **kwargs)
        object.__setattr__(self, "variables", list(variables))

    def sync(self) -> None:
        """Rank 0's values everywhere, remembered as the point ``restore()`` returns to."""
        super().sync()
        self.remember()
