"""Background writer for asynchronous checkpoints: at most one save in flight.

The caller snapshots the state to CPU memory (the only part that blocks
training) and hands a write function to :class:`AsyncWriter`. The writer runs it
on a background thread. Before a new save starts, the previous one is waited
for, and if it failed its exception is raised there — an error is never lost:
it surfaces on the next ``submit()`` or ``wait()``, or is logged at exit.

Example::

    writer = AsyncWriter()
    writer.submit(lambda: write_files(snapshot))   # returns at once
    ...                                             # training goes on
    writer.wait()                                   # raises if the write failed
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

from phalanx.log import get_logger

__all__ = ["AsyncWriter", "CheckpointWriteError", "default_writer"]

log = get_logger(__name__)


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint write failed; ``__cause__`` is the original error."""


class AsyncWriter:
    """Run one write function at a time on a background thread; report its error later."""

    def __init__(self, name: str = "phalanx-ckpt") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        self.last_write_s = 0.0
        _writers.add(self)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[[], None], what: str = "checkpoint") -> None:
        """Wait for (and re-raise the error of) the previous write, then start ``fn`` in the background."""
        self.wait()
        self._what = what
        # The new thread would run Python right after signalling that it started, holding the GIL
        # the caller needs to return from start(): the caller then waits out the switch interval
        # (5 ms) or longer under load (a median 5.3-7.2 ms, at worst 88 ms, for a thread starting a
        # busy body on the shared 2-core machine; 0.2 ms with this hand-off; benchmarks/LOG.md
        # #ckpt-handoff-copy). So the thread first waits, with the GIL released, until the caller
        # is back from start().
        go = threading.Event()

        def body() -> None:
            go.wait()
            started = time.perf_counter()
            try:
                fn()
            except BaseException as err:  # kept for the next call; never swallowed
                self._error = err
                log.error("asynchronous write of %s failed: %s", what, err)
            finally:
                self.last_write_s = time.perf_counter() - started

        self._thread = threading.Thread(target=body, name=self._name, daemon=False)
        try:
            self._thread.start()
        finally:  # never leave the thread waiting (an interrupt right after start())
            go.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the write in flight is done; raise :class:`CheckpointWriteError` if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"checkpoint write of {self._what} still running after {timeout}s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointWriteError(f"the asynchronous write of {self._what} failed: {err}") from err


_writers: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()
_default: AsyncWriter | None = None


def default_writer() -> AsyncWriter:
    """The process-wide writer used by ``phalanx.checkpoint.save(..., async_=True)``."""
    global _default
    if _default is None:
        _default = AsyncWriter()
    return _default


@atexit.register
def _finish_at_exit() -> None:
    for writer in list(_writers):
        try:
            writer.wait()
        except Exception as err:  # nothing left to raise into: say it loudly
            log.error("%s", err)
