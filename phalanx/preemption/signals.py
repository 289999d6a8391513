"""The local half of preemption: catch the scheduler's warning signal and remember it.

A handler only sets a flag (and the time it came); it never saves, logs or talks to
other ranks, because a signal lands between two bytecodes anywhere in the program,
possibly inside a collective or a lock. The training loop reads the flag at its next
step boundary and the ranks agree there (:mod:`phalanx.preemption.watch`).

Which signals: SIGTERM always (Kubernetes, SLURM at the time limit, spot reclaim,
``phalanx run`` forwarding), plus ``$PHALANX_PREEMPT_SIGNAL`` (``phalanx run
--preempt-signal USR1`` sets it, matching ``#SBATCH --signal=USR1@90``).

Example::

    from phalanx.preemption import signals
    signals.install(signals.from_env())     # SIGTERM + $PHALANX_PREEMPT_SIGNAL
    ...
    if signals.received():                  # this rank only; see watch.Preemption for the agreement
        ...
"""

from __future__ import annotations

import signal
import threading
import time

from phalanx.preemption import guard
from phalanx.settings import PreemptionSettings

__all__ = ["PREEMPTED_EXIT_CODE", "parse_signal", "from_env", "install", "uninstall", "received",
           "received_at", "clear"]

# "Preempted, resume me": distinct from success (0), a crash (1), a usage error (2), the sysexits.h
# range (64-78: 75 is already elastic's "could not re-form", phalanx.elastic.inprocess) and a signal
# death (128+N), so a scheduler policy can match it (Kubernetes podFailurePolicy onExitCodes,
# SLURM's RequeueExit=85, a shell loop `while [ $? -eq 85 ]`).
PREEMPTED_EXIT_CODE = 85

_state: dict = {"signal": None, "at": None}
_previous: dict[int, object] = {}


def parse_signal(name: str | int) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``"10"`` or 10 -> ``signal.SIGUSR1``; a one-line ValueError otherwise."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"--preempt-signal {name!r} is not a signal name; use e.g. USR1, USR2, TERM "
                         "(as in #SBATCH --signal=USR1@90)") from None


def from_env(env: dict | None = None) -> list[signal.Signals]:
    """SIGTERM plus every signal named (comma-separated) in ``$PHALANX_PREEMPT_SIGNAL``."""
    out = [signal.SIGTERM]
    for name in PreemptionSettings.one("signals", env):
        sig = parse_signal(name)
        if sig not in out:
            out.append(sig)
    return out


def _handler(signum, frame) -> None:
    if _state["signal"] is None:  # the first one counts; repeats (launcher forwarding + scancel --full) do not
        _state["signal"], _state["at"] = signal.Signals(signum), time.monotonic()


def install(signals) -> bool:
    """Catch ``signals`` in this process; returns False (and does nothing) off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in signals:
        previous = signal.signal(sig, _handler)
        _previous.setdefault(int(sig), previous)
    guard.start(signals)  # under phalanx run: a signal while blocked in a collective is seen at once
    return True


def uninstall() -> None:
    """Give every signal back its handler from before :func:`install`."""
    if threading.current_thread() is not threading.main_thread():
        return
    guard.stop()
    for sig, previous in list(_previous.items()):
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        del _previous[sig]


def received() -> signal.Signals | None:
    """The preemption signal this process got (None if none)."""
    return _state["signal"]


def received_at() -> float | None:
    """``time.monotonic()`` when it came."""
    return _state["at"]


def clear() -> None:
    _state["signal"], _state["at"] = None, None
