"""Adasum: adaptive summation of the ranks' vectors (Maleki et al., "Scaling Distributed Training
with Adaptive Summation", MLSys 2021), as Horovod computes it on CPU.

Two vectors combine as ``(1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b``: equal vectors give the
vector, orthogonal ones their sum. The ranks combine in a binary tree, ``((0,1),(2,3))…``,
computed by recursive vector halving and distance doubling (Horovod's VHDD): at level
``d = 1, 2, 4, …`` a rank swaps half of the part it holds with rank ``rank ^ d``, the block of
``2d`` ranks sums its partial dot products and norms (one small allreduce per level), and each
rank combines its half; then the halves travel back the same way::

    level 1:  0 ⇄ 1   2 ⇄ 3      each keeps half of the vector, combined pairwise
    level 2:  0 ⇄ 2   1 ⇄ 3      each keeps a quarter, pairs of pairs combined
    back:     the quarters, then the halves, are swapped back: every rank holds the result

Each rank sends about twice the vector in all (as a ring allreduce). ``counts`` splits the
flat vector into tensors that get coefficients of their own (Horovod fuses several tensors
into one Adasum this way). Horovod supports power-of-two worlds only, and so does this:
other sizes raise ``ValueError`` with Horovod's reason (the Horovod facade raises it as
``HorovodInternalError``).

Example::

    flat = torch.cat([g.reshape(-1) for g in grads])
    adasum_(flat, [g.numel() for g in grads], group=None)   # in place, on every rank
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm.mismatch import CollectiveMismatchError, describe_mismatch

__all__ = ["combine", "adasum_", "NORM_EPS", "is_power_of_two"]

NORM_EPS = 1e-8
"""Below this squared norm a vector's coefficient stays 1 (Horovod's threshold)."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors (the formula, computed in float64; the reference the tree follows)."""
    a64, b64 = a.double(), b.double()
    dot, aa, bb = (a64 * b64).sum(), (a64 * a64).sum(), (b64 * b64).sum()
    ca = 1 - dot / (2 * aa) if aa >= NORM_EPS else torch.ones((), dtype=torch.float64)
    cb = 1 - dot / (2 * bb) if bb >= NORM_EPS else torch.ones((), dtype=torch.float64)
    return (ca * a64 + cb * b64).to(a.dtype)


def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _swap(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    """Send ``send`` to ``peer`` and receive its part into ``recv`` (sizes agree on both sides)."""
    works = []
    if send.numel():
        works.append(dist.isend(send.contiguous(), peer))
    if recv.numel():
        works.append(dist.irecv(recv, peer))
    for w in works:
        w.wait()


def _check(flat: torch.Tensor, counts: Sequence[int], group, name) -> None:
    """Raise on every rank when the ranks disagree on the vector (before any point-to-point
    transfer, which would otherwise wait for sizes that never come)."""
    desc = {"call": "allreduce", "name": name, "op": "adasum", "dtype": str(flat.dtype),
            "shape": (flat.numel(),), "counts": tuple(counts)}
    h = int.from_bytes(hashlib.blake2b(repr(sorted(desc.items())).encode(), digest_size=7).digest(), "little")
    probe = torch.tensor([h, -h], dtype=torch.int64, device=flat.device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[0]) == -int(probe[1]):
        return
    every: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(every, desc, group=group)
    raise CollectiveMismatchError(describe_mismatch(every, group))


def adasum_(flat: torch.Tensor, counts: Sequence[int] | None = None, *, group=None, check: bool = True,
            name: str | None = None) -> torch.Tensor:
    """Replace the 1-D floating point ``flat`` by the Adasum of every rank's ``flat``, in place.

    ``counts``: the sizes of the tensors packed in ``flat`` (each gets its own coefficients);
    default one tensor. Raises ``ValueError`` for a world that is not a power of two.
    ``check``: first compare the ranks' calls (one 16-byte allreduce), as other collectives do.
    """
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    counts = [flat.numel()] if counts is None else [int(c) for c in counts]
    if sum(counts) != flat.numel():
        raise ValueError(f"adasum_: counts add up to {sum(counts)}, the vector has {flat.numel()} elements")
    if n == 1:
        return flat
    if not is_power_of_two(n):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, the group has {n} (Horovod: 'Running "
                         "Adasum with non-power-of-two ranks is not supported yet'); use 2, 4, 8, … ranks or "
                         "op=Average")
    if check:
        _check(flat, counts, group, name)
    me = dist.get_rank(group)
    starts = torch.tensor([0] + counts[:-1]).cumsum(0).tolist()
    lo, hi = 0, flat.numel()
    history = []  # (level, kept part, given part) for the way back
    level = 1
    while level < n:
        peer = _peer(group, me ^ level)
        mid = lo + (hi - lo) // 2
        upper = bool(me & level)
        keep, give = ((mid, hi), (lo, mid)) if upper else ((lo, mid), (mid, hi))
        theirs = torch.empty(keep[1] - keep[0], dtype=flat.dtype, device=flat.device)
        _swap(flat[give[0]:give[1]], theirs, peer)
        mine = flat[keep[0]:keep[1]]
        left, right = (theirs, mine) if upper else (mine, theirs)
        # this rank's share of every tensor's a·b, |a|², |b|² over its part; the block of 2·level
        # ranks (those combined so far on both sides) holds the whole vectors between them
        blocks = n // (2 * level)
        stats = torch.zeros(blocks, len(counts), 3, dtype=torch.float64, device=flat.device)
        pieces = []
        for i, (s, c) in enumerate(zip(starts, counts)):
            a, b = max(s, keep[0]), min(s + c, keep[1])
            if a >= b:
                continue
            la, rb = left[a - keep[0]:b - keep[0]].double(), right[a - keep[0]:b - keep[0]].double()
            stats[me // (2 * level), i] = torch.stack([(la * rb).sum(), (la * la).sum(), (rb * rb).sum()])
            pieces.append((i, a - keep[0], b - keep[0]))
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        dot, aa, bb = stats[me // (2 * level)].unbind(1)
        ca = torch.where(aa >= NORM_EPS, 1 - dot / (2 * aa), torch.ones_like(aa)).tolist()
        cb = torch.where(bb >= NORM_EPS, 1 - dot / (2 * bb), torch.ones_like(bb)).tolist()
        out = torch.empty_like(mine)
        for i, a, b in pieces:
            torch.add(left[a:b] * ca[i], right[a:b], alpha=cb[i], out=out[a:b])
        mine.copy_(out)
        history.append((level, keep, give))
        lo, hi = keep
        level *= 2
    for level, keep, give in reversed(history):
        _swap(flat[keep[0]:keep[1]], flat[give[0]:give[1]], _peer(group, me ^ level))
    return flat
