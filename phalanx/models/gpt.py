"""A small GPT (decoder-only transformer), written as an ``nn.Sequential`` so it splits into stages.

Children, in order: ``embed`` (token + position), ``block0`` … ``block{n-1}``,
``head`` (final LayerNorm + vocabulary projection). Each child takes and returns
one tensor, which is what a pipeline stage sends to the next. Attention infers
its local head count from the projection width, so tensor parallelism can cut
q/k/v by heads without the model knowing (see :func:`gpt_tp_plan`).

Example::

    from phalanx.models import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits_BTV = model(ids_BT)
    moe_gpt = GPT(GPTConfig(n_experts=8, moe_top_k=2))   # every block's MLP a mixture of 8 experts
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.moe import MoE

__all__ = ["GPT", "GPTConfig", "gpt_tp_plan"]


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 96
    """Number of distinct tokens (characters for a char-level model)."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide by the tensor-parallel size."""
    n_embd: int = 128
    """Width of the residual stream."""
    n_experts: int = 0
    """Experts per MoE block in place of each MLP (0: dense MLPs; :class:`phalanx.models.moe.MoE`)."""
    moe_top_k: int = 2
    """Experts each token is sent to (1: Switch, 2: GShard / Mixtral)."""
    capacity_factor: float | None = 1.25
    """Expert capacity as a multiple of an even share of the tokens; None drops no token."""
    moe_aux_weight: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer's alpha)."""


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        pos_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
        return self.tok(ids_BT) + self.pos(pos_T)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism q/k/v hold only this rank's heads.
        q, k, v = (f(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg) if not cfg.n_experts else MoE(
            cfg.n_embd, cfg.n_experts, cfg.moe_top_k, capacity_factor=cfg.capacity_factor,
            aux_loss_weight=cfg.moe_aux_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Sequential):
    """embed → blocks → head; ``forward(ids_BT) -> logits_BTV``."""

    def __init__(self, cfg: GPTConfig) -> None:
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must divide by n_head={cfg.n_head}")
        layers = {"embed": Embed(cfg)}
        layers.update({f"block{i}": Block(cfg) for i in range(cfg.n_layer)})
        layers["head"] = Head(cfg)
        super().__init__(OrderedDict(layers))
        self.config = cfg


def gpt_tp_plan(model: GPT) -> dict[str, str]:
    """Megatron's plan: q/k/v and fc colwise, attn.proj and mlp.proj rowwise, vocab-cut embedding and head.

    The head's logits stay cut by vocabulary: use ``vocab_parallel_cross_entropy`` as the loss.
    MoE blocks keep their experts whole (replicated over tp; expert parallel cuts them by expert).
    """
    plan = {"embed.tok": "vocab", "head.lm_head": "colwise"}
    mlp = () if model.config.n_experts else ("mlp.fc", "mlp.proj")
    for i in range(model.config.n_layer):
        for name in ("attn.q", "attn.k", "attn.v") + mlp[:1]:
            plan[f"block{i}.{name}"] = "colwise"
        for name in ("attn.proj",) + mlp[1:]:
            plan[f"block{i}.{name}"] = "rowwise"
    return plan
