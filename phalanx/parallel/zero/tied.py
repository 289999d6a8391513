"""ZeRO on a pipeline stage holding a copy of a parameter tied across stages (a head tied to the embedding).

A pipeline cut by module path keeps a copy of a tied parameter on every stage that uses it
(:func:`phalanx.parallel.pipeline.split_by_path`; Megatron-LM's tied embedding, Shoeybi et al.
2019, arXiv:1909.08053). Without ZeRO the pipeline sums the copies' ``.grad`` after backward. Under
ZeRO the gradients are reduce-scattered into each stage's flat shard during backward, so ZeRO sums
them itself, after its reduction and before the inner step. Both are sums, so the order commutes::

    Σ_stages avg_dp(g_stage) = avg_dp(Σ_stages g_stage)

For the shards of two stages to line up element by element, each tied parameter is a unit of its
own on every stage (``build_units(..., alone=...)``): its flat is the parameter alone, padded to a
multiple of the dp size, so dp rank d owns the same elements of it on every stage::

    stage 0 (wte)      unit [ w ......... |pad]  →  dp rank d: grad_shard[u0.shard_offset + (0..s)]
    stage 1 (lm_head)  unit [ w ......... |pad]  →  dp rank d: grad_shard[u1.shard_offset + (0..s)]
                                                     └─ one allreduce (sum) over the pipeline group ─┘

The copies start equal (one broadcast from the first holder, before ZeRO shards them) and take the
same steps from the same summed gradient, so their master shards and Adam moments stay equal.
A stage without a copy (a middle stage) adds zeros of the same size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["TiedCopies"]


class TiedCopies:
    """The tied parameters of one stage (``stage.tied_across_stages``) and the pipeline group summing them.

    ``group``: the pipeline's process group, group rank s running stage s (``RankGrid.pp_group``).

    Example::

        tied = TiedCopies(stage_module.tied_across_stages, mesh.pp_group, device)
        tied.sync()                                           # before ZeRO shards the parameters
        tied.sum_grad_shards(units, grad_shards, dp_world)     # in step(), after the dp reduction
    """

    def __init__(self, tied: Sequence, group, device: torch.device) -> None:
        self.tied = list(tied)
        self.group = group
        self.device = device

    def alone(self) -> set[int]:
        """ids of this stage's copies: each gets a ZeRO unit of its own."""
        return {id(t.param) for t in self.tied if t.param is not None}

    @torch.no_grad()
    def sync(self) -> None:
        """Every copy takes the first holder's values (a stage without a copy sends and keeps nothing)."""
        for t in self.tied:
            root = dist.get_global_rank(self.group, t.stages[0]) if self.group is not None else t.stages[0]
            if t.param is None:
                buf = torch.empty(t.shape, device=self.device)
            else:
                buf = t.param.data.float().contiguous()
            dist.broadcast(buf, src=root, group=self.group)
            if t.param is not None:
                t.param.data.copy_(buf)

    @torch.no_grad()
    def sum_grad_shards(self, units: Sequence[Sequence], grad_shards: Sequence[torch.Tensor], dp_world: int) -> None:
        """Each copy's slice of the (dp-averaged) gradient shard summed over the pipeline, in one allreduce (fp32)."""
        where = {id(u.params[0]): (g, u) for g, us in enumerate(units) for u in us if len(u.params) == 1}
        views, parts = [], []
        for t in self.tied:
            n = math.ceil(math.prod(t.shape) / dp_world)
            if t.param is None:
                views.append(None)
                parts.append(torch.zeros(n, device=self.device))
                continue
            g, u = where[id(t.param)]
            view = grad_shards[g][u.shard_offset : u.shard_offset + u.shard_numel]
            views.append(view)
            parts.append(view.float())
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.group)
        off = 0
        for view, part in zip(views, parts):
            if view is not None:
                view.copy_(flat[off : off + part.numel()])
            off += part.numel()
