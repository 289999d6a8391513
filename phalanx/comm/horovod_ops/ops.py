"""Horovod's collective semantics on phalanx's collectives (what ``phalanx.horovod`` delegates to).

Each function takes a :class:`~phalanx.comm.horovod_ops.process_sets.ProcessSet` and an optional
``name`` and returns a handle; on top of :mod:`phalanx.comm.collectives` it adds:

- names (:mod:`phalanx.comm.horovod_ops.names`): a named asynchronous collective on the global set
  starts once every rank has submitted that name, so submission never blocks; a second one with
  the name of one still in flight raises ``ValueError`` on the rank that issues it, before
  anything is sent (Horovod's duplicate-name error);
- join: on the global set, a rank inside :func:`join` answers the allreduces the others still
  issue with zeros (the op's identity for Min/Max/Product) and their object collectives and
  barriers; allgather, alltoall, reducescatter and broadcast raise on the training ranks, as
  Horovod's controller does (:mod:`phalanx.comm.horovod_ops.negotiate`);
- an integer Average truncates toward zero (Horovod's suite), where phalanx's own floors;
- dtypes the backend lacks travel cast (:mod:`phalanx.comm.horovod_ops.dtypes`); in-place forms work on
  non-contiguous tensors (through a contiguous copy);
- Adasum (``op=ADASUM``) on any backend: Horovod's vector-halving tree (:mod:`phalanx.comm.horovod_ops.adasum`).

``synchronize``/``poll`` take every handle returned here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.horovod_ops import adasum, names, negotiate
from phalanx.comm.horovod_ops.dtypes import FusedHandle, fuse, to_wire
from phalanx.comm.horovod_ops.names import (
    CompositeHandle,
    HorovodInternalError,
    poll,
    reset,
    synchronize,
)
from phalanx.comm.horovod_ops.process_sets import global_process_set
from phalanx.comm.mismatch import default_device

__all__ = [
    "ADASUM", "HorovodInternalError", "CompositeHandle", "allreduce_async", "grouped_allreduce_async",
    "allgather_async", "grouped_allgather_async", "broadcast_async", "alltoall_async", "reducescatter_async",
    "grouped_reducescatter_async", "sparse_allreduce_async", "barrier", "broadcast_object", "allgather_object",
    "join", "poll", "synchronize", "adasum_combine", "reset",
]

ADASUM = "adasum"


def _carry(tensor: torch.Tensor, group, inplace: bool, run) -> c.Handle:
    """Run ``run(wire_tensor, write_into_it)`` on the wire form of ``tensor``; cast back after."""
    wire, back = to_wire(tensor, group)
    t = wire.contiguous()
    inner = run(t, inplace or t is not tensor)  # write into our own copy, or into tensor when asked

    def finish(hs):
        out = hs[0].wait()
        if back is not None:
            out = (out[0].to(back), out[1]) if isinstance(out, tuple) else out.to(back)
        return tensor.copy_(out) if inplace and out is not tensor else out

    return CompositeHandle([inner], finish)


# ---------------------------------------------------------------- the collectives (run parts)
def _allreduce(tensor, op, pre, post, group, check, inplace, name=None, counts=None):
    if op == ADASUM:
        return _adasum(tensor, pre, post, group, check, inplace, name, counts)
    if c.ReduceOp(op) is c.ReduceOp.AVERAGE and not tensor.is_floating_point() and tensor.dtype != torch.bool:
        # Horovod's integer average truncates toward zero (its suite: t.div(n, rounding_mode="trunc");
        # phalanx's own Average floors)
        n = dist.get_world_size(group)
        summed = _allreduce(tensor, c.Sum, pre, post, group, check, inplace, name)
        return CompositeHandle([summed], lambda hs: hs[0].wait().div_(n, rounding_mode="trunc"))
    return _carry(tensor, group, inplace, lambda t, into: c.allreduce(
        t, op, group=group, async_op=True, name=name, prescale_factor=pre, postscale_factor=post, inplace=into, check=check))


def _allgather(tensor, group, check, name=None):
    return _carry(tensor, group, False, lambda t, _: c.allgather(t, group=group, async_op=True, name=name,
                                                                 check=check))


def _broadcast(tensor, root, group, check, inplace, name=None):
    return _carry(tensor, group, inplace, lambda t, into: c.broadcast(
        t, root, group=group, async_op=True, name=name, inplace=into, check=check))


def _alltoall(tensor, splits, group, check, name=None):
    return _carry(tensor, group, False, lambda t, _: c.alltoall(t, splits, group=group, async_op=True, name=name,
                                                                check=check))


def _reducescatter(tensor, op, pre, post, group, check, name=None):
    return _carry(tensor, group, False, lambda t, _: c.reducescatter(
        t, op, group=group, async_op=True, name=name, prescale_factor=pre, postscale_factor=post, check=check))


# ---------------------------------------------------------------- public async forms
def _op_value(op) -> str:
    return ADASUM if op == ADASUM else c.ReduceOp(op).value


def allreduce_async(tensor, op=c.Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None, inplace=False):
    return names.submit("allreduce", name, process_set or global_process_set, tensor, lambda group, check: _allreduce(
        tensor, op, prescale_factor, postscale_factor, group, check, inplace, name),
        op=_op_value(op), pre=prescale_factor, post=postscale_factor)


def grouped_allreduce_async(tensors, op=c.Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None, inplace=False):
    """One fused collective per dtype (Horovod's grouped allreduce); results split back per tensor."""
    ps, tensors = process_set or global_process_set, list(tensors)
    names.check_name("grouped_allreduce", name, ps)
    parts = []
    for k, (idx, flat) in enumerate(fuse(tensors)):
        part_name = None if name is None else f"{name}.{k}"
        counts = [tensors[j].numel() for j in idx] if op == ADASUM else None  # Adasum: per tensor

        def run(group, check, flat=flat, part_name=part_name, counts=counts):
            return _allreduce(flat, op, prescale_factor, postscale_factor, group, check, True, part_name, counts)
        parts.append((idx, names.submit("allreduce", part_name, ps, flat, run, op=_op_value(op), pre=prescale_factor,
                                   post=postscale_factor)))
    return names.track(name, ps, FusedHandle(parts, tensors, inplace))


def allgather_async(tensor, name=None, process_set=None):
    return names.submit("allgather", name, process_set or global_process_set, tensor,
                   lambda group, check: _allgather(tensor, group, check, name))


def grouped_allgather_async(tensors, name=None, process_set=None):
    handles = [allgather_async(t, None if name is None else f"{name}.{i}", process_set)
               for i, t in enumerate(tensors)]
    return names.track(name, process_set or global_process_set, CompositeHandle(handles, lambda hs: [h.wait() for h in hs]))


def broadcast_async(tensor, root_rank, name=None, process_set=None, inplace=False):
    root = int(root_rank)
    return names.submit("broadcast", name, process_set or global_process_set, tensor,
                   lambda group, check: _broadcast(tensor, root, group, check, inplace, name), root=root)


def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Returns ``(received, received_splits)`` when synchronized."""
    return names.submit("alltoall", name, process_set or global_process_set, tensor,
                   lambda group, check: _alltoall(tensor, splits, group, check, name))


def reducescatter_async(tensor, op=c.Average, name=None, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0):
    if tensor.dim() == 0:
        raise HorovodInternalError("reducescatter: a scalar (0-d tensor) cannot be scattered over the ranks; "
                                   "pass a tensor whose first dimension is split across them")
    if _op_value(op) not in ("sum", "average"):
        raise HorovodInternalError(f"reducescatter supports op=Sum or Average, got {op}")
    return names.submit("reducescatter", name, process_set or global_process_set, tensor, lambda group, check:
                   _reducescatter(tensor, op, prescale_factor, postscale_factor, group, check, name),
                   op=_op_value(op), pre=prescale_factor, post=postscale_factor)


def grouped_reducescatter_async(tensors, op=c.Average, name=None, process_set=None, prescale_factor=1.0,
                                postscale_factor=1.0):
    handles = [reducescatter_async(t, op, None if name is None else f"{name}.{i}", process_set, prescale_factor,
                                   postscale_factor) for i, t in enumerate(tensors)]
    return names.track(name, process_set or global_process_set, CompositeHandle(handles, lambda hs: [h.wait() for h in hs]))


def sparse_allreduce_async(tensor, op=c.Average, name=None, process_set=None):
    """Reduce a sparse COO tensor by allgathering its indices and values (as Horovod does).
    The handle is callable (Horovod returns a function) and works with ``synchronize``."""
    ps = process_set or global_process_set
    if not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async needs a sparse COO tensor, got layout {tensor.layout}; "
                        "use allreduce_async for dense tensors")
    if _op_value(op) not in ("sum", "average"):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {op}")
    t = tensor.coalesce()
    parts = [allgather_async(t.indices().t().contiguous(), None if name is None else f"{name}.indices", ps),
             allgather_async(t.values(), None if name is None else f"{name}.values", ps)]
    scale = 1.0 / ps.size() if _op_value(op) == "average" else 1.0

    def finish(hs):
        indices, values = (synchronize(h) for h in hs)
        return torch.sparse_coo_tensor(indices.t(), values * scale, tensor.shape).coalesce()

    return names.track(name, ps, CompositeHandle(parts, finish))


def barrier(process_set=None) -> None:
    group, _ = names.start_call("barrier", None, process_set or global_process_set, None)
    c.barrier(group=group)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    group, _ = names.start_call("broadcast_object", name, process_set or global_process_set, None, root=int(root_rank))
    return c.broadcast_object(obj, int(root_rank), group=group)


def allgather_object(obj, name=None, process_set=None):
    """Every rank's ``obj`` in rank order (a rank inside ``join`` contributes None)."""
    group, _ = names.start_call("allgather_object", name, process_set or global_process_set, None)
    return c.allgather_object(obj, group=group)


# ---------------------------------------------------------------- Adasum
adasum_combine = adasum.combine


def _adasum(tensor, pre, post, group, check, inplace, name=None, counts=None):
    """Adasum over the group (:mod:`phalanx.comm.horovod_ops.adasum`: Horovod's vector-halving tree, power-of-two
    worlds). Floating point only; ``counts`` splits a fused tensor into tensors with coefficients
    of their own. Runs at once; the handle is already complete."""
    if not tensor.is_floating_point():
        raise HorovodInternalError(f"Adasum needs a floating point tensor, got {tensor.dtype}")
    flat = c.scale_(tensor.detach().reshape(-1).clone(), pre)
    try:
        adasum.adasum_(flat, counts, group=group, check=check, name=name)
    except ValueError as e:
        raise HorovodInternalError(str(e)) from None
    out = c.scale_(flat.reshape(tensor.shape), post)
    if inplace:
        tensor.copy_(out)
        out = tensor
    return CompositeHandle([c.Handle(None, out)], lambda hs: out)


# ---------------------------------------------------------------- join
def _filled(desc: dict, rows_zero: bool = False) -> torch.Tensor:
    """The tensor a joined rank contributes: zeros (the op's identity for Min/Max/Product)."""
    dtype = getattr(torch, desc["dtype"].split(".")[-1])
    shape = tuple(desc["shape"] or ())
    if rows_zero:
        shape = (0,) + shape[1:]
    device = default_device()
    op = desc.get("op")
    if op == "product":
        return torch.ones(shape, dtype=dtype, device=device)
    if op in ("min", "max"):
        info = torch.finfo(dtype) if dtype.is_floating_point else (None if dtype == torch.bool else torch.iinfo(dtype))
        high = True if info is None else info.max
        low = False if info is None else info.min
        return torch.full(shape, high if op == "min" else low, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _answer(desc: dict) -> None:
    """Take part, from inside ``join``, in the collective ``desc`` describes."""
    kind, group = desc["call"], None
    if kind == "allreduce":
        op = desc["op"] if desc["op"] == ADASUM else c.ReduceOp(desc["op"])
        _allreduce(_filled(desc), op, desc["pre"], desc["post"], group, False, True).wait()
    elif kind == "allgather":
        _allgather(_filled(desc, rows_zero=True), group, False).wait()
    elif kind == "broadcast":
        _broadcast(_filled(desc), desc["root"], group, False, True).wait()
    elif kind == "alltoall":
        _alltoall(_filled(desc, rows_zero=True), [0] * dist.get_world_size(), group, False).wait()
    elif kind == "reducescatter":
        _reducescatter(_filled(desc), c.ReduceOp(desc["op"]), desc["pre"], desc["post"], group, False).wait()
    elif kind == "barrier":
        c.barrier(group)
    elif kind == "broadcast_object":
        c.broadcast_object(None, desc["root"], group=group)
    elif kind == "allgather_object":
        c.allgather_object(None, group=group)
    else:
        raise HorovodInternalError(f"join: cannot answer a {kind!r} collective")


def join(on_step=None, also_answered=None) -> int:
    """This rank has no more data: answer the others' collectives with zeros until every rank
    has joined; returns the global rank that joined last (Horovod's ``join``).

    ``on_step()`` answers one optimizer step announced on the world group (the data-parallel
    optimizer's zero gradients); ``also_answered()``, called once every rank has joined, returns
    how many requests were answered elsewhere (optimizer steps on a group of their own).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dist.get_rank() if dist.is_initialized() else 0
    answered = 0
    while True:
        kind, plan = negotiate.next_request(None)
        if kind == "done":
            break
        answered += 1
        if kind == "round":
            for desc in plan.ready + ([plan.call] if plan.call is not None else []):
                if negotiate.refusal(desc, plan.joined) is None:  # refused: the training ranks raise
                    _answer(desc)
        elif on_step is None:
            raise HorovodInternalError("join: the other ranks are stepping a DistributedOptimizer, but this rank "
                                       "has none; create the same DistributedOptimizer on every rank")
        else:
            on_step()
    if also_answered is not None:
        answered += also_answered()
    return negotiate.last_to_join(answered, None)
