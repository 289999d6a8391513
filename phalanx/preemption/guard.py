"""Tell a preemption from the agent stopping the group, while the main thread is blocked.

A Python signal handler runs only when the main thread is back in the interpreter. Under
``phalanx run --max-restarts`` (TorchElastic's group restart) a worker that watches for
preemption (a Trainer ``Checkpoint``, ``px.preemption.watch()``) catches SIGTERM; when a
peer dies, the agent stops the group with that same SIGTERM and sends SIGKILL 30 s later. A
worker blocked in a collective that the dead peer never finishes (a gloo unbound-buffer
receive that the closed socket does not end) would sit there for those 30 s, and the group
restart with it.

So besides the flag, the C-level handler writes the signal's number to a wakeup pipe
(:func:`signal.set_wakeup_fd`), read by a daemon thread that sees the signal at once, whatever
the main thread is doing. ``phalanx run`` marks a preemption before forwarding it: it creates
the file named by ``$PHALANX_PREEMPT_MARK`` (a scheduler signalling every process, as
``scancel --full`` does, reaches the launcher too and the mark follows within milliseconds).

    signal came, mark present            a preemption: the main thread votes and saves as before
    signal came, no mark, and the main   the agent is stopping the group: print one line and exit
    thread blocked in a collective for   at once (status 128 + signal), so the group restart
    GRACE_S since the signal             starts now instead of after the agent's SIGKILL
    the ranks agreed on a preemption     the guard stands down (the save's own waits are legitimate)

Armed only when ``$PHALANX_PREEMPT_MARK`` is set (``phalanx run``'s TorchElastic path); any
wakeup fd installed before (asyncio's) still gets every byte.

Example::

    guard.start([signal.SIGTERM])      # signals.install does this
    ...
    guard.agreed()                     # Preemption.decide: the ranks agreed; stand down
    guard.stop()
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

from phalanx.settings import PreemptionSettings, var

__all__ = ["PREEMPT_MARK_ENV", "GRACE_S", "start", "stop", "agreed", "mark"]

PREEMPT_MARK_ENV = var("preemption.mark")
# How long a worker blocked in a collective waits for the launcher's mark after an unmarked signal.
# Longer than the launcher takes to mark a signal that reached it too; far shorter than the agent's 30 s.
GRACE_S = 3.0

_guard: dict = {"thread": None, "write": -1, "previous": -1, "agreed": False}


def mark(path: str) -> None:
    """The launcher's side: note that the signal about to be forwarded is a preemption."""
    with contextlib.suppress(OSError):
        open(path, "w").close()  # noqa: SIM115 - an empty file is the whole message


def agreed() -> None:
    """Every rank agreed to stop for a preemption: the waits of the save that follows are expected."""
    _guard["agreed"] = True


def start(signals) -> bool:
    """Start the guard for ``signals`` (main thread only; once); False when not armed here."""
    path = PreemptionSettings.one("mark")
    if not path or _guard["thread"] is not None or threading.current_thread() is not threading.main_thread():
        return False
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read)
        os.close(write)
        return False
    watched = {int(s) for s in signals}
    thread = threading.Thread(target=_loop, args=(read, watched, path, previous), name="phalanx-preempt-guard",
                              daemon=True)
    _guard.update(thread=thread, write=write, previous=previous, agreed=False)
    thread.start()
    return True


def stop() -> None:
    """Give the wakeup fd back and end the thread."""
    thread = _guard["thread"]
    if thread is None or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(_guard["previous"])
    with contextlib.suppress(OSError):
        os.close(_guard["write"])  # the thread reads EOF and closes its end
    thread.join(timeout=1.0)
    _guard.update(thread=None, write=-1, previous=-1)


def _loop(read: int, watched: set[int], path: str, previous: int) -> None:
    came: tuple[int, float] | None = None  # (signal, when) of an unmarked watched signal
    try:
        while True:
            ready, _, _ = select.select([read], [], [], 0.1 if came else None)
            if ready:
                data = os.read(read, 64)
                if not data:
                    return
                if previous >= 0:
                    with contextlib.suppress(OSError):
                        os.write(previous, data)
                if came is None and not _guard["agreed"]:
                    sig = next((b for b in data if b in watched), None)
                    if sig is not None:
                        came = (sig, time.time())
            if came is not None:
                if _guard["agreed"] or os.path.exists(path):
                    came = None  # a preemption: the main thread handles it at its next step
                    _guard["agreed"] = True
                else:
                    _judge(*came)
    finally:
        os.close(read)


def _judge(sig: int, since: float) -> None:
    from phalanx.runtime.heartbeat import RECORD

    waiting = RECORD.waiting
    if waiting is None:
        return
    entry, blocked_since = waiting
    if time.time() - max(blocked_since, since) < GRACE_S:
        return
    name = signal.Signals(sig).name
    what = f"{entry[1]} #{entry[0]}" + (f" {entry[2]!r}" if entry[2] else "")
    line = (f"phalanx: {name} while blocked in {what} for {time.time() - blocked_since:.1f} s, and phalanx run did "
            f"not mark it a preemption: the agent is stopping the group; exiting now (status {128 + sig})\n")
    with contextlib.suppress(OSError):
        os.write(2, line.encode())
    os._exit(128 + sig)
