"""ZeRO stages 1 and 2: full parameters on every rank, sharded optimizer state (and gradients).

Both stages reduce-scatter gradients unit by unit *during backward*, so the
communication overlaps the rest of backward, and each rank receives only the
average of its own shard. They differ in where a gradient lives until then:

- Stage 1 (P_os): every parameter's ``.grad`` is a view into one persistent
  padded flat per unit (DDP's ``gradient_as_bucket_view``), so autograd
  accumulates in place and nothing is copied. Micro-batches accumulate locally;
  only the backward that ends the accumulation (``backward_passes_per_step``)
  reduce-scatters straight from those flats.
- Stage 2 (P_os+g): a post-accumulate-grad hook copies each gradient into a
  pooled unit buffer and frees it; at most ``max_in_flight`` buffers (one, as in
  FSDP2) are in flight, so full-size gradient memory is never held::

    backward:  p9.grad → unit0 buf ┐ complete → reduce_scatter(async) → shard[unit0] ┐ overlaps
               p8.grad → unit0 buf ┘                                                 │ the rest
               p7.grad → unit1 buf … complete → reduce_scatter(async) → shard[unit1] ┘ of backward
    end:       launch what is left (in unit order) · wait · shard /= N
    step():    inner optimizer on the fp32 shard → allgather into each unit's param flat

Units launch strictly in one fixed order that every rank shares, so ranks
whose backward visits parameters in a different order still pair their
collectives. (The data-parallel engine's ``BucketManager`` is not reused: ZeRO
needs flats padded to a multiple of N and a layout fixed at wrap time, because
the fp32 master shard is laid out from it; the engine re-plans its buckets
after the first iteration.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.collectives import reduce_scatter_flat
from phalanx.comm.compression import NoneCompressor
from phalanx.parallel.zero_shard import Unit, gather_into, reduces_in_place

__all__ = ["GradReducer", "Stage12"]


class GradReducer:
    """Backward-time reduce-scatter of gradients into per-group grad shards (stages 1, 2 and 3).

    ``units[g]`` are parameter group ``g``'s units; ``grad_shards[g]`` (or ``None``
    to allocate at the first reduce, stage 1) is the rank's flat gradient shard
    of group ``g`` in the compute dtype, averaged over ranks and accumulated
    across micro-batches until :meth:`zero`. ``keep_full=True`` is stage 1
    (persistent full flats, gradients as views, reduced on every
    ``passes_per_reduce``-th backward); otherwise gradients are copied into
    pooled buffers and freed (stages 2, 3). ``on_unit_complete(unit)`` runs once
    every gradient of a unit is in (stage 3 frees the unit's parameters there);
    ``on_backward_end()`` runs last. ``registration`` maps ``id(param)`` to its
    index in ``model.parameters()`` and fixes the launch order. ``compressor``: a
    summable one (``fp16``/``bf16`` casts) applied to what goes on the wire.

    Example::

        reducer = GradReducer([units], [torch.zeros(shard_numel)], group)
        loss.backward()            # reduce-scatters launched as units complete
        reducer.wait()             # grad_shards hold this rank's averaged slice
    """

    def __init__(
        self,
        units: Sequence[Sequence[Unit]],
        grad_shards: list[torch.Tensor | None],
        group,
        *,
        keep_full: bool = False,
        passes_per_reduce: int = 1,
        max_in_flight: int = 1,
        on_unit_complete: Callable[[Unit], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
        registration: dict[int, int] | None = None,
        compressor=None,
    ) -> None:
        self.group = group
        self.compressor = compressor if compressor is not None else NoneCompressor()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_place = reduces_in_place(group)
        self.grad_shards = grad_shards
        self.keep_full = keep_full
        self.passes_per_reduce = passes_per_reduce
        self.max_in_flight = max(1, max_in_flight)
        self.on_unit_complete = on_unit_complete
        self.on_backward_end = on_backward_end
        # One launch order for every rank: the unit holding the most recently registered
        # parameter goes first (backward visits the model roughly in reverse).
        flat = [(g, u) for g, us in enumerate(units) for u in us]
        reg = registration or {id(p): k for k, (_, u) in enumerate(flat) for p in u.params}
        self.order: list[tuple[int, Unit]] = sorted(flat, key=lambda gu: -max(reg[id(p)] for p in gu[1].params))
        self._need = [sum(1 for p in u.params if p.requires_grad) for _, u in self.order]
        self._where: dict[int, tuple[int, int]] = {}
        for i, (_g, u) in enumerate(self.order):
            for p, off in zip(u.params, u.offsets):
                self._where[id(p)] = (i, off)
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._count = [0] * len(self.order)
        self._next = 0  # next unit (index into order) to launch in this pass
        self._fresh = [True] * len(self.order)  # shard slice not yet written since zero()
        self._pending: list[tuple] = []  # (unit index, out, ctx, payload, pooled buffer, work)
        self._queued = False
        self.passes = 0  # backward passes since the last zero()/step
        self.reduced = False  # stage 1: the flats' contents are already in the shard
        self._bufs: dict[int, torch.Tensor] = {}  # stages 2/3: unit -> buffer being filled
        self._written: dict[int, set[int]] = {}
        self._pool: list[torch.Tensor] = []
        self._capacity = max((u.padded for _, u in self.order), default=0)
        self.full: list[torch.Tensor | None] = [None] * len(self.order)
        if keep_full:
            for i, (_g, u) in enumerate(self.order):
                p0 = u.params[0]
                self.full[i] = torch.zeros(u.padded, dtype=p0.dtype, device=p0.device)
            self.bind_grads()

    # -- stage 1: gradients as views into the flats -----------------------------------------
    def bind_grads(self) -> None:
        for i, (_g, u) in enumerate(self.order):
            for p, view in zip(u.params, u.views(self.full[i])):
                p.grad = view

    def _sync_pass(self) -> bool:
        return not self.keep_full or self.passes + 1 >= self.passes_per_reduce

    # -- hooks --------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        i, off = self._where[id(p)]
        u = self.order[i][1]
        if self.keep_full:
            if self.reduced:
                raise RuntimeError(
                    "zero(stage=1): a second backward reached gradients that were already reduced, with no "
                    "forward through the wrapped model in between; sum the losses and call backward once, "
                    "or run a new forward per backward"
                )
            view = self.full[i][off : off + p.numel()]
            if p.grad.data_ptr() != view.data_ptr():  # someone replaced .grad (or create_graph=True)
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)
            if not self._sync_pass():
                return
        else:
            buf = self._bufs.get(i)
            if buf is None:
                buf = self._bufs[i] = self._acquire(u.padded, p.grad.dtype, p.grad.device)
                self._written[i] = set()
            buf[off : off + p.numel()].copy_(p.grad.reshape(-1))
            self._written[i].add(id(p))
            p.grad = None  # the non-owned part of this gradient is never kept
        self._count[i] += 1
        if self._count[i] == self._need[i]:
            if self.on_unit_complete is not None:
                self.on_unit_complete(u)
            self._launch_ready()

    def _launch_ready(self, everything: bool = False) -> None:
        while self._next < len(self.order):
            i = self._next
            if self._need[i] == 0:  # all frozen: no collective on any rank
                self._next += 1
                continue
            if not everything and self._count[i] < self._need[i]:
                return
            self._launch(i)
            self._next += 1

    def _acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        while len(self._pending) >= self.max_in_flight:
            self._complete(self._pending.pop(0))
        if self._pool:
            return self._pool.pop()[:numel]
        return torch.empty(self._capacity, dtype=dtype, device=device)[:numel]

    def _launch(self, i: int) -> None:
        g, u = self.order[i]
        if self.keep_full:
            src, buf = self.full[i], None
        else:
            buf = self._bufs.pop(i, None)
            if buf is None:  # no gradient reached this unit on this rank this pass
                buf = self._acquire(u.padded, u.params[0].dtype, u.params[0].device).zero_()
            else:
                written = self._written.pop(i)
                buf[u.numel :].zero_()
                for p, off in zip(u.params, u.offsets):
                    if id(p) not in written:
                        buf[off : off + p.numel()].zero_()
            src = buf
        shard = self.grad_shards[g]
        if shard is None:  # stage 1: the shard exists only between the reduce and step()
            shard = self.grad_shards[g] = torch.zeros(self._shard_numel(g), dtype=src.dtype, device=src.device)
        payload, ctx = self.compressor.compress(src)  # no compression: src itself
        if self.in_place:  # gloo (see reduces_in_place); stage 1's .grad then hold the rank sum
            lo, hi = u.owned(self.rank)
            out = payload[lo:hi]
            work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:
            view = shard[u.shard_offset : u.shard_offset + u.shard_numel]
            direct = self._fresh[i] and payload.dtype == view.dtype
            out = view if direct else torch.empty(u.shard_numel, dtype=payload.dtype, device=payload.device)
            work = reduce_scatter_flat(out, payload, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((i, out, ctx, payload, buf, work))
        self._count[i] = 0

    def _shard_numel(self, g: int) -> int:
        return sum(u.shard_numel for gg, u in self.order if gg == g)

    def _complete(self, entry) -> None:
        i, out, ctx, _payload, buf, work = entry
        work.wait()
        out = self.compressor.decompress(out, ctx)
        g, u = self.order[i]
        view = self.grad_shards[g][u.shard_offset : u.shard_offset + u.shard_numel]
        if self._fresh[i] and out.data_ptr() == view.data_ptr():
            view.div_(self.world)
        elif self._fresh[i]:
            torch.div(out, self.world, out=view)
        else:
            view.add_(out, alpha=1.0 / self.world)
        self._fresh[i] = False
        if buf is not None:  # back to the pool at full capacity
            self._pool.append(buf._base if buf._base is not None else buf)

    def _end_of_backward(self) -> None:
        self._queued = False
        if self._sync_pass():
            self._launch_ready(everything=True)  # units some of whose parameters got no gradient
            self._next = 0
            self.reduced = self.keep_full
        self.passes += 1
        if not self.keep_full:
            self.wait()
            self._pool.clear()  # nothing of the full gradient outlives backward (stages 2, 3)
        if self.on_backward_end is not None:
            self.on_backward_end()

    # -- driven by the optimizer -----------------------------------------------------------
    def before_forward(self) -> None:
        """Stage 1: a new forward after a reduce moves on from the already-counted flats."""
        if self.keep_full and self.reduced and torch.is_grad_enabled():
            self.wait()
            for f in self.full:
                f.zero_()
            self.reduced = False

    def flush(self) -> None:
        """Reduce whatever is not reduced yet (stage 1 stepping before its last pass) and wait."""
        if self.keep_full and not self.reduced:
            self._next = 0
            self._launch_ready(everything=True)
            self._next = 0
            self.reduced = True
        self.wait()

    def wait(self) -> None:
        for entry in self._pending:
            self._complete(entry)
        self._pending.clear()

    def after_step(self) -> None:
        self.passes = 0
        if self.keep_full:  # stage 1 keeps only the full flats between steps
            self.grad_shards[:] = [None] * len(self.grad_shards)
            self._fresh = [True] * len(self.order)

    def zero(self) -> None:
        self.wait()
        self.passes = 0
        self._fresh = [True] * len(self.order)
        if self.keep_full:
            for f in self.full:
                f.zero_()
            self.bind_grads()
            self.reduced = False
        for s in self.grad_shards:
            if s is not None:
                s.zero_()

    def nbytes(self) -> int:
        """Bytes of gradient memory held now: full flats (stage 1) and shards."""
        full = sum(f.numel() * f.element_size() for f in self.full if f is not None)
        return full + sum(s.numel() * s.element_size() for s in self.grad_shards if s is not None)


class Stage12:
    """Parameters as views into per-unit flats; gradients reduce-scattered in backward."""

    def __init__(self, stage: int, units, masters, compute_dtype, group, rank: int,
                 passes_per_reduce: int = 1, registration: dict[int, int] | None = None, compressor=None) -> None:
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
                del full
                self.flats[id(u)] = flat
                for p, v in zip(u.params, u.views(flat)):
                    p.data = v
        if stage == 2:
            self.grad_shards = [torch.zeros_like(m, dtype=compute_dtype) for m in masters]
        else:
            self.grad_shards = [None] * len(masters)
        self.reducer = GradReducer(units, self.grad_shards, group, keep_full=stage == 1,
                                   passes_per_reduce=passes_per_reduce, registration=registration,
                                   compressor=compressor)

    def before_forward(self) -> None:
        self.reducer.before_forward()

    def grad_shards_for_step(self) -> list[torch.Tensor]:
        """The rank's averaged gradient shard of each group (compute dtype)."""
        self.reducer.flush()
        return [s if s is not None else torch.zeros_like(m, dtype=self.compute_dtype)
                for s, m in zip(self.grad_shards, self.masters)]

    def after_step(self) -> None:
        self.reducer.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Stage 1's .grad are views into the persistent flats: zeroed, never set to None.
        self.reducer.zero()

    def publish(self) -> None:
        """Allgather every rank's updated shard into the full parameter flats."""
        works = []
        for g, group_units in enumerate(self.units):
            for u in group_units:
                mine = self.masters[g][u.shard_offset : u.shard_offset + u.shard_numel]
                works.append(gather_into(self.flats[id(u)], mine, self.group, self.rank, self.world))
        for w in works:
            w.wait()

    def param_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())

    def grad_bytes(self) -> int:
        return self.reducer.nbytes()
