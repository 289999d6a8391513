"""Hugging Face MoE models (Mixtral, Qwen3-MoE) onto phalanx's MoE layer, so expert parallel cuts them.

transformers 5 keeps each sparse block's experts fused: ``experts.gate_up_proj``
``(E, 2·I, D)`` and ``experts.down_proj`` ``(E, D, I)``, with a top-k router
``gate.weight`` ``(E, D)`` (softmax in fp32, top-k, renormalised when
``norm_topk_prob``, always for Mixtral). :func:`from_hf` swaps every such block,
found by its shape (no import of transformers), for a :class:`phalanx.models.moe.MoE`
holding the same numbers: router weight as is, expert e a
:class:`~phalanx.models.moe.GatedExpert` of ``gate_up_proj[e]`` and ``down_proj[e]``.
With ``capacity_factor=None`` (the default: Mixtral drops no token) the block's output
is unchanged (tested to 1e-6). The parameter names change (``mlp.experts.3.gate_up``,
``mlp.router.gate.weight``); the balance loss enters backward through the layer
with ``aux_loss_weight`` (Mixtral's ``router_aux_loss_coef``), not through
``output_router_logits``. It is Switch's loss per layer, not transformers'
``load_balancing_loss_func``, which pools every layer's router outputs before the
product and counts a token's k choices k times: same aim, another function.

Example::

    model = MixtralForCausalLM(MixtralConfig(...))
    from_hf(model, aux_loss_weight=model.config.router_aux_loss_coef)
    model, opt = expert_parallel(model, RankGrid(ep=2), optimizer=lambda ps: torch.optim.AdamW(ps))
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.models.moe import GatedExpert, MoE
from phalanx.parallel.expert.shard import ExpertParallelError

__all__ = ["from_hf", "is_hf_moe_block"]


def is_hf_moe_block(m: nn.Module) -> bool:
    """A transformers sparse-MoE block with fused experts (Mixtral, Qwen3-MoE)."""
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    return (isinstance(getattr(gate, "weight", None), torch.Tensor) and hasattr(gate, "top_k")
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def _unfused(experts: nn.Module):
    """``index -> GatedExpert`` holding a copy of that expert's slices of the fused weights."""
    return lambda e: GatedExpert(experts.gate_up_proj.data[e].clone(), experts.down_proj.data[e].clone(),
                                 experts.act_fn)


def from_hf(model: nn.Module, *, capacity_factor: float | None = None, aux_loss_weight: float = 0.0) -> list[str]:
    """Replace every fused sparse-MoE block of ``model`` in place; returns their paths."""
    swapped = []
    for path, block in [(n, m) for n, m in model.named_modules() if is_hf_moe_block(m)]:
        if getattr(block, "jitter_noise", 0.0):
            raise ExpertParallelError(f"from_hf: {path} has router_jitter_noise={block.jitter_noise}; phalanx's "
                                      "router has no jitter: build the config with router_jitter_noise=0")
        gate, experts = block.gate, block.experts
        num, dim = gate.weight.shape
        moe = MoE(dim, num, int(gate.top_k), capacity_factor=capacity_factor, aux_loss_weight=aux_loss_weight,
                  normalize=bool(getattr(gate, "norm_topk_prob", True)), expert=_unfused(experts))
        with torch.no_grad():
            moe.router.gate.weight.copy_(gate.weight)
        parent_name, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, moe)
        swapped.append(path)
    if not swapped:
        raise ExpertParallelError(f"from_hf: {type(model).__name__} has no fused sparse-MoE block (gate + experts "
                                  "with gate_up_proj / down_proj, as Mixtral and Qwen3-MoE in transformers 5)")
    return swapped
