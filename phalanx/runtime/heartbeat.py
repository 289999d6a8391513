"""Each rank's collective record and the heartbeat that publishes it to the job's store.

The record is a small ring buffer of this process's collectives, as PyTorch's Flight
Recorder keeps for NCCL, but on any backend: sequence number, operation, name (the
bucket or tensor), shapes, start and end time. ``phalanx.comm.collectives`` writes it;
it also says which collective, if any, the main thread is *blocked* on right now and
since when (an async collective in flight while the rank computes is not a wait).

Under ``phalanx run`` (which exports ``PHALANX_HEARTBEAT_S`` and the address of the
store it hosts, ``PHALANX_HEARTBEAT_STORE``) a daemon thread publishes, every that many
seconds, one data-only JSON value to that store under ``phalanx/heartbeat/<rank>``::

    {"rank": 1, "pid": 4242, "restart": 0, "beat": 17, "state": "waiting", "seq": 38,
     "op": "allreduce", "name": "grad.bucket0", "shapes": [[4096]], "waited_s": 3.2,
     "done": 37, "recent": [[37, "allreduce", "grad.bucket1", [[512]], 0.0009], ...]}

``state`` is ``running`` (between collectives), ``waiting`` (blocked in collective
``at`` for ``waited_s``), and in the last beat, written at interpreter exit, ``exited``
(the script ended) or ``failed`` (an uncaught exception ended it).
A stopped or wedged process stops beating: the launcher notices that the ``beat``
counter no longer moves (its own clock, so host clocks never matter). The same
start registers :mod:`faulthandler` on SIGUSR2, writing every thread's Python stack
to ``PHALANX_STACK_DIR/rank<N>.txt``, which is how the launcher shows where a stuck
rank is.

Cost: a collective pays two ``time.time()`` calls and one small list appended to a
deque (about a microsecond); the thread wakes once per interval.

Example::

    from phalanx.runtime.heartbeat import RECORD
    e = RECORD.begin("allreduce", "grad", (torch.Size([4]),)); RECORD.end(e)
    RECORD.snapshot()["seq"]          # 1
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import faulthandler
import json
import os
import signal
import sys
import threading
import time

from phalanx.settings import ElasticSettings, RuntimeSettings, var

__all__ = ["CollectiveRecord", "RECORD", "Heartbeat", "start_from_env", "heartbeat_key", "describe_position",
           "peer_positions", "HEARTBEAT_ENV", "HEARTBEAT_STORE_ENV", "STACK_DIR_ENV"]

HEARTBEAT_ENV = var("runtime.heartbeat_s")
HEARTBEAT_STORE_ENV = var("runtime.heartbeat_store")  # host:port of the launcher's own store
STACK_DIR_ENV = var("runtime.stack_dir")
_RECENT = 8  # entries each beat carries (the ring keeps more, for a stack dump or a debugger)


def heartbeat_key(ident: int | str) -> str:
    """The store key of one worker's heartbeat: its rank, or its elastic worker id (``w3``) in elastic jobs."""
    return f"phalanx/heartbeat/{ident}"


class CollectiveRecord:
    """Ring buffer of this process's collectives; entries are ``[seq, op, name, shapes, start, end, group,
    group_seq]``: ``group`` names the process group by its global ranks (``"0,2"``; ``"world"`` for the
    default one) and ``group_seq`` counts that group's collectives only, so ranks that take part in
    different sub-groups are compared collective by collective within each group."""

    __slots__ = ("entries", "seq", "waiting", "groups")

    def __init__(self, size: int = 64) -> None:
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.seq = 0
        self.waiting: tuple[list, float] | None = None  # (entry, since): the main thread is blocked in it
        self.groups: dict[str, int] = {}  # group id -> collectives begun on it

    def begin(self, op: str, name: str | None, shapes: tuple, group=None) -> list:
        self.seq += 1
        gid = group_id(group)
        gseq = self.groups[gid] = self.groups.get(gid, 0) + 1
        entry = [self.seq, op, name, shapes, time.time(), None, gid, gseq]
        self.entries.append(entry)
        return entry

    @staticmethod
    def end(entry: list) -> None:
        entry[5] = time.time()

    def open(self, op: str, name: str | None, *tensors, group=None) -> list:
        """``begin`` with the shapes of ``tensors`` (None skipped)."""
        return self.begin(op, name, tuple(t.shape for t in tensors if t is not None), group)

    def blocking(self, entry: list, fn, *args, **kwargs):
        """Run ``fn`` (a synchronous collective), marked as the one this rank is waiting in."""
        self.waiting = (entry, time.time())
        try:
            return fn(*args, **kwargs)
        finally:
            self.waiting = None

    def call(self, op: str, fn, *args, **kwargs):
        """Record, run and close a synchronous collective that has no tensor name (barrier, objects)."""
        entry = self.begin(op, None, (), kwargs.get("group"))
        out = self.blocking(entry, fn, *args, **kwargs)
        entry[5] = time.time()
        return out

    def snapshot(self) -> dict:
        """What the heartbeat publishes (safe to call from another thread)."""
        waiting = self.waiting
        entries = list(self.entries)
        done = max((e[0] for e in entries if e[5] is not None), default=0)
        out: dict = {"seq": self.seq, "done": done, "state": "running", "waited_s": 0.0,
                     "recent": [[e[0], e[1], e[2], [list(s) for s in e[3]],
                                 None if e[5] is None else round(e[5] - e[4], 6)] for e in entries[-_RECENT:]]}
        current = waiting[0] if waiting else (entries[-1] if entries else None)
        if current is not None:
            out.update(op=current[1], name=current[2], shapes=[list(s) for s in current[3]], at=current[0],
                       group=current[6], gat=current[7])
        out["groups"] = dict(self.groups)
        if waiting:
            out.update(state="waiting", waited_s=round(time.time() - waiting[1], 3))
        return out


_GROUP_IDS: dict[int, str] = {}


def group_id(group) -> str:
    """A process group's name that every member computes alike: its global ranks, or ``"world"``."""
    if group is None:
        return "world"
    gid = _GROUP_IDS.get(id(group))
    if gid is None:
        import torch.distributed as dist

        try:
            ranks = dist.get_process_group_ranks(group)
            gid = "world" if ranks == list(range(dist.get_world_size())) else ",".join(map(str, ranks))
        except Exception:  # noqa: BLE001 - not a registered group (a test double): named by nothing shared
            gid = f"local{id(group)}"
        _GROUP_IDS[id(group)] = gid
    return gid


RECORD = CollectiveRecord()


def describe_position(value: dict) -> str:
    """``allreduce #38 'grad.bucket0' [[4096]]``: the collective a heartbeat says its rank is at."""
    if not value.get("op"):
        return "no collective yet"
    name = f" {value['name']!r}" if value.get("name") else ""
    shapes = f" {value['shapes']}" if value.get("shapes") else ""
    return f"{value['op']} #{value.get('at', value.get('seq'))}{name}{shapes}"


def peer_positions(ranks) -> dict[int, str]:
    """Where the other ``ranks`` are, by their last heartbeat: ``{0: "waiting in allreduce #9 'dp.bucket0'"}``.

    Empty when this process publishes no heartbeat (not under ``phalanx run``), or for ranks whose
    heartbeat is not in the store (an elastic worker publishes under its worker id).
    """
    if _started is None:
        return {}
    out = {}
    for rank in ranks:
        with contextlib.suppress(Exception):  # a torn value or a closing store: say nothing of that rank
            key = heartbeat_key(rank)
            if _started.store.check([key]):
                value = json.loads(_started.store.get(key))
                where = describe_position(value)
                out[rank] = f"waiting in {where}" if value.get("state") == "waiting" else f"running, last at {where}"
    return out


class Heartbeat:
    """A daemon thread that writes ``RECORD``'s snapshot to ``store`` every ``interval_s`` seconds."""

    def __init__(self, store, rank: int, interval_s: float = 1.0, record: CollectiveRecord = RECORD,
                 ident: int | str | None = None) -> None:
        self.store, self.rank, self.interval_s, self.record = store, rank, interval_s, record
        self.key = heartbeat_key(rank if ident is None else ident)
        self.beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="phalanx-heartbeat", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> Heartbeat:
        self.publish()
        self._thread.start()
        return self

    def publish(self, state: str | None = None) -> None:
        with self._lock:
            self.beat += 1
            value = {"rank": self.rank, "pid": os.getpid(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                     "beat": self.beat, "time": time.time(), **self.record.snapshot()}
            if state:
                value["state"] = state
            self.store.set(self.key, json.dumps(value))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending; stop quietly
                return

    def stop(self, state: str | None = None) -> None:
        if state is None:  # at exit: an uncaught exception leaves sys.last_value behind (PyErr_Print)
            state = "failed" if getattr(sys, "last_value", None) is not None else "exited"
        self._stop.set()
        with contextlib.suppress(Exception):
            self.publish(state)


_started: Heartbeat | None = None


def start_from_env(rank: int, env=None) -> Heartbeat | None:
    """Start the heartbeat (and the SIGUSR2 stack dump) when the launcher asked for it; once per process."""
    global _started
    stack_dir = RuntimeSettings.one("stack_dir", env)
    if stack_dir and hasattr(signal, "SIGUSR2"):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            stacks = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - kept for faulthandler
            faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    interval, address = RuntimeSettings.one("heartbeat_s", env), RuntimeSettings.one("heartbeat_store", env)
    if not interval or not address or _started is not None:
        return _started
    import torch.distributed as dist

    try:
        host, _, port = address.rpartition(":")
        # a client of its own: the process group's store connection is not shared with this thread
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=datetime.timedelta(seconds=5),
                              wait_for_workers=False)
        # an elastic worker keeps its id (PHALANX_ELASTIC_WID) across re-forms; its rank may change
        _started = Heartbeat(store, rank, float(interval), ident=ElasticSettings.one("worker_id", env)).start()
    except Exception as err:  # noqa: BLE001 - a job without a reachable store runs without a heartbeat
        from phalanx.log import get_logger

        get_logger(__name__).debug("no heartbeat: %s", err)
        return None
    atexit.register(_started.stop)
    return _started
