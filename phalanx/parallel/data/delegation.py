"""What an optimizer wrapper passes through to the optimizer it wraps (``self.optimizer``).

Schedulers, AMP's GradScaler and user code read ``param_groups``, ``state`` and ``defaults`` on
whatever they were given; a wrapper that owns a torch optimizer answers with the wrapped one's.
"""

from __future__ import annotations

from phalanx.optim.face import OptimizerFace

__all__ = ["WrapsOptimizer"]


class WrapsOptimizer(OptimizerFace):
    """``param_groups``, ``state`` and ``defaults`` are those of ``self.optimizer``, and so are
    ``zero_grad``, ``state_dict`` and ``load_state_dict`` unless a wrapper adds its own state; a
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
