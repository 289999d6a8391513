"""Pipeline schedules: the order in which one stage runs its forwards and backwards.

A schedule is a pure function of ``(stage, num_stages, num_microbatches)``; it
returns the list of actions ``("F", i)`` / ``("B", i)`` for that stage. The
executor in :mod:`phalanx.parallel.pipeline.stage` runs them, receiving and
sending activations and gradients as each action needs. Sends never block
(``isend``), so any schedule whose dependencies form no cycle cannot deadlock.

Both schedules leave the same time idle per stage — the *bubble*, a fraction
``(p-1)/(m+p-1)`` of the step for p stages and m micro-batches of equal cost —
they differ in memory: GPipe holds the activations of all m micro-batches,
1F1B at most p.

New schedules register by name::

    from phalanx.parallel.pipeline.schedules import SCHEDULES
    SCHEDULES["mine"] = MySchedule()        # anything with .actions(stage, p, m)

Example::

    from phalanx.parallel.pipeline import get_schedule
    get_schedule("1f1b").actions(stage=0, num_stages=2, num_microbatches=3)
    # [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Schedule", "GPipe", "OneFOneB", "SCHEDULES", "get_schedule", "bubble_fraction"]

Action = tuple[str, int]


@runtime_checkable
class Schedule(Protocol):
    """The order of forward ("F", i) and backward ("B", i) actions on one stage."""

    name: str

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]: ...


class GPipe:
    """GPipe (Huang et al., 2019, arXiv:1811.06965): every forward, then every backward.

    p = 4 stages, m = 4 micro-batches; Fi = forward of micro-batch i, Bi its backward,
    ``.`` = idle (the bubble)::

        stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
        stage 1 | .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
        stage 2 | .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
        stage 3 | .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  .
                  ------------------------------------------> time

    Simple, and the backwards run in reverse so the last micro-batch's
    activations are freed first; but all m micro-batches' activations are alive
    at the turn, so memory grows with m.
    """

    name = "gpipe"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        _check(stage, num_stages, num_microbatches)
        m = num_microbatches
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


class OneFOneB:
    """1F1B (PipeDream-Flush, Narayanan et al., 2021, arXiv:2006.09503; Megatron-LM's default).

    Stage s runs ``p-s-1`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. p = 4, m = 6::

        stage 0 | F0 F1 F2 F3 .  .  .  B0 F4 .  B1 F5 .  B2 .  .  B3 .  B4 .  B5
        stage 1 | .  F0 F1 F2 .  .  B0 F3 .  B1 F4 .  B2 F5 .  B3 .  B4 .  B5 .
        stage 2 | .  .  F0 F1 .  B0 F2 .  B1 F3 .  B2 F4 .  B3 F5 .  B4 B5 .  .
        stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .  .  .  .  .
                  -------------------------------------------------------------> time

    (Drawn with a backward as long as a forward; in practice B is about 2F.)
    The bubble is the same as GPipe's, but a stage holds at most ``p - s``
    micro-batches' activations instead of m — the reason to prefer it.
    """

    name = "1f1b"

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        _check(stage, num_stages, num_microbatches)
        m = num_microbatches
        warmup = min(num_stages - stage - 1, m)
        out: list[Action] = [("F", i) for i in range(warmup)]
        for k in range(m - warmup):
            out += [("F", warmup + k), ("B", k)]
        out += [("B", i) for i in range(m - warmup, m)]
        return out


def _check(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in [0, num_stages={num_stages})")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


SCHEDULES: dict[str, Schedule] = {"gpipe": GPipe(), "1f1b": OneFOneB()}


def get_schedule(schedule: str | Schedule) -> Schedule:
    """A schedule by name ("gpipe", "1f1b") or the object itself."""
    if isinstance(schedule, str):
        try:
            return SCHEDULES[schedule.lower()]
        except KeyError:
            raise ValueError(f"schedule={schedule!r}: known schedules are {sorted(SCHEDULES)}") from None
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name or have .actions(stage, num_stages, num_microbatches); "
                        f"got {type(schedule).__name__}")
    return schedule


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a synchronous pipeline step with equal stage costs: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
