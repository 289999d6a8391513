"""A ``dp × pp × ep × tp`` grid of ranks, and the process groups that fall out of slicing it.

``grid = torch.arange(world).view(dp, pp, ep, tp)``: rank = ((d·pp + s)·ep + e)·tp + t.
The order is chosen by how much each dimension talks:

    tp  innermost: its all-reduces run inside every layer, forward and backward,
        so its ranks are consecutive — on one host, on the fastest links.
    ep  next:      two all-to-alls per MoE layer, forward and backward (expert
        parallel, :mod:`phalanx.parallel.expert`); ep = 1 leaves the 3-D grid as it was.
    pp  middle:    one activation per micro-batch to the next stage, point to point.
    dp  outermost: one gradient all-reduce per step, overlappable — it tolerates
        the slowest links (across hosts).

The ranks of an ep group hold different tokens, so for the weights that are
not experts they are data parallel too: ``dense`` is the group of the ranks
holding the same (s, t), dp × ep of them, over which those gradients are
averaged; an expert's gradient is averaged over ``dp`` only (the ranks holding
the same experts). With ep = 1 the two are the same group.

For world = 8, dp = pp = tp = 2::

    d=0  s=0: [0 1]   s=1: [2 3]        tp groups:  rows      [0,1] [2,3] [4,5] [6,7]
    d=1  s=0: [4 5]   s=1: [6 7]        pp groups:  columns   [0,2] [1,3] [4,6] [5,7]
                                        dp groups:  across d  [0,4] [1,5] [2,6] [3,7]

Every rank creates every group in the same order (``dist.new_group`` is collective).
(Named ``RankGrid``, not ``DeviceMesh``: torch's ``DeviceMesh`` is a different object, and the
two met in one script.)

Example::

    mesh = RankGrid(dp=1, pp=2, tp=2)             # on 4 ranks
    mesh.coord                                    # (d, s, t) of this rank (mesh.e: its ep index)
    mesh.tp_group, mesh.pp_ranks                  # my groups and their members
    RankGrid(dp=2, ep=2).dense_ranks              # on 4 ranks: the 4 ranks averaging non-expert grads
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RankGrid", "GridError"]

_DIMS = ("dp", "pp", "ep", "tp")
_GROUPS = _DIMS + ("dense",)


class GridError(ValueError):
    """The grid factors do not fit the world."""


def _refuse_before_init(product: int) -> None:
    """A grid of several ranks asked for before ``px.init()``, or outside a launcher: say which."""
    import os

    from phalanx.runtime.env import detect_environment

    launched = detect_environment(dict(os.environ)).size  # a copy: read the variables, connect to nothing
    if launched > 1:
        raise GridError(f"RankGrid: this process is one of {launched} launched ranks but torch.distributed is not "
                        "initialised yet: call px.init() before building the grid")
    raise GridError(f"RankGrid: the grid needs {product} ranks but this process runs alone; start it with "
                    f"`phalanx run -np {product} python <script>` (and call px.init() first)")


class RankGrid:
    """The ``dp × pp × ep × tp`` grid; ``groups(dim)`` yields every group along ``dim``."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, ep: int = 1, world_size: int | None = None,
                 rank: int | None = None) -> None:
        dist_on = dist.is_initialized()
        world = world_size if world_size is not None else (dist.get_world_size() if dist_on else 1)
        factors = {"dp": dp, "pp": pp, "tp": tp, "ep": ep}
        bad = [f"{k}={v}" for k, v in factors.items() if not isinstance(v, int) or v < 1]
        if bad:
            raise GridError(f"mesh factors must be positive integers: {', '.join(bad)}")
        if dp * pp * tp * ep != world:
            if world_size is None and (not dist_on or world == 1):
                _refuse_before_init(dp * pp * tp * ep)
            named = f"dp={dp} × pp={pp} × tp={tp}" + (f" × ep={ep}" if ep > 1 else "")
            raise GridError(f"{named} = {dp * pp * tp * ep}, but the world size is {world}; "
                            f"choose factors whose product is {world}")
        self.dp, self.pp, self.tp, self.ep = dp, pp, tp, ep
        self.world_size = world
        self.rank = rank if rank is not None else (dist.get_rank() if dist_on else 0)
        self.grid = torch.arange(world).view(dp, pp, ep, tp)
        d, s, e, t = (int(i) for i in (self.grid == self.rank).nonzero()[0])
        self.coord = (d, s, t)
        self.e = e
        self._groups: dict[str, object] = {}
        if dist_on and world_size is None:
            for dim in _GROUPS if ep > 1 else ("dp", "pp", "tp"):  # same order on every rank: new_group is collective
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
        """Yield the rank lists of every group along ``dim`` ("dp", "pp", "ep", "tp", or "dense": dp × ep)."""
        if dim not in _GROUPS:
            raise ValueError(f"dim={dim!r}: use one of {_GROUPS}")
        if dim == "dense":  # the ranks of one (s, t), d-major then e
            moved = self.grid.permute(1, 3, 0, 2).reshape(-1, self.dp * self.ep)
            for row in moved:
                yield [int(r) for r in row]
            return
        axis = _DIMS.index(dim)
        moved = self.grid.movedim(axis, -1).reshape(-1, self.grid.shape[axis])
        for row in moved:
            yield [int(r) for r in row]

    def ranks(self, dim: str) -> list[int]:
        """The members of this rank's group along ``dim``."""
        return next(g for g in self.groups(dim) if self.rank in g)

    def group(self, dim: str):
        """This rank's process group along ``dim`` (``None`` when torch.distributed is not up, and
        for "ep" when ep = 1: there is no expert parallelism to do)."""
        if dim not in _GROUPS:
            raise ValueError(f"dim={dim!r}: use one of {_GROUPS}")
        if self.ep == 1 and dim in ("ep", "dense"):  # no groups of their own: dense is dp, ep is none
            return self._groups.get("dp") if dim == "dense" else None
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
    ep_group = property(lambda self: self.group("ep"))
    dense_group = property(lambda self: self.group("dense"))
    ep_ranks = property(lambda self: self.ranks("ep"))
    dense_ranks = property(lambda self: self.ranks("dense"))

    @property
    def batch_index(self) -> int:
        """Which of the dp × ep slices of the global batch this rank trains on (d-major)."""
        return self.coord[0] * self.ep + self.e

    def __repr__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"RankGrid(dp={self.dp}, pp={self.pp}, tp={self.tp}{ep}, rank={self.rank}, coord={self.coord})"
