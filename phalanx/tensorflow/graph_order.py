"""The order of a ``tf.compat.v1`` graph's collectives, agreed by the ranks while the graph runs.

TensorFlow starts the ops of a ``session.run`` on parallel threads in an order of its choosing, so
two ranks can reach a run's collectives in different orders, and gloo needs one order. Horovod
(Sergeev & Del Balso 2018, "Horovod: fast and easy distributed deep learning in TensorFlow",
section 4) orders them at run time: each op announces itself when it is ready, a coordinator
finds the ops ready on every rank and all ranks run those in one order. Here:

1. **post** (a ``py_function`` that returns at once): the collective's inputs and its key, the
   graph-stable op name and how many times this process has posted it before (``name#k``), go to
   this process's :class:`Coordinator`; one ``store.add`` counts the ranks that posted that key.
   The rank whose add completes the count of the collective's process set appends the key to the
   job's order (a store counter gives it a place, ``o/<seq>``).
2. **wait**: the op's outputs come from ``IteratorGetNext`` over a one-element dataset of the post's
   ticket, mapped by a ``py_function`` that waits for the ticket's result. ``IteratorGetNext`` is
   asynchronous: the wait runs on tf.data's thread, not on one of the session's inter-op threads, so
   a run with more collectives ready than inter-op threads does not deadlock, as ``py_function``\\ s
   that wait do (``scripts/horovod_tf_suite/async_wait_probe.py``).
3. The coordinator's thread reads the order from the store while this process has posted
   collectives and runs those of its own sets, one at a time, in that order: every member runs
   the same collectives in the same order, and only collectives every member has posted.

The agreement goes through the store only (a few small requests per collective), never through a
collective on the training group, so it cannot pair with an eager collective. A collective that
some member never posts fails on the members that did after the job's timeout (the key is marked
abandoned, so a late member fails at once instead of waiting for a collective nobody runs). The
thread waits on a condition while nothing is posted, and at interpreter exit every pending wait
ends (no thread left in a store call or a wait).

Example (what :func:`phalanx.tensorflow.bridge.call` builds)::

    ticket = tf.py_function(lambda *xs: post(name, fn, xs, members), inputs, tf.int64)
    outs = iterator over Dataset.from_tensors(ticket).map(py_function(wait)) -> get_next
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time

import torch.distributed as dist

from phalanx.log import get_logger

__all__ = ["Ticket", "Coordinator", "coordinator", "take", "drop", "close"]

_ABANDONED = 1 << 40  # added to a key's count by a member that gave up waiting for the others
_POLL_S = (0.0002, 0.004)  # backoff of the thread's checks for the next order entry


class Ticket:
    """One posted run of a graph collective: its inputs, and later its outputs or a failure."""

    __slots__ = ("key", "fn", "inputs", "members", "on_error", "posted_at", "done", "outputs", "error", "message")

    def __init__(self, key: str, fn, inputs, members, on_error) -> None:
        self.key, self.fn, self.inputs, self.members, self.on_error = key, fn, inputs, members, on_error
        self.posted_at = time.monotonic()
        self.done = threading.Event()
        self.outputs = None
        self.error: BaseException | None = None  # raised by the wait
        self.message = ""  # a cross-rank mismatch or a timeout: raised as FailedPreconditionError

    def run(self) -> None:
        try:
            self.outputs = self.fn(self.inputs)
        except Exception as err:  # noqa: BLE001 - handed to the waiting op, which raises it in TF's terms
            message = self.on_error(err)
            if message is None:
                self.error = err
            else:
                self.message = message
        self.inputs = None
        self.done.set()

    def fail(self, message: str) -> None:
        self.message, self.inputs = message, None
        self.done.set()


class Coordinator:
    """This process's posted graph collectives and the thread that runs them in the job's order."""

    def __init__(self, store, rank: int, timeout_s: float, store_of=None) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.store_of = store_of  # the job's store this coordinator's (prefixed) store wraps
        self.cond = threading.Condition()
        self.counts: dict[str, int] = {}  # op name -> times posted by this process
        self.pending: dict[str, Ticket] = {}  # key -> ticket posted everywhere or not yet, not yet run
        self.tickets: dict[int, Ticket] = {}  # ticket id -> ticket, until its wait takes it
        self.ids = itertools.count(1)
        self.seq = 0  # the next order entry this process reads
        self.closed = False
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the ops' side
    def post(self, name: str, fn, inputs, members: list[int], on_error) -> int:
        """Announce a run of collective ``name`` over the global ranks ``members``; returns the ticket's id.

        ``on_error(exception)``: the message of a failure to raise as ``FailedPreconditionError``
        (a cross-rank mismatch), or None to raise the exception itself.
        """
        alone = len(members) == 1 or self.rank not in members  # nothing to agree on (a non-member raises)
        with self.cond:
            if self.closed:
                raise RuntimeError("phalanx: a graph collective ran after shutdown() (the coordinator is closed)")
            k = self.counts.get(name, 0)
            self.counts[name] = k + 1
            ticket = Ticket(f"{name}#{k}", fn, inputs, members, on_error)
            ident = next(self.ids)
            self.tickets[ident] = ticket
            if not alone:  # before the count: the order may name it as soon as the last member adds
                self.pending[ticket.key] = ticket
        if alone:
            ticket.run()
            return ident
        count = self.store.add(f"n/{ticket.key}", 1)
        if count > _ABANDONED:
            with self.cond:
                self.pending.pop(ticket.key, None)
            ticket.fail(f"graph collective {name!r} (run {k + 1} in this process): another rank of its "
                        f"process set gave up waiting for the others after {self.timeout_s:g} s; every rank's "
                        "session.run must fetch the same collectives")
            return ident
        if count == len(members):
            seq = self.store.add("seq", 1) - 1
            self.store.set(f"o/{seq}", f"{ticket.key}|{','.join(map(str, members))}")
        with self.cond:
            self._start()
            self.cond.notify_all()
        return ident

    def take(self, ident: int) -> Ticket:
        """The ticket, once run or failed (the coordinator's timeout bounds the wait)."""
        with self.cond:
            ticket = self.tickets.pop(ident)
        while not ticket.done.wait(0.5):
            if self.closed and not ticket.done.is_set():
                ticket.fail("graph collective: the process is shutting down")
        return ticket

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="phalanx-tf-graph-order", daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        delay = _POLL_S[0]
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
            try:
                entry = self._next_entry()
            except Exception as err:  # noqa: BLE001 - the store is gone (shutdown): fail what waits
                self._fail_all(f"graph collectives: the job's store failed ({err})")
                return
            if entry is None:
                self._expire()
                time.sleep(delay)
                delay = min(delay * 2, _POLL_S[1])
                continue
            delay = _POLL_S[0]
            key, members = entry
            if self.rank not in members:
                continue
            with self.cond:
                ticket = self.pending.pop(key, None)
            if ticket is None:
                get_logger(__name__).warning("graph collective %s is in the order but not posted here", key)
                continue
            ticket.run()

    def _next_entry(self):
        key = f"o/{self.seq}"
        if not self.store.check([key]):
            return None
        self.seq += 1
        name, members = self.store.get(key).decode().rsplit("|", 1)
        return name, {int(m) for m in members.split(",")}

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            late = [t for t in self.pending.values() if now - t.posted_at > self.timeout_s]
        for ticket in late:
            count = self.store.add(f"n/{ticket.key}", _ABANDONED)
            if count - _ABANDONED >= len(ticket.members):
                ticket.posted_at = float("inf")  # every member posted it after all: it is (about to be) in the order
                continue
            with self.cond:
                self.pending.pop(ticket.key, None)
            ticket.fail(f"graph collective {ticket.key.rsplit('#', 1)[0]!r}: only {count - _ABANDONED} of the "
                        f"{len(ticket.members)} ranks of its process set ran it within {self.timeout_s:g} s (the job's "
                        "timeout, init(timeout=) or PHALANX_TIMEOUT); every rank's session.run must fetch the same "
                        "collectives")

    def _fail_all(self, message: str) -> None:
        with self.cond:
            tickets = list(self.pending.values())
            self.pending.clear()
        for ticket in tickets:
            ticket.fail(message)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self._fail_all("graph collective: the process is shutting down")


_current: Coordinator | None = None
_lock = threading.Lock()


def coordinator(rank: int, timeout_s: float) -> Coordinator:
    """This process's coordinator for the job's current store (a new one after shutdown and init)."""
    global _current
    store = None
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    with _lock:
        if _current is None or _current.store_of is not store:
            if _current is not None:
                _current.close()
            _current = Coordinator(None if store is None else dist.PrefixStore("phalanx/tf-graph/", store),
                                   rank, timeout_s, store_of=store)
        return _current


def take(ident: int) -> Ticket:
    """The ticket ``ident`` posted to this process's coordinator, once run or failed."""
    with _lock:
        current = _current
    return current.take(ident)


def drop(ident: int) -> None:
    """Forget ticket ``ident`` (its run ended before its wait); it still runs if every member posted it."""
    with _lock:
        current = _current
    if current is not None:
        with current.cond:
            current.tickets.pop(ident, None)


def close() -> None:
    """End every wait and the thread (at interpreter exit)."""
    with _lock:
        if _current is not None:
            _current.close()


atexit.register(close)
