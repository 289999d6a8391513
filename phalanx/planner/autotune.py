"""Autotune: pick the fusion (bucket) size online, during the first training steps.

Like Horovod's autotune (``HOROVOD_AUTOTUNE=1``), it tries settings on the real
job while it trains, scores each by its step time and keeps the best. Horovod
uses Bayesian optimisation over several knobs; here the search is a sweep over a
short list of bucket sizes, since one knob
needs no more. Every rank scores a trial by the *slowest* rank's median step
time (one small allreduce per trial), so all ranks take the same decisions::

    steps:  warm-up │ 1 MB x k │ 4 MB x k │ 16 MB x k │ ... │ best, for good
                     score = max over ranks of median(step seconds)

Example::

    model = px.DataParallel(net)
    tuner = autotune.for_data_parallel(model, candidates_mb=(1, 4, 16, 64))
    for x, y in loader:
        t0 = time.perf_counter()
        ...one step...
        tuner.step(time.perf_counter() - t0)   # applies the next candidate between steps
    tuner.best, tuner.log                       # chosen size, and (size, seconds) of every trial
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from phalanx.log import get_logger

__all__ = ["Autotuner", "for_data_parallel", "set_bucket_mb"]

_log = get_logger(__name__)


class Autotuner:
    """Sweep ``candidates`` (``steps_per_trial`` steps each after ``warmup`` steps), keep the fastest.

    ``apply(value)`` must switch the setting between steps. ``group`` is the process
    group whose ranks decide together (None: the world; a world of one works too).
    """

    def __init__(self, candidates: Sequence[float], apply: Callable[[float], None], *,
                 warmup: int = 2, steps_per_trial: int = 5, group=None) -> None:
        if not candidates:
            raise ValueError("Autotuner needs at least one candidate value")
        if steps_per_trial < 1 or warmup < 0:
            raise ValueError("steps_per_trial must be >= 1 and warmup >= 0")
        self.candidates = list(candidates)
        self.apply = apply
        self.warmup = warmup
        self.steps_per_trial = steps_per_trial
        self.group = group
        self.log: list[tuple[float, float]] = []
        self.best: float | None = None
        self._i = 0
        self._times: list[float] = []
        self._seen = 0
        self.apply(self.candidates[0])

    @property
    def done(self) -> bool:
        return self.best is not None

    def _agree(self, seconds: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return seconds
        from phalanx.comm.collectives import Max, allreduce

        return float(allreduce(torch.tensor([seconds], dtype=torch.float64), op=Max, group=self.group,
                               name="autotune")[0])

    def step(self, seconds: float) -> None:
        """Report one step's time; switches to the next candidate when a trial is complete."""
        if self.done:
            return
        self._seen += 1
        if self._seen <= self.warmup:
            return
        self._times.append(seconds)
        if len(self._times) < self.steps_per_trial:
            return
        value = self.candidates[self._i]
        score = self._agree(statistics.median(self._times))
        self.log.append((value, score))
        _log.info("autotune: %g -> %.2f ms/step", value, score * 1e3)
        self._times = []
        self._i += 1
        if self._i < len(self.candidates):
            self.apply(self.candidates[self._i])
            return
        self.best = min(self.log, key=lambda kv: kv[1])[0]
        self.apply(self.best)
        _log.info("autotune: keeping %g (search: %s)", self.best,
                  ", ".join(f"{v:g}={s * 1e3:.2f}ms" for v, s in self.log))


def set_bucket_mb(model, bucket_mb: float) -> None:
    """Re-bucket a ``DataParallel`` model's gradients at ``bucket_mb`` (call between steps)."""
    engine = getattr(model, "_engine", None)
    manager = getattr(engine, "buckets", None)
    if manager is None:
        raise TypeError(f"set_bucket_mb needs a phalanx DataParallel model, got {type(model).__name__}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    manager.bucket_bytes = int(bucket_mb * 2**20)
    manager._build(manager.order())


def for_data_parallel(model, candidates_mb: Sequence[float] = (0.25, 1, 4, 16, 64), **kwargs) -> Autotuner:
    """An :class:`Autotuner` over ``model``'s bucket size (a phalanx ``DataParallel``)."""
    return Autotuner(candidates_mb, lambda mb: set_bucket_mb(model, mb), **kwargs)
