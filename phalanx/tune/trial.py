"""``DistributedTrial``: one Optuna trial followed by every rank of a phalanx job.

In the spirit of optuna-integration's ``TorchDistributedTrial``, over phalanx's
collectives: rank 0 holds the real ``optuna.Trial`` and asks the sampler; every
``suggest_*`` and ``should_prune()`` answer is broadcast, so all ranks build the same
model with the same hyperparameters and stop at the same epoch. An exception on rank 0
(a bad range, a storage error) is broadcast too and raised on every rank, instead of
leaving the others waiting.

Example (inside a k-rank job; :func:`phalanx.tune.run_study` makes the trial for you)::

    def objective(trial):                    # trial: DistributedTrial, on every rank
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        for epoch in range(10):
            acc = train_one_epoch(lr)        # collectives inside, as usual
            trial.report(acc, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()   # every rank raises at the same epoch
        return acc

Outside any job (a world of one) it is a thin wrapper over the trial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import phalanx.runtime as runtime
from phalanx.comm.collectives import broadcast_object

__all__ = ["DistributedTrial"]


class DistributedTrial:
    """Rank 0 passes its ``optuna.Trial``; the other ranks pass None."""

    def __init__(self, trial: Any | None, topology: runtime.Topology | None = None) -> None:
        if topology is None and runtime.is_initialized():
            topology = runtime.topology()
        self._rank = topology.rank if topology is not None else 0
        self._size = topology.size if topology is not None else 1
        if self._rank == 0 and trial is None:
            raise ValueError("DistributedTrial: rank 0 must pass its optuna trial (the other ranks pass None)")
        if self._rank != 0 and trial is not None:
            raise ValueError(f"DistributedTrial: rank {self._rank} passed a trial; only rank 0 holds it, pass None")
        self._trial = trial
        self._number = self._call(lambda t: t.number)

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(trial)`` on rank 0 and return its result (or raise its exception) on every rank."""
        result = None
        if self._rank == 0:
            try:
                result = ("ok", fn(self._trial))
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                result = ("err", exc)
        if self._size > 1:
            result = broadcast_object(result, root_rank=0)
        kind, value = result
        if kind == "err":
            raise value
        return value

    # -- suggestions ------------------------------------------------------------------------------
    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None,
                      log: bool = False) -> float:
        return self._call(lambda t: t.suggest_float(name, low, high, step=step, log=log))

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return self._call(lambda t: t.suggest_int(name, low, high, step=step, log=log))

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return self._call(lambda t: t.suggest_categorical(name, choices))

    # -- pruning ----------------------------------------------------------------------------------
    def report(self, value: float, step: int) -> None:
        """Record an intermediate value (rank 0 writes it; every rank passes the same step)."""
        self._call(lambda t: t.report(float(value), step))

    def should_prune(self) -> bool:
        """Rank 0 asks the pruner; every rank gets the same answer."""
        return bool(self._call(lambda t: t.should_prune()))

    # -- attributes -------------------------------------------------------------------------------
    def set_user_attr(self, key: str, value: Any) -> None:
        self._call(lambda t: t.set_user_attr(key, value))

    @property
    def number(self) -> int:
        return self._number

    @property
    def params(self) -> dict[str, Any]:
        return self._call(lambda t: t.params)

    @property
    def distributions(self) -> dict[str, Any]:
        return self._call(lambda t: t.distributions)

    @property
    def user_attrs(self) -> dict[str, Any]:
        return self._call(lambda t: t.user_attrs)

    @property
    def datetime_start(self):
        return self._call(lambda t: t.datetime_start)
