"""ZeRO's flat partition: parameters packed into units, each unit split evenly across ranks.

A *unit* is a list of whole parameters flattened end to end and padded to a
multiple of the world size N; rank r owns elements ``[r*s, (r+1)*s)`` of it,
``s = padded / N``. Balance is by element count: every rank owns exactly ``s``
elements of every unit, however the parameters fall (a parameter may straddle
two owners). Units are gradient buckets for stages 1 and 2 and modules for
stage 3. One rank's pieces of every unit of a parameter group, end to end,
form that group's *shard* — the one flat fp32 tensor its inner optimizer steps::

    unit 0  [ w0 ........ | b0 | w1 ...... |pad]      unit 1  [ w2 ..... | b2 |pad]
             \\_ rank 0 _/ \\__ rank 1 ___/                    \\_ r0 _/ \\_ r1 _/
    shard (rank 0) = [ unit0[0:s0] | unit1[0:s1] ]

It also holds the two unit-level collectives (``gather_into``, ``reduces_in_place``)
and the chunking of a shard for the inner optimizer (``chunks``). The checkpoint
formats built on this layout are in :mod:`phalanx.parallel.zero.checkpoint`.

Example::

    units = build_units([("w", w), ("b", b)], world=2, bucket_numel=1 << 20)
    units[0].owned(rank=1)            # (start, stop) of rank 1's slice of unit 0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm.collectives import all_gather_flat
from phalanx.runtime.backends import engine

__all__ = [
    "Unit", "build_units", "assign_shard_offsets", "segments", "gather_into", "reduces_in_place", "chunks",
    "CHUNK_NUMEL",
]

# The inner optimizer steps the flat shard in views of this many elements: its temporaries
# (Adam: two of a parameter's size) then stay this small instead of the whole shard's size.
CHUNK_NUMEL = 1 << 20


@dataclasses.dataclass
class Unit:
    """Whole parameters flattened end to end, padded to a multiple of ``world``."""

    names: list[str]
    params: list[torch.nn.Parameter]
    shapes: list[torch.Size]
    offsets: list[int]  # start of each parameter in the unit's flat
    numel: int
    world: int
    shard_offset: int = 0  # where this unit's slice starts in the rank's group shard

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.world) * self.world if self.numel else 0

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world

    def owned(self, rank: int) -> tuple[int, int]:
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def flatten(self, dtype: torch.dtype | None = None, tensors: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """A new padded flat holding ``tensors`` (default: the parameters' data)."""
        tensors = [p.detach() for p in self.params] if tensors is None else tensors
        dtype = dtype or tensors[0].dtype
        flat = torch.zeros(self.padded, dtype=dtype, device=tensors[0].device)
        for t, off in zip(tensors, self.offsets):
            flat[off : off + t.numel()].copy_(t.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a padded flat, shaped like the parameter."""
        return [flat[off : off + math.prod(shape)].view(shape) for shape, off in zip(self.shapes, self.offsets)]


def _unit(named: Sequence[tuple[str, torch.nn.Parameter]], world: int) -> Unit:
    offsets, off = [], 0
    for _, p in named:
        offsets.append(off)
        off += p.numel()
    return Unit(
        names=[n for n, _ in named],
        params=[p for _, p in named],
        shapes=[p.shape for _, p in named],
        offsets=offsets,
        numel=off,
        world=world,
    )


def build_units(
    named: Sequence[tuple[str, torch.nn.Parameter]], world: int, bucket_numel: int | None,
    alone: frozenset[int] | set[int] = frozenset(),
) -> list[Unit]:
    """Pack parameters, in the given order, into units of about ``bucket_numel`` elements.

    ``bucket_numel=None`` makes one unit of all of them (a stage-3 module). A parameter whose id
    is in ``alone`` gets a unit of its own (a copy tied across pipeline stages: the same layout on
    every stage, see :mod:`phalanx.parallel.zero.tied`), after the others.
    """
    solo = [_unit([(name, p)], world) for name, p in named if id(p) in alone]
    named = [(name, p) for name, p in named if id(p) not in alone]
    if bucket_numel is None:
        return ([_unit(named, world)] if named else []) + solo
    units, current, size = [], [], 0
    for name, p in named:
        if current and size + p.numel() > bucket_numel:
            units.append(_unit(current, world))
            current, size = [], 0
        current.append((name, p))
        size += p.numel()
    if current:
        units.append(_unit(current, world))
    return units + solo


def assign_shard_offsets(units: Sequence[Unit]) -> int:
    """Lay the units' slices end to end in the rank's shard; returns the shard's length."""
    off = 0
    for u in units:
        u.shard_offset = off
        off += u.shard_numel
    return off


def segments(units: Sequence[Unit], rank: int) -> list[tuple[str, int, int, int]]:
    """Rank's pieces of parameters: ``(name, start_in_param, numel, offset_in_shard)``.

    This is what a sharded checkpoint records, so that any other world size can
    find, for each element it owns, which saved piece holds it.
    """
    out = []
    for u in units:
        lo, hi = u.owned(rank)
        for name, shape, off in zip(u.names, u.shapes, u.offsets):
            n = math.prod(shape)
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((name, a - off, b - a, u.shard_offset + a - lo))
    return out


def reduces_in_place(group) -> bool:
    """True on gloo, where ``reduce_scatter_tensor`` clones its input and allreduces the clone.

    ZeRO then allreduces its own (disposable) gradient buffer in place and reads
    the owned chunk: the same traffic as gloo's reduce-scatter without a
    full-size temporary. NCCL gets a true reduce-scatter.
    """
    return engine(group) == "gloo"


class _AllDone:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def gather_into(flat: torch.Tensor, mine: torch.Tensor, group, rank: int, world: int):
    """Allgather every rank's ``mine`` into ``flat`` (rank r's chunk at ``[r*s, (r+1)*s)``), async.

    On gloo, ``all_gather_into_tensor`` stages the whole output in a temporary of
    ``flat``'s size and copies it back, so this writes the rank's own chunk in
    place and broadcasts each chunk from its owner instead (the same bytes on
    the wire, no temporary; torch's ZeroRedundancyOptimizer does the same).
    """
    if not reduces_in_place(group):
        return all_gather_flat(flat, mine.to(flat.dtype), group=group, async_op=True)
    s = mine.numel()
    flat[rank * s : (rank + 1) * s].copy_(mine)
    return _AllDone([
        dist.broadcast(flat[r * s : (r + 1) * s], src=dist.get_global_rank(group, r) if group is not None else r,
                       group=group, async_op=True)
        for r in range(world)
    ])


def chunks(flat: torch.Tensor, cuts: Sequence[int] = ()) -> list[torch.Tensor]:
    """Views of ``flat`` of :data:`CHUNK_NUMEL` elements (the last one shorter): the inner optimizer's parameters.

    ``cuts``: offsets where a view must start, each segment between them chunked from its own
    start (a tied copy's slice: 8-bit state quantizes in blocks from the start of each view, so
    the copies on two stages are quantized alike only if their slices start views of their own).
    """
    bounds = sorted({0, flat.numel(), *cuts})
    return [flat[i : min(i + CHUNK_NUMEL, b)] for a, b in zip(bounds, bounds[1:])
            for i in range(a, b, CHUNK_NUMEL)] or [flat]
