"""The Trainer and its callbacks."""

from phalanx.trainer.callbacks import (
    BroadcastInitialState,
    Callback,
    Checkpoint,
    EarlyStopping,
    LRSchedule,
    LRWarmup,
    MetricAverage,
    TensorBoard,
)
from phalanx.trainer.data import DataError
from phalanx.trainer.trainer import Trainer, TrainerState

__all__ = [
    "Trainer",
    "TrainerState",
    "Callback",
    "BroadcastInitialState",
    "MetricAverage",
    "LRWarmup",
    "LRSchedule",
    "EarlyStopping",
    "Checkpoint",
    "TensorBoard",
    "DataError",
]
