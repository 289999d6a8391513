"""Numbered checkpoints under one root: newest-intact loading with fallback, keep-last-k, auto-resume.

Example::

    mgr = CheckpointManager("ckpts", keep=3)
    mgr.load_latest(state)                  # None on a fresh run; skips corrupt/incomplete ones
    mgr.save(step, state, async_=True)
    resume(state)                           # load from $PHALANX_RESUME_FROM (phalanx run --resume-from)
"""

from __future__ import annotations

import os
import re
import shutil

from phalanx.checkpoint import io
from phalanx.checkpoint.manifest import MANIFEST
from phalanx.checkpoint.pieces import job_of
from phalanx.checkpoint.reader import apply_state, read_state
from phalanx.checkpoint.sharded import save, wait
from phalanx.comm.collectives import allgather_object, broadcast_object
from phalanx.log import get_logger
from phalanx.settings import CheckpointSettings

__all__ = ["CheckpointManager", "list_checkpoints", "load_latest", "resume"]

log = get_logger(__name__)

# step-N / epoch-N, and a Trainer's preemption checkpoint inside an epoch: epoch-N-batch-B, which
# sorts after epoch N-1 and before the end of epoch N (a finished epoch counts as batch "infinity")
_ORDER_RE = re.compile(r"(\d+)(?:-batch-(\d+))?$")
_WHOLE = 1 << 62


def list_checkpoints(root: str, complete_only: bool = True) -> list[str]:
    """Checkpoint directories under ``root``, newest first (by trailing step number, then mtime)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        p = os.path.join(root, name)
        if not os.path.isdir(p) or (complete_only and not os.path.exists(os.path.join(p, MANIFEST))):
            continue
        out.append((_order_of(name), os.path.getmtime(p), p))
    return [p for _, _, p in sorted(out, reverse=True)]


def load_latest(root: str, state: dict, *, topology=None) -> str | None:
    """Load the newest checkpoint under ``root`` that every rank can read intact; return its path.

    A checkpoint whose files are missing, fail their checksum or whose manifest is
    malformed on any rank is skipped (with a warning) for the next older one. Returns
    None if ``root`` has no complete checkpoint at all; raises if all of them are corrupt.
    """
    wait(topology=topology)
    job = job_of(topology)
    candidates = list_checkpoints(root)
    if job.world > 1:
        candidates = broadcast_object(candidates, root_rank=0)
    errors = []
    for path in candidates:
        try:
            tree, err = read_state(path, state, topology=topology, share_checks=True), None
        except (io.CorruptCheckpointError, OSError, KeyError, ValueError) as e:
            tree, err = None, f"rank {job.rank}: {e}"
        errs = allgather_object(err) if job.world > 1 else [err]
        bad = [e for e in errs if e is not None]
        if not bad:
            apply_state(state, tree)
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(bad))
        errors.extend(bad)
    if candidates:
        raise io.CorruptCheckpointError(f"no intact checkpoint under {root}: " + "; ".join(errors))
    return None


class CheckpointManager:
    """Numbered checkpoints under ``root``; keeps the newest ``keep`` complete ones.

    Example::

        mgr = CheckpointManager("ckpts", keep=3)
        start = mgr.load_latest(state)        # None on a fresh run
        for step in range(...):
            ...
            if step % 100 == 0:
                mgr.save(step, state, async_=True)
    """

    def __init__(self, root: str, keep: int = 3, *, topology=None) -> None:
        if keep < 1:
            raise ValueError(f"CheckpointManager(keep={keep}): keep at least 1 checkpoint")
        # None follows the live job (an elastic job's topology changes when it re-forms)
        self.root, self.keep, self.topology = root, keep, topology

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step-{int(step):09d}")

    def save(self, step: int, state: dict, *, async_: bool = False, fsync: bool = True) -> str:
        path = self.path(step)
        save(path, state, async_=async_, meta={"step": int(step)}, fsync=fsync, on_done=self.prune,
             topology=self.topology)
        return path

    def prune(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints, and unfinished ones older than those."""
        complete = list_checkpoints(self.root)
        if not complete:
            return
        keep = set(complete[: self.keep])
        oldest_kept = _order_of(complete[: self.keep][-1])
        for p in list_checkpoints(self.root, complete_only=False):
            if p not in keep and _order_of(p) < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def load_latest(self, state: dict) -> str | None:
        return load_latest(self.root, state, topology=self.topology)

    def latest(self) -> str | None:
        found = list_checkpoints(self.root)
        return found[0] if found else None


def _order_of(path: str) -> tuple[int, int]:
    m = _ORDER_RE.search(os.path.basename(path))
    if not m:
        return (-1, _WHOLE)
    return (int(m.group(1)), int(m.group(2)) if m.group(2) else _WHOLE)


def resume(state: dict, root: str | None = None, *, topology=None) -> str | None:
    """Load the newest intact checkpoint under ``root`` (default ``$PHALANX_RESUME_FROM``) into ``state``.

    Returns the path loaded, or None when there is no root or nothing to resume
    (a fresh run). ``phalanx run --resume-from DIR`` sets the variable.
    """
    root = root or CheckpointSettings.one("resume_from")
    if not root:
        return None
    path = load_latest(root, state, topology=topology)
    if path is not None:
        log.warning("resumed from %s", path)
    return path
