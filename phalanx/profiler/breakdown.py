"""Step breakdown: where each rank's step time goes.

From the spans of a timeline (see :mod:`phalanx.profiler.timeline`) it splits
every step of every rank into::

    step = data + compute + exposed communication + waiting for stragglers + other

Span conventions (categories of :func:`phalanx.trace.span`):

    "step"     one per training step, args {"step": i}     (StepProfiler.steps makes them)
    "data"     loading the next batch
    "compute"  forward, backward, optimizer step
    "comm"     names with wait / compress / decompress block the main thread;
               other comm spans (an async allreduce from launch to completion)
               count only where no compute or data span covers them — that is
               the part *not* hidden behind backward.

A "compute" span with ``args["in_wait"]`` (work done while the rank waits for
the wire, e.g. the optimizer stepped on each decoded piece:
``DataParallel(overlap_optimizer=...)``) is charged as compute even inside a
blocking comm span. Each instant of a step is charged to exactly one bucket, by priority
data > compute in a wait > blocking comm > compute > overlappable comm > other, so the parts add up
to the step time by construction; ``other`` is what no span covered (Python
overhead between spans) and stays small when a loop is fully instrumented.

Waiting for stragglers: a rank is *ready* when it first blocks on communication
(or its backward ends, if sooner). In a step,
rank r waits ``max_q ready_q - ready_r`` for the slowest rank (clocks are
aligned by the timeline), charged out of its exposed communication.

Example::

    from phalanx.profiler import StepProfiler, timeline, breakdown
    timeline.start(); prof = StepProfiler()
    for step, (x, y) in prof.steps(loader):
        with prof.phase("forward"): loss = loss_fn(model(x), y)
        with prof.phase("backward"): loss.backward()
        with prof.phase("optimizer"): opt.step()
    bd = breakdown.from_events(timeline.stop())
    print(bd.table()); bd.to_tensorboard("runs/breakdown")
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from phalanx import trace

__all__ = ["StepBreakdown", "Breakdown", "StepProfiler", "from_events"]

_BLOCKING = ("wait", "compress", "launch", "barrier", "check", "negotiat")
_NO_BYTES = ("wait", "compress")  # their "bytes" repeat what the launch/collective span sent


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """One rank's step, in seconds (``bytes_sent``: payload bytes its collectives sent)."""

    rank: int
    step: int
    total_s: float
    compute_s: float
    comm_s: float
    straggler_s: float
    data_s: float
    other_s: float
    bytes_sent: int

    @property
    def parts_s(self) -> float:
        return self.compute_s + self.comm_s + self.straggler_s + self.data_s + self.other_s


@dataclasses.dataclass
class Breakdown:
    """All steps of all ranks. ``bd.steps`` is the list; helpers summarise it."""

    steps: list[StepBreakdown]

    def for_rank(self, rank: int) -> list[StepBreakdown]:
        return [s for s in self.steps if s.rank == rank]

    def mean(self, rank: int | None = None) -> dict[str, float]:
        rows = self.steps if rank is None else self.for_rank(rank)
        if not rows:
            return {}
        keys = ("total_s", "compute_s", "comm_s", "straggler_s", "data_s", "other_s", "bytes_sent")
        return {k: sum(getattr(s, k) for s in rows) / len(rows) for k in keys}

    def table(self) -> str:
        """Per-rank means as a text table (milliseconds)."""
        lines = [f"{'rank':>4} {'steps':>5} {'step ms':>8} {'compute':>8} {'comm':>8} "
                 f"{'straggle':>8} {'data':>8} {'other':>8} {'MB sent':>8}"]
        for r in sorted({s.rank for s in self.steps}):
            m, n = self.mean(r), len(self.for_rank(r))
            lines.append(f"{r:>4} {n:>5} {m['total_s'] * 1e3:>8.2f} {m['compute_s'] * 1e3:>8.2f} "
                         f"{m['comm_s'] * 1e3:>8.2f} {m['straggler_s'] * 1e3:>8.2f} "
                         f"{m['data_s'] * 1e3:>8.2f} {m['other_s'] * 1e3:>8.2f} "
                         f"{m['bytes_sent'] / 1e6:>8.3f}")
        return "\n".join(lines)

    def to_tensorboard(self, logdir: str) -> str:
        """Write TensorBoard event files, one run per rank (``logdir/rank<N>``); returns logdir."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("Breakdown.to_tensorboard needs tensorboard: pip install 'phalanx[tensorboard]'") from err
        for r in sorted({s.rank for s in self.steps}):
            writer = SummaryWriter(log_dir=f"{logdir}/rank{r}")
            for s in self.for_rank(r):
                for key in ("total_s", "compute_s", "comm_s", "straggler_s", "data_s", "other_s"):
                    writer.add_scalar(f"step/{key[:-2]}_ms", getattr(s, key) * 1e3, s.step)
                writer.add_scalar("step/bytes_sent", s.bytes_sent, s.step)
            writer.close()
        return logdir


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(segments: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in segments)


def _split_step(lo: float, hi: float, spans: list[dict[str, Any]]):
    """Charge each instant of [lo, hi) to one bucket. Returns seconds per bucket and ready time."""
    kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ready = None
    for e in spans:
        a, b = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
        if b <= a:
            continue
        cat, name = e.get("cat", ""), e["name"].lower()
        if cat == "data":
            kinds["data"].append((a, b))
        elif cat == "comm":
            blocking = e.get("args", {}).get("blocking", any(k in name for k in _BLOCKING))
            kinds["block" if blocking else "async"].append((a, b))
            if blocking:
                ready = a if ready is None else min(ready, a)
        elif cat == "compute":
            kinds["work" if e.get("args", {}).get("in_wait") else "compute"].append((a, b))
            if name == "backward":
                ready = b if ready is None else min(ready, b)
    merged = {k: _union(v) for k, v in kinds.items()}
    cuts = sorted({lo, hi, *(t for v in merged.values() for seg in v for t in seg)})
    secs = dict.fromkeys(("data", "comm", "compute", "other"), 0.0)
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        if _covered(merged.get("data", []), a):
            secs["data"] += b - a
        elif _covered(merged.get("work", []), a):
            secs["compute"] += b - a
        elif _covered(merged.get("block", []), a) or (
            not _covered(merged.get("compute", []), a) and _covered(merged.get("async", []), a)
        ):
            secs["comm"] += b - a
        elif _covered(merged.get("compute", []), a):
            secs["compute"] += b - a
        else:
            secs["other"] += b - a
    return secs, ready


def from_events(events: Iterable[dict[str, Any]]) -> Breakdown:
    """Break down every "step" span of every rank (pid) in Chrome-trace events (µs)."""
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_rank[int(e["pid"])].append({**e, "ts": e["ts"] / 1e6, "dur": e["dur"] / 1e6})
    partial: dict[tuple[int, int], tuple[float, dict[str, float], float | None, int]] = {}
    for rank, spans in by_rank.items():
        steps = [e for e in spans if e.get("cat") == "step"]
        for i, st in enumerate(sorted(steps, key=lambda e: e["ts"])):
            lo, hi = st["ts"], st["ts"] + st["dur"]
            inside = [e for e in spans if e is not st and e.get("cat") != "step" and e["ts"] < hi
                      and e["ts"] + e["dur"] > lo]
            secs, ready = _split_step(lo, hi, inside)
            sent = sum(int(e.get("args", {}).get("bytes", 0)) for e in inside
                       if e.get("cat") == "comm" and lo <= e["ts"] < hi
                       and not any(k in e["name"].lower() for k in _NO_BYTES))
            step_id = int(st.get("args", {}).get("step", i))
            partial[(rank, step_id)] = (hi - lo, secs, ready, sent)
    ready_max: dict[int, float] = {}
    for (_, step_id), (_, _, ready, _) in partial.items():
        if ready is not None:
            ready_max[step_id] = max(ready_max.get(step_id, ready), ready)
    out = []
    for (rank, step_id), (total, secs, ready, sent) in sorted(partial.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        straggle = 0.0
        if ready is not None and step_id in ready_max:
            straggle = min(max(0.0, ready_max[step_id] - ready), secs["comm"])
        out.append(StepBreakdown(rank=rank, step=step_id, total_s=total, compute_s=secs["compute"],
                                 comm_s=secs["comm"] - straggle, straggler_s=straggle, data_s=secs["data"],
                                 other_s=secs["other"], bytes_sent=sent))
    return Breakdown(out)


class StepProfiler:
    """Emits the "step", "data" and "compute" spans a breakdown needs (free when tracing is off).

    Example::

        prof = StepProfiler()
        for step, batch in prof.steps(loader):      # a "data" span around each fetch,
            with prof.phase("forward"):             # a "step" span from fetch to fetch
                ...
    """

    def steps(self, iterable: Iterable[Any], start: int = 0) -> Iterator[tuple[int, Any]]:
        it = iter(iterable)
        step = start
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            t1 = time.perf_counter()
            trace.instant("data", "data", t0, t1, step=step)
            yield step, batch
            trace.instant("step", "step", t0, time.perf_counter(), step=step)
            step += 1

    @staticmethod
    def phase(name: str, **args: Any):
        """A "compute" span: ``forward``, ``backward`` (marks the rank ready), ``optimizer``…"""
        return trace.span(name, "compute", **args)
