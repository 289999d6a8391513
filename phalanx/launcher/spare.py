"""The supervisor's warm spare: one worker process with its imports done, handed the next replacement.

``PHALANX_ELASTIC_SPARE=1`` under ``phalanx run --min-np/--max-np`` (replacements started on this
machine): a lost worker's replacement is the spare (:mod:`phalanx.launcher._spare`), which only has to
join, instead of a new process that first imports torch and phalanx (seconds; measured on cpu2 at 4
workers, one run: 10.6 s of the 11.0 s from a kill to the job back at full size; 0.7-0.9 s with the spare). A new spare is started once
every live worker is in a generation again, so its imports do not compete with the replacement's join::

    job start ─ workers w0..w3 + spare S (imports, then waits on stdin)
    w3 killed ─ replacement w4 = S: the env of w4 written to S's stdin ─ w4 joins at the next commit
    w4 admitted ─ a new spare S'

Cost: one more process holding torch (measured on cpu2: 303 MiB resident, 2.8 s of CPU for its imports),
and that CPU at the job's start.

Example::

    spare = Spare([sys.executable, "train.py"])
    spare.start(env)                      # when wanted
    proc = spare.take(worker_env)         # a Popen running the command, or None (no spare ready)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

__all__ = ["Spare"]


class Spare:
    """At most one spare process for ``command``, started with the job's common environment."""

    SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_spare.py")

    def __init__(self, command: list[str]) -> None:
        self.command = list(command)
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] | None = None

    def start(self, env: dict[str, str]) -> None:
        """Start a spare (if none is waiting) with ``env``, what every worker of the job shares."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, self.SHIM], env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)

    def take(self, env: dict[str, str]) -> subprocess.Popen | None:
        """The spare, told to run the command as the worker of ``env``; None when there is none alive.
        Variables torch read at import (``OMP_NUM_THREADS``...) must be those it started with: a
        spare whose environment differs in any but the worker's own variables is not used."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None
        own = {k for k in set(env) | set(self.env or {}) if (self.env or {}).get(k) != env.get(k)}
        if any(k.startswith(("OMP_", "MKL_", "TORCH_", "PYTHON", "LD_")) for k in own):
            self.stop(proc)
            return None
        try:
            proc.stdin.write(json.dumps({"env": env, "command": self.command}) + "\n")
            proc.stdin.close()  # EOF from here on: as a worker started with stdin from /dev/null
        except OSError:  # it died meanwhile
            self.stop(proc)
            return None
        return proc

    def stop(self, proc: subprocess.Popen | None = None) -> None:
        """End the spare (the job is over): EOF on its stdin ends it once its imports are done."""
        proc = proc or self.proc
        if proc is self.proc:
            self.proc = None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
