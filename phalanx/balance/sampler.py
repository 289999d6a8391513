"""BalancedSampler: each rank's variable share of a fixed global batch, every sample once per epoch.

The epoch is one permutation cut into global batches of ``G`` samples; the
:class:`~phalanx.balance.Balancer` decides how each global batch is cut
into per-rank pieces (``sizes`` sums to ``G``). Every rank walks the same
permutation and applies the same cut, so the pieces tile the epoch whatever the
split does between steps::

    permutation  p0 … p63 | p64 … p127 | p128 …
    step 0, sizes [32, 32]:  rank 0 p0–p31    rank 1 p32–p63
    step 1, sizes [43, 21]:  rank 0 p64–p106  rank 1 p107–p127     (the balancer moved 11 samples)

The last, partial global batch of ``R`` samples is split in the same
proportions (at least one sample per rank); when ``R`` is smaller than the
number of ranks it is folded into the previous step instead, so no sample is
dropped and no rank gets an empty batch.

Each yield also tells the balancer how many samples this rank and the whole
job got in that step (a FIFO, so a ``DataLoader`` that prefetches batches ahead
still weights every step by the split it was actually cut with).

Example::

    balancer = px.balance.Balancer(global_batch=128)
    model = px.DataParallel(net, balance=balancer)
    sampler = px.balance.BalancedSampler(len(dataset), balancer, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

__all__ = ["BalancedSampler", "split_sizes"]


def split_sizes(total: int, shares: Sequence[float], minimum: int = 1) -> list[int]:
    """Cut ``total`` into integers proportional to ``shares``, each at least ``minimum``.

    Ranks whose proportional size falls below the minimum are pinned to it and the
    rest is shared among the others (water filling); then floors plus the largest
    remainders (ties to the lower rank), so the result always sums to ``total``.

    Example::

        split_sizes(64, [2.0, 1.0])       # [43, 21]
        split_sizes(10, [0.99, 0.01], 2)  # [8, 2]
    """
    n = len(shares)
    if n == 0:
        raise ValueError("split_sizes: need at least one share")
    if any(not s >= 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"split_sizes: shares must be >= 0 with a positive sum, got {list(shares)}")
    if minimum < 0 or total < n * minimum:
        raise ValueError(f"split_sizes: total {total} cannot give {n} ranks at least {minimum} each")
    pinned: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in pinned]
        rest = total - minimum * len(pinned)
        weight = sum(shares[i] for i in free)
        ideal = [float(minimum)] * n
        for i in free:
            ideal[i] = rest * shares[i] / weight if weight > 0 else rest / len(free)
        low = [i for i in free if ideal[i] < minimum]
        if not low:
            break
        pinned.update(low)
    sizes = [int(x) for x in ideal]
    order = sorted(range(n), key=lambda i: (-(ideal[i] - sizes[i]), i))
    for i in order[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


class BalancedSampler(torch.utils.data.Sampler):
    """A batch sampler: yields this rank's indices of each global batch, cut by ``balancer.sizes``.

    Args:
        data: a dataset (anything with ``len``) or the number of samples.
        balancer: the :class:`~phalanx.balance.Balancer` (same object the model uses).
        shuffle, seed: one permutation per epoch from ``seed + epoch`` (same on every rank).
        drop_last: drop the final partial global batch instead of splitting it.
        accumulation: backward passes per optimizer step; a new split is picked up only at
            step boundaries, so the micro-batches of one step share one split.

    ``len(sampler)`` is the number of (micro-)batches per epoch; it does not depend on the split.
    """

    def __init__(self, data, balancer, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 accumulation: int = 1) -> None:
        n = data if isinstance(data, int) else len(data)
        if n < 1:
            raise ValueError(f"BalancedSampler: the dataset is empty (length {n})")
        if accumulation < 1:
            raise ValueError(f"BalancedSampler: accumulation must be >= 1, got {accumulation}")
        self.num_samples, self.balancer = int(n), balancer
        self.shuffle, self.seed, self.drop_last, self.accumulation = shuffle, int(seed), drop_last, accumulation
        self.epoch = 0
        self.cursor = 0  # samples of this epoch's permutation handed out to the whole job
        self._resume_cursor = 0
        if self.num_samples < balancer.world_size and not drop_last:
            raise ValueError(f"BalancedSampler: {self.num_samples} samples cannot give each of "
                             f"{balancer.world_size} ranks at least one")

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation (call before each epoch, as with DistributedSampler)."""
        self.epoch, self._resume_cursor = int(epoch), 0

    def _plan(self) -> list[int]:
        """Global batch sizes of this epoch's steps (all ``G`` except perhaps the last)."""
        g = self.balancer.global_batch
        full, rest = divmod(self.num_samples, g)
        steps = [g] * full
        if rest and not self.drop_last:
            if rest >= self.balancer.world_size:
                steps.append(rest)
            elif steps:
                steps[-1] += rest  # too few to give every rank one: fold into the previous step
            else:
                raise ValueError(f"BalancedSampler: {rest} samples cannot give each of "
                                 f"{self.balancer.world_size} ranks at least one")
        return steps

    def __len__(self) -> int:
        return len(self._plan())

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=gen).tolist()
        else:
            order = list(range(self.num_samples))
        bal, rank = self.balancer, self.balancer.rank
        bal.clear_pending()  # a new pass: forget counts of batches a previous pass never trained on
        start, self.cursor = 0, 0
        sizes = None
        for i, step_total in enumerate(self._plan()):
            if start + step_total <= self._resume_cursor:  # resumed mid-epoch: skip what was done
                start += step_total
                continue
            if sizes is None or i % self.accumulation == 0:
                sizes = list(bal.sizes)
            cut = sizes if step_total == bal.global_batch else split_sizes(
                step_total, sizes, min(bal.min_batch, step_total // len(sizes)))
            lo = start + sum(cut[:rank])
            mine = order[lo: lo + cut[rank]]
            start += step_total
            self.cursor = start
            bal.push_batch(len(mine), step_total)
            yield mine
        self._resume_cursor = 0

    def state_dict(self) -> dict:
        """Epoch and position; a sampler loaded with it resumes after the last batch handed out."""
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"BalancedSampler.load_state_dict: saved for {state['num_samples']} samples, "
                             f"this dataset has {self.num_samples}")
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        self._resume_cursor = self.cursor = int(state["cursor"])
