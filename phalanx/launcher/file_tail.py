"""Rank output files followed to the terminal a whole line at a time, each line under its rank's header.

``phalanx run`` (non-elastic) lets TorchElastic write each rank's stdout/stderr to a file. TorchElastic's
own follower (``tail_log.tail_logfile``) prints what ``readline()`` returns, and on a file that is still
being written ``readline()`` returns a partial line: a rank that writes a line in two pieces (under
``PYTHONUNBUFFERED=1`` ``print`` makes two writes, the text and the newline; ``print(..., end="")``
then the rest) showed up as ``[0]: part one,[0]:  part two``. This follower keeps the piece until its
newline arrives and writes each line whole with one ``write``; a last line without a newline is
written (with one) when the file is finished.

Example::

    tails = FileTails()
    tails.follow("/tmp/logs/rank.0/stdout", "[0]: ", sys.stdout)
    ...                       # the rank runs
    tails.finish()            # read what is left of every file, stop following them
"""

from __future__ import annotations

import threading
from typing import IO

__all__ = ["FileTails"]

_INTERVAL_S = 0.05


class _Followed:
    def __init__(self, path: str, header: str, dst: IO[str]) -> None:
        self.path, self.header, self.dst = path, header, dst
        self.file: IO[str] | None = None
        self.partial = ""

    def pump(self, final: bool) -> None:
        if self.file is None:
            try:
                self.file = open(self.path, errors="replace")  # noqa: SIM115 (kept open while followed)
            except FileNotFoundError:
                return  # the rank has not started yet
        text = self.partial + self.file.read()
        lines = text.split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        if lines:
            self.dst.write("".join(f"{self.header}{line}\n" for line in lines))
            self.dst.flush()
        if final:
            self.file.close()


class FileTails:
    """Files followed by one daemon thread; :meth:`finish` drains and drops every file followed so far."""

    def __init__(self) -> None:
        self._files: list[_Followed] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, path: str, header: str, dst: IO[str]) -> None:
        """Write ``path``'s lines to ``dst`` under ``header`` from now on (the file may not exist yet)."""
        with self._lock:
            self._files.append(_Followed(path, header, dst))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="phalanx-rank-output", daemon=True)
                self._thread.start()

    def finish(self) -> None:
        """Write what is left of every followed file (a last line without its newline gets one) and stop
        following them. The writers must have ended (a restart's previous attempt, the job's end)."""
        with self._lock:
            files, self._files = self._files, []
            for f in files:
                f.pump(final=True)

    def _run(self) -> None:
        while not self._stop.wait(_INTERVAL_S):
            with self._lock:
                for f in self._files:
                    f.pump(final=False)

    def close(self) -> None:
        """:meth:`finish`, then end the thread."""
        self.finish()
        self._stop.set()
