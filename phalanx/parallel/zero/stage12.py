"""ZeRO stages 1 and 2: full parameters on every rank, sharded optimizer state (and gradients).

Gradients go through the data-parallel :class:`~phalanx.parallel.data.gradients.GradientEngine`
(its hooks, buckets launched strictly in one order, end-of-backward callback,
``backward_passes_per_step`` accumulation); ZeRO plugs in its per-bucket reduction,
:class:`ShardReduction`: a reduce-scatter into the owner's gradient shard instead of an
allreduce back into ``p.grad``. The engine's buckets are ZeRO's units: a fixed plan,
padded to a multiple of N (the fp32 master shard is laid out from it). The stages differ
in where a gradient lives until its reduction:

- Stage 1 (P_os): every parameter's ``.grad`` is a view into its bucket's persistent
  padded flat (DDP's ``gradient_as_bucket_view``), so autograd accumulates in place and
  nothing is copied. Micro-batches accumulate locally; only the backward that ends the
  accumulation (``backward_passes_per_step``) reduce-scatters straight from the flats.
- Stage 2 (P_os+g): the engine's bucket flats get no storage. Each gradient, as it
  arrives (the engine's ``on_grad``), is copied into its bucket's pooled send buffer and
  dropped (``p.grad = None``); a complete bucket is reduce-scattered. At most
  ``max_in_flight`` buffers (one, as FSDP2) are in flight plus the one filling, and the
  pool is freed after backward, so full-size gradient memory is never held::

    backward:  p9.grad → bucket 0 buf ┐ complete → reduce_scatter(async) → shard[bucket 0] ┐ overlaps
               p8.grad → bucket 0 buf ┘                                                    │ the rest
               p7.grad → bucket 1 buf (waits bucket 0 first) … complete → reduce_scatter ──┘ of backward
    end:       launch what is left (in bucket order) · wait · shard /= N
    step():    inner optimizer on the fp32 shard → allgather into each unit's param flat

Buckets launch strictly in one fixed order that every rank shares, so ranks whose
backward visits parameters in a different order still pair their collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm.collectives import reduce_scatter_flat
from phalanx.comm.compression.codecs import NoneCompressor
from phalanx.parallel.data.config import EngineConfig
from phalanx.parallel.data.gradients import GradientEngine
from phalanx.parallel.data.reduction import BucketReduction
from phalanx.parallel.zero.shard import Unit, gather_into, reduces_in_place

__all__ = ["ShardReduction", "shard_engine", "Stage12"]


class ShardReduction(BucketReduction):
    """The engine's per-bucket reduction for ZeRO: reduce-scatter into the owner's gradient shard.

    ``order[i] = (g, unit)``: bucket ``i`` is ``unit`` of parameter group ``g``;
    ``grad_shards[g]`` (or ``None`` to allocate at the first reduce, stage 1) is the
    rank's flat gradient shard of group ``g`` in the compute dtype, averaged over ranks
    and accumulated across micro-batches until :meth:`zero`. ``keep_full=True`` is stage
    1 (persistent flats, gradients as views); otherwise gradients are copied into pooled
    send buffers and dropped. ``on_unit_complete(unit)`` runs once every gradient of a unit is in
    (stage 3 frees the unit's parameters there); ``on_backward_end()`` at the end of every
    backward. ``compressor``: a summable one (``fp16``/``bf16`` casts) for what goes on the wire.
    """

    def __init__(
        self,
        order: Sequence[tuple[int, Unit]],
        grad_shards: list[torch.Tensor | None],
        group,
        *,
        keep_full: bool = False,
        max_in_flight: int = 1,
        on_unit_complete: Callable[[Unit], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
        compressor=None,
    ) -> None:
        self.order = list(order)
        self.grad_shards = grad_shards
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_place = reduces_in_place(group)
        self.keep_full = keep_full
        self.max_in_flight = max(1, max_in_flight)
        self.on_unit_complete = on_unit_complete
        self.on_backward_end = on_backward_end
        self.compressor = compressor if compressor is not None else NoneCompressor()
        self._fresh = [True] * len(self.order)  # shard slice not yet written since zero()
        self._in_flight: list = []  # buckets launched, not finished (stages 2, 3)
        self.reduced = False  # stage 1: the flats' contents are already in the shard
        self._reduced_pass = -1  # the backward pass that reduced them
        self._pool: list[torch.Tensor] = []  # stages 2, 3: send buffers, reused within a backward
        self._bufs: dict[int, torch.Tensor] = {}  # bucket index -> send buffer being filled
        self._written: dict[int, set[int]] = {}
        self._offset = {id(p): off for _, u in self.order for p, off in zip(u.params, u.offsets)}
        self._capacity = max((u.padded for _, u in self.order), default=0)
        self._finished = 0

    def _second_backward(self) -> RuntimeError:
        return RuntimeError(
            "zero(stage=1): a second backward reached gradients that were already reduced, with no "
            "forward through the wrapped model in between; sum the losses and call backward once, "
            "or run a new forward per backward"
        )

    # -- called by the engine ------------------------------------------------------------------
    def complete(self, bucket) -> None:
        if self.on_unit_complete is not None:
            self.on_unit_complete(self.order[bucket.index][1])

    def _pass(self) -> int:
        """The engine's index of the backward pass now running (its end-of-backward counts it first)."""
        return self.ctx.pass_index

    def end_of_backward(self, synced: bool) -> None:
        if self.keep_full and self.reduced and self._reduced_pass != self.ctx.pass_index:
            raise self._second_backward()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def launch(self, bucket) -> None:
        i = bucket.index
        g, u = self.order[i]
        if self.keep_full:
            now = self._pass()
            if self.reduced and self._reduced_pass != now:
                raise self._second_backward()
            self.reduced, self._reduced_pass = True, now
            self.ctx.gather_grads(bucket)  # nothing to copy unless someone replaced a .grad
            src = bucket.flat
        else:
            src = self._copy_out(bucket)
        shard = self.grad_shards[g]
        if shard is None:  # stage 1: the shard exists only between the reduce and step()
            shard = self.grad_shards[g] = torch.zeros(
                sum(uu.shard_numel for gg, uu in self.order if gg == g), dtype=src.dtype, device=src.device)
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
        bucket.handle = (out, ctx, src, work)
        self.ctx.count_bytes(self.ctx.ring_bytes(payload.nbytes))
        if not self.keep_full:
            self._in_flight.append(bucket)

    def finish(self, bucket) -> None:
        if bucket.handle is None:
            return
        out, ctx, src, work = bucket.handle
        bucket.handle = None
        work.wait()
        out = self.compressor.decompress(out, ctx)
        i = bucket.index
        g, u = self.order[i]
        view = self.grad_shards[g][u.shard_offset : u.shard_offset + u.shard_numel]
        if self._fresh[i] and out.data_ptr() == view.data_ptr():
            view.div_(self.world)
        elif self._fresh[i]:
            torch.div(out, self.world, out=view)
        else:
            view.add_(out, alpha=1.0 / self.world)
        self._fresh[i] = False
        if not self.keep_full:
            self._in_flight.remove(bucket)
            self._pool.append(src._base if src._base is not None else src)  # back at full capacity
            self._finished += 1
            if self._finished == len(self.order):  # the pass is done: no full gradient outlives it
                self._pool.clear()
                self._finished = 0

    def _acquire(self, bucket) -> torch.Tensor:
        """A pooled send buffer for ``bucket``: at most ``max_in_flight`` are in flight (the
        oldest is finished first) plus the one filling; reused within a backward, freed after it."""
        while len(self._in_flight) >= self.max_in_flight:
            self.finish(self._in_flight[0])
        if self._pool:
            return self._pool.pop()[: bucket.padded]
        p0 = bucket.params[0]
        return torch.empty(self._capacity, dtype=p0.dtype, device=p0.device)[: bucket.padded]

    def on_grad(self, p: torch.Tensor, bucket) -> None:
        """Stages 2, 3: copy the gradient into its bucket's send buffer and drop it at once."""
        if self.keep_full:
            return
        i = bucket.index
        buf = self._bufs.get(i)
        if buf is None:
            buf = self._bufs[i] = self._acquire(bucket)
            self._written[i] = set()
        off = self._offset[id(p)]
        buf[off : off + p.numel()].copy_(p.grad.reshape(-1))
        self._written[i].add(id(p))
        p.grad = None  # the non-owned part of this gradient is never kept

    def _copy_out(self, bucket) -> torch.Tensor:
        """Stages 2, 3 at launch: the bucket's send buffer, with zeros where no gradient came."""
        i = bucket.index
        buf = self._bufs.pop(i, None)
        written = self._written.pop(i, set())
        if buf is None:
            buf = self._acquire(bucket)
        for p, off in zip(bucket.params, bucket.offsets):
            if id(p) in written:
                continue
            n = p.numel()
            if p.grad is None:
                buf[off : off + n].zero_()
            else:  # accumulated outside a reducing pass
                buf[off : off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        buf[bucket.numel :].zero_()
        return buf

    # -- driven by the optimizer -----------------------------------------------------------------
    def zero(self) -> None:
        self._fresh = [True] * len(self.order)
        self._pool.clear()
        self._bufs.clear()
        self._written.clear()
        self._finished = 0
        for s in self.grad_shards:
            if s is not None:
                s.zero_()


def shard_engine(
    units: Sequence[Sequence[Unit]],
    grad_shards: list[torch.Tensor | None],
    group,
    *,
    keep_full: bool = False,
    passes_per_reduce: int = 1,
    registration: dict[int, int] | None = None,
    compressor=None,
    on_unit_complete: Callable[[Unit], None] | None = None,
    on_backward_end: Callable[[], None] | None = None,
) -> tuple[GradientEngine, ShardReduction]:
    """A :class:`GradientEngine` whose buckets are ``units`` (per group) and whose reduction is ZeRO's.

    One launch order for every rank: the unit holding the most recently registered
    parameter goes first (backward visits the model roughly in reverse). Stage 1
    (``keep_full``) reduces on every ``passes_per_reduce``-th backward and waits in
    ``step()``; stages 2 and 3 reduce and wait in every backward.

    Example::

        engine, reduction = shard_engine([units], [torch.zeros(shard_numel)], group)
        loss.backward()            # reduce-scatters launched as buckets complete, waited at the end
    """
    flat = [(g, u) for g, us in enumerate(units) for u in us]
    reg = registration or {id(p): k for k, (_, u) in enumerate(flat) for p in u.params}
    order = sorted(flat, key=lambda gu: -max(reg[id(p)] for p in gu[1].params))
    reduction = ShardReduction(order, grad_shards, group, keep_full=keep_full, compressor=compressor,
                               on_unit_complete=on_unit_complete, on_backward_end=on_backward_end)
    named = [(n, p) for _, u in order for n, p in zip(u.names, u.params)]
    world = dist.get_world_size(group)
    engine = GradientEngine(named, EngineConfig(
        group=group, bucket_mb=1.0, algorithm="flat",
        plan=[u.params for _, u in order], pad_to=world, lazy_buckets=not keep_full,
        backward_passes_per_step=passes_per_reduce if keep_full else 1,
        wait_in_backward=not keep_full, gradient_as_bucket_view=keep_full,
    ), reduction=reduction)
    return engine, reduction


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
        self.grad_engine, self.reduction = shard_engine(
            units, self.grad_shards, group, keep_full=stage == 1, passes_per_reduce=passes_per_reduce,
            registration=registration, compressor=compressor)
        if stage == 1:
            self._bind_grads()

    def _bind_grads(self) -> None:
        """Stage 1: every ``.grad`` is a view into its bucket's flat (autograd accumulates in place)."""
        for bucket in self.grad_engine.buckets.buckets:
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    def before_forward(self) -> None:
        """Stage 1: a new forward after a reduce moves on from the already-counted flats."""
        red = self.reduction
        if self.stage == 1 and red.reduced and torch.is_grad_enabled():
            self.grad_engine.wait()
            for bucket in self.grad_engine.buckets.buckets:
                bucket.flat.zero_()
            red.reduced = False

    def flush(self) -> None:
        """Reduce whatever is not reduced yet (stage 1 stepping before its last pass) and wait."""
        if self.stage == 1 and not self.reduction.reduced:
            self.grad_engine.launch_all()
            self.reduction.reduced = True
        self.grad_engine.wait()

    def grad_shards_for_step(self) -> list[torch.Tensor]:
        """The rank's averaged gradient shard of each group (compute dtype)."""
        self.flush()
        return [s if s is not None else torch.zeros_like(m, dtype=self.compute_dtype)
                for s, m in zip(self.grad_shards, self.masters)]

    def after_step(self) -> None:
        self.grad_engine.reset_passes()
        if self.stage == 1:  # stage 1 keeps only the full flats between steps
            self.grad_shards[:] = [None] * len(self.grad_shards)
            self.reduction._fresh = [True] * len(self.reduction.order)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Stage 1's .grad are views into the persistent flats: zeroed, never set to None.
        self.grad_engine.wait()
        self.grad_engine.reset_passes()
        self.reduction.zero()
        if self.stage == 1:
            for bucket in self.grad_engine.buckets.buckets:
                bucket.flat.zero_()
            self._bind_grads()
            self.reduction.reduced = False

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
        return grad_bytes(self.grad_engine, self.grad_shards)


def grad_bytes(engine: GradientEngine, grad_shards) -> int:
    """Bytes of gradient memory held now: bucket flats that have storage (stage 1) and shards."""
    flats = sum(b.flat.untyped_storage().nbytes() for b in engine.buckets.buckets)
    return flats + sum(s.numel() * s.element_size() for s in grad_shards if s is not None)
