"""Negotiation of the Horovod facade's collectives: names, join, and who still takes part.

Horovod's coordinator matches collectives by name and knows every pending tensor, so an
``allreduce_async`` never waits for its peers and a rank that has run out of data (``join()``)
can answer the others' allreduces with zeros. phalanx has no coordinator thread; instead each
facade collective on the global set starts with its cross-rank check, a 24-byte ``MAX``
allreduce of ``[h, -h, joined]`` (``h`` a code for the call), and a *named* asynchronous
collective is not started at submission: it waits in the rank's pending list until a round in
which every training rank has submitted that name (rounds happen at ``synchronize()`` and at
every facade collective, on every rank)::

    training rank   blocking call, nothing pending: [digest, -digest, 0]
                    synchronize(h), h its only pending op: [digest(h), -digest(h), 0]
                    anything else with ops pending: [PENDING, -PENDING, 0]
                    optimizer step (lossy-compression fallback): [STEP, -STEP, 0]
    joined rank     [NOBODY, NOBODY, 1]              (NOBODY is below every code)

    fast path       nobody joined and every rank sent the same digest: the call (or the one
                    pending op) runs at once, already checked, as before names were deferred
    full round      every rank's {call, pending names} is gathered (all_gather_object) and
                    plan() decides, the same on every rank: the names submitted by every
                    training rank start, in the first training rank's order (a joined rank
                    answers them with zeros); then the blocking call, if every training rank
                    makes the same one; otherwise the ranks loop. A round in which nothing
                    can start raises on every rank with where each one is, instead of hanging.

So a second submission of a name still pending raises ``ValueError`` on the submitting rank
before anything is sent (Horovod's duplicate-name error), and ``allreduce_async`` never
blocks. While a rank has joined, allgather, alltoall, reducescatter and broadcast raise on the
training ranks, as Horovod's controller does (the joined ranks keep waiting). A descriptor
mismatch raises :class:`CollectiveMismatchError` on every rank, the joined ones included.
Nothing of this costs more while nobody has joined and no named op is pending: the probe *is*
the check every checked collective makes anyway. ``set_mismatch_check(False)`` drops it all:
names start at submission, and ``join`` then only answers optimizer steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm.mismatch import (
    CollectiveMismatchError,
    default_device,
    describe_mismatch,
    mismatch_check_enabled,
)
from phalanx.runtime import heartbeat

__all__ = ["STEP", "PENDING", "NOBODY", "REFUSED_WITH_JOIN", "Plan", "digest", "step_probe", "active",
           "probe", "exchange", "plan", "refusal", "next_request", "joined_wait", "last_to_join"]

STEP = 1
"""An optimizer step's code in the probe."""
PENDING = 2
"""The code of a rank holding named asynchronous collectives not yet started (a full round follows)."""
NOBODY = -(2**62)
"""A joined rank's code: below every digest, so the MAX is the training ranks' call."""
_JOINED = {"call": "join", "name": None}
REFUSED_WITH_JOIN = ("allgather", "alltoall", "reducescatter", "broadcast")
"""Horovod's controller refuses these while a rank has joined ("Allgather is not supported with Join
at this time"): the training ranks raise, the joined ones keep waiting."""


def digest(desc: dict) -> int:
    """A stable code for a call's descriptor (the same on every rank), 3 or more."""
    raw = hashlib.blake2b(repr(sorted(desc.items(), key=lambda kv: kv[0])).encode(), digest_size=7).digest()
    return int.from_bytes(raw, "little") + 3


def step_probe(device: torch.device) -> torch.Tensor:
    """The probe an optimizer step contributes (``all_reduce(..., MAX)``; its result is not needed)."""
    return torch.tensor([STEP, -STEP, 0], dtype=torch.int64, device=device)


def active(group) -> bool:
    """Facade calls on ``group`` are negotiated: the global set, the check on, more than one rank."""
    return group is None and mismatch_check_enabled() and dist.is_initialized() and dist.get_world_size() > 1


def probe(code: int, desc: dict, group=None) -> tuple[int, int, int]:
    """The 24-byte MAX of ``[code, -code, joined]``: ``(highest code, -lowest code, anyone joined)``.
    A timeout becomes one line naming ``desc`` and where the other ranks are."""
    joined = int(code == NOBODY)
    t = torch.tensor([code, NOBODY if joined else -code, joined], dtype=torch.int64, device=default_device(group))
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as err:
        if joined or "timed out" not in str(err).lower():
            raise
        raise CollectiveMismatchError(_not_made_in_time(desc, dist.get_world_size(group))) from err
    high, low, anyone = t.tolist()
    return high, low, anyone


def exchange(entry: dict, group=None) -> list[dict]:
    """Every rank's entry of a full round: ``{"call": desc or None, "sync": name or None,
    "pending": [desc, ...], "joined": bool}``."""
    every: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(every, entry, group=group)
    return every


@dataclass
class Plan:
    """What a full round decided, the same on every rank: the named collectives every training rank
    has submitted (``ready``, started in this order) and the blocking call they all make (``call``)."""

    ready: list
    call: dict | None
    joined: list  # global ranks inside join()


def _ranks(group, n: int) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(n))


def plan(every: list[dict], group=None) -> Plan:
    """Decide a full round from every rank's entry (:func:`exchange`). Raises
    :class:`CollectiveMismatchError` on every rank when two ranks describe the same name
    differently, when the ranks' blocking calls differ, or when no rank can go on."""
    ranks = _ranks(group, len(every))
    training = [e for e in every if not e["joined"]]
    joined = [r for r, e in zip(ranks, every) if e["joined"]]
    by_name = [{d["name"]: d for d in e["pending"]} for e in training]
    ready = [d for d in training[0]["pending"] if all(d["name"] in b for b in by_name)]
    for d in ready:
        descs = [b[d["name"]] for b in by_name]
        if any(x != descs[0] for x in descs[1:]):
            raise CollectiveMismatchError(describe_mismatch(
                [_JOINED if e["joined"] else next(x for x in e["pending"] if x["name"] == d["name"])
                 for e in every], group))
    calls = [e["call"] for e in training]
    call = None
    if all(c is not None for c in calls):
        if any(c != calls[0] for c in calls[1:]):
            raise CollectiveMismatchError(describe_mismatch(
                [e["call"] or _JOINED for e in every], group))
        call = calls[0]
    elif not ready:
        raise CollectiveMismatchError(_stuck(every, ranks))
    return Plan(ready, call, joined)


def _stuck(every: list[dict], ranks: list[int]) -> str:
    """The one line for a round in which no rank can go on (a name submitted on some ranks only)."""
    def where(e: dict) -> str:
        if e["joined"]:
            return "has joined"
        if e["call"] is not None:
            return f"is in {e['call']['call']} {e['call']['name']!r}"
        return f"waits for {e['sync']!r}"
    pending = sorted({d["name"] for e in every for d in e["pending"]})
    by = {n: [r for r, e in zip(ranks, every) if any(d["name"] == n for d in e["pending"])] for n in pending}
    return ("phalanx: no rank can go on: " + "; ".join(f"rank {r} {where(e)}" for r, e in zip(ranks, every))
            + "; submitted so far: " + (", ".join(f"{n!r} by ranks {by[n]}" for n in pending) or "nothing")
            + ". A named asynchronous collective starts once every rank has submitted it: submit the same "
            "names on every rank")


def refusal(desc: dict, joined: list) -> str | None:
    """Why the training ranks cannot make ``desc`` while ``joined`` ranks are inside join() (they raise
    this; the joined ranks skip it), or None."""
    if not joined:
        return None
    if desc["call"] in REFUSED_WITH_JOIN:
        return (f"phalanx: {desc['call']} {desc['name']!r} while rank(s) {joined} have joined: as in Horovod, "
                f"{desc['call']} is not supported with join (only allreduce is, with zeros from the joined "
                "ranks); make it before join() or after every rank has joined")
    root = desc.get("root")
    if root is not None and root in joined:
        return (f"phalanx: {desc['call']} {desc['name']!r} has root_rank {root}, which has already joined; "
                "a joined rank has no data to send: choose a root that has not called join()")
    return None


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


def next_request(group=None) -> tuple[str, Plan | None]:
    """Joined rank: wait for the others' next move. ``("done", None)`` when every rank has joined,
    ``("step", None)`` for an optimizer step, ``("round", plan)`` for facade collectives (answer
    ``plan.ready`` and ``plan.call`` unless :func:`refusal` says the training ranks refuse them)."""
    high, _, _ = probe(NOBODY, _JOINED, group)
    if high == NOBODY:
        return "done", None
    if high == STEP:
        return "step", None
    return "round", plan(exchange({"call": None, "sync": None, "pending": [], "joined": True}, group), group)


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
