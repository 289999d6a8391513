"""What an optimizer wrapper passes through to the optimizer it wraps (``self.optimizer``).

Schedulers, AMP's GradScaler and user code read ``param_groups``, ``state`` and ``defaults`` on
whatever they were given; a wrapper that owns a torch optimizer answers with the wrapped one's.
"""

from __future__ import annotations

from phalanx.optim.face import OptimizerFace

__all__ = ["WrapsOptimizer"]


class WrapsOptimizer(OptimizerFace):
    """``param_groups``, ``state`` and ``defaults`` are those of ``self.optimizer``; a
    ``torch.optim.Optimizer`` to torch (LR schedulers take it: :mod:`phalanx.optim.face`)."""

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults
