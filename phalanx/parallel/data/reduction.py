"""How a bucket's gradients are combined across ranks: the :class:`BucketReduction` plug point.

The engine (:mod:`~phalanx.parallel.data.gradients`) owns buckets, hooks and timing; a
reduction owns the collective. The default, :class:`AllReduceReduction`, allreduces each
bucket (optionally compressed, or with a ring/hierarchical algorithm) and writes the
average back into ``p.grad``; ZeRO plugs in a reduce-scatter into the owner's gradient
shard (``phalanx.parallel.zero``)::

    bucket full ──► reduction.launch(bucket)   start an async collective, keep it in bucket.handle
    engine.wait() ─► reduction.finish(bucket)  every bucket, in order: results into place

Example::

    class Sum(BucketReduction):            # a reduction that leaves the rank-sum in the bucket
        def launch(self, bucket):
            self.ctx.gather_grads(bucket)
            bucket.handle = dist.all_reduce(bucket.flat, async_op=True)
        def finish(self, bucket):
            bucket.handle.wait()
    engine = GradientEngine(named_params, reduction=Sum())   # Sum().ctx: a ReductionContext
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

import torch

from phalanx import trace
from phalanx.comm.buckets import Bucket
from phalanx.comm.collectives import ReduceOp, allreduce
from phalanx.comm.compression.allreduce import allreduce_compressed
from phalanx.comm.compression.paths import wire
from phalanx.parallel.data.config import VIEW_MIN_NUMEL

__all__ = ["ReductionContext", "BucketReduction", "TakesGrads", "ReportsComplete", "AllReduceReduction",
           "InFlight"]


class ReductionContext:
    """What a :class:`BucketReduction` sees of its engine (``reduction.ctx``): the group and its
    size, the job's topology and algorithm, the codec, this step's scales and state, and the few
    things it may ask the engine to do. Nothing else of the engine is a reduction's business.

    Example::

        op, pre, post = self.ctx.scales()
        self.ctx.gather_grads(bucket)                # the gradients into the bucket's flat
        self.ctx.count_bytes(self.ctx.ring_bytes(bucket.nbytes))
    """

    __slots__ = ("_engine",)

    def __init__(self, engine) -> None:
        self._engine = engine

    # what the engine reduces over (changes only at an elastic re-form, which binds a new context)
    @property
    def group(self):
        return self._engine.group

    @property
    def world(self) -> int:
        return self._engine.world

    @property
    def topology(self):
        return self._engine.topology

    @property
    def algorithm(self) -> str:
        return self._engine.algorithm

    @property
    def compressor(self):
        return self._engine.compressor

    @property
    def grad_as_view(self) -> bool:
        """Leave large gradients as views into their bucket (``gradient_as_bucket_view``)."""
        return self._engine.grad_as_view

    # this step
    def scales(self) -> tuple[ReduceOp, float, float]:
        """(op, prescale, postscale) of this step (a weighted sum under a balancer's weight)."""
        return self._engine.scales()

    @property
    def shadowing(self) -> bool:
        """A joined rank's step: it sends zeros and takes part, its gradients untouched."""
        return self._engine.shadowing

    @property
    def plan_fixed(self) -> bool:
        """The bucket plan was agreed across ranks (after the first step): no per-call probe needed."""
        return self._engine.buckets.rebuilt

    @property
    def overlap(self):
        """An OptimizerOverlap stepping each piece of the average as it is final, or None."""
        return self._engine.overlap

    @property
    def pass_index(self) -> int:
        """The index of the backward pass now running (see ``GradientEngine.pass_index``)."""
        return self._engine.pass_index

    # what a reduction asks of the engine
    def gather_grads(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients into its flat (zeros for a missing one)."""
        self._engine.gather_grads(bucket)

    def check_finite(self, tensors) -> None:
        """Note inf/NaN in ``tensors`` for this step's non-finite flag (lossy codecs)."""
        self._engine.finite.check(tensors)

    def ring_bytes(self, nbytes: int) -> int:
        """What a ring allreduce of ``nbytes`` sends from each rank of the group."""
        return self._engine.ring_bytes(nbytes)

    def count_bytes(self, nbytes: int) -> None:
        """Add ``nbytes`` to what this rank sent for gradients (``bytes_sent``)."""
        self._engine.bytes_sent += nbytes


class BucketReduction:
    """How a bucket's gradients are combined across ranks, plugged into ``GradientEngine(reduction=)``.

    - ``launch(bucket)``: the bucket is complete (in the fixed launch order); start an async
      collective and keep what ``finish`` needs in ``bucket.handle``. ``self.ctx.gather_grads(bucket)``
      copies the gradients into the bucket's flat (zeros for a missing one); ``self.ctx`` (a
      :class:`ReductionContext`) is all a reduction sees of its engine.
    - ``finish(bucket)``: from ``engine.wait()`` for every bucket, in order (a bucket finished
      earlier, e.g. to bound memory in flight, has ``handle`` back at ``None``).
    - ``drain(bucket)``: wait for the collective without using its result (a joined rank
      that only takes part); by default ``finish``.
    - ``end_of_backward(synced)``: at the start of every backward's end-of-backward callback.

    Optional abilities, each a protocol of its own: ``on_grad(p, bucket)`` (:class:`TakesGrads`)
    and ``complete(bucket)`` (:class:`ReportsComplete`, only with ``plan=``).

    ``tolerates_missing``: parameters without a gradient count as zeros, so the engine does
    not insist on ``find_unused_parameters``. ``reduces_alone``: reduce in a group of one
    too (the reduction may keep state a single process needs: ZeRO's gradient shard).
    """

    tolerates_missing = True
    reduces_alone = True
    ctx: ReductionContext  # what it sees of the engine it is bound to (bind)

    def bind(self, ctx: ReductionContext) -> None:
        self.ctx = ctx

    def launch(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def drain(self, bucket: Bucket) -> None:
        self.finish(bucket)

    def end_of_backward(self, synced: bool) -> None:
        pass


@runtime_checkable
class TakesGrads(Protocol):
    """Each gradient the moment it is in (in a pass that reduces), before its bucket is marked:
    e.g. copy it into a send buffer and drop it."""

    def on_grad(self, p: torch.Tensor, bucket: Bucket) -> None: ...


@runtime_checkable
class ReportsComplete(Protocol):
    """The moment a bucket's last gradient is in, even if an earlier bucket holds up its launch."""

    def complete(self, bucket: Bucket) -> None: ...


@dataclasses.dataclass(slots=True)
class InFlight:
    """What :class:`AllReduceReduction` keeps in ``bucket.handle`` between launch and finish."""

    handle: Any  # a Handle (or _PiecesHandle) whose wait() gives the reduced payload
    ctx: Any  # the compressor's context for decompress; None when nothing to decode
    scale: float  # applied to the bucket after decoding (post-scale, 1/N of an average)


class AllReduceReduction(BucketReduction):
    """The default: allreduce every bucket (compressed, flat or ring/hierarchical) into ``p.grad``.

    A summable compressor (none, fp16, bf16) casts the bucket and allreduces the payload; a
    lossy one goes through :func:`~phalanx.comm.compression.allreduce.allreduce_compressed`
    straight from the gradients, decoding into the bucket. With ``ctx.overlap`` (an
    ``OptimizerOverlap``) each piece of the average is stepped as soon as it is final.
    """

    tolerates_missing = False
    reduces_alone = False

    def bind(self, ctx: ReductionContext) -> None:
        super().bind(ctx)
        self._stepped: dict[int, int] = {}  # bucket index -> elements the overlap stepped this iteration

    def launch(self, bucket: Bucket) -> None:
        ctx = self.ctx
        self._stepped[bucket.index] = 0
        if not ctx.compressor.summable:
            self._launch_lossy(bucket)
            return
        i, nbytes = bucket.index, bucket.nbytes
        op, pre, post = ctx.scales()
        if ctx.shadowing:
            bucket.flat.zero_()
        else:
            ctx.gather_grads(bucket)
            ctx.check_finite([bucket.flat])
            if bucket.extra:
                bucket.tail.fill_(1)  # the join flag (phalanx.parallel.data.joined): this rank steps
        with trace.span("compress", "comm", bucket=i, bytes=nbytes):
            payload, codec_ctx = ctx.compressor.compress(bucket.flat)
        ctx.count_bytes(ctx.ring_bytes(payload.nbytes))
        with trace.span("allreduce_launch", "comm", bucket=i, bytes=payload.nbytes):
            if ctx.algorithm == "flat":
                # Once the bucket plan is fixed (checked across ranks in the first iteration, then
                # taken from rank 0's order) the per-call probe, one blocking round trip a bucket
                # (benchmarks/mismatch_check.py), would only re-check what cannot change.
                handle = allreduce(payload, op=op, group=ctx.group, async_op=True, name=f"dp.bucket{i}",
                                   prescale_factor=pre, postscale_factor=post, inplace=True,
                                   check=not ctx.plan_fixed)
                scale = 1.0
            else:
                from phalanx.comm.algorithms import allreduce as algo_allreduce

                if pre != 1.0:
                    payload.mul_(pre)
                handle = algo_allreduce(payload, ctx.algorithm, topology=ctx.topology, group=ctx.group,
                                        op=ReduceOp.SUM, async_op=True)
                scale = post / (ctx.world if op is ReduceOp.AVERAGE else 1)
        bucket.handle = InFlight(handle, codec_ctx, scale)

    def _launch_lossy(self, bucket: Bucket) -> None:
        ctx = self.ctx
        i, nbytes = bucket.index, bucket.nbytes
        op, pre, post = ctx.scales()
        parts = None
        if not ctx.shadowing and pre == 1.0:
            # the compressed collective reads the gradients themselves (no copy into the bucket
            # first: 1.4 ms a step for 4.35M values) and writes the average into the bucket
            grads = [p.grad for p in bucket.params]
            if all(g is not None and g.layout is torch.strided and g.dtype == bucket.flat.dtype
                   and g.is_contiguous() for g in grads):
                parts = grads
        if ctx.shadowing:
            bucket.flat.zero_()
        elif parts is None:
            ctx.gather_grads(bucket)
            ctx.check_finite([bucket.flat])
        if pre != 1.0:
            bucket.flat.mul_(pre)
        before = wire.bytes_sent
        on_piece = None
        if ctx.overlap is not None and post == 1.0 and not ctx.shadowing:
            on_piece = functools.partial(self._step_piece, bucket)
        with trace.span("allreduce_launch", "comm", bucket=i, bytes=nbytes):
            handle = allreduce_compressed(bucket.flat, ctx.compressor, group=ctx.group, async_op=True,
                                          name=f"dp.bucket{i}", average=op is ReduceOp.AVERAGE,
                                          shapes=[p.shape for p in bucket.params], out=bucket.flat,
                                          parts=parts, on_piece=on_piece)
        ctx.count_bytes(wire.bytes_sent - before)
        if parts is not None:  # while the payload is on the wire (the gradients stay as they are)
            ctx.check_finite(parts)
        bucket.handle = InFlight(handle, None, post)

    def finish(self, bucket: Bucket) -> None:
        ctx = self.ctx
        flight: InFlight = bucket.handle
        i = bucket.index
        with trace.span("allreduce_wait", "comm", bucket=i, bytes=bucket.nbytes):
            result = flight.handle.wait()
        if flight.ctx is not None or result.data_ptr() != bucket.flat.data_ptr():
            with trace.span("decompress", "comm", bucket=i, bytes=bucket.nbytes):
                out = ctx.compressor.decompress(result, flight.ctx) \
                    if flight.ctx is not None or ctx.compressor.summable else result
                bucket.flat.copy_(out.reshape(-1))
        if flight.scale != 1.0:
            bucket.flat.mul_(flight.scale)
        grads, views = [], []
        for p, view in zip(bucket.params, bucket.views):
            g = p.grad
            if g is None or g.layout is not torch.strided or g.data_ptr() == view.data_ptr():
                continue  # no gradient, or a sparse one (its follow-up writes it)
            if ctx.grad_as_view and view.numel() >= VIEW_MIN_NUMEL:
                p.grad = view  # later backward passes accumulate straight into the bucket
            else:
                grads.append(g)
                views.append(view)
        if grads:
            torch._foreach_copy_(grads, views)
        if ctx.overlap is not None and not ctx.shadowing and self._stepped.get(i, 0) == 0:
            self._step_piece(bucket, 0, bucket.numel)  # the whole bucket, while later ones are in flight

    def drain(self, bucket: Bucket) -> None:
        bucket.handle.handle.wait()

    def _step_piece(self, bucket: Bucket, start: int, stop: int) -> None:
        """Step the optimizer on elements [start, stop) of ``bucket``: their average is final."""
        items = []
        for p, off in zip(bucket.params, bucket.offsets):
            lo, hi = max(start, off), min(stop, off + p.numel())
            if lo < hi and p.grad is not None:
                items.append((p, lo - off, hi - off, bucket.flat[lo:hi]))
        self._stepped[bucket.index] = self._stepped.get(bucket.index, 0) + stop - start
        with trace.span("optimizer_piece", "compute", bucket=bucket.index, values=stop - start, in_wait=True):
            self.ctx.overlap.step_pieces(items)

