"""The Trainer's side of balancing: ``balance=True`` turned into a Balancer, and balanced epochs.

Example::

    bal = as_balancer(True, global_batch=64)               # a Balancer, or None for False/None
    for xb, yb in epoch_batches(bal, (x, y), epoch=0, fetch=lambda d, i: (d[0][i], d[1][i])):
        ...
"""

from __future__ import annotations

import torch

from phalanx.balance.balancer import Balancer
from phalanx.balance.sampler import BalancedSampler

__all__ = ["as_balancer", "epoch_batches"]


def as_balancer(balance, global_batch: int, group=None) -> Balancer | None:
    """``balance=`` of a front that knows its global batch: True, False/None or a Balancer."""
    if balance is None or balance is False:
        return None
    if balance is True:
        return Balancer(global_batch=global_batch, group=group)
    if isinstance(balance, Balancer):
        if balance.global_batch != global_batch:
            raise ValueError(f"balance=: the Balancer's global_batch {balance.global_batch} differs from "
                             f"batch_size x ranks = {global_batch}")
        return balance
    raise TypeError(f"balance= takes True/False or a phalanx.balance.Balancer, got {balance!r}")


class _EpochBatches:
    """One epoch of a BalancedSampler mapped through ``fetch(data, idx)``; lazy, with a length."""

    def __init__(self, sampler: BalancedSampler, data, fetch) -> None:
        self.sampler, self.data, self.fetch = sampler, data, fetch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        for idx in self.sampler:
            yield self.fetch(self.data, torch.tensor(idx, dtype=torch.int64))


def epoch_batches(balancer: Balancer, data, epoch: int, fetch, *, shuffle: bool = True, seed: int = 0,
                  accumulation: int = 1) -> _EpochBatches:
    """The Trainer's view: this rank's balanced batches of ``epoch``, each ``fetch(data, idx)``."""
    length = len(data[0]) if isinstance(data, tuple) else len(data)
    sampler = BalancedSampler(length, balancer, shuffle=shuffle, seed=seed, accumulation=accumulation)
    sampler.set_epoch(epoch)
    return _EpochBatches(sampler, data, fetch)
