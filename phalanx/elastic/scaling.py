"""Hooks for a changed world size: rescale the learning rate or the per-rank batch.

When an elastic job continues with another number of workers, one of two things
must give (Goyal et al. 2017, "Accurate, Large Minibatch SGD", arXiv:1706.02677):

* keep the **per-rank batch**: the global batch grows or shrinks with the world,
  so scale the learning rate with it (the linear scaling rule) — :func:`scale_lr`;
* keep the **global batch**: give each rank ``global_batch // world`` samples and
  leave the learning rate alone; training continues exactly as it would have at
  the old size — :func:`keep_global_batch`.

Both return a hook for :meth:`phalanx.elastic.TorchState.on_world_change`; it is
called as ``hook(old_size, new_size)`` in ``sync()`` after a restart at another
size, on every rank, after rank 0's state was broadcast.

Example::

    state = elastic.TorchState(model, opt, sampler=sampler, batch=32, step=0)
    state.on_world_change(elastic.scale_lr(opt, sched))           # per-rank batch fixed
    # or: state.on_world_change(elastic.keep_global_batch(state, "batch", 256))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.elastic.state import live_topology

__all__ = ["scale_lr", "keep_global_batch"]


def scale_lr(optimizer: torch.optim.Optimizer, *schedulers: Any) -> Callable[[int, int], None]:
    """A hook multiplying every group's ``lr`` (and ``initial_lr``, and each scheduler's
    ``base_lrs``, so schedules keep the new scale) by ``new_size / old_size``."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"scale_lr: expected a torch optimizer, got {type(optimizer).__name__}")

    def hook(old: int, new: int) -> None:
        factor = new / old
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    value = group[key]
                    if isinstance(value, torch.Tensor):
                        value.mul_(factor)
                    else:
                        group[key] = value * factor
        for sched in schedulers:
            sched.base_lrs = [b * factor for b in sched.base_lrs]

    return hook


def keep_global_batch(state: Any, name: str, global_batch: int) -> Callable[[int, int], None]:
    """A hook setting ``state.<name> = global_batch // new_size`` (and that value now).

    Raises ValueError at the change if ``global_batch`` does not split evenly over the
    new world (the job would silently train on another global batch otherwise).
    """
    if global_batch < 1:
        raise ValueError(f"keep_global_batch: global_batch must be positive, got {global_batch}")

    def hook(old: int, new: int) -> None:
        if global_batch % new:
            raise ValueError(f"keep_global_batch: the global batch {global_batch} does not split over "
                             f"{new} workers; choose a global batch divisible by every size in "
                             "--min-np..--max-np")
        setattr(state, name, global_batch // new)

    topology = live_topology()
    size = topology.size if topology is not None else 1
    hook(size, size)
    return hook
