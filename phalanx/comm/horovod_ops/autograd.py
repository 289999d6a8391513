"""Differentiable Horovod collectives: each backward runs the collective Horovod runs on the gradient.

    allreduce(op, pre, post)   backward: allreduce of the gradient, same op and factors (Sum/Average)
    grouped_allreduce          backward: grouped allreduce of the gradients
    allgather                  backward: averaged gradient, this rank's rows
    grouped_allgather          backward: per tensor, as allgather
    broadcast                  backward: averaged gradient on the root, zeros elsewhere
    alltoall                   backward: alltoall of the gradient with the received splits (the way back)
    reducescatter(op)          backward: allgather of the gradient, × set size for Sum, × pre·post
    grouped_reducescatter      backward: per tensor, as reducescatter

These are Horovod 0.28's rules, checked against numerical references on 2 and 4 ranks in
``tests/fronts/test_horovod_autograd.py``. Each entry point takes the differentiable path only
when grad mode is on and an input requires grad; otherwise it is the plain collective.
"""

from __future__ import annotations

import torch

from phalanx.comm import collectives as c
from phalanx.comm.horovod_ops import ops as ops

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _linear(op) -> None:
    if op not in (c.Average, c.Sum):
        raise NotImplementedError(f"no gradient for a collective with op={op}; use Sum or Average on tensors "
                                  "that require grad (or detach them)")


def _own_rows(grads: list[torch.Tensor], rows: list[int], ps) -> list[torch.Tensor]:
    """Backward of an allgather per tensor: average the gradients, keep this rank's rows."""
    reduced = ops.synchronize(ops.grouped_allreduce_async([g.contiguous() for g in grads], c.Average,
                                                          process_set=ps))
    counts = ops.synchronize(ops.allgather_async(torch.tensor([rows], device=grads[0].device), process_set=ps))
    offsets = counts[: ps.rank()].sum(0).tolist() if ps.rank() else [0] * len(rows)
    return [g.narrow(0, int(o), r) for g, o, r in zip(reduced, offsets, rows)]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, pre, post, ps):
        ctx.args = (op, pre, post, ps)
        return ops.synchronize(ops.allreduce_async(tensor.detach(), op, name, pre, post, ps))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        _linear(op)
        return ops.synchronize(ops.allreduce_async(grad.contiguous(), op, None, pre, post, ps)), *[None] * 5


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, pre, post, ps, *tensors):
        ctx.args = (op, pre, post, ps)
        return tuple(ops.synchronize(ops.grouped_allreduce_async([t.detach() for t in tensors], op, name, pre,
                                                                 post, ps)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        _linear(op)
        reduced = ops.synchronize(ops.grouped_allreduce_async([g.contiguous() for g in grads], op, None, pre,
                                                              post, ps))
        return (None,) * 5 + tuple(reduced)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ps, name, *tensors):
        ctx.ps, ctx.rows = ps, [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(ops.synchronize(ops.grouped_allgather_async([t.detach() for t in tensors], name, ps)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_own_rows(list(grads), ctx.rows, ctx.ps))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.ps = root_rank, ps
        return ops.synchronize(ops.broadcast_async(tensor.detach(), root_rank, name, ps))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.synchronize(ops.allreduce_async(grad.contiguous(), c.Average, process_set=ctx.ps))
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        out, received = ops.synchronize(ops.alltoall_async(tensor.detach(), splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), ctx.received, None, ctx.ps))
        return back, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, pre, post, ps, *tensors):
        ctx.args = (op, pre, post, ps)
        return tuple(ops.synchronize(ops.grouped_reducescatter_async([t.detach() for t in tensors], op, name, ps,
                                                                     pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        _linear(op)
        scale = pre * post * (ps.size() if op == c.Sum else 1)
        gathered = ops.synchronize(ops.grouped_allgather_async([g.contiguous() for g in grads], None, ps))
        return (None,) * 5 + tuple(g * scale if scale != 1 else g for g in gathered)


# ---------------------------------------------------------------- entry points
def allreduce(tensor, op, name, pre, post, ps):
    if _wants_grad(tensor):
        return _Allreduce.apply(tensor, op, name, pre, post, ps)
    return ops.synchronize(ops.allreduce_async(tensor, op, name, pre, post, ps))


def grouped_allreduce(tensors, op, name, pre, post, ps):
    if _wants_grad(*tensors):
        return list(_GroupedAllreduce.apply(op, name, pre, post, ps, *tensors))
    return ops.synchronize(ops.grouped_allreduce_async(tensors, op, name, pre, post, ps))


def allgather(tensor, name, ps):
    if _wants_grad(tensor):
        return _Allgather.apply(ps, name, tensor)[0]
    return ops.synchronize(ops.allgather_async(tensor, name, ps))


def grouped_allgather(tensors, name, ps):
    if _wants_grad(*tensors):
        return list(_Allgather.apply(ps, name, *tensors))
    return ops.synchronize(ops.grouped_allgather_async(tensors, name, ps))


def broadcast(tensor, root_rank, name, ps):
    if _wants_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, ps)
    return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, ps))


def alltoall(tensor, splits, name, ps):
    """``(received, received_splits)``."""
    if _wants_grad(tensor):
        return _Alltoall.apply(tensor, splits, name, ps)
    return ops.synchronize(ops.alltoall_async(tensor, splits, name, ps))


def reducescatter(tensor, op, name, ps, pre, post):
    if _wants_grad(tensor):
        return _Reducescatter.apply(op, name, pre, post, ps, tensor)[0]
    return ops.synchronize(ops.reducescatter_async(tensor, op, name, ps, pre, post))


def grouped_reducescatter(tensors, op, name, ps, pre, post):
    if _wants_grad(*tensors):
        return list(_Reducescatter.apply(op, name, pre, post, ps, *tensors))
    return ops.synchronize(ops.grouped_reducescatter_async(tensors, op, name, ps, pre, post))
