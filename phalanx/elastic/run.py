"""``phalanx.elastic.run(train_fn)(state)``: Horovod's elastic retry loop on TorchElastic's restarts.

Horovod's loop (``horovod/common/elastic.py``) catches a peer failure inside
the surviving processes, re-forms the ring and retries from the last commit.
Under TorchElastic the agent does the re-forming: when any worker exits, it
stops the rest and starts a new worker group (up to ``--max-restarts`` times,
with ``--min-np``..``--max-np`` workers). So the loop is split in two::

    agent:   start group ─ worker dies ─ stop group ─ re-rendezvous ─ start group (restart 1) …
    worker:  run(train_fn)(state):  restore() last commit (snapshot) → sync() → train_fn(state)
                                    on a collective error: log where, exit non-zero → agent restarts

Inside one process the loop still retries on :class:`HostsUpdatedInterrupt`
(raised by a user at a commit to re-sync a changed state) after rolling back to
the last commit. Under ``--host-discovery-script`` a commit may raise
:class:`~phalanx.elastic.discovery.ResizeRequested`: the workers then exit 0 and
the launcher starts a group of the new size from that commit (see discovery.py).

Example::

    @phalanx.elastic.run
    def train(state):
        for state.step in range(state.step, 100):
            ...
            if state.step % 10 == 0:
                state.commit()

    train(TorchState(model, opt, sampler=sampler, step=0))
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from phalanx.elastic.discovery import ResizeRequested
from phalanx.elastic.state import State
from phalanx.log import get_logger

__all__ = ["run", "HostsUpdatedInterrupt", "restart_count"]

log = get_logger(__name__)


class HostsUpdatedInterrupt(RuntimeError):
    """Raise inside ``train_fn`` to roll back to the last commit and re-sync (e.g. the host set changed)."""


def restart_count() -> int:
    """How many times TorchElastic has restarted this worker group (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``func(state, *args)`` so it resumes from the last commit after a restart."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"phalanx.elastic.run: state must have commit/restore/sync, got {type(state).__name__}")
        started = time.monotonic()
        if state.restore():
            log.warning("restart %d: resumed from the last commit after %.2fs", restart_count(),
                        time.monotonic() - started)
        state.sync()
        while True:
            try:
                return func(state, *args, **kwargs)
            except ResizeRequested as req:
                # The launcher restarts the group at the new size; it resumes from this very commit.
                log.warning("%s: the commit is saved; ending this worker group", req)
                _exit_for_resize()
            except HostsUpdatedInterrupt:
                log.warning("hosts updated: rolling back to the last commit and re-syncing")
                state.restore()
                state.sync()
            except Exception as err:
                # A dead peer breaks this process group; the agent will restart everyone, and the
                # restarted group resumes from the last commit. Say so, then let the error end us.
                log.error("training failed (%s: %s); exiting so the agent restarts the group "
                          "from the last commit", type(err).__name__, err)
                raise

    return wrapper


def _exit_for_resize() -> None:
    """End this worker with status 0 right here: run the exit hooks (async checkpoint writer,
    timeline, runtime shutdown) as a normal exit would, then ``os._exit``. Unwinding a
    ``SystemExit`` through the training frames instead lets interpreter teardown destroy c10d
    objects in arbitrary order, which sometimes aborted ("terminate called without an active
    exception", exit 134) and made the agent restart the group at the old size."""
    from phalanx import runtime

    atexit._run_exitfuncs()
    if runtime.is_initialized():
        runtime.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
