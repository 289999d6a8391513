"""Gradient clipping by the whole model's norm when the model is split over pipeline stages, TP shards and experts.

Every LLM recipe clips at a global norm (1.0). When a rank holds only a piece of the model, the
norm of its own gradients is not that norm: Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053)
and torchtitan (``dist_utils.clip_grad_norm_``, which all-reduces the norm over the pp mesh) sum
the squares of every piece, each element once, and only then take the root::

    ‖g‖² = Σ_stages Σ_tp-ranks Σ_(params counted here) ‖g_p‖²
      a TP-sharded parameter (``p.tp_dim`` set): its slice on every tp rank, summed
      a replicated one (layer norms, a row-parallel bias): counted on tp rank 0 only
      a parameter tied across stages (a head tied to the embedding): counted on its first stage only
      an expert-parallel model (experts cut over an ep group, DeepSpeed-MoE's rule, arXiv:2201.05596):
        the experts' squares summed over ep; a dense weight (averaged over dp x ep) on ep rank 0 only

Without ZeRO the dp replicas hold the same averaged gradient, so the dp axis adds nothing; under
ZeRO each dp rank holds a disjoint shard and :class:`~phalanx.parallel.zero.ZeroOptimizer` adds
its dp sum first (``max_grad_norm=`` with ``tp_group=`` / ``pp_group=``, which ``parallelize``
passes). The cost is one scalar all-reduce per split axis.

Example (pp 2 x tp 2, no ZeRO; ``pm.clip_grad_norm_(1.0)`` does the same)::

    loss = pm.step(x, y)
    norm = clip_grad_norm_(pm.module, 1.0, tp_group=mesh.tp_group, pp_group=mesh.pp_group)
    opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.parallel.expert.shard import expert_names
from phalanx.parallel.norm import add_squares_, scale_grads_
from phalanx.parallel.pipeline.by_path import tied_of

__all__ = ["clip_grad_norm_", "counted_elsewhere", "sum_over"]


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def counted_elsewhere(module_or_params, tp_group=None, pp_group=None, ep_group=None) -> set[int]:
    """ids of the parameters whose gradient another rank of ``tp_group`` / ``pp_group`` / ``ep_group``
    counts in the norm: replicated ones (no ``tp_dim``) off tp rank 0, the copies of a parameter tied
    across stages (``module.tied_across_stages``) off the first stage holding one, and every weight but
    the experts (of the module's MoE layers) off ep rank 0."""
    params = list(module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params)
    out = set()
    if _size(tp_group) > 1 and _rank(tp_group) != 0:
        out |= {id(p) for p in params if getattr(p, "tp_dim", None) is None}
    if _size(ep_group) > 1 and _rank(ep_group) != 0:
        if not isinstance(module_or_params, nn.Module):
            raise TypeError("clip_grad_norm_(ep_group=...): pass the module (its MoE layers say which weights are "
                            "experts), not a list of parameters")
        experts = expert_names(module_or_params)
        out |= {id(p) for n, p in module_or_params.named_parameters() if n not in experts}
    stage = _rank(pp_group)
    for t in tied_of(module_or_params):
        if t.param is not None and t.stages[0] != stage:
            out.add(id(t.param))
    return out


def sum_over(sq: torch.Tensor, *groups) -> torch.Tensor:
    """``sq`` (a one-element tensor of squares) summed over each group of more than one rank, in place."""
    for g in groups:
        if _size(g) > 1:
            dist.all_reduce(sq, group=g)
    return sq


@torch.no_grad()
def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float, *, tp_group=None,
                    pp_group=None, ep_group=None) -> torch.Tensor:
    """Scale the gradients of this rank's piece so the whole model's norm is at most ``max_norm``.

    ``torch.nn.utils.clip_grad_norm_`` (L2, the same ``max_norm / (norm + 1e-6)`` coefficient), with
    the norm taken over every piece: the squares summed over ``tp_group``, ``pp_group`` and ``ep_group``
    (``RankGrid.tp_group`` / ``pp_group`` / ``ep_group``; None for an axis that is not split). Pass the
    stage *module* (``pm.module``) when a parameter is tied across stages, so its copies count once, and
    with ``ep_group`` (its MoE layers name the experts; the gradients already averaged: dense weights
    over dp x ep, experts over dp).
    Every rank of both groups must call it. Returns the total norm (the same on every rank).
    For ZeRO use ``max_grad_norm=`` instead: the gradients live in its shards, not in ``.grad``.
    """
    if max_norm is None or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): must be a positive number")
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    skip = counted_elsewhere(parameters if isinstance(parameters, nn.Module) else params, tp_group, pp_group,
                             ep_group)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    sq = add_squares_(torch.zeros(1, device=device), [p.grad for p in params if p.grad is not None and id(p) not in skip])
    total = sum_over(sq, tp_group, pp_group, ep_group).sqrt()
    scale_grads_(grads, max_norm, total)
    return total[0]
