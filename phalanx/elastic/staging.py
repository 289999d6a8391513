"""Admission without a pause: the next generation's process group made in the background.

Workers added to a ``TorchState(recover="live")`` job used to cost every member a stop at the
commit that admitted them: leave the group, check in, wait for the others, connect a new gloo
group (a full mesh), then hand the state over. torchft's members instead configure the next
quorum's group off the training path and switch at a step boundary. This module does that for
a generation that only *adds* workers after the current members (same order, same ranks)::

    commit k     the members' vote says: generation g' (members + newcomers) is published
                 every member: Staging(g').start()  ─ thread: check in to g', wait for every member
                 of g' (the newcomers are waiting already), connect g's gloo group   ─┐ training
    commit k+1.. each member's vote carries "my group is ready" (0), "forming" (1), "failed" (2)   │ goes on
    commit k+j   the vote says every member is ready: every member switches at this commit   ─┘
                 (drop the old group, adopt the connected one, hand the state to the newcomers)

A newcomer connects the same way (:func:`connect`), told by the flag ``pxe/g<g'>/staged`` that the
members stage. A group connected in the background is adopted through a c10d backend of our own
(:data:`BACKEND`, registered with ``torch.distributed.Backend.register_backend``): the default
process group is made with it, and its creator hands over the connected gloo backend instead of
connecting again (any later subgroup gets a fresh gloo backend from the same creator). A staging
that fails (a member or a newcomer died while it formed) is dropped: the members keep training in
their generation and the launcher's next one (without the dead worker) re-forms as any change does;
a generation once staged is never joined by the ordinary path (its store keys are spent).

Example (what ``phalanx.elastic.inprocess`` does)::

    staging = Staging(store_address, gen=5, rank=1, members=["w0", "w1", "w4"], wid="w1").start()
    staging.state()          # FORMING, READY or FAILED (a vote carries it)
    adopt(staging, store)    # at the agreed commit: the default process group is the connected one
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from phalanx.elastic import lost
from phalanx.log import get_logger

__all__ = ["Staging", "connect", "adopt", "BACKEND", "READY", "FORMING", "FAILED", "staged_key"]

log = get_logger(__name__)

BACKEND = "phalanx_staged"  # the c10d backend name of a group adopted after a staged admission (gloo inside)
READY, FORMING, FAILED = 0, 1, 2  # a member's staging, as its vote carries it (MAX over the members)
_POLL_S = 0.01
_handover: list = []  # the connected backend the creator hands over next (one at a time)
_registered = False


def staged_key(gen: int) -> str:
    """Set by rank 0 of the members before it checks in: generation ``gen`` is formed by staging."""
    return f"pxe/g{gen}/staged"


def connect(store, gen: int, rank: int, size: int, timeout_s: float):
    """Connect generation ``gen``'s gloo group (members in the background, newcomers in their join):
    everyone of a staged generation makes it this way, on the same store keys."""
    from phalanx import runtime

    runtime.import_dynamo_first()
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pxe/g{gen}/staged-pg", store), rank, size,
                                 datetime.timedelta(seconds=timeout_s))


def _creator(store, rank: int, size: int, timeout):
    """The c10d creator of :data:`BACKEND`: the connected backend waiting to be adopted, else (a
    subgroup made later) a fresh gloo backend on the store c10d gives."""
    if _handover and _handover[0][0] == (rank, size):
        return _handover.pop()[1]
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def adopt(backend, store, gen: int, rank: int, size: int, timeout_s: float) -> None:
    """Make ``backend`` (connected by :func:`connect`) this process's default process group.
    ``store``: the launcher's store; subgroups made later key their own connections under it."""
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _creator, devices=["cpu"])
        _registered = True
    _handover[:] = [((rank, size), backend)]
    try:
        dist.init_process_group(BACKEND, store=dist.PrefixStore(f"pxe/g{gen}/pg", store), rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        _handover.clear()


class Staging:
    """One member's background formation of generation ``gen`` (see the module docstring)."""

    def __init__(self, address: str, gen: int, rank: int, members: list[str], wid: str, *,
                 timeout_s: float, form_timeout_s: float) -> None:
        self.address, self.gen, self.rank, self.members, self.wid = address, gen, rank, members, wid
        self.timeout_s, self.form_timeout_s = timeout_s, form_timeout_s
        self.backend = None
        self.store = None  # the thread's own client (the connected backend keeps using it)
        self.sockets: set[str] = set()  # the connected group's TCP connections (lost.group_sockets)
        self.error: str | None = None
        self.dropped = False
        self.took_s: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-elastic-staging", daemon=True)

    def start(self) -> Staging:
        self._thread.start()
        return self

    def state(self) -> int:
        if not self._done.is_set():
            return FORMING
        return READY if self.backend is not None and not self.dropped else FAILED

    def drop(self) -> None:
        """Not adopted (a failure, a newer generation): let the connected group go (its sockets close
        with it, so a newcomer waiting on it fails at once and waits for the next generation)."""
        self.dropped = True
        if self._done.is_set():
            lost.shut(self.sockets)
            self.backend = None

    def _run(self) -> None:
        started = time.monotonic()
        try:
            host, _, port = self.address.rpartition(":")
            self.store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=self.form_timeout_s))
            if self.rank == 0:
                self.store.set(staged_key(self.gen), b"1")
            self.store.set(f"pxe/g{self.gen}/ack/{self.wid}", b"1")
            arrived = f"pxe/g{self.gen}/arrived"
            self.store.add(arrived, 1)
            deadline = started + self.form_timeout_s
            while self.store.add(arrived, 0) < len(self.members):
                if self.dropped or time.monotonic() > deadline:
                    raise TimeoutError(f"generation {self.gen}: not every member checked in within "
                                       f"{self.form_timeout_s:.0f}s")
                time.sleep(_POLL_S)
            before = lost.group_sockets(int(port))
            backend = connect(self.store, self.gen, self.rank, len(self.members), self.timeout_s)
            self.sockets = lost.group_sockets(int(port)) - before
            self.backend = backend
            self.took_s = time.monotonic() - started
        except Exception as err:  # noqa: BLE001 - a failed staging is dropped; the members train on
            self.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        finally:
            self._done.set()
            if self.dropped:
                self.drop()
