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

    staging = Staging(store_address, gen=5, rank=1, members=["w0", "w1", "w4"], wid="w1", holders=2).start()
    staging.state()          # FORMING, READY or FAILED (a vote carries it)
    adopt(staging, store)    # at the agreed commit: the default process group is the connected one
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time

import torch.distributed as dist

from phalanx.elastic import lost
from phalanx.log import get_logger
from phalanx.runtime.backends import register_alias
from phalanx.settings import var

__all__ = ["Admission", "Staging", "check_in", "holders_of", "take_rank", "make_group", "connect", "adopt", "BACKEND", "READY", "FORMING", "FAILED", "staged_key"]

log = get_logger(__name__)

BACKEND = "phalanx_staged"  # the c10d backend name of a group adopted after a staged admission (gloo inside)
READY, FORMING, FAILED = 0, 1, 2  # a member's staging, as its vote carries it (MAX over the members)
_POLL_S = 0.01
_handover: list = []  # the connected backend the creator hands over next (one at a time)
_registered = False


def staged_key(gen: int) -> str:
    """Set by rank 0 of the members before it checks in: generation ``gen`` is formed by staging (the
    value: how many members it keeps, ranks 0 to n-1; the rest are newcomers)."""
    return f"pxe/g{gen}/staged"


def holders_of(store, gen: int) -> int | None:
    """How many members (ranks 0 to n-1) of generation ``gen`` came from the one before it holding the
    state, when ``gen`` was formed by staging; None otherwise (one store read, two when staged)."""
    key = staged_key(gen)
    return int(store.get(key)) if store.check([key]) else None


def check_in(store, gen: int, wid: str, count: int, deadline: float, give_up) -> bool:
    """Check in to generation ``gen`` (``pxe/g<gen>/ack/<wid>``, counted in ``pxe/g<gen>/arrived``); True
    once all ``count`` members have, False at the deadline or when ``give_up()`` says so."""
    store.set(f"pxe/g{gen}/ack/{wid}", b"1")
    arrived = f"pxe/g{gen}/arrived"
    store.add(arrived, 1)
    while store.add(arrived, 0) < count:
        if give_up() or time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def take_rank(members: list[list[str]], wid: str, gen: int) -> int:
    """Set this worker's variables (torchrun's and Horovod's names) for generation ``gen``, whose
    ``members`` are ``[worker id, host]`` in rank order; returns its rank."""
    rank = [m[0] for m in members].index(wid)
    hosts = list(dict.fromkeys(m[1] for m in members))
    my_host = members[rank][1]
    on_host = [m[0] for m in members if m[1] == my_host]
    env = {"RANK": rank, "WORLD_SIZE": len(members), "LOCAL_RANK": on_host.index(wid),
           "LOCAL_WORLD_SIZE": len(on_host), "GROUP_RANK": hosts.index(my_host), "GROUP_WORLD_SIZE": len(hosts),
           var("elastic.generation"): gen}
    os.environ.update({k: str(v) for k, v in env.items()})
    for ours, theirs in (("RANK", "HOROVOD_RANK"), ("WORLD_SIZE", "HOROVOD_SIZE"), ("LOCAL_RANK",
                         "HOROVOD_LOCAL_RANK"), ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"),
                         ("GROUP_RANK", "HOROVOD_CROSS_RANK"), ("GROUP_WORLD_SIZE", "HOROVOD_CROSS_SIZE")):
        os.environ[theirs] = os.environ[ours]
    return rank


def make_group(store, gen: int, rank: int, size: int, timeout_s: float, form_timeout_s: float,
               staged: Staging | None = None) -> None:
    """Generation ``gen``'s default process group: the one ``staged`` connected in the background (a
    member's switch), connected now the same way (a newcomer to a staged generation), else a gloo group
    made the ordinary way. The store waits are bounded by ``form_timeout_s``, so a member that died
    after checking in aborts this round instead of holding it."""
    from phalanx import runtime

    timeout = datetime.timedelta(seconds=timeout_s)
    runtime.import_dynamo_first()
    store.set_timeout(datetime.timedelta(seconds=min(timeout_s, form_timeout_s)))
    try:
        if staged is not None:
            adopt(staged.backend, store, gen, rank, size, timeout_s)
            staged.adopted()
        elif store.check([staged_key(gen)]):
            adopt(connect(store, gen, rank, size, timeout_s), store, gen, rank, size, timeout_s)
        else:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"pxe/g{gen}/pg", store), rank=rank,
                                    world_size=size, timeout=timeout)
    finally:
        store.set_timeout(timeout)


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
        register_alias(BACKEND, "gloo")  # the dtypes gloo lacks, its in-place reduce-scatter: as gloo
        _registered = True
    _handover[:] = [((rank, size), backend)]
    try:
        dist.init_process_group(BACKEND, store=dist.PrefixStore(f"pxe/g{gen}/pg", store), rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        _handover.clear()


class Admission:
    """One member's admissions: the staging in flight, and the generations staged once.

    At each deferred commit :meth:`at_vote` reads the members' agreed vote (the same on every member,
    so every member decides alike): ``"switch"`` (every member's group is ready: re-form onto it now),
    ``"reform"`` (a change staging cannot take: re-form the ordinary way now) or None (train on).
    """

    def __init__(self) -> None:
        self.staging: Staging | None = None
        self.staged: set[int] = set()  # never joined by the ordinary path: their store keys are spent
        self.switch = False

    def state(self) -> int:
        """This member's part of the vote (READY when nothing is forming)."""
        return READY if self.staging is None else self.staging.state()

    def at_vote(self, kind: int, latest: int, state: int, stageable, start) -> str | None:
        """``kind``: the launcher's pending change (0 none, else interrupts.REMOVED_ONLY / ADDED);
        ``latest``: the generation it published; ``state``: the members' staging, MAX over them.
        ``stageable(latest)``: it only adds workers after the members; ``start(latest)``: a Staging."""
        if self.staging is not None:
            if latest > self.staging.gen:  # a newer change than the one forming
                return "reform"
            if state == READY:
                self.switch = True
                return "switch"
            if state == FAILED:  # train on in this generation; the launcher's next one follows
                log.warning("generation %d could not form in the background (%s); training on", self.staging.gen,
                            self.staging.error or "another member's failed")
                self.staging.drop()
                self.staging = None
            return None
        if not kind or latest in self.staged:
            return None
        if not stageable(latest):
            return "reform"
        self.staged.add(latest)
        self.staging = start(latest)
        log.info("generation %d admits worker(s): forming its group in the background", latest)
        return None

    def take(self) -> Staging | None:
        """At a re-form: the staging every member agreed to switch to, else None (one in flight is dropped:
        a newcomer connected to it fails at once and waits for the next generation)."""
        chosen = self.staging if self.switch else None
        if self.staging is not None and chosen is None:
            self.staging.drop()
        self.staging, self.switch = None, False
        return chosen

    def spent(self) -> int:
        """The newest generation staged once (-1: none)."""
        return max(self.staged, default=-1)


class Staging:
    """One member's background formation of generation ``gen`` (see the module docstring)."""

    def __init__(self, address: str, gen: int, rank: int, members: list[str], wid: str, *,
                 timeout_s: float, form_timeout_s: float, holders: int) -> None:
        self.address, self.gen, self.rank, self.members, self.wid = address, gen, rank, members, wid
        self.holders = holders  # the members now (ranks 0 to holders-1 of gen): the rest are newcomers
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
        atexit.register(self.close)  # (a thread still in a store call at interpreter teardown can abort it)
        return self

    def adopted(self) -> None:
        """The default process group now: nothing of it is this object's to drop any more."""
        atexit.unregister(self.close)
        self.backend = None

    def close(self) -> None:
        """Drop it and wait for the thread (bounded: its store waits are)."""
        self.drop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.form_timeout_s + 5)

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
                self.store.set(staged_key(self.gen), str(self.holders).encode())
            if not check_in(self.store, self.gen, self.wid, len(self.members), started + self.form_timeout_s,
                            lambda: self.dropped):
                raise TimeoutError(f"generation {self.gen}: not every member checked in within "
                                   f"{self.form_timeout_s:.0f}s")
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
