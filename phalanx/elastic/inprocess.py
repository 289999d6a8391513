"""In-process re-forming of an elastic job (Horovod's model): survivors keep running after a worker dies.

Under ``phalanx run --min-np/--max-np`` (or ``--host-discovery-script``) the launcher
starts every worker itself (see :mod:`phalanx.elastic.supervisor`), hosts a TCPStore
and publishes *generations*: who is in the job and in which order. A worker keeps its
process across generations::

    launcher: worker w2 died ─ publish gen 1 = [w0, w1, w3]          (store: pxe/gen/1, pxe/latest=1)
    w0,w1,w3: collective raises (peer's socket closed) ─ leave the group ─ wait for gen > 0 ─
              check in (pxe/g1/arrived) ─ all 3 arrived ─ new gloo group on PrefixStore("pxe/g1/pg")
              ─ ranks 0,1,2 ─ restore() the commit in memory ─ sync() ─ train_fn again

    launcher: new worker w4 ready (pxe/ready/w4) ─ publish gen 2 = [w0, w1, w3, w4]
    workers:  state.commit() ─ rank 0 reads pxe/latest (one store get), allreduce(MAX) ─ 2 > 1 ─
              every rank re-forms as above, w4 included; w4 receives the state in sync()

    launcher: discovery adds a host ─ start w5, w6 there ─ post a host-change notice (pxe/notice)
    workers:  a phalanx.horovod.elastic state's commit() raises at once (Horovod's meaning) and waits
              in the re-form for the generation admitting w5, w6; phalanx.elastic's trains on until
              that generation is published (once w5, w6 are ready), as above

A worker missing from a new generation (the launcher shrinks the job) leaves with exit
status 0. Every wait is bounded (``PHALANX_ELASTIC_REFORM_TIMEOUT``, default the collective
timeout): a worker that cannot re-form exits with :data:`REFORM_FAILED_EXIT`, and the
launcher falls back to restarting the whole group on TorchElastic from the last snapshot.

Example (what ``phalanx.elastic.run`` does; scripts do not call this module)::

    from phalanx.elastic import inprocess
    if inprocess.active():
        inprocess.reform("a peer died")       # now in the next generation, maybe another rank/size
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

import torch.distributed as dist

from phalanx.elastic import lost, staging
from phalanx.elastic import worker_context as wctx
from phalanx.elastic.interrupts import (
    HostsUpdatedInterrupt,
    MembershipChanged,
)
from phalanx.log import get_logger
from phalanx.settings import ElasticSettings, var

__all__ = ["active", "admitting", "handover", "abandon", "exit_now", "prepare", "is_joiner", "generation", "latest_generation", "members_of", "reform", "join", "host_updates",
           "MembershipChanged", "HostsUpdatedInterrupt", "ReformFailed", "keep_current_connections", "REFORM_FAILED_EXIT", "STORE_ENV", "WID_ENV", "JOIN_ENV"]

log = get_logger(__name__)

# the variables the supervisor writes for its workers (phalanx.settings.ElasticSettings says what each holds)
STORE_ENV, WID_ENV, JOIN_ENV, GEN_ENV = (var(f"elastic.{name}") for name in ("store", "worker_id", "join", "generation"))
REFORM_FAILED_EXIT = 75  # "could not re-form in-process": the launcher falls back to a group restart
_POLL_S = 0.01


class ReformFailed(RuntimeError):
    """This worker could not join a new generation in time."""


def active() -> bool:
    """True in a worker started by the in-process elastic launcher."""
    return bool(ElasticSettings.one("store") and ElasticSettings.one("worker_id"))


def is_joiner() -> bool:
    """True in a worker started mid-run that has not joined a generation yet."""
    return active() and ElasticSettings.one("join") and ((ctx := wctx.existing()) is None or not ctx.members)


def admitting() -> int | None:
    """The generation whose group this member is forming in the background while it trains (workers
    added to a ``recover="live"`` job, :mod:`phalanx.elastic.staging`), else None."""
    forming = wctx.current().admission.staging if active() else None
    return forming.gen if forming is not None else None


def handover() -> tuple[int, range] | None:
    """After a staged admission (:mod:`phalanx.elastic.staging`): ``(generation, newcomers)``, the ranks
    that joined it with no state (every rank before them is a member that holds it), which a live state's
    ``sync()`` hands the state to (:mod:`phalanx.elastic.handover`). None after any other re-form."""
    return wctx.current().handover if active() else None


def generation() -> int:
    """The generation this worker is in (0 at the start, and outside an in-process elastic job)."""
    return wctx.current().gen if active() else 0


def latest_generation() -> int:
    """The newest generation the launcher has published (> :func:`generation` while a change is
    pending: this worker's next commit re-forms). 0 outside an in-process elastic job."""
    return wctx.latest() if active() else 0


def members_of(gen: int) -> list[str]:
    """The worker ids of generation ``gen`` in rank order, as the launcher published it."""
    return [m[0] for m in json.loads(wctx.current().store.get(f"pxe/gen/{gen}"))["members"]]


def host_updates(since: int = 0) -> list[tuple[int, float, int]]:
    """The host changes the launcher announced after notice ``since`` that this worker's generation
    does not cover yet: ``(notice, unix time, update)``, update as Horovod's ``HostUpdateResult``
    (1 removed, 2 added, 3 both). One store read when there are none. Empty outside an in-process job.

    The launcher posts a notice as soon as it acts on a change (workers started on a host discovery
    added, or a generation published); the generation that admits or drops the workers covers it.
    """
    if not active() or is_joiner():
        return []
    ctx = wctx.current()
    out = []
    for n in range(max(since, ctx.notice) + 1, wctx.notices() + 1):
        body = json.loads(ctx.store.get(f"pxe/notice/{n}"))
        out.append((n, float(body["t"]), int(body["update"])))
    return out


def keep_current_connections() -> int:
    """Before ``px.init()`` in a process that has connections of its own (a Ray actor's links to
    its cluster): mark them as not the process group's, so a re-form never shuts them down."""
    return lost.keep(lost.group_sockets(-1))


def _shut_group_sockets(ctx: wctx.Context, only_gen: int | None = None) -> int | None:
    """Shut down the broken group's TCP connections (not close: gloo still owns the fds).

    A peer blocked in a collective on this group then sees the connection end and raises
    at once, instead of waiting out the collective timeout: destroying the group does not
    close them while anything (a pending work object) still references it. ``only_gen``:
    only while the worker is still in that generation with connections to shut (None otherwise).
    """
    with ctx.lock:
        if only_gen is not None and (ctx.gen != only_gen or not ctx.group_sockets):
            return None
        count = lost.shut(ctx.group_sockets)
        ctx.group_sockets = set()
    return count


def _interrupt(gen: int, gone: str) -> None:
    """The watcher saw members of generation ``gen`` lost: end this worker's collective of ``gen`` now."""
    count = _shut_group_sockets(wctx.current(), only_gen=gen)
    if count is None:
        return  # already re-forming or re-formed: the new group is not touched
    log.warning("%s of generation %d lost: shut this worker's %d connection(s) so its collective ends now",
                gone, gen, count)


def abandon() -> int:
    """This worker is lost (its training raised): shut its group connections so the peers'
    collectives fail now, not when this process has finished exiting. Returns how many."""
    ctx = wctx.current()
    with contextlib.suppress(Exception):  # the survivors' watchers end their waits on this at once
        lost.announce(ctx.store, ctx.wid)
    if not ctx.group_sockets:
        ctx.group_sockets = lost.group_sockets(ctx.store_port)
    return _shut_group_sockets(ctx)


def prepare() -> None:
    """At the start of ``elastic.run``: connect to the launcher's store and note which TCP
    connections belong to the process group ``px.init()`` made (to shut them at a failure)."""
    if active():
        ctx = wctx.current()
        if not ctx.members:
            ctx.group_sockets = lost.group_sockets(ctx.store_port)
        if ctx.watcher is None:
            host, _, port = ElasticSettings.one("store").rpartition(":")
            ctx.watcher = lost.LostWatcher(host.strip("[]"), int(port), lambda: (
                -1 if is_joiner() else ctx.gen, ctx.wid), _interrupt).start()


def _leave_group(free_later: bool = False) -> None:
    """Drop this process's part in the broken group (runtime's topology and the default process group).
    ``free_later`` (a healthy group left for a staged one): its gloo backend is destroyed by a thread of
    its own (closing its connections and joining its threads took 10-40 ms at np 4 on cpu2; c10d's
    destructors run without the GIL), not on the members' path."""
    from phalanx import runtime

    old = [dist.group.WORLD] if free_later and dist.is_initialized() else []
    ctx = wctx.current()
    ctx.vote, ctx.skip = None, 0  # a deferred commit vote of the broken group: never waited for
    if ctx.pending is not None:  # the skip it proposed was not made: no commit rate from it
        ctx.pending.forget_rate()
    shut = _shut_group_sockets(ctx)
    log.info("shut down %d connections of the old group", shut)

    if runtime.is_initialized():
        runtime.shutdown()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - a broken group may complain while it is torn down
            log.info("destroying the broken process group: %s", err)
    if old:
        threading.Thread(target=old.clear, name="phalanx-elastic-old-group", daemon=True).start()


def exit_now(code: int) -> None:
    """End the worker here with ``code`` after the normal exit hooks.

    Unwinding a ``SystemExit`` through the training frames instead lets interpreter teardown
    destroy c10d objects in arbitrary order, which sometimes aborts ("terminate called without
    an active exception")."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_stop() -> None:
    stop = wctx.stop_reason()
    if stop is None:
        return
    if stop.get("abort"):
        # the launcher printed the reason once; each worker repeating it would bury it
        print("phalanx: the launcher stopped the job (its reason is in phalanx run's output); exiting",
              file=sys.stderr, flush=True)
        exit_now(1)
    exit_now(0)  # the job finished while this worker waited to join


def reform(reason: str, *, joining: bool = False) -> float:
    """Leave the current group and join the next generation the launcher publishes.

    One round per generation g: check in (``pxe/g<g>/ack/<wid>``, counted in ``pxe/g<g>/arrived``),
    wait until every member of g has, then make g's process group. A newer generation
    published meanwhile (a member died while g formed) abandons the round for the newer one;
    so does a process group that could not be made (a member died after checking in).
    Returns the seconds it took. A worker left out of the new generation exits 0 (the job
    shrank); one that cannot join within the timeout raises :class:`ReformFailed` naming the
    generation and the workers that did not check in.
    """
    from phalanx import runtime

    ctx = wctx.current()
    started = time.monotonic()
    wait_s = wctx.reform_timeout_s(ctx.timeout_s)
    if joining:  # admitted at the members' next commit, however far away: Horovod's --elastic-timeout
        wait_s = max(wait_s, ElasticSettings.one("join_timeout_s"))
    deadline = started + wait_s
    staged = ctx.admission.take()  # every member's background group is ready: adopt it
    _leave_group(free_later=staged is not None)
    left = time.monotonic()
    if staged is not None:
        body = json.loads(ctx.store.get(f"pxe/gen/{staged.gen}"))
        try:
            _join_group(ctx, staged.gen, body["members"], int(body.get("notice", 0)), staged=staged)
        except Exception as err:  # noqa: BLE001 - a newcomer died after connecting: the next generation
            log.warning("generation %d, formed in the background, failed at the switch (%s: %s); waiting for "
                        "the next one", staged.gen, type(err).__name__, str(err).splitlines()[0][:160] if str(err) else "")
            staged.drop()
            _leave_group()
        else:
            took = time.monotonic() - started
            log.warning("%s: generation %d formed in the background in %.3fs, switched to in %.3fs: rank %d of %d",
                        reason, staged.gen, staged.took_s or 0.0, took, runtime.rank(), runtime.size())
            return took
    if joining:
        ctx.store.set(f"pxe/ready/{ctx.wid}", b"1")
    # a generation staged once is never joined here: its check-ins and connection keys are spent
    seen = max(ctx.gen, ctx.admission.spent()) if not joining else -1
    missing: tuple[int, list[str]] | None = None
    while True:
        _check_stop()
        latest = wctx.latest()
        if latest > seen:
            body = json.loads(ctx.store.get(f"pxe/gen/{latest}"))
            members = body["members"]
            wids = [m[0] for m in members]
            if ctx.wid not in wids:
                if joining:
                    seen = latest  # admitted later
                    continue
                log.warning("generation %d leaves this worker (%s) out: the job shrank; exiting", latest, ctx.wid)
                ctx.store.set(f"pxe/left/{ctx.wid}", b"1")
                exit_now(0)
            if _all_checked_in(ctx, latest, wids, deadline):
                arrived = time.monotonic()
                try:
                    _join_group(ctx, latest, members, int(body.get("notice", 0)))
                except Exception as err:  # noqa: BLE001 - a member died while the group was made
                    log.warning("generation %d could not form (%s: %s); waiting for the next one", latest,
                                type(err).__name__, str(err).splitlines()[0][:160] if str(err) else "")
                    _leave_group()
                else:
                    took = time.monotonic() - started
                    log.warning("%s: generation %d formed in-process: rank %d of %d (%.3fs: leave %.3f, check-in "
                                "%.3f, group %.3f)", reason, latest, runtime.rank(), runtime.size(), took,
                                left - started, arrived - left, started + took - arrived)
                    return took
            else:
                missing = (latest, [w for w in wids if not ctx.store.check([f"pxe/g{latest}/ack/{w}"])])
            seen = latest
        if time.monotonic() > deadline:
            where = (f"generation {missing[0]} still misses {', '.join(missing[1])}" if missing else
                     f"the launcher published no generation after {ctx.gen}")
            raise ReformFailed(f"{ctx.wid} could not re-form within {wait_s:.0f}s ({reason}): {where}; "
                               "set PHALANX_ELASTIC_REFORM_TIMEOUT to wait longer")
        time.sleep(_POLL_S)


def _all_checked_in(ctx: wctx.Context, gen: int, wids: list[str], deadline: float) -> bool:
    """Check in to generation ``gen``; True once every member has (False: a newer one, or the deadline)."""
    def give_up() -> bool:
        _check_stop()
        return wctx.latest() > gen

    return staging.check_in(ctx.store, gen, ctx.wid, len(wids), deadline, give_up)


def join() -> float:
    """A worker started mid-run: wait (bounded) until a generation admits it, then join it."""
    return reform("joining the job", joining=True)


def _join_group(ctx: wctx.Context, gen: int, members: list[list[str]], notice: int = 0,
                staged: staging.Staging | None = None) -> None:
    """Become rank ``members.index(this worker)`` of generation ``gen``: its variables, its process group
    (``staged``: the one this member connected in the background), the runtime on it."""
    from phalanx import runtime

    rank = staging.take_rank(members, ctx.wid, gen)
    # (a member's staged group: its connections are known already; a /proc scan costs 5-10 ms at np 4)
    before = lost.group_sockets(ctx.store_port) if staged is None else set()
    holders = staged.holders if staged is not None else staging.holders_of(ctx.store, gen)
    staging.make_group(ctx.store, gen, rank, len(members), ctx.timeout_s, wctx.form_timeout_s(), staged)
    with ctx.lock:  # the lost-member watcher acts on one generation's connections only
        ctx.group_sockets = staged.sockets if staged is not None else lost.group_sockets(ctx.store_port) - before
        ctx.gen, ctx.members, ctx.notice = gen, members, notice
        ctx.handover = None if holders is None else (gen, range(holders, len(members)))
    os.environ.pop(JOIN_ENV, None)
    runtime.init(timeout=ctx.timeout_s)  # adopts the group just made
