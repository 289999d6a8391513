"""Elastic state (Horovod's model): ``commit()`` a known-good point, ``restore()`` it, ``sync()`` it to all.

As in Horovod, the last commit stays in the memory of each worker: after a failure
the survivors of an in-process elastic job (``phalanx run --min-np/--max-np``) roll
back to it without any I/O. A commit is also a fast local snapshot through
:mod:`phalanx.checkpoint` (by default under ``/dev/shm``, without fsync), which a
group restarted by TorchElastic (``--max-restarts``, or the fallback) loads —
resharded when the world size changed. Under the in-process launcher a commit also
asks the store (rank 0, one broadcast) whether workers join or leave.

    step:   1   2   3   4   5   6   7   8   9
                    ^commit     ^commit   x rank 2 killed
    survivors re-form (or the agent restarts all) -> restore() the commit at step 6
    steps lost = 8 - 6 (at most the commit interval)

``TorchState(recover="live")`` keeps no copy: the survivors go on from the new rank 0's live state
(a step is applied whole or not at all; torchft's model), the commit's vote is waited one commit
later, and rank 0 alone writes a snapshot in the background, at most every 10 s by default
(:mod:`phalanx.elastic.snapshots`).

Example::

    state = TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
    state.commit()             # every few steps
    state.restore()            # roll back to the last commit (memory, else snapshot)
    state.sync()               # rank 0's state to every rank; re-deal the sampler
    state.on_world_change(elastic.scale_lr(optimizer))   # runs in sync() after a resize
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any, Protocol, runtime_checkable

import torch

from phalanx import runtime
from phalanx.checkpoint.manager import CheckpointManager
from phalanx.checkpoint.pieces import is_gathered, is_stateful
from phalanx.comm.broadcast import broadcast_coalesced
from phalanx.comm.collectives import allgather_object, broadcast_object
from phalanx.elastic.commit_dir import default_commit_dir, own_commit_dir
from phalanx.elastic.snapshots import Snapshots, pack, unpack
from phalanx.elastic.unheld import watch
from phalanx.log import get_logger

__all__ = ["State", "TorchState", "live_topology", "RECOVER", "LIVE_SNAPSHOT_S"]

RECOVER = ("commit", "live")  # TorchState(recover=...): what the survivors of a lost worker go on from
# recover="live": rank 0's snapshot at most this often by default. The survivors of a lost worker go on
# from the live state; the file serves only a restart of the whole group. Written every 10th commit
# (a 13 ms step, cpu2) it was the largest part of the steady overhead: 1.0% of rank 0's training
# thread (the state dicts and pack()) and 0.9% of a core in the writer thread, plus a write (and an
# fsync off /dev/shm) every 130 ms; every 10 s that is ~0.02%. A group restart resumes up to 10 s back.
LIVE_SNAPSHOT_S = 10.0

log = get_logger(__name__)
_clock = time.monotonic  # (the snapshot period's clock)


@runtime_checkable
class State(Protocol):
    """What ``phalanx.elastic.run`` needs from a training state."""

    def commit(self) -> None: ...

    def restore(self) -> bool: ...

    def sync(self) -> None: ...


class TorchState:
    """Model, optimizer and named extras (schedulers, samplers, plain values) as one elastic state.

    Extras are attributes: ``state.epoch``, ``state.sampler``. ``commit()`` keeps
    a copy in memory and writes a snapshot to ``commit_dir`` (``keep`` newest
    kept); ``restore()`` returns False when there is nothing to restore. The n-th state a
    process makes with the same directory commits to ``<commit_dir>-state<n>``: each keeps and
    restores its own snapshots, a restarted process (same states, same order) finds each one's
    again, and a new state never inherits an earlier state's commits.
    ``snapshot_every``: under in-process elastic (``phalanx run --min-np/--max-np``), write the
    snapshot at every N-th commit only (default 1: every commit). The survivors of a lost worker
    restore from memory, so a commit every step costs a state copy, not a file; the snapshot is
    for a group restart (every worker lost, a re-form that fails), which then resumes up to N-1
    commits earlier. A preemption's commit is always written.
    ``recover``: what the survivors of a lost worker go on from under in-process elastic.
    ``"commit"`` (default, Horovod's): the last commit, a copy of the state every ``commit()`` keeps
    in memory. ``"live"``: the state the new rank 0 holds when the loss is noticed, no copy at all
    (torchft's model): a step is applied whole or not at all on each rank, because a failed
    collective raises before ``optimizer.step()`` applies the gradients it was reducing (a rank
    whose allreduce completed got every rank's part), and ``sync()`` gives every member rank 0's
    state, so the members agree again and no step is lost or applied twice. A commit then costs
    one small allreduce about every 0.5 s (0.1 s while a change is pending), started at a commit and
    waited for at the next one (the membership vote, acted on one commit later), and a snapshot rank 0
    writes by itself in the background every ``snapshot_period_s`` (10 s by default; for a group
    restart: one file set, no cross-rank wait).
    It needs a training loop that changes the state only through whole steps between
    collectives (the usual forward, backward, ``optimizer.step()``, counters), and no sharded
    piece (ZeRO re-forms by a group restart either way).
    ``snapshot_period_s`` (``recover="live"`` only): at most one snapshot a period of this many seconds,
    at the first due commit (every ``snapshot_every``-th) at least that long after rank 0's last one,
    so the snapshots' cost does not grow with the step rate (default None: :data:`LIVE_SNAPSHOT_S`,
    10 s; 0: every due commit). A group restart then resumes up to a period earlier; the survivors of
    a lost worker never read the file.
    ``topology``: the job's, for a job whose membership never changes; the default
    (``None``) follows the live job, whose topology an in-process elastic re-form
    replaces (``phalanx.runtime.topology()`` after each re-form, one process before ``init``).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None, *,
                 commit_dir: str | None = None, keep: int = 2, topology=None, snapshot_every: int = 1,
                 recover: str = "commit", snapshot_period_s: float | None = None, **extras: Any) -> None:
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"TorchState(snapshot_every={snapshot_every!r}): give a whole number of commits >= 1 "
                             "(1: a snapshot at every commit)")
        if recover not in RECOVER:
            raise ValueError(f"TorchState(recover={recover!r}): give 'commit' (roll back to the last commit) or "
                             "'live' (go on from the new rank 0's state, no copy per commit)")
        if snapshot_period_s is not None and (isinstance(snapshot_period_s, bool) or not isinstance(
                snapshot_period_s, (int, float)) or not snapshot_period_s >= 0 or recover != "live"):
            raise ValueError(f"TorchState(snapshot_period_s={snapshot_period_s!r}, recover={recover!r}): give a "
                             "number of seconds >= 0 with recover='live' (rank 0 alone times its snapshots; a "
                             "copying commit's snapshot is written by every rank at the same commit)")
        if snapshot_period_s is None and recover == "live":
            snapshot_period_s = LIVE_SNAPSHOT_S
        pieces = {"model": model, "optimizer": optimizer, **extras}
        object.__setattr__(self, "_pieces", {k: v for k, v in pieces.items() if v is not None})
        if recover == "live" and self.sharded():
            raise ValueError(f"TorchState(recover='live'): the pieces {', '.join(self.sharded())} are sharded "
                             "(ZeRO), which only a group restart from a commit recovers; give recover='commit'")
        object.__setattr__(self, "_live", recover == "live")
        object.__setattr__(self, "_synced", False)  # (live) this process holds the job's state: sync() ran
        object.__setattr__(self, "_handed", None)  # (live) the staged admission whose state sync() handed over
        object.__setattr__(self, "commit_dir", own_commit_dir(commit_dir or default_commit_dir()))
        object.__setattr__(self, "_topology", topology)
        object.__setattr__(self, "_manager", CheckpointManager(self.commit_dir, keep=keep, topology=topology))
        # (live) rank 0's snapshot files, written alone in the background (phalanx.elastic.snapshots)
        object.__setattr__(self, "_snapshots", Snapshots(self.commit_dir, keep=keep))
        object.__setattr__(self, "_memory", None)
        object.__setattr__(self, "_commit_count", 0)
        object.__setattr__(self, "_snapshot_every", snapshot_every)
        object.__setattr__(self, "_snapshot_period_s", snapshot_period_s)
        object.__setattr__(self, "_snapshot_at", None)  # (live) monotonic time of rank 0's last snapshot
        object.__setattr__(self, "restored_from", None)
        object.__setattr__(self, "_world", None)  # world size of the state held (None: not synced yet)
        object.__setattr__(self, "_world_hooks", [])
        # an optimizer with state stepping this state's model but left out of it: refused at its first step
        ref = weakref.ref(self)
        object.__setattr__(self, "_unheld", watch(lambda: None if (s := ref()) is None else s._pieces.values()))

    # commit(): also act on the launcher's host-change notices (phalanx.horovod.elastic's state does)
    _host_notices = False

    @property
    def commits(self) -> int:
        """How many commits this state made (a piece named ``commits``, e.g. Horovod's test script's
        own counter, is that piece instead)."""
        return self._pieces["commits"] if "commits" in self._pieces else self._commit_count

    def __getattr__(self, name: str) -> Any:
        pieces = object.__getattribute__(self, "_pieces")
        if name in pieces:
            return pieces[name]
        raise AttributeError(f"TorchState has no piece '{name}' (pieces: {sorted(pieces)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._pieces:
            self._pieces[name] = value
        else:
            object.__setattr__(self, name, value)

    def pieces(self) -> dict[str, Any]:
        """The live name -> piece dict (what a checkpoint of this state holds), plus the commit counter."""
        return {**self._pieces, "_commits": self._commit_count, "_world": self._world}

    def sharded(self) -> list[str]:
        """The names of the pieces split across ranks in their own format (a ZeRO optimizer): such a
        state cannot re-form in-process (a lost rank's shard and the shard layout go with the old world)."""
        return [k for k, v in self._pieces.items() if is_gathered(v)]

    def on_world_change(self, hook) -> None:
        """Call ``hook(old_size, new_size)`` in :meth:`sync` when the state was committed at another
        world size (after a restart with fewer or more workers). See :mod:`phalanx.elastic.scaling`."""
        if not callable(hook):
            raise TypeError(f"on_world_change takes a function hook(old_size, new_size), got {hook!r}")
        self._world_hooks.append(hook)

    def commit(self) -> None:
        """Remember this point: in memory, and as a snapshot a restarted group can load."""
        object.__setattr__(self, "_commit_count", self._commit_count + 1)
        if self._world is None:  # committed without a sync(): record the size this state belongs to
            object.__setattr__(self, "_world", _size(self._topology))
        if self._live:
            self._commit_live()
            return
        self.remember()
        from phalanx.elastic import inprocess, preempt, vote

        # in-process elastic: workers join or leave at this commit. Asked before the snapshot is
        # written: the question is one small allreduce, which fails at once when a peer died since
        # the last step, where the snapshot's cross-rank waits would only time out. It carries the
        # preemption vote too (a HostsUpdatedInterrupt or None, and the largest vote).
        changed, reduced = vote.commit_round(notices=self._host_notices, vote=preempt.vote())

        def save() -> str:
            return self._manager.save(self._commit_count, self.pieces(), fsync=not self.commit_dir.startswith("/dev/shm"))

        # in-process elastic restores from memory: the file is for a group restart, every snapshot_every-th
        due = not inprocess.active() or self._commit_count % self._snapshot_every == 0
        # under elastic.run: a preemption signal -> this commit saved (now, if it was not due), exit 85
        preempt.at_commit(save() if due else save, self.commit_dir, reduced)
        if changed is not None:
            raise changed

    def _commit_live(self) -> None:
        """recover='live': the vote (waited for at the next commit), a background snapshot when due."""
        from phalanx.elastic import preempt, vote

        if vote.skips_vote():  # most commits: between two votes, nothing to agree on
            changed, reduced = None, 0
        else:  # (reduced None: not an in-process elastic worker)
            changed, reduced = vote.commit_round(notices=self._host_notices, vote=preempt.vote(), deferred=True)
        due = self._commit_count % self._snapshot_every == 0 or reduced is None
        if due and self._snapshot_period_s:  # at most one snapshot a period
            now = _clock()
            due = self._snapshot_at is None or now - self._snapshot_at >= self._snapshot_period_s
            if due:
                object.__setattr__(self, "_snapshot_at", now)
        if due:
            self._snapshot_alone(async_=True)
        preempt.at_commit(lambda: self._snapshot_alone(async_=False), self.commit_dir, reduced)
        if changed is not None:
            raise changed

    def _snapshot_alone(self, *, async_: bool) -> str:
        """(live) Rank 0 writes the state to a snapshot file by itself; the others write nothing."""
        topology = live_topology(self._topology)
        if topology is not None and topology.rank != 0:
            return self._snapshots.path(self._commit_count)
        tree = {k: v.state_dict() if is_stateful(v) else v for k, v in self._pieces.items()}
        return self._snapshots.write(self._commit_count, {"pieces": tree, "_commits": self._commit_count,
                                                          "_world": self._world}, background=async_)

    def finish(self) -> None:
        """Wait for the background snapshot in flight (recover='live'; ``elastic.run`` calls this when
        the training function returns), so the last one is complete before the process exits."""
        if self._live:
            self._snapshots.wait()

    def remember(self) -> None:
        """Keep the state as it is now in memory, as the point :meth:`restore` returns to (no snapshot,
        no commit counted); ``commit()`` does this and more."""
        snapshot = {k: copy.deepcopy(v.sharded_state_dict() if is_gathered(v) else
                                     v.state_dict() if is_stateful(v) else v)
                    for k, v in self._pieces.items()}
        object.__setattr__(self, "_memory", snapshot)

    def restore(self) -> bool:
        """Roll back to the last commit: from memory if this process made it, else from the snapshot.
        recover='live': a process that holds the job's state (it synced) keeps it as it is."""
        if self._live and self._synced:
            return True
        if self._memory is not None:
            for k, v in self._pieces.items():
                if is_gathered(v):  # ZeRO: each rank kept its own shard; load from all of them
                    v.load_sharded_state_dict(_all_ranks(copy.deepcopy(self._memory[k]), self._topology))
                else:  # (a copy: the memory stays the point to return to)
                    self._put(k, v, self._memory[k] if isinstance(v, torch.Tensor) else copy.deepcopy(self._memory[k]))
            return True
        return self._load_latest()

    def _put(self, key: str, piece: Any, value: Any) -> None:
        """Piece ``key`` made ``value``: loaded into a stateful piece, copied into a tensor, else replaced."""
        if is_stateful(piece):
            piece.load_state_dict(value)
        elif isinstance(piece, torch.Tensor):
            with torch.no_grad():
                piece.copy_(value)
        else:
            self._pieces[key] = value

    def _load_latest(self) -> bool:
        """The last snapshot on disk, if any (what a restarted group, or a generation of newcomers, resumes)."""
        if self._live:  # rank 0 wrote them alone: every process reads the newest by itself
            return self._load_snapshot()
        live = self.pieces()
        path = self._manager.load_latest(live)
        if path is None:
            return False
        object.__setattr__(self, "_commit_count", live.pop("_commits"))
        object.__setattr__(self, "_world", live.pop("_world"))
        self._pieces.update({k: v for k, v in live.items() if not is_stateful(v)})
        object.__setattr__(self, "restored_from", path)
        log.info("restored commit %d from %s", self._commit_count, path)
        return True

    def _load_snapshot(self) -> bool:
        """(live) The newest snapshot file rank 0 wrote, if any."""
        found = self._snapshots.latest()
        if found is None:
            return False
        number, tree = found
        for k, v in list(self._pieces.items()):
            if k in tree["pieces"]:
                self._put(k, v, tree["pieces"][k])
        object.__setattr__(self, "_commit_count", tree["_commits"])
        object.__setattr__(self, "_world", tree["_world"])
        object.__setattr__(self, "restored_from", self._snapshots.path(number))
        log.info("restored commit %d from %s", self._commit_count, self.restored_from)
        return True

    def sync(self) -> None:
        """Make every rank hold rank 0's state (after a restart or a new worker joined).

        When no rank holds a commit (a generation of newcomers only: every earlier member left at
        the commit that admitted them), the state comes from the last snapshot on every rank, not
        from rank 0's fresh one: the job goes on from where it was, nothing is lost.
        """
        topology = live_topology(self._topology)
        if self._hand_over(topology):
            return
        held = self._memory is not None or self.restored_from is not None or (self._live and self._synced)
        object.__setattr__(self, "_synced", False)
        anyone = any(allgather_object(held)) if topology is not None and topology.size > 1 else held
        if not anyone:  # (every rank asks: a collective)
            if self._load_latest():
                log.warning("no member held the state: resumed commit %d from %s", self._commit_count, self.restored_from)
        if topology is None or topology.size == 1:
            self._synced_to(self._commit_count, self._world, 1)
            return
        tensors, others = self._sync_parts()
        # The rest (optimizer and scheduler state dicts, plain values, the counters) as one object
        # broadcast of skeletons and one flat buffer per dtype (snapshots.pack), not each piece pickled
        # whole, tensors included, in its own broadcast_object: at a staged admission this pause is the
        # members' stall (np 4: sync 35-50 ms of a 63-85 ms pause, 7 collectives; now 2 + 1 per dtype).
        packed, flats = None, []
        if topology.rank == 0:
            packed = {"counters": (self._commit_count, self._world), "pieces": {}}
            for k in others:
                skeleton, buffers = pack(self._pieces[k].state_dict() if is_stateful(self._pieces[k]) else self._pieces[k])
                packed["pieces"][k] = (skeleton, [(b.dtype, b.numel()) for b in buffers], len(flats))
                flats += buffers
            devices = {t.device.type for t in [*flats, *tensors]}
            if devices - {"cpu"}:  # a device job (NCCL sends no CPU buffer): each piece pickled, as before
                packed["pieces"], flats = None, []
        packed = broadcast_object(packed, root_rank=0)
        if packed["pieces"] is not None and topology.rank != 0:
            flats = [torch.empty(n, dtype=dtype) for _, metas, _ in packed["pieces"].values() for dtype, n in metas]
        # one collective per dtype: the modules' parameters and buffers, tensor pieces, the packed buffers
        broadcast_coalesced(tensors + flats, 0, None, "sync.state")
        for k in others:
            v = self._pieces[k]
            if packed["pieces"] is None:
                value = broadcast_object(v.state_dict() if is_stateful(v) and topology.rank == 0 else
                                         None if is_stateful(v) else v, root_rank=0)
            elif topology.rank == 0:
                continue  # the source: its pieces stay the objects they are
            else:
                skeleton, metas, first = packed["pieces"][k]
                value = unpack(skeleton, flats[first:first + len(metas)])
            if is_stateful(v):
                v.load_state_dict(value)
            else:
                self._pieces[k] = value
        self._synced_to(*packed["counters"], topology.size)  # (a sync cut short leaves a mix: restore() reads the file)

    def _sync_parts(self) -> tuple[list[torch.Tensor], list[str]]:
        """What ``sync()`` hands over: the modules' parameters and buffers and the tensor pieces, and the
        names of the other pieces (optimizer, schedulers, plain values). A sharded optimizer's model is
        left out (ZeRO broadcast it at construction and keeps it equal; at stage 3 each rank holds only
        its shard of every parameter, so a broadcast of its tensors would mismatch)."""
        owned = {id(getattr(v, "model", None)) for v in self._pieces.values() if is_gathered(v)}
        tensors = [t for v in self._pieces.values() if isinstance(v, torch.nn.Module) and id(v) not in owned
                   for t in [*v.parameters(), *v.buffers()]]
        tensors += [v for v in self._pieces.values() if isinstance(v, torch.Tensor)]
        others = [k for k, v in self._pieces.items()
                  if not (is_gathered(v) or isinstance(v, (torch.nn.Module, torch.Tensor)))]
        return tensors, others

    def _synced_to(self, commits: int, world: int, size: int) -> None:
        """This process holds the job's state now, at ``commits`` commits of a job last ``world`` wide."""
        object.__setattr__(self, "_commit_count", commits)
        object.__setattr__(self, "_world", world)
        object.__setattr__(self, "_synced", True)
        self._reset_samplers()
        self._world_changed(size)

    def _hand_over(self, topology) -> bool:
        """(live) A staged admission: rank 0 sends the state to the newcomers alone (phalanx.elastic.handover)."""
        from phalanx.elastic import handover, inprocess

        given = inprocess.handover() if self._live and topology is not None else None
        if given is None or given[0] == self._handed:
            return False
        object.__setattr__(self, "_handed", given[0])
        counters = handover.share(self._pieces, *self._sync_parts(), (self._commit_count, self._world),
                                  topology.rank, given[1])
        self._synced_to(*counters, topology.size)
        return True

    def _world_changed(self, size: int) -> None:
        old = self._world
        object.__setattr__(self, "_world", size)
        if old is not None and old != size:
            log.warning("world size changed %d -> %d: running %d rescaling hook(s)", old, size,
                        len(self._world_hooks))
            for hook in self._world_hooks:
                hook(old, size)

    def _reset_samplers(self) -> None:
        for v in self._pieces.values():
            if hasattr(v, "reset") and hasattr(v, "record_batch"):
                v.reset()


def live_topology(topology=None):
    """``topology``, else the live job's (an elastic re-form replaces it), else None (one process).

    The elastic layer's one read of the runtime's current topology: the state, the
    sampler and the rescaling hooks follow the job as its membership changes.
    """
    if topology is not None:
        return topology
    return runtime.topology() if runtime.is_initialized() else None


def _size(topology) -> int:
    live = live_topology(topology)
    return 1 if live is None else live.size


def _all_ranks(mine: Any, topology) -> list:
    if _size(topology) == 1:
        return [mine]
    return allgather_object(mine)
