"""Autotune: pick the fusion (bucket) size online, during the first training steps.

Like Horovod's autotune (``HOROVOD_AUTOTUNE=1``), it tries settings on the real
job while it trains, scores each by its step time and keeps the best. Horovod
uses Bayesian optimisation over several knobs; here a short list of bucket sizes
is searched by successive halving: every candidate is tried in interleaved,
repeated trials (the order reversed each pass, the first step after each switch
dropped), the slower half is dropped, and again, until one is left. On a shared
machine one trial per candidate is not enough: step times drift by more than
the differences between bucket sizes. Every rank scores a trial by the
*slowest* rank's median step time (one small allreduce per trial), so all ranks
take the same decisions::

    steps:  warm-up │ 1 4 16 64 │ 64 16 4 1 │ 4 16 │ 16 4 │ best, for good
            (each trial: 1 settling step + k timed; score = max over ranks of the median)

Example::

    model = px.DataParallel(net)
    tuner = autotune.for_data_parallel(model, candidates_mb=(1, 4, 16, 64))
    for x, y in loader:
        t0 = time.perf_counter()
        ...one step...
        tuner.step(time.perf_counter() - t0)   # applies the next candidate between steps
    tuner.best, tuner.log, tuner.scores()       # chosen size, (size, seconds) of every trial, medians

Without code: ``phalanx run --autotune [--autotune-log-file F] python train.py`` (or
``HOROVOD_AUTOTUNE=1``) sets PHALANX_AUTOTUNE; ``phalanx.init()`` then attaches a tuner
to every gradient engine (DataParallel, DistributedOptimizer), timed from one
synchronised step to the next. On more than one host the search also tries the
hierarchical allreduce against the flat one.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence

import torch

from phalanx.log import get_logger
from phalanx.settings import DataParallelSettings

__all__ = ["Autotuner", "for_data_parallel", "for_engine", "set_bucket_mb", "enable_from_env", "write_log"]

_log = get_logger(__name__)


class Autotuner:
    """Find the fastest of ``candidates`` by successive halving over interleaved, repeated trials.

    A *trial* runs one candidate for ``settle`` steps (dropped: the first step after a
    re-bucketing pays for it) then ``steps_per_trial`` timed steps, scored by the slowest
    rank's median. A *stage* runs ``rounds`` passes over the surviving candidates, each
    pass in the reverse order of the previous one (a drift in the machine's load then
    hits every candidate alike); at its end the faster half (by the median of each
    candidate's trial scores so far) survives. The last survivor is kept for good::

        warm-up │ a b c d e │ e d c b a │ c a b │ b a c │ a b │ b a │ a, for good
                 └──── stage 1 ────────┘ └── stage 2 ──┘ └ stage 3┘

    ``rounds=1`` is a single sweep that keeps the fastest (Horovod-style, cheap, noisy).
    ``apply(value)`` must switch the setting between steps. ``group`` is the process
    group whose ranks decide together (None: the world; a world of one works too).
    """

    def __init__(self, candidates: Sequence, apply: Callable[[object], None], *,
                 warmup: int = 2, steps_per_trial: int = 5, rounds: int = 2, settle: int = 1,
                 group=None) -> None:
        if not candidates:
            raise ValueError("Autotuner needs at least one candidate value")
        if steps_per_trial < 1 or warmup < 0 or rounds < 1 or settle < 0:
            raise ValueError("Autotuner needs steps_per_trial >= 1, rounds >= 1, warmup >= 0 and settle >= 0; got "
                             f"steps_per_trial={steps_per_trial} rounds={rounds} warmup={warmup} settle={settle}")
        self.candidates = list(candidates)
        self.apply = apply
        self.warmup = warmup
        self.steps_per_trial = steps_per_trial
        self.rounds = rounds
        self.settle = settle
        self.group = group
        self.log: list[tuple[object, float]] = []
        """(candidate, agreed median seconds per step) of every trial, in order"""
        self.restart()

    def restart(self) -> None:
        """Search again from the start (every rank at the same step: after an elastic re-form)."""
        self.best = None
        self._trials: list[list[float]] = [[] for _ in self.candidates]
        self._alive = list(range(len(self.candidates)))
        self._queue = self._stage_order()
        self._pos = 0
        self._times: list[float] = []
        self._seen = 0
        self._skip = 0
        self.apply(self.candidates[self._queue[0]])

    def adopt(self, best) -> None:
        """Take ``best`` as the search's result without searching (an elastic newcomer takes the job's)."""
        self.best = best
        self.apply(best)

    def reformed(self, best) -> None:
        """After an elastic re-form, on every rank, with rank 0's (the oldest member's) ``best``: adopt
        it; None (rank 0 was still searching, or had no tuner) searches again from the start, in step."""
        if best is not None and best in self.candidates:
            self.adopt(best)
        else:
            self.restart()

    @property
    def done(self) -> bool:
        return self.best is not None

    def scores(self) -> dict:
        """Median seconds per step of every candidate tried so far (over its trials)."""
        return {self.candidates[i]: statistics.median(t) for i, t in enumerate(self._trials) if t}

    def _stage_order(self) -> list[int]:
        order: list[int] = []
        for r in range(self.rounds):
            order += self._alive if r % 2 == 0 else self._alive[::-1]
        return order

    def _agree(self, seconds: float) -> float:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return seconds
        from phalanx.comm.collectives import Max, allreduce

        return float(allreduce(torch.tensor([seconds], dtype=torch.float64), op=Max, group=self.group,
                               name="autotune")[0])

    def step(self, seconds: float) -> None:
        """Report one step's time; switches candidate between steps when a trial is complete."""
        if self.done:
            return
        self._seen += 1
        if self._seen <= self.warmup:
            return
        if self._skip:
            self._skip -= 1
            return
        self._times.append(seconds)
        if len(self._times) < self.steps_per_trial:
            return
        i = self._queue[self._pos]
        score = self._agree(statistics.median(self._times))
        self._times = []
        self.log.append((self.candidates[i], score))
        self._trials[i].append(score)
        _log.info("autotune: %s -> %.2f ms/step", _show(self.candidates[i]), score * 1e3)
        self._pos += 1
        if self._pos == len(self._queue):  # end of a stage: the faster half goes on
            ranked = sorted(self._alive, key=lambda j: (statistics.median(self._trials[j]), j))
            keep = ranked[:1] if self.rounds == 1 else ranked[:max(1, math.ceil(len(ranked) / 2))]
            if len(keep) == 1:
                self.best = self.candidates[keep[0]]
                self.apply(self.best)
                _log.info("autotune: keeping %s (median per candidate: %s)", _show(self.best),
                          ", ".join(f"{_show(v)}={s * 1e3:.2f}ms" for v, s in self.scores().items()))
                return
            self._alive = sorted(keep)
            self._queue = self._stage_order()
            self._pos = 0
        nxt = self._queue[self._pos]
        if nxt != i:
            self.apply(self.candidates[nxt])
            self._skip = self.settle


def _show(value) -> str:
    """A candidate for the log: ``4`` or ``4 MB/hierarchical``."""
    if isinstance(value, tuple):
        return "/".join(f"{v:g} MB" if isinstance(v, float | int) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float | int) else str(value)


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
        world = engine.group is None or getattr(engine, "follows_world", False)  # (the world's steps group)
        algorithms = ("flat", "hierarchical") if hosts > 1 and world else (engine.algorithm,)
    grid = list(itertools.product(candidates_mb, algorithms))

    def apply(choice) -> None:
        mb, algorithm = choice
        engine.algorithm = algorithm
        set_bucket_mb(engine, mb)

    return Autotuner(grid, apply, group=engine.group, **kwargs)


def write_log(tuner: Autotuner, path: str) -> None:
    """Rank 0 writes the search as CSV, one row per candidate tried: bucket_mb, algorithm,
    median seconds per step over its trials, the number of trials, and which was kept."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    trials: dict = {}
    for value, _ in tuner.log:
        trials[value] = trials.get(value, 0) + 1
    with open(path, "w") as f:
        f.write("bucket_mb,algorithm,seconds_per_step,trials,chosen\n")
        for (mb, algorithm), seconds in tuner.scores().items():
            chosen = "best" if (mb, algorithm) == tuner.best else ""
            f.write(f"{mb:g},{algorithm},{seconds:.6f},{trials[(mb, algorithm)]},{chosen}\n")


def enable_from_env(environ=None) -> bool:
    """Attach a tuner to every gradient engine created from now on when PHALANX_AUTOTUNE
    (or HOROVOD_AUTOTUNE) is 1; knobs PHALANX_AUTOTUNE_LOG, _WARMUP_STEPS, _STEPS_PER_TRIAL,
    _ROUNDS (passes per halving stage; 1 = one sweep), _SETTLE_STEPS (dropped after each
    switch), _BUCKETS_MB (comma list): :class:`phalanx.settings.DataParallelSettings`.
    Returns whether it was enabled."""
    global _enabled
    job = DataParallelSettings.read(environ)
    if not job.autotune:
        return False
    if _enabled:
        return True
    from phalanx.parallel.data import register_engine_hook

    candidates = job.autotune_buckets_mb or DEFAULT_CANDIDATES_MB
    log_file = job.autotune_log
    warmup, per_trial = job.autotune_warmup_steps, job.autotune_steps_per_trial
    rounds, settle = job.autotune_rounds, job.autotune_settle_steps

    def attach(engine) -> None:
        tuner = for_engine(engine, candidates, warmup=warmup, steps_per_trial=per_trial, rounds=rounds,
                           settle=settle)
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
