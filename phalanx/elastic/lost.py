"""A lost member ends every survivor's collective at once, whatever gloo is waiting on.

When a worker dies, gloo fails the survivors' collectives through the closed connections,
but not always: a survivor waiting to *receive* from a live peer (a ring step, an
unbound-buffer receive) is not told that a connection to another peer closed, and waits out
the collective timeout (measured: a rank blocked in an allreduce with 3 ranks stayed there
10 s after its other peer shut its connections, and returned only when the third exited).
Under load that is how one survivor noticed a raising peer only at the timeout, so its
recovery merged with the next admission (issue #32).

What does end such a wait is shutting *this process's own* connections: gloo's loop then
fails every pending operation of the pairs (measured: the blocked allreduce raised at once).
So the loss is announced on the launcher's store, and a thread in each worker acts on it::

    worker w2 raises ─ abandon(): announce pxe/lost/w2 (+1 on pxe/lost) ─ shut its connections ─ exit
    launcher: w2 exited non-zero ─ announce pxe/lost/w2 (a SIGKILL announces nothing itself)
    w0, w1, w3 (thread, every 0.1 s: one store add): pxe/lost moved ─ w2 is in my generation ─
               the main thread is still blocked in a collective 1 s later (gloo did not end it) ─
               shut my own connections of that generation ─ that collective raises now
               ─ elastic.run re-forms as for any collective error

A worker's connections are shut only for the generation it is in when the loss is seen (the
re-form takes the same lock to swap generations), so a new group is never touched.

Example::

    lost.announce(store, "w2")
    LostWatcher(host, port, ctx_gen, interrupt).start()
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["announce", "is_collective_error", "LostWatcher", "socket_fds", "group_sockets", "keep", "shut", "POLL_S", "GRACE_S"]

POLL_S = 0.1  # one store round trip per worker per poll
# Most losses gloo reports by itself at once; the connections are shut only under a collective still
# blocked this long after the loss was seen (shutting them under gloo's feet is not free either).
GRACE_S = 1.0


_COLLECTIVE_WORDS = ("gloo", "connection closed", "connection reset", "broken pipe", "timed out",
                     "timeout", "nccl", "peer", "socket", "store", "no answer within")


def is_collective_error(err: BaseException) -> bool:
    """Does ``err`` look like a failed collective (a peer died, the group broke) rather than a bug?"""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    # TimeoutError: a checkpoint's cross-rank wait on the store for a rank that is gone
    return isinstance(err, (RuntimeError, TimeoutError)) and any(w in str(err).lower() for w in _COLLECTIVE_WORDS)


def announce(store, wid: str) -> None:
    """Say on the launcher's store that worker ``wid`` is lost (idempotent enough: a second +1 is harmless)."""
    store.set(f"pxe/lost/{wid}", b"1")
    store.add("pxe/lost", 1)


def socket_fds() -> dict[str, int]:
    """inode -> fd of this process's sockets."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd, a thread's socket)
        if target.startswith("socket:["):
            out[target[8:-1]] = int(fd)
    return out


_kept: set[str] = set()  # connections never the group's (a Ray actor's own RPC links)


def keep(inodes: set[str]) -> int:
    """Never count the connections ``inodes`` as the process group's; returns how many are kept."""
    _kept.update(inodes)
    return len(_kept)


def group_sockets(store_port: int) -> set[str]:
    """Inodes of this process's established TCP connections that are not to or from the store's port."""
    if not os.path.isdir("/proc/self/fd"):
        return set()
    mine = socket_fds()
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            ports = {int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)}
            if cols[9] in mine and cols[3] == "01" and store_port not in ports and cols[9] not in _kept:  # ESTABLISHED
                found.add(cols[9])
    return found


def shut(inodes: set[str]) -> int:
    """Shut down (not close: gloo still owns the fds) the connections ``inodes``; returns how many."""
    count = 0
    fds = socket_fds() if os.path.isdir("/proc/self/fd") else {}
    for inode in inodes & set(fds):
        try:
            s = socket.socket(fileno=os.dup(fds[inode]))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            s.close()  # closes our duplicate only
    return count


class LostWatcher:
    """A daemon thread: when a member of this worker's generation is announced lost, ``interrupt(gen)``.

    ``current()`` returns (generation, this worker's id) as the main thread sees them now;
    ``interrupt(gen)`` shuts the connections of ``gen`` if the worker is still in it.
    """

    def __init__(self, host: str, port: int, current: Callable[[], tuple[int, str]],
                 interrupt: Callable[[int, str], None]) -> None:
        self.host, self.port, self.current, self.interrupt = host, port, current, interrupt
        self._thread = threading.Thread(target=self._loop, name="phalanx-elastic-lost", daemon=True)
        self._stop = threading.Event()

    def start(self) -> LostWatcher:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread and wait for it (at interpreter exit, from atexit).

        Left running, the thread is inside a store call (C++, the GIL released) about one exit in
        ten; when that call returns during the interpreter's finalization, Python ends the thread
        with ``pthread_exit``, whose forced unwinding through torch's noexcept GIL re-acquire calls
        ``std::terminate``: "terminate called without an active exception", SIGABRT, after a
        finished script (issue 39; measured: 1 of 5 runs of Horovod's elastic MNIST example
        under ``phalanx run --min-np 1 --max-np 2``). A store call is bounded by the client's
        10 s timeout, so the wait is too."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        import torch.distributed as dist

        try:  # a client of its own: the main thread's may be blocked in a long store wait
            store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=10))
        except Exception:  # noqa: BLE001 - no store: the collective timeout still bounds every wait
            return
        seen, acted = 0, set()
        pending: tuple[int, str, float] | None = None  # (generation, who, when seen)
        with contextlib.suppress(Exception):  # the store went away: the job is ending
            while not self._stop.wait(POLL_S):
                gen, me = self.current()
                if pending is not None:
                    if pending[0] != gen:
                        pending = None  # the main thread noticed by itself and re-formed
                    elif _blocked_since(pending[2]) >= GRACE_S:
                        acted.add(gen)
                        self.interrupt(gen, pending[1])
                        pending = None
                count = store.add("pxe/lost", 0)
                if count == seen:
                    continue
                seen = count
                if gen < 0 or gen in acted or not store.check([f"pxe/gen/{gen}"]):
                    continue
                members = [m[0] for m in json.loads(store.get(f"pxe/gen/{gen}"))["members"]]
                gone = [w for w in members if w != me and store.check([f"pxe/lost/{w}"])]
                if gone:
                    pending = (gen, ", ".join(gone), time.time())


def _blocked_since(seen: float) -> float:
    """How long the main thread has been blocked in one collective, counted from ``seen`` at the earliest."""
    from phalanx.runtime.heartbeat import RECORD

    waiting = RECORD.waiting
    return 0.0 if waiting is None else time.time() - max(waiting[1], seen)
