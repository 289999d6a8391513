"""Negotiation for Horovod's ``join``: which collective comes next, and who still takes part.

Horovod's coordinator knows every pending tensor, so a rank that has run out of data
(``join()``) can answer the others' collectives with zeros. phalanx has no coordinator;
instead each collective of the Horovod facade on the global set starts with its cross-rank
check, a 24-byte ``MAX`` allreduce of ``[h, -h, joined]`` (``h`` a digest of the call). The
data-parallel optimizer's steps carry their join flag in their first bucket, on a group of their
own (:mod:`phalanx.parallel.data.joined`); only where that cannot be (a lossy compressor) a step
starts with the same probe carrying ``STEP``, on the optimizer's group::

    training rank   facade collective: [h, -h, 0]    optimizer step: [STEP, -STEP, 0]
    joined rank     [NOBODY, NOBODY, 1]              (NOBODY is below every digest)

    joined == 0     nobody has joined: max h == -max(-h) means every rank makes the same call
                    (checked: the collective runs without a check of its own); otherwise the
                    descriptors are gathered and CollectiveMismatchError names the difference
    joined == 1     exchange descriptors (all_gather_object), compare them, run the collective;
                    a joined rank runs it too, with zeros of the described shape

A joined rank loops on that probe: ``h == NOBODY`` means every rank has joined; ``STEP`` an
optimizer step (answered through ``on_step``); any other digest a facade collective, whose
descriptor it then receives. A descriptor mismatch raises :class:`CollectiveMismatchError` on
every rank, the joined ones included.

So join costs nothing while nobody has joined: the probe *is* the cross-rank check every
checked collective makes anyway (before, a separate 4-byte join probe went first: two blocking
round trips per facade collective, now one). ``set_mismatch_check(False)`` drops it, and
``join`` then only answers optimizer steps.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from phalanx.comm.mismatch import (
    CollectiveMismatchError,
    default_device,
    describe_mismatch,
    mismatch_check_enabled,
)
from phalanx.runtime import heartbeat

__all__ = ["STEP", "NOBODY", "JOINED", "digest", "step_probe", "announce", "next_request", "joined_wait",
           "last_to_join"]

STEP = 1
"""An optimizer step's code in the probe (digests of facade calls are 2 or more)."""
NOBODY = -(2**62)
"""A joined rank's code: below every digest, so the MAX is the training ranks' call."""

JOINED = {"call": "join", "name": None}


def digest(desc: dict) -> int:
    """A stable code for a call's descriptor (the same on every rank), 2 or more."""
    raw = hashlib.blake2b(repr(sorted(desc.items(), key=lambda kv: kv[0])).encode(), digest_size=7).digest()
    return int.from_bytes(raw, "little") + 2


def _probe(code: int, joined: int, group) -> torch.Tensor:
    out = torch.tensor([code, -code if code != NOBODY else NOBODY, joined], dtype=torch.int64,
                       device=default_device(group))
    return out


def step_probe(device: torch.device) -> torch.Tensor:
    """The probe an optimizer step contributes (``all_reduce(..., MAX)``; its result is not needed)."""
    return torch.tensor([STEP, -STEP, 0], dtype=torch.int64, device=device)


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
    """Training rank, before a facade collective: the cross-rank check and the join probe in one.
    True when the call was checked here (the collective runs without a check of its own)."""
    if group is not None or not mismatch_check_enabled() or dist.get_world_size(group) == 1:
        return False
    n = dist.get_world_size(group)
    probe = _probe(digest(desc), 0, group)
    try:
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as err:
        if "timed out" not in str(err).lower():
            raise
        raise CollectiveMismatchError(_not_made_in_time(desc, n)) from err
    high, low, joined = probe.tolist()
    if not joined:
        if high == -low:
            return True
        every: list[dict] = [None] * n  # type: ignore[list-item]
        dist.all_gather_object(every, desc, group=group)
        raise CollectiveMismatchError(describe_mismatch(every, group))
    every = [None] * n
    dist.all_gather_object(every, desc, group=group)
    _compare(every, group)
    return True


def _not_made_in_time(desc: dict, n: int) -> str:
    """The one line for a facade call the other ranks did not make within the collective timeout:
    what this rank called, where the others are (their heartbeats, under ``phalanx run``), the fix."""
    me = dist.get_rank()
    where = heartbeat.peer_positions(r for r in range(n) if r != me)
    others = "; ".join(f"rank {r} is {w}" for r, w in sorted(where.items())) or \
        "run under `phalanx run` to see where the other ranks are"
    hint = " ('dp.bucket' is a gradient reduction: optimizer.step() or backward)" \
        if any("'dp.bucket" in w for w in where.values()) else ""
    return (f"phalanx: rank {me} called {desc['call']} {desc['name']!r}, and the other ranks did not make that "
            f"call within the collective timeout: {others}{hint}. Every rank must make the same collectives in "
            "the same order (a rank in optimizer.step() while another calls hvd.allreduce is the usual cause); "
            "if a rank is only slow, raise --timeout")


def next_request(group) -> tuple[str, dict | None]:
    """Joined rank: wait for the others' next move. ``("done", None)`` when every rank has
    joined, ``("step", None)`` for an optimizer step, ``("call", descriptor)`` for a collective,
    ``("skip", None)`` for one the training ranks refuse (a broadcast from a joined root)."""
    probe = _probe(NOBODY, 1, group)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    code = int(probe[0])
    if code == NOBODY:
        return "done", None
    if code == STEP:
        return "step", None
    every: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(every, JOINED, group=group)
    desc = _compare(every, group)
    return ("call", desc) if desc is not None else ("skip", None)


def joined_wait(group, device: torch.device) -> bool:
    """Joined rank of a plain ``DistributedOptimizer.join``: True when another step is coming,
    False when every rank has joined."""
    probe = torch.tensor([NOBODY, NOBODY, 1], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    return int(probe[0]) != NOBODY


def last_to_join(answered: int, group) -> int:
    """Every rank, after leaving its join loop: the global rank that joined last (it answered the
    fewest requests; the highest such rank on a tie, as Horovod)."""
    n = dist.get_world_size(group)
    every = torch.zeros(n, dtype=torch.int64, device=default_device(group))
    every[dist.get_rank(group)] = answered
    dist.all_reduce(every, op=dist.ReduceOp.SUM, group=group)
    counts = every.tolist()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    fewest = min(counts)
    return max(r for r, c in zip(ranks, counts) if c == fewest)
