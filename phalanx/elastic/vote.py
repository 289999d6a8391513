"""The commit's vote of an in-process elastic job: at a commit, every member learns at once whether the
launcher changed the job (a worker lost or added, a host change announced) and whether any rank got a
preemption signal, from one small allreduce MAX that rank 0 fills with what it read from the launcher's
store. A peer that died since the last step makes that allreduce fail on every rank at once, so the
commit never waits on a dead peer's timeout.

``recover="live"`` commits vote *deferred* (nothing on the critical path): the allreduce is started at
a commit and read at the next, about every 0.5 s of commits, and :func:`skips_vote` lets the commits
between two votes make no round at all. Workers only added are admitted while the members train
(:mod:`phalanx.elastic.staging`); any other change re-forms the group (:mod:`phalanx.elastic.inprocess`).

Example (what ``TorchState.commit()`` does; scripts do not call this module)::

    from phalanx.elastic import vote
    if not vote.skips_vote():
        changed, preempted = vote.commit_round(vote=0, deferred=True)
        if changed is not None:
            raise changed                 # every member raises at the same commit, then re-forms
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from phalanx.elastic import pending, staging
from phalanx.elastic import worker_context as wctx
from phalanx.elastic.inprocess import active, members_of
from phalanx.elastic.interrupts import ADDED, HostsUpdatedInterrupt, launcher_interrupt
from phalanx.settings import ElasticSettings

__all__ = ["change_at_commit", "commit_round", "skips_vote"]


def change_at_commit(notices: bool = False) -> HostsUpdatedInterrupt | None:
    """At a commit: the interrupt every rank raises for the launcher's change, or None (no change):
    a newer generation published (``notices``: or a host change announced, whose generation the
    workers then wait for while re-forming, as Horovod's workers do after ``HostsUpdatedInterrupt``).

    Rank 0 asks the store once (twice with ``notices``; the pending change itself only when there is
    one); one small allreduce MAX carries the answer to every rank (an allreduce, not a broadcast:
    every rank takes part, so a peer that died since the last step makes it fail on every rank at once).
    """
    return commit_round(notices)[0]


def skips_vote() -> bool:
    """A deferred commit between two votes: True (and counted) when the last vote's answer still
    leaves commits to skip, so this one makes no round at all; False: call :func:`commit_round`.

    Most commits of a ``recover="live"`` job take this path (one in ~38 votes at a 13 ms step), so it
    reads only the worker's context: no settings, no topology, no tensor. A context exists only in a
    worker the elastic launcher started, and ``skip`` is set only by the answer of a vote among more
    than one rank and cleared at every re-form, so :func:`commit_round`'s checks need no repeating.
    Measured (2 ranks, cpu2, a commit after each step of a 2-layer MLP, so its code is out of the
    caches): 50 us a commit through :func:`commit_round` (18 us of it the environment reads of
    ``inprocess.active()``), 21 us with this path; at 4 ranks on 2 cores those summed to about 1% of a
    step (docs/elastic.md, run 10).
    """
    ctx = wctx.existing()
    if ctx is None or ctx.vote is not None or ctx.skip <= 0:
        return False
    if ctx.pending is not None:  # (rank 0) time every commit, so a pause between them is not read as slow
        ctx.pending.tick()
    ctx.skip -= 1
    return True


def commit_round(notices: bool = False, vote: int = 0, deferred: bool = False
                 ) -> tuple[HostsUpdatedInterrupt | None, int | None]:
    """:func:`change_at_commit`, and in the same allreduce MAX this rank's preemption ``vote`` (the
    signal it got, 0 for none): ``(interrupt or None, the largest vote)``, so a commit costs one
    collective, not two. Outside in-process elastic: ``(None, None)`` and no collective (vote apart).

    ``deferred``: nothing on the critical path. Rank 0 reads the launcher's pending change from a
    thread that polls the store (no store call here), and the allreduce is started now and waited
    for at the next deferred commit, which acts on its answer: a change or a preemption is acted on
    one commit later, by every member at the same commit. A re-form drops the vote in flight. The
    vote is taken about every ``pending.VOTE_S`` (0.5 s) of commits, not every commit: each vote carries
    rank 0's count of the commits to skip before the next one (its commits per 0.5 s, less one, timed
    commit by commit so that a pause between commits does not shorten it; a commit asks
    :func:`skips_vote` first), so at a commit every 13 ms (cpu2) one commit in 38 votes; every
    ``pending.VOTE_BUSY_S`` (0.1 s) while rank 0 sees a change pending or an admission forms.
    """
    if not active():
        return None, None
    from phalanx import runtime

    ctx = wctx.current()
    size = runtime.size() if runtime.is_initialized() else 1
    if not deferred:
        flag = torch.tensor([0, vote], dtype=torch.int64)
        if size == 1 or runtime.rank() == 0:
            flag[0] = pending.pending_on(ctx.store, ctx.gen, ctx.notice, notices)  # 0, REMOVED_ONLY or ADDED
        if size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (launcher_interrupt(int(flag[0])) if flag[0] else None), int(flag[1])
    agreed = 0
    if ctx.pending is not None:  # (rank 0) time every commit, so a pause between them is not read as slow commits
        ctx.pending.tick()
    if size > 1 and ctx.vote is not None:  # the previous commit's vote: done long ago, a step ran since
        work, answer = ctx.vote
        ctx.vote = None
        work.wait()
        answer = answer.tolist()  # (one call; int() of each element was ~4 us apiece)
        change = _staged_change(ctx, answer[:4], notices)
        if change is not None:
            return change, answer[1]
        agreed, ctx.skip = answer[1], answer[4]
    if size > 1 and ctx.skip > 0:  # voted less than pending.VOTE_S ago: nothing new to agree on yet
        ctx.skip -= 1
        return None, agreed
    # + rank 0's latest generation, the staging state, and how many commits skip the vote after this one
    # (made only at a voting commit: a commit that skips the vote makes none)
    flag = [0, vote, 0, ctx.admission.state(), 0]  # (one tensor made below: a tensor's item set is ~5 us)
    if size == 1 or runtime.rank() == 0:
        if ctx.pending is None:
            ctx.pending = pending.PendingPoll(ElasticSettings.one("store"), lambda: ctx.gen).start()
            ctx.pending.tick()
        flag[0] = ctx.pending.kind(ctx.gen, ctx.notice, notices)
        flag[2] = ctx.pending.latest
        # a change seen or an admission forming: vote again soon (the staging's steps are votes)
        flag[4] = ctx.pending.commits_to_skip(busy=bool(flag[0]) or ctx.admission.staging is not None)
    if size == 1:  # nobody to agree with: act on it now
        return _staged_change(ctx, flag[:4], notices), vote
    flag = torch.tensor(flag, dtype=torch.int64)
    ctx.vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
    return None, agreed


def _staged_change(ctx: wctx.Context, answer: list[int], notices: bool) -> HostsUpdatedInterrupt | None:
    """What a deferred vote's answer ``[kind, vote, latest, staging]`` means at this commit: workers
    only added after the members are admitted without a pause (:class:`staging.Admission`), any other
    change re-forms now. None: train on."""
    from phalanx import runtime

    kind, _, latest, state = answer
    if kind and (notices or kind != ADDED) and ctx.admission.staging is None:
        return launcher_interrupt(kind)
    decided = ctx.admission.at_vote(kind, latest, state, functools.partial(_stageable, ctx), lambda gen: staging.Staging(
        ElasticSettings.one("store"), gen, runtime.rank(), members_of(gen), ctx.wid, timeout_s=ctx.timeout_s,
        form_timeout_s=wctx.form_timeout_s(), holders=runtime.size()).start())
    return None if decided is None else launcher_interrupt(kind or ADDED)


def _stageable(ctx: wctx.Context, gen: int) -> bool:
    """Generation ``gen`` keeps every current member at its rank and only adds workers after them."""
    if gen <= ctx.gen:
        return False
    now, wids = members_of(ctx.gen), members_of(gen)
    return len(wids) > len(now) and wids[:len(now)] == now
