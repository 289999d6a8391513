"""Expert parallelism: the experts of every MoE layer cut over the ``ep`` axis of the mesh.

Switch Transformer (Fedus et al. 2021, arXiv:2101.03961) and GShard (Lepikhin et
al. 2020, arXiv:2006.16668): each rank holds E/ep experts of each MoE layer and its
own slice of the batch; routed tokens travel to their experts' ranks and back by
all-to-all (variable split sizes), forward and backward. The layer itself
(router, capacity, balance loss) is :class:`phalanx.models.moe.MoE`, plain model code.

The package, one module per seam::

    dispatch.py     AllToAll (differentiable, variable splits) and AllToAllDispatch, the MoE's dispatcher
    shard.py        shard_experts: keep this rank's experts of every MoE layer; expert / dense names
    data.py         the two gradient groups (dense: dp × ep, experts: dp) and ExpertOptimizer
    hf.py           from_hf: Mixtral / Qwen3-MoE sparse blocks onto phalanx's MoE layer

Entry point::

    mesh = RankGrid(dp=2, ep=2)                                  # 4 ranks
    model, opt = expert_parallel(GPT(GPTConfig(n_experts=4)), mesh,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    x, y = batch_slice(mesh.batch_index)                         # every rank its own tokens
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step(); opt.zero_grad()

Checkpoints: ``phalanx.checkpoint.ExpertCheckpoint(model, opt)`` saves the experts as Shards
of one E-long stack per weight, so they load at another ep degree.

With pipeline and tensor parallel, :func:`phalanx.parallel.parallelize.parallelize`
takes a mesh with ``ep > 1`` and cuts the experts after tensor parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from phalanx.parallel.expert.data import (
    DATA_PARALLEL,
    ExpertOptimizer,
    build_optimizer,
    check_options,
)
from phalanx.parallel.expert.dispatch import AllToAll, AllToAllDispatch, all_to_all
from phalanx.parallel.expert.hf import from_hf
from phalanx.parallel.expert.shard import (
    ExpertParallelError,
    check_experts,
    expert_names,
    moe_layers,
    shard_experts,
    split_named_parameters,
)

__all__ = ["expert_parallel", "ExpertOptimizer", "ExpertParallelError", "AllToAll",
           "AllToAllDispatch", "all_to_all", "check_experts", "shard_experts", "moe_layers", "expert_names",
           "split_named_parameters", "DATA_PARALLEL", "from_hf"]


def expert_parallel(model: nn.Module, mesh, *,
                    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                    data_parallel: str = "allreduce", bucket_mb: float | None = None,
                    max_grad_norm: float | None = None):
    """Cut ``model``'s experts over ``mesh.ep_group`` and build its optimizer; returns ``(model, optimizer)``.

    ``mesh``: a :class:`~phalanx.parallel.grid.RankGrid` with pp = tp = 1 (for pipeline or
    tensor parallel use ``parallelize``). ``optimizer``: a function from parameters to a
    torch optimizer (called twice: dense weights, experts). ``data_parallel``:
    ``"allreduce"`` (bucketed, overlapped with backward) or ``"zero1|2"`` for the dense
    weights over the dense group. Every rank trains on its own slice of the batch
    (``mesh.batch_index`` of ``mesh.dp * mesh.ep``). ``max_grad_norm``: ``opt.step()`` first clips
    by the whole model's norm (the experts' squares summed over ep, the dense weights counted once) and
    returns it.
    """
    if mesh.pp > 1 or mesh.tp > 1:
        raise ExpertParallelError(f"expert_parallel: mesh has pp={mesh.pp}, tp={mesh.tp}; with pipeline or tensor "
                                  "parallel use phalanx.parallel.parallelize.parallelize(model, mesh, ...)")
    check_options(optimizer, data_parallel, max_grad_norm)
    check_experts(model, mesh.ep)
    if not dist.is_initialized():  # else the first broadcast fails deep in torch with its own advice
        raise ExpertParallelError("expert_parallel: torch.distributed is not initialised; call px.init() first "
                                  "(alone, or under `phalanx run -np N`)")
    shard_experts(model, mesh.ep_group)
    return model, build_optimizer(model, mesh, optimizer, data_parallel, bucket_mb, max_grad_norm)
