"""ZeRO stages 1 and 2: full parameters on every rank, sharded optimizer state (and gradients).

Stage 1 (P_os): gradients stay whole on every rank through backward; ``step()``
reduce-scatters them unit by unit, so each rank receives only the average of
its own shard. Stage 2 (P_os+g): a post-accumulate-grad hook copies each
gradient into its unit's flat buffer and frees it; a full unit is reduce-scattered
asynchronously while the rest of backward runs, and only the owned slice is kept::

    stage 2 backward:  p9.grad → unit0 buf ┐ full → reduce_scatter(async) ─┐
                       p8.grad → unit0 buf ┘                                │ (overlaps backward)
                       p7.grad → unit1 buf … full → reduce_scatter(async) ─┤
    end of backward:   wait all → grad_shard[unit slice] += out / N ───────┘
    step():            inner optimizer on the fp32 shard → allgather into each unit's param flat

Parameters are views into one padded flat per unit, so the allgather writes
them in place. (The data-parallel engine's ``BucketManager`` keeps a full flat
gradient per bucket for its whole life; stage 2 must free everything but the
owned slice, so these units are our own, smaller bucketing.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.collectives import all_gather_flat, reduce_scatter_flat
from phalanx.parallel.zero_shard import Unit

__all__ = ["GradReducer", "Stage12"]


class GradReducer:
    """Backward-time reduce-scatter of gradients into per-group grad shards (stages 2 and 3).

    ``units[g]`` are group ``g``'s units; ``grad_shards[g]`` is the rank's flat gradient
    shard for that group (compute dtype), accumulated across micro-batches.
    ``on_unit_reduced(unit)`` runs once a unit's reduce-scatter is launched (stage 3
    frees the unit's full parameters there); ``on_backward_end()`` runs last.
    """

    def __init__(
        self,
        units: Sequence[Sequence[Unit]],
        grad_shards: Sequence[torch.Tensor],
        group,
        on_unit_reduced: Callable[[Unit], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.grad_shards = grad_shards
        self.on_unit_reduced = on_unit_reduced
        self.on_backward_end = on_backward_end
        self._where: dict[int, tuple[int, Unit, int]] = {}
        self._order: list[Unit] = []
        self._need: dict[int, int] = {}
        for g, group_units in enumerate(units):
            for u in group_units:
                self._order.append(u)
                self._need[id(u)] = sum(1 for p in u.params if p.requires_grad)
                for p, off in zip(u.params, u.offsets):
                    self._where[id(p)] = (g, u, off)
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._on_grad)
        self._bufs: dict[int, torch.Tensor] = {}
        self._count: dict[int, int] = {}
        self._pending: list[tuple[int, Unit, torch.Tensor, torch.Tensor, object]] = []
        self._queued = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        g, u, off = self._where[id(p)]
        buf = self._bufs.get(id(u))
        if buf is None:
            buf = self._bufs[id(u)] = torch.zeros(u.padded, dtype=p.grad.dtype, device=p.grad.device)
            self._count[id(u)] = 0
        buf[off : off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # the non-owned part of this gradient is never kept
        self._count[id(u)] += 1
        if self._count[id(u)] == self._need[id(u)]:
            self._launch(g, u)

    def _launch(self, g: int, u: Unit) -> None:
        buf = self._bufs.pop(id(u))
        out = torch.empty(u.shard_numel, dtype=buf.dtype, device=buf.device)
        work = reduce_scatter_flat(out, buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((g, u, out, buf, work))
        if self.on_unit_reduced is not None:
            self.on_unit_reduced(u)

    def _finish(self) -> None:
        # Units some of whose parameters got no gradient this pass: send what they have,
        # in unit order, which every rank shares.
        for g, group_units in enumerate(self._groups_in_order()):
            for u in group_units:
                if id(u) in self._bufs:
                    self._launch(g, u)
        for g, u, out, _buf, work in self._pending:
            work.wait()
            view = self.grad_shards[g][u.shard_offset : u.shard_offset + u.shard_numel]
            view.add_(out, alpha=1.0 / self.world)
        self._pending.clear()
        self._queued = False
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _groups_in_order(self) -> list[list[Unit]]:
        groups: dict[int, list[Unit]] = {}
        for u in self._order:
            g = self._where[id(u.params[0])][0]
            groups.setdefault(g, []).append(u)
        return [groups.get(g, []) for g in range(len(self.grad_shards))]


class Stage12:
    """Parameters as views into per-unit flats; gradients reduced at step (1) or in backward (2)."""

    def __init__(self, stage: int, units, masters, compute_dtype, group, rank: int) -> None:
        self.stage = stage
        self.units = units
        self.masters = masters
        self.group = group
        self.rank = rank
        self.world = dist.get_world_size(group)
        self.compute_dtype = compute_dtype
        self.flats: dict[int, torch.Tensor] = {}
        for g, group_units in enumerate(units):
            for u in group_units:
                full = u.flatten(dtype=masters[g].dtype)
                lo, hi = u.owned(rank)
                masters[g][u.shard_offset : u.shard_offset + u.shard_numel].copy_(full[lo:hi])
                flat = full.to(compute_dtype)
                self.flats[id(u)] = flat
                for p, v in zip(u.params, u.views(flat)):
                    p.data = v
        self.grad_shards: list[torch.Tensor] | None = None
        if stage == 2:
            self.grad_shards = [torch.zeros_like(m, dtype=compute_dtype) for m in masters]
            self.reducer = GradReducer(units, self.grad_shards, group)

    def grad_shards_for_step(self) -> list[torch.Tensor]:
        """The rank's averaged gradient shard of each group (compute dtype)."""
        if self.stage == 2:
            return self.grad_shards
        shards = []
        for g, group_units in enumerate(self.units):
            shard = torch.zeros_like(self.masters[g], dtype=self.compute_dtype)
            in_flight = None
            for u in group_units + [None]:
                launched = None
                if u is not None:
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in u.params]
                    buf = u.flatten(dtype=self.compute_dtype, tensors=grads)
                    out = shard[u.shard_offset : u.shard_offset + u.shard_numel]
                    work = reduce_scatter_flat(out, buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                    launched = (work, buf)
                if in_flight is not None:  # at most two unit buffers alive at a time
                    in_flight[0].wait()
                in_flight = launched
            shard.div_(self.world)
            shards.append(shard)
        return shards

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group_units in self.units:
            for u in group_units:
                for p in u.params:
                    if set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
        if self.grad_shards is not None:
            for s in self.grad_shards:
                s.zero_()

    def publish(self) -> None:
        """Allgather every rank's updated shard into the full parameter flats."""
        works = []
        for g, group_units in enumerate(self.units):
            for u in group_units:
                mine = self.masters[g][u.shard_offset : u.shard_offset + u.shard_numel].to(self.compute_dtype)
                works.append(all_gather_flat(self.flats[id(u)], mine, group=self.group, async_op=True))
        for w in works:
            w.wait()

    def param_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())

    def grad_bytes(self) -> int:
        if self.grad_shards is not None:
            return sum(s.numel() * s.element_size() for s in self.grad_shards)
        return sum(
            p.grad.numel() * p.grad.element_size()
            for group_units in self.units
            for u in group_units
            for p in u.params
            if p.grad is not None
        )
