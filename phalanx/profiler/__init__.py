"""Profiler: see where a distributed step's time goes.

- :mod:`~phalanx.profiler.timeline`: every rank's spans on one clock, as Chrome-trace JSON
  (``phalanx run --timeline trace.json``, or ``timeline.start()`` / ``timeline.stop(path)``).
- :mod:`~phalanx.profiler.breakdown`: each step split into compute, exposed
  communication, waiting for stragglers and data loading, plus bytes sent.
- :mod:`~phalanx.profiler.report`: ``phalanx report``, the scaling report (HTML + PNG).

Example::

    from phalanx.profiler import timeline, breakdown, StepProfiler
    timeline.start()
    ...
    print(breakdown.from_events(timeline.stop("trace.json")).table())
"""

from phalanx.profiler import breakdown, timeline
from phalanx.profiler.breakdown import Breakdown, StepBreakdown, StepProfiler
from phalanx.profiler.timeline import Timeline, start_timeline, stop_timeline

__all__ = ["timeline", "breakdown", "Timeline", "Breakdown", "StepBreakdown", "StepProfiler",
           "start_timeline", "stop_timeline"]
