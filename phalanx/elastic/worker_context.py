"""One in-process elastic worker's context: its own client of the launcher's store, the generation it
is in, and the launcher's keys it reads (see :mod:`phalanx.elastic.inprocess` for the protocol).

The context is made once per process, at its first use in a worker that the elastic launcher
started (:func:`current`), and lives as long as the process: generations change its fields, not it.

Example::

    from phalanx.elastic import worker_context
    ctx = worker_context.current()
    if worker_context.latest() > ctx.gen:   # the launcher published a newer generation
        ...
"""

from __future__ import annotations

import datetime
import json
import threading

import torch
import torch.distributed as dist

from phalanx.elastic import lost, pending, staging
from phalanx.settings import ElasticSettings, RuntimeSettings

__all__ = ["Context", "current", "existing", "forget", "collective_timeout_s", "reform_timeout_s", "form_timeout_s",
           "get", "latest", "stop_reason", "notices"]


class Context:
    """What a worker holds across generations (the re-forming code changes its fields)."""

    def __init__(self) -> None:
        job = ElasticSettings.read()
        host, _, port = job.store.rpartition(":")
        self.timeout_s = collective_timeout_s()  # re-forming waits this + 30 s (a blocked peer times out)
        self.store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        self.wid = job.worker_id
        self.gen = job.generation
        self.members: list[list[str]] = []
        self.notice = 0  # the launcher's host-change notices this worker's generation covers (pxe/notice)
        self.store_port = int(port)
        self.group_sockets: set[str] = set()  # inodes of the current process group's connections
        self.lock = threading.Lock()  # generation and its connections change together (lost.LostWatcher)
        self.watcher: lost.LostWatcher | None = None
        self.vote: tuple[object, torch.Tensor] | None = None  # a deferred commit vote in flight (work, flag)
        self.skip = 0  # deferred commits left before the next vote (the last vote's agreed count)
        self.pending: pending.PendingPoll | None = None  # rank 0's background view of the launcher's changes
        self.admission = staging.Admission()  # generations formed in the background (a live state's)
        self.handover: tuple[int, range] | None = None  # (generation, its newcomers): this one was staged


_current: Context | None = None


def current() -> Context:
    """This process's context, made at the first call."""
    global _current
    if _current is None:
        _current = Context()
    return _current


def existing() -> Context | None:
    """This process's context if one was made, else None (nothing is made)."""
    return _current


def forget() -> None:
    """Drop this process's context (a test that plays several workers' parts in one process)."""
    global _current
    _current = None


def collective_timeout_s() -> float:
    return RuntimeSettings.one("timeout_s")  # before init(): PHALANX_TIMEOUT checked as init() checks it


def reform_timeout_s(collective_s: float) -> float:
    """How long a worker waits to re-form: long enough for a peer blocked in a collective to time out."""
    return ElasticSettings.one("reform_timeout_s") or collective_s + 30


def form_timeout_s() -> float:
    """How long making one generation's process group may take once every member checked in."""
    return ElasticSettings.one("form_timeout_s")


def get(key: str) -> bytes | None:
    """The launcher's value under ``key``, or None (one check, one get)."""
    store = current().store
    return store.get(key) if store.check([key]) else None


def latest() -> int:
    """The newest generation the launcher has published."""
    raw = get("pxe/latest")
    return int(raw) if raw else 0


def stop_reason() -> dict | None:
    """Why the launcher stopped the job, once it has."""
    raw = get("pxe/stop")
    return json.loads(raw) if raw else None


def notices() -> int:
    """The host-change notices the launcher has posted."""
    return int(current().store.add("pxe/notice", 0))
