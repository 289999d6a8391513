"""Tensor fusion: gradients packed into flat buckets, each launched the moment it is full.

The picotron shape: a :class:`Bucket` owns one flat buffer and the parameters
whose gradients are views into it; it reports when every one of them is ready.
A :class:`BucketManager` assigns parameters to buckets (reverse registration
order, a byte threshold, one dtype/device per bucket) and launches buckets
strictly in index order, so every rank issues the same collectives in the same
sequence even when its gradients become ready in a different order::

    backward:  grad p9 ready ─┐
               grad p8 ready ─┤ bucket 0 full → launch(0)   (async; overlaps the rest)
               grad p7 ready ─┐
               ...            ┘ bucket 1 full → launch(1)
    step():    wait(0), wait(1), ...

Buckets are rebuilt once, from the order in which gradients actually arrived in
the first iteration (rank 0's order is used by everyone), as DDP does.
:class:`PlannedBuckets` instead keeps a layout fixed from the start (ZeRO lays its
master shard out from it), with :class:`PaddedBucket` flats padded to a multiple
of the group size and, for a reduction that sends from buffers of its own, no storage.

Example::

    mgr = BucketManager(list(model.parameters()), bucket_bytes=25 * 2**20, launch=print)
    mgr.mark_ready(p)   # from a post-accumulate-grad hook; launches full buckets in order
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = ["Bucket", "BucketManager", "PaddedBucket", "PlannedBuckets", "pack", "view_like"]


def view_like(piece: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``piece`` (a flat, contiguous slice of ``p.numel()`` elements) seen with ``p``'s shape and,
    where ``p`` is dense but not contiguous (a channels_last convolution weight), ``p``'s strides.

    A gradient kept as a view into its bucket must have its parameter's layout, as DDP's bucket
    views do: a contiguous gradient of a channels_last weight makes fused AdamW refuse the step
    on CUDA ("params, grads, ... must have same dtype, device, and layout") and sends the foreach
    paths to their slow per-tensor fallback.
    """
    if p.is_contiguous() or not _dense(p):
        return piece.view_as(p)
    return piece.as_strided(p.shape, p.stride())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive slots with no gaps or overlaps."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda ss: ss[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def pack(sizes: Sequence[float], limit: float, breaks: Sequence[bool] | None = None) -> list[list[int]]:
    """The packing rule of :class:`BucketManager`, on sizes alone: positions of ``sizes``
    grouped in order, a new group started when the next item would take the current one past
    ``limit`` or where ``breaks[k]`` says item ``k`` cannot join its predecessor's group (another
    dtype or device). An item larger than ``limit`` gets a group of its own. The planner's cost
    model packs a model it only knows by its gradients' sizes with it."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for k, nbytes in enumerate(sizes):
        if current and (size + nbytes > limit or (breaks is not None and breaks[k])):
            groups.append(current)
            current, size = [], 0.0
        current.append(k)
        size += nbytes
    if current:
        groups.append(current)
    return groups


class Bucket:
    """One flat buffer and the parameters whose gradients live in it.

    ``view(p)`` is ``p``'s slice of the buffer, shaped like ``p``. ``extra`` elements after the
    gradients travel with them (the data-parallel optimizer's join flag, in bucket 0).
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], extra: int = 0) -> None:
        first = params[0]
        self.index = index
        self.params = list(params)
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.extra = extra
        self.flat = torch.zeros(total + extra, dtype=first.dtype, device=first.device)
        self.tail = self.flat[total:]  # the ``extra`` elements
        self.views = [view_like(self.flat[o : o + p.numel()], p) for p, o in zip(self.params, self.offsets)]
        self._views = {id(p): v for p, v in zip(self.params, self.views)}
        self.pending = len(self.params)
        self.ready: set[int] = set()
        self.handle: object | None = None  # what the reduction keeps between launch and finish
        self.launched = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def view(self, p: torch.Tensor) -> torch.Tensor:
        return self._views[id(p)]

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready.clear()
        self.handle = None
        self.launched = False

    def mark(self, p: torch.Tensor) -> bool:
        """Record ``p`` as ready; True when it was the last one outstanding."""
        if id(p) in self.ready:
            return False
        self.ready.add(id(p))
        self.pending -= 1
        return self.pending == 0


class BucketManager:
    """Assigns parameters to buckets and launches full buckets in index order.

    ``launch(bucket)`` is called once per bucket per iteration with the bucket's
    buffer filled; it should start an async collective and store its handle in
    ``bucket.handle``. ``head_flag``: bucket 0 (the first launched) has one element more.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        bucket_bytes: int,
        launch: Callable[[Bucket], None],
        head_flag: bool = False,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes; pass bucket_mb > 0")
        self.params = list(params)
        self.bucket_bytes = int(bucket_bytes)
        self.launch = launch
        self.head_flag = head_flag
        self.rebuilt = False
        self.observed: list[int] = []  # indices into self.params, in the order grads arrived
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._build(list(reversed(range(len(self.params)))))

    def _build(self, order: Sequence[int]) -> None:
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        ps = [self.params[i] for i in order]
        breaks = [k > 0 and (p.dtype != ps[k - 1].dtype or p.device != ps[k - 1].device) for k, p in enumerate(ps)]
        for group in pack([p.numel() * p.element_size() for p in ps], self.bucket_bytes, breaks):
            self._add([ps[k] for k in group])
        self.next_to_launch = 0

    def _add(self, params: list[torch.nn.Parameter]) -> None:
        bucket = Bucket(len(self.buckets), params, extra=int(self.head_flag and not self.buckets))
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    def bucket_of(self, p: torch.Tensor) -> Bucket:
        return self._bucket_of[id(p)]

    def manages(self, p: torch.Tensor) -> bool:
        return id(p) in self._bucket_of

    def order(self) -> list[int]:
        """Current parameter order (indices into ``params``), bucket by bucket."""
        return [self._index[id(p)] for b in self.buckets for p in b.params]

    def mark_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient is in its bucket view; launch every bucket that is now launchable.

        Once per gradient per backward (the hot path): only a bucket that has just completed
        can make one launchable, so the launch loop runs only then."""
        key = id(p)
        if not self.rebuilt:
            self.observed.append(self._index[key])
        if self._bucket_of[key].mark(p):
            self.launch_ready()

    def launch_ready(self) -> None:
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if bucket.pending:
                return
            bucket.launched = True
            self.launch(bucket)
            self.next_to_launch += 1

    def without(self, gone: Sequence[torch.nn.Parameter]) -> BucketManager:
        """A manager for every parameter but ``gone``, in this one's bucket order (already rebuilt)."""
        ids = {id(p) for p in gone}
        order = [p for b in self.buckets for p in b.params if id(p) not in ids]
        kept = [p for p in self.params if id(p) not in ids]
        out = BucketManager(kept, self.bucket_bytes, self.launch, self.head_flag)
        index = {id(p): i for i, p in enumerate(kept)}
        out.maybe_rebuild([index[id(p)] for p in order])
        return out

    def missing(self) -> list[torch.nn.Parameter]:
        """Parameters not yet marked ready in this iteration."""
        return [p for b in self.buckets for p in b.params if id(p) not in b.ready]

    def reset(self) -> None:
        for b in self.buckets:
            b.reset()
        self.next_to_launch = 0

    def maybe_rebuild(self, order: Sequence[int] | None) -> bool:
        """Rebuild once from ``order`` (normally rank 0's observed order); True if the layout changed.

        Parameters missing from ``order`` (no gradient in the first iteration) go last.
        """
        if self.rebuilt:
            return False
        self.rebuilt = True
        self.observed = []
        if not order:
            return False
        seen = set(order)
        full = list(dict.fromkeys(order)) + [i for i in reversed(range(len(self.params))) if i not in seen]
        if full == self.order():
            return False
        self._build(full)
        return True


class PaddedBucket(Bucket):
    """A :class:`Bucket` whose flat is padded to a multiple of ``pad_to`` (zeros after ``numel``).

    ``lazy=True`` leaves the flat without storage (``untyped_storage().resize_(0)``): for a
    reduction that sends from buffers of its own (ZeRO stages 2 and 3 never hold the full gradient).
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], pad_to: int = 1, lazy: bool = False) -> None:
        first = params[0]
        self.index = index
        self.params = list(params)
        self.offsets = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.extra = 0
        self.padded = math.ceil(total / pad_to) * pad_to if total else 0
        self.flat = (torch.empty if lazy else torch.zeros)(self.padded, dtype=first.dtype, device=first.device)
        self.tail = self.flat[:0]  # no extra elements
        self.views = [self.flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        self._views = {id(p): v for p, v in zip(self.params, self.views)}
        self.pending = len(self.params)
        self.ready: set[int] = set()
        self.handle = None
        self.launched = False
        if lazy:
            self.release()

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)


class PlannedBuckets(BucketManager):
    """A :class:`BucketManager` over a fixed plan: ``plan[i]`` are bucket ``i``'s parameters.

    The layout never changes (no re-planning from the first iteration's order, and
    ``set_bucket_mb`` leaves it as it is): ZeRO lays its master shard out from it.
    ``on_complete(bucket)`` runs when a bucket's last gradient is marked.
    """

    def __init__(self, plan: Sequence[Sequence[torch.nn.Parameter]], launch: Callable[[Bucket], None], *,
                 pad_to: int = 1, lazy: bool = False,
                 on_complete: Callable[[Bucket], None] | None = None) -> None:
        self._plan = [list(ps) for ps in plan if ps]
        self._pad_to, self._lazy, self._on_complete = pad_to, lazy, on_complete
        self._fixed = False
        params = [p for ps in self._plan for p in ps]
        super().__init__(params, 1 << 62, launch)
        self.rebuilt = True

    def _build(self, order: Sequence[int]) -> None:
        if self._fixed:
            return  # the layout never changes
        self.buckets = []
        self._bucket_of = {}
        for ps in self._plan:
            bucket = PaddedBucket(len(self.buckets), ps, self._pad_to, self._lazy)
            self.buckets.append(bucket)
            for p in ps:
                self._bucket_of[id(p)] = bucket
        self._frozen = [(b, p) for b in self.buckets for p in b.params if not p.requires_grad]
        self.next_to_launch = 0
        self._fixed = True
        self.reset()

    def reset(self) -> None:
        super().reset()
        for bucket, p in self._frozen:  # never get a gradient: ready from the start
            bucket.mark(p)

    def mark_ready(self, p: torch.Tensor) -> None:
        if self.bucket_of(p).mark(p) and self._on_complete is not None:
            self._on_complete(self.bucket_of(p))
        self.launch_ready()

    def maybe_rebuild(self, order) -> bool:
        return False
