"""Process sets: named subsets of the ranks that run their own collectives (Horovod's process sets).

A :class:`ProcessSet` is a sorted list of global ranks and, on its members, a c10d
subgroup built when it is added (every rank adds every set, in the same order, as Horovod requires). ``global_process_set`` is every rank (``group`` is
``None``). Sets are added and removed at run time, as in Horovod 0.28::

    even = add_process_set([0, 2])         # every rank calls it, in the same order; the members build the group
    hvd.allreduce(t, process_set=even)     # members only; a non-member raises at once
    remove_process_set(even)               # the group is destroyed; using the set again raises

Every set gets an id (``process_set_id``; the global set is 0). A removed set keeps its
ranks but has no id, and a collective on it raises ``ValueError`` naming it.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from phalanx import runtime

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "group_of",
           "process_set_ids", "registered"]


class ProcessSet:
    """A subset of ranks that runs its own collectives. ``ranks=None`` means every rank."""

    def __init__(self, ranks=None) -> None:
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: int | None = 0 if ranks is None else None
        self._group = None

    @property
    def group(self):
        """The c10d group of this set (``None`` for the global set), built by :func:`add_process_set`."""
        if self.ranks is None:
            return None
        if self._group is None:  # registered before torch.distributed was up: build it now
            self._build()
        return self._group

    def _build(self) -> None:
        """Every rank, in registration order (``dist.new_group`` is collective over the world).

        Not ``use_local_synchronization=True``: its group name hashes the ranks *and the number of
        groups this rank already has*, so a member that skipped an earlier set (a non-member does)
        names the same group differently from the other members, and they wait on different store
        keys forever (4 ranks adding [0, 1, 2], [0, 3]: ranks 0 and 3 hung in ``new_group``). Called
        by every rank in the same order, the name is the world's group counter, the same everywhere.
        """
        group = dist.new_group(self.ranks)
        self._group = group if self.included() else None

    def included(self) -> bool:
        return self.ranks is None or runtime.rank() in self.ranks

    def size(self) -> int:
        return runtime.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank inside the set (raises if it is not a member)."""
        if self.ranks is None:
            return runtime.rank()
        if runtime.rank() not in self.ranks:
            raise ValueError(f"rank {runtime.rank()} is not in {self}")
        return self.ranks.index(runtime.rank())

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks \
            and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks or ()), self.process_set_id))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks if self.ranks else 'all'})"


global_process_set = ProcessSet()
_ids = itertools.count(1)
_registered: dict[int, ProcessSet] = {0: global_process_set}


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a :class:`ProcessSet` or a list of ranks) and return it.

    Call it on every rank in the same order, as Horovod requires; the members build its group.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None and _registered.get(ps.process_set_id) is ps:
        raise ValueError(f"{ps} is already registered; remove it first or pass a new ProcessSet")
    if ps.ranks is not None and (not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= runtime.size()):
        raise ValueError(f"process set ranks {ps.ranks} must be a non-empty subset of 0..{runtime.size() - 1}")
    if ps.ranks is not None and dist.is_initialized():
        _check_same_everywhere(ps.ranks)
    ps.process_set_id = next(_ids)
    _registered[ps.process_set_id] = ps
    if ps.ranks is not None and dist.is_initialized():
        ps._build()
    return ps


def _check_same_everywhere(ranks: list[int]) -> None:
    """Every rank must add the same set at the same point: say so on every rank, instead of a
    ``new_group`` whose ranks differ per process (undefined in c10d: a hang or a torn mesh)."""
    seen: list = [None] * runtime.size()
    dist.all_gather_object(seen, ranks)
    if any(other != ranks for other in seen):
        differ = {r: other for r, other in enumerate(seen) if other != seen[0]}
        raise ValueError(f"add_process_set was called with different ranks on different processes (rank 0: "
                         f"{seen[0]}, " + ", ".join(f"rank {r}: {o}" for r, o in differ.items()) + "); every rank "
                         "must add the same process sets, in the same order, as in Horovod")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` and destroy its group; False for the global set or an unknown set."""
    if process_set is global_process_set or _registered.get(process_set.process_set_id) is not process_set:
        return False
    del _registered[process_set.process_set_id]
    process_set.process_set_id = None
    if process_set._group is not None:
        dist.destroy_process_group(process_set._group)
        process_set._group = None
    return True


def process_set_ids() -> list[int]:
    """Ids of the registered process sets (0 is the global set)."""
    return sorted(_registered)


def registered(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: the global set); raises ``ValueError`` naming the known ids."""
    ps = _registered.get(process_set_id)
    if ps is None:
        raise ValueError(f"no process set with id {process_set_id}; registered ids: {process_set_ids()}")
    return ps


def group_of(process_set: ProcessSet):
    """The group a collective on ``process_set`` runs on; raises for a non-member or a removed set."""
    if process_set.ranks is None:
        return None
    if process_set.process_set_id is None or _registered.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set} is not registered (removed, or never added): "
                         "call hvd.add_process_set(ranks) on every rank first")
    if not process_set.included():
        raise ValueError(f"rank {runtime.rank()} is not in {process_set}; only its members may call this")
    return process_set.group
