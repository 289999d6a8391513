"""An in-process elastic ``phalanx run`` on a preemption signal: forward it, wait, exit 85.

The elastic supervisor (:mod:`.supervisor`) answers SIGINT by stopping its workers (exit 130).
SIGTERM and ``--preempt-signal`` (``$PHALANX_PREEMPT_SIGNAL``) are instead passed to every
worker on this machine; the members' ``elastic.run`` votes at its next commit (one member
that got the signal is enough: the vote is an allreduce MAX), writes that commit and exits 85::

    SIGTERM ─ forwarded to the local workers ─ a member exits 85 ─ wait for the other members
            (≤ GRACE_S from the signal) ─ kill, naming them, those that did not finish
    every member exited 85 (or was stopped after one did) ─ phalanx run exits 85

A member's exit 85 without a signal here (``scancel --signal=USR1 --full`` signals the
workers themselves) is the same preemption, never a lost worker.

Example::

    pre = ElasticPreemption(os.environ)
    previous = pre.install(stop_event, lambda: alive_workers)
    ...
    if pre.signal is not None: return pre.finish(members, stop)
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time

from phalanx.launcher.forward import GRACE_S, all_preempted, preempt_signals, report_preempted
from phalanx.launcher.hosts import is_local
from phalanx.launcher.stall import describe_exit
from phalanx.preemption.signals import PREEMPTED_EXIT_CODE

__all__ = ["ElasticPreemption", "PREEMPTED_EXIT_CODE"]


class ElasticPreemption:
    """The supervisor's signal handlers and its preemption ending (see the module docstring)."""

    def __init__(self, env, grace_s: float = GRACE_S) -> None:
        self.signals = preempt_signals((signal.SIGTERM,), env)
        self.grace_s = grace_s
        self.signal: signal.Signals | None = None
        self.since: float | None = None

    def install(self, interrupt, workers) -> dict:
        """SIGINT sets ``interrupt``; the preemption signals go to ``workers()``' local processes."""

        def on_preempt(signum, frame):
            if self.signal is None:
                self.signal, self.since = signal.Signals(signum), time.monotonic()
            local = [w for w in workers() if is_local(w.host)]
            print(f"phalanx: received {signal.Signals(signum).name}; forwarded to {len(local)} worker(s), "
                  f"waiting up to {self.grace_s:.0f} s for their preemption checkpoint", file=sys.stderr, flush=True)
            for w in local:
                with contextlib.suppress(ProcessLookupError, OSError):
                    w.proc.send_signal(signum)

        previous = {}
        for sig in (signal.SIGINT, *self.signals):
            with contextlib.suppress(ValueError):  # not the main thread
                previous[sig] = signal.signal(sig, (lambda *_: interrupt.set()) if sig == signal.SIGINT
                                              else on_preempt)
        return previous

    @staticmethod
    def uninstall(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def finish(self, members, stop) -> int:
        """Wait (bounded) for every member to exit; 85 when they saved, else the first other status."""
        self.since = self.since or time.monotonic()
        stop({"done": True})  # workers waiting to join exit 0
        deadline = self.since + self.grace_s
        pending = [w for w in members if w.code is None]
        while pending and time.monotonic() < deadline:
            for w in list(pending):
                w.code = w.proc.poll()
                if w.code is not None:
                    pending.remove(w)
            time.sleep(0.05)
        for w in pending:
            rank = members.index(w)
            print(f"phalanx: rank {rank} ({w.wid} on {w.host}, pid {w.proc.pid}) did not finish its preemption "
                  f"checkpoint within {self.grace_s:.0f} s; killing it", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            w.proc.wait(5)
            w.code = -int(signal.SIGKILL)
        codes = [w.code for w in members]
        if all_preempted(codes):
            return report_preempted(self.signal)
        if all(c == 0 for c in codes):
            return 0
        for rank, w in enumerate(members):
            if w.code != PREEMPTED_EXIT_CODE:
                print(f"phalanx: rank {rank} ({w.wid} on {w.host}) did not save a preemption checkpoint: "
                      f"{describe_exit(w.code)}", file=sys.stderr, flush=True)
        bad = [c for c in codes if c not in (0, PREEMPTED_EXIT_CODE)]
        return (128 - bad[0] if bad[0] < 0 else bad[0]) if bad else 1
