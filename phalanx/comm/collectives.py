"""Collectives: one function per operation, each with an ``async_op`` form.

Every call takes its ``group`` explicitly (``None`` is the whole world) and a
group of one returns at once. Before a collective is sent the ranks check that
they all mean the same call (:mod:`phalanx.comm.mismatch`): a mismatch raises
:class:`~phalanx.comm.mismatch.CollectiveMismatchError` on every rank instead
of hanging. A tensor where the backend cannot send it (a CPU tensor on NCCL,
which moves CUDA tensors only: a loss to average, a metric) travels through the
rank's GPU and comes back where it was, as Horovod's CPU ops do.

Example::

    import torch, phalanx as px
    px.init()
    g = px.allreduce(torch.ones(3), op=px.Average, name="grad")
    h = px.allgather(torch.tensor([px.rank()]), async_op=True)
    print(h.wait())
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.mismatch import check_call, default_device
from phalanx.runtime.heartbeat import RECORD

__all__ = [
    "all_gather_flat",
    "reduce_scatter_flat",
    "ReduceOp",
    "Sum",
    "Average",
    "Min",
    "Max",
    "Product",
    "Handle",
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "alltoall",
    "barrier",
    "broadcast_object",
    "allgather_object",
    "group_size",
    "group_rank",
    "scale_",
]


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Sum, Average, Min, Max, Product = (
    ReduceOp.SUM,
    ReduceOp.AVERAGE,
    ReduceOp.MIN,
    ReduceOp.MAX,
    ReduceOp.PRODUCT,
)

# torch 2.13 renamed the flat-tensor forms; keep working on torch >= 2.3.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,  # divided locally: works for every backend and dtype
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class Handle:
    """The pending result of an ``async_op=True`` collective.

    ``is_completed()`` polls without blocking; ``wait()`` blocks and returns the result.
    """

    __slots__ = ("_work", "_result", "_finish", "_done", "_entry")

    def __init__(self, work, result, finish: Callable[[Any], Any] | None = None, entry: list | None = None) -> None:
        self._work = work
        self._result = result
        self._finish = finish
        self._done = False
        if entry is None and work is not None:  # a caller's own torch work: record it, unnamed
            entry = RECORD.begin("collective", None, (result.shape,) if isinstance(result, torch.Tensor) else ())
        self._entry = entry  # this collective's line in the rank's record (runtime.heartbeat)

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()

    @property
    def done(self) -> bool:
        """True once ``wait()`` has returned (the result has been collected)."""
        return self._done

    def wait(self):
        if not self._done:
            entry = self._entry
            if self._work is not None:
                if entry is not None:
                    RECORD.waiting = (entry, time.time())
                try:
                    self._work.wait()
                finally:
                    RECORD.waiting = None
            if self._finish is not None:
                self._result = self._finish(self._result)
            if entry is not None:
                entry[5] = time.time()
            self._done = True
        return self._result


def group_size(group=None) -> int:
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    return dist.get_rank(group)


# the rank's collective record (runtime.heartbeat): open an entry; run a blocking torch call marked as the wait
_record, _blocking = RECORD.open, RECORD.blocking


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``t`` by ``factor`` in place; integer tensors go through float64 and truncate."""
    if factor == 1.0:
        return t
    if t.is_floating_point() or t.is_complex():
        return t.mul_(factor)
    return t.copy_(t.double().mul_(factor).trunc_())


def _done(result, async_op: bool):
    return Handle(None, result) if async_op else result


def _launch(work, result, finish, async_op: bool, entry: list | None = None, home=None):
    if home is not None:
        finish = _homeward(finish, *home)
    handle = Handle(work, result, finish, entry)
    return handle if async_op else handle.wait()


def _wire(tensor: torch.Tensor, group) -> torch.device | None:
    """The GPU ``tensor`` travels through when the group's backend cannot send it from where it is:
    NCCL moves CUDA tensors only, so a CPU tensor (a loss, a metric to average) goes through this
    rank's GPU and comes back. None: it travels as it is (always, on a machine without CUDA: the
    CPU path of every bucket asks no more than that)."""
    if tensor.device.type == "cuda" or not torch.cuda.is_available():
        return None
    device = default_device(group)
    return device if device.type == "cuda" else None


def _homeward(finish, home: torch.device, into: torch.Tensor | None):
    """``finish``, then the result back on ``home`` (copied into ``into`` for an in-place call)."""
    def go(result):
        result = finish(result) if finish is not None else result
        if into is not None:
            return into.copy_(result)
        if isinstance(result, tuple):
            return tuple(r.to(home) if isinstance(r, torch.Tensor) else r for r in result)
        return result.to(home)
    return go


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    *,
    group=None,
    async_op: bool = False,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    inplace: bool = False,
    check: bool = True,
):
    """Reduce ``tensor`` across the group; returns the result (or a :class:`Handle`).

    ``Average`` divides the sum by the group size (floor division for integers).
    ``prescale_factor`` multiplies before the reduction, ``postscale_factor`` after (integer
    tensors are scaled in float64 and truncated, as Horovod does). With ``inplace=True`` the
    result is written into ``tensor``. ``check=False`` skips the cross-rank check (the caller
    has compared the ranks' calls already).
    """
    op = ReduceOp(op)
    n = dist.get_world_size(group)
    out = tensor if inplace else tensor.clone()
    scale_(out, prescale_factor)

    def finish(t):
        if op is ReduceOp.AVERAGE and n > 1:
            if t.is_floating_point() or t.is_complex():
                t.div_(n)
            else:
                t.floor_divide_(n)
        return scale_(t, postscale_factor)

    if n == 1:
        return _done(finish(out), async_op)
    entry = _record("allreduce", name, tensor, group=group)
    wire = _wire(out, group)
    sent = out if wire is None else out.to(wire)
    if check:
        check_call("allreduce", name, sent, group, entry, op=op.value)
    work = dist.all_reduce(sent, op=_TORCH_OP[op], group=group, async_op=True)
    return _launch(work, sent, finish, async_op, entry, home=None if wire is None else (out.device, out))


def allgather(tensor: torch.Tensor, *, group=None, async_op: bool = False, name: str | None = None,
              check: bool = True):
    """Concatenate every rank's ``tensor`` along dim 0 (first dimensions may differ)."""
    n = dist.get_world_size(group)
    if n == 1:
        return _done(tensor.clone(), async_op)
    entry = _record("allgather", name, tensor, group=group)
    wire = _wire(tensor, group)
    t = tensor.contiguous() if wire is None else tensor.to(wire)
    home = None if wire is None else (tensor.device, None)
    if check:
        check_call("allgather", name, t, group, entry)
    if t.dim() == 0:
        t = t.reshape(1)
    sizes = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
    every = torch.empty(n, dtype=torch.int64, device=t.device)
    _blocking(entry, all_gather_flat, every, sizes, group=group)
    counts = [int(c) for c in every.tolist()]
    if len(set(counts)) == 1:
        out = torch.empty((n * counts[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = all_gather_flat(out, t, group=group, async_op=True)
        return _launch(work, out, None, async_op, entry, home)
    # Uneven first dimensions: pad to the largest, gather, then cut the padding away.
    biggest = max(counts)
    padded = torch.zeros((biggest,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(n)]
    work = dist.all_gather(parts, padded, group=group, async_op=True)
    return _launch(work, parts, lambda ps: torch.cat([p[:c] for p, c in zip(ps, counts)]), async_op, entry, home)


def broadcast(
    tensor: torch.Tensor,
    root_rank: int = 0,
    *,
    group=None,
    async_op: bool = False,
    name: str | None = None,
    inplace: bool = False,
    check: bool = True,
):
    """Copy ``tensor`` from global rank ``root_rank`` to every rank of the group."""
    n = dist.get_world_size(group)
    out = tensor if inplace else tensor.clone()
    if n == 1:
        return _done(out, async_op)
    members = dist.get_process_group_ranks(group) if group is not None else range(n)
    if root_rank not in members:
        raise ValueError(f"root_rank {root_rank} is not a member of the group {list(members)}")
    entry = _record("broadcast", name, tensor, group=group)
    wire = _wire(out, group)
    sent = out if wire is None else out.to(wire)
    if check:
        check_call("broadcast", name, sent, group, entry, root=root_rank)
    work = dist.broadcast(sent, src=root_rank, group=group, async_op=True)
    return _launch(work, sent, None, async_op, entry, home=None if wire is None else (out.device, out))


def reducescatter(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    *,
    group=None,
    async_op: bool = False,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    check: bool = True,
):
    """Reduce across ranks, then give rank i the i-th slice of dim 0.

    When dim 0 does not divide evenly, the first ``len % n`` ranks get one extra row
    (Horovod's rule). ``prescale_factor``/``postscale_factor`` as in :func:`allreduce`.
    """
    op = ReduceOp(op)
    n = dist.get_world_size(group)
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"reducescatter supports Sum and Average, not {op.name.title()}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: a scalar (0-d tensor) cannot be scattered; "
                         "pass a tensor with a first dimension to split across the ranks")
    if prescale_factor != 1.0:
        tensor = scale_(tensor.clone(), prescale_factor)
    if n == 1:
        return _done(scale_(tensor.clone(), postscale_factor), async_op)
    entry = _record("reducescatter", name, tensor, group=group)
    wire = _wire(tensor, group)
    home = None if wire is None else (tensor.device, None)
    if wire is not None:
        tensor = tensor.to(wire)
    if check:
        check_call("reducescatter", name, tensor, group, entry, op=op.value)
    me = dist.get_rank(group)
    rows = tensor.shape[0]
    counts = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
    divide = op is ReduceOp.AVERAGE

    def finish(t):
        if divide:
            t.div_(n) if t.is_floating_point() else t.floor_divide_(n)
        return scale_(t, postscale_factor)

    t = tensor.contiguous()
    if len(set(counts)) == 1:
        out = torch.empty((counts[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = reduce_scatter_flat(out, t, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _launch(work, out, finish, async_op, entry, home)
    parts = list(torch.split(t, counts))
    out = torch.empty_like(parts[me])
    work = dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _launch(work, out, finish, async_op, entry, home)


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    *,
    group=None,
    async_op: bool = False,
    name: str | None = None,
    check: bool = True,
):
    """Send slice i of dim 0 to rank i; returns ``(received, received_splits)``.

    ``splits`` gives the row count for each destination (default: equal slices).
    """
    n = dist.get_world_size(group)
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall: dim 0 ({rows}) is not divisible by the group size {n}; pass splits=")
        splits = [rows // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"alltoall: splits {splits} must be {n} non-negative counts summing to {rows}")
    if n == 1:
        return _done((tensor.clone(), torch.tensor(splits)), async_op)
    entry = _record("alltoall", name, tensor, group=group)
    wire = _wire(tensor, group)
    t = tensor.contiguous() if wire is None else tensor.to(wire)
    if check:
        check_call("alltoall", name, t, group, entry)
    send = torch.tensor(splits, dtype=torch.int64, device=t.device)
    recv = torch.empty_like(send)
    _blocking(entry, dist.all_to_all_single, recv, send, group=group)
    recv_splits = [int(s) for s in recv.tolist()]
    out = torch.empty((sum(recv_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    work = dist.all_to_all_single(out, t, recv_splits, splits, group=group, async_op=True)
    return _launch(work, (out, recv.cpu()), None, async_op, entry, None if wire is None else (tensor.device, None))


def barrier(group=None) -> None:
    """Block until every rank of the group has reached this point."""
    if dist.get_world_size(group) > 1:
        RECORD.call("barrier", dist.barrier, group=group)


def broadcast_object(obj: Any, root_rank: int = 0, *, group=None) -> Any:
    """Pickle ``obj`` on ``root_rank`` and return it on every rank."""
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    RECORD.call("broadcast_object", dist.broadcast_object_list, box, src=root_rank, group=group)
    return box[0]


def allgather_object(obj: Any, *, group=None) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order."""
    n = dist.get_world_size(group)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    RECORD.call("allgather_object", dist.all_gather_object, out, obj, group=group)
    return out
