"""Gradients of an expert-parallel model: dense weights over dp × ep, experts over dp, one optimizer.

Why two groups (DeepSpeed-MoE, Rajbhandari et al. 2022, arXiv:2201.05596; GShard, arXiv:2006.16668):
on a ``dp × ep`` mesh every rank trains on its own slice of the batch, so a weight every
rank holds (attention, router, embeddings — *dense*) is plain data parallel over all
dp·ep of them. Expert j lives on one rank of each ep group, and the all-to-all's backward
already brought it the gradient of every token routed to it from the whole ep group;
only the dp ranks that hold the same expert still differ. With the loss the mean
over the dp·ep slices::

    dense  grad = (1 / dp·ep) Σ over the dense group        (average over mesh.dense_group)
    expert grad = (1 / dp·ep) Σ over the dp group           (÷ ep on the rank, then average over mesh.dp_group)

The ``÷ ep`` is a gradient hook on each expert weight. ``max_grad_norm`` clips by the whole model's
norm: the experts' squares summed over the ep group (each ep rank holds other experts; the dp ranks
holding the same ones, the same averaged gradient), the dense weights' counted once (every rank holds
their average; under ZeRO their shards summed over the dense group), one coefficient for both. Each group has its own
bucketed, overlapped engine (:class:`~phalanx.parallel.data.DistributedOptimizer`);
ZeRO (``data_parallel="zero1|2"``) shards the dense weights' optimizer state
(and gradients) over the dense group and leaves the experts as they are: they are
already cut ep ways. ZeRO-3 is refused: it shards every parameter of the module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm.collectives import broadcast
from phalanx.parallel.data import DistributedOptimizer
from phalanx.parallel.expert.shard import ExpertParallelError, split_named_parameters
from phalanx.parallel.norm import add_squares_, scale_grads_

__all__ = ["ExpertOptimizer", "DATA_PARALLEL", "check_options", "build_optimizer", "scale_expert_grads"]

DATA_PARALLEL = ("allreduce", "zero1", "zero2")


class ExpertOptimizer:
    """One optimizer over an expert-parallel model: ``dense`` (a DistributedOptimizer over the
    dense group, or a ZeroOptimizer) and ``experts`` (a DistributedOptimizer over the dp group).

    ``step()`` and ``zero_grad()`` act on both; ``state_dict()`` is ``{"dense": …, "experts": …}``.
    """

    def __init__(self, dense, experts, max_grad_norm: float | None = None, ep_group=None) -> None:
        self.dense, self.experts = dense, experts
        self.max_grad_norm, self.ep_group = max_grad_norm, ep_group
        self._zero = not isinstance(dense, DistributedOptimizer)
        if self._zero and max_grad_norm is not None:  # ZeRO clips the dense shards, the experts' squares added
            dense.outside_squares = self._expert_squares

    @property
    def param_groups(self) -> list[dict]:
        return list(self.dense.param_groups) + list(self.experts.param_groups)

    def _params(self, opt) -> list[torch.Tensor]:
        return [p for g in opt.param_groups for p in g["params"] if p.grad is not None]

    def _expert_squares(self) -> torch.Tensor:
        """Σ ‖g‖² of every expert of the model: this rank's, summed over the ep group."""
        params = [p for g in self.experts.param_groups for p in g["params"]]
        sq = add_squares_(torch.zeros(1, device=params[0].device if params else None),
                          [p.grad for p in self._params(self.experts)])
        if self.ep_group is not None:
            dist.all_reduce(sq, group=self.ep_group)
        return sq

    def step(self, closure=None):
        """Step both; with ``max_grad_norm`` clip first by the whole model's norm (returned, else the
        dense optimizer's return value)."""
        if self.max_grad_norm is None:
            loss = self.dense.step(closure) if closure is not None else self.dense.step()
            self.experts.step()
            return loss
        if closure is not None:
            raise ValueError("ExpertOptimizer.step(closure=...) with max_grad_norm is not supported; compute the "
                             "loss before step()")
        self.experts.synchronize()
        if self._zero:  # ZeRO adds _expert_squares to its norm, clips its shards and steps them
            total = self.dense.step()
            if total is None:  # a non-finite norm: ZeRO skipped its step, and so do the experts
                return None
        else:
            self.dense.synchronize()
            sq = add_squares_(self._expert_squares(), [p.grad for p in self._params(self.dense)])
            total = sq.sqrt()[0]
        scale_grads_([p.grad for p in self._params(self.experts) + ([] if self._zero else self._params(self.dense))],
                     self.max_grad_norm, total)
        if not self._zero:
            with self.dense.skip_synchronize():
                self.dense.step()
        with self.experts.skip_synchronize():
            self.experts.step()
        return total.reshape(())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.experts.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "experts": self.experts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.dense.load_state_dict(state["dense"])
        self.experts.load_state_dict(state["experts"])

    def __repr__(self) -> str:
        return f"ExpertOptimizer(dense={self.dense!r}, experts={self.experts!r})"


def scale_expert_grads(experts: list[tuple[str, nn.Parameter]], ep: int) -> None:
    """Divide each expert weight's gradient by ``ep`` as it is computed (see the module docstring)."""
    if ep > 1:
        for _, p in experts:
            p.register_hook(lambda g, ep=ep: g / ep)


def check_options(optimizer, data_parallel: str, max_grad_norm: float | None = None) -> None:
    """One line for a bad ``data_parallel``, ``max_grad_norm`` or an ``optimizer`` that is not a function of
    parameters."""
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ExpertParallelError(f"expert parallel: max_grad_norm={max_grad_norm!r}: must be a positive number, "
                                  "or None to not clip")
    if data_parallel == "zero3":
        raise ExpertParallelError("expert parallel: data_parallel='zero3' is not supported: ZeRO-3 shards every "
                                  "parameter of the module, and the experts are cut over ep already; use 'zero1' or "
                                  "'zero2' (the dense weights' optimizer state and gradients sharded)")
    if data_parallel not in DATA_PARALLEL:
        raise ExpertParallelError(f"expert parallel: data_parallel={data_parallel!r}: use one of "
                                  f"{', '.join(map(repr, DATA_PARALLEL))}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ExpertParallelError("expert parallel: optimizer= must be a function from parameters to an optimizer, "
                                  "e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)")


def build_optimizer(model: nn.Module, mesh, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                    data_parallel: str = "allreduce", bucket_mb: float | None = None,
                    max_grad_norm: float | None = None) -> ExpertOptimizer:
    """The ExpertOptimizer of ``model`` (its experts cut already) on ``mesh``; starts every rank
    from the values of its groups' first ranks (dense: the dense group's, experts: the dp group's)."""
    check_options(optimizer, data_parallel, max_grad_norm)
    ep_group = mesh.ep_group if mesh.ep > 1 else None
    dense, experts = split_named_parameters(model)
    scale_expert_grads(experts, mesh.ep)
    _sync(experts, mesh.dp_ranks[0], mesh.dp_group)
    expert_opt = DistributedOptimizer(optimizer([p for _, p in experts]), named_parameters=experts,
                                      group=mesh.dp_group, bucket_mb=bucket_mb)
    if data_parallel == "allreduce":
        _sync(dense, mesh.dense_ranks[0], mesh.dense_group)
        dense_opt = DistributedOptimizer(optimizer([p for _, p in dense]), named_parameters=dense,
                                         group=mesh.dense_group, bucket_mb=bucket_mb)
        return ExpertOptimizer(dense_opt, expert_opt, max_grad_norm, ep_group)
    from phalanx.parallel.zero import zero

    # zero() starts every parameter of the module from the group's first rank; the experts
    # of the other ep ranks are other experts, so they are put back after.
    kept = [p.detach().clone() for _, p in experts]
    _, dense_opt = zero(model, optimizer([p for _, p in dense]), stage=int(data_parallel[-1]),
                        group=mesh.dense_group, max_grad_norm=max_grad_norm,
                        **({"bucket_mb": bucket_mb} if bucket_mb else {}))
    with torch.no_grad():
        for (_, p), value in zip(experts, kept):
            p.copy_(value)
    return ExpertOptimizer(dense_opt, expert_opt, max_grad_norm, ep_group)


def _sync(named: list[tuple[str, nn.Parameter]], root: int, group) -> None:
    for _, p in named:
        broadcast(p.data, root_rank=root, group=group, inplace=True, name="ep.init")
