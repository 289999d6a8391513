"""Horovod-style front of the data-parallel engine: ``DistributedOptimizer`` and the broadcasts.

``DistributedOptimizer`` holds a plain ``torch.optim`` optimizer (composition,
no classes built at run time). Gradients are bucketed and launched during
backward exactly as under ``DataParallel``; the wait happens in
``synchronize()`` or ``step()``, so you can clip or unscale in between::

    loss.backward()            # buckets launched as gradients become ready
    opt.synchronize()          # wait: p.grad now holds the average
    scaler.unscale_(opt); clip_grad_norm_(...)
    with opt.skip_synchronize():
        scaler.step(opt)

Example::

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    px.broadcast_parameters(model.state_dict(), root_rank=0)
    px.broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from phalanx import trace
from phalanx.comm.collectives import Average, ReduceOp, broadcast, broadcast_object

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "root_of"]


def root_of(group) -> int:
    """Global rank of the first member of ``group`` (0 for the world)."""
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_process_group_ranks(group)[0]


def _broadcast_coalesced(tensors: list[torch.Tensor], root_rank: int, group, name: str) -> None:
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
    _broadcast_coalesced(tensors, root_rank, group, "broadcast_parameters")


def broadcast_buffers_(module: nn.Module, root_rank: int, group) -> None:
    buffers = [b for b in module.buffers()]
    if buffers:
        _broadcast_coalesced(buffers, root_rank, group, "dp.buffers")


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


class DistributedOptimizer:
    """Average gradients across ranks before the inner optimizer's step (Horovod's front).

    Args mirror ``horovod.torch.DistributedOptimizer``; ``bucket_mb`` and
    ``find_unused_parameters`` (default True here: a parameter without a gradient
    contributes zeros, as in Horovod) tune the shared engine.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
        *,
        compression=None,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        group=None,
        sparse_as_dense: bool = False,
        topology=None,
        bucket_mb: float = 25.0,
        find_unused_parameters: bool = True,
        algorithm: str = "flat",
    ) -> None:
        from phalanx.parallel.data import GradientEngine

        self.optimizer = optimizer
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(opt_params)]
        else:
            named = list(named_parameters)
            if len({n for n, _ in named}) != len(named):
                raise ValueError("named_parameters has duplicate names; pass model.named_parameters()")
            known = {id(p) for _, p in named}
            unnamed = [p for p in opt_params if id(p) not in known]
            if unnamed:
                raise ValueError(
                    f"named_parameters is missing {len(unnamed)} parameter(s) the optimizer updates; "
                    "pass model.named_parameters() of the same model the optimizer was built from"
                )
            in_opt = {id(p) for p in opt_params}
            named = [(n, p) for n, p in named if id(p) in in_opt]
        named = [(n, p) for n, p in named if p.requires_grad]
        self._engine = GradientEngine(
            named, group=group, topology=topology, bucket_mb=bucket_mb, compression=compression, op=op,
            gradient_predivide_factor=gradient_predivide_factor, find_unused_parameters=find_unused_parameters,
            sparse_as_dense=sparse_as_dense, algorithm=algorithm,
            backward_passes_per_step=backward_passes_per_step, wait_in_backward=False,
        )
        self._skip = False

    # delegation -----------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, group: dict) -> None:
        raise NotImplementedError("DistributedOptimizer: build a new one after adding param groups")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def bytes_sent(self) -> int:
        return self._engine.bytes_sent

    def state_dict(self) -> dict:
        out = self.optimizer.state_dict()
        comm = self._engine.state_dict()
        if "compression" in comm:
            out = {**out, "compression": comm["compression"]}
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        comm = state.pop("compression", None)
        self.optimizer.load_state_dict(state)
        if comm is not None:
            self._engine.load_state_dict({"compression": comm})

    # synchronisation -------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every launched reduction; afterwards ``p.grad`` holds the average."""
        self._engine.wait()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside the block ``step()`` does not synchronize (you already called ``synchronize()``)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        with trace.span("optimizer_step", "compute"):
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
