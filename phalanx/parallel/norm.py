"""The two halves of clipping by a norm that several places share: the squares of some gradients
added to a running sum, and torch's coefficient applied (``torch.nn.utils.clip_grad_norm_``'s
``max_norm / (norm + 1e-6)``, at most 1). :mod:`phalanx.parallel.clip` and the expert-parallel
optimizer use both; each sums the squares over its own groups in between.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["add_squares_", "scale_grads_"]


def add_squares_(sq: torch.Tensor, grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Add Σ ‖g‖² of ``grads`` (each in fp32) to the one-element ``sq`` in place, one gradient at a time; returns it."""
    for g in grads:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(sq.device) ** 2
    return sq


def scale_grads_(grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` in place by torch's clipping coefficient ``min(1, max_norm / (total + 1e-6))``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
