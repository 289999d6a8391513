"""Horovod's Keras callbacks on Keras 3: broadcast, metric averaging, learning-rate warm-up and schedule.

Semantics follow ``horovod/_keras/callbacks.py`` (Horovod 0.28):

* ``BroadcastGlobalVariablesCallback(root_rank)``: after the first batch, the model's
  and optimizer's variables are copied from ``root_rank`` (Horovod's point: the
  optimizer's slots exist by then). phalanx also broadcasts the model's variables at
  ``on_train_begin`` when the model is built, so the first step already starts from
  the same weights on every rank.
* ``MetricAverageCallback()``: at the end of each epoch every value in ``logs`` is
  replaced by its average over the ranks (one fused allreduce, names sorted). Put it
  before callbacks that read metrics (``ModelCheckpoint``, ``ReduceLROnPlateau``).
* ``LearningRateScheduleCallback(initial_lr, multiplier, start_epoch, end_epoch,
  staircase, momentum_correction, steps_per_epoch)``: ``lr = initial_lr * multiplier(e)``
  at the first batch of each epoch (staircase) or every batch with
  ``e = epoch + batch / steps_per_epoch``; with momentum correction the momentum is
  scaled by ``new_lr / old_lr`` for that batch (Goyal et al. 2017, section 2.1).
* ``LearningRateWarmupCallback(initial_lr, warmup_epochs=5, …)``: Goyal et al.'s
  gradual warm-up from ``initial_lr / size`` to ``initial_lr``, per batch::

      e' = epoch + batch / steps_per_epoch + 1 / steps_per_epoch
      lr = initial_lr / size * (e' * (size - 1) / warmup_epochs + 1)

The callbacks also run in tf-keras's ``model.fit`` (Keras 2 code under ``TF_USE_LEGACY_KERAS=1``):
they answer the hook queries its callback list makes.

Momentum correction changes the optimizer's ``momentum`` attribute for one batch. The
torch backend runs the step eagerly and sees it; TensorFlow's compiled step keeps the
momentum it was traced with (as Horovod's did with Keras 3 optimizers), so there it
has no effect.
"""

from __future__ import annotations

import keras
import numpy as np
import torch

import phalanx.runtime as runtime
from phalanx.comm import collectives
from phalanx.keras.variables import broadcast_variables

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
]


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


class Callback(keras.callbacks.Callback):
    """A Keras 3 callback that tf-keras's ``CallbackList`` also takes (it asks which hooks are implemented)."""

    _supports_tf_logs = False

    def _implements_train_batch_hooks(self):
        return True

    def _implements_test_batch_hooks(self):
        return False

    def _implements_predict_batch_hooks(self):
        return False


def _keys(variables) -> set:
    return {v.ref() if hasattr(v, "ref") else id(v) for v in variables}


class BroadcastGlobalVariablesCallback(Callback):
    """Start every rank from ``root_rank``'s weights and optimizer state.

    Example::

        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        if local_variables is not None and not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        self.local_variables = _keys(local_variables or [])  # Horovod's: these stay as each rank has them

    def _shared(self, variables):
        return [v for v in variables if (v.ref() if hasattr(v, "ref") else id(v)) not in self.local_variables]

    def on_train_begin(self, logs=None):
        if self.model.built and not self.broadcast_done:
            broadcast_variables(self._shared(self.model.variables), root_rank=self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        broadcast_variables(self._shared(self.model.variables), root_rank=self.root_rank)
        if self.model.optimizer is not None:
            broadcast_variables(self._shared(self.model.optimizer.variables), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(Callback):
    """Replace each epoch's metrics in ``logs`` by their average over the ranks.

    Example::

        callbacks = [hvd.callbacks.MetricAverageCallback(), keras.callbacks.ModelCheckpoint(...)]
    """

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs or runtime.size() == 1:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = torch.tensor([float(logs[k]) for k in names], dtype=torch.float64)
        averaged = collectives.allreduce(values, collectives.Average, name="keras.metrics")
        for k, v in zip(names, averaged.tolist()):
            logs[k] = v


class LearningRateScheduleCallback(Callback):
    """Multiply ``initial_lr`` by ``multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a function of the (fractional, when ``staircase=False``) epoch or a
    constant ``c`` meaning ``c ** epoch``.

    Example::

        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.1, start_epoch=30, end_epoch=60)
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__}: initial_lr is required (the learning rate the schedule "
                             "multiplies, usually the base rate times hvd.size())")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, c=multiplier: c ** epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None
        self.restore_momentum = None

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return int(self.params["steps"])
        raise ValueError(f"{type(self).__name__}: could not tell the number of steps per epoch; "
                         "pass steps_per_epoch=… (or give model.fit a dataset of known length)")

    def _adjust_learning_rate(self, epoch) -> None:
        optimizer = self.model.optimizer
        old_lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        inner = _inner(optimizer)
        if self.momentum_correction and isinstance(getattr(inner, "momentum", None), float) and old_lr > 0:
            self.restore_momentum = inner.momentum
            inner.momentum = self.restore_momentum * new_lr / old_lr

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            _inner(self.model.optimizer).momentum = self.restore_momentum
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al. (2017) gradual warm-up: from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    Example::

        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=5, verbose=1)
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shifted by one batch so that each epoch ends on a round value (Horovod's choice).
            epoch += 1.0 / self.steps_per_epoch
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.rank() == 0:
            # verbose=1 asks for this line on stdout, as Keras's own callbacks print theirs.
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
