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

Without code: ``phalanx run --autotune [--autotune-log-file F] python train.py`` (or
``HOROVOD_AUTOTUNE=1``) sets PHALANX_AUTOTUNE; ``phalanx.init()`` then attaches a tuner
to every gradient engine (DataParallel, DistributedOptimizer), timed from one
synchronised step to the next. On more than one host the search also tries the
hierarchical allreduce against the flat one.
"""

from __future__ import annotations

import itertools
import os
import statistics
from collections.abc import Callable, Sequence

import torch

from phalanx.log import get_logger

__all__ = ["Autotuner", "for_data_parallel", "for_engine", "set_bucket_mb", "enable_from_env", "write_log"]

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
        _log.info("autotune: %s -> %.2f ms/step", _show(value), score * 1e3)
        self._times = []
        self._i += 1
        if self._i < len(self.candidates):
            self.apply(self.candidates[self._i])
            return
        self.best = min(self.log, key=lambda kv: kv[1])[0]
        self.apply(self.best)
        _log.info("autotune: keeping %s (search: %s)", _show(self.best),
                  ", ".join(f"{_show(v)}={s * 1e3:.2f}ms" for v, s in self.log))


def _show(value) -> str:
    """A candidate for the log: ``4`` or ``4 MB/hierarchical``."""
    if isinstance(value, tuple):
        return "/".join(f"{v:g} MB" if isinstance(v, float | int) else str(v) for v in value)
    return f"{value:g}"


def set_bucket_mb(model, bucket_mb: float) -> None:
    """Re-bucket the gradients of a ``DataParallel`` model (or a ``GradientEngine``) at ``bucket_mb``.

    Call between steps. Every rank must apply the same value (the tuner's decisions are agreed).
    """
    engine = getattr(model, "_engine", model)
    manager = getattr(engine, "buckets", None)
    if manager is None:
        raise TypeError(f"set_bucket_mb needs a phalanx DataParallel model, got {type(model).__name__}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    manager.bucket_bytes = int(bucket_mb * 2**20)
    manager._build(manager.order())


DEFAULT_CANDIDATES_MB = (0.25, 1, 4, 16, 64)


def for_data_parallel(model, candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB, **kwargs) -> Autotuner:
    """An :class:`Autotuner` over ``model``'s bucket size (a phalanx ``DataParallel``)."""
    return Autotuner(candidates_mb, lambda mb: set_bucket_mb(model, mb), **kwargs)


def for_engine(engine, candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB, *, algorithms=None,
               **kwargs) -> Autotuner:
    """An :class:`Autotuner` over a ``GradientEngine``'s (bucket MB, allreduce algorithm) pairs.

    ``algorithms`` defaults to flat only on one host, flat and hierarchical on several.
    """
    if algorithms is None:
        hosts = getattr(engine.topology, "cross_size", 1) if engine.topology is not None else 1
        algorithms = ("flat", "hierarchical") if hosts > 1 and engine.group is None else (engine.algorithm,)
    grid = list(itertools.product(candidates_mb, algorithms))

    def apply(choice) -> None:
        mb, algorithm = choice
        engine.algorithm = algorithm
        set_bucket_mb(engine, mb)

    return Autotuner(grid, apply, group=engine.group, **kwargs)


def write_log(tuner: Autotuner, path: str) -> None:
    """Rank 0 writes the search as CSV: bucket_mb, algorithm, seconds per step, and which was kept."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    with open(path, "w") as f:
        f.write("bucket_mb,algorithm,seconds_per_step,chosen\n")
        for (mb, algorithm), seconds in tuner.log:
            chosen = "best" if (mb, algorithm) == tuner.best else ""
            f.write(f"{mb:g},{algorithm},{seconds:.6f},{chosen}\n")


def enable_from_env(environ=os.environ) -> bool:
    """Attach a tuner to every gradient engine created from now on when PHALANX_AUTOTUNE
    (or HOROVOD_AUTOTUNE) is 1; knobs PHALANX_AUTOTUNE_LOG, _WARMUP_STEPS, _STEPS_PER_TRIAL,
    _BUCKETS_MB (comma list). Returns whether it was enabled."""
    global _enabled
    on = environ.get("PHALANX_AUTOTUNE") or environ.get("HOROVOD_AUTOTUNE")
    if str(on).lower() not in ("1", "true", "yes"):
        return False
    if _enabled:
        return True
    from phalanx.parallel.data import register_engine_hook

    def number(key: str, default: int) -> int:
        raw = environ.get(key)
        try:
            return default if raw is None else int(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not an integer") from None

    raw_mb = environ.get("PHALANX_AUTOTUNE_BUCKETS_MB")
    try:
        candidates = tuple(float(v) for v in raw_mb.split(",")) if raw_mb else DEFAULT_CANDIDATES_MB
    except ValueError:
        raise ValueError(f"PHALANX_AUTOTUNE_BUCKETS_MB={raw_mb!r}: give MB values like '1,4,16'") from None
    log_file = environ.get("PHALANX_AUTOTUNE_LOG") or environ.get("HOROVOD_AUTOTUNE_LOG")
    warmup = number("PHALANX_AUTOTUNE_WARMUP_STEPS", 3)
    per_trial = number("PHALANX_AUTOTUNE_STEPS_PER_TRIAL", 5)

    def attach(engine) -> None:
        tuner = for_engine(engine, candidates, warmup=warmup, steps_per_trial=per_trial)
        engine.autotuner = tuner

        def step(seconds: float) -> None:
            searching = not tuner.done
            tuner.step(seconds)
            if log_file and searching and tuner.done:
                write_log(tuner, log_file)

        engine.step_hooks.append(step)

    register_engine_hook(attach)
    _enabled = True
    return True


_enabled = False
