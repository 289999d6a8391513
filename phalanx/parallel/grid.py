"""A ``dp × pp × tp`` grid of ranks, and the process groups that fall out of slicing it.

``grid = torch.arange(world).view(dp, pp, tp)``: rank = (d·pp + s)·tp + t. The
order is chosen by how much each dimension talks:

    tp  innermost: its all-reduces run inside every layer, forward and backward,
        so its ranks are consecutive — on one host, on the fastest links.
    pp  middle:    one activation per micro-batch to the next stage, point to point.
    dp  outermost: one gradient all-reduce per step, overlappable — it tolerates
        the slowest links (across hosts).

For world = 8, dp = pp = tp = 2::

    d=0  s=0: [0 1]   s=1: [2 3]        tp groups:  rows      [0,1] [2,3] [4,5] [6,7]
    d=1  s=0: [4 5]   s=1: [6 7]        pp groups:  columns   [0,2] [1,3] [4,6] [5,7]
                                        dp groups:  across d  [0,4] [1,5] [2,6] [3,7]

Every rank creates every group in the same order (``dist.new_group`` is collective).
(Named ``RankGrid``, not ``DeviceMesh``: torch's ``DeviceMesh`` is a different object, and the
two met in one script.)

Example::

    mesh = RankGrid(dp=1, pp=2, tp=2)             # on 4 ranks
    mesh.coord                                    # (d, s, t) of this rank
    mesh.tp_group, mesh.pp_ranks                  # my groups and their members
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RankGrid", "GridError"]

_DIMS = ("dp", "pp", "tp")


class GridError(ValueError):
    """The grid factors do not fit the world."""


class RankGrid:
    """The ``dp × pp × tp`` grid; ``groups(dim)`` yields every group along ``dim``."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, world_size: int | None = None,
                 rank: int | None = None) -> None:
        dist_on = dist.is_initialized()
        world = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        factors = {"dp": dp, "pp": pp, "tp": tp}
        bad = [f"{k}={v}" for k, v in factors.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise GridError(f"mesh factors must be positive integers: {', '.join(bad)}")
        if dp * pp * tp != world:
            raise GridError(
                f"dp={dp} × pp={pp} × tp={tp} = {dp * pp * tp}, but the world size is {world}; "
                f"choose factors whose product is {world}"
            )
        self.dp, self.pp, self.tp = dp, pp, tp
        self.world_size = world
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.grid = torch.arange(world).view(dp, pp, tp)
        d, s, t = (int(i) for i in (self.grid == self.rank).nonzero()[0])
        self.coord = (d, s, t)
        self._groups: dict[str, object] = {}
        if dist_on and world_size is None:
            for dim in _DIMS:  # same order on every rank: new_group is collective over the world
                for ranks in self.groups(dim):
                    g = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                    if self.rank in ranks:
                        self._groups[dim] = g
            # A second group per pipeline for its gradients (PipelineStage's grad_group: on gloo one
            # connection per direction, so neighbours sending to each other at once never stall).
            for ranks in self.groups("pp") if pp > 1 else ():
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups["pp_grad"] = g

    def groups(self, dim: str):
        """Yield the rank lists of every group along ``dim`` ("dp", "pp" or "tp")."""
        if dim not in _DIMS:
            raise ValueError(f"dim={dim!r}: use one of {_DIMS}")
        axis = _DIMS.index(dim)
        moved = self.grid.movedim(axis, -1).reshape(-1, self.grid.shape[axis])
        for row in moved:
            yield [int(r) for r in row]

    def ranks(self, dim: str) -> list[int]:
        """The members of this rank's group along ``dim``."""
        return next(g for g in self.groups(dim) if self.rank in g)

    def group(self, dim: str):
        """This rank's process group along ``dim`` (``None`` when torch.distributed is not up)."""
        if dim not in _DIMS:
            raise ValueError(f"dim={dim!r}: use one of {_DIMS}")
        return self._groups.get(dim)

    @property
    def pp_grad_group(self):
        """This rank's second pipeline group, for gradients (``None`` when pp = 1 or torch.distributed is not up)."""
        return self._groups.get("pp_grad")

    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    tp_group = property(lambda self: self.group("tp"))
    dp_ranks = property(lambda self: self.ranks("dp"))
    pp_ranks = property(lambda self: self.ranks("pp"))
    tp_ranks = property(lambda self: self.ranks("tp"))

    def __repr__(self) -> str:
        return f"RankGrid(dp={self.dp}, pp={self.pp}, tp={self.tp}, rank={self.rank}, coord={self.coord})"
