"""Parallel strategies: data, ZeRO, pipeline, tensor, and their composition.

``clip_grad_norm_``: clip by the whole model's norm when it is split over pipeline stages and TP shards
(:mod:`phalanx.parallel.clip`).
"""

from phalanx.parallel.clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
