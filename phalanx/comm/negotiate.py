"""Negotiation for Horovod's ``join``: which collective comes next, and who still takes part.

Horovod's coordinator knows every pending tensor, so a rank that has run out of data
(``join()``) can answer the others' collectives with zeros. phalanx has no coordinator;
instead each collective of the Horovod facade on the global set starts with a 4-byte
``SUM`` allreduce, the same kind the data-parallel optimizer starts each step with::

    training rank   facade collective: MARK      optimizer step: 1      join(): 0
    sum == MARK·n   nobody has joined: run the collective as usual (the usual cross-rank check)
    otherwise       exchange descriptors (all_gather_object), compare them, run the collective
                    unchecked; a joined rank runs it too, with zeros of the described shape

A joined rank loops on that allreduce: 0 means every rank has joined; below MARK is an
optimizer step (answered through ``on_step``); MARK or more is a facade collective,
whose descriptor it then receives. A descriptor mismatch raises
:class:`CollectiveMismatchError` on every rank, the joined ones included.

The probe costs one 4-byte allreduce per facade collective. It is skipped, together with
the cross-rank check, when ``set_mismatch_check(False)`` is in force; ``join`` then only
answers optimizer steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.comm.collectives import (
    CollectiveMismatchError,
    describe_mismatch,
    mismatch_check_enabled,
)

__all__ = ["MARK", "JOINED", "announce", "next_request", "last_to_join", "device_for"]

MARK = 4096.0
"""A facade collective's contribution; an optimizer step contributes 1 per training rank
(so fewer than 4096 ranks keep the two apart, and MARK·n stays exact in float32 up to 4096 ranks)."""

JOINED = {"call": "join", "name": None}


def device_for(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compare(every: list[dict], group) -> dict | None:
    """The training ranks' common descriptor; raises on every rank if they differ. A broadcast
    whose root has joined raises on the training ranks only (None here: the joined ranks go on)."""
    active = [d for d in every if d["call"] != "join"]
    if any(d != active[0] for d in active[1:]):
        raise CollectiveMismatchError(describe_mismatch(every, group))
    desc = active[0]
    root = desc.get("root")
    if root is not None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(every)))
        if every[ranks.index(root)]["call"] == "join":
            if every[dist.get_rank(group)]["call"] == "join":
                return None
            raise CollectiveMismatchError(
                f"phalanx: {desc['call']} {desc['name']!r} has root_rank {root}, which has already joined; "
                "a joined rank has no data to send: choose a root that has not called join()")
    return desc


def announce(desc: dict, group) -> bool:
    """Training rank, before a facade collective. True when some rank has joined: the
    descriptors were compared and the collective must run unchecked."""
    if group is not None or not mismatch_check_enabled() or dist.get_world_size(group) == 1:
        return False
    n = dist.get_world_size(group)
    flag = torch.full((1,), MARK, device=device_for(group))
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    if flag.item() == MARK * n:
        return False
    every: list[dict] = [None] * n  # type: ignore[list-item]
    dist.all_gather_object(every, desc, group=group)
    _compare(every, group)
    return True


def next_request(group) -> tuple[str, dict | None]:
    """Joined rank: wait for the others' next move. ``("done", None)`` when every rank has
    joined, ``("step", None)`` for an optimizer step, ``("call", descriptor)`` for a collective,
    ``("skip", None)`` for one the training ranks refuse (a broadcast from a joined root)."""
    flag = torch.zeros(1, device=device_for(group))
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    total = flag.item()
    if total == 0:
        return "done", None
    if total < MARK:
        return "step", None
    every: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(every, JOINED, group=group)
    desc = _compare(every, group)
    return ("call", desc) if desc is not None else ("skip", None)


def last_to_join(answered: int, group) -> int:
    """Every rank, after leaving its join loop: the global rank that joined last (it answered the
    fewest requests; the highest such rank on a tie, as Horovod)."""
    n = dist.get_world_size(group)
    every = torch.zeros(n, dtype=torch.int64, device=device_for(group))
    every[dist.get_rank(group)] = answered
    dist.all_reduce(every, op=dist.ReduceOp.SUM, group=group)
    counts = every.tolist()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    fewest = min(counts)
    return max(r for r, c in zip(ranks, counts) if c == fewest)
