"""Pipeline schedules: the order in which one stage runs its forwards and backwards.

A schedule is a pure function of ``(stage, num_stages, num_microbatches)``; it
returns the list of actions ``("F", i)`` / ``("B", i)`` for that stage (or
``("F", i, c)`` / ``("B", i, c)`` when each rank holds ``chunks`` model chunks,
c being the chunk: interleaved 1F1B). The
executor in :mod:`phalanx.parallel.pipeline.stage` runs them, receiving and
sending activations and gradients as each action needs. Sends never block
(``isend``), so any schedule whose dependencies form no cycle cannot deadlock.

GPipe and 1F1B leave the same time idle per stage — the *bubble*, a fraction
``(p-1)/(m+p-1)`` of the step for p stages and m micro-batches of equal cost —
they differ in memory: GPipe holds the activations of all m micro-batches,
1F1B at most p. Interleaved 1F1B with v chunks per rank cuts the bubble to
``(p-1)/(v·m+p-1)`` for v times the point-to-point messages.

New schedules register by name::

    from phalanx.parallel.pipeline.schedules import SCHEDULES
    SCHEDULES["mine"] = MySchedule()        # anything with .actions(stage, p, m)

Example::

    from phalanx.parallel.pipeline import get_schedule
    get_schedule("1f1b").actions(stage=0, num_stages=2, num_microbatches=3)
    # [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Schedule", "GPipe", "OneFOneB", "EagerOneFOneB", "Interleaved1F1B", "SCHEDULES", "get_schedule", "bubble_fraction",
           "bubble_bound", "replay", "draw"]

Action = tuple  # (kind, micro-batch) or (kind, micro-batch, chunk)


@runtime_checkable
class Schedule(Protocol):
    """The order of forward ("F", i) and backward ("B", i) actions on one stage.

    A schedule with a ``chunks`` attribute > 1 runs that many model chunks per
    rank and returns ``(kind, i, chunk)`` actions.
    """

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

        stage 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
        stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
        stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5
        stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
                  -------------------------------------------------------------> time

    (Drawn by :func:`draw`: one slot per action, a backward as long as a forward;
    in practice B is about 2F.)
    The bubble is the same as GPipe's, but a stage holds at most ``p - s``
    micro-batches' activations instead of m — the reason to prefer it.
    """

    name = "1f1b"
    extra_warmup = 0

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        _check(stage, num_stages, num_microbatches)
        m = num_microbatches
        warmup = min(num_stages - stage - 1 + (self.extra_warmup if stage < num_stages - 1 else 0), m)
        out: list[Action] = [("F", i) for i in range(warmup)]
        for k in range(m - warmup):
            out += [("F", warmup + k), ("B", k)]
        out += [("B", i) for i in range(m - warmup, m)]
        return out


class EagerOneFOneB(OneFOneB):
    """1F1B with one more warm-up forward on every stage but the last (``"eager_1f1b"``).

    In plain 1F1B with equal stages the steady state has no slack: stage s sends
    the activation of micro-batch i+1 and at once needs the gradient of micro-batch
    i, so every micro-batch pays two transfers (there and back) on the critical
    path. One forward more in flight gives each stage the next activation before it
    is needed: a transfer then delays the pipeline once, not once per micro-batch.
    On an ideal network it is 1F1B's timeline (same bubble, (p-1)/(m+p-1)); the
    price is one more micro-batch of activations held on stages 0 … p-2. p = 4, m = 6::

        stage 0 | F0 F1 F2 F3 F4 .  .  B0 F5 B1 .  B2 .  B3 .  B4 .  B5
        stage 1 | .  F0 F1 F2 F3 .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5
        stage 2 | .  .  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
        stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
                  -------------------------------------------------------------> time
    """

    name = "eager_1f1b"
    extra_warmup = 1


class Interleaved1F1B:
    """Interleaved 1F1B (Narayanan et al., SC 2021, arXiv:2104.04473, section 2.2; Megatron-LM).

    Each rank holds ``chunks`` = v non-adjacent model chunks: the model is cut into
    v·p pieces and rank r runs pieces r, r+p, r+2p, … (virtual stages), so a
    micro-batch visits every rank v times. A rank's forward of one chunk is 1/v
    of a plain stage's, so the fill and drain take 1/v as long: the bubble is
    ``(p-1)/(v·m+p-1)``, at the price of v times the messages. Micro-batches go
    in groups of p (m must be a multiple of p): p forwards of chunk 0, p of chunk
    1, …; warm-up is ``2(p-r-1) + (v-1)p`` forwards, then 1F1B, then the drain.
    p = 2, v = 2, m = 4; ``Fi.c`` / ``Bi.c`` = micro-batch i on chunk c, one slot
    per chunk action (a chunk does half a plain stage's work)::

        stage 0 | F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 .    B2.1 .    B3.1 B2.0 B3.0
        stage 1 | .    F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0
                  -------------------------------------------------------------------------------------> time

    Example::

        Interleaved1F1B(chunks=2).actions(stage=0, num_stages=2, num_microbatches=4)[:3]
        # [('F', 0, 0), ('F', 1, 0), ('F', 0, 1)]
    """

    name = "interleaved_1f1b"

    def __init__(self, chunks: int = 2) -> None:
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be a positive integer (model chunks per rank)")
        self.chunks = chunks

    def actions(self, stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
        _check(stage, num_stages, num_microbatches)
        p, v, m = num_stages, self.chunks, num_microbatches
        if m % p:
            raise ValueError(f"interleaved 1F1B sends micro-batches in groups of num_stages={p}: "
                             f"num_microbatches={m} must be a multiple of {p}")
        total = m * v

        def unit(k: int, forward: bool) -> tuple[int, int]:
            chunk = (k % (p * v)) // p
            return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

        warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
        out: list[Action] = [("F", *unit(k, True)) for k in range(warmup)]
        for j in range(total - warmup):
            out += [("F", *unit(warmup + j, True)), ("B", *unit(j, False))]
        out += [("B", *unit(k, False)) for k in range(total - warmup, total)]
        return out


def _check(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in [0, num_stages={num_stages})")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


SCHEDULES: dict[str, Schedule] = {"gpipe": GPipe(), "1f1b": OneFOneB(), "eager_1f1b": EagerOneFOneB(),
                                  "interleaved_1f1b": Interleaved1F1B(2)}


def get_schedule(schedule: str | Schedule) -> Schedule:
    """A schedule by name ("gpipe", "1f1b", "interleaved_1f1b" = 2 chunks per rank) or the object itself."""
    if isinstance(schedule, str):
        try:
            return SCHEDULES[schedule.lower()]
        except KeyError:
            raise ValueError(f"schedule={schedule!r}: known schedules are {sorted(SCHEDULES)}") from None
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a name or have .actions(stage, num_stages, num_microbatches); "
                        f"got {type(schedule).__name__}")
    return schedule


def bubble_fraction(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step with equal stage costs: (p-1)/(v·m+p-1), v = chunks."""
    return (num_stages - 1) / (chunks * num_microbatches + num_stages - 1)


def bubble_bound(stage_costs: Sequence[tuple[float, float]], num_microbatches: int,
                 schedule: str | Schedule = "1f1b") -> float:
    """Idle fraction of a step whose stages cost ``stage_costs[s] = (forward, backward)`` per micro-batch.

    The generalisation of :func:`bubble_fraction` to unequal stages, on an ideal
    network (zero transfer time): the schedule is replayed with these costs and
    the bubble is ``1 - mean(busy) / span``, the formula's definition. Equal
    costs give ``(p-1)/(m+p-1)``; otherwise every micro-batch also pays the
    slowest stage's excess on the others. For 1F1B with the slowest stage last
    (the usual case: it also computes the loss), with ``t_s = F_s + B_s``::

        span = sum(t) + (m - 1) · max(t)        bubble = 1 - m · mean(t) / span

    GPipe runs its forward phase at the slowest *forward* and its backward phase
    at the slowest *backward*, so it pays about ``(m - 1) · (max F + max B)``: the
    same when one stage is slowest in both, more when the stages are balanced in
    total but skewed per phase (the second example below: 0.144 for GPipe).

    Example::

        bubble_bound([(1, 2), (1, 2)], 8)        # 0.111 = (p-1)/(m+p-1)
        bubble_bound([(1, 1.8), (1, 2.2)], 8)    # 0.155: the last stage 13 % slower
        bubble_bound([(12, 28), (14, 26)], 8)            # 0.111: equal totals
        bubble_bound([(12, 28), (14, 26)], 8, "gpipe")   # 0.144: skewed per phase
    """
    sched = get_schedule(schedule)
    v = getattr(sched, "chunks", 1)
    p = len(stage_costs)
    if p < 1 or any(len(c) != 2 or min(c) < 0 for c in stage_costs):
        raise ValueError(f"stage_costs={stage_costs!r}: give one (forward, backward) pair of costs >= 0 per stage")
    acts = [sched.actions(s, p, num_microbatches) for s in range(p)]
    lines = replay(acts, v, duration=lambda s, k: stage_costs[s][acts[s][k][0] == "B"] / v)
    span = max(t[-1][4] for t in lines) - min(t[0][3] for t in lines)
    busy = sum(end - start for t in lines for *_, start, end in t) / p
    return 1.0 - busy / span if span > 0 else 0.0


def _unit(action: Action) -> tuple[str, int, int]:
    return (action[0], action[1], action[2] if len(action) > 2 else 0)


def replay(
    actions: Sequence[Sequence[Action]],
    chunks: int = 1,
    duration: Callable[[int, int], float] | None = None,
) -> list[list[tuple[str, int, int, float, float]]]:
    """Run each stage's ``actions`` on an ideal network (zero transfer time); returns the timelines.

    ``actions[s]`` is stage s's list; ``duration(s, k)`` is the length of stage s's
    k-th action (default: forward 1, backward 2). An action starts when its stage is
    free and its input exists: a forward needs the previous virtual stage's forward
    of the same micro-batch, a backward the next virtual stage's backward. Each
    timeline entry is ``(kind, micro_batch, chunk, start, end)``. Raises if the
    schedules wait on each other in a cycle (they would deadlock on real ranks).
    """
    p = len(actions)
    last = p * chunks - 1

    def default(s: int, k: int) -> float:
        return 1.0 if actions[s][k][0] == "F" else 2.0

    duration = duration or default
    done: dict[tuple[str, int, int], float] = {}
    out: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(p)]
    free, at = [0.0] * p, [0] * p
    while any(at[s] < len(actions[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(actions[s]):
                kind, i, c = _unit(actions[s][at[s]])
                v = c * p + s  # virtual stage
                need = ("F", i, v - 1) if kind == "F" and v > 0 else ("B", i, v + 1) if kind == "B" and v < last else None
                if need is not None and need not in done:
                    break
                start = max(free[s], done[need] if need else 0.0)
                free[s] = done[(kind, i, v)] = start + duration(s, at[s])
                out[s].append((kind, i, c, start, free[s]))
                at[s] += 1
                moved = True
        if not moved:
            stuck = {s: actions[s][at[s]] for s in range(p) if at[s] < len(actions[s])}
            raise RuntimeError(f"the stages wait on each other in a cycle (a deadlock): next actions {stuck}")
    return out


def draw(schedule: str | Schedule, num_stages: int, num_microbatches: int) -> str:
    """The ASCII timeline of ``schedule`` with every action one slot long, as drawn in the docstrings."""
    sched = get_schedule(schedule)
    chunks = getattr(sched, "chunks", 1)
    acts = [sched.actions(s, num_stages, num_microbatches) for s in range(num_stages)]
    lines = replay(acts, chunks, duration=lambda s, k: 1.0)
    width = max(len(f"{k}{i}.{c}") if chunks > 1 else len(f"{k}{i}") for t in lines for k, i, c, _, _ in t)
    rows = []
    for s, t in enumerate(lines):
        slots = ["." for _ in range(int(max(e for *_, e in t)))]
        for k, i, c, start, _ in t:
            slots[int(start)] = f"{k}{i}.{c}" if chunks > 1 else f"{k}{i}"
        rows.append(f"stage {s} | " + " ".join(x.ljust(width) for x in slots).rstrip())
    return "\n".join(rows)
