"""What a rank that has joined (uneven data) does with the gradient engine's steps: zeros, in step.

A joined rank takes part in the other ranks' gradient reductions with zeros (the average still
divides by the whole group, as Horovod's ``join``). With ``join_flag`` the first bucket carries
every rank's "I am stepping" (1, or 0 from a joined rank), so a joined rank learns from the
step's own first collective whether a step is coming: no extra collective per step::

    stepping rank   bucket 0 [grads | 1]  bucket 1 …  bucket n
    joined rank     bucket 0 [zeros | 0]  -> sum > 0: bucket 1 … bucket n (zeros)
                                          -> sum = 0: every rank has joined; nothing else sent

Example::

    while engine.answer_step():   # a joined rank, until every rank has joined
        answered += 1
"""

from __future__ import annotations

__all__ = ["JoinedSteps"]


class JoinedSteps:
    """The joined rank's side of :class:`~phalanx.parallel.data.gradients.GradientEngine`."""

    def answer_step(self) -> bool:
        """A joined rank (``join_flag``): take part in the others' next step with zeros; False when
        nobody stepped (bucket 0's flags sum to 0: every rank has joined, and nothing else is sent)."""
        first = self.buckets.buckets[0]
        self.shadowing = True
        try:
            for p in first.params:
                first.mark(p)
            self.buckets.launch_ready()
            stepping = float(first.handle.handle.wait()[-1]) > 0
            if stepping:
                for p in self.buckets.params:
                    self.buckets.bucket_of(p).mark(p)
                self.buckets.launch_ready()
        finally:
            self.shadowing = False
        if not stepping:
            self.buckets.reset()
            return False
        self._finish_shadow()
        return True

    def shadow(self) -> None:
        """Take part in one iteration's collectives with zero gradients (a joined rank)."""
        self.shadowing = True
        try:
            for p in self.buckets.params:
                self.buckets.bucket_of(p).mark(p)
            self.buckets.launch_ready()
        finally:
            self.shadowing = False
        self._finish_shadow()

    def _finish_shadow(self) -> None:
        self._launch_followups(shadow=True)
        for bucket in self.buckets.buckets:
            self.reduction.drain(bucket)
        for followup in self._followups:
            followup.drain()
        self._pending = False
        self._end_step()
