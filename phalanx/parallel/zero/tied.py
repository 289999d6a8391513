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

Only the first stage holding a copy (``stages[0]``) keeps the copy's optimizer state and steps it;
the others receive the stepped master slice (fp32: the same bytes as the gradient they sent). A
reduce plus a broadcast move what the all-reduce of every copy stepping on its own moved, and the
copy's Adam moments (8 bytes an element, 2 with 8-bit state) are kept once per pipeline instead of
once per copy. Megatron-LM keeps them on both ends (its last stage's word embedding is an ordinary
parameter with its own optimizer state, the two gradients all-reduced); ZeRO here does not have to.
A stage without a copy (a middle stage) adds zeros to the reduce and discards the broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["TiedCopies"]


class TiedCopies:
    """The tied parameters of one stage (``stage.tied_across_stages``) and the pipeline group summing them.

    ``group``: the pipeline's process group, group rank s running stage s (``RankGrid.pp_group``).

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

    def alone(self) -> set[int]:
        """ids of this stage's copies: each gets a ZeRO unit of its own."""
        return {id(t.param) for t in self.tied if t.param is not None}

    def state_elsewhere(self) -> set[int]:
        """ids of this stage's copies whose optimizer state another stage keeps (every holder but the first)."""
        return {id(t.param) for t in self.tied if t.param is not None and t.stages[0] != self.stage}

    def _by_root(self) -> list[tuple[int, list]]:
        roots: dict[int, list] = {}
        for t in self.tied:
            roots.setdefault(t.stages[0], []).append(t)
        return sorted(roots.items(), key=lambda kv: kv[0])

    @staticmethod
    def _views(tied: Sequence, units: Sequence[Sequence], flats: Sequence[torch.Tensor]) -> list:
        """Each copy's slice of this rank's flat shards (None for a copy this stage does not hold)."""
        where = {id(u.params[0]): (g, u) for g, us in enumerate(units) for u in us if len(u.params) == 1}
        out = []
        for t in tied:
            if t.param is None:
                out.append(None)
                continue
            g, u = where[id(t.param)]
            out.append(flats[g][u.shard_offset : u.shard_offset + u.shard_numel])
        return out

    @staticmethod
    def _sizes(tied: Sequence, dp_world: int) -> list[int]:
        return [-(-int(torch.Size(t.shape).numel()) // dp_world) for t in tied]

    @torch.no_grad()
    def sync(self) -> None:
        """Every copy takes the first holder's values (a stage without a copy sends and keeps nothing)."""
        for t in self.tied:
            root = dist.get_global_rank(self.group, t.stages[0])
            if t.param is None:
                buf = torch.empty(t.shape, device=self.device)
            else:
                buf = t.param.data.float().contiguous()
            dist.broadcast(buf, src=root, group=self.group)
            if t.param is not None:
                t.param.data.copy_(buf)

    @torch.no_grad()
    def reduce_grad_shards(self, units: Sequence[Sequence], grad_shards: Sequence[torch.Tensor], dp_world: int) -> None:
        """Each copy's slice of the (dp-averaged) gradient shard summed on its first holder (one fp32
        reduce per first holder); the other holders' slices are left as they were (never stepped)."""
        for root, tied in self._by_root():
            views = self._views(tied, units, grad_shards)
            flat = torch.cat([v.float() if v is not None else torch.zeros(n, device=self.device)
                              for v, n in zip(views, self._sizes(tied, dp_world))])
            dist.reduce(flat, dst=dist.get_global_rank(self.group, root), group=self.group)
            if self.stage == root:
                off = 0
                for v in views:
                    v.copy_(flat[off : off + v.numel()])
                    off += v.numel()

    @torch.no_grad()
    def send_updated(self, units: Sequence[Sequence], masters: Sequence[torch.Tensor], dp_world: int) -> None:
        """The first holder's stepped master slices broadcast to the other holders (one per first holder)."""
        for root, tied in self._by_root():
            views, sizes = self._views(tied, units, masters), self._sizes(tied, dp_world)
            if self.stage == root:
                flat = torch.cat(views)
            else:
                flat = torch.empty(sum(sizes), dtype=masters[0].dtype, device=self.device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, root), group=self.group)
            if self.stage != root:
                off = 0
                for v, n in zip(views, sizes):
                    if v is not None:
                        v.copy_(flat[off : off + n])
                    off += n
