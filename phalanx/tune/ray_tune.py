"""Ray Tune trials that are phalanx jobs: each trial runs a :class:`~phalanx.ray.RayExecutor`.

``distributed_trainable(train_fn, num_workers=k)`` gives a Tune trainable that reserves
one placement group per trial (an empty head bundle for the trial's driver plus one bundle
per rank), starts k actors in it, and runs ``train_fn(config)`` on every rank. What rank 0
passes to :func:`report` (or ``phalanx.ray.ray_logger.log``) reaches ``ray.tune.report``,
so schedulers such as ASHA see every epoch and can stop the trial early; stopping the
trial ends its actors with it.

Example::

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from phalanx.tune import distributed_trainable, report

    def train_fn(config):                        # every rank; the same function runs under phalanx run
        px.init()
        for epoch in range(10):
            acc = ...
            report(epoch=epoch, accuracy=acc)    # rank 0's dict goes to Tune

    tuner = tune.Tuner(distributed_trainable(train_fn, num_workers=2),
                       param_space={"lr": tune.loguniform(1e-3, 1)},
                       tune_config=tune.TuneConfig(num_samples=4, scheduler=ASHAScheduler(
                           metric="accuracy", mode="max", max_t=10, grace_period=2)))
    results = tuner.fit()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ray import tune

from phalanx.ray import RayExecutor, ray_logger

__all__ = ["distributed_trainable", "report"]


def report(**metrics: Any) -> None:
    """From inside ``train_fn``: send rank 0's metrics of this epoch to Tune (a no-op on other ranks)."""
    ray_logger.log(dict(metrics))


def _run_trial(config: dict, *, train_fn: Callable[[dict], Any], num_workers: int, cpus_per_worker: float,
               use_gpu: bool, gpus_per_worker: float | None, timeout_s: float, env: dict[str, str]) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=timeout_s), num_workers=num_workers,
                           cpus_per_worker=cpus_per_worker, use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                           use_current_placement_group=True)
    executor.start(extra_env_vars=env)
    try:
        executor.run(train_fn, args=[config], callbacks=[tune.report])
    finally:
        executor.shutdown()


def distributed_trainable(train_fn: Callable[[dict], Any], *, num_workers: int = 2, cpus_per_worker: float = 1,
                          use_gpu: bool = False, gpus_per_worker: float | None = None, timeout_s: float = 120,
                          env: dict[str, str] | None = None):
    """A Tune trainable running ``train_fn(config)`` as a ``num_workers``-rank phalanx job per trial."""
    if num_workers < 1:
        raise ValueError(f"distributed_trainable: num_workers must be >= 1, got {num_workers}")
    worker = {"CPU": float(cpus_per_worker)}
    if use_gpu:
        worker["GPU"] = float(gpus_per_worker or 1)
    trainable = functools.partial(_run_trial, train_fn=train_fn, num_workers=num_workers,
                                  cpus_per_worker=cpus_per_worker, use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                                  timeout_s=timeout_s, env=dict(env or {}))
    functools.update_wrapper(trainable, train_fn)
    resources = tune.PlacementGroupFactory([{}] + [dict(worker) for _ in range(num_workers)])
    return tune.with_resources(trainable, resources)
