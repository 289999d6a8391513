"""Hyperparameter search whose trials are phalanx jobs (``pip install 'phalanx[tune]'``).

* Optuna: :class:`DistributedTrial` (every rank follows rank 0's suggestions and pruning
  decisions) and :func:`run_study` (a study of N trials, each a k-rank job launched with
  ``phalanx.run`` or on Ray, in parallel when slots allow, stored in SQLite by default).
* Ray Tune: :func:`distributed_trainable` (each trial a RayExecutor job) and :func:`report`
  (rank 0's per-epoch metrics to Tune's schedulers, e.g. ASHA).

Names load on first use, so the Optuna half never imports Ray and the other way round.
``import phalanx`` imports neither.

Example::

    from phalanx.tune import run_study
    study = run_study(objective, n_trials=8, ranks_per_trial=2, direction="maximize")

See docs/tuning.md.
"""

import importlib

__all__ = ["DistributedTrial", "run_study", "open_storage", "trials_table", "distributed_trainable", "report"]

_HOME = {"DistributedTrial": "phalanx.tune.trial", "run_study": "phalanx.tune.study",
         "open_storage": "phalanx.tune.study", "trials_table": "phalanx.tune.study",
         "distributed_trainable": "phalanx.tune.ray_tune", "report": "phalanx.tune.ray_tune"}


def __getattr__(name):
    if name in _HOME:
        try:
            return getattr(importlib.import_module(_HOME[name]), name)
        except ImportError as err:
            extra = "ray" if _HOME[name].endswith("ray_tune") else "tune"
            raise ImportError(f"phalanx.tune.{name} needs {err.name}: pip install 'phalanx[{extra}]'") from err
    raise AttributeError(f"module 'phalanx.tune' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
