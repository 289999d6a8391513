"""A mixture-of-experts layer: top-k softmax router, expert capacity, load-balancing loss.

Switch Transformer (Fedus et al. 2021, arXiv:2101.03961) for k = 1 and its
auxiliary loss; GShard (Lepikhin et al. 2020, arXiv:2006.16668) for k = 2, the
capacity per expert and the rule that every token's first choice is served
before any token's second choice. Data flow of one forward (N tokens, E experts)::

    x_ND ─ router ─▶ probs_NE ─ top-k ─▶ (expert, weight) × k per token
         │                                   │ slot = place in its expert's queue
         │                                   │ (first choices first, then seconds; token order)
         │                                   ▼ slot ≥ capacity → dropped (the residual carries it)
         └─ gather, sorted by expert ─▶ x_MD ─ dispatch ─▶ expert e on its rows ─▶ y_MD
    out_ND = Σ_k weight · y   (index_add back to each token; 0 for a dropped choice)

``capacity = ceil(capacity_factor · N · k / E)`` counts the tokens of one forward
call on one rank (GShard's *group*); ``capacity_factor=None`` drops nothing.

The *dispatch* step is a small protocol (``MoE.dispatcher``): here every
expert is local (:class:`LocalDispatch`); :mod:`phalanx.parallel.expert`
swaps in an all-to-all over the ranks of an ``ep`` group and keeps only that
rank's experts, so this file knows nothing of parallelism.

The balance loss ``E · Σ_e f_e · P_e`` (f_e: share of the N·k choices that
picked e before any drop, P_e: mean router probability of e) is kept in
``moe.last_aux_loss`` and enters backward through the layer's output with
weight ``aux_loss_weight`` (Megatron-Core's way), so a training loop or a
pipeline stage needs no extra term in its loss.

Example::

    moe = MoE(dim=64, num_experts=8, top_k=2, capacity_factor=1.25)
    y_BTD = moe(x_BTD)
    moe.last_aux_loss, moe.last_dropped          # the balance loss, choices dropped for capacity
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "Router", "ExpertMLP", "GatedExpert", "Dispatcher", "LocalDispatch", "Routing", "route", "run_experts"]


class ExpertMLP(nn.Module):
    """The default expert: ``Linear(dim, hidden) → GELU → Linear(hidden, dim)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GatedExpert(nn.Module):
    """A SwiGLU-style expert as Mixtral and Qwen-MoE have it: ``down(act(gate(x)) · up(x))``,
    gate and up fused in one ``(2·hidden, dim)`` weight."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Callable = F.silu) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(gate_up)
        self.down = nn.Parameter(down)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down)


class Router(nn.Module):
    """Softmax gate over the experts; ``forward(x_ND) -> probs_NE``."""

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.gate(x_ND).float().softmax(dim=-1)


class Routing:
    """One forward's routing: which rows go to which expert, and what to give back to whom.

    ``token_M`` / ``weight_M``: for each kept choice, sorted by expert, its token and gate
    weight; ``counts_E``: rows per expert (sums to M); ``dropped``: choices over capacity;
    ``aux_loss``: Switch's balance loss.
    """

    def __init__(self, token_M, weight_M, counts_E, dropped, aux_loss) -> None:
        self.token_M, self.weight_M, self.counts_E = token_M, weight_M, counts_E
        self.dropped, self.aux_loss = dropped, aux_loss


def route(probs_NE: torch.Tensor, top_k: int, capacity: int | None, normalize: bool = True) -> Routing:
    """Top-k choices, GShard's slot order and capacity, Switch's balance loss (see the module docstring)."""
    n, e = probs_NE.shape
    weight_NK, expert_NK = probs_NE.topk(top_k, dim=-1)
    if normalize and top_k > 1:  # GShard / Mixtral: the k gate weights of a token sum to 1
        weight_NK = weight_NK / weight_NK.sum(dim=-1, keepdim=True)
    # Choice-major order: every token's first choice queues before any token's second.
    expert_C = expert_NK.t().reshape(-1)
    onehot_CE = F.one_hot(expert_C, e)
    slot_C = (onehot_CE.cumsum(0) * onehot_CE).sum(-1) - 1
    keep_C = slot_C < capacity if capacity is not None else torch.ones_like(slot_C, dtype=torch.bool)
    token_C = torch.arange(n, device=probs_NE.device).repeat(top_k)
    kept = keep_C.nonzero().squeeze(-1)
    order = torch.argsort(expert_C[kept], stable=True)  # by expert; within one, queue order
    kept = kept[order]
    counts_E = torch.bincount(expert_C[kept], minlength=e)
    f_E = onehot_CE.sum(0).to(probs_NE.dtype) / max(1, n * top_k)
    aux = e * (f_E * probs_NE.mean(0)).sum()
    return Routing(token_C[kept], weight_NK.t().reshape(-1)[kept], counts_E, int(n * top_k - kept.numel()), aux)


def run_experts(x_MD: torch.Tensor, counts: list[int], experts: nn.ModuleList) -> torch.Tensor:
    """Expert j on its ``counts[j]`` consecutive rows of ``x_MD``. Every expert runs, even on
    no rows, so each of its parameters gets a gradient (zeros) every step and the data-parallel
    engine never waits for one that did not come."""
    outs = [expert(rows) for expert, rows in zip(experts, torch.split(x_MD, counts))]
    return torch.cat(outs) if outs else x_MD


@runtime_checkable
class Dispatcher(Protocol):
    """Takes the rows sorted by expert (``counts_E`` per expert, all E of them) to the experts
    that own them, runs them, and brings the outputs back in the same order."""

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor: ...


class LocalDispatch:
    """Every expert lives here: no communication."""

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
        return run_experts(x_MD, counts_E.tolist(), experts)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``d(weight · aux)/d aux = weight`` enters the router's graph."""

    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight, ctx.dtype, ctx.device = weight, aux.dtype, aux.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=ctx.dtype, device=ctx.device), None


class MoE(nn.Module):
    """Top-k routed experts in place of one MLP; ``forward(x_*D) -> y_*D`` (any leading dims).

    ``expert``: a function ``index -> nn.Module`` (default :class:`ExpertMLP` of width
    ``hidden`` = 4·dim); experts are ordinary modules in ``self.experts``.
    ``capacity_factor=None``: no token is dropped. ``aux_loss_weight``: the balance loss's
    coefficient (Switch uses 0.01); 0 leaves it out of backward (it is still measured).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int = 2, *, capacity_factor: float | None = 1.25,
                 hidden: int | None = None, expert: Callable[[int], nn.Module] | None = None,
                 aux_loss_weight: float = 0.01, normalize: bool = True) -> None:
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE: num_experts={num_experts!r} must be a positive integer")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k!r} must be between 1 and num_experts={num_experts} "
                             "(Switch: 1, GShard / Mixtral: 2)")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor!r} must be > 0, or None for no dropping")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor, self.aux_loss_weight, self.normalize = capacity_factor, aux_loss_weight, normalize
        self.router = Router(dim, num_experts)
        make = expert or (lambda i: ExpertMLP(dim, hidden or 4 * dim))
        self.experts = nn.ModuleList(make(i) for i in range(num_experts))
        self.expert_offset = 0  # global index of self.experts[0] (expert parallel keeps a slice)
        self.dispatcher: Dispatcher = LocalDispatch()
        # What one forward's balance-loss gradient counts for: 1/m when a step is m micro-batches
        # whose losses are each divided by m (the pipeline sets it), as Megatron-Core scales it.
        self.aux_grad_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None
        self.last_dropped = 0

    def capacity(self, tokens: int) -> int | None:
        """Rows each expert takes from one forward of ``tokens`` tokens (None: unlimited)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        probs_NE = self.router(x_ND)
        if probs_NE.shape != (x_ND.shape[0], self.num_experts):  # a wider one breaks far below, a narrower one is silent
            raise ValueError(f"MoE: the router returned shape {tuple(probs_NE.shape)} for {x_ND.shape[0]} tokens; it "
                             f"must return (tokens, num_experts) = ({x_ND.shape[0]}, {self.num_experts}) probabilities")
        r = route(probs_NE, self.top_k, self.capacity(x_ND.shape[0]), self.normalize)
        y_MD = self.dispatcher(x_ND[r.token_M], r.counts_E, self.experts)
        out_ND = torch.zeros_like(x_ND).index_add(0, r.token_M, y_MD * r.weight_M.unsqueeze(-1).to(y_MD.dtype))
        self.last_aux_loss, self.last_dropped = r.aux_loss.detach(), r.dropped
        if self.aux_loss_weight and torch.is_grad_enabled():
            out_ND = _AuxLossGrad.apply(out_ND, r.aux_loss, float(self.aux_loss_weight * self.aux_grad_scale))
        return out_ND.view_as(x)
