"""The exceptions a commit raises when the job's membership changes (Horovod's ``HostsUpdatedInterrupt``).

Under the in-process launcher, ``state.commit()`` (and ``hvd.elastic`` state's ``check_host_updates()``)
raises on every rank, at the same commit, when the launcher changed the job::

    launcher: a new generation, or a host-change notice ─ commit(): rank 0 asks, one allreduce MAX ─
    every rank raises HostsUpdatedInterrupt(skip_sync) ─ elastic.run re-forms (reform is True)

One class is both names a script may catch: ``HostsUpdatedInterrupt`` (Horovod's, exported by
``phalanx.horovod.elastic`` and ``phalanx.elastic``) is a ``MembershipChanged`` (phalanx's), and a
``RuntimeError`` as Horovod's is. ``skip_sync`` has Horovod's meaning: the change only removed
workers, so every member already holds the state (phalanx re-syncs anyway: one broadcast).

A ``HostsUpdatedInterrupt`` a user raises (``reform`` False) only rolls back to the last commit and
re-syncs, as before; the retry loop tells the two apart by ``reform``.

Example::

    try:
        state.commit()
    except hvd.elastic.HostsUpdatedInterrupt as err:   # hosts changed: re-raise, the loop resets
        print("hosts updated; removals only:", err.skip_sync)
        raise
"""

from __future__ import annotations

__all__ = ["MembershipChanged", "HostsUpdatedInterrupt", "launcher_interrupt", "REMOVED_ONLY", "ADDED"]

REMOVED_ONLY, ADDED = 1, 2  # the kind of a pending change, as one allreduce MAX carries it (0: none)


class MembershipChanged(Exception):
    """Raised by ``commit()`` on every rank when the launcher published a new generation (or announced a
    host change); ``phalanx.elastic.run`` then re-forms the group."""

    reform = True  # the retry loop re-forms (False: a user's interrupt, which only rolls back)


class HostsUpdatedInterrupt(MembershipChanged, RuntimeError):
    """Horovod's ``HostsUpdatedInterrupt(skip_sync)``: the hosts changed at this commit.

    ``skip_sync``: the change only removed workers. Also takes a message (``HostsUpdatedInterrupt("why")``),
    as phalanx's earlier class did. Raised by a user, it rolls back to the last commit and re-syncs.
    """

    def __init__(self, *args: object, skip_sync: bool | None = None) -> None:
        if skip_sync is None and args and isinstance(args[0], bool):
            skip_sync, args = args[0], args[1:]
        super().__init__(*args)
        self.skip_sync = bool(skip_sync)
        self.reform = False


def launcher_interrupt(kind: int) -> HostsUpdatedInterrupt:
    """The interrupt a commit raises for the launcher's change of ``kind`` (REMOVED_ONLY or ADDED)."""
    err = HostsUpdatedInterrupt("the job's hosts changed at this commit" + (
        " (workers removed)" if kind == REMOVED_ONLY else ""), skip_sync=kind == REMOVED_ONLY)
    err.reform = True
    return err
