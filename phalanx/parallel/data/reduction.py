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
            self.engine.gather_grads(bucket)
            bucket.handle = dist.all_reduce(bucket.flat, async_op=True)
        def finish(self, bucket):
            bucket.handle.wait()
    engine = GradientEngine(named_params, reduction=Sum())
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from phalanx import trace
from phalanx.comm.buckets import Bucket
from phalanx.comm.collectives import Handle, ReduceOp, allreduce
from phalanx.comm.compression.allreduce import allreduce_compressed
from phalanx.comm.compression.paths import wire
from phalanx.parallel.data.config import VIEW_MIN_NUMEL
from phalanx.runtime.heartbeat import RECORD

__all__ = ["BucketReduction", "TakesGrads", "ReportsComplete", "AllReduceReduction", "InFlight"]


class BucketReduction:
    """How a bucket's gradients are combined across ranks, plugged into ``GradientEngine(reduction=)``.

    - ``launch(bucket)``: the bucket is complete (in the fixed launch order); start an async
      collective and keep what ``finish`` needs in ``bucket.handle``. ``engine.gather_grads(bucket)``
      copies the gradients into the bucket's flat (zeros for a missing one).
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
    engine: Any  # the GradientEngine this reduction is bound to (bind)

    def bind(self, engine) -> None:
        self.engine = engine

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
    straight from the gradients, decoding into the bucket. With ``engine.overlap`` (an
    ``OptimizerOverlap``) each piece of the average is stepped as soon as it is final.
    """

    tolerates_missing = False
    reduces_alone = False

    def bind(self, engine) -> None:
        super().bind(engine)
        self._stepped: dict[int, int] = {}  # bucket index -> elements the overlap stepped this iteration

    def launch(self, bucket: Bucket) -> None:
        engine = self.engine
        self._stepped[bucket.index] = 0
        if not engine.compressor.summable:
            self._launch_lossy(bucket)
            return
        i, nbytes = bucket.index, bucket.nbytes
        op, pre, post = engine.scales()
        if engine.shadowing:
            bucket.flat.zero_()
        else:
            engine.gather_grads(bucket)
            engine.finite.check([bucket.flat])
            if bucket.extra:
                bucket.tail.fill_(1)  # the join flag (phalanx.parallel.data.joined): this rank steps
        with trace.span("compress", "comm", bucket=i, bytes=nbytes):
            payload, ctx = engine.compressor.compress(bucket.flat)
        engine.bytes_sent += engine.ring_bytes(payload.nbytes)
        with trace.span("allreduce_launch", "comm", bucket=i, bytes=payload.nbytes):
            if engine.algorithm == "flat" and engine.buckets.rebuilt:
                # Steady state: the bucket plan was checked across ranks in the first iteration
                # (every bucket went through the mismatch-checked allreduce) and then fixed from
                # rank 0's order, so the per-call probe (one blocking round trip per bucket,
                # benchmarks/mismatch_check.py) would only re-check what cannot change.
                if pre != 1.0:
                    payload.mul_(pre)
                # named in the rank's collective record, as the checked path names it ("behind" reports)
                entry = RECORD.begin("allreduce", f"dp.bucket{i}", (payload.shape,), engine.group)
                work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=engine.group, async_op=True)
                handle = Handle(work, payload, entry=entry)
                scale = post / (engine.world if op is ReduceOp.AVERAGE else 1)
            elif engine.algorithm == "flat":
                handle = allreduce(payload, op=op, group=engine.group, async_op=True, name=f"dp.bucket{i}",
                                   prescale_factor=pre, postscale_factor=post, inplace=True)
                scale = 1.0
            else:
                from phalanx.comm.algorithms import allreduce as algo_allreduce

                if pre != 1.0:
                    payload.mul_(pre)
                handle = algo_allreduce(payload, engine.algorithm, topology=engine.topology, group=engine.group,
                                        op=ReduceOp.SUM, async_op=True)
                scale = post / (engine.world if op is ReduceOp.AVERAGE else 1)
        bucket.handle = InFlight(handle, ctx, scale)

    def _launch_lossy(self, bucket: Bucket) -> None:
        engine = self.engine
        i, nbytes = bucket.index, bucket.nbytes
        op, pre, post = engine.scales()
        parts = None
        if not engine.shadowing and pre == 1.0:
            # the compressed collective reads the gradients themselves (no copy into the bucket
            # first: 1.4 ms a step for 4.35M values) and writes the average into the bucket
            grads = [p.grad for p in bucket.params]
            if all(g is not None and g.layout is torch.strided and g.dtype == bucket.flat.dtype
                   and g.is_contiguous() for g in grads):
                parts = grads
        if engine.shadowing:
            bucket.flat.zero_()
        elif parts is None:
            engine.gather_grads(bucket)
            engine.finite.check([bucket.flat])
        if pre != 1.0:
            bucket.flat.mul_(pre)
        before = wire.bytes_sent
        on_piece = None
        if engine.overlap is not None and post == 1.0 and not engine.shadowing:
            on_piece = functools.partial(self._step_piece, bucket)
        with trace.span("allreduce_launch", "comm", bucket=i, bytes=nbytes):
            handle = allreduce_compressed(bucket.flat, engine.compressor, group=engine.group, async_op=True,
                                          name=f"dp.bucket{i}", average=op is ReduceOp.AVERAGE,
                                          shapes=[p.shape for p in bucket.params], out=bucket.flat,
                                          parts=parts, on_piece=on_piece)
        engine.bytes_sent += wire.bytes_sent - before
        if parts is not None:  # while the payload is on the wire (the gradients stay as they are)
            engine.finite.check(parts)
        bucket.handle = InFlight(handle, None, post)

    def finish(self, bucket: Bucket) -> None:
        engine = self.engine
        flight: InFlight = bucket.handle
        i = bucket.index
        with trace.span("allreduce_wait", "comm", bucket=i, bytes=bucket.nbytes):
            result = flight.handle.wait()
        if flight.ctx is not None or result.data_ptr() != bucket.flat.data_ptr():
            with trace.span("decompress", "comm", bucket=i, bytes=bucket.nbytes):
                out = engine.compressor.decompress(result, flight.ctx) \
                    if flight.ctx is not None or engine.compressor.summable else result
                bucket.flat.copy_(out.reshape(-1))
        if flight.scale != 1.0:
            bucket.flat.mul_(flight.scale)
        grads, views = [], []
        for p, view in zip(bucket.params, bucket.views):
            g = p.grad
            if g is None or g.layout is not torch.strided or g.data_ptr() == view.data_ptr():
                continue  # no gradient, or a sparse one (its follow-up writes it)
            if engine.grad_as_view and view.numel() >= VIEW_MIN_NUMEL:
                p.grad = view  # later backward passes accumulate straight into the bucket
            else:
                grads.append(g)
                views.append(view)
        if grads:
            torch._foreach_copy_(grads, views)
        if engine.overlap is not None and not engine.shadowing and self._stepped.get(i, 0) == 0:
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
            self.engine.overlap.step_pieces(items)

