"""Torch backend: start each bucket's allreduce during backward, as DataParallel does.

Keras's torch ``train_step`` runs ``optimizer.scale_loss(loss)``, ``loss.backward()``
and then ``optimizer.apply(grads, variables)``. :class:`BackwardOverlap` puts a
post-accumulate-grad hook on every trainable parameter; ``scale_loss`` arms it, so
during that backward each gradient is copied into its bucket as soon as autograd has
it, and a full bucket's allreduce starts at once (buckets in index order, the same on
every rank), overlapping the rest of backward. ``apply`` then only waits::

    scale_loss ── arm
    backward:   grad p_k ready ── copy into bucket view ── bucket full? ── allreduce (async)
    apply:      fill what never came (zeros), launch the rest, wait, / n
                inner.apply(views of the averaged buckets)

One copy per gradient (autograd allocates a new ``.grad`` every step, because Keras
zeroes gradients with ``set_to_none``; the copy happens while backward still runs). The
first step on a process group goes through the cross-rank mismatch check (one blocking
round trip per bucket); later steps launch the same buckets unchecked, as DataParallel's
steady state does. Without the arming call (a custom ``train_step``) the hooks do
nothing and the optimizer reduces after backward (``phalanx.keras.fused``).

Example::

    overlap = BackwardOverlap([v.value for v in model.trainable_variables], bucket_mb=25)
    overlap.arm(); loss.backward(); grads = overlap.finish(params)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives
from phalanx.comm.buckets import Bucket, BucketManager

__all__ = ["BackwardOverlap"]


class BackwardOverlap:
    """Bucketed allreduce of ``params``' gradients launched from backward; see the module docstring."""

    def __init__(self, params: Sequence[torch.Tensor], *, bucket_mb: float, average: bool = True,
                 name: str = "keras.grads") -> None:
        self.params = [p for p in params if p.requires_grad]
        self.average = average
        self.name = name
        self.manager = BucketManager(self.params, max(int(bucket_mb * 2**20), 1), self._launch)
        self.manager.maybe_rebuild(None)  # the layout stays reverse registration order (no re-plan)
        self.armed = False
        self.overlapped_steps = 0  # steps whose buckets all started during backward (for tests and curiosity)
        self._checked_group = None  # the process group whose first step passed the mismatch check
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def covers(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are exactly the parameters this overlap was built for, in order."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def arm(self) -> None:
        self.manager.reset()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        self.manager.reset()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed or p.grad is None:
            return
        bucket = self.manager.bucket_of(p)
        bucket.view(p).copy_(p.grad)
        self.manager.mark_ready(p)

    def _launch(self, bucket: Bucket) -> None:
        group = dist.group.WORLD
        if self._checked_group is group:
            work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)
            bucket.handle = collectives.Handle(work, bucket.flat)
        else:
            op = collectives.Sum  # divided in finish, as the unchecked path does
            bucket.handle = collectives.allreduce(bucket.flat, op, async_op=True, inplace=True,
                                                  name=f"{self.name}.{bucket.index}")

    def finish(self) -> list[torch.Tensor | None]:
        """Wait for every bucket; ``p``'s averaged gradient (a view of its bucket) per parameter, or None."""
        self.armed = False
        if self.manager.next_to_launch == len(self.manager.buckets):
            self.overlapped_steps += 1
        for bucket in self.manager.buckets:  # gradients backward never produced: zeros, as DataParallel
            for p, view in zip(bucket.params, bucket.views):
                if id(p) not in bucket.ready:
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
                    bucket.mark(p)
        self.manager.launch_ready()
        world = dist.get_world_size()
        for bucket in self.manager.buckets:
            bucket.handle.wait()
            if self.average:
                bucket.flat.div_(world)
        self._checked_group = dist.group.WORLD
        out = [None if p.grad is None else self.manager.bucket_of(p).view(p) for p in self.params]
        self.manager.reset()
        return out
