"""A drop-in home for ``horovod.torch`` scripts: ``import phalanx.horovod as hvd``.

Thin by design: every call translates Horovod's spelling to phalanx's core and
delegates; no logic lives here, and the core never imports this package.
Differences from Horovod 0.28 are listed in docs/horovod.md; the main ones:
handles are objects (``poll``/``synchronize`` accept them as Horovod's ints),
Adasum is not supported, and ``root_rank`` is a global rank.

Example (seed 002's script, only the import changed)::

    import phalanx.horovod as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""

from __future__ import annotations

import torch

import phalanx.runtime as _rt
from phalanx.comm import collectives as _c
from phalanx.comm.compression import CastCompressor, NoneCompressor
from phalanx.parallel.sync_batchnorm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async",
    "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "SyncBatchNorm",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline", "elastic",
]

_NO_COMPRESSION = NoneCompressor()

Average, Sum, Min, Max, Product = _c.Average, _c.Sum, _c.Min, _c.Max, _c.Product
Adasum = "adasum"  # accepted as a value so scripts import; rejected with a clear error when used


# ---------------------------------------------------------------- runtime
def init(comm=None, process_sets=None):
    """Start phalanx (``comm`` is accepted for compatibility; MPI communicators are not used)."""
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("phalanx.horovod.init: MPI communicators are not supported; launch with phalanx run")
    _rt.init()
    for ps in process_sets or []:
        add_process_set(ps)


shutdown, is_initialized = _rt.shutdown, _rt.is_initialized
size, rank, local_size, local_rank = _rt.size, _rt.rank, _rt.local_size, _rt.local_rank
cross_size, cross_rank = _rt.cross_size, _rt.cross_rank


def is_homogeneous() -> bool:
    return _rt.topology().is_homogeneous


# Build checks, answered truthfully for this pure-Python implementation.
def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return torch.distributed.is_gloo_available()


def gloo_built() -> bool:
    return torch.distributed.is_gloo_available()


def nccl_built() -> bool:
    return torch.distributed.is_nccl_available() and torch.cuda.is_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return torch.version.hip is not None


# ---------------------------------------------------------------- process sets
class ProcessSet:
    """A subset of ranks that runs its own collectives (Horovod's process sets)."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)

    @property
    def group(self):
        return None if self.ranks is None else _rt.topology().group(self.ranks)

    def included(self) -> bool:
        return self.ranks is None or _rt.rank() in self.ranks

    def size(self) -> int:
        return _rt.size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return _rt.rank() if self.ranks is None else self.ranks.index(_rt.rank())

    def __repr__(self) -> str:
        return f"ProcessSet(ranks={self.ranks if self.ranks is not None else 'all'})"


global_process_set = ProcessSet()


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks); its members create its group."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    bad = [r for r in ps.ranks or [] if not 0 <= r < _rt.size()]
    if bad:
        raise ValueError(f"process set ranks {bad} are outside 0..{_rt.size() - 1}")
    if ps.included():
        _ = ps.group
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    return process_set is not global_process_set


def _group(process_set: ProcessSet):
    if not process_set.included():
        raise ValueError(f"rank {_rt.rank()} is not in {process_set}; only its members may call this")
    return process_set.group


# ---------------------------------------------------------------- handles and names
_in_flight: dict[str, _c.Handle] = {}


def _track(name: str | None, handle: _c.Handle) -> _c.Handle:
    if name is not None:
        previous = _in_flight.get(name)
        if previous is not None and not previous._done:
            raise ValueError(
                f"a collective named {name!r} is already in flight; give pending operations unique names"
            )
        _in_flight[name] = handle
    return handle


class _Composite(_c.Handle):
    """A handle over inner handles: ``poll`` is true only once all of them are (never blocks)."""

    def __init__(self, inner, finish):
        super().__init__(None, inner, finish)
        self._inner = list(inner) if isinstance(inner, (list, tuple)) else [inner]

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h in self._inner)


def poll(handle: _c.Handle) -> bool:
    """True when the asynchronous operation has finished (never blocks)."""
    return handle.is_completed()


def synchronize(handle: _c.Handle):
    """Wait for an asynchronous operation and return its result."""
    result = handle.wait()
    for name, h in list(_in_flight.items()):
        if h is handle:
            del _in_flight[name]
    return result


def _op(average, op):
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by phalanx; use op=hvd.Average or hvd.Sum")
    if average is not None:
        if op is not None:
            raise ValueError("pass either average= (deprecated) or op=, not both")
        return Average if average else Sum
    return Average if op is None else op


# ---------------------------------------------------------------- allreduce
def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    h = _c.allreduce(tensor, _op(average, op), group=_group(process_set), async_op=True, name=name,
                     prescale_factor=prescale_factor, postscale_factor=postscale_factor, inplace=True)
    return _track(name, h)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def _differentiable(tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


class _AllreduceFn(torch.autograd.Function):
    """Backward of a Sum/Average allreduce is the same allreduce of the gradient (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor.detach(), None, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(f"phalanx.horovod: no gradient for an allreduce with op={op}; "
                                      "use Sum or Average on tensors that require grad")
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, op, pre, post, process_set))
        return reduced, None, None, None, None, None


class _AllgatherFn(torch.autograd.Function):
    """Backward: average the gradient over the ranks, keep this rank's rows (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor.detach(), name, process_set))

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.process_set
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ps))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], device=grad.device), None, ps))
        offset = int(rows[: ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class _BroadcastFn(torch.autograd.Function):
    """Backward: the averaged gradient on the root, zeros elsewhere (as Horovod)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor.detach(), root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set))
        if _rt.rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def allreduce(tensor, average=None, name=None, compression=_NO_COMPRESSION, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over the process set; returns a new tensor (Average by default).

    Differentiable like Horovod's: when ``tensor`` requires grad, backward allreduces the
    gradient with the same op and scale factors.
    """
    payload, ctx = compression.compress(tensor)
    if _differentiable(payload):
        out = _AllreduceFn.apply(payload, _op(average, op), name, prescale_factor, postscale_factor, process_set)
    else:
        out = synchronize(allreduce_async(payload, average, name, op, prescale_factor, postscale_factor,
                                          process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _fuse(tensors):
    """Group tensors by dtype into flat buffers (one collective per dtype)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return [(idx, torch.cat([tensors[i].reshape(-1) for i in idx])) for idx in groups.values()]


class _GroupedHandle(_c.Handle):
    """Waits for the fused collectives, then splits the results back into shapes."""

    def __init__(self, parts, tensors, inplace):
        super().__init__(None, None)
        self._parts, self._tensors, self._inplace = parts, tensors, inplace

    def is_completed(self) -> bool:
        return all(h.is_completed() for _, h in self._parts)

    def wait(self):
        if not self._done:
            out = [None] * len(self._tensors)
            for idx, h in self._parts:
                flat = h.wait()
                offset = 0
                for i in idx:
                    t = self._tensors[i]
                    piece = flat[offset:offset + t.numel()].view_as(t)
                    offset += t.numel()
                    out[i] = t.copy_(piece) if self._inplace else piece.clone()
            self._result, self._done = out, True
        return self._result


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, _inplace=False):
    parts = [(idx, _c.allreduce(flat, _op(average, op), group=_group(process_set), async_op=True,
                                name=None if name is None else f"{name}.{k}", prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, inplace=True))
             for k, (idx, flat) in enumerate(_fuse(list(tensors)))]
    return _track(name, _GroupedHandle(parts, list(tensors), _inplace))


class _GroupedAllreduceFn(torch.autograd.Function):
    """Backward: the same grouped allreduce of the gradients (as Horovod)."""

    @staticmethod
    def forward(ctx, op, name, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async([t.detach() for t in tensors], None, name, op,
                                                         prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(f"phalanx.horovod: no gradient for a grouped allreduce with op={op}")
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, pre, post,
                                                      process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=_NO_COMPRESSION, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors with one fused collective per dtype; differentiable like ``allreduce``."""
    packed = [compression.compress(t) for t in tensors]
    payloads = [p for p, _ in packed]
    if any(_differentiable(p) for p in payloads):
        out = _GroupedAllreduceFn.apply(_op(average, op), name, prescale_factor, postscale_factor, process_set,
                                        *payloads)
    else:
        out = synchronize(grouped_allreduce_async(payloads, average, name, op, prescale_factor,
                                                  postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                   process_set, _inplace=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ---------------------------------------------------------------- allgather / broadcast / alltoall / reducescatter
def allgather_async(tensor, name=None, process_set=global_process_set):
    return _track(name, _c.allgather(tensor, group=_group(process_set), async_op=True, name=name))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ); differentiable."""
    if _differentiable(tensor):
        return _AllgatherFn.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    handles = [allgather_async(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]
    return _track(name, _Composite(handles, lambda hs: [synchronize(h) for h in hs]))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _track(name, _c.broadcast(tensor, root_rank, group=_group(process_set), async_op=True,
                                     name=name, inplace=True))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s tensor on every rank (a new tensor); differentiable."""
    if _differentiable(tensor):
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    return _track(name, _c.alltoall(tensor, splits, group=_group(process_set), async_op=True, name=name))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send slice i to rank i; with ``splits`` also returns the received splits (as Horovod)."""
    out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return (out, received) if splits is not None else out


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    scaled = tensor * prescale_factor if prescale_factor != 1.0 else tensor
    finish = (lambda t: t.mul_(postscale_factor)) if postscale_factor != 1.0 else None
    inner = _c.reducescatter(scaled, _op(None, op), group=_group(process_set), async_op=True, name=name)
    return _track(name, _Composite(inner, lambda h: finish(h.wait()) if finish else h.wait()))


def reducescatter(tensor, name=None, compression=_NO_COMPRESSION, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    payload, ctx = compression.compress(tensor)
    out = synchronize(reducescatter_async(payload, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set):
    handles = [reducescatter_async(t, None if name is None else f"{name}.{i}", op, process_set)
               for i, t in enumerate(tensors)]
    return _track(name, _Composite(handles, lambda hs: [synchronize(h) for h in hs]))


def grouped_reducescatter(tensors, name=None, compression=_NO_COMPRESSION, op=Average,
                          process_set=global_process_set):
    return synchronize(grouped_reducescatter_async(tensors, name, op, process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Reduce a sparse COO tensor by allgathering its indices and values (as Horovod does);
    ``synchronize`` returns the coalesced sparse result. ``op`` is Average or Sum."""
    if not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO tensor, got layout {tensor.layout}; "
                        "use allreduce_async for dense tensors")
    op = _op(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {op}")
    t = tensor.coalesce()
    parts = [allgather_async(t.indices().t().contiguous(), None if name is None else f"{name}.indices", process_set),
             allgather_async(t.values(), None if name is None else f"{name}.values", process_set)]
    scale = 1.0 / process_set.size() if op is Average else 1.0

    def finish(hs):
        indices, values = (synchronize(h) for h in hs)
        return torch.sparse_coo_tensor(indices.t(), values * scale, tensor.shape).coalesce()

    return _track(name, _Composite(parts, finish))


def barrier(process_set=global_process_set):
    _c.barrier(group=_group(process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    return _c.broadcast_object(obj, root_rank, group=_group(process_set))


def allgather_object(obj, name=None, process_set=global_process_set):
    return _c.allgather_object(obj, group=_group(process_set))


# ---------------------------------------------------------------- compression
class Compression:
    """Horovod's ``hvd.Compression``: ``none`` and ``fp16``, plus ``bf16``.

    phalanx's other compressors (int8, topk, sign, powersgd, …) are passed to
    ``DistributedOptimizer`` by name: ``compression="int8"``.
    """

    none = NoneCompressor()
    fp16 = CastCompressor(torch.float16, "fp16")
    bf16 = CastCompressor(torch.bfloat16, "bf16")


from phalanx.horovod import elastic  # noqa: E402  (hvd.elastic.run, TorchState, ElasticSampler)
from phalanx.horovod._training import (  # noqa: E402  (needs the names above)
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    start_timeline,
    stop_timeline,
)
