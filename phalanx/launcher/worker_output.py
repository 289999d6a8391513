"""An elastic job's worker processes: where their output goes, and how they are stopped.

Output goes to the terminal, prefixed with the worker's current rank, and
``--output-filename DIR`` files (Horovod's layout: ``DIR/rank.N/stdout|stderr``; ``DIR/worker.<id>/`` for joiners).

A worker's rank changes with each generation, so the prefix is asked for per line (``rank_of``);
before a worker is a member (a joiner waiting for its commit) its lines carry its id, ``[w5]: …``.
``stop_processes`` ends workers: stdin closed (a remote worker's agent stops it at EOF), SIGTERM,
a grace period, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

__all__ = ["WorkerOutput", "stop_processes"]


class WorkerOutput:
    """Pumps each worker's stdout/stderr on a daemon thread of its own; ``join`` waits for them at the end."""

    def __init__(self, rank_of: Callable[[object], int | None], *, log_dir: str | None = None,
                 ranks_filter: frozenset[int] | None = None) -> None:
        self.rank_of, self.log_dir, self.ranks_filter = rank_of, log_dir, ranks_filter
        self._threads: list[threading.Thread] = []

    def attach(self, worker, wid: str, stdout: IO[str] | None, stderr: IO[str] | None, first_rank: int | None) -> None:
        """Start pumping ``worker``'s streams (``first_rank`` None: a joiner, its files go to ``worker.<wid>``)."""
        files = self._files(wid, first_rank)
        for stream, out, keep in ((stdout, sys.stdout, files[0]), (stderr, sys.stderr, files[1])):
            if stream is None:
                continue
            t = threading.Thread(target=self._pump, args=(worker, wid, stream, out, keep), daemon=True)
            t.start()
            self._threads.append(t)

    def join(self, timeout_s: float = 2.0) -> None:
        for t in self._threads:
            t.join(timeout_s)

    def _files(self, wid: str, first_rank: int | None) -> tuple:
        if not self.log_dir:
            return None, None
        folder = os.path.join(self.log_dir, f"rank.{first_rank}" if first_rank is not None else f"worker.{wid}")
        os.makedirs(folder, exist_ok=True)
        return tuple(open(os.path.join(folder, n), "a", buffering=1) for n in ("stdout", "stderr"))  # noqa: SIM115

    def _pump(self, worker, wid: str, stream, out, keep=None) -> None:
        for line in iter(stream.readline, ""):
            if keep is not None:
                keep.write(line)
            rank = self.rank_of(worker)
            if rank is not None and self.ranks_filter is not None and rank not in self.ranks_filter:
                continue
            out.write(f"[{rank}]: {line}" if rank is not None else f"[{wid}]: {line}")
            out.flush()
        stream.close()
        if keep is not None:
            keep.close()


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Close each one's stdin, SIGTERM it, wait up to ``grace_s`` in all, then SIGKILL what is left."""
    for proc in procs:
        with contextlib.suppress(OSError, ValueError):
            if proc.stdin:
                proc.stdin.close()  # a remote worker's agent stops it at EOF
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
