"""Cut every MoE layer of a model over an ep group: each rank keeps E/ep consecutive experts.

The model is rewritten in place, as tensor parallel does: each
:class:`~phalanx.models.moe.MoE` keeps ``experts[r·E/ep : (r+1)·E/ep]`` on ep rank
r, records the first one's global index in ``expert_offset``, and dispatches
through :class:`~phalanx.parallel.expert.dispatch.AllToAllDispatch`. Every rank
of the group must start from the same full model (same seed, or a broadcast),
like every other strategy here.

Example::

    layers = shard_experts(model, mesh.ep_group)     # the MoE layers, now holding their slice
    expert_names(model)                              # {"block0.moe.experts.0.fc.weight", ...}
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from phalanx.models.moe import MoE
from phalanx.parallel.expert.dispatch import AllToAllDispatch

__all__ = ["ExpertParallelError", "moe_layers", "check_experts", "shard_experts", "expert_names", "split_named_parameters"]


class ExpertParallelError(ValueError):
    """An expert-parallel setup that cannot work (the message names the field and the fix)."""


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer of ``model`` with its module path."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def check_experts(model: nn.Module, ep: int) -> list[tuple[str, MoE]]:
    """The MoE layers of ``model``, or :class:`ExpertParallelError` (one line) when it has none,
    a layer's expert count does not divide by ``ep``, or a layer was cut already."""
    layers = moe_layers(model)
    if not layers:
        raise ExpertParallelError(f"expert parallel: {type(model).__name__} has no MoE layer "
                                  "(phalanx.models.moe.MoE); build the model with MoE blocks, e.g. "
                                  "GPTConfig(n_experts=8)")
    for name, moe in layers:
        if moe.expert_offset or len(moe.experts) != moe.num_experts:
            raise ExpertParallelError(f"expert parallel: {name or 'the model'} holds {len(moe.experts)} of "
                                      f"{moe.num_experts} experts: it is cut already; build a fresh model")
        if moe.num_experts % ep:
            raise ExpertParallelError(f"expert parallel: {name or 'the model'} has num_experts={moe.num_experts}, "
                                      f"which does not divide by ep={ep}; pick ep dividing {moe.num_experts}")
    return layers


def shard_experts(model: nn.Module, group) -> list[MoE]:
    """Keep this rank's experts of every MoE layer and dispatch over ``group`` (all-to-all);
    checked first by :func:`check_experts`."""
    ep = dist.get_world_size(group) if dist.is_initialized() and group is not None else 1
    layers = check_experts(model, ep)
    if ep == 1:
        return [m for _, m in layers]
    rank = dist.get_rank(group)
    for _, moe in layers:
        local = moe.num_experts // ep
        moe.experts = nn.ModuleList(list(moe.experts)[rank * local:(rank + 1) * local])
        moe.expert_offset = rank * local
        moe.dispatcher = AllToAllDispatch(group, moe.num_experts)
    return [m for _, m in layers]


def expert_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters that belong to experts."""
    names = set()
    for path, moe in moe_layers(model):
        prefix = f"{path}.experts." if path else "experts."
        names.update(prefix + n for n, _ in moe.experts.named_parameters())
    return names


def split_named_parameters(model: nn.Module) -> tuple[list, list]:
    """``(dense, experts)``: the model's trainable ``(name, parameter)`` pairs, experts apart."""
    experts = expert_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if n not in experts], [(n, p) for n, p in named if n in experts]
