"""Every line a rank printed reaches the driver before the executor returns.

Ray forwards an actor's output asynchronously: the raylet's log monitor tails the actor's log
file and publishes new lines, and the driver's ``ray_print_logs`` thread prints them. A driver
that returns from ``run()`` and exits at once (the end of a user's script) loses what is still on
its way, typically every rank's last lines. So each rank counts the lines it wrote
(:class:`LineCount`, kept by the worker's rank-prefixed streams), and the driver counts the lines
it received from each worker process (:class:`Arrivals`, a handler beside Ray's own printer) and
waits, up to a bound, until every rank's lines have arrived.

The driver's side reads Ray's stdstream dispatcher, which is not public API: where a Ray release
moves it, or ``ray.init(log_to_driver=False)`` turns forwarding off, :meth:`Arrivals.wait_for`
returns at once (no wait, as before).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

from phalanx.log import get_logger

__all__ = ["Arrivals", "LineCount", "await_lines"]

log = get_logger(__name__)

_NAMES = itertools.count()


class LineCount:
    """Complete lines written by one worker process (its stdout and stderr together)."""

    def __init__(self) -> None:
        self.lines = 0

    def add(self, text: str) -> None:
        self.lines += text.count("\n")


def _dispatcher():
    try:
        from ray._private import worker as ray_worker

        dispatcher = ray_worker.global_worker_stdstream_dispatcher
        forwarding = any(name == "ray_print_logs" for name, _ in dispatcher.handlers)
    except Exception:  # noqa: BLE001 - a Ray without this internal: no wait
        return None
    return dispatcher if forwarding else None


class Arrivals:
    """The lines the driver has received per worker process, while open (a context manager)."""

    def __init__(self) -> None:
        self._got: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._name = f"phalanx-arrivals-{next(_NAMES)}"
        self._dispatcher = None

    def open(self) -> Arrivals:
        if self._dispatcher is None:
            self._dispatcher = _dispatcher()
            if self._dispatcher is not None:
                self._dispatcher.add_handler(self._name, self._count)
        return self

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.remove_handler(self._name)
            self._dispatcher = None

    __enter__ = open

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def forwarding(self) -> bool:
        """True while open where the driver prints what the workers write."""
        return self._dispatcher is not None

    def lines_from(self, pid: int | str) -> int:
        """The lines received from worker process ``pid`` so far."""
        with self._lock:
            return self._got[str(pid)]

    def _count(self, data: dict) -> None:
        with self._lock:
            self._got[str(data.get("pid"))] += len(data.get("lines") or ())

    def wait_for(self, written: dict, timeout: float = 10.0) -> bool:
        """Wait until ``written`` (worker pid -> lines it wrote) have all arrived, at most
        ``timeout`` seconds. True when they did (or nothing is being forwarded)."""
        if self._dispatcher is None:
            return True
        deadline = time.monotonic() + timeout
        want = {str(pid): n for pid, n in written.items()}
        while True:
            with self._lock:
                if all(self._got[pid] >= n for pid, n in want.items()):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def await_lines(arrivals: Arrivals, actors: list, timeout: float = 5.0) -> None:
    """Ask each (idle) actor how many lines its rank printed, and wait until the driver has them."""
    if not actors or not arrivals.forwarding:
        return
    import ray

    try:
        written = dict(ray.get([a.lines_written.remote() for a in actors], timeout=timeout))
    except Exception:  # noqa: BLE001 - an actor that died cannot say: its lines are Ray's to forward
        return
    if not arrivals.wait_for(written, timeout):
        log.info("some lines the ranks printed had not reached the driver after %gs (written per worker "
                 "process: %s)", timeout, written)
