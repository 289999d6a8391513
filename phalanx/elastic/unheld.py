"""An optimizer with state that steps an elastic state's model but is not in that state: refused.

A worker admitted to the job takes every piece of the state from rank 0, and a survivor of a lost
worker (or a restarted group) goes back to the last commit. An optimizer left out of the state keeps
its moments on the members and starts afresh on the newcomer, so from the first step after a grow
the replicas apply different updates and drift apart, with no error anywhere (measured: after a
2 → 3 grow with Adam left out, the newcomer's weights summed to 3.57 against the members' 1.95).
Horovod's elastic state has the same trap (``hvd.elastic.TorchState(model, optimizer)`` is the
documented call). So at the first step of each optimizer, a global post-step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``) checks: an optimizer that now holds
state (Adam's moments, SGD's momentum buffers) for parameters of the state's modules must be one of
the state's pieces. A stateless optimizer (SGD without momentum) holds nothing to lose and passes.

A wrapper in the state (``px.DistributedOptimizer``, ZeRO's) answers ``.state`` with the optimizer
it wraps, which is the one that steps, so the check compares the ``state`` dicts themselves. ZeRO's
inner optimizer steps flat master shards, not the modules' parameters, and is never refused here.

Example::

    state = elastic.TorchState(model, sampler=sampler)    # the optimizer forgotten
    opt.step()   # ValueError: ... pass it: TorchState(model, optimizer, ...)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["watch"]


def watch(pieces: Callable[[], Iterable[Any] | None]):
    """Refuse, at its first step, an optimizer with state over the modules of ``pieces()`` (the state's
    pieces, read at that step; ``None`` once the state is gone) that is not one of them. Returns the
    hook's handle."""
    checked: weakref.WeakSet = weakref.WeakSet()

    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if optimizer in checked:
            return
        held = pieces()
        if held is None or not optimizer.state:  # (a step that found no gradient makes no state yet)
            return
        checked.add(optimizer)
        held = list(held)
        if any(optimizer.state is p.state for p in held if isinstance(p, torch.optim.Optimizer)):
            return
        params = {id(p) for m in held if isinstance(m, torch.nn.Module) for p in m.parameters()}
        if any(id(p) in params for group in optimizer.param_groups for p in group["params"]):
            name = type(optimizer).__name__
            raise ValueError(f"elastic.TorchState: {name} steps the state's model and keeps state ({name}'s "
                             "moments or buffers) but is not in the state, so a worker that joins or rolls back "
                             "starts it afresh while the others keep theirs and the replicas drift apart; pass "
                             "it: TorchState(model, optimizer, ...)")

    return register_optimizer_step_post_hook(hook)
