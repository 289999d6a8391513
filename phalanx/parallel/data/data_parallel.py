"""``DataParallel``: wrap a module so that ``loss.backward()`` returns with gradients averaged.

Each rank holds a full replica and computes gradients on its own slice of the
global batch; gradients are averaged so every replica takes the same step
(Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020). The gradient engine (:mod:`.gradients`) fuses gradients
into flat buckets and overlaps their allreduce with the rest of backward; this
front waits for it inside backward (DDP semantics)::

    forward ──► [re-broadcast buffers] ──► module(x)
    backward ──► hooks fill buckets ──► async allreduce per bucket ──► wait at the end of backward

Example::

    import torch, phalanx as px
    px.init()
    model = px.DataParallel(torch.nn.Linear(10, 1), bucket_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 10)).sum().backward()   # gradients averaged when this returns
    opt.step()
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from phalanx import trace
from phalanx.comm.broadcast import broadcast_buffers_, broadcast_parameters, root_of
from phalanx.comm.collectives import Average, ReduceOp, allreduce
from phalanx.log import get_logger
from phalanx.parallel.data.config import EngineConfig, resolve_topology
from phalanx.parallel.data.gradients import GradientEngine
from phalanx.parallel.data.hooks import resolve_balance
from phalanx.parallel.data.optimizer_overlap import OptimizerOverlap

__all__ = ["DataParallel"]

_log = get_logger(__name__)


def _tensors_of(out):
    """The tensors of a forward's output (a tensor, or a flat tuple/list/dict of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _sparse_param_ids(module: nn.Module) -> set[int]:
    return {id(m.weight) for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


class DataParallel(nn.Module):
    """Wrap a module so that ``loss.backward()`` returns with gradients averaged over the ranks.

    Parameters and buffers are broadcast from the group's first rank at wrap time; with
    ``broadcast_buffers=True`` buffers (BatchNorm statistics) are re-broadcast before
    every forward, as DDP does. See ``docs/data_parallel.md`` for every knob and its cost.

    ``gradient_as_bucket_view=True`` (default) leaves each ``p.grad`` of at least
    ``VIEW_MIN_NUMEL`` elements as a view into its bucket after the first reduction, so
    later backward passes accumulate in place and the reduced gradient needs no copy back
    (DDP's option of the same name); a ``p.grad`` kept across steps is then overwritten by
    the next reduction. Smaller gradients, and all of them with ``False``, are copied.

    ``overlap_optimizer=opt`` (SGD, Adam, AdamW) steps ``opt`` on each piece of the averaged
    gradient as soon as it is final, while the rest is still on the wire
    (:mod:`phalanx.parallel.data.optimizer_overlap`); keep calling ``opt.step()``, which then steps only
    what was not stepped yet. Not with gradient clipping or ``GradScaler``: the update
    runs before the whole gradient is known.

    Example::

        model = px.DataParallel(net, bucket_mb=25, compression="fp16")
        with model.no_sync():              # accumulate locally
            model(x1).sum().backward()
        model(x2).sum().backward()         # this one communicates
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        topology=None,
        group=None,
        bucket_mb: float | None = None,
        compression=None,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        sparse_as_dense: bool = False,
        algorithm: str | None = None,
        balance=None,
        gradient_as_bucket_view: bool = True,
        overlap_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs phalanx.init() (or torch.distributed) first")
        self.module = module
        self.group = group
        self.broadcast_buffers = broadcast_buffers
        self._joining = False
        broadcast_parameters(module.state_dict(), root_rank=root_of(group), group=group)
        self._engine_config = EngineConfig(
            group=group, topology=resolve_topology(topology), bucket_mb=bucket_mb, compression=compression, op=op,
            gradient_predivide_factor=gradient_predivide_factor, find_unused_parameters=find_unused_parameters,
            sparse_as_dense=sparse_as_dense, sparse_ids=frozenset(_sparse_param_ids(module)), algorithm=algorithm,
            wait_in_backward=True, gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self._all_params = list(module.parameters())
        self._trainable = tuple(p.requires_grad for p in self._all_params)
        self._engine = GradientEngine(self._trainable_named(), self._engine_config)
        self.overlap = None
        if overlap_optimizer is not None:
            if find_unused_parameters:
                raise ValueError("overlap_optimizer cannot be combined with find_unused_parameters=True: whether a "
                                 "parameter was used on any rank (and must keep grad=None) is known only after "
                                 "every bucket; drop one of the two")
            self.overlap = OptimizerOverlap(overlap_optimizer, [p for _, p in self._trainable_named()])
            self._engine.overlap = self.overlap
        # a phalanx.balance.Balancer (or a global batch size): docs/load_balancing.md
        self.balancer = self._engine.attach(resolve_balance(balance, group))

    def _trainable_named(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def _follow_requires_grad(self) -> None:
        """Re-bucket when ``requires_grad`` changed since the last forward (freeze/unfreeze while training).

        Every rank must make the same change; the first iteration of the new buckets goes
        through the cross-rank mismatch check, which names the difference if they did not.
        Compressor state (error-feedback residuals) is tied to the old layout and starts afresh.
        """
        trainable = tuple(p.requires_grad for p in self._all_params)
        if trainable == self._trainable:
            return
        old = self._engine
        if old.busy():
            raise RuntimeError("requires_grad changed while a gradient reduction was in flight; "
                               "change it between iterations (after optimizer.step())")
        changed = sum(a != b for a, b in zip(trainable, self._trainable))
        _log.info("requires_grad changed on %d parameter(s): rebuilding the gradient buckets", changed)
        old.remove_hooks()
        self._trainable = trainable
        self._engine = GradientEngine(self._trainable_named(), self._engine_config)
        self._engine.take_over(old)

    def forward(self, *args, **kwargs):
        if trace.enabled():
            return self._traced_forward(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _traced_forward(self, *args, **kwargs):
        """Forward as a span; backward from the moment the output's gradient arrives (timeline only)."""
        with trace.span("forward", "compute"):
            out = self._forward(*args, **kwargs)
        engine = self._engine
        for t in _tensors_of(out):
            if t.requires_grad:
                t.register_hook(lambda grad: setattr(engine, "backward_start", time.perf_counter()))
                break
        return out

    def _forward(self, *args, **kwargs):
        self._follow_requires_grad()
        if self.balancer is not None:
            self.balancer.forward_begins()
        if self._joining:
            allreduce(torch.ones(1, device=self._engine.device), op=ReduceOp.SUM, group=self.group, name="dp.join")
        if self.broadcast_buffers and self._engine.world > 1:
            broadcast_buffers_(self.module, root_of(self.group), self.group)
        return self.module(*args, **kwargs)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for gradients so far (ring estimate 2(N-1)/N per allreduce payload)."""
        return self._engine.bytes_sent

    def set_sample_weight(self, w: float) -> None:
        """Weight this rank's gradient by ``w`` (weights sum to 1 over ranks) instead of 1/N."""
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"sample weight must be in [0, 1] (weights sum to 1 over ranks), got {w}")
        self._engine.sample_weight = float(w)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block communicates."""
        before, self._engine.require_sync = self._engine.require_sync, False
        try:
            yield
        finally:
            self._engine.require_sync = before

    @contextlib.contextmanager
    def join(self):
        """Uneven inputs: a rank that leaves the block keeps contributing zero gradients until all do.

        Gradients are still averaged over the whole group (joined ranks count as zeros), like
        DDP's default. Not supported together with ``no_sync()`` inside the block.
        """
        if self.balancer is not None:
            raise RuntimeError("join() cannot be combined with balance=: BalancedSampler gives every rank "
                               "the same number of steps, so there are no uneven inputs to join")
        self._joining = True
        try:
            yield
        except BaseException:
            self._joining = False
            raise
        self._joining = False
        while True:
            active = allreduce(torch.zeros(1, device=self._engine.device), op=ReduceOp.SUM, group=self.group,
                               name="dp.join")
            if active.item() == 0:
                return
            if self.broadcast_buffers and self._engine.world > 1:
                broadcast_buffers_(self.module, root_of(self.group), self.group)
            self._engine.shadow()

    def state_dict(self, *args, **kwargs):  # the plain module's keys, loadable without the wrapper
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def comm_state_dict(self) -> dict:
        """The engine's own state (compressor residuals under ``"compression"``)."""
        return self._engine.state_dict()

    def load_comm_state_dict(self, state: dict) -> None:
        self._engine.load_state_dict(state)
