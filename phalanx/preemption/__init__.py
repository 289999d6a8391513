"""Preemption: on SIGTERM or the scheduler's warning signal, one checkpoint at the same step on
every rank, then exit with status 85 ("preempted, resume me"); under SLURM, requeue the job.

Example::

    with px.preemption.watch() as preempt:
        preempt.resume(mgr, state)
        for step in range(state["step"], steps):
            ...
            if preempt.requested():
                preempt.save_and_exit(mgr, step + 1, state)

The Trainer does this by itself when it has a ``Checkpoint`` callback; ``phalanx run
--preempt-signal USR1`` forwards the signal to every worker and exits 85. See docs/preemption.md.
"""

from phalanx.preemption import signals, slurm
from phalanx.preemption.signals import PREEMPTED_EXIT_CODE
from phalanx.preemption.watch import Preempted, Preemption, watch

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Preemption", "watch", "signals", "slurm"]
