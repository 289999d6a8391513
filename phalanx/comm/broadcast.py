"""Broadcast helpers: parameters, buffers and optimizer state from one rank to the group.

Many tensors go as one flat collective per dtype and device (``broadcast_coalesced``);
``root_of(group)`` names the rank they come from by default (the group's first).
Used at wrap time by ``DataParallel`` and by the Horovod-style fronts.

Example::

    from phalanx.comm.broadcast import broadcast_parameters, broadcast_optimizer_state
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from phalanx.comm.collectives import broadcast, broadcast_object

__all__ = ["root_of", "broadcast_coalesced", "broadcast_parameters", "broadcast_buffers_", "broadcast_optimizer_state"]


def root_of(group) -> int:
    """Global rank of the first member of ``group`` (0 for the world)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_process_group_ranks(group)[0]


def broadcast_coalesced(tensors: list[torch.Tensor], root_rank: int, group, name: str) -> None:
    """Broadcast many tensors with one collective per dtype/device (in place)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), ts in sorted(by_kind.items(), key=lambda kv: str(kv[0])):
        flat = _flatten_dense_tensors([t.detach() for t in ts])
        broadcast(flat, root_rank=root_rank, group=group, inplace=True, name=f"{name}.{dtype}")
        for t, synced in zip(ts, _unflatten_dense_tensors(flat, ts)):
            t.detach().copy_(synced)


def broadcast_parameters(params, root_rank: int = 0, *, group=None) -> None:
    """Copy parameters (a ``state_dict``, ``named_parameters()`` or a module) from ``root_rank``, in place.

    Example::

        px.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if isinstance(params, nn.Module):
        params = params.state_dict()
    items = sorted(params.items()) if isinstance(params, Mapping) else sorted(params, key=lambda kv: kv[0])
    tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
    broadcast_coalesced(tensors, root_rank, group, "broadcast_parameters")


def broadcast_buffers_(module: nn.Module, root_rank: int, group) -> None:
    """Copy ``module``'s buffers (BatchNorm statistics) from ``root_rank``, in place, one collective per dtype."""
    buffers = list(module.buffers())
    if buffers:
        broadcast_coalesced(buffers, root_rank, group, "dp.buffers")


def broadcast_optimizer_state(optimizer, root_rank: int = 0, *, group=None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (empty state works too).

    Example::

        px.broadcast_optimizer_state(opt, root_rank=0)
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    state = inner.state_dict() if dist.get_rank() == root_rank else None
    state = broadcast_object(state, root_rank=root_rank, group=group)
    if dist.get_rank() != root_rank:
        inner.load_state_dict(state)
