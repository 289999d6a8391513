"""Preemption inside ``phalanx.elastic.run``: vote at each commit, save it, exit 85.

One :class:`~phalanx.preemption.Preemption` per worker, built when ``elastic.run`` starts
(SIGTERM + ``$PHALANX_PREEMPT_SIGNAL``), its topology replaced after each re-form. Each
``TorchState.commit()`` votes (a blocking allreduce: under in-process elastic the commit's own,
:func:`phalanx.elastic.vote.commit_round`, else :meth:`Preemption.requested_now`:
every member answers the same at the same commit, and no vote stays in flight into the steps
after it, where a lost worker must fail the next collective at once); when the answer is yes the
commit just written is
the preemption checkpoint: :meth:`Preemption.finish` requeues under SLURM and raises
``Preempted`` (exit 85). The relaunched job resumes from it in ``restore()``::

    SIGTERM ─ phalanx run forwards it ─ the next commit k is written, votes "yes" on every member
            ─ exit 85 ─ phalanx run exits 85
    phalanx run --resume-from DIR ... ─ restore() loads commit k ─ training goes on

Example::

    preempt.start(); ...; preempt.at_commit(path, commit_dir); ...; preempt.stop()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from phalanx import runtime
from phalanx.log import get_logger
from phalanx.preemption import Preemption

__all__ = ["start", "stop", "reformed", "vote", "at_commit", "current"]

log = get_logger(__name__)
_current: Preemption | None = None


def current() -> Preemption | None:
    """The running ``elastic.run``'s Preemption (None outside one)."""
    return _current


def start() -> Preemption:
    global _current
    _current = Preemption(topology=runtime.topology() if runtime.is_initialized() else None).install()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        with contextlib.suppress(Exception):  # a vote in flight on a broken group: nothing to finish
            _current.close()
    _current = None


def reformed(leaving: bool = False) -> None:
    """Around a re-form: drop the vote in flight (``leaving``: it holds the broken group's sockets),
    then vote with the new members."""
    if _current is not None:
        _current.retopologize(None if leaving else runtime.topology())


def vote() -> int:
    """This worker's preemption vote for the commit's allreduce (the signal it got, 0 for none)."""
    return _current.local_flag() if _current is not None else 0


def at_commit(path: str | Callable[[], str], commit_dir: str, reduced: int | None = None) -> None:
    """Called by every member in ``commit()`` after the snapshot ``path`` (or with the function that
    writes it, when this commit wrote none: called only when the vote is yes); raises ``Preempted``
    when agreed. ``reduced``: the vote already agreed in the commit's own allreduce (None: vote now)."""
    if _current is None:
        return
    if not (_current.requested_now() if reduced is None else _current.signal is not None or _current.decide(reduced)):
        return
    if callable(path):
        path = path()
    if commit_dir.startswith("/dev/shm"):
        log.warning("the preemption checkpoint %s is in /dev/shm: it does not survive this machine; "
                    "run with --resume-from DIR (or PHALANX_ELASTIC_DIR) on a disk every host sees", path)
    _current.finish(path)
