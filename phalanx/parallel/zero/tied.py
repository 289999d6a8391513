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
                          ── reduce (sum) to the first holder ──▶   its inner step (Adam state: here only)
                          ◀── broadcast of the updated master slice ──
    stages 1 .. P-2 (no copy): nothing (the reduce and broadcast run over a group of the holders)

Only the first stage holding a copy (``stages[0]``) keeps the copy's optimizer state and steps it;
the others receive the stepped master slice (fp32: the same bytes as the gradient they sent). A
reduce plus a broadcast move what the all-reduce of every copy stepping on its own moved, and the
copy's Adam moments (8 bytes an element, 2 with 8-bit state) are kept once per pipeline instead of
once per copy. Megatron-LM keeps them on both ends (its last stage's word embedding is an ordinary
parameter with its own optimizer state, the two gradients all-reduced); ZeRO here does not have to.
Both run over a group of the copy's holders only (:func:`~phalanx.parallel.pipeline.holder_groups`,
Megatron-LM's embedding group of the first and last stage): with 3 or more stages a middle stage,
which holds no copy, sends and receives nothing for it (before, both ran over the whole pipeline
group: a middle stage added zeros and discarded the result; ``benchmarks/tied_state.py`` measures
both at pp 4). The sum over the holders is the sum the whole group took (x + 0 is x), so the results
are bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.parallel.pipeline.by_path import held_sets, holder_groups

__all__ = ["TiedCopies"]


class TiedCopies:
    """The tied parameters of one stage (``stage.tied_across_stages``) and the groups of their holders.

    ``group``: the pipeline's process group, group rank s running stage s (``RankGrid.pp_group``); the
    copies move over a group of their holders made from it (:func:`holder_groups`: every rank of
    the world builds its ``TiedCopies`` at once).

    Example::

        tied = TiedCopies(stage_module.tied_across_stages, mesh.pp_group, device)
        tied.sync()                                            # before ZeRO shards the parameters
        skip = tied.state_elsewhere()                          # copies the inner optimizer leaves out
        tied.reduce_grad_shards(units, grad_shards)            # in step(), after the dp reduction
        inner.step(); tied.send_updated(units, masters)        # the first holder's step to the others
    """

    def __init__(self, tied: Sequence, group, device: torch.device) -> None:
        self.tied = list(tied)
        self.group = group
        self.device = device
        self.stage = dist.get_rank(group)
        self.groups = holder_groups(self.tied, group)
        """{stages holding a copy: their group}, for the sets this stage is in ({} on a middle stage)"""

    def alone(self) -> set[int]:
        """ids of this stage's copies: each gets a ZeRO unit of its own."""
        return {id(t.param) for t in self.tied if t.param is not None}

    def state_elsewhere(self) -> set[int]:
        """ids of this stage's copies whose optimizer state another stage keeps (every holder but the first)."""
        return {id(t.param) for t in self.tied if t.param is not None and t.stages[0] != self.stage}

    def _by_holders(self) -> list[tuple[object, int, list]]:
        """(group, global rank of the first holder, the copies) per set of holders this stage is in."""
        return [(g, dist.get_global_rank(self.group, s[0]), ts) for s, g, ts in held_sets(self.tied, self.groups)]

    @staticmethod
    def _views(tied: Sequence, units: Sequence[Sequence], flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each copy's slice of this rank's flat shards."""
        where = {id(u.params[0]): (g, u) for g, us in enumerate(units) for u in us if len(u.params) == 1}
        out = []
        for t in tied:
            g, u = where[id(t.param)]
            out.append(flats[g][u.shard_offset : u.shard_offset + u.shard_numel])
        return out

    @torch.no_grad()
    def sync(self) -> None:
        """Every copy takes the first holder's values (a stage without a copy does nothing)."""
        for group, root, tied in self._by_holders():
            for t in tied:
                buf = t.param.data.float().contiguous()
                dist.broadcast(buf, src=root, group=group)
                t.param.data.copy_(buf)

    @torch.no_grad()
    def reduce_grad_shards(self, units: Sequence[Sequence], grad_shards: Sequence[torch.Tensor]) -> None:
        """Each copy's slice of the (dp-averaged) gradient shard summed on its first holder (one fp32
        reduce per set of holders, over them only); the other holders' slices are left as they were
        (never stepped)."""
        me = dist.get_rank()
        for group, root, tied in self._by_holders():
            views = self._views(tied, units, grad_shards)
            flat = torch.cat([v.float() for v in views])
            dist.reduce(flat, dst=root, group=group)
            if me == root:
                off = 0
                for v in views:
                    v.copy_(flat[off : off + v.numel()])
                    off += v.numel()

    @torch.no_grad()
    def send_updated(self, units: Sequence[Sequence], masters: Sequence[torch.Tensor]) -> None:
        """The first holder's stepped master slices broadcast to the other holders (one per set of holders)."""
        me = dist.get_rank()
        for group, root, tied in self._by_holders():
            views = self._views(tied, units, masters)
            flat = torch.cat(views)
            dist.broadcast(flat, src=root, group=group)
            if me != root:
                off = 0
                for v in views:
                    v.copy_(flat[off : off + v.numel()])
                    off += v.numel()
