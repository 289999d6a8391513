"""Rank 0's snapshots of a live-recovering elastic state: one file a commit, written in the background.

``TorchState(recover="live")`` keeps no copy in memory: the survivors of a lost worker go on from
the live state. A file is still wanted for a group restart (every worker lost, a re-form that
fails), every ``snapshot_every``-th commit. The state is replicated (live recovery refuses sharded
pieces), so one rank's copy is the whole state: rank 0 copies it (the only part on the training
thread) and a thread writes it, with no cross-rank wait that a lost peer could hold up, and none
of the job's collective checkpoint machinery (whose saves every rank makes together)::

    commit 30 (rank 0):  copy the pieces' state dicts ─ thread: torch.save to commit-000000030.pt.tmp
                         ─ fsync (not under /dev/shm) ─ rename to commit-000000030.pt ─ prune to `keep`
    restart:             every rank reads the newest commit-*.pt (a file of this job's own commit dir)

Example::

    files = Snapshots("/dev/shm/phalanx-elastic-x", keep=2)
    files.write(30, {"model": model.state_dict(), "step": 30})   # returns once copied
    files.wait(); files.latest()                                 # (30, {...}) or None
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import re
import threading
from typing import Any

import torch

from phalanx.log import get_logger

__all__ = ["Snapshots"]

log = get_logger(__name__)
_NAME = re.compile(r"commit-(\d+)\.pt$")


class Snapshots:
    """Numbered snapshot files under ``root``, at most one write in flight, ``keep`` newest kept."""

    def __init__(self, root: str, keep: int = 2) -> None:
        self.root, self.keep = root, max(1, keep)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def path(self, number: int) -> str:
        return os.path.join(self.root, f"commit-{number:09d}.pt")

    def write(self, number: int, tree: dict[str, Any], *, background: bool = True) -> str:
        """Copy ``tree`` now, write it as snapshot ``number`` (in a thread when ``background``)."""
        self.wait()
        snapshot = copy.deepcopy(tree)  # tensors cloned: training may change them from the next step
        path = self.path(number)
        if not background:
            self._write(path, snapshot)
            return path
        self._thread = threading.Thread(target=self._guarded, args=(path, snapshot),
                                        name="phalanx-elastic-snapshot", daemon=True)
        self._thread.start()
        return path

    def wait(self) -> None:
        """Wait for the write in flight; a failed one is logged (a snapshot is a fallback, not the state)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            log.warning("elastic snapshot not written (%s: %s)", type(err).__name__, err)

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest complete snapshot, ``(number, tree)``, or None when there is none."""
        self.wait()
        found = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(self.root, "commit-*.pt"))
                       if (m := _NAME.search(p)))
        if not found:
            return None
        number, path = found[-1]
        # this job's own commit dir: its extras may be any picklable value, as a commit's memory copy is
        return number, torch.load(path, weights_only=False)

    def _guarded(self, path: str, snapshot: dict[str, Any]) -> None:
        try:
            self._write(path, snapshot)
        except BaseException as err:  # noqa: BLE001 - reported by the next wait()
            self._error = err

    def _write(self, path: str, snapshot: dict[str, Any]) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            torch.save(snapshot, f)
            if not self.root.startswith("/dev/shm"):
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        numbered = sorted(p for p in glob.glob(os.path.join(self.root, "commit-*.pt")) if _NAME.search(p))
        for old in numbered[:-self.keep]:
            with contextlib.suppress(OSError):
                os.unlink(old)
