"""Host-change notices: the launcher tells the workers a change is coming, before its generation exists.

Horovod's driver notifies the workers as soon as discovery changes the host assignment; their
next ``state.commit()`` raises ``HostsUpdatedInterrupt`` and the reset waits for the new workers.
A phalanx generation is published only once the workers it admits are ready (seconds later:
they import torch), so the launcher posts a numbered notice first and every generation says
which notices it covers::

    discovery adds 127.0.0.1:2 ─ start w2, w3 there ─ notice 1 (added)      pxe/notice/1, pxe/notice=1
    w0 (rank 0): hvd state._host_messages gets (t, added) ─ commit() raises on every rank ─ re-form waits
    w2, w3 ready ─ generation 1 = [w0, w1, w2, w3], "notice": 1 (covers it)  ─ the four form it
    a generation with no notice before it (a failure, a shrink) posts its own at publish time

A notice is always followed by a generation that covers it (one with the same members if the
change came to nothing, e.g. the new workers died starting), so no worker waits on it for ever.
``phalanx.elastic``'s own state does not act on notices (it admits workers once they are ready
and trains on meanwhile); ``phalanx.horovod.elastic``'s does, as Horovod's.

Example::

    notices = HostNotices(store)
    notices.post(ADDED)           # workers started on a new host
    body["notice"] = notices.cover(old_members, new_members)   # at each publish
"""

from __future__ import annotations

import json
import time

__all__ = ["HostNotices", "REMOVED", "ADDED", "MIXED"]

REMOVED, ADDED, MIXED = 1, 2, 3  # Horovod's HostUpdateResult values


class HostNotices:
    """The launcher's side: post notices on its store, and cover them with each generation."""

    def __init__(self, store) -> None:
        self.store = store
        self.posted = 0  # notices posted
        self.covered = 0  # notices the last published generation covers

    @property
    def pending(self) -> bool:
        """A notice no generation covers yet: the next reconcile must publish one."""
        return self.posted > self.covered

    def post(self, update: int) -> int:
        """Announce a host change (the body first, then the count the workers poll)."""
        self.posted += 1
        self.store.set(f"pxe/notice/{self.posted}", json.dumps({"t": time.time(), "update": update}))
        self.store.add("pxe/notice", 1)
        return self.posted

    def cover(self, old: list, new: list, first: bool = False) -> int:
        """At a publish: post this change's notice unless one is pending (not for the first
        generation); return the count the generation covers."""
        if not first and not self.pending:
            gone, came = set(old) - set(new), set(new) - set(old)
            self.post(MIXED if gone and came else ADDED if came else REMOVED)
        self.covered = self.posted
        return self.covered
