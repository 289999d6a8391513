"""Rank 0's view of the launcher's pending membership change, read off the training thread.

A commit asks whether the launcher published a newer generation (workers join or leave) or
posted a host-change notice. Asked on the training thread that is two to four store round trips
per commit (measured ~0.7 ms median on cpu2, spikes of tens of ms under load); a deferred commit
(``TorchState(recover="live")``) instead reads the last answer of a thread that asks every
:data:`POLL_S` with a store client of its own::

    thread (rank 0, every 100 ms): pxe/latest (one store get) > gen? members of latest vs gen
                                  -> REMOVED_ONLY / ADDED
    commit:  kind = poll.kind(gen, notice, notices)    # a dict lookup; 0 until the thread has read one
             poll.latest                               # that generation's number (a staged admission's target)

Example::

    poll = PendingPoll("127.0.0.1:29400", lambda: ctx.gen).start()
    poll.kind(gen, notice, notices=False)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from phalanx.elastic.interrupts import ADDED, REMOVED_ONLY

__all__ = ["PendingPoll", "pending_on", "POLL_S", "VOTE_S", "VOTE_BUSY_S"]

POLL_S = 0.1
# The spacing of the members' votes while nothing is going on. Each vote is one async allreduce, and
# launching it costs every rank more than the collective: the enqueue wakes a gloo worker thread, and
# with the job's ranks on every core (np 4 on cpu2) the caller loses its core to it. Profiled at np 4
# (py-spy on rank 0, 15 s; --native: it ends in pthread_cond_signal): at one vote every ~100 ms the launch
# was 2.8% of rank 0's training thread, ~3 ms a vote; at one every 0.5 s, 0.8% (run 8). A change or a
# preemption signal is then noticed up to 0.5 s later (a lost worker is not: the watcher and the failed
# collective find it), and once noticed the votes follow every VOTE_BUSY_S until it is acted on.
VOTE_S = 0.5
# the spacing while rank 0 sees a change pending or a staged admission forms (each of its steps is a vote)
VOTE_BUSY_S = 0.1
_MAX_SKIP = 100  # a vote at least every 101 commits, however short they are
# A gap between two commits longer than this many times the last measured commit is a pause (an
# evaluation, a checkpoint, steps that commit nothing), counted as that many commits' time, unless most
# of the gaps since the last vote are that long (the commits themselves slowed down). Counted whole, a
# pause made the next count of commits to skip small, so the votes crowded into the commits after it:
# the in-job A/B's live windows, each after windows without commits, voted 2.5 times a 0.43 s window at
# np 4 (cpu2) where commits without pauses vote about once every 0.5 s (run 9).
_PAUSE = 4


def pending_on(store, gen: int, notice: int, notices: bool, latest: int | None = None) -> int:
    """The launcher's change pending for a worker of generation ``gen`` that has seen its notices up to
    ``notice`` (``notices``: count host-change notices too), read through ``store``: 0 none,
    REMOVED_ONLY (workers only leave), ADDED (workers join). ``latest``: the newest generation,
    already read (None: read it here)."""
    kind = 0
    if latest is None:
        latest = int(store.get("pxe/latest")) if store.check(["pxe/latest"]) else 0
    if latest > gen:
        def members(g: int) -> set[str]:
            return {m[0] for m in json.loads(store.get(f"pxe/gen/{g}"))["members"]}

        kind = REMOVED_ONLY if members(latest) <= members(gen) else ADDED
    if notices and int(store.add("pxe/notice", 0)) > notice:
        updates = {int(json.loads(store.get(f"pxe/notice/{n}"))["update"])
                   for n in range(notice + 1, int(store.add("pxe/notice", 0)) + 1)}
        kind = max(kind, REMOVED_ONLY if updates == {1} else ADDED)  # 1: Horovod's HostUpdateResult.removed
    return kind


class PendingPoll:
    """A daemon thread that reads the launcher's pending change every :data:`POLL_S` with a
    store client of its own, so a deferred commit on rank 0 asks nothing of the store itself."""

    def __init__(self, address: str, current_gen: Callable[[], int]) -> None:
        self.address, self.current_gen = address, current_gen
        self.seen: dict[tuple[int, int, bool], int] = {}  # (generation, notice, notices) -> kind
        self.latest = 0  # the newest generation the launcher had published at the last read
        # (rank 0's commits, timed by tick()) the last commit's time, and the seconds a commit took as the
        # last vote measured them; since the last vote: the time its commits took, the same with each
        # pause counted as _PAUSE commits, how many commits and pauses; the count that vote proposed
        self._last: float | None = None
        self._per: float | None = None
        self._spent = self._spent_paused = 0.0
        self._commits = self._pauses = self._proposed = 0
        self.asked: set[tuple[int, int, bool]] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="phalanx-elastic-pending", daemon=True)

    def start(self) -> PendingPoll:
        self.thread.start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(5.0)

    def tick(self) -> None:
        """At each of rank 0's deferred commits, voting or not (before :meth:`commits_to_skip` at a voting
        one): the time since its last commit counts as commit time, a pause (over :data:`_PAUSE` times the
        last measured commit) as that many commits' time."""
        now = time.monotonic()
        if self._last is not None:
            took = now - self._last
            self._spent += took
            if self._per is not None and took > _PAUSE * self._per:
                took = _PAUSE * self._per
                self._pauses += 1
            self._spent_paused += took
            self._commits += 1
        self._last = now

    def commits_to_skip(self, busy: bool = False) -> int:
        """How many commits the members skip voting after this one: the commits rank 0 makes in one
        :data:`VOTE_S` (five of this thread's polls), or in one :data:`VOTE_BUSY_S` when ``busy`` (a
        change pending or an admission forming), less one.
        Called at each voting commit, after :meth:`tick`: the commits since the last call are the count
        proposed then plus one, timed by :meth:`tick`, so a pause between commits is not read as slow
        commits (when most of the gaps are long, the commits slowed down: timed as they are). The count
        at most doubles (plus one) from one vote to the next: the rate is measured over the commits just
        made, and a loop that then slows down (a re-form's few quick steps, then commits 50 ms apart
        while a replacement is awaited) would otherwise skip a quick stretch's count of slow commits (at
        0.5 s, 99 commits: 5 s unvoted)."""
        skip = 0
        if self._commits and self._spent > 0:
            self._per = (self._spent if 2 * self._pauses > self._commits else self._spent_paused) / self._commits
            period = VOTE_BUSY_S if busy else VOTE_S
            skip = max(0, min(_MAX_SKIP, 2 * self._proposed + 1, int(period / self._per) - 1))
        self._spent = self._spent_paused = 0.0
        self._commits, self._pauses, self._proposed = 0, 0, skip
        return skip

    def forget_rate(self) -> None:
        """At a re-form: the members dropped the count they were skipping, so the next vote measures no
        commit rate from it (it would read the old generation's proposal over the re-form's pause: at a
        0.5 s period, after 100 quick commits and a 1 s pause, ~50 commits of the new one unvoted), and
        the new generation's commits are timed afresh."""
        self._last, self._per = None, None
        self._spent = self._spent_paused = 0.0
        self._commits = self._pauses = self._proposed = 0

    def kind(self, gen: int, notice: int, notices: bool) -> int:
        """The last answer read for this generation (0 until the thread has read one)."""
        self.asked.add((gen, notice, notices))
        return self.seen.get((gen, notice, notices), 0)

    def _loop(self) -> None:
        host, _, port = self.address.rpartition(":")
        with contextlib.suppress(Exception):  # the store went away: the job is ending
            store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=10))
            published = False
            while not self.stop.wait(POLL_S):
                # one store round trip a poll while nothing changes (was four: each asked key re-read
                # pxe/latest, checking first that it exists); the generations' members only on a change
                published = published or store.check(["pxe/latest"])
                if published:
                    self.latest = int(store.get("pxe/latest"))
                for key in list(self.asked):
                    if key[0] != self.current_gen():  # a generation this worker left
                        self.asked.discard(key)
                        self.seen.pop(key, None)
                    elif self.latest > key[0] or key[2]:
                        self.seen[key] = pending_on(store, *key, latest=self.latest)
                    else:
                        self.seen[key] = 0
