"""Where an elastic state commits: the job's default directory, and one lineage per state object.

Split out of :mod:`phalanx.elastic.state`, which uses both.
"""

from __future__ import annotations

import os

from phalanx.log import get_logger
from phalanx.settings import CheckpointSettings, ElasticSettings

log = get_logger(__name__)

__all__ = ["default_commit_dir", "own_commit_dir"]


def default_commit_dir() -> str:
    """``$PHALANX_RESUME_FROM``, else ``$PHALANX_ELASTIC_DIR``, else ``/dev/shm/phalanx-elastic-<run id>``."""
    chosen = CheckpointSettings.one("resume_from") or ElasticSettings.one("commit_dir")
    if chosen:
        return chosen
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    return os.path.join(base, f"phalanx-elastic-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")


_made: dict[tuple[str, str], int] = {}  # (commit dir asked for, restart count) -> states this process made with it


def own_commit_dir(wanted: str) -> str:
    """``wanted`` for the first state this process makes with that directory, ``wanted-state<n>`` for the n-th.

    A state restores only its own lineage's commits: its own, or those of the state made in the same
    place by a process before it in this job (a group restart, a generation of newcomers: they run the
    same script, make their states in the same order, and so the n-th state finds the n-th's directory).
    A later state object of this process never inherits an earlier one's last commit, whether the
    earlier one is still alive or gone, whatever its pieces: Horovod's Keras ``test_elastic_state``,
    run after its TensorFlow one in the same process, found that state's snapshot and its ``sync()``
    loaded it. States are counted per restart of the group (``TORCHELASTIC_RESTART_COUNT``, constant
    in a process: a test that plays a restart inside one process sets it). A sibling, not a
    subdirectory: the checkpoint manager prunes every directory under its root that is not one of its
    newest snapshots.
    """
    key = (wanted.rstrip(os.sep) or os.sep, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    n = _made[key] = _made.get(key, 0) + 1
    if n == 1:
        return wanted
    chosen = f"{key[0]}-state{n}"
    log.info("elastic state number %d of this process with commit dir %s commits to %s", n, wanted, chosen)
    return chosen
