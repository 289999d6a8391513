"""Timeline: every rank's spans on one time axis, as Chrome-trace / Perfetto JSON.

Like Horovod's Timeline: open the file in ``chrome://tracing`` or
https://ui.perfetto.dev and each rank is one process row (``pid`` = rank), with
forward, backward, each bucket's compress / allreduce / wait / decompress, the
optimizer step and data loading as spans.

Clock alignment. ``start()`` is collective: every rank leaves a barrier and
reads ``time.perf_counter()``; the readings are all-gathered. Ranks on the same
host as rank 0 share its monotonic clock (Linux CLOCK_MONOTONIC is system wide),
so they use rank 0's reading as time zero exactly; ranks on other hosts use
their own barrier-exit reading, which is off by at most the barrier's skew
(tens of microseconds on a LAN)::

    rank 0  ──barrier──┤t0   spans ...           ts = t - t0
    rank 1  ──barrier──┤t1   spans ...           ts = t - (t0 if same host else t1)

Example::

    from phalanx.profiler import timeline
    timeline.start()                    # collective; installs the recorder
    ... train ...
    timeline.stop("trace.json")         # collective; rank 0 writes every rank's events

``phalanx run --timeline trace.json python train.py`` does the same without code:
``phalanx.init()`` starts the recorder, each rank writes ``trace.json.rank<N>``
when it exits, and the launcher merges the parts into ``trace.json``.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import socket
import threading
import time
from typing import Any

from phalanx import trace
from phalanx.log import get_logger
from phalanx.settings import LauncherSettings, var

__all__ = ["Timeline", "start", "stop", "start_timeline", "stop_timeline", "active", "merge_parts", "load", "ENV"]

ENV = var("launcher.timeline")
"""Environment variable ``phalanx run --timeline FILE`` sets; ``phalanx.init()`` reads it."""

_log = get_logger(__name__)


class Timeline:
    """A :mod:`phalanx.trace` recorder that keeps spans in memory (a list append per span).

    Example::

        tl = Timeline(rank=0)
        tl.install()
        with trace.span("forward", "compute"):
            ...
        events = tl.uninstall()           # Chrome-trace "X" events, ts/dur in microseconds
    """

    def __init__(self, rank: int = 0, zero_s: float | None = None, host: str | None = None) -> None:
        self.rank = rank
        self.zero_s = time.perf_counter() if zero_s is None else zero_s
        self.host = host or socket.gethostname()
        self._spans: list[tuple[str, str, float, float, int, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def record(self, name: str, cat: str, start_s: float, end_s: float, args: dict[str, Any]) -> None:
        span = (name, cat, start_s, end_s, threading.get_ident(), args)
        with self._lock:
            self._spans.append(span)

    def install(self) -> Timeline:
        """Become the trace recorder, and time every ``torch.optim`` step (global optimizer hooks)."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        trace.set_recorder(self)
        started: dict[int, float] = {}

        def pre(opt, args, kwargs) -> None:
            started[id(opt)] = time.perf_counter()

        def post(opt, args, kwargs) -> None:
            t0 = started.pop(id(opt), None)
            if t0 is not None:
                self.record("optimizer", "compute", t0, time.perf_counter(), {"optimizer": type(opt).__name__})

        self._optim_hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        return self

    def uninstall(self) -> list[dict[str, Any]]:
        if trace.get_recorder() is self:
            trace.set_recorder(None)
        for h in getattr(self, "_optim_hooks", ()):
            h.remove()
        self._optim_hooks = []
        return self.events()

    def events(self) -> list[dict[str, Any]]:
        """This rank's spans as Chrome-trace complete ("X") events plus its process name."""
        with self._lock:
            spans = list(self._spans)
        threads: dict[int, int] = {}
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"name": f"rank {self.rank} ({self.host})"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
             "args": {"sort_index": self.rank}},
        ]
        for name, cat, start, end, ident, args in spans:
            tid = threads.setdefault(ident, len(threads))
            out.append({
                "name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                "ts": (start - self.zero_s) * 1e6, "dur": max(0.0, end - start) * 1e6,
                "args": _jsonable(args),
            })
        return out


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)) for k, v in args.items()}


def _aligned_zero(group=None) -> tuple[float, int, str]:
    """Barrier, then agree on time zero (see the module docstring). Collective."""
    from phalanx.comm import collectives as C

    host = socket.gethostname()
    C.barrier(group)
    now = time.perf_counter()
    every = C.allgather_object((now, host), group=group)
    rank0_now, rank0_host = every[0]
    zero = rank0_now if rank0_host == host else now
    return zero, C.group_rank(group), host


_active: Timeline | None = None
_part_path: str | None = None


def active() -> Timeline | None:
    """The running timeline, if any."""
    return _active


def start(group=None) -> Timeline:
    """Start recording on every rank (collective; aligns clocks). Idempotent."""
    global _active
    if _active is not None:
        return _active
    zero, rank, host = _aligned_zero(group)
    _active = Timeline(rank=rank, zero_s=zero, host=host).install()
    return _active


def stop(path: str | None = None, group=None) -> list[dict[str, Any]]:
    """Stop recording on every rank (collective) and return all ranks' events.

    With ``path``, rank 0 writes the merged Chrome-trace JSON there.
    """
    global _active
    if _active is None:
        raise RuntimeError("timeline.stop(): no timeline is running; call timeline.start() first")
    from phalanx.comm import collectives as C

    mine = _active.uninstall()
    _active = None
    every = [e for part in C.allgather_object(mine, group=group) for e in part]
    if path is not None and C.group_rank(group) == 0:
        _write(path, every)
    return every


_api_path: str | None = None


def start_timeline(path: str, group=None) -> Timeline:
    """Horovod's spelling: start recording (collective); :func:`stop_timeline` writes ``path``."""
    global _api_path
    _api_path = path
    return start(group)


def stop_timeline(group=None) -> list[dict[str, Any]]:
    """Stop the timeline begun by :func:`start_timeline` (collective); rank 0 writes its file."""
    global _api_path
    path, _api_path = _api_path, None
    return stop(path, group)


def _write(path: str, events: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def load(path: str) -> list[dict[str, Any]]:
    """The events of a timeline file (either the object or the bare-array form)."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def start_from_env(rank: int) -> None:
    """Called by ``phalanx.init()`` when PHALANX_TIMELINE is set: start, and save a part at exit."""
    global _part_path
    path = LauncherSettings.one("timeline")
    if not path or _active is not None:
        return
    start()
    _part_path = f"{path}.rank{rank}"
    atexit.register(_save_part)


def _save_part() -> None:
    # At exit the peers may be gone, so no collective here: each rank writes its own
    # part (already on the common axis) and the launcher merges them.
    global _active
    if _active is None or _part_path is None:
        return
    events = _active.uninstall()
    _active = None
    _write(_part_path, events)
    # Leave the job cleanly: exiting with the gloo group alive after the start-up
    # allgather_object sometimes aborts ("terminate called without an active exception").
    from phalanx import runtime

    runtime.shutdown()


def merge_parts(path: str, remove: bool = True) -> int:
    """Merge ``PATH.rank*`` parts into ``PATH``; returns the number of parts found."""
    parts = sorted(glob.glob(glob.escape(path) + ".rank*"))
    events: list[dict[str, Any]] = []
    for part in parts:
        events.extend(load(part))
    if parts:
        _write(path, events)
        if remove:
            for part in parts:
                os.remove(part)
    else:
        _log.warning("timeline: no parts %s.rank* found; did the workers call phalanx.init()?", path)
    return len(parts)
