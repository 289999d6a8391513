"""``phalanx.elastic.run(train_fn)(state)``: Horovod's elastic retry loop.

Two recovery paths; the log says which one ran ("path: in-process" / "path: group restart"):

* **in-process** (``phalanx run --min-np/--max-np`` or ``--host-discovery-script``): the
  launcher starts every worker itself (:mod:`phalanx.elastic.supervisor`). When one dies,
  the survivors' next collective raises; this loop catches it, leaves the broken group,
  re-forms with the others on the launcher's store (:mod:`phalanx.elastic.inprocess`),
  rolls back to the last commit from memory, ``sync()`` s and calls ``train_fn`` again —
  same processes, no torch re-import. Workers the launcher adds (a replacement, a new
  host) are admitted when ``commit()`` raises ``HostsUpdatedInterrupt`` (a ``MembershipChanged``,
  phalanx.elastic.interrupts); they get the state
  from rank 0 in ``sync()``::

      worker:  restore() → sync() → train_fn(state) … collective error (peer died) →
               re-form (new rank/size) → restore() the commit in memory → sync() → train_fn(state) …

* **group restart** (``phalanx run --max-restarts N`` alone, and the fallback when a
  worker cannot re-form in-process): TorchElastic's agent stops every worker and starts a
  new group; ``restore()`` loads the last commit's snapshot and training resumes there.

A :class:`HostsUpdatedInterrupt` raised by the user (not by a commit) only rolls back to the last
commit and re-syncs, in one process, without re-forming.

Example::

    @phalanx.elastic.run
    def train(state):
        for state.step in range(state.step, 100):
            ...                          # read px.rank()/px.size() here: they change at a re-form
            if state.step % 10 == 0:
                state.commit()

    train(TorchState(model, opt, sampler=sampler, step=0))
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from phalanx import runtime
from phalanx.elastic import inprocess, lost, preempt
from phalanx.elastic.interrupts import HostsUpdatedInterrupt
from phalanx.elastic.state import State, TorchState
from phalanx.log import get_logger

__all__ = ["run", "HostsUpdatedInterrupt", "restart_count"]

log = get_logger(__name__)
_LOST = "recovering from a lost worker"


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
        inprocess.prepare()
        # SIGTERM / --preempt-signal: the members agree at a commit, save it, exit 85. Only under the
        # in-process supervisor, which forwards a preemption and kills what it stops itself: under
        # TorchElastic's group restart the agent's SIGTERM must end a worker blocked in a collective on
        # a dead peer at once (a caught SIGTERM waits there until the agent's SIGKILL 30 s later)
        if inprocess.active():
            preempt.start()
        try:
            return _run(func, state, started, args, kwargs)
        finally:
            preempt.stop()

    return wrapper


def _run(func: Callable[..., Any], state: State, started: float, args, kwargs) -> Any:
    """Resume (join, or restore the last commit), then run ``func`` until it returns, re-forming on the way."""
    if inprocess.is_joiner():
        # started mid-run by the launcher: wait for the generation that admits us (at a commit);
        # the state comes from rank 0 in sync() (the members restore from their memory, no I/O)
        _reform_or_fall_back(inprocess.join)
    elif state.restore():
        log.warning("restart %d: resumed from the last commit after %.2fs (path: group restart)",
                    restart_count(), time.monotonic() - started)
    state.sync()
    while True:
        reform = None
        try:
            result = func(state, *args, **kwargs)
            if isinstance(state, TorchState):
                state.finish()  # its background snapshot in flight (recover="live"), complete before the exit
            return result
        except inprocess.MembershipChanged as err:  # (HostsUpdatedInterrupt is one)
            if err.reform:  # raised by a commit: the launcher admitted or removed workers; all re-form here
                reform = "workers joining or leaving at a commit"
            else:  # a HostsUpdatedInterrupt the user raised
                log.warning("hosts updated: rolling back to the last commit and re-syncing")
                state.restore()
                state.sync()
        except Exception as err:
            if not (inprocess.active() and lost.is_collective_error(err)):
                if inprocess.active():
                    # In-process: this worker is lost. Cut its connections now, so the others
                    # fail at once and re-form while this process prints and exits.
                    inprocess.abandon()
                    log.error("training failed (%s: %s); this worker exits, the others re-form "
                              "in-process", type(err).__name__, err)
                    runtime.skip_teardown_if_uncaught()  # exit 1 with the traceback, not a teardown abort
                    raise
                # Under TorchElastic a dead peer breaks this process group; the agent restarts
                # everyone from the last commit. Say so, then let the error end us.
                log.error("training failed (%s: %s); exiting so the agent restarts the group "
                          "from the last commit", type(err).__name__, err)
                raise
            log.warning("collective failed (%s: %s): a peer is gone; the survivors re-form in-process "
                        "(path: in-process, this process keeps running)", type(err).__name__,
                        str(err).splitlines()[0][:160])
            reform = _LOST
        if reform is not None and state.sharded():
            # ZeRO's shards and bucket plan belong to the old world, and a lost rank's shard is only on
            # disk: the whole group restarts from the last commit (saved before MembershipChanged)
            log.error("%s: this state holds sharded pieces (%s: ZeRO), which cannot re-form in-process; "
                      "exiting with status %d so the launcher restarts the group from the last commit "
                      "(path: group restart)", reform, ", ".join(state.sharded()), inprocess.REFORM_FAILED_EXIT)
            inprocess.exit_now(inprocess.REFORM_FAILED_EXIT)
        if reform is not None:
            # Outside the except block: the traceback (and the failed collective's work objects,
            # which keep the broken group's sockets open) is gone, so leaving the group closes
            # them at once and peers still blocked on us fail fast instead of timing out. Workers
            # admitted at a commit left no failed collective behind: no collection (a full one
            # costs 0.5 s in a process that imported torch._dynamo, measured on cpu2 under load),
            # the members' pause is the re-form and the sync only.
            paused = time.monotonic()
            preempt.reformed(leaving=True)
            if reform == _LOST:
                gc.collect()
            _reform_or_fall_back(functools.partial(inprocess.reform, reform))
            synced = _roll_back(state)
            log.warning("%s: training resumed %.3fs after it stopped (sync %.3fs)", reform,
                        time.monotonic() - paused, synced)


def _roll_back(state: State) -> float:
    """After re-forming in-process: the last commit (this process's memory), synced from the new rank 0.
    Returns the seconds it took."""
    started = time.monotonic()
    if not state.restore():
        log.warning("no commit to roll back to: continuing from rank 0's current state")
    state.sync()
    return time.monotonic() - started


def _reform_or_fall_back(reform: Callable[[], float]) -> None:
    """Re-form, or end this worker with REFORM_FAILED_EXIT so the launcher restarts the whole group."""
    try:
        reform()
        _rederive_strategies()
        preempt.reformed()
    except Exception as err:  # noqa: BLE001 - any failure to re-form hands over to the restart path
        log.error("could not re-form in-process (%s: %s); exiting with status %d so the launcher restarts "
                  "the group from the last commit (path: group restart)", type(err).__name__, err,
                  inprocess.REFORM_FAILED_EXIT)
        inprocess.exit_now(inprocess.REFORM_FAILED_EXIT)


def _rederive_strategies() -> None:
    """The world changed: every DataParallel / DistributedOptimizer re-derives its collectives
    (bucket layout, world size, join announcement) so old ranks and newcomers issue the same ones."""
    from phalanx.parallel.data.gradients import reform_engines

    count = reform_engines(runtime.topology())
    if count:
        log.info("re-derived %d gradient engine(s) for a world of %d", count, runtime.size())
