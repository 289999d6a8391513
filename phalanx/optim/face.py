"""An optimizer wrapper that torch accepts where it asks for an optimizer.

torch's LR schedulers (``StepLR``, ``OneCycleLR``, ``ReduceLROnPlateau`` ...), and other code,
check ``isinstance(optimizer, torch.optim.Optimizer)``. phalanx's wrappers (``DistributedOptimizer``,
Horovod's, ZeRO's) hold a torch optimizer and answer ``param_groups`` / ``state`` with its, so a
scheduler that changes ``lr`` changes the optimizer that steps; Horovod's wrapper is a subclass of the
wrapped optimizer's class for the same reason. :class:`OptimizerFace` makes a wrapper a
``torch.optim.Optimizer`` without running its ``__init__`` (which would build parameter groups and
state of the wrapper's own): torch's hook registries are made on first use, and copying or
pickling a wrapper keeps its own attributes (torch's ``__getstate__`` keeps only defaults, state
and groups).

Example::

    opt = px.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=...)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)   # was: "... is not an Optimizer"
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["OptimizerFace"]

_HOOKS = frozenset({"_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks"})


class OptimizerFace(torch.optim.Optimizer):
    """Base of an optimizer wrapper: ``isinstance(wrapper, torch.optim.Optimizer)`` holds; the
    subclass provides ``param_groups``, ``state``, ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` (usually from the optimizer it wraps)."""

    def __getattr__(self, name: str):
        if name in _HOOKS:  # torch's register_*_hook methods, on an instance whose __init__ torch did not run
            hooks = OrderedDict()
            object.__setattr__(self, name, hooks)
            return hooks
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self):
        return self.__dict__.copy()

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return object.__repr__(self)
