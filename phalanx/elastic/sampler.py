"""ElasticSampler: a distributed sampler whose position survives restarts and world-size changes.

Horovod's ElasticSampler, with one change: the position is a count of samples
of this epoch's permutation already consumed by the whole job, so the
remaining samples can be re-split for any world size::

    epoch permutation  p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 p10 p11 | p12 ...
                       \\_______ processed (12) ____________/  \\_ remaining, dealt round-robin:
    world 3:  rank 0 gets p12 p15 …, rank 1 p13 p16 …, rank 2 p14 p17 …

With a local batch of ``G / world`` the union of one step's local batches is
always ``remaining[k*G:(k+1)*G]`` — the same global batch whatever the world
size, so a resumed run sees the same data in the same order.

Example::

    sampler = ElasticSampler(len(ds), shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=G // px.size(), sampler=sampler)
    for x, y in loader:
        ...
        sampler.record_batch(len(x))   # counts len(x) * world samples as processed
"""

from __future__ import annotations

import torch

from phalanx.elastic.state import live_topology

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Shard the unprocessed rest of the epoch over the current ranks; checkpointable.

    ``rank``/``world_size`` default to ``topology``'s, and without one to the live
    job's (or 0/1 before ``init``). Call :meth:`reset` after the world changes
    (``phalanx.elastic.TorchState.sync`` does).
    """

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None, topology=None) -> None:
        if num_samples < 1:
            raise ValueError(f"ElasticSampler(num_samples={num_samples}): need at least one sample")
        self.num_samples, self.shuffle, self.seed = int(num_samples), shuffle, int(seed)
        self.epoch = 0
        self.processed = 0  # samples of this epoch consumed by the whole job
        self._fixed = (rank, world_size)
        self._topology = topology
        self.reset()

    def reset(self) -> None:
        """Re-read rank and world size and re-deal the remaining samples of the epoch."""
        rank, world = self._fixed
        if rank is None or world is None:
            topology = live_topology(self._topology)
            rank, world = (topology.rank, topology.size) if topology is not None else (0, 1)
        self.rank, self.world_size = rank, world
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        remaining = order[self.processed:]
        usable = len(remaining) - len(remaining) % world  # equal shares: every rank runs the same steps
        self.indices = remaining[rank:usable:world]

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed = int(epoch), 0
        self.reset()

    def record_batch(self, local_batch_size: int) -> None:
        """Count one step: ``local_batch_size`` samples on each of ``world_size`` ranks."""
        self.processed += int(local_batch_size) * self.world_size

    def __iter__(self):
        # Iterate from the position at the time iteration starts; record_batch moves the position.
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, sd: dict) -> None:
        if sd["num_samples"] != self.num_samples:
            raise ValueError(f"ElasticSampler: checkpoint has num_samples={sd['num_samples']}, this "
                             f"sampler {self.num_samples}; use the same dataset to resume")
        self.epoch, self.processed, self.seed, self.shuffle = sd["epoch"], sd["processed"], sd["seed"], sd["shuffle"]
        self.reset()
