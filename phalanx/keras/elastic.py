"""``hvd.elastic`` for Keras: ``KerasState``, the three state callbacks and ``run``, on phalanx.elastic.

Horovod's elastic Keras recipe with the import changed; launch it with
``phalanx run -np 4 --min-np 2 --max-np 4 python train.py``. When a worker is lost the
survivors' collective fails inside ``model.fit``; ``run`` re-forms the group in the same
processes, rolls the model and optimizer back to the last commit (kept in memory),
syncs rank 0's state to every rank and calls the training function again::

    fit … batch end: CommitStateCallback → state.commit() (weights + optimizer variables, in memory
    and as a snapshot) … worker lost → re-form → state.restore() → on_reset() callbacks → sync →
    train(state) again: model.fit(epochs=EPOCHS - state.epoch)

Semantics follow ``horovod/_keras/elastic.py``: ``CommitStateCallback(state,
batches_per_commit=1)`` commits every ``batches_per_commit`` batches and at each epoch's
end; ``UpdateBatchStateCallback`` keeps ``state.batch`` (the last finished batch, 0 at
an epoch's end); ``UpdateEpochStateCallback`` keeps ``state.epoch`` counting epochs
across resets (Keras restarts its count at 0 in every ``fit``, so pass
``epochs=EPOCHS - state.epoch``, as Horovod's example does).

Difference from Horovod: Keras 3 reads the number of steps once per ``fit``, so the
epoch a reset interrupted is run again in full (Horovod shortened it through
``params['steps']``, which Keras 3 no longer reads); ``state.batch`` still says where it was.

Example::

    import phalanx.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    state.register_reset_callbacks([lambda: setattr(model.optimizer, "learning_rate", 0.01 * hvd.size())])
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=EPOCHS - state.epoch, callbacks=callbacks)

    train(state)
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import torch

from phalanx.horovod.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    restart_count,
    run,
)
from phalanx.horovod.elastic import TorchState as _HorovodTorchState
from phalanx.keras.callbacks import Callback
from phalanx.keras.legacy_check import is_tf_keras_model

__all__ = ["KerasState", "TensorFlowKerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run",
           "ObjectState", "HostsUpdatedInterrupt", "HorovodInternalError", "restart_count"]


def _numpy(v) -> np.ndarray:
    """A Keras 3 variable's or a ``tf.Variable``'s value as a NumPy array (a copy)."""
    if hasattr(v, "numpy"):
        return np.array(v.numpy())
    return np.array(keras.ops.convert_to_numpy(v.value))


def _built(optimizer) -> bool:
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return bool(getattr(inner, "built", getattr(inner, "_built", False)))


class _KerasWeights:
    """A Keras model's weights and its optimizer's variables as one ``state_dict`` piece (torch tensors)."""

    def __init__(self, model, optimizer=None) -> None:
        self.model = model
        self.optimizer = optimizer

    def _optimizer(self):
        return self.optimizer if self.optimizer is not None else getattr(self.model, "optimizer", None)

    def state_dict(self) -> dict:
        optimizer = self._optimizer()
        opt_values = [] if optimizer is None or not _built(optimizer) else [
            torch.from_numpy(_numpy(v)) for v in optimizer.variables]
        return {"weights": [torch.from_numpy(np.array(w)) for w in self.model.get_weights()],
                "optimizer": opt_values}

    def load_state_dict(self, state: dict) -> None:
        self.model.set_weights([t.numpy() for t in state["weights"]])
        values = state["optimizer"]
        optimizer = self._optimizer()
        if not values or optimizer is None:
            return
        if not _built(optimizer):  # a worker that joined before its first step: create the slots first
            optimizer.build(self.model.trainable_variables)
        variables = optimizer.variables
        if len(variables) != len(values):
            raise ValueError(f"KerasState: the committed optimizer state has {len(values)} variables, this "
                             f"optimizer {len(variables)}; every worker must build the same model and optimizer")
        for v, t in zip(variables, values):
            v.assign(t.numpy())


class KerasState(_HorovodTorchState):
    """Horovod's ``hvd.elastic.KerasState(model, optimizer=None, **kwargs)``: the model's weights, its
    optimizer's variables and named extras (``batch=0, epoch=0``) as one elastic state.

    ``state.model`` (and ``state.optimizer``) are the live Keras objects; extras are
    attributes (``state.epoch``). ``commit()``, ``restore()``, ``sync()`` and
    ``register_reset_callbacks`` are those of ``phalanx.horovod.elastic.TorchState``: the
    last commit stays in memory (and as a snapshot a restarted group loads).
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any) -> None:
        if not isinstance(model, keras.Model) and not is_tf_keras_model(model):
            raise TypeError(f"KerasState takes a keras.Model (Keras 3 or tf-keras), got {type(model).__name__}; "
                            "for torch modules use phalanx.horovod.elastic.TorchState")
        if "keras" in kwargs:
            raise ValueError("KerasState: 'keras' is the name of the model's own piece; name your extra otherwise")
        super().__init__(None, None, keras=_KerasWeights(model, optimizer), **kwargs)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer if optimizer is not None else model.optimizer)

    def sync(self) -> None:
        """Give every rank rank 0's state, and make it the point ``restore()`` returns to (as Horovod's
        ``sync`` saves after broadcasting): a rank that syncs and then restores holds the synced weights."""
        super().sync()
        self.remember()


class CommitStateCallback(Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of each epoch.

    Example::

        hvd.elastic.CommitStateCallback(state, batches_per_commit=10)
    """

    def __init__(self, state, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a reset

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(Callback):
    """Keep ``state.batch``: the last finished batch of the epoch, 0 at an epoch's end.

    Example::

        hvd.elastic.UpdateBatchStateCallback(state)
    """

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(Callback):
    """Keep ``state.epoch`` counting finished epochs across resets (Keras counts from 0 in each ``fit``).

    Example::

        hvd.elastic.UpdateEpochStateCallback(state)   # then model.fit(epochs=EPOCHS - state.epoch)
    """

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


TensorFlowKerasState = KerasState  # horovod.tensorflow.elastic's name for the same state
