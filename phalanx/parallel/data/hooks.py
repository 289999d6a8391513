"""The engine's hook seam: how services attach to the data-parallel engine without it importing them.

Two ways in, both public:

- :func:`register_engine_hook` ``(fn)``: ``fn(engine)`` for every :class:`GradientEngine`
  created from then on (autotune appends to ``engine.step_hooks`` there).
- :class:`StepObserver`: an object the fronts accept as ``balance=`` and the engine tells
  when each synchronised step's phases begin and end (load balancing, ``phalanx.balance``)::

      forward_begins()      DataParallel.forward, before the module runs
      backward_begins()     the first gradient of a backward pass arrives -> weight or None
      compute_ends()        backward is over, the last buckets are about to be launched
      wait_ends(wait_s)     the step's reduction is done, after ``wait_s`` seconds blocked on it

  ``balance=<int>`` (a global batch size) is turned into an observer by the factory the
  service registered (:func:`register_balance_factory`; ``import phalanx`` does it).

Example::

    from phalanx.parallel.data.hooks import register_engine_hook
    remove = register_engine_hook(lambda engine: engine.step_hooks.append(print))
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

__all__ = ["register_engine_hook", "run_engine_hooks", "StepObserver", "register_balance_factory",
           "resolve_balance"]

_engine_hooks: list[Callable[[Any], None]] = []
_balance_factory: list[Callable[[int, Any], StepObserver]] = []


def register_engine_hook(fn: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``fn(engine)`` for every :class:`GradientEngine` created from now on; returns a remover.

    The seam through which services (autotune) attach to the engine without the engine
    importing them. ``fn`` typically appends to ``engine.step_hooks``.
    """
    _engine_hooks.append(fn)
    return lambda: _engine_hooks.remove(fn) if fn in _engine_hooks else None


def run_engine_hooks(engine) -> None:
    """Hand a new engine to every registered hook (the engine's constructor calls it)."""
    for fn in list(_engine_hooks):
        fn(engine)


class StepObserver(abc.ABC):
    """Told when each synchronised step's phases begin and end (see the module docstring).

    ``bind(engine)`` runs once when it is attached: check that it fits the engine (group,
    world size, op) and raise with the fix otherwise.
    """

    def bind(self, engine) -> None:  # noqa: B027 (optional: nothing to check by default)
        pass

    @abc.abstractmethod
    def forward_begins(self) -> None: ...

    @abc.abstractmethod
    def backward_begins(self) -> float | None:
        """A backward pass starts; the weight of this rank's gradient in the step's weighted
        sum (the weights sum to 1 over the ranks), or None for the plain average."""

    @abc.abstractmethod
    def compute_ends(self) -> None: ...

    @abc.abstractmethod
    def wait_ends(self, wait_s: float) -> None: ...


def register_balance_factory(fn: Callable[[int, Any], StepObserver]) -> None:
    """``fn(global_batch, group)`` builds the observer for ``balance=<int>`` (phalanx.balance)."""
    _balance_factory[:] = [fn]


def resolve_balance(balance, group) -> StepObserver | None:
    """``balance=`` of DataParallel / DistributedOptimizer: None/False, a StepObserver, or a global batch."""
    if balance is None or balance is False:
        return None
    if isinstance(balance, StepObserver):
        return balance
    if isinstance(balance, int) and not isinstance(balance, bool) and _balance_factory:
        return _balance_factory[0](balance, group)
    raise TypeError(f"balance= takes a phalanx.balance.Balancer or the global batch size (int), got {balance!r}")
