"""Trace hook: the lowest layer's way to report spans to the profiler, free when off.

Low layers (comm, strategies) call ``span("allreduce", "comm", bucket=3)``; it does
nothing unless a service above (``phalanx.profiler``) has installed a recorder with
``set_recorder``. This keeps arrows pointing down: comm never imports the profiler.

Example::

    from phalanx import trace
    with trace.span("forward", "compute"):
        out = model(x)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

__all__ = ["Recorder", "set_recorder", "get_recorder", "span", "instant", "enabled"]


class Recorder(Protocol):
    def record(self, name: str, cat: str, start_s: float, end_s: float, args: dict[str, Any]) -> None: ...


_recorder: Recorder | None = None


def set_recorder(recorder: Recorder | None) -> None:
    """Install (or remove, with None) the process-wide span recorder."""
    global _recorder
    _recorder = recorder


def get_recorder() -> Recorder | None:
    return _recorder


def enabled() -> bool:
    return _recorder is not None


@contextlib.contextmanager
def _recording(name: str, cat: str, args: dict[str, Any]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        rec = _recorder
        if rec is not None:
            rec.record(name, cat, start, time.perf_counter(), args)


_NULL = contextlib.nullcontext()


def span(name: str, cat: str, **args: Any):
    """A context manager timing a span; a shared no-op object when tracing is off."""
    if _recorder is None:
        return _NULL
    return _recording(name, cat, args)


def instant(name: str, cat: str, start_s: float, end_s: float, **args: Any) -> None:
    """Record a span whose times were measured by the caller (e.g. async collective completion)."""
    rec = _recorder
    if rec is not None:
        rec.record(name, cat, start_s, end_s, args)


Callback = Callable[..., None]
